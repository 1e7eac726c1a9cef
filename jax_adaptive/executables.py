"""Compiling and measuring the jitted pieces of an update, per micro-batch size.

The one place that knows the micro-step's calling convention (`MicroArgs`, donation by
name) and the optimizer step's. `Executables` compiles each ahead of time from
``jax.ShapeDtypeStruct``s for the train state and one example it is bound to, reads
XLA's memory analysis of each, and adds what the analysis leaves out into a `Ledger`:
the whole resident state (JAX prunes the arguments a program does not read, such as
Adam's moments in a micro-step, yet they stay on the device) and the inputs and outputs
of every micro-step in flight.

Compiled programs are released when the planner no longer uses their size; their memory
reports are kept, so a size decided once is never compiled again to be decided again.

Under a mesh, a loss without model state and parameters not split over the data axis
(`Executables.per_device`), each device accumulates its own gradient (`per_device`):
the micro-step and its chunks run no collective, the accumulator and the running totals
carry a leading device axis split over the data axis (a device holds one accumulator,
as when it is replicated), and the optimizer step sums them over the devices, the one
reduction of an update. A loss with model state (BatchNorm) keeps the SPMD micro-step,
whose statistics span the whole micro-batch, and its gradient all-reduce: per-device
statistics would change what ``model_state`` is.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections import Counter
from collections.abc import Callable, Container
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jax_adaptive.memory import Ledger, memory_report, tree_bytes
from jax_adaptive.step import (
    PerExampleLoss,
    TrainState,
    _call_loss,
    _check_per_example,
    make_micro_step,
    make_optimizer_step,
    per_device,
    scan_micro_steps,
    with_optimizer_step,
)

__all__ = ["DONATED", "Executable", "Executables", "FaultHook", "MicroArgs", "compile_measured"]


class MicroArgs(NamedTuple):
    """The micro-step's arguments, by name (see `jax_adaptive.step.make_micro_step`)."""

    params: Any
    opt_state: Any  # the MultiStepsState with acc_grads=None
    acc_grads: Any
    model_state: Any
    totals: Any
    batch: Any
    weights: Any
    rng: Any
    offset: Any
    k: Any
    target: Any = None  # the update's target batch size T: a runtime int32


DONATED = ("acc_grads",)
"""The micro-step's donated arguments: a failed run may delete these, never the state."""


class FaultHook(Protocol):
    """What `jax_adaptive.testing.FaultInjector` implements: called before compiles and runs."""

    def before_compile(self, size: int) -> None:
        """Called before the micro-step for ``size`` compiles."""

    def before_execution(self, size: int, args: MicroArgs) -> None:
        """Called before a micro-step of ``size`` runs on ``args``."""


class Executable(NamedTuple):
    """A compiled program with XLA's memory analysis of it and what compiling cost."""

    compiled: Any
    report: dict[str, int]
    seconds: float

    @property
    def estimate(self) -> int:
        """`jax_adaptive.estimate_peak_bytes` of the program alone."""
        r = self.report
        return r["argument"] + r["output"] - r["alias"] + r["temp"] + r["code"]


def compile_measured(
    lower: Callable[[], Any], fault_hook: FaultHook | None = None, size: int = 0
) -> Executable:
    """Compiles what ``lower()`` lowers, timed, with XLA's memory analysis of it.

    ``fault_hook.before_compile(size)`` runs first when a hook is given (the compile of
    that size may be made to fail). The time counts the lowering ``lower`` does.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> program = compile_measured(lambda: jax.jit(jnp.sin).lower(jnp.ones(4)))
        >>> program.report["output"] >= 16 and program.seconds > 0
        True
    """
    start = time.perf_counter()
    if fault_hook is not None:
        fault_hook.before_compile(size)
    compiled = lower().compile()
    return Executable(compiled, memory_report(compiled), time.perf_counter() - start)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))


def _shardings(structs: Any) -> Any:
    return jax.tree.map(lambda s: s.sharding, structs)


def zeros(structs: Any) -> Any:
    """Zeros on the device, of the shapes, dtypes and shardings of ``structs``.

    Structs that all carry a sharding get theirs from one cached program (an update
    makes a fresh accumulator this way), the others one ``jnp.zeros`` each.
    """
    leaves, treedef = jax.tree.flatten(structs)
    if leaves and all(s.sharding is not None for s in leaves):
        return jax.tree.unflatten(treedef, _zeros_program(tuple(leaves))())
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), structs)


