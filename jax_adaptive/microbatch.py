"""Micro-batching inside your own jitted step: the exact full-batch gradient at any size.

`micro_batch_grad` turns a per-example loss into a function that, called inside a
jitted step on a batch of ``T`` examples, returns the gradient of the full-batch mean
loss ``sum_i w_i loss_i / T`` (``w_i = 1`` unless given), computed ``m`` examples at a
time in one in-jit loop (``lax.fori_loop``): the activations of one micro-batch are live
at once, never the batch's. `micro_batch_sum` is the same loop for any function that
returns sums (per-example gradients clipped, moments, counts).

The micro-batch size ``m`` is static and need not divide ``T``. The last micro-batch is
padded with real rows and masked: it is the batch's last ``m`` rows, whose weights are
0 on the rows an earlier micro-batch already counted, and slicing the batch in place
copies no padded batch. A row given a weight of 0 never reaches the gradient: the loss
sees a live row's inputs in its place (`jax_adaptive.step.live_source`), so a masked
NaN or infinity stays out. Unlike ``optax.microbatch`` and Levanter's ``grad_accum`` (a
size that must divide the batch), any size gives the exact gradient, so the size can
be the largest that fits (`jax_adaptive.AdaptiveStep`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_adaptive import checks
from jax_adaptive.data import leading_size
from jax_adaptive.step import (
    Batch,
    Params,
    PerExampleLoss,
    call_loss,
    live_source,
    loss_takes_weights,
    weighted_grad,
)

__all__ = ["MicroBatchGrad", "micro_batch_grad", "micro_batch_sum"]


class MicroBatchGrad(NamedTuple):
    """What `micro_batch_grad`'s function returns for a batch of ``T`` examples.

    Attributes:
        grads: the gradient of ``sum_i w_i loss_i / T`` with respect to the params.
        loss: ``sum_i w_i loss_i / T``, the full-batch mean loss.
        aux: each aux metric's ``sum_i w_i aux_i / T``.
        sums: the weighted sums themselves (``"loss"`` and each aux metric), in float32:
            what to add up across batches or devices.
        model_state: the model state after the last micro-batch (``()`` without
            ``has_state``).
    """

    grads: Params
    loss: jax.Array
    aux: dict[str, jax.Array]
    sums: dict[str, jax.Array]
    model_state: Any


def _check_size(micro_batch_size: Any) -> int:
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise TypeError(f"{micro_batch_size=} must be an int (it is static).")
    if micro_batch_size < 1:
        raise ValueError(f"{micro_batch_size=} must be positive.")
    return micro_batch_size


def _weights_for(weights: Any, total: int) -> jax.Array:
    if weights is None:
        return jnp.ones((total,), jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    if weights.shape != (total,):
        raise ValueError(
            f"weights must have shape ({total},), one per example; got {weights.shape}."
        )
    return weights


def _loop(
    body: Callable[[Any, Batch, jax.Array, jax.Array], Any],
    carry: Any,
    batch: Batch,
    weights: jax.Array,
    micro_batch_size: int,
) -> Any:
    """Folds ``body(carry, micro_batch, micro_weights, offset)`` over the micro-batches.

    Micro-batch ``i`` is the ``m`` rows from ``min(i * m, T - m)``; its weights are 0 on
    rows before ``i * m`` (counted by micro-batch ``i - 1``), so every row counts once.
    Its rows are gathered by `jax_adaptive.step.live_source`: a row of weight 0 holds a
    live row's inputs.
    """
    total = leading_size(batch)
    m = min(micro_batch_size, total)  # a size above T is the whole batch
    steps = math.ceil(total / m)
    source = live_source(weights)

    def gather(rows: jax.Array) -> Batch:
        return jax.tree.map(lambda x: jnp.asarray(x).at[rows].get(mode="promise_in_bounds"), batch)

    if steps == 1:
        return body(carry, gather(source), weights, jnp.int32(0))
    rows = jnp.arange(m, dtype=jnp.int32)

    def step(i: jax.Array, carry: Any) -> Any:
        first = i * m  # the first row not yet counted
        start = jnp.minimum(first, total - m)
        own = lax.dynamic_slice_in_dim(weights, start, m)  # each row's own weight
        micro_weights = jnp.where(start + rows >= first, own, 0.0)
        return body(carry, gather(lax.dynamic_slice_in_dim(source, start, m)), micro_weights, start)

    return lax.fori_loop(0, steps, step, carry)


def micro_batch_sum(
    fn: Callable[[Batch, jax.Array, jax.Array], Any], micro_batch_size: int
) -> Callable[..., Any]:
    """Sums ``fn`` over the micro-batches of a batch, in one in-jit loop.

    ``fn(micro_batch, weights, offset)`` gets ``micro_batch_size`` rows of the batch,
    their weights (0 on a row it must not count: the padding of the last micro-batch)
    and the index of its first row; it returns a pytree of weighted sums over its rows.
    The result is the sum of those pytrees: what ``fn`` would return for the whole
    batch, with the activations of one micro-batch live at a time.

    Args:
        fn: ``(micro_batch, weights, offset) -> pytree`` of sums weighted by ``weights``.
        micro_batch_size: rows per call of ``fn`` (static); any positive int.

    Returns:
        ``(batch, weights=None) -> pytree``: the sum over the batch (``weights`` is one
        per example, 1 by default).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def clipped_grad_sum(batch, weights, offset):  # per-example gradients, clipped
        ...     grads = jax.vmap(jax.grad(lambda w, x: (w * x) ** 2), (None, 0))(1.0, batch)
        ...     return jnp.sum(weights * jnp.clip(grads, -5.0, 5.0))
        >>> summed = jax.jit(micro_batch_sum(clipped_grad_sum, 2))
        >>> float(summed(jnp.arange(5.0)))  # clip(2 x**2, -5, 5) summed over x = 0..4
        17.0
    """
    m = _check_size(micro_batch_size)

    def summed(batch: Batch, weights: Any = None) -> Any:
        total = leading_size(batch)
        weights = _weights_for(weights, total)
        micro = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((min(m, total), *x.shape[1:]), x.dtype), batch
        )
        shapes = jax.eval_shape(
            fn, micro, jax.ShapeDtypeStruct((min(m, total),), jnp.float32), jnp.int32(0)
        )
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(acc: Any, micro_batch: Batch, micro_weights: jax.Array, offset: jax.Array):
            return jax.tree.map(jnp.add, acc, fn(micro_batch, micro_weights, offset))

        return _loop(body, zeros, batch, weights, m)

    return summed


def micro_batch_grad(
    loss_fn: PerExampleLoss,
    micro_batch_size: int,
    *,
    has_aux: bool = False,
    has_state: bool = False,
) -> Callable[..., MicroBatchGrad]:
    """The exact full-batch mean gradient of a per-example loss, ``m`` examples at a time.

    For use inside your own jitted step: the returned function computes, in one in-jit
    loop over micro-batches of ``micro_batch_size``, the gradient of
    ``sum_i w_i loss_i / T`` over the ``T`` examples of its batch. It equals
    ``jax.grad`` of the plain full-batch mean loss to float tolerance for any size,
    including one that does not divide ``T``; only the memory differs.

    The loss is the trainer's (`jax_adaptive.AdaptiveTrainer`): ``(params, batch, rng) ->
    losses[m]``, one per example (with ``has_aux``: ``(losses, aux)``, aux a dict of
    per-example arrays; with ``has_state``: ``(params, model_state, batch, rng) ->
    (that, new_model_state)``, the state threaded through the micro-batches in order,
    as in every accumulation scheme: BatchNorm statistics are per micro-batch). A loss
    that declares a keyword ``weights`` gets each micro-batch's weights (0 on padding).
    Each micro-batch gets the key ``fold_in(rng, offset)`` (``offset`` its first row),
    or None when ``rng`` is None. An aux metric may not be named ``"loss"`` (it would
    replace the loss): the first trace raises a ValueError, as the trainer does.

    Args:
        loss_fn: the per-example loss.
        micro_batch_size: examples per micro-batch (static); any positive int, a size
            above the batch's ``T`` is ``T``.
        has_aux: ``loss_fn`` returns ``(losses, aux)``.
        has_state: ``loss_fn`` takes and returns a model state.

    Returns:
        ``(params, batch, rng=None, *, weights=None, model_state=()) -> MicroBatchGrad``;
        ``weights`` (one per example, 1 by default) weights each loss in the sum.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> loss = lambda w, batch, rng: (batch["x"] * w - batch["y"]) ** 2
        >>> batch = {"x": jnp.arange(5.0), "y": jnp.ones(5)}
        >>> out = jax.jit(micro_batch_grad(loss, 2))(2.0, batch)  # 3 micro-batches
        >>> full = jax.grad(lambda w: loss(w, batch, None).mean())(2.0)
        >>> bool(jnp.allclose(out.grads, full)), float(out.loss)
        (True, 17.0)
    """
    m = _check_size(micro_batch_size)
    takes_weights = loss_takes_weights(loss_fn)
    loss_fn = checks.refuse_aux_named_loss(loss_fn, has_aux, has_state)

    def grad_fn(
        params: Params,
        batch: Batch,
        rng: jax.Array | None = None,
        *,
        weights: Any = None,
        model_state: Any = (),
    ) -> MicroBatchGrad:
        total = leading_size(batch)
        weights = _weights_for(weights, total)

        def body(carry: Any, micro_batch: Batch, micro_weights: jax.Array, offset: jax.Array):
            grads, sums, state = carry
            key = None if rng is None else jax.random.fold_in(rng, offset)

            micro_grads, micro_sums, new_state = weighted_grad(
                loss_fn, has_aux, has_state, takes_weights, params, state, micro_batch, key,
                micro_weights, total,
            )  # fmt: skip
            grads = jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads, micro_grads)
            sums = {name: sums[name] + value for name, value in micro_sums.items()}
            return grads, sums, new_state

        # Sums start at zero with the names the loss returns: trace it once for them.
        micro = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((min(m, total), *jnp.shape(x)[1:]), jnp.result_type(x)),
            batch,
        )
        _, aux, _ = jax.eval_shape(
            lambda p, s, b, r: call_loss(loss_fn, has_aux, has_state, p, s, b, r),
            params, model_state, micro, rng,
        )  # fmt: skip
        if not isinstance(aux, dict):
            raise TypeError(f"aux must be a dict of per-example metrics, got {type(aux).__name__}.")
        sums = {name: jnp.zeros((), jnp.float32) for name in ("loss", *aux)}
        # The gradient accumulates in float32 at least: bfloat16 sums drift.
        grads = jax.tree.map(
            lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(jnp.result_type(p), jnp.float32)),
            params,
        )
        grads, sums, state = _loop(body, (grads, sums, model_state), batch, weights, m)
        grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
        means = {name: value / total for name, value in sums.items()}
        loss = means.pop("loss")
        return MicroBatchGrad(grads, loss, means, sums, state)

    return grad_fn
