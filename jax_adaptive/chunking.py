"""How an update's micro-steps are dispatched: how many per program, and the last program.

`Chunking` decides, for the size the planner runs, the chunk and whether the update's
last program runs the optimizer step too (guide: docs/trainer.md, ``chunk``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Literal

import jax

from jax_adaptive.distributed import process_min
from jax_adaptive.errors import catch_oom
from jax_adaptive.executables import Executables
from jax_adaptive.memory import Executable, Ledger
from jax_adaptive.plan import chunk_length
from jax_adaptive.step import TrainState

__all__ = ["SLOWER_CHUNK", "Chunking"]

log = logging.getLogger("jax_adaptive")


_UNDECIDED: Any = object()  # the fused last program before it is decided

SLOWER_CHUNK = 2.0
"""On a CPU, a chunk whose program takes over this many times its micro-steps one by one
is not taken (`Chunking.settle`); the warning gives the ratio measured."""

DECISIVE = 4 * SLOWER_CHUNK
"""A chunk this many times slower than its micro-steps, and taking `DECISIVE_SECONDS` or
more, is decided by its first timing: load does not make that much of a difference to a
program that long (a CNN's chunk: 24 to 33 times, seconds), and each of its runs costs
that many micro-steps (the command line's CNN: 4.8 s of a 13 s run timed). A short one
is timed in full: on a loaded CPU a chunk of milliseconds once read 8 times slower."""

DECISIVE_SECONDS = 0.1


def _fits(ledger: Callable[[], Ledger], capacity: int | None) -> bool:
    """Whether the program ``ledger`` measures (compiling it if need be) fits ``capacity``."""
    measured, error = catch_oom(ledger)  # compiling may run out of memory
    return error is None and (capacity is None or measured.total <= capacity)


class Chunking:
    """The chunk and the fused last program of one size, each against its ledger, decided once.

    The planner (`jax_adaptive.planner.Planner`) owns one and makes it decide again when
    the size, the target or the limit changes.

    Args:
        executables: the compiled pieces (``ledger(size, chunk)`` measures a program of
            that many micro-steps).
        capacity: ``() -> bytes`` a program's ledger may reach (None: no limit known).
        limit: ``"auto"`` (as many micro-steps per dispatch as the capacity allows, the
            whole update at most) or the most per dispatch (`AdaptiveTrainer`'s ``chunk``).
        timed: time a chunk once against its micro-steps one by one (`settle`).
    """

    def __init__(
        self,
        executables: Executables,
        *,
        capacity: Callable[[], int | None],
        limit: int | Literal["auto"],
        timed: bool,
    ):
        self.executables, self.limit, self.timed = executables, limit, timed
        self._ledger, self._capacity = executables.ledger, capacity
        self.chunk_of: int | None = None  # decided at the size's first update
        # The last program with the optimizer step in it (None: apart), once decided.
        self._final: tuple[int, Executable] | None = _UNDECIDED
        self._speed: dict[tuple, bool] = {}  # (size, chunk, fused): not much slower

    @property
    def fused(self) -> bool | None:
        """Whether the update's last program runs the optimizer step too (None: undecided)."""
        return None if self._final is _UNDECIDED else self._final is not None

    def reset(self) -> None:
        """Forgets everything: the programs are another input shape's."""
        self.forget()
        self._speed.clear()

    def forget(self, chunk: bool = True) -> None:
        """Decides again at the next update (``chunk=False``: the agreed chunk stays)."""
        self._final = _UNDECIDED
        if chunk:
            self.chunk_of = None

    def chunk(self, size: int, T: int) -> int:
        """Micro-steps per dispatch for ``size`` in updates of ``T``, decided once.

        Under ``jax.distributed``, the shortest any process chose: all run the same programs.
        """
        if self.chunk_of is None:
            self.chunk_of = process_min(self._chunk_for(size, T))
        return self.chunk_of

    def _chunk_for(self, size: int, T: int) -> int:
        """As few dispatches as the capacity allows, the chosen chunk's own ledger checked.

        A chunk's ledger grows by its examples only: the scan reuses one micro-step's temporaries.
        """
        steps = math.ceil(T / size)
        if self.limit != "auto":
            return chunk_length(steps, self.limit)
        if steps == 1:
            return 1
        if self.executables.data is not None and not self.executables.per_device:
            return 1  # a micro-step that reduces across devices: one at a time
        capacity, most = self._capacity(), steps
        if capacity is not None:
            base, error = catch_oom(lambda: self._ledger(size, 1))
            if error is not None:
                return 1
            spare = capacity - base.total
            per = self.executables.in_flight * size * self.executables.example_bytes()
            most = 1 + max(0, spare) // per
        chunk = chunk_length(steps, most)
        while chunk > 1:
            # The whole update in one program: the one with the optimizer step, if it fits.
            whole = chunk == steps and self._may_fuse(size, steps, T, capacity)
            if whole or _fits(lambda c=chunk: self._ledger(size, c), capacity):
                break
            chunk = chunk_length(steps, chunk - 1)
        return chunk

    def final(self, size: int, T: int) -> tuple[int, Executable] | None:
        """The update's last program with the optimizer step in it, and its micro-steps.

        The last chunk when the chunk divides the micro-steps, else a single micro-step
        (`Executables.final`), when its ledger (the new state beside the old) fits.
        None: the optimizer step runs apart.
        """
        if self._final is _UNDECIDED:
            steps, chunk = math.ceil(T / size), self.chunk(size, T)
            last = chunk if steps % chunk == 0 else 1
            fused = self._may_fuse(size, last, T, self._capacity())
            self._final = (last, self.executables.final(size, last, T)) if fused else None
        return self._final

    def _may_fuse(self, size: int, chunk: int, T: int, capacity: int | None) -> bool:
        """Whether ``chunk`` micro-steps of ``size`` and the optimizer step fit one program.

        Only with one process: with several, the optimizer step's reduction keeps a program
        of its own (`jax_adaptive.update.Updater`). Compiled only when the micro-step's
        ledger and the new state, a lower bound of its own, fit.
        """
        if jax.process_count() > 1:
            return False
        if capacity is not None:
            room = capacity - self.executables.new_state_bytes()
            if not _fits(lambda: self._ledger(size, 1), room):
                return False
        return _fits(lambda: self.executables.final_ledger(size, chunk, T), capacity)

    def settle(self, state: TrainState, size: int, T: int) -> None:
        """At an update's start: the chunk the capacity allows, if it is not much slower.

        XLA:CPU runs a convolution inside a loop (a chunk's scan) with slow kernels
        (jax-ml/jax#12868). When ``timed``, the program the update would run is timed
        once on ``state`` and zeros against its micro-steps one by one (`_not_slower`);
        elsewhere a chunk is taken untimed.
        """
        if not self.timed or (chunk := self.chunk(size, T)) == 1:
            return
        final = self.final(size, T)
        fused = final is not None and final[0] == chunk
        key = (size, chunk, fused)
        if key not in self._speed:
            program = final[1] if fused else self.executables.micro(size, chunk)
            self._speed[key] = self._not_slower(state, size, T, chunk, program)
        if not self._speed[key]:
            self.chunk_of, self._final = 1, _UNDECIDED  # the last program decided anew

    def _not_slower(
        self, state: TrainState, size: int, T: int, chunk: int, program: Executable
    ) -> bool:
        """Whether ``program`` (``chunk`` micro-steps) takes at most `SLOWER_CHUNK` times them.

        Timed in turn, three times each (the fastest counts), a chunk found slower timed
        again: a busy machine must not decide. One found `DECISIVE`-ly slower is decided
        at once. True when an out-of-memory leaves it unknown: the update meets it and
        recovers.
        """
        ex = self.executables

        def timed() -> tuple[float, bool]:
            """The ratio, and whether it is decisive (`DECISIVE`, `DECISIVE_SECONDS`)."""
            ones, manys = [], []
            for _ in range(3):
                ones.append(ex.time_program(ex.micro(size), state, size, T, reps=1))
                manys.append(ex.time_program(program, state, size, T, chunk, reps=1))
                ratio = min(manys) / (chunk * min(ones))
                if min(manys) >= DECISIVE_SECONDS and ratio > DECISIVE:
                    return ratio, True
            return ratio, False

        for _ in range(2):
            out, error = catch_oom(timed)
            if error is not None or out[0] <= SLOWER_CHUNK:
                return True
            slower, decided = out
            if decided:
                break
        log.warning(
            "a program of %d micro-steps of %d took %.1f times %d micro-steps one by one "
            "(XLA:CPU runs convolutions in a loop slowly): one micro-step per dispatch",
            chunk, size, slower, chunk,
        )  # fmt: skip
        return False

    def least(self) -> None:
        """One micro-step per dispatch and the optimizer step apart, until `forget`.

        The sizes a search in the background has found so far run so: with the programs
        it compiled, no other.
        """
        self.chunk_of, self._final = 1, None

    def unchunk(self, size: int) -> None:
        """After a chunk, or the fused optimizer step, ran out of memory: the least from now on."""
        log.warning(
            "a program of %d micro-steps of %d%s ran out of memory: one micro-step per "
            "dispatch from now on, the optimizer step apart",
            self.chunk_of or 1, size, " and the optimizer step" if self.fused else "",
        )  # fmt: skip
        self.least()
