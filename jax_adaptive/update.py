"""One exact update: the micro-steps of a target batch, then the optimizer step.

How an update runs and recovers: docs/recovery.md. A micro-step donates only the
accumulator, so an out-of-memory leaves the parameters, the optimizer state and the model
state alive: the update goes on from the last micro-step that survived (or its host
copy) or starts again. The fused last program (`jax_adaptive.chunking.Chunking.final`)
donates what a micro-step donates, never the state; as the whole update it starts from
zeros and leaves the state's accumulator (zeros between updates) unread, to be the new
state's. When each device accumulates its own gradient (`Executables.per_device`), an
update starts from a fresh per-device accumulator and releases the state's: a device
holds one, as the ledger counts.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import numpy as np

from jax_adaptive.data import micro_batches
from jax_adaptive.distributed import Placement, agreed, host_copy, place, process_min
from jax_adaptive.errors import OptimizerStepOutOfMemory, StateLostError, catch_oom, is_oom
from jax_adaptive.executables import zeros
from jax_adaptive.memory import tree_bytes
from jax_adaptive.planner import Planner
from jax_adaptive.step import Batch, MicroArgs, TrainState, live_source

__all__ = ["Updater"]


class _Saved(NamedTuple):
    arrays: Any  # host copies of (acc, model_state, totals)
    mini_step: int
    offset: int
    steps: int


@dataclasses.dataclass
class _Progress:
    """How far the current update got: what a failed micro-step lets it go on from."""

    acc: Any
    mini_step: Any
    model_state: Any
    totals: Any
    offset: int = 0  # the first example not yet accumulated
    steps: int = 0  # micro-steps accumulated
    saved: _Saved | None = None  # a host copy of a point the update can go on from
    finishing: bool = False  # the last program, with the optimizer step in it, is running
    done: Any = None  # its (params, opt_state, model_state, means), once it ran

    def kept(self) -> tuple[Any, Any, Any]:
        return self.acc, self.model_state, self.totals


def _is_deleted(tree: Any) -> bool:
    for leaf in jax.tree.leaves(tree):  # a loop: this runs at every update
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            return True
    return False


def _ready(out: tuple) -> tuple:
    """``out`` once the program that made it finished: its outputs finish together."""
    jax.block_until_ready(out[-1])
    return out


def _live_inputs(batch: Batch, weights: np.ndarray) -> Batch:
    """``batch`` with each row of weight 0 holding a live row's inputs (`live_source`).

    Its own inputs could give a NaN loss, whose zero cotangent still makes NaN partials.
    Done before the micro-batches are cut; a batch all live (or none) is passed as it is.
    """
    live = weights != 0
    if live.all() or not live.any():
        return batch
    source = live_source(weights)
    return jax.tree.map(lambda x: x[source], batch)


def _release(tree: Any) -> None:
    """Frees the device buffers of ``tree``'s arrays now, as donating them would."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


