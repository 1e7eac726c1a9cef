"""Ghost batches (Hoffer et al. 2017): BatchNorm statistics over fixed groups of examples.

Normalising over groups of ``g`` examples, whatever the micro-batch, every device trains
the same model; the price is `GHOST_TRADE_OFF`. The guide: docs/batchnorm.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_adaptive.data import leading_size

__all__ = ["GHOST_TRADE_OFF", "ghost_batches"]

GHOST_TRADE_OFF = (
    "Ghost batches normalise over groups of g examples whatever the micro-batch, so "
    "training is the same on every device; the price: statistics over g examples are "
    "noisier than over a large micro-batch, the running averages move T/g times per "
    "update (choose their momentum for batches of g), and a micro-batch's groups run "
    "one after another."
)

StatefulLoss = Callable[..., Any]
"""``(params, model_state, batch, rng) -> (output, new_model_state)``, the output a
pytree of per-example arrays (losses, or ``(losses, aux)``)."""


def ghost_batches(loss_fn: StatefulLoss, group_size: int) -> StatefulLoss:
    """Runs a stateful per-example loss over consecutive groups of ``group_size`` examples.

    The groups run in order in a ``lax.scan``, group ``i`` with the state group ``i - 1``
    returned (never differentiated) and the key ``fold_in(rng, i)``; a group whose
    ``weights`` are all 0 (padding) leaves the state as it was. With ``weights``, a batch
    must be one group or whole groups (train with ``multiple_of=group_size``); without
    (evaluation), it may end with a shorter group.

    Args:
        loss_fn: ``(params, model_state, batch, rng) -> (output, new_model_state)``,
            every leaf of ``output`` per-example.
        group_size: the examples each BatchNorm statistic is computed over.

    Returns:
        ``(params, model_state, batch, rng, *, weights=None) -> (output,
        new_model_state)``, to use with ``has_state=True``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def loss_fn(params, state, batch, rng):  # a running mean of batch means
        ...     mean = jnp.mean(batch["x"])
        ...     return (batch["x"] - mean) ** 2, {"mean": 0.5 * state["mean"] + 0.5 * mean}
        >>> ghost = ghost_batches(loss_fn, group_size=2)
        >>> batch = {"x": jnp.array([0.0, 2.0, 4.0, 4.0])}
        >>> losses, state = ghost(None, {"mean": 0.0}, batch, jax.random.key(0),
        ...                       weights=jnp.ones(4))
        >>> losses.tolist(), float(state["mean"])  # groups [0, 2] and [4, 4]
        ([1.0, 1.0, 0.0, 0.0], 2.25)
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"{group_size=} must be a positive int.")

    def group_loss(params, state, group, group_weights, key):
        out, new_state = loss_fn(params, state, group, key)
        # The state is never differentiated (the trainer returns it as grad's aux);
        # without this, the backward pass would run through every group's statistics.
        new_state = jax.lax.stop_gradient(new_state)
        if group_weights is not None:
            keep = jnp.any(group_weights != 0)
            new_state = jax.tree.map(lambda new, old: jnp.where(keep, new, old), new_state, state)
        return out, new_state

    def ghost_loss(params, model_state, batch, rng, *, weights=None):
        m = leading_size(batch)
        if weights is not None and m > group_size and m % group_size:
            raise ValueError(
                f"a micro-batch of {m} examples is not a whole number of ghost batches of "
                f"{group_size=}: train with multiple_of={group_size} and a micro-batch "
                f"size that is a multiple of {group_size}."
            )
        groups, full = m // group_size, m - m % group_size

        def grouped(x):
            return x[:full].reshape(groups, group_size, *x.shape[1:])

        def body(state, xs):
            group, group_weights, i = xs
            out, state = group_loss(params, state, group, group_weights, jax.random.fold_in(rng, i))
            return state, out

        group_weights = None if weights is None else grouped(weights)
        xs = (jax.tree.map(grouped, batch), group_weights, jnp.arange(groups))
        state, out = jax.lax.scan(body, model_state, xs)
        out = jax.tree.map(lambda x: x.reshape(full, *x.shape[2:]), out)
        if full < m:  # a shorter last group (or a micro-batch smaller than one)
            rest = jax.tree.map(lambda x: x[full:], batch)
            rest_weights = None if weights is None else weights[full:]
            key = jax.random.fold_in(rng, groups)
            tail, state = group_loss(params, state, rest, rest_weights, key)
            out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, tail)
        return out, state

    return ghost_loss
