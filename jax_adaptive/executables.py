"""Compiling and measuring the jitted pieces of an update, per micro-batch size.

The one place that knows the micro-step's calling convention (`MicroArgs`, donation by
name) and the optimizer step's. `Executables` lowers each ahead of time from
``jax.ShapeDtypeStruct``s for the train state and one example it is bound to. The
micro-step itself is the sizing engine's program (`jax_adaptive.sizing.Sizing`: one
compile per size, its `Ledger` from XLA's memory analysis, kept per input signature);
the chunks of several micro-steps, the update's last program and the optimizer step are
compiled here, each measured the same way (`jax_adaptive.memory.program_ledger`): the
whole resident state (JAX prunes the arguments a program does not read, such as Adam's
moments in a micro-step, yet they stay on the device) and the inputs and outputs of
every program in flight.

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
import math
import time
from collections import Counter
from collections.abc import Callable, Container, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jax_adaptive.data import example_structs
from jax_adaptive.memory import Ledger, program_ledger, tree_bytes
from jax_adaptive.sizing import Executable, Sized, Sizing, compile_measured
from jax_adaptive.step import (
    PerExampleLoss,
    TrainState,
    call_loss,
    check_per_example,
    make_micro_step,
    make_optimizer_step,
    per_device,
    scan_micro_steps,
    with_optimizer_step,
)

__all__ = ["DONATED", "Executables", "MicroArgs"]


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


class Executables:
    """Compiles the micro-step per size and the optimizer step, for one bound input shape.

    Args:
        loss_fn: the per-example loss (see `jax_adaptive.AdaptiveTrainer`).
        optimizer: the inner optax optimizer.
        sizing: the engine that compiles and measures the micro-step per size (`bind`
            binds it to the shape: ``program``, a `jax_adaptive.sizing.Binding`).
        has_aux: ``loss_fn`` returns ``(losses, aux)``.
        has_state: ``loss_fn`` threads mutable model state.
        everywhere: where a replicated value lives (a device's or a mesh's sharding).
        data: the micro-batch's sharding over the data axis, or None on one device.
        in_flight: how many programs the update dispatches ahead at most.
        key: ``() -> {name: value}``: the plan's parts besides the programs (the target
            batch size, the objective...), for the plan cache's key.
        fingerprint_at: ``() -> size`` at which the micro-step's code is fingerprinted
            for that key (one every model accepts).
        memory_prior: a predicted ``(intercept, slope)`` of the micro-step's peak.

    A *chunk* of ``c`` micro-steps of one size runs as one program (`scan_micro_steps`):
    ``micro(size, chunk=c)`` takes ``c * size`` examples (``[c, size, ...]`` when
    `per_device`). Chunk 1 is the plain micro-step the search compiles. ``final(size,
    chunk=c, T)`` is the same program followed by the optimizer step
    (`jax_adaptive.step.with_optimizer_step`): an update's last dispatch, when it fits.
    The programs take the update's target batch size ``T`` at run time
    (`MicroArgs.target`): one compile per size serves every target.

    Attributes:
        chunk_compiles: compiles of chunks of several micro-steps.
        final_compiles: compiles of last programs (micro-steps and the optimizer step).
        trace_counts: traces of the micro-step per size (one each, never a retrace).
        chunk_trace_counts: traces of the micro-step inside chunks and last programs,
            per size.
        per_device: each device accumulates its own gradient, reduced once per update
            (decided at `bind`: a mesh, no model state, parameters not split over the
            data axis).
        acc_struct: the accumulator the micro-steps carry (``[D, ...]`` when
            `per_device`, else the parameters' shape).
        totals_struct: the running totals the micro-steps carry (``[D]`` each when
            `per_device`, else scalars).

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, optax
        >>> from jax_adaptive.distributed import Placement
        >>> loss = lambda p, b, r: (b @ p) ** 2
        >>> ex = Executables(loss, optax.adam(0.1), Sizing("micro-step of"),
        ...                  everywhere=Placement().everywhere, key=dict)
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
        sizing: Sizing,
        *,
        has_aux: bool = False,
        has_state: bool = False,
        everywhere: jax.sharding.Sharding,
        data: jax.sharding.Sharding | None = None,
        in_flight: int = 1,
        key: Callable[[], Mapping[str, Any]],
        fingerprint_at: Callable[[], int] = lambda: 1,
        memory_prior: tuple[float, float] | None = None,
    ):
        self.loss_fn, self.optimizer, self.sizing = loss_fn, optimizer, sizing
        self.has_aux, self.has_state = has_aux, has_state
        self.everywhere, self.data, self.in_flight = everywhere, data, in_flight
        self._key, self._fingerprint_at, self._prior = key, fingerprint_at, memory_prior
        self.chunk_compiles = self.final_compiles = 0
        self.trace_counts: Counter[int] = Counter()
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

    # ------------------------------------------------------------ binding a shape

    def bind(self, state: TrainState, example_batch: Any) -> bool:
        """Binds the programs to a placed train state and an example's shape.

        Binding another shape (or another state layout) drops the chunks, last programs
        and optimizer steps of the previous one (they would not accept the new inputs)
        and binds the sizing engine to the new shape's micro-step; what the engine
        learned of a shape is kept for when it comes back.

        Returns:
            Whether anything changed.
        """
        structs = (jax.tree.map(_struct, state), example_structs(example_batch))
        if self._bound is not None and _same(self._bound, structs):
            return False
        self._bound = structs
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
        self._lowered: dict[tuple[int, int], Any] = {}  # chunks of several, by (size, chunk)
        self._compiled: dict[tuple[int, int], Executable] = {}
        self._reports: dict[tuple[int, int], dict[str, int]] = {}
        self._optimizer: dict[bool, Executable] = {}
        self._finals: dict[tuple[int, int, bool], Executable] = {}
        # per (size, chunk, with the optimizer step, whole): kept when programs go
        self._ledgers: dict[tuple[int, int, bool, bool], Ledger] = {}
        self._zero_totals: Any = None
        signature = (jax.tree.structure(structs), tuple(jax.tree.leaves(structs)))
        self.program = self.sizing.bind(signature, self._sized)
        return True

    def _sized(self) -> Sized:
        """The micro-step as the sizing engine sizes it."""
        return Sized(
            lower=lambda size: self.lower(size),
            resident=self.state_bytes(),
            inputs=lambda size: self._input_bytes(size, 1),
            key=lambda: {"example": str(self.example), **self._key()},
            in_flight=self.in_flight,
            prior=self._prior,
            fingerprint_at=self._fingerprint_at,
        )

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
            out, aux, _ = call_loss(
                self.loss_fn, self.has_aux, self.has_state, params, model_state, b, rng
            )
            check_per_example("loss_fn's losses", out, 1)
            return aux

        aux = jax.eval_shape(aux_of, state.params, state.model_state, batch, state.rng)
        if not isinstance(aux, dict):
            raise TypeError(f"aux must be a dict of per-example metrics, got {type(aux).__name__}.")
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.everywhere)
        return {name: scalar for name in ("loss", *aux)}

    def zero_totals(self) -> Any:
        """Device zeros of the running totals, made once per shape: never donated."""
        if self._zero_totals is None:
            self._zero_totals = zeros(self.totals_struct)
        return self._zero_totals

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
        self._require_bound()
        if chunk == 1:
            return self._micro_jit.lower(*self.micro_structs(size))
        if (size, chunk) not in self._lowered:
            self._lowered[size, chunk] = self._jit(size, chunk).lower(
                *self.micro_structs(size, chunk)
            )
        return self._lowered[size, chunk]

    def _jit_of(self, fn: Any) -> Any:
        return jax.jit(fn, donate_argnames=DONATED, out_shardings=self._outs)

    def _jit(self, size: int, chunk: int) -> Any:
        if size not in self._chunk_jit:
            self._chunk_jit[size] = self._jit_of(self._program(self._chunk_fn, size))
        return self._chunk_jit[size]

    def micro(self, size: int, chunk: int = 1) -> Executable:
        """The compiled program for ``chunk`` micro-steps of ``size``, compiled once in use."""
        if chunk == 1:
            return self.program.executable(size)
        key = size, chunk
        if key not in self._compiled:
            lowered = self.lower(*key)
            executable = self._compile(lambda: lowered, size)
            del self._lowered[key]
            self.chunk_compiles += 1
            self._compiled[key] = executable
            self._reports[key] = executable.report
        return self._compiled[key]

    def ledger(self, size: int, chunk: int = 1) -> Ledger:
        """Everything live on a device while programs of ``size`` run (see `Ledger`).

        The resident state is counted whole, read or not. Each of the ``in_flight``
        programs dispatched holds its transferred examples (``chunk * size``), its
        outputs that are not aliased to a donated input (the new model state) and its
        temporaries (a runtime may allocate them at dispatch).
        """
        if chunk == 1:
            return self.program.ledger(size)
        return self._ledger_of(size, chunk, whole=False, final=False)

    def _ledger_of(self, size: int, chunk: int, whole: bool, final: bool) -> Ledger:
        """`ledger` of ``micro(size, chunk)``, or of a last program: measured once."""
        key = (size, chunk, whole, final)
        if key not in self._ledgers:
            if final:
                report = self._final(size, chunk, whole).report
            else:
                if (size, chunk) not in self._reports:
                    self.micro(size, chunk)
                report = self._reports[size, chunk]
            self._ledgers[key] = program_ledger(
                report,
                resident=self.state_bytes(),
                inputs=self._input_bytes(size, chunk),
                in_flight=self.in_flight,
            )
        return self._ledgers[key]

    def _input_bytes(self, size: int, chunk: int) -> int:
        """What a program of ``chunk`` micro-steps of ``size`` transfers per call."""
        args = self.micro_structs(size, chunk)
        return tree_bytes((args.batch, args.weights, args.offset, args.k, args.target))

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
        """Frees the compiled programs of every size not in ``keep`` (measures stay)."""
        for programs in (self._compiled, self._finals):
            for key in [key for key in programs if key[0] not in keep]:
                del programs[key]
        self._lowered = {key: low for key, low in self._lowered.items() if key[0] in keep}

    def compiled_sizes(self) -> list[int]:
        """The sizes whose compiled program (of any chunk) is held now."""
        return sorted(set(self.program.compiled_sizes()) | {size for size, _ in self._compiled})

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

    def final(self, size: int, chunk: int, T: int) -> Executable:
        """An update's last ``chunk`` micro-steps of ``size`` and the optimizer step, compiled.

        It takes the arguments of ``micro(size, chunk)``, donates what it donates (the
        train state stays intact: a failure loses nothing) and returns ``(params,
        opt_state, model_state, means)`` (`jax_adaptive.step.with_optimizer_step`).
        When those micro-steps are the whole update of ``T`` examples (`whole`), it
        neither reads nor donates the accumulator and returns
        ``opt_state.acc_grads=None``: the state's, zeros between updates, stays the new
        state's. Compiled once per size, chunk and whether it is whole; `final_ledger`
        is its peak.
        """
        return self._final(size, chunk, self.whole(size, chunk, T))

    def _final(self, size: int, chunk: int, whole: bool) -> Executable:
        key = (size, chunk, whole)
        if key not in self._finals:
            s = self.state_structs
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

    def whole(self, size: int, chunk: int, T: int) -> bool:
        """Whether ``chunk`` micro-steps of ``size`` are a whole update of ``T`` examples.

        Its last program then starts from zeros instead of the state's accumulator
        (one device's: not `per_device`, whose accumulator has a device axis).
        """
        return not self.per_device and chunk == math.ceil(T / size)

    def _compile(self, lower: Any, size: int | None = None) -> Executable:
        """`compile_measured` with the engine's fault hook (for a ``size``'s compile)."""
        return compile_measured(lower, None if size is None else self.sizing.fault_hook, size)

    def new_state_bytes(self) -> int:
        """Bytes an optimizer step writes beside the state it does not donate.

        The parameters and the inner optimizer state: a lower bound of what `final`
        adds to the micro-steps' ledger.
        """
        self._require_bound()
        s = self.state_structs
        return tree_bytes((s.params, s.opt_state.inner_opt_state))

    def final_ledger(self, size: int, chunk: int, T: int) -> Ledger:
        """Everything live while `final` runs: ``ledger``'s parts, with the new state."""
        return self._ledger_of(size, chunk, self.whole(size, chunk, T), final=True)

    def optimizer_step_ledger(self, donate: bool) -> Ledger:
        """Everything live while the optimizer step runs: the state, its new outputs, temps."""
        report = self.optimizer_step(donate).report
        return program_ledger(report, resident=self.state_bytes(), inputs=0)

    # ------------------------------------------------------------ timing

    def time_program(
        self,
        executable: Executable,
        state: TrainState,
        size: int,
        T: int,
        chunk: int = 1,
        reps: int = 3,
    ) -> float:
        """The fastest of ``reps`` runs of a program of ``micro(size, chunk)``'s arguments.

        In seconds, on ``state`` and a batch of zeros, for updates of ``T`` examples,
        after a first run that warms up. ``executable`` is ``micro(size, chunk)`` or
        ``final(size, chunk, T)``. Out-of-memory errors propagate: the caller decides
        what they mean.
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
            target=np.int32(T),
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
