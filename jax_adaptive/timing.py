"""Timed candidates: of a few plans the search allows, the one whose update is fastest.

The largest micro-batch that fits is not always the fastest: on a CPU a smaller one can
stay in cache, on a GPU a size past saturation gains nothing and a rounder size can tile
better. `candidate_sizes` names a few plans below the largest that fits; a `Timing`
says which size to run next and, once it has timed enough, which was fastest. A client
drives it offline (`fastest`: the trainer's micro-step on zeros, before training) or
online (`AdaptiveStep`'s first real calls run the sizes it asks: every plan trains the
same, exactness does not depend on the micro-batch, so those calls are training, not
overhead). The plan cache keeps the choice and its timings: a second run times nothing.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Generator, Mapping
from typing import Any, NamedTuple

import jax

from jax_adaptive.errors import catch_oom
from jax_adaptive.plan import least_padding_size

__all__ = [
    "Timed",
    "Timing",
    "can_time",
    "candidate_sizes",
    "fastest",
    "plan_timing",
    "run_offline",
]

log = logging.getLogger("jax_adaptive")

MOST = 12
"""Candidates at most: down to 2 ** 10 times smaller than the default plan. The
screening's early stop bounds what is compiled: two clearly slower past the fastest."""

SCREEN_RUNS = 2
"""Timed updates per candidate in the screening pass, after one that warms up (its first
run allocates)."""

ROUNDS = 7
"""Interleaved rounds over the close candidates: the median of each decides."""

CLOSE = 0.10
"""Candidates within this share of the best screened time go to the rounds."""

GIVE_UP = 0.25
"""A screened size this much slower than the best ends the screening at once."""

KEEP_DEFAULT = 0.03
"""The default plan (the fewest micro-steps) is kept unless another wins by more: a
moment's load moves medians by a few percent on a shared host (measured: 3-5% between
two timings of the same sizes on this project's 2-core CPU), and a switch that wins
less than this gains little and may lose it."""


def can_time() -> bool:
    """Whether plans are timed here: in one process only.

    Under ``jax.distributed`` each process would time its own runs and could stop its
    screening, or choose, at another size than the others, whose programs would then
    wait on each other's collectives; they plan by the least padding instead.

    Examples:
        >>> can_time()  # one process
        True
    """
    return jax.process_count() == 1


