"""Micro-batching inside your own jitted step: the exact full-batch gradient at any size.

`micro_batch_grad` computes the gradient of ``sum_i w_i loss_i / T`` ``m`` examples at a
time in one in-jit loop (``lax.fori_loop``), for any ``m``: the last micro-batch is the
batch's last ``m`` rows, those already counted weighted 0 (no padded copy). A row of
weight 0 never reaches the gradient (`jax_adaptive.step.live_source`). `micro_batch_sum`
is the same loop for a function returning sums. The guide: docs/own-loop.md.
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
        grads: the gradient of ``loss`` with respect to the params.
        loss: ``sum_i w_i loss_i / T``, the full-batch mean loss.
        aux: each aux metric's ``sum_i w_i aux_i / T``.
        sums: the float32 weighted sums (``"loss"`` and each aux metric), to add up
            across batches or devices.
        model_state: the model state after the last micro-batch (``()`` without one).
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


def _prepare(batch: Batch, weights: Any, m: int) -> tuple[int, jax.Array, Any]:
    """The batch's ``T``, its weights checked (1 by default), and one micro-batch's structs."""
    total = leading_size(batch)
    if weights is None:
        weights = jnp.ones((total,), jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    if weights.shape != (total,):
        raise ValueError(
            f"weights must have shape ({total},), one per example; got {weights.shape}."
        )
    micro = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((min(m, total), *jnp.shape(x)[1:]), jnp.result_type(x)),
        batch,
    )
    return total, weights, micro


def _loop(
    body: Callable[[Any, Batch, jax.Array, jax.Array], Any],
    carry: Any,
    batch: Batch,
    weights: jax.Array,
    micro_batch_size: int,
    all_live: bool,
) -> Any:
    """Folds ``body(carry, micro_batch, micro_weights, offset)`` over the micro-batches.

    Micro-batch ``i`` is the ``m`` rows from ``min(i * m, T - m)``, weighted 0 before
    ``i * m`` (counted already); unless ``all_live`` (no weights given), gathered by
    `live_source`.
    """
    total = leading_size(batch)
    m = min(micro_batch_size, total)  # a size above T is the whole batch
    steps = math.ceil(total / m)
    source = None if all_live else live_source(weights)

    def cut(start: Any, length: int) -> Batch:
        """The rows from ``start``, each a live row's inputs (`live_source`)."""
        if source is None:
            return jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, start, length), batch)
        rows = lax.dynamic_slice_in_dim(source, start, length)
        return jax.tree.map(lambda x: jnp.asarray(x).at[rows].get(mode="promise_in_bounds"), batch)

    if steps == 1:
        return body(carry, batch if source is None else cut(0, total), weights, jnp.int32(0))
    rows = jnp.arange(m, dtype=jnp.int32)

    def step(i: jax.Array, carry: Any) -> Any:
        first = i * m  # the first row not yet counted
        start = jnp.minimum(first, total - m)
        own = lax.dynamic_slice_in_dim(weights, start, m)  # each row's own weight
        micro_weights = jnp.where(start + rows >= first, own, 0.0)
        return body(carry, cut(start, m), micro_weights, start)

    return lax.fori_loop(0, steps, step, carry)


def micro_batch_sum(
    fn: Callable[[Batch, jax.Array, jax.Array], Any], micro_batch_size: int
) -> Callable[..., Any]:
    """Sums ``fn`` over the micro-batches of a batch, in one in-jit loop.

    Args:
        fn: ``(micro_batch, weights, offset) -> pytree`` of sums over the micro-batch's
            rows weighted by ``weights`` (0 on a row not to count), ``offset`` its first
            row's index.
        micro_batch_size: rows per call of ``fn`` (static); any positive int.

    Returns:
        ``(batch, weights=None) -> pytree``: the sum over the batch (``weights`` one per
        example, 1 by default).

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
        all_live = weights is None
        total, weights, micro = _prepare(batch, weights, m)
        shapes = jax.eval_shape(
            fn, micro, jax.ShapeDtypeStruct((min(m, total),), jnp.float32), jnp.int32(0)
        )
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(acc: Any, micro_batch: Batch, micro_weights: jax.Array, offset: jax.Array):
            return jax.tree.map(jnp.add, acc, fn(micro_batch, micro_weights, offset))

        return _loop(body, zeros, batch, weights, m, all_live)

    return summed


def micro_batch_grad(
    loss_fn: PerExampleLoss,
    micro_batch_size: int,
    *,
    has_aux: bool = False,
    has_state: bool = False,
) -> Callable[..., MicroBatchGrad]:
    """The exact full-batch mean gradient of a per-example loss, ``m`` examples at a time.

    Called inside your jitted step, it equals ``jax.grad`` of the full-batch mean loss to
    float tolerance for any size; only the memory differs. Each micro-batch gets the key
    ``fold_in(rng, offset)`` (None without ``rng``); a loss declaring a keyword
    ``weights`` gets the micro-batch's weights; an aux metric named ``"loss"`` is refused.

    Args:
        loss_fn: the per-example loss, as `jax_adaptive.AdaptiveTrainer` takes it.
        micro_batch_size: examples per micro-batch (static); any positive int, a size
            above the batch's ``T`` is ``T``.
        has_aux: ``loss_fn`` returns ``(losses, aux)``.
        has_state: ``loss_fn`` takes and returns a model state, threaded in order.

    Returns:
        ``(params, batch, rng=None, *, weights=None, model_state=()) -> MicroBatchGrad``,
        ``weights`` one per example (1 by default).

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
        all_live = weights is None
        total, weights, micro = _prepare(batch, weights, m)

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
        grads, sums, state = _loop(body, (grads, sums, model_state), batch, weights, m, all_live)
        grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
        means = {name: value / total for name, value in sums.items()}
        loss = means.pop("loss")
        return MicroBatchGrad(grads, loss, means, sums, state)

    return grad_fn
