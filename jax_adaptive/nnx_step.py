"""Flax NNX's own training step, micro-batched: the step you wrote, at the size that fits.

`micro_batch_value_and_grad` replaces ``nnx.value_and_grad`` inside an NNX step (a
batch-mean loss, or a ratio loss with its ``normalizer``; call-time ``rngs``; BatchNorm
statistics over ghost batches) and computes the full batch's loss, aux and gradient ``m``
examples at a time; `AdaptiveNnxStep` replaces ``@nnx.jit`` and plans ``m`` with the
sizing engine. The guide: docs/flax.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.graph import is_graph_node

from jax_adaptive import checks
from jax_adaptive.adaptive_step import AdaptiveStep, signature_of
from jax_adaptive.data import leading_size
from jax_adaptive.errors import OptimizerStepOutOfMemory, SimulatedOutOfMemory, catch_oom
from jax_adaptive.ghost import over_groups
from jax_adaptive.memory import Ledger, program_ledger, tree_bytes
from jax_adaptive.normalizer import Normalizer, denominator, normalizer_problem
from jax_adaptive.sizing import compile_measured

__all__ = ["GHOST_DEFAULT", "AdaptiveNnxStep", "micro_batch_value_and_grad"]

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


class _Record(NamedTuple):
    """One call of `micro_batch_value_and_grad` in a step: what it returned and wrote."""

    value: Any  # the loss, or (loss, aux)
    grads: Any  # the gradient, an nnx.State
    rest: Any  # the objects' other state after it (BatchNorm statistics, Rngs counts)


class _StepTrace:
    """What a step traced by `AdaptiveNnxStep` asks of its `micro_batch_value_and_grad` calls.

    ``size``: the planned micro-batch (None: the whole batch). Without ``replay`` each call
    computes and appends its `_Record` (and its normalizer's check) here; with ``replay``
    each call returns the next given record instead of computing.
    """

    def __init__(self, size: int | None, replay: tuple[_Record, ...] | None = None):
        self.size, self.replay = size, replay
        self.records: list[_Record] = []
        self.checks: list[jax.Array] = []  # [the batch's denominator, a micro-batch's was bad]
        self.ghost_sizes: set[int] = set()

    def next_replay(self) -> _Record:
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

_TRACE: contextvars.ContextVar[_StepTrace | None] = contextvars.ContextVar(
    "jax_adaptive_step_trace", default=None
)


@contextlib.contextmanager
def _tracing(trace: _StepTrace) -> Iterator[_StepTrace]:
    token = _TRACE.set(trace)
    try:
        yield trace
    finally:
        _TRACE.reset(token)


def _batch_position(args: tuple[Any, ...], batch_argnum: int | None, what: str) -> int:
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
    if normalizer is not None and not callable(normalizer):
        raise TypeError(f"normalizer must be a function of the batch, got {normalizer!r}.")

    def value_and_grad(*args: Any) -> Any:
        trace = _TRACE.get()
        if trace is None and micro_batch_size is None:
            warnings.warn(WHOLE_BATCH, stacklevel=2)
        b = _batch_position(args, batch_argnum, "the loss")
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
            trace.records.append(_Record(value, grads[argnums], rest))
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


class _Update(NamedTuple):
    """The step's update for one signature: compiled once, donating its state only if it must."""

    compiled: Any
    donate: bool
    ledger: Ledger


class _Programs:
    """One graph structure's programs: the gradient, sized and never donating, and the update.

    ``calls``: the step's calls of `micro_batch_value_and_grad` (0: nothing to plan).
    """

    def __init__(self, gradient: AdaptiveStep, calls: int):
        self.gradient, self.calls = gradient, calls
        self.updates: dict[Any, _Update] = {}


class _Donating(NamedTuple):
    """What a fault hook sees of a run: its arguments, and the arrays the run donates."""

    args: Any
    donated: tuple[jax.Array, ...]


class AdaptiveNnxStep:
    """An NNX training step at the largest micro-batch that fits: ``@nnx.jit``'s stand-in.

    Decorate the step Flax's examples write (``train_step(model, optimizer, metrics,
    batch, rngs)``, updating its NNX objects in place) after replacing its
    ``nnx.value_and_grad`` by `micro_batch_value_and_grad`. Each call runs the step as two
    programs: its **gradient** (every `micro_batch_value_and_grad` of the step, at the
    micro-batch `jax_adaptive.AdaptiveStep` plans for the whole step's memory, donating
    nothing) and its **update** (the rest of the step, the optimizer's and the metrics',
    with the gradient as computed; its memory does not depend on the micro-batch). An
    out-of-memory in the gradient re-plans smaller and runs it again: the objects' state
    was never given away. The update donates the state only when the state twice does not
    fit the device, after a host copy (``host_bytes`` counts them), so no out-of-memory
    leaves an object deleted; one in the update raises
    `jax_adaptive.OptimizerStepOutOfMemory` with the objects as they were. A step already
    under ``@nnx.jit`` runs as its Python function.

    Args:
        step_fn: the step; its NNX object arguments are updated in place, the others are
            arrays (the batch among them); it returns arrays or nothing. It must call
            `micro_batch_value_and_grad` the same way on every trace.
        batch_argnum: the batch's position; None: the one argument not an NNX object.
        **step_kwargs: `jax_adaptive.AdaptiveStep`'s options (``memory_limit``,
            ``multiple_of``, ``plan_cache``, ...); ``multiple_of`` follows the ghost batches
            of the step's `micro_batch_value_and_grad`.

    Attributes:
        step: the gradient's `jax_adaptive.AdaptiveStep` for the objects in use.
        host_bytes: bytes copied to the host before updates that donate the state.

    Examples:
        >>> import functools, numpy as np, optax
        >>> from flax import nnx
        >>> import jax_adaptive as ja
        >>> model = nnx.Sequential(nnx.Linear(64, 512, rngs=nnx.Rngs(0)), nnx.relu,
        ...                        nnx.Linear(512, 10, rngs=nnx.Rngs(1)))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> def loss_fn(model, batch):
        ...     logits = model(batch["image"])
        ...     return optax.softmax_cross_entropy_with_integer_labels(
        ...         logits, batch["label"]).mean()
        >>> @functools.partial(ja.AdaptiveNnxStep, memory_limit=1_000_000, plan_cache=False)
        ... def train_step(model, optimizer, batch):
        ...     loss, grads = ja.micro_batch_value_and_grad(loss_fn)(model, batch)
        ...     optimizer.update(model, grads)
        ...     return loss
        >>> batch = {"image": np.ones((256, 64), np.float32), "label": np.zeros(256, np.int32)}
        >>> loss = train_step(model, optimizer, batch)
        >>> train_step.micro_batch_size < 256, train_step.plan_info.accumulation_steps > 1
        (True, True)
    """

    def __init__(self, step_fn: Callable[..., Any], *, batch_argnum: int | None = None,
                 **step_kwargs: Any):  # fmt: skip
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {step_fn!r}.")
        self.step_fn = inspect.unwrap(step_fn)
        self.batch_argnum = batch_argnum
        self.step_kwargs = step_kwargs
        self._programs: dict[tuple[Any, int], _Programs] = {}  # by graph and batch size
        self._in_use: _Programs | None = None
        self._batch_size = 0
        self._fault_hook: Any = None
        self.step: AdaptiveStep | None = None
        self.host_bytes = 0
        functools.update_wrapper(self, self.step_fn)

    @property
    def micro_batch_size(self) -> int:
        """The size in use (the whole batch for a step with nothing to micro-batch)."""
        if self._in_use is None:
            raise RuntimeError("call the step first.")
        return self._in_use.gradient.micro_batch_size if self._in_use.calls else self._batch_size

    @property
    def plan_info(self) -> Any:
        """The `jax_adaptive.Plan` of the gradient in use."""
        if self._in_use is None or not self._in_use.calls:
            raise RuntimeError("no plan: call a step that calls micro_batch_value_and_grad first.")
        return self._in_use.gradient.plan_info

    @property
    def search_log(self) -> list[Any]:
        """Every `jax_adaptive.SizeTrial` of the gradient, for every shape."""
        return [] if self.step is None else self.step.search_log

    @property
    def update_ledger(self) -> Ledger | None:
        """Everything live while the last update ran (None before a call)."""
        if self._in_use is None or not self._in_use.updates:
            return None
        return list(self._in_use.updates.values())[-1].ledger

    @property
    def fault_hook(self) -> Any:
        """Called before each compile and each run (`jax_adaptive.testing`)."""
        return self._fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Any) -> None:
        self._fault_hook = hook
        for programs in self._programs.values():
            programs.gradient.fault_hook = hook

    def __call__(self, *args: Any) -> Any:
        """Runs the step on ``args``, its NNX objects updated in place; what it returns.

        Raises:
            NothingFitsError: not even the smallest micro-batch fits; the objects are intact.
            OptimizerStepOutOfMemory: the update ran out of memory; the objects are intact.
            ValueError: a `micro_batch_value_and_grad` normalizer gave a negative or
                non-finite count; nothing was applied.
        """
        b = _batch_position(args, self.batch_argnum, "the step")
        nodes = {i: a for i, a in enumerate(args) if i != b and is_graph_node(a)}
        others = tuple(a for i, a in enumerate(args) if i != b and i not in nodes)
        graphdef, state = nnx.split(nodes)
        batch, self._batch_size = args[b], leading_size(args[b])
        # A batch of another size may hold other ghost batches: its own plan, multiples of them.
        key = (graphdef, self._batch_size)
        programs = self._programs.get(key)
        if programs is None:
            programs = self._discover(graphdef, b, len(args), state, batch, others)
            self._programs[key] = programs
        self._in_use, self.step = programs, programs.gradient
        records: tuple[_Record, ...] = ()
        if programs.calls:
            records, counts = programs.gradient(state, batch, others)
            _check_counts(counts)
        state = self._update(programs, (graphdef, b, len(args)), nodes, state, batch, others,
                             records)  # fmt: skip
        new_state, out = state
        nnx.update(nodes, new_state)
        return out

    # ------------------------------------------------------------ the two programs

    def _traced(self, where: tuple[Any, int, int], trace: _StepTrace, state: Any, batch: Any,
                others: tuple[Any, ...]) -> tuple[Any, Any]:  # fmt: skip
        """The step's Python function on objects of ``state``, under ``trace``: (objects, out)."""
        graphdef, b, n = where
        nodes, rest = nnx.merge(graphdef, state), iter(others)
        args = [batch if i == b else nodes[i] if i in nodes else next(rest) for i in range(n)]
        with _tracing(trace):
            out = self.step_fn(*args)
        return nodes, out

    def _discover(self, graphdef: Any, b: int, n: int, state: Any, batch: Any,
                  others: tuple[Any, ...]) -> _Programs:  # fmt: skip
        """Traces the step once (nothing compiles): its calls and ghost batches, its programs."""
        where, trace = (graphdef, b, n), _StepTrace(None)
        jax.eval_shape(lambda *a: self._traced(where, trace, *a)[1], state, batch, others)
        kwargs = dict(self.step_kwargs)
        multiple_of = math.lcm(kwargs.pop("multiple_of", 1), *trace.ghost_sizes)

        def build(size: int) -> Callable[..., Any]:
            def gradient(state: Any, batch: Any, others: tuple[Any, ...]) -> Any:
                trace = _StepTrace(size)
                self._traced(where, trace, state, batch, others)
                return tuple(trace.records), tuple(trace.checks)

            return jax.jit(gradient)  # donates nothing: a failed run loses nothing

        gradient = AdaptiveStep(build, batch_argnum=1, multiple_of=multiple_of, **kwargs)
        gradient.fault_hook = self._fault_hook
        if not trace.records:
            log.warning(
                "%s never calls ja.micro_batch_value_and_grad, so there is nothing to "
                "micro-batch: it runs on the whole batch, as @nnx.jit would (replace its "
                "nnx.value_and_grad by ja.micro_batch_value_and_grad to plan it)",
                getattr(self.step_fn, "__name__", "the step"),
            )
        return _Programs(gradient, len(trace.records))

    def _update(
        self,
        programs: _Programs,
        where: tuple[Any, int, int],
        nodes: Any,
        state: Any,
        batch: Any,
        others: tuple[Any, ...],
        records: tuple[_Record, ...],
    ) -> Any:
        """Runs the update on the gradient's records: ``(new state, out)``; the objects kept."""
        args = (state, batch, others, records)
        key = signature_of(args)
        if key not in programs.updates:
            programs.updates[key] = self._compile_update(programs, where, args)
        update = programs.updates[key]
        saved = None
        if update.donate:  # the state twice does not fit: a host copy keeps it safe
            saved = [(jax.device_get(x), x.sharding) for x in jax.tree.leaves(state)]
            self.host_bytes += sum(host.nbytes for host, _ in saved)

        def run() -> Any:
            if self._fault_hook is not None:
                donated = tuple(jax.tree.leaves(state)) if update.donate else ()
                self._fault_hook.before_execution(0, _Donating(args, donated))
            return jax.block_until_ready(update.compiled(*args))

        out, error = catch_oom(run)
        if error is None:
            return out
        if saved is not None:
            leaves = [jax.device_put(host, sharding) for host, sharding in saved]
            state = jax.tree.unflatten(jax.tree.structure(state), leaves)
            nnx.update(nodes, state)
        raise OptimizerStepOutOfMemory(state) from error

    def _compile_update(self, programs: _Programs, where: tuple[Any, int, int],
                        args: tuple[Any, ...]) -> _Update:  # fmt: skip
        """The update compiled for ``args``, donating its state only if twice does not fit."""

        def update(state: Any, batch: Any, others: tuple[Any, ...], records: Any) -> Any:
            trace = _StepTrace(None, replay=records)
            nodes, out = self._traced(where, trace, state, batch, others)
            if len(trace.records) != len(records):
                raise RuntimeError(
                    f"the step called micro_batch_value_and_grad {len(trace.records)} times "
                    f"in its update and {len(records)} times in its gradient: a step must make "
                    "the same calls on every trace."
                )
            return nnx.state(nodes), out

        state, batch, others, records = args
        shardings = jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else None, state)
        resident = tree_bytes((state, others))
        inputs = tree_bytes((batch, records))
        capacity = programs.gradient.capacity()
        ledgers = []
        for donate in (False, True):
            # The new state comes back as the state went in: a sharded model's next call
            # then runs the same executables (XLA would choose its own output shardings).
            jitted = jax.jit(
                update, donate_argnums=(0,) if donate else (), out_shardings=(shardings, None)
            )
            executable = compile_measured(lambda jitted=jitted: jitted.lower(*args))
            ledger = program_ledger(executable.report, resident=resident, inputs=inputs)
            ledgers.append(ledger)
            if capacity is None or ledger.total <= capacity:
                break
        else:
            error = SimulatedOutOfMemory(ledger.total, capacity, what="step's update")
            raise OptimizerStepOutOfMemory(state) from error
        if donate:
            log.info(
                "the step's update donates the state: the state twice does not fit (%s of %s "
                "bytes without), so a host copy of it (%s bytes) comes before each update",
                f"{ledger.total:,}",
                f"{capacity:,}",
                f"{tree_bytes(state):,}",
            )
        return _Update(executable.compiled, donate, ledger)


def _check_counts(counts: tuple[jax.Array, ...]) -> None:
    """Raises in one line when a normalizer gave a bad count (the gradient's check values)."""
    for whole, bad in np.asarray(jax.device_get(counts)).reshape(-1, 2):
        problem = normalizer_problem(float(whole))
        if problem is not None:
            raise ValueError(f"for the whole batch, {problem} Nothing was applied.")
        if bad:
            raise ValueError(
                "normalizer returned a negative or non-finite count for a micro-batch: it "
                "must be finite and at least 0. Nothing was applied."
            )