class Updater:
    """Runs exact updates with the sizes a `jax_adaptive.planner.Planner` gives.

    Args:
        planner: the plan (and, through it, the compiled pieces).
        placement: where micro-batches go.
        in_flight: the most micro-steps dispatched and not finished at once.

    Attributes:
        host_bytes: bytes copied to the host so far (saves that make failures cheap,
            and the snapshot before a donating optimizer step).
    """

    def __init__(self, planner: Planner, placement: Placement, in_flight: int = 1):
        if in_flight < 1:
            raise ValueError(f"{in_flight=} must be at least 1.")
        self.planner, self.executables = planner, planner.executables
        self.chunking, self.sizing = planner.chunking, planner.sizing
        self.placement, self.in_flight = placement, in_flight
        self.host_bytes = 0
        self._ints: dict[int, jax.Array] = {}  # device int32 scalars the programs take

    @property
    def T(self) -> int:
        """The target batch size of the update: the planner's (`Planner.set_target`)."""
        return self.planner.target_batch_size

    def run(self, state: TrainState, batch: Batch, weights: Any = None) -> tuple[TrainState, dict]:
        """One update of ``state`` on ``batch`` of ``T`` examples (``weights``: 1 by default).

        The programs take ``T`` at run time: a new ``T`` compiles no size again.
        """
        self.planner.start_update(state)
        if weights is None:  # every row live: nothing to gather
            weights = self._ones(self.placement.share(self.T))
        else:
            weights = np.asarray(weights, np.float32)
            batch = _live_inputs(batch, weights)
        progress = self._fresh(state)
        failed = False
        while True:
            size = self.planner.size
            try:
                self._accumulate(state, (batch, weights), size, progress, cautious=failed)
                break
            except Exception as exc:
                if not is_oom(exc):
                    raise
                finishing, progress.finishing = progress.finishing, False
                if self.chunking.chunk(size, self.T) > 1 or finishing:
                    self.chunking.unchunk(size)  # the extra of a chunk or the optimizer step's
                elif self.planner.fixed is not None:
                    raise
                else:
                    self.planner.shrink(exc, size)
                # Go on from the micro-step that failed when what came before survived;
                # else start the update again from the state, which nothing donated.
                salvaged = self._salvage(state, progress)
                if not process_min(salvaged is not None):  # all go on, or all start again
                    salvaged = None
                progress = salvaged or self._fresh(state)
                failed = True
        out = self._apply(state, progress)
        self.planner.finish_update()
        return out

    # ------------------------------------------------------------ micro-steps

    def _fresh(self, state: TrainState) -> _Progress:
        acc, ex = state.opt_state.acc_grads, self.executables
        if ex.per_device:  # the state's zeros, as a micro-step would have donated them
            _release(acc)
            acc = zeros(ex.acc_struct)
        elif _is_deleted(acc):  # donated to a micro-step that failed
            acc = zeros(ex.acc_struct)
        return _Progress(acc, state.opt_state.mini_step, state.model_state, ex.zero_totals)

    def _accumulate(self, state, batch, size: int, p: _Progress, cautious: bool) -> None:
        """Runs the micro-steps of ``size`` from ``p.offset`` to the end of the batch.

        A chunk at a time (the last ones one at a time when fewer than a chunk remain),
        the last program with the optimizer step when fused (its results in ``p.done``),
        at most ``in_flight`` programs dispatched and not finished. ``cautious`` (after
        an out-of-memory in this update) and a program's first run wait for each program
        and keep a host copy of its result: a failure costs one program, not the update.
        """
        T = self.T
        self.chunking.settle(state, size, T)  # the chunk, timed once on a CPU
        chunk, final = self.chunking.chunk(size, T), self.chunking.final(size, T)
        programs: dict[int, Any] = {}  # per length: compiled and checked at its first use
        ran = (size, chunk, final is not None)
        cautious = cautious or not self.planner.program.has_run(ran)
        remaining = math.ceil((T - p.offset) / size)
        k = self._int(p.steps + remaining + 1)  # never emits: the optimizer step does
        running: collections.deque = collections.deque()  # each program's mini_step
        while p.offset < T:
            while len(running) >= self.in_flight:
                jax.block_until_ready(running.popleft())
            if cautious and p.steps:  # the previous program must fail inside the try
                agreed(lambda: self._save(p), size)
                self.planner.program.ran()
            steps = chunk if math.ceil((T - p.offset) / size) >= chunk else 1
            end = min(p.offset + steps * size, T)
            last = final is not None and end == T and steps == final[0]
            if last:
                program = final[1].compiled
            elif steps in programs:
                program = programs[steps]
            else:  # compiled and checked at its first use; a failure here is agreed
                program = programs[steps] = agreed(lambda s=steps: self._program(size, s), size)
            examples, weights = self._rows(batch, p.offset, steps * size)
            examples, weights = self.placement.micro_batch(
                (examples, weights), split=steps if self.executables.per_device else 1
            )
            args = MicroArgs(
                state.params, state.opt_state._replace(acc_grads=None, mini_step=p.mini_step),
                p.acc, p.model_state,
                p.totals, examples, weights, state.rng, self._int(p.offset), k, self._int(T),
            )  # fmt: skip
            p.finishing = last  # a late failure of the last program must surface as its own
            out = self._execute(program, args, size)
            if last:
                # One program's outputs are ready (or failed) together: wait on one.
                p.done = agreed(lambda out=out: _ready(out), size)
            else:
                p.acc, p.mini_step, p.model_state, p.totals = out
                running.append(p.mini_step)
            p.finishing = False
            p.offset, p.steps = end, p.steps + steps
            del examples, weights, args, out  # the transferred examples live while they run only
        if p.done is None:  # a late (asynchronous) failure must surface as the program's
            agreed(lambda: self._save(p) if cautious else jax.block_until_ready(p.kept()), size)
        self.planner.program.ran(ran)

    def _int(self, value: int) -> jax.Array:
        """``value`` as an int32 on the devices, made once: a host scalar is a transfer per call."""
        scalar = self._ints.get(value)
        if scalar is None:
            if len(self._ints) >= 64:  # offsets of many sizes and targets: start afresh
                self._ints.clear()
            scalar = self._ints[value] = place(np.int32(value), self.placement.everywhere)
        return scalar

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _ones(T: int) -> np.ndarray:
        """Weights of 1, read-only: every update starts from them."""
        ones = np.ones(T, np.float32)
        ones.flags.writeable = False
        return ones

    def _rows(self, batch: tuple[Batch, np.ndarray], start: int, n: int) -> tuple[Batch, Any]:
        """Examples ``start`` to ``start + n`` and their weights, padded: padding weighs 0.

        With several processes, each holds its share of those rows: ``start`` and ``n``
        (multiples of the data shards, or ``T``) count them over all processes.
        """
        P = self.placement.processes
        start, n = start // P, n // P
        if start == 0 and n == self.T // P:
            return batch  # the whole batch: nothing to cut
        piece = next(micro_batches(batch, n, start=start))
        examples, weights = piece.batch
        return examples, np.where(piece.mask, weights, np.float32(0))

    def _program(self, size: int, steps: int) -> Any:
        """The compiled program of ``steps`` micro-steps of ``size``, if its ledger fits."""
        executable = self.executables.micro(size, steps)
        self.planner.check(size, steps)
        return executable.compiled

    def _execute(self, program: Any, args: MicroArgs, size: int) -> Any:
        """Runs one program of micro-steps (the fault hook first), agreed between processes.

        Under ``jax.distributed`` a per-device micro-step runs no collective: each process
        runs it to its end (an injected fault stands for such a run), then all agree
        whether any ran out of memory. An SPMD one reduces inside its run: they agree
        before it runs.
        """
        hook = self.sizing.fault_hook

        def run() -> Any:
            if hook is not None:
                hook.before_execution(size, args)
            return program(*args)

        if jax.process_count() == 1:
            return run()
        if self.executables.per_device:
            return agreed(lambda: jax.block_until_ready(run()), size)
        if hook is not None:
            agreed(lambda: hook.before_execution(size, args), size)
        return program(*args)

    def _save(self, p: _Progress) -> None:
        """Copies what the last micro-step changed to the host.

        It blocks first: that raises a failed run's error, where reading a failed
        buffer straight away can abort the process on XLA:CPU.
        """
        jax.block_until_ready((*p.kept(), p.mini_step))
        arrays = host_copy(p.kept())
        self.host_bytes += tree_bytes(arrays)
        p.saved = _Saved(arrays, int(p.mini_step), p.offset, p.steps)

    def _salvage(self, state: TrainState, p: _Progress) -> _Progress | None:
        """The progress of a failed update if it can go on, else None (start it again).

        It goes on from the device buffers when the failure left them alive (a simulated
        limit, an out-of-memory at dispatch), else from the host copy of the last
        micro-step that a new size's first run keeps.
        """
        if p.steps == 0:
            return None
        # A failure may have surfaced late, poisoning buffers still alive.
        if (
            not _is_deleted(p.kept())
            and catch_oom(lambda: jax.block_until_ready(p.kept()))[1] is None
        ):
            return p
        if p.saved is None:
            return None
        saved, ex = p.saved, self.executables
        structs = (ex.acc_struct, ex.state_structs.model_state, ex.totals_struct)
        shardings = jax.tree.map(lambda s: s.sharding, structs)
        acc, model_state, totals = place(saved.arrays, shardings)
        mini_step = place(np.int32(saved.mini_step), state.opt_state.mini_step.sharding)
        return _Progress(acc, mini_step, model_state, totals, saved.offset, saved.steps, saved)

    # ------------------------------------------------------------ the optimizer step

    def _apply(self, state: TrainState, p: _Progress) -> tuple[TrainState, dict[str, Any]]:
        if p.done is not None:  # the last program ran the optimizer step
            params, opt_state, model_state, means = p.done
            if opt_state.acc_grads is None:  # a whole update's: it left p.acc, zeros, unread
                opt_state = opt_state._replace(acc_grads=p.acc)
            return TrainState(params, opt_state, model_state, state.rng), self._metrics(means, p)
        executable, donating = self.planner.optimizer_step()
        opt = state.opt_state._replace(acc_grads=p.acc, mini_step=p.mini_step)
        inputs = (state.params, opt, p.totals, np.int32(p.steps + 1), np.int32(self.T))
        # A donating call that fails deletes its inputs: keep a host copy for its first
        # run. A call that does not donate loses nothing: no copy.
        snapshot = None
        if donating and not self.planner.program.has_run(("optimizer step", donating)):
            snapshot = host_copy((state.params, state.opt_state._replace(acc_grads=None)))
            self.host_bytes += tree_bytes(snapshot)
        out, error = catch_oom(lambda: jax.block_until_ready(executable.compiled(*inputs)))
        if error is not None:
            raise self._optimizer_failed(state, inputs, snapshot) from error
        params, opt_state, means = out
        self.planner.program.ran(("optimizer step", donating))
        return TrainState(params, opt_state, p.model_state, state.rng), self._metrics(means, p)

    def _metrics(self, means: dict[str, Any], p: _Progress) -> dict[str, Any]:
        return {
            **means,
            "micro_batch_size": self.planner.size,
            "accumulation_steps": p.steps,
            "examples": self.T,
        }

    def _optimizer_failed(self, state: TrainState, inputs: tuple, snapshot: Any) -> Exception:
        """The error for an optimizer step that ran out of memory, with the state kept."""
        params, opt = inputs[:2]
        structs = self.executables.state_structs
        if _is_deleted(inputs[:2]):
            if snapshot is None:
                return StateLostError(
                    "the optimizer step, donating the train state because the state twice "
                    "does not fit, ran out of memory inside its run and XLA deleted the "
                    "state: restore it from your last checkpoint, and leave more memory free."
                )
            shardings = jax.tree.map(
                lambda s: s.sharding, (structs.params, structs.opt_state._replace(acc_grads=None))
            )
            params, opt = place(snapshot, shardings)
        restored = TrainState(
            params,
            opt._replace(
                acc_grads=zeros(structs.opt_state.acc_grads),
                mini_step=zeros(structs.opt_state.mini_step),
            ),
            state.model_state,
            state.rng,
        )
        return OptimizerStepOutOfMemory(restored)
