"""One input signature's program in the sizing engine: its ledgers, search, plan and shrink.

A client describes its program for one signature as a `Sized`; `jax_adaptive.sizing.Sizing`
binds it once as a `Binding`, which compiles and measures each size once, searches the
largest that fits, keeps the plan in the plan cache, and after an out-of-memory decides
whether the size runs again or shrinks (docs/memory.md, docs/recovery.md).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from jax_adaptive.errors import (
    NothingFitsError,
    PeerOutOfMemory,
    SimulatedOutOfMemory,
    catch_oom,
)
from jax_adaptive.memory import (
    Executable,
    Ledger,
    MemoryModel,
    compile_measured,
    compile_side_by_side,
    device_capacity,
    learned_capacity,
    program_ledger,
)
from jax_adaptive.plan import DecidedBy, SearchCost
from jax_adaptive.plan_cache import plan_key
from jax_adaptive.release import ReleaseWatch
from jax_adaptive.search import search_max_size
from jax_adaptive.timing import Timed

if TYPE_CHECKING:
    from jax_adaptive.sizing import Sizing

__all__ = ["Binding", "Sized", "log"]

log = logging.getLogger("jax_adaptive")
if not log.handlers:  # say what the search does unless the user set up this logger
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("jax_adaptive: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class Sized(NamedTuple):
    """What a client says of the program it sizes, for one input signature.

    Attributes:
        lower: ``size -> jax.stages.Lowered`` (the user's code traces here).
        resident: bytes live whatever the size (counted whole, read or not).
        inputs: ``size -> bytes`` each call transfers.
        key: ``() -> {name: value}``: the plan cache key's parts besides the device,
            the limits and the code.
        in_flight: calls dispatched at once (each holds inputs, outputs, temporaries).
        off_line: a size whose peak lies off the others' line, left out of the guesses.
        prior: a predicted ``(intercept, slope)`` of the peak against the size.
        fingerprint_at: ``() -> size`` whose lowered text fingerprints the program.
    """

    lower: Callable[[int], Any]
    resident: int
    inputs: Callable[[int], int]
    key: Callable[[], Mapping[str, Any]]
    in_flight: int = 1
    off_line: int | None = None
    prior: tuple[float, float] | None = None
    fingerprint_at: Callable[[], int] = lambda: 1


class Binding:
    """What the engine knows of one signature's program, and its decisions on it.

    Attributes:
        sized: what the client said of the program.
        memory_model: the `jax_adaptive.memory.MemoryModel` of the sizes measured.
        size: the size in use (None before `use`).
        largest: the largest size found to fit (None before a search).
        plans: the client's own memory of plans, by what decided them.
        learned_cap: the capacity real out-of-memory errors taught, or None.
        timed: the plans timed for the size in use and the one chosen (`timed_fastest`,
            or the plan cache's), or None.
        search: what the last search cost (`jax_adaptive.plan.SearchCost`), or None.
    """

    def __init__(self, engine: Sizing, sized: Sized):
        self.engine, self.sized = engine, sized
        self.memory_model = MemoryModel(prior=sized.prior)
        self.size: int | None = None
        self.largest: int | None = None
        self.plans: dict[Hashable, int] = {}
        self.learned_cap: int | None = None
        self.timed: Timed | None = None
        self.search: SearchCost | None = None
        self._ledgers: dict[int, Ledger] = {}
        self._lowered: dict[int, Any] = {}
        self._programs: dict[int, Executable] = {}
        self._ahead: dict[int, Any] = {}  # compiled side by side, not yet asked: a Future
        self._fingerprint: str | None = None
        self._streak = 0  # out-of-memory errors since a run last succeeded
        self._real_ooms = 0  # real out-of-memory errors since `start`
        self._ran: set[Hashable] = set()  # what ran to its end (a size, a program's key)
        self._again = False  # a size that ran was given another run since `start`
        self._release = ReleaseWatch(engine.device)  # the last call's buffers coming back

    def guide_capacity(self) -> int | None:
        """The capacity the search aims under: the real one, or the learned one if lower."""
        caps = (self.engine.capacity(), self.learned_cap)
        return min([c for c in caps if c is not None], default=None)

    # ------------------------------------------------------------ programs and ledgers

    def lower(self, size: int) -> Any:
        """Traces the program at ``size`` (once while it is not compiled)."""
        if size not in self._lowered and size not in self._programs:
            self._lowered[size] = self.sized.lower(size)
        return self._lowered.get(size)

    def executable(self, size: int) -> Executable:
        """The compiled program at ``size``, compiled once while in use."""
        if size not in self._programs:
            ahead = self._ahead.pop(size, None)
            if ahead is not None:  # compiled in a round (`prepare`): its result or its error
                program = ahead.result()
            else:
                lowered = self.lower(size)
                program = compile_measured(lambda: lowered, self.engine.fault_hook, size)
                self.engine.compiles += 1
            self._lowered.pop(size, None)
            self._programs[size] = program
        return self._programs[size]

    def prepare(self, sizes: list[int]) -> None:
        """Compiles a search round's ``sizes`` side by side (`compile_side_by_side`).

        Each is traced here, on the caller's thread, in order (a size whose tracing fails
        is left to `fits`, which raises it if the search asks that size); compiling runs
        on threads. What they compiled (or the error) waits in `executable`.
        """
        lowered = {}
        for size in sizes:
            if size in self._ledgers or size in self._programs or size in self._ahead:
                continue
            try:
                lowered[size] = self.lower(size)
            except Exception:  # raised again by `fits` if the search asks this size
                continue
        if len(lowered) > 1:
            self._ahead.update(compile_side_by_side(lowered, self.engine.fault_hook))
            self.engine.compiles += len(lowered)

    def ledger(self, size: int) -> Ledger:
        """Everything live on the device while the program at ``size`` runs (measured once)."""
        if size not in self._ledgers:
            s, report = self.sized, self.executable(size).report
            ledger = program_ledger(report, resident=s.resident, inputs=s.inputs(size),
                                    in_flight=s.in_flight)  # fmt: skip
            self._ledgers[size] = ledger
            self.memory_model.add(size, ledger.total)
        return self._ledgers[size]

    def compiled_sizes(self) -> list[int]:
        """The sizes whose compiled program is held now."""
        return sorted(self._programs)

    def peak(self, size: int) -> int | None:
        """The ledger's total measured for ``size``, or None if it never was."""
        ledger = self._ledgers.get(size)
        return None if ledger is None else ledger.total

    def check(self, size: int) -> None:
        """Raises `jax_adaptive.SimulatedOutOfMemory` when the ledger exceeds the capacity."""
        capacity, needed = self.engine.capacity(), self.ledger(size).total
        if capacity is not None and needed > capacity:
            raise SimulatedOutOfMemory(needed, capacity, what=f"{self.engine.what} {size}")

    def use(self, size: int) -> None:
        """Runs ``size`` from now on: the programs of other sizes are freed (not their measures)."""
        self.size = size
        self._programs = {s: p for s, p in self._programs.items() if s == size}
        self._ahead = {s: f for s, f in self._ahead.items() if s == size}
        self._lowered = {s: low for s, low in self._lowered.items() if s == size}

    def release(self) -> None:
        """Frees the programs of every size (not their measures): a program no longer run."""
        self._programs, self._ahead, self._lowered = {}, {}, {}

    # ------------------------------------------------------------ deciding sizes

    def fits(self, size: int, reason: str) -> bool:
        """Decides one size (compiled once ever) and records the trial.

        It fails when compiling runs out of memory, or its ledger exceeds the capacity
        or the one real runs taught.
        """
        start = time.perf_counter()
        measured, ahead = size in self._ledgers, self._ahead.get(size)
        if not measured:
            self.lower(size)  # the user's code traces here: its errors propagate
        ledger, error = catch_oom(lambda: self.ledger(size))  # compiling may run out
        decided: DecidedBy = "compile" if ledger is None else "cache" if measured else "estimate"
        if ledger is not None:
            capacity = self.engine.capacity()
            if capacity is not None and ledger.total > capacity:
                error = "above the capacity"
            elif self.learned_cap is not None and ledger.total > self.learned_cap:
                decided, error = "learned", "above the capacity learned from real runs"
        seconds = time.perf_counter() - start
        if ahead is not None and ahead.exception() is None:  # its own compile, in its round
            seconds += ahead.result().seconds
        self.engine.record(size, error is None, ledger, seconds, decided, reason)
        return error is None

    def largest_fitting(
        self, *, hi: int, reason: str, lo: int = 1, multiple_of: int = 1, least: int = 1,
        on_fit: Callable[[int, Any], None] | None = None, first: int | None = None,
    ) -> int:  # fmt: skip
        """The largest size in ``[max(lo, least), hi]`` that fits, agreed; kept as ``largest``.

        Multiples of ``multiple_of`` (a multiple of ``least``) first; multiples of
        ``least`` below it when none fits; else `jax_adaptive.NothingFitsError`, with
        the bytes needed and available. ``on_fit(size, compiled)``, if given, hears of
        each size found to fit, with its compiled program, as the search goes.
        ``first``: a size asked before the search (a multiple of ``multiple_of``), which
        then looks only above it, or only below.
        """
        lo = max(lo, least)
        if hi < lo:
            raise self.nothing_fits(lo, [])
        capacity = self.guide_capacity()
        propose = self._propose(capacity) if capacity is not None else None
        multiple = multiple_of if hi // multiple_of * multiple_of >= lo else least

        def fits(size: int) -> bool:
            ok = self.fits(size, reason)
            if ok and on_fit is not None:
                on_fit(size, self.executable(size).compiled)
            return ok

        # Without a capacity only a compile can fail (on a CPU, no limit): one at a time.
        width = self.engine.compile_workers if capacity is not None else 1
        rounds = {"width": width, "prepare": self.prepare}
        start, compiles, trials = time.perf_counter(), self.engine.compiles, self.engine.search_log
        seen, known = len(trials), None
        if first is not None and lo <= first < hi and first % multiple == 0:
            if fits(first):
                known = first  # the search looks above it, and does not ask it again
            else:
                hi = first - 1

        try:
            try:
                found = search_max_size(
                    fits, lo=lo, hi=hi, multiple_of=multiple, propose=propose,
                    known_good=known, **rounds,
                )  # fmt: skip
            except NothingFitsError:
                if multiple == least or lo >= multiple:
                    raise
                found = search_max_size(
                    fits, lo=least, hi=multiple - 1, multiple_of=least, propose=propose, **rounds
                )
        except NothingFitsError as exc:
            raise self.nothing_fits(exc.smallest, exc.trials) from None
        self.largest = self.engine.agree(found.size)
        one = [
            t.seconds for t in trials[seen:] if t.size == found.size and t.decided_by == "estimate"
        ]
        self.search = SearchCost(time.perf_counter() - start, self.engine.compiles - compiles,
                                 found.size, one[0] if one else None)  # fmt: skip
        return self.largest

    def _propose(self, capacity: int) -> Callable[[int | None, int | None], int | None]:
        """The memory model's guesses, leaving out the size off its line."""
        off = self.sized.off_line
        if off is None:
            return self.memory_model.propose(capacity)

        def propose(good: int | None, bad: int | None) -> int | None:
            points = {s: n for s, n in self.memory_model.points.items() if s != off}
            return MemoryModel(points, self.memory_model.prior).propose(capacity)(good, bad)

        return propose

    def nothing_fits(self, size: int, trials: list, detail: str | None = None) -> NothingFitsError:
        """The one error for a size that does not fit, with the bytes it needs."""
        needed, capacity = self.peak(size), self.guide_capacity()
        need = "?" if needed is None else f"{needed:,}"
        have = "fewer" if capacity is None else f"{capacity:,}"
        said = f"the {self.engine.what} {size} needs {need} bytes (estimate) and {have} bytes"
        return NothingFitsError(size, trials, detail=detail or f"{said} are available")

    # ------------------------------------------------------------ the plan cache

    def key(self) -> str:
        """The plan cache's key: the device, the limits, the program's code, the client's parts."""
        if self._fingerprint is None:
            size = self.sized.fingerprint_at()
            lowered = self.lower(size) or self.sized.lower(size)
            self._fingerprint = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        device, engine = self.engine.device, self.engine
        return plan_key(
            platform=device.platform, device_kind=device.device_kind,
            device_capacity=device_capacity(device), memory_limit=engine.memory_limit,
            headroom=engine.headroom, program=self._fingerprint, jax=jax.__version__,
            **self.sized.key(),
        )  # fmt: skip

    def cached(self, bound: int, reason: str) -> int | None:
        """The size a run of the same job stored, up to ``bound`` (recorded), or None."""
        if self.engine.plan_cache is None:
            return None
        start = time.perf_counter()
        entry = self.engine.plan_cache.plan(self.key(), bound)
        if entry is None:
            return None
        size, estimate = entry["micro_batch_size"], entry.get("estimated_bytes")
        self.engine.record(size, True, estimate, time.perf_counter() - start, "plan cache", reason)
        self.timed = Timed.from_entry(entry, bound)
        return size

    def store(self, size: int, **entry: Any) -> None:
        """Remembers ``size`` in the plan cache, with its peak, the capacity and ``entry``.

        The timing that chose ``size`` (`timed`) is kept with it.
        """
        if self.engine.plan_cache is not None:
            plan = {"micro_batch_size": size, "estimated_bytes": self.peak(size)}
            plan["capacity"] = self.engine.capacity()
            timed = self.timed_for(size)
            self.engine.plan_cache.put(
                self.key(), {**plan, **(timed.entry() if timed else {}), **entry}
            )

    def timed_for(self, size: int) -> Timed | None:
        """The timing that chose ``size`` (`timed`), or None: it was not timed."""
        return self.timed if self.timed is not None and self.timed.chosen == size else None

    # ------------------------------------------------------------ out of memory

    def start(self) -> None:
        """A new update, call or batch: its first real out-of-memory counts as the first.

        Once a size that ran failed and then ran after the release (`again`), each call
        first waits for the memory held to come down to the least at which its size ran
        (`jax_adaptive.release.ReleaseWatch`).
        """
        self._real_ooms = 0
        self._again = False
        self._release.start(self.size)

    def again(self, exc: BaseException, size: int, reason: str) -> bool:
        """Whether ``size``, which ran before and now ran out of memory, runs once more.

        The trainer's rule: a size that has run is kept unless it fails again after the
        recovery steps (what the failed attempt held released; the next run cautious,
        which the caller sees to). Only for a real out-of-memory, once since `start`:
        recorded and logged, teaching no capacity. Otherwise False: `shrink` it.
        """
        real = not isinstance(exc, SimulatedOutOfMemory | PeerOutOfMemory)
        if not real or self._again or size not in self._ran:
            return False
        self._again = True
        self.engine.record(
            size, False, self._ledgers.get(size), 0.0, "run", f"{reason}; ran before"
        )
        log.warning(
            "%s %d ran out of memory (real) after it had run; trying it once more",
            self.engine.what, size,
        )  # fmt: skip
        # A full collection, which also runs JAX's collector callback (buffers whose
        # release was deferred, jax-ml/jax#14882): with Python's collector off, the last
        # call's arrays stayed mapped until one ran (measured under RLIMIT_AS: a size that
        # ran failed at every next call, and shrank, 103 to 47 to 1, without it).
        gc.collect()
        # The runtime returns released buffers on its own threads, later under a loaded
        # host: measured under RLIMIT_AS on a busy 2-core CPU, the retry failed again and
        # shrank in 3 of 5 runs without a wait, and still in 1 of 3 full CI runs with a
        # fixed 0.2 s. It waits while the memory held still falls; it costs only calls
        # that already ran out of memory.
        self._release.retry(size)
        return True

    def forget_learned(self) -> None:
        """Drops the capacity real runs taught: memory may have come back."""
        self.learned_cap = None

    def ran(self, what: Hashable = None) -> None:
        """A run succeeded: out-of-memory errors are no longer in a row; ``what`` ran."""
        self._streak = 0
        if what is None:
            return
        self._ran.add(what)
        if self._release.ran(what, retried=self._again):
            log.info(
                "%s %s ran once the last call's buffers were released: from now on each call"
                " waits for their release first", self.engine.what, what,
            )  # fmt: skip

    def has_run(self, what: Hashable) -> bool:
        """Whether ``what`` (a size, a program's key) ran to its end in this binding."""
        return what in self._ran

    def failed(self, exc: BaseException, size: int, reason: str, least: int = 1) -> bool:
        """Records that ``size`` ran out of memory; returns whether it was real.

        A real one teaches a capacity below the peak: less ``headroom`` the first time
        since `start`, halfway down to the bytes of the smallest size, ``least``, after
        (`jax_adaptive.memory.learned_capacity`).
        """
        real, peak = not isinstance(exc, SimulatedOutOfMemory | PeerOutOfMemory), self.peak(size)
        decided = "run" if real else "estimate"
        self.engine.record(size, False, self._ledgers.get(size), 0.0, decided, reason)
        kind = "real" if real else "simulated"
        log.warning("%s %d ran out of memory (%s)", self.engine.what, size, kind)
        self._streak += 1
        if real and peak is not None:
            self._real_ooms += 1
            floor = self.sized.resident + self.sized.inputs(least)  # below every size's ledger
            self.learned_cap = learned_capacity(
                peak, self.engine.headroom, self._real_ooms == 1, self.learned_cap, floor
            )
        return real

    def shrink(
        self, exc: BaseException, size: int, *, reason: str, multiple_of: int = 1, least: int = 1
    ) -> int:
        """The largest size below ``size`` that fits, after ``size`` ran out of memory.

        When nothing below fits, a real out-of-memory is retried at ``least`` up to
        ``oom_retries`` times in a row (it can pass: another job's peak); past that, or
        for a simulated one, `jax_adaptive.NothingFitsError` is raised from ``exc``.
        """
        real = self.failed(exc, size, reason, least)
        try:
            if size <= least:
                raise self.nothing_fits(size, []) from exc
            return self.largest_fitting(
                hi=size - 1, reason=f"out of memory at size {size}",
                multiple_of=multiple_of, least=least,
            )  # fmt: skip
        except NothingFitsError:
            if not real or self._streak > self.engine.oom_retries:
                raise
            # Before the same size again: what failed attempts held only through reference
            # cycles (a batch's device copy) goes now, not at some later collection. The
            # young generations hold the last attempt's (a full collection of a large
            # process takes a quarter second); all of them after a second failure in a row.
            gc.collect(1 if self._streak == 1 else 2)
            self.largest = least
            return least