def _size_for(T: int, steps: int, largest: int, multiple: int) -> int:
    """The least padding for ``steps`` micro-steps, a multiple of ``multiple``.

    ``ceil(T / steps)`` rounded up (down, where up would pass ``largest``).
    """
    size = -(-math.ceil(T / steps) // multiple) * multiple
    return size if size <= largest else largest // multiple * multiple


def candidate_sizes(T: int, largest: int, multiple_of: int = 1, most: int = MOST) -> list[int]:
    """The plans worth timing, the default (fewest micro-steps) first, then by more steps.

    For ``k = ceil(T / largest)`` micro-steps: the least-padding size of ``k`` (the
    default plan) and of ``k + 1`` (a rounder size, often), then of the step counts that a
    power-of-two size ``p <= T / k`` would take (``ceil(T / p)``): the sizes a halving
    search lands on, where caches and tiles favour a smaller size. Each with the least
    padding its step count allows; at most ``most``, none below ``multiple_of``. A
    `Timing` stops at the second past the fastest, so few of them are ever compiled.

    Args:
        T: the examples per update.
        largest: the largest size that fits.
        multiple_of: every size's multiple.
        most: how many at most.

    Returns:
        Distinct sizes, in order of their step counts.

    Examples:
        >>> candidate_sizes(2048, 700, most=6)  # 683 x 3, 512 x 4, 256 x 8, 128 x 16, ...
        [683, 512, 256, 128, 64, 32]
        >>> candidate_sizes(100, 48, multiple_of=8)
        [40, 32, 16, 8]
    """
    k = math.ceil(T / largest)
    sizes = [least_padding_size(T, largest, multiple_of)]
    steps = [k + 1] + [math.ceil(T / 2**j) for j in range(sizes[0].bit_length() - 1, -1, -1)]
    for n in sorted(set(steps)):
        size = _size_for(T, n, largest, multiple_of)
        if multiple_of <= size < sizes[-1]:
            sizes.append(size)
    return sizes[:most]


class Timed(NamedTuple):
    """The timed plans and the one chosen.

    Attributes:
        chosen: the fastest size (the default unless another won by over 3%).
        default: the size of the fewest micro-steps (the plan without timing).
        seconds: ``(size, seconds per update)`` of each size timed, in timing order (a
            size that ran out of memory is absent).
        target_batch_size: the examples per update.
        cost: the seconds the timing cost: its compiles and runs, less (when its runs
            were training) what the chosen plan would have taken for them.
        source: ``"timed"``, or ``"plan cache"`` when a run of the same job timed them.

    Examples:
        >>> timed = Timed(256, 683, ((683, 0.50), (512, 0.46), (256, 0.40)), 2048, 12.0)
        >>> print(timed)
        256 x 8 timed fastest of 683 x 3 0.5 s, 512 x 4 0.46 s, 256 x 8 0.4 s per update: \
1.25x the speed of 683 x 3 (timing took 12.0 s)
        >>> timed.speedup
        1.25
    """

    chosen: int
    default: int
    seconds: tuple[tuple[int, float], ...]
    target_batch_size: int
    cost: float
    source: str = "timed"

    @property
    def speedup(self) -> float:
        """The default plan's time per update over the chosen one's."""
        default = dict(self.seconds).get(self.default)
        return 1.0 if default is None else default / self.chosen_seconds

    @property
    def chosen_seconds(self) -> float | None:
        """The chosen plan's seconds per update (None: nothing was timed)."""
        return dict(self.seconds).get(self.chosen)

    def plan(self, size: int) -> str:
        """``"m x k"`` for a size."""
        return f"{size} x {math.ceil(self.target_batch_size / size)}"

    def __str__(self) -> str:
        if not self.seconds:
            return f"{self.plan(self.chosen)} not timed (its timing run ran out of memory)"
        each = ", ".join(f"{self.plan(s)} {t:.3g} s" for s, t in self.seconds)
        won = f"{self.speedup:.3g}x the speed of {self.plan(self.default)}"
        if self.chosen == self.default:
            won = f"the default, no other faster by over {KEEP_DEFAULT:.0%}"
        how = f"timing took {self.cost:.1f} s" if self.source == "timed" else self.source
        return f"{self.plan(self.chosen)} timed fastest of {each} per update: {won} ({how})"

    def entry(self) -> dict[str, Any]:
        """What the plan cache keeps of it."""
        pairs = [list(pair) for pair in self.seconds]
        return {"timed": {"default": self.default, "seconds": pairs, "cost": self.cost}}

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], target_batch_size: int) -> Timed | None:
        """The timing a plan cache entry kept (None if it kept none).

        Examples:
            >>> entry = Timed(256, 683, ((683, 0.5), (256, 0.4)), 2048, 9.0).entry()
            >>> print(Timed.from_entry({"micro_batch_size": 256, **entry}, 2048).source)
            plan cache
        """
        timed = entry.get("timed")
        if not isinstance(timed, Mapping):
            return None
        seconds = tuple((int(s), float(t)) for s, t in timed["seconds"])
        chosen = entry["micro_batch_size"]
        return cls(chosen, int(timed["default"]), seconds, target_batch_size,
                   float(timed["cost"]), "plan cache")  # fmt: skip


