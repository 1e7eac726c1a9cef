"""Ghost batches: BatchNorm statistics over fixed groups of examples, whatever the plan.

A model with BatchNorm trained by accumulation normalises each micro-batch by its own
statistics and updates its running averages once per micro-step, so its training
depends on the micro-batch size, and so on the device the job lands on. `ghost_batches`
makes it independent of both: it runs the model's stateful loss over consecutive groups
of ``group_size`` examples (ghost batches, Hoffer et al. 2017), one after the other in a
``lax.scan``, threading the model state through them. Each group is normalised by its
own statistics and updates the running averages once, in the order of the target
batch. With micro-batches that are whole numbers of groups (``multiple_of=group_size``
in the trainer), any micro-batch size cuts the target batch into the same groups and
updates the running averages in the same order: the parameters and ``batch_stats``
after an update are the same, to float tolerance, on any device.

The trade-off against per-micro-batch statistics (`GHOST_TRADE_OFF`):

* statistics over ``g`` examples are noisier than over a large micro-batch (a known
  regulariser; 16 to 128 is the usual range, 32 a common choice);
* the running averages move ``T / g`` times per update (not ``T / m``): their momentum
  is per group, so choose it for batches of ``g`` (``momentum ** (T / g)`` is what is
  left of the old average after an update);
* the groups of a micro-batch run one after another: each layer sees batches of ``g``,
  which keeps a large device less busy than one batch of ``m`` (the activations held
  for the backward pass are the same).
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

    The returned loss cuts its batch into groups of ``group_size`` consecutive examples
    and calls ``loss_fn`` on each, in order, in a ``lax.scan``: group ``i`` gets the
    model state group ``i - 1`` returned (never differentiated, as between micro-steps)
    and the key ``fold_in(rng, i)``. It returns the per-example outputs of all groups,
    concatenated, and the last group's model state. A group whose ``weights`` are all 0
    (the trainer's padding) leaves the model state as it was: padding never moves the
    running averages.

    It takes the trainer's per-example ``weights`` as a keyword (`AdaptiveTrainer`
    passes them to a loss that declares ``weights``); a micro-batch larger than a group
    must then be a whole number of groups, so train with ``multiple_of=group_size`` and
    a ``target_batch_size`` that is a multiple of ``group_size`` (otherwise the last
    group of the target batch mixes real examples and padding). A micro-batch smaller
    than a group (the planner's choice on a device that cannot hold one group) is
    normalised as one group: per-micro-batch statistics, as without ghost batches.
    Called without ``weights`` (evaluation), a batch that is not a whole number of
    groups ends with a shorter group.

    Args:
        loss_fn: ``(params, model_state, batch, rng) -> (output, new_model_state)``,
            every leaf of ``output`` per-example (leading axis the group's examples).
        group_size: the examples each BatchNorm statistic is computed over.

    Returns:
        ``(params, model_state, batch, rng, *, weights=None) -> (output,
        new_model_state)``, to use with ``has_state=True``.

    Raises:
        ValueError: when ``group_size`` is not positive, or when called with
            ``weights`` on a batch larger than ``group_size`` and not a multiple of it.

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

        state, out = jax.lax.scan(
            body,
            model_state,
            (
                jax.tree.map(grouped, batch),
                None if weights is None else grouped(weights),
                jnp.arange(groups),
            ),
        )
        out = jax.tree.map(lambda x: x.reshape(full, *x.shape[2:]), out)
        if full < m:  # a shorter last group (or a micro-batch smaller than one)
            tail, state = group_loss(
                params,
                state,
                jax.tree.map(lambda x: x[full:], batch),
                None if weights is None else weights[full:],
                jax.random.fold_in(rng, groups),
            )
            out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, tail)
        return out, state

    return ghost_loss