@functools.lru_cache(maxsize=32)
def _zeros_program(structs: tuple[jax.ShapeDtypeStruct, ...]) -> Any:
    def make() -> list[jax.Array]:
        return [jnp.zeros(s.shape, s.dtype) for s in structs]

    return jax.jit(make, out_shardings=[s.sharding for s in structs])


def example_structs(example_batch: Any) -> Any:
    """The shape and dtype of one example of each leaf of a batch."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        dtype = x.dtype if isinstance(x, jax.Array) else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(np.shape(x)[1:], dtype)

    return jax.tree.map(one, example_batch)


class Executables:
    """Compiles the micro-step per size and the optimizer step, for one bound input shape.

    Args:
        loss_fn: the per-example loss (see `jax_adaptive.AdaptiveTrainer`).
        optimizer: the inner optax optimizer.
        target_batch_size: examples per update now: the bound of the sizes and chunks it
            compiles (`jax_adaptive.planner.Planner.set_target` changes it as a
            batch-size schedule grows). The programs themselves take ``T`` at run time
            (`MicroArgs.target`): one compile per size serves every target.
        has_aux: ``loss_fn`` returns ``(losses, aux)``.
        has_state: ``loss_fn`` threads mutable model state.
        everywhere: where a replicated value lives (a device's or a mesh's sharding).
        data: the micro-batch's sharding over the data axis, or None on one device.
        in_flight: how many programs the update dispatches ahead at most.

    A *chunk* of ``c`` micro-steps of one size runs as one program (`scan_micro_steps`):
    ``micro(size, chunk=c)`` takes ``c * size`` examples (``[c, size, ...]`` when
    `per_device`). Chunk 1 is the plain micro-step the search compiles. ``final(size,
    chunk=c)`` is the same program followed by the optimizer step
    (`jax_adaptive.step.with_optimizer_step`): an update's last dispatch, when it fits.

    Attributes:
        compiles: micro-step compiles so far (chunks of one; what a search costs).
        chunk_compiles: compiles of chunks of several micro-steps.
        final_compiles: compiles of last programs (micro-steps and the optimizer step).
        trace_counts: traces of the micro-step per size (one each, never a retrace).
        chunk_trace_counts: traces of the micro-step inside chunks and last programs,
            per size.
        fault_hook: a `FaultHook` (tests inject out-of-memory errors through it), or None.
        generation: how many shapes it was bound to; what was learned of a size under
            another generation (its peak, that it ran) says nothing of it now.
        per_device: each device accumulates its own gradient, reduced once per update
            (decided at `bind`: a mesh, no model state, parameters not split over the
            data axis).
        acc_struct: the accumulator the micro-steps carry (``[D, ...]`` when
            `per_device`, else the parameters' shape).
        totals_struct: the running totals the micro-steps carry (``[D]`` each when
            `per_device`, else scalars).

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, optax
        >>> from jax_adaptive.distributed import Placement
        >>> loss = lambda p, b, r: (b @ p) ** 2
        >>> ex = Executables(loss, optax.adam(0.1), 8, everywhere=Placement().everywhere)
        >>> state = TrainState(jnp.ones(256), optax.MultiSteps(optax.adam(0.1), 1).init(
        ...     jnp.ones(256)), (), jax.random.key(0))
        >>> _ = ex.bind(jax.device_put(state), np.ones((8, 256), np.float32))
        >>> ledger = ex.ledger(4)
        >>> ledger.state >= 4 * 1024  # params, both moments and the accumulator
        True
    """

    def __init__(
        self,
        loss_fn: PerExampleLoss,
        optimizer: optax.GradientTransformation,
        target_batch_size: int,
        *,
        has_aux: bool = False,
        has_state: bool = False,
        everywhere: jax.sharding.Sharding,
        data: jax.sharding.Sharding | None = None,
        in_flight: int = 1,
    ):
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.target_batch_size = target_batch_size
        self.has_aux, self.has_state = has_aux, has_state
        self.everywhere, self.data, self.in_flight = everywhere, data, in_flight
        self.compiles = self.chunk_compiles = self.final_compiles = 0
        self.trace_counts: Counter[int] = Counter()
        self.fault_hook: FaultHook | None = None
        self.generation = 0  # bumped by each bind to a new shape: measures of old ones are void
        self.chunk_trace_counts: Counter[int] = Counter()
        self.per_device, self._shards = False, 1  # decided by bind
        self._micro_fn, self._chunk_fn = (
            make_micro_step(
                loss_fn,
                optimizer,
                None,  # T is the programs' runtime argument (MicroArgs.target)
                has_aux=has_aux,
                has_state=has_state,  # per device, a trace sees one device's rows
                on_trace=lambda rows, counts=counts: counts.update([rows * self._shards]),
            )
            for counts in (self.trace_counts, self.chunk_trace_counts)
        )
        self._bound: tuple[Any, Any] | None = None
        self._clear()

    def _clear(self) -> None:
        # Keyed by (size, chunk).
        self._compiled: dict[tuple[int, int], Executable] = {}
        self._lowered: dict[tuple[int, int], Any] = {}
        self._reports: dict[tuple[int, int], dict[str, int]] = {}
        self._optimizer: dict[bool, Executable] = {}
        self._finals: dict[tuple[int, int, bool], Executable] = {}
        # per (size, chunk, with the optimizer step): kept when programs go
        self._ledgers: dict[tuple[int, int, bool, bool], Ledger] = {}
        self._fingerprint: str | None = None

    # ------------------------------------------------------------ binding a shape

    def bind(self, state: TrainState, example_batch: Any) -> bool:
        """Binds the programs to a placed train state and an example's shape.

        Binding another shape (or another state layout) drops every program and
        measurement of the previous one: they would not accept the new inputs.

        Returns:
            Whether anything changed.
        """
        structs = (jax.tree.map(_struct, state), example_structs(example_batch))
        if self._bound is not None and _same(self._bound, structs):
            return False
        self._bound = structs
        self.generation += 1
        self.state_structs, self.example = structs
        self.means_struct = self._totals_for(state)
        s = self.state_structs
        self.per_device = self._can_accumulate_per_device(s.params)
        self._shards = self.data.mesh.shape[self._axis] if self.per_device else 1
        self.acc_struct = jax.tree.map(self._device_rows, s.opt_state.acc_grads)
        self.totals_struct = jax.tree.map(self._device_rows, self.means_struct)
        # The outputs keep the inputs' shardings, call after call.
        self._outs = _shardings(
            (self.acc_struct, s.opt_state.mini_step, s.model_state, self.totals_struct)
        )
        self._micro_jit = self._jit_of(self._program(self._micro_fn))
        self._chunk_jit: dict[int, Any] = {}  # per size: its micro-steps scanned in one program
        self._clear()
        return True

    @property
    def _axis(self) -> str:
        return self.data.spec[0]

    def _can_accumulate_per_device(self, params: Any) -> bool:
        """A mesh, a loss without model state, no parameter split over the data axis."""
        if self.data is None or self.has_state:
            return False
        return all(
            isinstance(leaf.sharding, NamedSharding) and self._axis not in _axes(leaf.sharding)
            for leaf in jax.tree.leaves(params)
        )

    def _device_rows(self, struct: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        """``struct`` with a leading device axis split over the data axis, when `per_device`."""
        if not self.per_device:
            return struct
        spec = PartitionSpec(self._axis, *getattr(struct.sharding, "spec", ()))
        sharding = NamedSharding(self.data.mesh, spec)
        return jax.ShapeDtypeStruct((self._shards, *struct.shape), struct.dtype, sharding=sharding)

    def _program(self, micro_step: Any, size: int | None = None) -> Any:
        """The micro-step (``size`` None) or a chunk of ``size``, per device when `per_device`."""
        if self.per_device:
            return per_device(micro_step, self.data.mesh, self._axis, chunk_size=size)
        return micro_step if size is None else scan_micro_steps(micro_step, size)

    def _require_bound(self) -> None:
        if self._bound is None:
            raise RuntimeError("call trainer.init(params, example_batch) first.")

    def _totals_for(self, state: TrainState) -> dict[str, jax.ShapeDtypeStruct]:
        # The aux metrics' names are known only from the loss's output: trace it once.
        batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((1, *s.shape), s.dtype), self.example)

        def aux_of(params, model_state, b, rng):
            out, aux, _ = _call_loss(
                self.loss_fn, self.has_aux, self.has_state, params, model_state, b, rng
            )
            _check_per_example("loss_fn's losses", out, 1)
            return aux

        aux = jax.eval_shape(aux_of, state.params, state.model_state, batch, state.rng)
        if not isinstance(aux, dict):
            raise TypeError(f"aux must be a dict of per-example metrics, got {type(aux).__name__}.")
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.everywhere)
        return {name: scalar for name in ("loss", *aux)}

    # ------------------------------------------------------------ the micro-step

    def micro_structs(self, size: int, chunk: int = 1) -> MicroArgs:
        """The arguments of a chunk of micro-steps of ``size`` as ``ShapeDtypeStruct``s."""
        self._require_bound()
        s, data, rows = self.state_structs, self.data, (size * chunk,)
        if self.per_device and chunk > 1:  # each device holds its rows of every micro-batch
            rows, data = (chunk, size), NamedSharding(data.mesh, PartitionSpec(None, self._axis))
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        return MicroArgs(
            params=s.params,
            opt_state=s.opt_state._replace(acc_grads=None),
            acc_grads=self.acc_struct,
            model_state=s.model_state,
            totals=self.totals_struct,
            batch=jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((*rows, *x.shape), x.dtype, sharding=data),
                self.example,
            ),
            weights=jax.ShapeDtypeStruct(rows, jnp.float32, sharding=data),
            rng=s.rng,
            offset=i32,
            k=i32,
            target=i32,
        )

    def lower(self, size: int, chunk: int = 1) -> Any:
        """Traces the program for ``size`` (the user's loss runs here, errors and all)."""
        key = self._check_size(size), self._check_chunk(size, chunk)
        if key not in self._lowered:
            self._lowered[key] = self._jit(*key).lower(*self.micro_structs(*key))
        return self._lowered[key]

    def _jit_of(self, fn: Any) -> Any:
        return jax.jit(fn, donate_argnames=DONATED, out_shardings=self._outs)

    def _jit(self, size: int, chunk: int) -> Any:
        if chunk == 1:
            return self._micro_jit
        if size not in self._chunk_jit:
            self._chunk_jit[size] = self._jit_of(self._program(self._chunk_fn, size))
        return self._chunk_jit[size]

    def micro(self, size: int, chunk: int = 1) -> Executable:
        """The compiled program for ``chunk`` micro-steps of ``size``, compiled once in use."""
        key = self._check_size(size), self._check_chunk(size, chunk)
        if key not in self._compiled:
            lowered = self.lower(*key)
            executable = self._compile(lambda: lowered, size)
            del self._lowered[key]
            if chunk == 1:
                self.compiles += 1
            else:
                self.chunk_compiles += 1
            self._compiled[key] = executable
            self._reports[key] = executable.report
        return self._compiled[key]

    def report(self, size: int, chunk: int = 1) -> dict[str, int]:
        """XLA's memory analysis of the program for ``size`` (compiled once, ever)."""
        if (size, chunk) not in self._reports:
            self.micro(size, chunk)
        return self._reports[size, chunk]

    def ledger(self, size: int, chunk: int = 1) -> Ledger:
        """Everything live on a device while programs of ``size`` run (see `Ledger`).

        The resident state is counted whole, read or not. Each of the ``in_flight``
        programs dispatched holds its transferred examples (``chunk * size``), its
        outputs that are not aliased to a donated input (the new model state) and its
        temporaries (a runtime may allocate them at dispatch).
        """
        return self._ledger_of(size, chunk, final=False)

    def _ledger_of(self, size: int, chunk: int, final: bool) -> Ledger:
        """`ledger` of ``micro(size, chunk)``, or of ``final(size, chunk)``: measured once."""
        key = (size, chunk, final and self.whole(size, chunk), final)
        if key not in self._ledgers:
            report = self.final(size, chunk).report if final else self.report(size, chunk)
            args = self.micro_structs(size, chunk)
            inputs = tree_bytes((args.batch, args.weights, args.offset, args.k, args.target))
            new_outputs = report["output"] - report["alias"]
            self._ledgers[key] = Ledger(
                state=self.state_bytes(),
                in_flight=self.in_flight * (inputs + new_outputs),
                program=self.in_flight * report["temp"] + report["code"],
            )
        return self._ledgers[key]

    def example_bytes(self) -> int:
        """Bytes one example (and its weight) adds to a program's inputs."""
        self._require_bound()
        return tree_bytes(self.example) + 4

    def state_bytes(self) -> int:
        """Bytes of the whole train state and the running totals on one device.

        The accumulator counted is the one the micro-steps carry (`acc_struct`): a
        device holds one row of a per-device accumulator, which replaces the state's
        (`jax_adaptive.update` releases that one when an update starts).
        """
        self._require_bound()
        s = self.state_structs
        state = s._replace(opt_state=s.opt_state._replace(acc_grads=self.acc_struct))
        return tree_bytes((state, self.totals_struct))

    def release(self, keep: Container[int]) -> None:
        """Frees the compiled programs of every size not in ``keep`` (reports stay)."""
        for programs in (self._compiled, self._finals):
            for key in [key for key in programs if key[0] not in keep]:
                del programs[key]
        self._lowered = {key: low for key, low in self._lowered.items() if key[0] in keep}

    def compiled_sizes(self) -> list[int]:
        """The sizes whose compiled program (of any chunk) is held now."""
        return sorted({size for size, _ in self._compiled})

    def fingerprint(self, size: int) -> str:
        """A digest of the lowered micro-step: the model, loss, optimizer and shapes."""
        if self._fingerprint is None:
            text = self._micro_jit.lower(*self.micro_structs(size)).as_text()
            self._fingerprint = hashlib.sha256(text.encode()).hexdigest()
        return self._fingerprint

    def _check_chunk(self, size: int, chunk: Any) -> int:
        if isinstance(chunk, bool) or not isinstance(chunk, int | np.integer) or chunk < 1:
            raise ValueError(f"{chunk=} must be a positive int.")
        if size * chunk > self.target_batch_size + size - 1:
            raise ValueError(
                f"a chunk of {chunk} micro-steps of {size} covers more than "
                f"target_batch_size={self.target_batch_size}."
            )
        return int(chunk)

    def _check_size(self, size: Any) -> int:
        self._require_bound()
        if isinstance(size, bool) or not isinstance(size, int | np.integer):
            raise TypeError(f"size must be an int, got {size!r}.")
        if not 1 <= size <= self.target_batch_size:
            raise ValueError(f"{size=} must be in [1, target_batch_size={self.target_batch_size}].")
        return int(size)

    # ------------------------------------------------------------ the optimizer step

    def optimizer_step(self, donate: bool) -> Executable:
        """The compiled optimizer step, donating the state or not (compiled once each)."""
        self._require_bound()
        if donate not in self._optimizer:
            s = self.state_structs
            k = jax.ShapeDtypeStruct((), jnp.int32)
            opt_state = s.opt_state._replace(acc_grads=self.acc_struct)
            jitted = jax.jit(
                make_optimizer_step(self.optimizer, per_device=self.per_device),
                donate_argnames=("params", "opt_state") if donate else (),
                out_shardings=_shardings((s.params, s.opt_state, self.means_struct)),
            )
            self._optimizer[donate] = self._compile(
                lambda: jitted.lower(s.params, opt_state, self.totals_struct, k, k)
            )
        return self._optimizer[donate]

    def final(self, size: int, chunk: int = 1) -> Executable:
        """An update's last ``chunk`` micro-steps of ``size`` and the optimizer step, compiled.

        It takes the arguments of ``micro(size, chunk)``, donates what it donates (the
        train state stays intact: a failure loses nothing) and returns ``(params,
        opt_state, model_state, means)`` (`jax_adaptive.step.with_optimizer_step`).
        When those micro-steps are the whole update (`whole`), it neither reads nor
        donates the accumulator and returns ``opt_state.acc_grads=None``: the state's,
        zeros between updates, stays the new state's. Compiled once per size, chunk and
        whether it is whole; `final_ledger` is its peak.
        """
        size, chunk = self._check_size(size), self._check_chunk(size, chunk)
        key = (size, chunk, self.whole(size, chunk))
        if key not in self._finals:
            whole, s = key[2], self.state_structs
            program = with_optimizer_step(
                self._program(self._chunk_fn, size if chunk > 1 else None),
                make_optimizer_step(self.optimizer, per_device=self.per_device),
                whole=whole,
            )
            opt_state = s.opt_state._replace(acc_grads=None) if whole else s.opt_state
            outs = _shardings((s.params, opt_state, s.model_state, self.means_struct))
            donated = tuple(name for name in DONATED if not (whole and name == "acc_grads"))
            jitted = jax.jit(program, donate_argnames=donated, out_shardings=outs)
            self._finals[key] = self._compile(
                lambda: jitted.lower(*self.micro_structs(size, chunk)), size
            )
            self.final_compiles += 1
        return self._finals[key]

    def whole(self, size: int, chunk: int) -> bool:
        """Whether ``chunk`` micro-steps of ``size`` are a whole update of the target now.

        Its last program then starts from zeros instead of the state's accumulator
        (one device's: not `per_device`, whose accumulator has a device axis).
        """
        return not self.per_device and chunk == math.ceil(self.target_batch_size / size)

    def _compile(self, lower: Any, size: int | None = None) -> Executable:
        """`compile_measured` with this object's fault hook (for a ``size``'s compile)."""
        return compile_measured(lower, None if size is None else self.fault_hook, size)

    def new_state_bytes(self) -> int:
        """Bytes an optimizer step writes beside the state it does not donate.

        The parameters and the inner optimizer state: a lower bound of what `final`
        adds to the micro-steps' ledger.
        """
        self._require_bound()
        s = self.state_structs
        return tree_bytes((s.params, s.opt_state.inner_opt_state))

    def final_ledger(self, size: int, chunk: int = 1) -> Ledger:
        """Everything live while `final` runs: ``ledger``'s parts, with the new state."""
        return self._ledger_of(size, chunk, final=True)

    def optimizer_step_ledger(self, donate: bool) -> Ledger:
        """Everything live while the optimizer step runs: the state, its new outputs, temps."""
        report = self.optimizer_step(donate).report
        return Ledger(
            state=self.state_bytes(),
            in_flight=report["output"] - report["alias"],
            program=report["temp"] + report["code"],
        )

    # ------------------------------------------------------------ timing

    def time_program(
        self, executable: Executable, state: TrainState, size: int, chunk: int = 1, reps: int = 3
    ) -> float:
        """The fastest of ``reps`` runs of a program of ``micro(size, chunk)``'s arguments.

        In seconds, on ``state`` and a batch of zeros, after a first run that warms up.
        ``executable`` is ``micro(size, chunk)`` or ``final(size, chunk)``.
        Out-of-memory errors propagate: the caller decides what they mean.
        """
        structs = self.micro_structs(size, chunk)
        w = structs.weights
        fixed = structs._replace(  # what the program reads and does not donate
            params=state.params,
            opt_state=state.opt_state._replace(acc_grads=None),
            model_state=state.model_state,
            batch=zeros(structs.batch),
            weights=jnp.ones(w.shape, w.dtype, device=w.sharding),
            rng=state.rng,
            offset=np.int32(0),
            k=np.int32(chunk + 1),
            target=np.int32(self.target_batch_size),
            totals=zeros(structs.totals),
        )
        seconds = []
        for _ in range(reps + 1):  # the first run warms up
            args = fixed._replace(acc_grads=zeros(structs.acc_grads))  # donated: fresh each run
            start = time.perf_counter()
            jax.block_until_ready(executable.compiled(*args))
            seconds.append(time.perf_counter() - start)
        return min(seconds[1:])


def _axes(sharding: NamedSharding) -> set[str]:
    """The mesh axes a sharding splits over."""
    axes: set[str] = set()
    for entry in sharding.spec:
        axes.update((entry,) if isinstance(entry, str) else entry or ())
    return axes


def _same(a: Any, b: Any) -> bool:
    try:
        return jax.tree.structure(a) == jax.tree.structure(b) and all(
            x == y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )
    except (TypeError, ValueError):
        return False
