"""Flax NNX's ``nnx.value_and_grad``, micro-batched: the full batch's loss, aux and gradient.

`micro_batch_value_and_grad` replaces ``nnx.value_and_grad`` inside an NNX step (a
batch-mean loss, or a ratio loss with its ``normalizer``; call-time ``rngs``; BatchNorm
statistics over ghost batches) and computes them ``m`` examples at a time. Under
`jax_adaptive.AdaptiveNnxStep` each call records what it returned in the step's
`StepTrace` (the gradient program) or returns what was recorded (the update program).
The guide: docs/flax.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.graph import is_graph_node

from jax_adaptive import checks
from jax_adaptive.data import leading_size
from jax_adaptive.ghost import over_groups
from jax_adaptive.normalizer import Normalizer, denominator

__all__ = ["GHOST_DEFAULT", "micro_batch_value_and_grad"]

log = logging.getLogger("jax_adaptive")

GHOST_DEFAULT = 32
"""The examples BatchNorm's statistics are computed over by default: the largest divisor
of this that divides the batch, at least 8 (as the command line's ghost batches)."""

WHOLE_BATCH = (
    "micro_batch_value_and_grad was traced outside ja.AdaptiveNnxStep with no "
    "micro_batch_size, so it computes the whole batch at once, as nnx.value_and_grad: "
    "decorate the step with @ja.AdaptiveNnxStep instead of @nnx.jit (or pass "
    "micro_batch_size)."
)


class Record(NamedTuple):
    """One call of `micro_batch_value_and_grad` in a step: what it returned and wrote."""

    value: Any  # the loss, or (loss, aux)
    grads: Any  # the gradient, an nnx.State
    rest: Any  # the objects' other state after it (BatchNorm statistics, Rngs counts)


class StepTrace:
    """What a step traced by `AdaptiveNnxStep` asks of its `micro_batch_value_and_grad` calls.

    ``size``: the planned micro-batch (None: the whole batch). Without ``replay`` each call
    computes and appends its `Record` (and its normalizer's check) here; with ``replay``
    each call returns the next given record instead of computing.
    """

    def __init__(self, size: int | None, replay: tuple[Record, ...] | None = None):
        self.size, self.replay = size, replay
        self.records: list[Record] = []
        self.checks: list[jax.Array] = []  # [the batch's denominator, a micro-batch's was bad]
        self.ghost_sizes: set[int] = set()

    def next_replay(self) -> Record:
        assert self.replay is not None
        if len(self.records) == len(self.replay):
            raise RuntimeError(
                "the step called micro_batch_value_and_grad more times than when it was "
                "traced for its gradient: a step must make the same calls on every trace."
            )
        record = self.replay[len(self.records)]
        self.records.append(record)
        return record


_TOLD: set[int] = set()  # the ghost batches chosen for the user, said once each

_TRACE: contextvars.ContextVar[StepTrace | None] = contextvars.ContextVar(
    "jax_adaptive_step_trace", default=None
)


@contextlib.contextmanager
def tracing(trace: StepTrace) -> Iterator[StepTrace]:
    token = _TRACE.set(trace)
    try:
        yield trace
    finally:
        _TRACE.reset(token)


def batch_position(args: tuple[Any, ...], batch_argnum: int | None, what: str) -> int:
    """``batch_argnum``, or the one argument that is not an NNX object."""
    if batch_argnum is not None:
        if not 0 <= batch_argnum < len(args):
            raise ValueError(f"{batch_argnum=} is not one of the {len(args)} arguments of {what}.")
        return batch_argnum
    arrays = [i for i, a in enumerate(args) if not is_graph_node(a)]
    if len(arrays) != 1:
        raise ValueError(
            f"{what} has {len(arrays)} arguments that are not NNX objects (positions "
            f"{arrays}): say which is the batch with batch_argnum."
        )
    return arrays[0]


def _combine(aux: Any, size: int, weight: jax.Array) -> Any:
    """An aux leaf of one micro-batch: per example (kept), or a scalar (``weight`` of it)."""

    def leaf(x: jax.Array) -> jax.Array:
        if jnp.ndim(x) == 0:
            return weight * x
        if jnp.shape(x)[0] != size:
            raise ValueError(
                f"an aux leaf of shape {jnp.shape(x)} is neither a scalar nor per example "
                f"(a leading axis of the micro-batch's {size})."
            )
        return x

    return jax.tree.map(leaf, aux)


GhostSize = int | Literal["auto", "micro_batch"] | None


def _ghost_size(ghost_batch_size: GhostSize, rest: Any, total: int) -> int | None:
    """The ghost batch in force: None when each micro-batch keeps its own statistics."""
    if isinstance(ghost_batch_size, int):
        return ghost_batch_size
    if ghost_batch_size == "micro_batch" or not jax.tree.leaves(nnx.state(rest, nnx.BatchStat)):
        return None
    size = math.gcd(GHOST_DEFAULT, total)
    if size < 8:
        raise ValueError(
            f"the model has BatchNorm statistics and a batch of {total} holds no ghost batches "
            f"of 8 or more (the largest divisor of {GHOST_DEFAULT} that divides it is {size}): "
            "pass ghost_batch_size=g for a g that divides the batch, or "
            "ghost_batch_size='micro_batch' for each micro-batch's own statistics (the "
            "training then depends on the device)."
        )
    return size


def micro_batch_value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int = 0,
    wrt: nnx.filterlib.Filter = nnx.Param,
    micro_batch_size: int | None = None,
    ghost_batch_size: GhostSize = "auto",
    normalizer: Normalizer | None = None,
    batch_argnum: int | None = None,
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of a batch-mean loss, computed ``m`` examples at a time.

    The returned function takes ``loss_fn``'s arguments and returns what
    ``nnx.value_and_grad(loss_fn, argnums, has_aux)`` would on the whole batch: the
    batch's loss, each aux leaf per example in order (a scalar leaf: weighted as the
    loss), and the gradient, exactly (a last micro-batch of ``T mod m`` included). The NNX
    objects' other state (BatchNorm statistics, ``nnx.Rngs`` counts) goes through the
    micro-batches in order, and is written back into them.

    A loss divided by a count the data decides (real tokens: ``sum(l * w) / sum(w)``)
    needs its ``normalizer``: micro-batch ``k`` then weighs ``d_k / D``, its count over the
    batch's, instead of its share of the examples, and one whose count is 0 (padding
    only) is selected out. Without it such a loss trains differently at every plan.

    Args:
        loss_fn: ``(model, ..., batch, ...) -> loss`` (or ``(loss, aux)``): the mean over
            the batch's examples, as Flax's examples write it, or over what
            ``normalizer`` counts.
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        argnums: the argument differentiated (an NNX object).
        wrt: the filter of its variables differentiated.
        micro_batch_size: examples per micro-batch (static); None: the size
            `AdaptiveNnxStep` planned, or the whole batch outside one (with a warning).
        ghost_batch_size: BatchNorm over consecutive groups of this many examples, as in
            order (side by side where that is proven exact: `jax_adaptive.ghost_batches`),
            whatever the micro-batch (the batch and the micro-batch whole groups).
            ``"auto"``: for a model with ``nnx.BatchStat`` variables, the largest divisor
            of `GHOST_DEFAULT` that divides the batch (at least 8), so every device trains
            the same model; ``"micro_batch"``: each micro-batch's own statistics.
        normalizer: ``fn(batch) -> scalar``, what the loss divides by
            (``lambda batch: batch["weights"].sum()``); None: the number of examples.
        batch_argnum: the batch's position; None: the one argument not an NNX object.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        >>> def loss_fn(model, batch):  # a mean over the real (weighted) examples
        ...     losses = optax.softmax_cross_entropy_with_integer_labels(
        ...         model(batch["x"]), batch["y"])
        ...     return (losses * batch["w"]).sum() / batch["w"].sum()
        >>> batch = {"x": jnp.arange(15.0).reshape(5, 3), "y": jnp.zeros(5, jnp.int32),
        ...          "w": jnp.array([1.0, 1.0, 0.0, 0.0, 1.0])}  # rows 2, 3: padding
        >>> grad_fn = micro_batch_value_and_grad(
        ...     loss_fn, micro_batch_size=2, normalizer=lambda b: b["w"].sum())
        >>> loss, grads = grad_fn(model, batch)  # micro-batches of 2, 2 (padding) and 1
        >>> full, full_grads = nnx.value_and_grad(loss_fn)(model, batch)
        >>> bool(jnp.allclose(loss, full)), bool(jnp.allclose(grads["kernel"][...],
        ...                                                   full_grads["kernel"][...]))
        (True, True)
    """
    if micro_batch_size is not None:
        checks.positive_int("micro_batch_size", micro_batch_size)
    if isinstance(ghost_batch_size, int) or ghost_batch_size not in ("auto", "micro_batch", None):
        checks.positive_int("ghost_batch_size", ghost_batch_size)
    checks.check_normalizer(normalizer)

    def value_and_grad(*args: Any) -> Any:
        trace = _TRACE.get()
        if trace is None and micro_batch_size is None:
            warnings.warn(WHOLE_BATCH, stacklevel=2)
        b = batch_position(args, batch_argnum, "the loss")
        if not is_graph_node(args[argnums]) or argnums == b:
            raise ValueError(f"{argnums=} must be an NNX object, not the batch.")
        nodes = {i: a for i, a in enumerate(args) if i != b}
        if trace is not None and trace.replay is not None:  # the step's update: as computed
            record = trace.next_replay()
            nnx.update(nodes, record.rest)
            return record.value, record.grads
        batch, total = args[b], leading_size(args[b])
        planned = None if trace is None else trace.size
        m = min(micro_batch_size or planned or total, total)
        diff = _diff_of(argnums, wrt)
        graphdef, params, rest = nnx.split(nodes, diff, ...)
        ghost = _ghost_size(ghost_batch_size, rest, total)
        if ghost is not None and (total % ghost or m % ghost):
            raise ValueError(
                f"a batch of {total} in micro-batches of {m} is not whole ghost batches of "
                f"ghost_batch_size={ghost}: plan with multiple_of={ghost} and a batch "
                f"that is a multiple of {ghost}."
            )
        if ghost is not None and ghost_batch_size in ("auto", None) and ghost not in _TOLD:
            _TOLD.add(ghost)
            log.info(
                "BatchNorm statistics over ghost batches of %d examples, the same on every "
                "device (ghost_batch_size='micro_batch': each micro-batch's own)",
                ghost,
            )
        if trace is not None and ghost is not None:
            trace.ghost_sizes.add(ghost)
        whole = None if normalizer is None else denominator(normalizer, batch)

        def call(params: Any, rest: Any, part: Any) -> tuple[Any, Any]:
            """``loss_fn`` on ``part`` (rows of the batch); its output, the new state."""
            objects = nnx.merge(graphdef, params, rest, copy=True)
            out = loss_fn(*(part if i == b else objects[i] for i in range(len(args))))
            loss, aux = out if has_aux else (out, ())
            return (loss, aux), nnx.split(objects, diff, ...)[2]

        def micro(params: Any, rest: Any, part: Any) -> tuple[Any, Any]:
            """A micro-batch's mean loss, its (aux, state): its ghost batches as in order."""
            size, g = leading_size(part), ghost or leading_size(part)
            groups = jax.tree.map(lambda x: x.reshape(size // g, g, *x.shape[1:]), part)
            # ghost_batches' own grouping: side by side where the state's update is proven
            # affine (BatchNorm's running averages), in order otherwise (Dropout's keys)
            (losses, aux), rest = over_groups(
                lambda rest, rows: call(params, rest, rows), rest, groups
            )
            aux = jax.tree.map(lambda x: _flat(x) if x.ndim > 1 else x.mean(), aux)
            return losses.mean(), (aux, rest)

        grad_micro = jax.value_and_grad(micro, has_aux=True)

        def run(carry: Any, part: Any) -> tuple[Any, Any]:
            grads, loss, bad, rest = carry
            size = leading_size(part)
            (part_loss, (aux, rest)), part_grads = grad_micro(params, rest, part)
            if whole is None:  # each example weighs the same
                w, live = size / total, None
            else:  # the micro-batch's count over the batch's; a count of 0 selected out
                count = denominator(normalizer, part)
                w, live = count / whole, count > 0
                bad = bad | ~jnp.isfinite(count) | (count < 0)

            def add(acc: jax.Array, x: jax.Array) -> jax.Array:
                x = w * x if live is None else jnp.where(live, w * x, 0)
                return acc + x.astype(acc.dtype)

            grads = jax.tree.map(add, grads, part_grads)
            weight = w if live is None else jnp.where(live, w, 0)
            return (grads, add(loss, part_loss), bad, rest), _combine(aux, size, weight)

        zeros = jax.tree.map(jnp.zeros_like, params)
        carry = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), bool), rest)
        (grads, loss, bad, rest), aux = _fold(run, carry, batch, m)
        if trace is not None and whole is not None:
            trace.checks.append(jnp.stack([whole, bad.astype(jnp.float32)]))
        nnx.update(nodes, rest)
        value = (loss, aux) if has_aux else loss
        if trace is not None:
            trace.records.append(Record(value, grads[argnums], rest))
        return value, grads[argnums]

    return value_and_grad


