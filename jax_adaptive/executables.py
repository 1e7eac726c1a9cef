"""The jitted pieces of an update, lowered per micro-batch size for one input shape.

The micro-step is the sizing engine's program; chunks of micro-steps, the update's last
program and the optimizer step are compiled and measured here as the engine measures.
Under a mesh a loss without model state accumulates per device (docs/devices.md).
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Container, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jax_adaptive.data import example_structs
from jax_adaptive.memory import Executable, Ledger, compile_measured, program_ledger, tree_bytes
from jax_adaptive.plan import Collectives
from jax_adaptive.sharding import collective_counts
from jax_adaptive.sizing import Sized, Sizing
from jax_adaptive.step import (
    DONATED,
    MicroArgs,
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

__all__ = ["Executables"]


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))


def _shardings(structs: Any) -> Any:
    return jax.tree.map(lambda s: s.sharding, structs)


def zeros(structs: Any) -> Any:
    """Zeros of ``structs``' shapes, dtypes and shardings (one cached program when sharded)."""
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
    """Lowers and compiles an update's programs for one bound input shape.

    Args:
        loss_fn, optimizer, has_aux, has_state: as `jax_adaptive.AdaptiveTrainer` takes.
        sizing: the engine; `bind` makes ``program`` its `jax_adaptive.sizing.Binding`.
        everywhere: where a replicated value lives (a device's or a mesh's sharding).
        data: the micro-batch's sharding over the data axis, or None on one device.
        in_flight: programs dispatched ahead at most.
        key: ``() -> {name: value}``, the plan cache key's parts besides the programs.
        fingerprint_at: ``() -> size`` the micro-step's code is fingerprinted at.
        memory_prior: a predicted ``(intercept, slope)`` of the micro-step's peak.
        variant: which of several losses of the same shapes this is (a remat policy's
            name): the engine sizes each apart.

    ``micro(size, chunk=c)`` runs ``c`` micro-steps in one program, ``final(size, c, T)``
    then the optimizer step; every program takes ``T`` at run time.

    Attributes:
        chunk_compiles, final_compiles: compiles of chunks and of last programs.
        trace_counts, chunk_trace_counts: traces of the micro-step per size, alone and
            inside chunks.
        per_device: each device accumulates its own gradient (decided at `bind`).
        acc_struct, totals_struct: the accumulator and totals the micro-steps carry
            (``[D, ...]`` when `per_device`).
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
        variant: Hashable = None,
    ):
        self.loss_fn, self.optimizer, self.sizing = loss_fn, optimizer, sizing
        self.variant = variant
        self.has_aux, self.has_state = has_aux, has_state
        self.everywhere, self.data, self.in_flight = everywhere, data, in_flight
        self._key, self._fingerprint_at, self._prior = key, fingerprint_at, memory_prior
        self.chunk_compiles = self.final_compiles = 0
        self.trace_counts: Counter[int] = Counter()
        self.chunk_trace_counts: Counter[int] = Counter()
        self.per_device, self._shards = False, 1  # decided by bind
        # T is the programs' runtime argument; per device, a trace sees one device's rows.
        self._micro_fn, self._chunk_fn = (
            make_micro_step(
                loss_fn, optimizer, None, has_aux=has_aux, has_state=has_state,
                on_trace=lambda rows, counts=counts: counts.update([rows * self._shards]),
            )
            for counts in (self.trace_counts, self.chunk_trace_counts)
        )  # fmt: skip
        self._bound: tuple[Any, Any] | None = None

    # ------------------------------------------------------------ binding a shape

    def bind(self, state: TrainState, example_batch: Any) -> bool:
        """Binds the programs to a placed train state and an example's shape; True if new.

        Another shape drops the previous one's programs; the engine keeps its measures.
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
        self._collectives: dict[int, Collectives] = {}
        self.zero_totals = zeros(self.totals_struct)  # never donated: every update starts here
        leaves = tuple(jax.tree.leaves(structs))
        signature = (self.variant, jax.tree.structure(structs), leaves)
        self.program = self.sizing.bind(signature, self._sized)
        return True

    def _sized(self) -> Sized:
        """The micro-step as the sizing engine sizes it."""
        return Sized(
            lower=lambda size: self.lower(size), resident=self.state_bytes(),
            inputs=lambda size: self._input_bytes(size, 1),
            key=lambda: {"example": str(self.example), **self._key()},
            in_flight=self.in_flight, prior=self._prior, fingerprint_at=self._fingerprint_at,
        )  # fmt: skip

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

    # ------------------------------------------------------------ the micro-step

    def micro_structs(self, size: int, chunk: int = 1) -> MicroArgs:
        """The arguments of a chunk of micro-steps of ``size`` as ``ShapeDtypeStruct``s."""
        self._require_bound()
        s, data, rows = self.state_structs, self.data, (size * chunk,)
        if self.per_device and chunk > 1:  # each device holds its rows of every micro-batch
            rows, data = (chunk, size), NamedSharding(data.mesh, PartitionSpec(None, self._axis))
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((*rows, *x.shape), x.dtype, sharding=data), self.example
        )
        return MicroArgs(
            params=s.params, opt_state=s.opt_state._replace(acc_grads=None),
            acc_grads=self.acc_struct, model_state=s.model_state, totals=self.totals_struct,
            batch=batch, weights=jax.ShapeDtypeStruct(rows, jnp.float32, sharding=data),
            rng=s.rng, offset=i32, k=i32, target=i32,
        )  # fmt: skip

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
        """Everything live on a device while ``chunk`` micro-steps of ``size`` run."""
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
                report, resident=self.state_bytes(), inputs=self._input_bytes(size, chunk),
                in_flight=self.in_flight,
            )  # fmt: skip
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
        """Bytes of the whole train state and the totals on one device (with `acc_struct`)."""
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

    def collectives(self, size: int) -> Collectives | None:
        """The collectives of a micro-step of ``size`` and of the optimizer step (None: one device).

        Counted once per size in the compiled programs; one not compiled yet (a size run
        in chunks, the optimizer step run inside the last program) is compiled for it.
        """
        if self.data is None:
            return None
        if size not in self._collectives:
            if size in self.program.compiled_sizes():
                micro = self.micro(size).compiled
            else:  # compiled apart: the engine measures only the sizes it decides on
                micro = self.lower(size).compile()
            self._collectives[size] = Collectives(
                collective_counts(micro), collective_counts(self.optimizer_step(False).compiled)
            )
        return self._collectives[size]

    def final(self, size: int, chunk: int, T: int) -> Executable:
        """An update's last ``chunk`` micro-steps of ``size``, then the optimizer step.

        It takes ``micro(size, chunk)``'s arguments, donates what it donates and returns
        ``(params, opt_state, model_state, means)`` (`jax_adaptive.step.with_optimizer_step`).
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
        """Whether ``chunk`` micro-steps of ``size`` are a whole update of ``T`` (one device's)."""
        return not self.per_device and chunk == math.ceil(T / size)

    def _compile(self, lower: Any, size: int | None = None) -> Executable:
        """`compile_measured` with the engine's fault hook (for a ``size``'s compile)."""
        return compile_measured(lower, None if size is None else self.sizing.fault_hook, size)

    def new_state_bytes(self) -> int:
        """Bytes an optimizer step writes beside the state (a lower bound of `final`'s extra)."""
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
        self, executable: Executable, state: TrainState, size: int, T: int, chunk: int = 1,
        reps: int = 3, warm: bool = True,
    ) -> float:  # fmt: skip
        """The fastest of ``reps`` runs of a chunk or last program on zeros, in seconds.

        ``warm``: one run first, untimed (the first run of a program allocates).

        Out-of-memory propagates: the caller decides what it means.
        """
        structs = self.micro_structs(size, chunk)
        w = structs.weights
        fixed = structs._replace(  # what the program reads and does not donate
            params=state.params, opt_state=state.opt_state._replace(acc_grads=None),
            model_state=state.model_state, batch=zeros(structs.batch),
            weights=jnp.ones(w.shape, w.dtype, device=w.sharding), rng=state.rng,
            offset=np.int32(0), k=np.int32(chunk + 1), target=np.int32(T),
            totals=zeros(structs.totals),
        )  # fmt: skip
        seconds = []
        for _ in range(reps + warm):
            args = fixed._replace(acc_grads=zeros(structs.acc_grads))  # donated: fresh each run
            start = time.perf_counter()
            jax.block_until_ready(executable.compiled(*args))
            seconds.append(time.perf_counter() - start)
        return min(seconds[warm:])


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
