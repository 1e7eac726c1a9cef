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
    "noisier than over a large micro-batch, and the running averages move T/g times per "
    "update (choose their momentum for batches of g). A micro-batch's groups run side "
    "by side, as one batch, when the model's state is running averages (BatchNorm's); a "
    "state the outputs read, or one not updated as m * old + f(group), runs them one "
    "after another, each layer on batches of g."
)

StatefulLoss = Callable[..., Any]
"""``(params, model_state, batch, rng) -> (output, new_model_state)``, the output a
pytree of per-example arrays (losses, or ``(losses, aux)``)."""


def ghost_batches(
    loss_fn: StatefulLoss, group_size: int, *, sequential: bool = False
) -> StatefulLoss:
    """Runs a stateful per-example loss over consecutive groups of ``group_size`` examples.

    Group ``i`` gets the key ``fold_in(rng, i)``, its own statistics, and moves the state
    as if the groups ran in order, each with the state group ``i - 1`` returned (never
    differentiated); a group whose ``weights`` are all 0 (padding) leaves the state as it
    was. With ``weights``, a batch must be one group or whole groups (train with
    ``multiple_of=group_size``); without (evaluation), it may end with a shorter group.

    The groups run side by side, one ``vmap``ped batch through every layer, when the state
    is running averages, as BatchNorm's in training (linen, NNX): outputs that do not read
    the state, and every leaf floating and updated as ``new = m * old + f(group)`` with
    ``m`` independent of the state. Each group's ``m`` and ``f`` are read from its update
    at two states (the model runs once; only the state's arithmetic sees both), and the
    state after the groups is composed as in order: ``m**n * old + sum_i m**(n-1-i) *
    f_i`` for a constant ``m``. A loss whose outputs read the state (batch
    renormalisation), with an integer leaf, or whose update's derivative in the state
    depends on the state (``max(old, x)``; not seen behind a ``stop_gradient``) is found
    when traced and runs the groups one after another in a ``lax.scan``, as
    ``sequential=True`` always does.

    Args:
        loss_fn: ``(params, model_state, batch, rng) -> (output, new_model_state)``,
            every leaf of ``output`` per-example.
        group_size: the examples each BatchNorm statistic is computed over.
        sequential: run the groups one after another whatever the state.

    Returns:
        ``(params, model_state, batch, rng, *, weights=None) -> (output,
        new_model_state)``, to use with ``has_state=True``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def loss_fn(params, state, batch, rng):  # a running mean of batch means
        ...     mean = jnp.mean(batch["x"])
        ...     return (batch["x"] - mean) ** 2, {"mean": 0.5 * state["mean"] + 0.5 * mean}
        >>> ghost = ghost_batches(loss_fn, group_size=2)  # groups side by side
        >>> batch = {"x": jnp.array([0.0, 2.0, 4.0, 4.0])}
        >>> losses, state = ghost(None, {"mean": 0.0}, batch, jax.random.key(0),
        ...                       weights=jnp.ones(4))
        >>> losses.tolist(), float(state["mean"])  # groups [0, 2] and [4, 4], in order
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

    def in_order(params, state, groups, group_weights, keys):
        def body(state, xs):
            out, state = group_loss(params, state, *xs)
            return state, out

        state, out = jax.lax.scan(body, state, (groups, group_weights, keys))
        return out, state

    def runs_side_by_side(params, state, group, key) -> bool:
        """Whether the outputs and the update's derivative ignore the state: traced, not run."""
        if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(state)):
            return False  # an integer leaf (a step counter) has no momentum to read
        two = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype), state)

        def probe(s):  # the derivative is blind behind a stop_gradient (NNX's BatchNorm)
            ones = jax.tree.map(jnp.ones_like, s)
            (out, _), (_, slope) = jax.jvp(lambda s: loss_fn(params, s, group, key), (s,), (ones,))
            return out, slope

        try:  # vmap over two states refuses an unbatched result that depends on them
            jax.eval_shape(jax.vmap(probe, out_axes=None), two)
        except ValueError:
            return False
        return True

    def affine(params, like, group, key):
        """The output and the update ``new = m * old + f`` as ``(f, m)``, for one group.

        The model runs once: only the state's own arithmetic sees the two states, 0 and a
        power of two large enough that ``m`` comes out to float precision.
        """

        def two(x):
            big = 2.0 ** (jnp.finfo(x.dtype).maxexp // 2)
            return jnp.stack([jnp.zeros_like(x), jnp.full_like(x, big)])

        states = jax.tree.map(two, like)
        run = jax.vmap(lambda s: loss_fn(params, s, group, key), out_axes=(None, 0))
        out, new = run(states)
        f = jax.tree.map(lambda new: new[0], new)
        m = jax.tree.map(lambda new, s: (new[1] - new[0]) / s[1], new, states)
        return out, jax.lax.stop_gradient((f, m))

    def side_by_side(params, state, groups, group_weights, keys):
        """The groups at once; the state moved as the groups in order would move it."""
        run = jax.vmap(affine, in_axes=(None, None, 0, 0))
        out, (f, m) = run(params, state, groups, keys)
        keep = None if group_weights is None else jnp.any(group_weights != 0, axis=1)

        def compose(old, f, m):
            if keep is not None:  # a padding group is m = 1, f = 0
                k = keep.reshape(-1, *[1] * old.ndim)
                f, m = jnp.where(k, f, 0), jnp.where(k, m, 1)
            after = jnp.cumprod(m[::-1], axis=0)[::-1]  # after[i] = m_i * ... * m_(n-1)
            later = jnp.concatenate([after[1:], jnp.ones_like(m[:1])])
            return after[0] * old + jnp.sum(later * f, axis=0)

        return out, jax.tree.map(compose, state, f, m)

    def ghost_loss(params, model_state, batch, rng, *, weights=None):
        m = leading_size(batch)
        if weights is not None and m > group_size and m % group_size:
            raise ValueError(
                f"a micro-batch of {m} examples is not a whole number of ghost batches of "
                f"{group_size=}: train with multiple_of={group_size} and a micro-batch "
                f"size that is a multiple of {group_size}."
            )
        model_state = jax.tree.map(jnp.asarray, model_state)  # a Python float has no dtype
        groups, full = m // group_size, m - m % group_size
        # whole groups as [groups, group_size, ...], then a shorter last group (or a
        # micro-batch smaller than one) as one group [1, m - full, ...]
        spans = ([(0, full, groups)] if groups else []) + ([(full, m, 1)] if full < m else [])

        def part(start, stop, n):
            def cut(x):
                return x[start:stop].reshape(n, -1, *x.shape[1:])

            first = start // group_size
            keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, first + jnp.arange(n))
            return jax.tree.map(cut, batch), jax.tree.map(cut, weights), keys

        parts = [part(*span) for span in spans]
        first = jax.tree.map(lambda x: x[0], parts[0][0])
        fast = not sequential and runs_side_by_side(params, model_state, first, parts[0][2][0])
        outs, state = [], model_state
        for part in parts:
            if fast:
                out, state = side_by_side(params, state, *part)
            else:
                out, state = in_order(params, state, *part)
            outs.append(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out))
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs), state

    ghost_loss.ghost_batch_size = group_size  # what a trainer's multiple_of follows
    return ghost_loss