def _fold(run: Callable[[Any, Any], tuple[Any, Any]], carry: Any, batch: Any, m: int) -> Any:
    """``run(carry, rows) -> (carry, aux)`` over the batch's micro-batches of ``m`` in order.

    Returns the last carry and the aux of every row in order (scalar leaves summed).
    """
    total = leading_size(batch)
    turns, last = -(-total // m), total - (total - 1) // m * m  # the last turn's rows
    if turns == 1:
        return run(carry, batch)

    # One loop whose last turn takes its rows at a static offset in a branch: a last turn
    # after the loop holds its own temporaries beside the loop's, and a loop without the
    # branch held more (measured, 256 examples: 723 kB at m = 86 with the turn after the
    # loop against 402 kB; 409 kB at m = 64 without the branch against 304 kB), so the
    # peak would not follow m.
    # Each turn writes its rows' aux into one buffer of the batch's rows: stacking the
    # turns' aux and slicing off the last turn's padding held the aux twice (measured: a
    # language model's logits of 512 sequences, 4.2 MB, took 8.7 MB at m = 3 against
    # 4.5 MB at m = 2, which divides 512).
    rows = jax.tree.map(lambda x: _rows(x, 0, m), batch)
    _, shapes = jax.eval_shape(run, carry, rows)
    aux = jax.tree.map(
        lambda s: jnp.zeros((total, *s.shape[1:]) if s.ndim else (), s.dtype), shapes
    )

    def turn(state: Any, i: jax.Array) -> tuple[Any, None]:
        def part(start: Any, size: int) -> tuple[Any, Any]:
            carry, aux = state
            carry, part_aux = run(carry, jax.tree.map(lambda x: _rows(x, start, size), batch))
            return carry, jax.tree.map(functools.partial(_written, start=start), aux, part_aux)

        final = functools.partial(part, total - last, last)
        return jax.lax.cond(i < turns - 1, lambda: part(i * m, m), final), None

    (carry, aux), _ = jax.lax.scan(turn, (carry, aux), jnp.arange(turns))
    return carry, aux


def _written(out: jax.Array, x: jax.Array, start: Any) -> jax.Array:
    """``x``'s rows written into ``out`` from ``start``; a scalar added to it."""
    return jax.lax.dynamic_update_slice_in_dim(out, x, start, 0) if x.ndim else out + x


def _diff_of(argnums: int, wrt: nnx.filterlib.Filter) -> Callable[..., bool]:
    """The filter of ``wrt``'s variables in argument ``argnums`` (paths start with it)."""
    selected = nnx.filterlib.to_predicate(wrt)
    return lambda path, x: path[0] == argnums and selected(path, x)


def _rows(x: jax.Array, start: Any, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(jnp.asarray(x), start, size)


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(-1, *x.shape[2:])