class Timing:
    """Which size to run next, and, once enough are timed, the fastest (`result`).

    A screening pass runs the sizes in order, each once to warm up and then
    `SCREEN_RUNS` times (the least kept), and stops early once two sizes are more than
    `CLOSE` slower than the best with none faster between, or one is `GIVE_UP` slower:
    time per update falls with the size and then rises (where it stays within `CLOSE`,
    the curve is flat and the screening goes on). The best one's neighbourhood is
    screened too: the step counts halfway to its neighbours (`_between`). The sizes
    within `CLOSE` of the best then run ``rounds`` interleaved rounds, with the default
    plan (screened first, on the coldest caches), so that a moment's load weighs on all
    of them; the least median wins, the first size (the default plan) unless another
    wins by over `KEEP_DEFAULT`. A size that ran out of memory is left out; when the
    first one does, nothing is timed and the first is chosen.

    Args:
        sizes: the candidates, the default plan first (`candidate_sizes`).
        target_batch_size: the examples per update.
        multiple_of: every size's multiple (of the sizes between candidates too).
        rounds: the interleaved rounds.
        online: whether the runs are training (the cost then leaves out what the chosen
            plan would have taken for them).
        budget: the most the timing may cost, in updates at the default plan's speed
            (checked after each size and round: a compile may overrun it); None: no bound.

    Attributes:
        size: the size to run next; None once `result` is known.
        result: the `Timed` plans, once decided.

    Examples:
        >>> timing = Timing([683, 512, 256], 2048)
        >>> asked = []
        >>> while timing.size is not None:  # an update's seconds: least at 400 examples
        ...     asked.append(timing.size)
        ...     timing.record(timing.size, 0.4 + abs(timing.size - 400) / 1000)
        >>> timing.result.chosen, sorted(set(asked))  # 342 x 6: between 512 x 4 and 256 x 8
        (342, [256, 342, 512, 683])
    """

    def __init__(
        self, sizes: list[int], target_batch_size: int, *, multiple_of: int = 1,
        rounds: int = ROUNDS, online: bool = False, budget: float | None = None,
    ):  # fmt: skip
        if not sizes:
            raise ValueError("Timing needs at least one size.")
        if budget is not None and not budget >= 0:
            raise ValueError(f"{budget=} must be a number of updates, at least 0.")
        self.sizes, self.target_batch_size, self.rounds = sizes, target_batch_size, rounds
        self.multiple_of, self.online, self.budget = multiple_of, online, budget
        self.result: Timed | None = None
        self._spent: list[float] = []  # each run's seconds, compile and all
        self._runs: list[float] = []  # each run's own seconds
        self._steps = self._schedule()
        self.size: int | None = next(self._steps)

    def record(self, size: int, seconds: float, spent: float | None = None) -> None:
        """The run of ``size`` took ``seconds`` (``spent``: with its compile, if any)."""
        self._check(size)
        self._spent.append(seconds if spent is None else spent)
        self._runs.append(seconds)
        self._advance(seconds)

    def drop(self, size: int, spent: float = 0.0) -> None:
        """The run of ``size`` ran out of memory: it is no candidate."""
        self._check(size)
        self._spent.append(spent)
        self._advance(None)

    def _check(self, size: int) -> None:
        if size != self.size:
            raise ValueError(f"the timing asked for size {self.size}, not {size}.")

    def _advance(self, seconds: float | None) -> None:
        try:
            self.size = self._steps.send(seconds)
        except StopIteration as done:
            self.size, self.result = None, done.value
            log.info("timed plans: %s", self.result)

    def _schedule(self) -> Generator[int, float | None, Timed]:
        """Yields the sizes to run; is sent each run's seconds (None: out of memory)."""
        screened: dict[int, float] = {}
        slower, default = 0, self.sizes[0]
        for size in self.sizes:
            seconds = yield from self._screen(size)
            if seconds is None:  # out of memory: no candidate
                if size == default:
                    return self._timed(default, {})
                continue
            best = min(screened.values(), default=math.inf)
            screened[size] = seconds
            # Within CLOSE the curve is flat: the next, smaller sizes may still win (XLA:CPU
            # ran a CNN's micro-batches of 1 and 2 faster than every size from 4 to 24).
            if seconds > best * (1 + CLOSE):
                slower += 1
            elif seconds <= best:
                slower = 0
            if slower == 2 or seconds > best * (1 + GIVE_UP) or self._spent_all(screened):
                break
        near = self._between(min(screened, key=screened.get))
        for size in [] if self._spent_all(screened) else near:
            seconds = yield from self._screen(size)
            if seconds is not None:
                screened[size] = seconds
        best = min(screened.values())
        # the default always runs the rounds: screened first, it ran on the coldest caches
        close = [s for s, t in screened.items() if t <= best * (1 + CLOSE) or s == default]
        rounds: dict[int, list[float]] = {size: [] for size in close}
        for _ in range(self.rounds if len(close) > 1 else 0):
            if self._spent_all(screened):
                break
            for size in [s for s in close if s in rounds]:
                seconds = yield size
                if seconds is None:
                    del rounds[size]
                else:
                    rounds[size].append(seconds)
        medians = {s: statistics.median(t) for s, t in rounds.items() if t}
        medians = medians or {s: screened[s] for s in close}
        chosen = min(medians, key=medians.get)
        if default in medians and medians[default] <= medians[chosen] * (1 + KEEP_DEFAULT):
            chosen = default
        return self._timed(chosen, {s: medians.get(s, t) for s, t in screened.items()})

    def _screen(self, size: int) -> Generator[int, float | None, float | None]:
        """Runs ``size`` once to warm up, then `SCREEN_RUNS` times: the least (None: OOM)."""
        runs = []
        for _ in range(1 + SCREEN_RUNS):
            seconds = yield size
            if seconds is None:
                return None
            runs.append(seconds)
        return min(runs[1:])

    def _spent_all(self, screened: dict[int, float]) -> bool:
        """Whether the timing has cost its ``budget`` (updates at the default plan's speed)."""
        default = screened.get(self.sizes[0])
        if self.budget is None or default is None:
            return False
        return self._cost(default) > self.budget * default

    def _cost(self, reference: float) -> float:
        """What the timing cost so far: all it ran, less (online) what ``reference`` would."""
        cost = sum(self._spent) - (len(self._runs) * reference if self.online else 0.0)
        return max(cost, 0.0)

    def _between(self, best: int) -> list[int]:
        """Sizes between ``best`` and its neighbours among the candidates, by step count.

        The candidates halve the size; the fastest may lie between two of them (a CPU's
        cache, a GPU's tiles): the step count halfway (geometrically) to each neighbour.
        """
        T, sizes, i = self.target_batch_size, self.sizes, self.sizes.index(best)
        steps = math.ceil(T / best)
        found = []
        for neighbour in sizes[max(i - 1, 0) : i] + sizes[i + 1 : i + 2]:
            n = round(math.sqrt(steps * math.ceil(T / neighbour)))
            size = _size_for(T, n, max(best, neighbour), self.multiple_of)
            if size not in sizes and size not in found and size >= self.multiple_of:
                found.append(size)
        return found

    def _timed(self, chosen: int, seconds: dict[int, float]) -> Timed:
        cost = self._cost(seconds.get(chosen, 0.0))  # online, the runs trained: the excess
        return Timed(chosen, self.sizes[0], tuple(seconds.items()), self.target_batch_size, cost)


