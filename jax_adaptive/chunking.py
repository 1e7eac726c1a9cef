"""How an update's micro-steps are dispatched: how many per program, and the last program.

`Chunking` decides, for the size the planner runs, the chunk (micro-steps scanned in
one program: as few dispatches as the capacity leaves room for) and whether the
update's last program runs the optimizer step too (one dispatch and one wait fewer),
each against its `jax_adaptive.Ledger`. On a CPU it also times a chunk once against
its micro-steps one by one: XLA:CPU runs some loops slowly. The planner
(`jax_adaptive.planner.Planner`) owns one and makes it decide again when the size,
the target or the limit changes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal

import jax

from jax_adaptive.distributed import process_min
from jax_adaptive.errors import catch_oom
from jax_adaptive.executables import Executables
from jax_adaptive.memory import Ledger
from jax_adaptive.plan import chunk_length
from jax_adaptive.sizing import Executable
from jax_adaptive.step import TrainState

__all__ = ["SLOWER_CHUNK", "Chunking"]

log = logging.getLogger("jax_adaptive")


class _Undecided:
    """The fused last program before it is decided."""


_UNDECIDED = _Undecided()

SLOWER_CHUNK = 2.0
"""On a CPU, a chunk whose program takes over this many times its micro-steps run one by
one is not taken (`Chunking.settle`): a chunk saves dispatches, and the slow loops it
guards against cost several times that (the warning gives the ratio measured)."""


def _fits(ledger: Callable[[], Ledger], capacity: int | None) -> bool:
    """Whether the program ``ledger`` measures (compiling it if need be) fits ``capacity``.

    Examples:
        >>> from jax_adaptive.memory import Ledger
        >>> _fits(lambda: Ledger(state=6, in_flight=2, program=2), capacity=10)
        True
    """
    measured, error = catch_oom(ledger)  # compiling may run out of memory
    return error is None and (capacity is None or measured.total <= capacity)


class Chunking:
    """The chunk and the fused last program of one size, each decided once for it.

    Args:
        executables: the compiled pieces (``ledger(size, chunk)`` measures a program of
            that many micro-steps).
        capacity: ``() -> bytes`` a program's ledger may reach (None: no limit known).
        limit: ``"auto"`` (as many micro-steps per dispatch as the capacity allows, the
            whole update at most) or the most per dispatch (`AdaptiveTrainer`'s
            ``chunk``).
        timed: time a chunk once against its micro-steps one by one (a CPU, one
            process), and run one micro-step per dispatch when it is much slower.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
        >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: b * p, optax.sgd(0.1),
        ...                              target_batch_size=8, micro_batch_size=2)
        >>> state = trainer.init(jnp.zeros(()), np.ones(8, np.float32))
        >>> state, _ = trainer.step(state, np.ones(8, np.float32))
        >>> trainer.plan_info.chunk, trainer.plan_info.fused  # Chunking's decisions
        (4, True)
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
        self._final: tuple[int, Executable] | _Undecided | None = _UNDECIDED
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
        """Decides again at the next update: the size, the target or the limit changed.

        ``chunk=False`` keeps the chunk (several processes agreed on it together).
        """
        self._final = _UNDECIDED
        if chunk:
            self.chunk_of = None

    def chunk(self, size: int, T: int) -> int:
        """Micro-steps per dispatch for ``size`` in updates of ``T``, decided once.

        Every process runs the same programs: under ``jax.distributed`` the chunk is
        the shortest any process chose (their capacities may differ).
        """
        if self.chunk_of is None:
            self.chunk_of = process_min(self._chunk_for(size, T))
        return self.chunk_of

    def _chunk_for(self, size: int, T: int) -> int:
        """Micro-steps per dispatch for ``size``: as few dispatches as the capacity allows.

        A chunk's ledger grows by its examples only (the scan reuses one micro-step's
        temporaries); the chosen chunk is compiled and its own ledger checked.
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

        The last dispatch of an update (the last chunk when the chunk divides the
        micro-steps, else a single micro-step) runs the optimizer step too, one dispatch
        and one wait fewer per update (`Executables.final`), when its ledger fits: the
        new state is then allocated beside the old one, which stays intact. Decided
        (compiled) at the size's first update and again after the size or the limit
        changes; never with several processes. None: the optimizer step runs apart.
        """
        if self._final is _UNDECIDED:
            steps, chunk = math.ceil(T / size), self.chunk(size, T)
            last = chunk if steps % chunk == 0 else 1
            fused = self._may_fuse(size, last, T, self._capacity())
            self._final = (last, self.executables.final(size, last, T)) if fused else None
        return self._final

    def _may_fuse(self, size: int, chunk: int, T: int, capacity: int | None) -> bool:
        """Whether ``chunk`` micro-steps of ``size`` and the optimizer step fit one program.

        Only with one process: with several, micro-steps hold no collective so that one
        that runs out of memory leaves no other waiting (`jax_adaptive.update.Updater`),
        and the optimizer step's reduction keeps a program of its own. The program is
        compiled only when the micro-step's ledger and the new state, a lower bound of
        its own, fit.
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

        XLA:CPU runs a convolution inside a loop (a chunk's scan) with slow kernels: the
        Flax MNIST example's CNN runs a chunk several times slower than its micro-steps
        dispatched one at a time (jax-ml/jax#12868; the warning gives the ratio). When
        ``timed``, the program the update would run (the chunk, or the whole update with
        the optimizer step) is timed once on ``state`` and a batch of zeros against
        ``chunk`` runs of the micro-step (the user's loss runs then, on zeros); more
        than `SLOWER_CHUNK` times slower, the update runs one micro-step per dispatch.
        Elsewhere a chunk is taken for the dispatches it saves, untimed.
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
        """Whether ``program`` (``chunk`` micro-steps) is not much slower than one by one.

        At most `SLOWER_CHUNK` times the micro-steps one by one. The two are timed in
        turn, three times each (the fastest of each counts), and a chunk found slower is
        timed again: a busy machine must not decide. True when an out-of-memory leaves
        it unknown: the update meets it and recovers.
        """
        ex = self.executables

        def ratio() -> float:
            ones, manys = [], []
            for _ in range(3):
                ones.append(ex.time_program(ex.micro(size), state, size, T, reps=1))
                manys.append(ex.time_program(program, state, size, T, chunk, reps=1))
            return min(manys) / (chunk * min(ones))

        for _ in range(2):
            slower, error = catch_oom(ratio)
            if error is not None or slower <= SLOWER_CHUNK:
                return True
        log.warning(
            "a program of %d micro-steps of %d took %.1f times %d micro-steps one by one "
            "(XLA:CPU runs convolutions in a loop slowly): one micro-step per dispatch",
            chunk, size, slower, chunk,
        )  # fmt: skip
        return False

    def unchunk(self, size: int) -> None:
        """After a program of several micro-steps, or the optimizer step's, ran out of memory.

        From then on, for this size: one micro-step per dispatch and the optimizer
        step apart, the least each program needs.
        """
        log.warning(
            "a program of %d micro-steps of %d%s ran out of memory: one micro-step per "
            "dispatch from now on, the optimizer step apart",
            self.chunk_of or 1,
            size,
            " and the optimizer step" if self.fused else "",
        )
        self.chunk_of, self._final = 1, None
