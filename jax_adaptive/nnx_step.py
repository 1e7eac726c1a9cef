"""Flax NNX's own training step, micro-batched: the step you wrote, at the size that fits.

`AdaptiveNnxStep` replaces ``@nnx.jit`` around a step whose ``nnx.value_and_grad`` became
`jax_adaptive.micro_batch_value_and_grad`, and plans its micro-batch with the sizing
engine: a gradient program (sized, never donating) and an update program that replays
its records (docs/flax.md).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from flax.nnx.graph import is_graph_node

from jax_adaptive.adaptive_step import AdaptiveStep, signature_of
from jax_adaptive.backup import backup, backup_bytes, put_back
from jax_adaptive.data import leading_size
from jax_adaptive.errors import OptimizerStepOutOfMemory, SimulatedOutOfMemory, catch_oom
from jax_adaptive.memory import Ledger, compile_measured, program_ledger, tree_bytes
from jax_adaptive.nnx_grad import Record, StepTrace, batch_position, tracing
from jax_adaptive.normalizer import normalizer_problem
from jax_adaptive.remat import RematChoices, choices_of

__all__ = ["AdaptiveNnxStep"]

log = logging.getLogger("jax_adaptive")


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


# What the step takes: AdaptiveStep's options, batch_argnum its own and the rest passed on.
_OPTIONS = tuple(p for p in inspect.signature(AdaptiveStep).parameters if p != "build_step")


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
            `micro_batch_value_and_grad` the same way on every trace. Or a
            `jax_adaptive.RematChoices` of such steps, one per remat policy (the same step,
            its loss running the model's layers under each policy): the gradient's plan
            takes the policy with the fewest micro-steps (docs/memory.md); the update runs
            the chosen step.
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

    def __init__(self, step_fn: Callable[..., Any] | RematChoices[Callable[..., Any]], *,
                 batch_argnum: int | None = None, **step_kwargs: Any):  # fmt: skip
        # Several steps, one per remat policy: the gradient's plan picks one (`_discover`).
        steps = choices_of(step_fn, "step_fn")
        self._step_fns = {name: inspect.unwrap(fn) for name, fn in steps.items()}
        self.step_fn = next(iter(self._step_fns.values()))
        self.batch_argnum = batch_argnum
        # Checked here, at decoration: AdaptiveStep is made at the first call.
        if unknown := sorted(set(step_kwargs) - set(_OPTIONS)):
            raise TypeError(
                f"AdaptiveNnxStep got an unknown option {', '.join(unknown)}; its options are "
                f"{', '.join(sorted(_OPTIONS))}."
            )
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

    def set_memory_limit(self, memory_limit: int | None) -> None:
        """Changes the cap mid-training, as `jax_adaptive.AdaptiveTrainer`'s does.

        The gradient re-plans at the next call (what it measured is kept); the update
        decides again whether it must donate the state.
        """
        self.step_kwargs["memory_limit"] = memory_limit
        for programs in self._programs.values():
            programs.gradient.set_memory_limit(memory_limit)
            programs.updates.clear()

    def __call__(self, *args: Any) -> Any:
        """Runs the step on ``args``, its NNX objects updated in place; what it returns.

        Raises:
            NothingFitsError: not even the smallest micro-batch fits; the objects are intact.
            OptimizerStepOutOfMemory: the update ran out of memory; the objects are intact.
            ValueError: a `micro_batch_value_and_grad` normalizer gave a negative or
                non-finite count; nothing was applied.
        """
        b = batch_position(args, self.batch_argnum, "the step")
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
        records: tuple[Record, ...] = ()
        if programs.calls:
            records, counts = programs.gradient(state, batch, others)
            _check_counts(counts)
        state = self._update(programs, (graphdef, b, len(args)), nodes, state, batch, others,
                             records)  # fmt: skip
        new_state, out = state
        nnx.update(nodes, new_state)
        return out

    # ------------------------------------------------------------ the two programs

    def _traced(self, where: tuple[Any, int, int], trace: StepTrace, state: Any, batch: Any,
                others: tuple[Any, ...], policy: str | None = None) -> tuple[Any, Any]:  # fmt: skip
        """The step's Python function on objects of ``state``, under ``trace``: (objects, out).

        ``policy``: which remat choice's step (None: the first, or the only one).
        """
        graphdef, b, n = where
        nodes, rest = nnx.merge(graphdef, state), iter(others)
        args = [batch if i == b else nodes[i] if i in nodes else next(rest) for i in range(n)]
        with tracing(trace):
            out = (self.step_fn if policy is None else self._step_fns[policy])(*args)
        return nodes, out

    def _discover(self, graphdef: Any, b: int, n: int, state: Any, batch: Any,
                  others: tuple[Any, ...]) -> _Programs:  # fmt: skip
        """Traces the step once (nothing compiles): its calls and ghost batches, its programs."""
        where, trace = (graphdef, b, n), StepTrace(None)
        jax.eval_shape(lambda *a: self._traced(where, trace, *a)[1], state, batch, others)
        kwargs = dict(self.step_kwargs)
        multiple_of = math.lcm(kwargs.pop("multiple_of", 1), *trace.ghost_sizes)

        def build(policy: str | None, size: int) -> Callable[..., Any]:
            def gradient(state: Any, batch: Any, others: tuple[Any, ...]) -> Any:
                trace = StepTrace(size)
                self._traced(where, trace, state, batch, others, policy)
                return tuple(trace.records), tuple(trace.checks)

            return jax.jit(gradient)  # donates nothing: a failed run loses nothing

        builders = {name: functools.partial(build, name) for name in self._step_fns}
        build_step = builders[None] if None in builders else RematChoices(builders)
        gradient = AdaptiveStep(build_step, batch_argnum=1, multiple_of=multiple_of, **kwargs)
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
        records: tuple[Record, ...],
    ) -> Any:
        """Runs the update on the gradient's records: ``(new state, out)``; the objects kept."""
        args = (state, batch, others, records)
        key = signature_of(args)
        if key not in programs.updates:
            programs.updates[key] = self._compile_update(programs, where, args)
        update = programs.updates[key]
        saved = None
        if update.donate:  # the state twice does not fit: a host copy keeps it safe
            saved = backup(state)
            self.host_bytes += backup_bytes(saved)

        def run() -> Any:
            if self._fault_hook is not None:
                donated = tuple(jax.tree.leaves(state)) if update.donate else ()
                self._fault_hook.before_execution(0, _Donating(args, donated))
            return jax.block_until_ready(update.compiled(*args))

        out, error = catch_oom(run)
        if error is None:
            return out
        if saved is not None:
            state = put_back(state, saved)
            nnx.update(nodes, state)
        raise OptimizerStepOutOfMemory(state) from error

    def _compile_update(self, programs: _Programs, where: tuple[Any, int, int],
                        args: tuple[Any, ...]) -> _Update:  # fmt: skip
        """The update compiled for ``args``, donating its state only if twice does not fit."""
        remat = programs.gradient.remat  # the chosen step's update (None: the first's)
        policy = None if remat is None else remat.policy

        def update(state: Any, batch: Any, others: tuple[Any, ...], records: Any) -> Any:
            trace = StepTrace(None, replay=records)
            nodes, out = self._traced(where, trace, state, batch, others, policy)
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