def plan_timing(
    T: int, largest: int, multiple_of: int, *, online: bool, budget: float | None = None
) -> Timing | None:
    """A `Timing` of the plans at or below ``largest`` (`candidate_sizes`), or None.

    None where nothing is timed: under several processes (`can_time`), or where the
    default plan is the only candidate. ``online``, ``budget``: as `Timing` takes them.

    Examples:
        >>> plan_timing(2048, 700, 1, online=True).sizes[:3]
        [683, 512, 256]
        >>> plan_timing(1, 1, 1, online=False) is None  # one candidate
        True
    """
    sizes = candidate_sizes(T, largest, multiple_of)
    if not can_time():
        log.info("objective='throughput' times plans in one process only: least padding")
        return None
    if len(sizes) < 2:
        return None
    log.info("timing the plans %s", ", ".join(f"{s} x {math.ceil(T / s)}" for s in sizes))
    return Timing(sizes, T, multiple_of=multiple_of, online=online, budget=budget)


def run_offline(timing: Timing, time_once: Callable[[int], float]) -> Timed:
    """Drives ``timing`` one run at a time, each ``time_once(size)`` (its seconds).

    An out-of-memory leaves the size out; any other error propagates.
    """
    while timing.size is not None:
        size, start = timing.size, time.perf_counter()
        seconds, error = catch_oom(functools.partial(time_once, size))
        spent = time.perf_counter() - start
        if error is None:
            timing.record(size, seconds, spent)
        else:
            timing.drop(size, spent)
    return timing.result


def fastest(
    sizes: list[int], time_once: Callable[[int], float], target_batch_size: int,
    *, multiple_of: int = 1, rounds: int = ROUNDS, budget: float | None = None,
) -> Timed:  # fmt: skip
    """Times the sizes offline, one run at a time as a `Timing` asks; the `Timed` result.

    Args:
        sizes: the candidates, the default plan first (`candidate_sizes`).
        time_once: ``time_once(size)`` runs one update at ``size`` and returns its
            seconds; an out-of-memory leaves the size out, any other error propagates.
        target_batch_size: the examples per update.
        multiple_of: every size's multiple.
        rounds: the interleaved rounds.
        budget: the most the timing may cost, in updates at the default plan's speed.

    Returns:
        The `Timed` plans.

    Examples:
        >>> def seconds(size):  # an update's: least at 200 examples
        ...     return 0.4 + abs(size - 200) / 1000
        >>> print(fastest([683, 512, 256, 128, 64], seconds, 2048).chosen)  # 187 x 11
        187
    """
    timing = Timing(sizes, target_batch_size, multiple_of=multiple_of, rounds=rounds,
                    budget=budget)  # fmt: skip
    return run_offline(timing, time_once)
