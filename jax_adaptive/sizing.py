"""The one sizing engine: which sizes of a program fit the device, and which one to run.

A client (the planner, `jax_adaptive.Evaluator`, `jax_adaptive.AdaptiveStep`) describes
its program for one input signature as a `Sized`; `Sizing.bind` gives it that
signature's `Binding`, kept for when the signature comes back. The engine owns, for
every client: the capacity, each size's ledger (compiled and measured once), the
search, the plan cache, and the shrink after an out-of-memory (docs/memory.md,
docs/recovery.md). Every trial is logged at INFO on the ``jax_adaptive`` logger.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import jax

from jax_adaptive import checks
from jax_adaptive.errors import (
    NothingFitsError,
    PeerOutOfMemory,
    SimulatedOutOfMemory,
    catch_oom,
)
from jax_adaptive.memory import (
    Executable,
    FaultHook,
    Ledger,
    MemoryModel,
    compile_measured,
    compile_side_by_side,
    device_capacity,
    learned_capacity,
    others_bytes,
    program_ledger,
    usable_capacity,
)
from jax_adaptive.plan import DecidedBy, SearchCost, SizeTrial
from jax_adaptive.plan_cache import PlanCache, plan_key
from jax_adaptive.release import ReleaseWatch
from jax_adaptive.search import search_max_size
from jax_adaptive.timing import Timed, candidate_sizes, fastest

__all__ = ["Binding", "Sized", "Sizing"]

log = logging.getLogger("jax_adaptive")
if not log.handlers:  # say what the search does unless the user set up this logger
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("jax_adaptive: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _compile_workers() -> int:
    """The sizes a search round compiles side by side: ``JAX_ADAPTIVE_COMPILE_WORKERS``, or 1.

    One by default: on a 2-core CPU two compiles side by side took 0.74 s against 0.80 s
    one after the other (XLA:CPU's compiler already uses the cores), and rounds of two
    compiled more sizes (62 against 48 over `experiments/search_cost.py`)
    for a longer search. A host whose compiles leave cores idle (a GPU host's, compiling
    kernels) may set more; `experiments/gpu_validation.py` measures it there.
    """
    said = os.environ.get("JAX_ADAPTIVE_COMPILE_WORKERS", "").strip()
    if not said:
        return 1
    if not said.isdigit() or int(said) < 1:
        raise ValueError(f"JAX_ADAPTIVE_COMPILE_WORKERS must be a positive int, got {said!r}.")
    return int(said)


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
        self, *, hi: int, reason: str, lo: int = 1, multiple_of: int = 1, least: int = 1
    ) -> int:
        """The largest size in ``[max(lo, least), hi]`` that fits, agreed; kept as ``largest``.

        Multiples of ``multiple_of`` (a multiple of ``least``) first; multiples of
        ``least`` below it when none fits; else `jax_adaptive.NothingFitsError`, with
        the bytes needed and available.
        """
        lo = max(lo, least)
        if hi < lo:
            raise self.nothing_fits(lo, [])
        capacity = self.guide_capacity()
        propose = self._propose(capacity) if capacity is not None else None
        multiple = multiple_of if hi // multiple_of * multiple_of >= lo else least

        def fits(size: int) -> bool:
            return self.fits(size, reason)

        # Without a capacity only a compile can fail (on a CPU, no limit): one at a time.
        width = self.engine.compile_workers if capacity is not None else 1
        rounds = {"width": width, "prepare": self.prepare}
        start, compiles, trials = time.perf_counter(), self.engine.compiles, self.engine.search_log
        seen = len(trials)

        try:
            try:
                found = search_max_size(
                    fits, lo=lo, hi=hi, multiple_of=multiple, propose=propose, **rounds
                )
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
            timed = self.timed.entry() if self.timed and self.timed.chosen == size else {}
            self.engine.plan_cache.put(self.key(), {**plan, **timed, **entry})

    def timed_fastest(
        self, T: int, largest: int, multiple_of: int, time_once: Callable[[int], float],
        budget: float | None = None,
    ) -> int:  # fmt: skip
        """Times the candidate plans below ``largest`` offline (`jax_adaptive.timing`).

        ``time_once(size)`` runs one update of ``T`` examples at ``size`` and returns its
        seconds; sizes other than the fastest, returned, are freed by the client's `use`.
        ``budget``: the most the timing may cost, in updates at the default plan's speed.
        """
        sizes = candidate_sizes(T, largest, multiple_of)
        self.timed = fastest(sizes, time_once, T, multiple_of=multiple_of, budget=budget)
        log.info("timed plans: %s", self.timed)
        return self.timed.chosen

    # ------------------------------------------------------------ out of memory

    def start(self) -> None:
        """A new update, call or batch: its first real out-of-memory counts as the first.

        Once a size that ran failed and then ran after the release (`again`), each call
        first waits for the memory held to come down to the least at which its size ran
        (`jax_adaptive.memory.ReleaseWatch`).
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


class Sizing:
    """The sizing engine of one device: capacity, ledgers, search, plan cache, shrink.

    Args:
        what: how a size is named in logs and errors (``"micro-step of"``).
        memory_limit: bytes of a device (on a CPU, a simulated one).
        headroom: the share of a device's real capacity left unused (not of the limit).
        device: the device whose capacity counts (the first local device by default).
        plan_cache: where plans are remembered, or None.
        oom_retries: real out-of-memory errors in a row retried at the smallest size.
        agree: the size every process plans from this one's (under ``jax.distributed``
            the smallest any found); the size itself by default.

    Attributes:
        search_log: every `jax_adaptive.SizeTrial`, in order, of every signature.
        compiles: the sized programs compiled so far.
        compile_workers: the sizes a search round compiles side by side (see
            `_compile_workers`; 1: one at a time).
        fault_hook: a `FaultHook` called before each compile, or None.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def lower(size):  # a program whose temporaries grow with the size
        ...     x = jax.ShapeDtypeStruct((size, 1024), jnp.float32)
        ...     return jax.jit(lambda a: jnp.tanh(a) @ jnp.tanh(a).T).lower(x)
        >>> sizing = Sizing("batch of", memory_limit=200_000)
        >>> program = sizing.bind("f", lambda: Sized(lower, 0, lambda n: 4096 * n, dict))
        >>> largest = program.largest_fitting(hi=64, reason="example")
        >>> program.ledger(largest).total <= 200_000 < program.ledger(largest + 1).total
        True
    """

    def __init__(
        self,
        what: str,
        *,
        memory_limit: int | None = None,
        headroom: float = 0.05,
        device: jax.Device | None = None,
        plan_cache: PlanCache | None = None,
        oom_retries: int = 3,
        agree: Callable[[int], int] | None = None,
    ):
        self.what = what
        self.memory_limit = checks.check_limit(memory_limit)
        self.headroom = checks.check_fraction("headroom", headroom)
        self.device = device or jax.local_devices()[0]
        self.plan_cache = plan_cache
        self.oom_retries = checks.non_negative_int("oom_retries", oom_retries)
        self.agree = agree or (lambda size: size)
        self.search_log: list[SizeTrial] = []
        self.compiles = 0
        self.compile_workers = _compile_workers()
        self.fault_hook: FaultHook | None = None
        self._bindings: dict[Hashable, Binding] = {}
        self._others = 0  # bytes other live arrays held on the device at the last plan

    def capacity(self) -> int | None:
        """The bytes a ledger may reach; None when unknown (a CPU with no limit)."""
        return usable_capacity(self.memory_limit, self.device, self.headroom, self._others)

    def measure_others(self, own: int) -> None:
        """Notes the bytes live on the device now that are not ``own`` (another job's)."""
        self._others = others_bytes(self.device, own)

    def set_memory_limit(self, memory_limit: int | None) -> bool:
        """Changes the cap; returns whether it was raised (a larger size may fit now)."""
        old, self.memory_limit = self.memory_limit, checks.check_limit(memory_limit)
        return old is not None and (memory_limit is None or memory_limit > old)

    def bind(self, signature: Hashable, sized: Callable[[], Sized]) -> Binding:
        """The `Binding` of ``signature``'s program (``sized()`` makes it once; kept after)."""
        binding = self._bindings.get(signature)
        if binding is None:
            binding = self._bindings[signature] = Binding(self, sized())
        return binding

    def record(
        self, size: int, fits: bool, ledger: Ledger | int | None, seconds: float,
        decided_by: DecidedBy, reason: str,
    ) -> SizeTrial:  # fmt: skip
        """Appends a `jax_adaptive.SizeTrial` (of a `Ledger`, its total, or None) and logs it."""
        parts = (
            (ledger.state, ledger.in_flight, ledger.program) if isinstance(ledger, Ledger) else ()
        )
        total = ledger.total if isinstance(ledger, Ledger) else ledger
        trial = SizeTrial(size, fits, total, seconds, decided_by, reason, *parts)
        self.search_log.append(trial)
        log.info("%s", trial.describe(self.what, self.capacity()))
        return trial
