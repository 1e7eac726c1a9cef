"""Which sizes fit: one size's verdict, the search for the largest, what a real OOM teaches.

The trainer's `jax_adaptive.planner.Planner` (micro-batches), `jax_adaptive.Evaluator`
(evaluation batches) and `jax_adaptive.AdaptiveStep` (a step the user builds) each know
how to compile a size and count its `jax_adaptive.Ledger`; `SizeSearch` does the rest
for all three: it compares a size's ledger with the capacity, remembers the lower
capacity that real out-of-memory errors teach, records every `SizeTrial`, and finds the
largest size that fits with `jax_adaptive.search_max_size`, guided by the memory model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from jax_adaptive.errors import NothingFitsError, SimulatedOutOfMemory, catch_oom
from jax_adaptive.memory import Ledger, learned_capacity
from jax_adaptive.plan import DecidedBy, SizeTrial
from jax_adaptive.search import search_max_size

__all__ = ["SizeSearch"]

log = logging.getLogger("jax_adaptive")

Propose = Callable[[int | None, int | None], int | None]


class SizeSearch:
    """Decides whether sizes fit and searches the largest, for one kind of program.

    Args:
        what: how a size is named in logs and errors, followed by the size
            (``"micro-step of"``: "micro-step of 64 does not fit").
        ledger: ``ledger(size)``, the size's `jax_adaptive.Ledger`, compiling it if need
            be; out-of-memory errors while compiling are caught.
        capacity: ``capacity()``, the bytes a ledger may reach (None: unknown).
        known: ``known(size)``, the peak bytes measured for the size before, or None.
        propose: ``propose(capacity)``, the memory model's next guess for the search.
        lower: ``lower(size)``, tracing the user's code for a size not measured yet,
            outside the out-of-memory guard so that its errors propagate as themselves.
        headroom: the fraction below a failed peak that a first real out-of-memory
            teaches (`jax_adaptive.memory.learned_capacity`).

    Attributes:
        search_log: every `SizeTrial`, in order.
        learned_cap: the capacity real out-of-memory errors taught (None: none yet).

    Example:
        >>> from jax_adaptive.memory import Ledger, MemoryModel
        >>> model = MemoryModel()
        >>> def ledger(size):  # 100 bytes per example, 1,000 resident
        ...     model.add(size, 1_000 + 100 * size)
        ...     return Ledger(state=1_000, in_flight=100 * size, program=0)
        >>> sizes = SizeSearch(
        ...     "micro-step of", ledger=ledger, capacity=lambda: 5_000,
        ...     known=model.points.get, propose=model.propose,
        ... )  # fmt: skip
        >>> sizes.largest(hi=64, reason="init")
        40
        >>> [(t.size, t.fits) for t in sizes.search_log][-2:]  # the exact edge
        [(40, True), (41, False)]
    """

    def __init__(
        self,
        what: str,
        *,
        ledger: Callable[[int], Ledger],
        capacity: Callable[[], int | None],
        known: Callable[[int], int | None],
        propose: Callable[[int], Propose],
        lower: Callable[[int], Any] | None = None,
        headroom: float = 0.0,
    ):
        self.what = what
        self._ledger, self._capacity, self._known = ledger, capacity, known
        self._propose, self._lower, self.headroom = propose, lower, headroom
        self.search_log: list[SizeTrial] = []
        self.learned_cap: int | None = None

    def guide_capacity(self) -> int | None:
        """The capacity the search aims under: the real one, or the learned one if lower."""
        caps = (self._capacity(), self.learned_cap)
        return min([c for c in caps if c is not None], default=None)

    def check(self, size: int, ledger: Ledger | None = None) -> None:
        """Raises `jax_adaptive.SimulatedOutOfMemory` when the ledger exceeds the capacity."""
        capacity = self._capacity()
        needed = (ledger or self._ledger(size)).total
        if capacity is not None and needed > capacity:
            raise SimulatedOutOfMemory(needed, capacity, what=f"{self.what} {size}")

    def fits(self, size: int, reason: str) -> bool:
        """Decides one size: compiles it (once ever), compares its ledger, records the trial.

        A size fails when compiling it runs out of memory, when its ledger exceeds the
        capacity, or when it lies above the capacity learned from real runs.
        """
        start = time.perf_counter()
        measured = self._known(size) is not None
        if not measured and self._lower is not None:
            self._lower(size)  # the user's code traces here: its errors propagate
        ledger, error = catch_oom(lambda: self._ledger(size))  # compiling may run out
        decided: DecidedBy = "compile" if ledger is None else "cache" if measured else "estimate"
        if ledger is not None:
            capacity = self._capacity()
            if capacity is not None and ledger.total > capacity:
                error = "above the capacity"
            elif self.learned_cap is not None and ledger.total > self.learned_cap:
                decided, error = "learned", "above the capacity learned from real runs"
        self.record(size, error is None, ledger, time.perf_counter() - start, decided, reason)
        return error is None

    def largest(
        self, *, hi: int, reason: str, lo: int = 1, multiple_of: int = 1, least: int = 1
    ) -> int:
        """The largest size in ``[max(lo, least), hi]`` that fits.

        Multiples of ``multiple_of`` (itself a multiple of ``least``) are preferred;
        when none fits, multiples of ``least`` below ``multiple_of`` are tried.

        Raises:
            NothingFitsError: not even the smallest candidate fits; says the bytes it
                needs and the bytes available.
        """
        lo = max(lo, least)
        if hi < lo:
            raise self.nothing_fits(lo, [])
        capacity = self.guide_capacity()
        propose = self._propose(capacity) if capacity is not None else None
        multiple = multiple_of if hi // multiple_of * multiple_of >= lo else least

        def fits(size: int) -> bool:
            return self.fits(size, reason)

        try:
            try:
                found = search_max_size(fits, lo=lo, hi=hi, multiple_of=multiple, propose=propose)
            except NothingFitsError:
                if multiple == least or lo >= multiple:
                    raise
                found = search_max_size(
                    fits, lo=least, hi=multiple - 1, multiple_of=least, propose=propose
                )
        except NothingFitsError as exc:
            raise self.nothing_fits(exc.smallest, exc.trials) from None
        return found.size

    def nothing_fits(self, size: int, trials: list) -> NothingFitsError:
        """The one error for a size that does not fit, with the bytes it needs."""
        needed, capacity = self._known(size), self.guide_capacity()
        return NothingFitsError(
            size,
            trials,
            detail=f"the {self.what} {size} needs "
            f"{f'{needed:,}' if needed is not None else '?'} bytes (estimate) and "
            f"{f'{capacity:,}' if capacity is not None else 'fewer'} bytes are available",
        )

    def from_cache(
        self, plan_cache: Any, key: Callable[[], str], bound: int, reason: str
    ) -> int | None:
        """The size a run of the same job stored in ``plan_cache`` (recorded), or None.

        ``key``: makes the job's key (it may lower the program: called only with a
        cache). ``bound``: the largest size that makes sense (an entry above it is
        ignored). None without a plan cache.
        """
        if plan_cache is None:
            return None
        start = time.perf_counter()
        entry = plan_cache.plan(key(), bound)
        if entry is None:
            return None
        size, estimate = entry["micro_batch_size"], entry.get("estimated_bytes")
        self.record(size, True, estimate, time.perf_counter() - start, "plan cache", reason)
        return size

    def learn(self, peak: int, first: bool) -> None:
        """A real out-of-memory at a ledger of ``peak``: the capacity lies below it."""
        self.learned_cap = learned_capacity(peak, self.headroom, first, self.learned_cap)

    def record(
        self,
        size: int,
        fits: bool,
        ledger: Ledger | int | None,
        seconds: float,
        decided_by: DecidedBy,
        reason: str,
    ) -> SizeTrial:
        """Appends a `SizeTrial` to ``search_log`` and logs it at INFO; returns it.

        ``ledger``: the size's `jax_adaptive.Ledger` (its parts are recorded), its
        total bytes alone, or None when unknown. `fits` records its own trials; this is
        also for trials decided elsewhere (a plan cache, a run that ran out of memory).
        """
        parts = (
            (ledger.state, ledger.in_flight, ledger.program) if isinstance(ledger, Ledger) else ()
        )
        total = ledger.total if isinstance(ledger, Ledger) else ledger
        trial = SizeTrial(size, fits, total, seconds, decided_by, reason, *parts)
        self.search_log.append(trial)
        log.info(
            "%s %d %s (%s, %s bytes)",
            self.what,
            size,
            "fits" if fits else "does not fit",
            decided_by,
            f"{total:,}" if total is not None else "?",
        )
        return trial
