"""The plan: which micro-batch size to run, and how it changes when memory does.

`Planner` is the trainer's client of the sizing engine (`jax_adaptive.sizing.Sizing`,
through `jax_adaptive.executables.Executables`), which decides which sizes fit. The
planner picks the size the trainer runs: fixed, from the plan cache or the largest that
fits, trimmed by the objective; shrunk after an out-of-memory, grown back at an update
boundary, followed when a schedule moves the target. Under ``jax.distributed`` every
process plans the same size (the smallest any found). Its `Chunking` decides how the
size's micro-steps are dispatched.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Literal

import jax

from jax_adaptive import checks
from jax_adaptive.background import INTERIM, BackgroundSearch, first_size
from jax_adaptive.chunking import Chunking
from jax_adaptive.distributed import process_any, process_min
from jax_adaptive.errors import NothingFitsError, SimulatedOutOfMemory
from jax_adaptive.executables import Executables
from jax_adaptive.memory import Executable, Ledger, MemoryModel, tree_bytes
from jax_adaptive.plan import Objective, Plan, least_padding_size
from jax_adaptive.sizing import Binding
from jax_adaptive.step import TrainState
from jax_adaptive.timing import plan_timing, run_offline

__all__ = ["GrowPolicy", "Planner"]

log = logging.getLogger("jax_adaptive")

GrowPolicy = Literal["never", "on_limit_change"] | int


class Planner:
    """Plans the micro-batch size over an `jax_adaptive.executables.Executables`.

    Args:
        executables: the compiled pieces (bound to a state and an example shape); their
            ``sizing`` engine decides which sizes fit.
        target_batch_size: examples per update (the first update's, with a schedule).
        fixed: a fixed size, never searched nor changed; None to search.
        grow, multiple_of, objective, chunk, timing_budget, background_search: as
            `jax_adaptive.AdaptiveTrainer` documents them.
        shards: the data shards every size must be a multiple of.

    Attributes:
        chunking: how the size's micro-steps are dispatched.
        size: the size in use (None before `plan_for`).
        largest: the largest size that fits, when searched.
        source: how the size was decided (`jax_adaptive.Plan`'s ``source``).
    """

    def __init__(
        self,
        executables: Executables,
        *,
        target_batch_size: int,
        fixed: int | None = None,
        grow: GrowPolicy = "on_limit_change",
        multiple_of: int = 1,
        shards: int = 1,
        objective: Objective = "least_padding",
        chunk: int | Literal["auto"] = "auto",
        timing_budget: float | None = None,
        background_search: bool = False,
    ):
        self.executables, self.sizing = executables, executables.sizing
        self.background_search = background_search
        self._search: BackgroundSearch | None = None
        self._timing_due = False  # a search ended with no state at hand to time its plans
        self.timing_budget = timing_budget
        self.target_batch_size, self.fixed = target_batch_size, fixed
        self.grow = checks.check_grow(grow)
        self.objective = checks.one_of(
            "objective", objective, ("least_padding", "max", "throughput")
        )
        self.multiple_of, self.shards = multiple_of, shards
        self.size: int | None = None
        self.largest: int | None = None
        self.source: str | None = None
        # XLA:CPU's slow loops: a chunk is timed there, by one process (`Chunking.settle`)
        self.chunking = Chunking(
            executables,
            capacity=lambda: self.program.guide_capacity(),
            limit=checks.check_chunk(chunk),
            timed=self.sizing.device.platform == "cpu" and jax.process_count() == 1,
        )
        self._open = True  # no size above `largest` was tried: a larger target searches up
        self._limit = self.sizing.memory_limit  # the limit the plan was made under
        self._limit_raised = False
        self._updates_since_grow = 0

    # ------------------------------------------------------------ what it holds

    @property
    def program(self) -> Binding:
        """The engine's binding of the micro-step for the shape in use."""
        return self.executables.program

    @property
    def memory_model(self) -> MemoryModel:
        """The `jax_adaptive.memory.MemoryModel` of every size measured for the shape in use."""
        return self.program.memory_model

    @property
    def throughput_log(self) -> list[dict[str, float]]:
        """The plans ``objective="throughput"`` timed: size, seconds and examples per second."""
        timed, T = self.program.timed, self.target_batch_size
        if timed is None:
            return []
        return [{"size": size, "seconds_per_update": seconds, "examples_per_second": T / seconds}
                for size, seconds in timed.seconds]  # fmt: skip

    def capacity(self) -> int | None:
        """The bytes a size's ledger may reach; None when unknown (a CPU with no limit)."""
        return self.sizing.capacity()

    def fingerprint_size(self) -> int:
        """A size every model accepts (a multiple of the ghost batch and the shards)."""
        return min(self._multiple, self.target_batch_size)

    def key_parts(self) -> dict[str, Any]:
        """What besides the programs decides the plan (the plan cache's key)."""
        return {
            "target_batch_size": self.target_batch_size,
            "objective": self.objective,
            "multiple_of": self.multiple_of,
            "shards": self.shards,
        }

    def check(self, size: int, chunk: int = 1) -> None:
        """Raises the simulated out-of-memory when the program's peak exceeds the capacity."""
        if chunk == 1:
            return self.program.check(size)
        capacity, needed = self.capacity(), self.executables.ledger(size, chunk).total
        if capacity is not None and needed > capacity:
            raise SimulatedOutOfMemory(needed, capacity, what=f"chunk of {chunk} x {size}")

    def optimizer_step(self) -> tuple[Executable, bool]:
        """The optimizer step, and whether it donates the state (if the state twice cannot fit)."""
        capacity = self.capacity()
        for donate in (False, True):
            executable = self.executables.optimizer_step(donate)
            needed = self.executables.optimizer_step_ledger(donate).total
            if capacity is None or needed <= capacity:
                return executable, donate
        raise NothingFitsError(
            1,
            [],
            detail=f"the optimizer step alone needs {needed:,} bytes (the train state "
            f"updated in place) and {capacity:,} bytes are available",
        )

    @property
    def plan(self) -> Plan:
        """The `Plan` in use.

        Under ``jax.distributed`` its peak waits for the first update: deciding the chunk
        is collective, and a process that did not measure the size would skip it.
        """
        if self.size is None:
            raise RuntimeError("call trainer.init(params, example_batch) first.")
        known = self.program.peak(self.size) is not None
        known &= self.chunking.chunk_of is not None or jax.process_count() == 1
        timed, search = self.program.timed_for(self.size), self.program.search
        return Plan(
            self.size,
            math.ceil(self.target_batch_size / self.size),
            self._peak() if known else None,
            self.capacity(),
            self.chunking.chunk_of,
            None if self.largest is None else min(self.largest, self.target_batch_size),
            self.chunking.fused,
            self.source,
            getattr(self.sizing.agree, "found", None),  # an `Agreement`'s, several processes
            self.executables.collectives(self.size),
            timed=timed and str(timed),
            search=search and str(search),
        )

    def _peak(self) -> Ledger:
        """The largest ledger of the programs an update runs (chunks, the last one)."""
        T, size, ex = self.target_batch_size, self.size, self.executables
        final, steps = self.chunking.final(size, T), math.ceil(T / size)
        ledgers = [] if final is None else [ex.final_ledger(size, final[0], T)]
        if final is None or steps > final[0]:
            ledgers.append(ex.ledger(size, self.chunking.chunk(size, T)))
        return max(ledgers, key=lambda ledger: ledger.total)

    # ------------------------------------------------------------ planning

    def plan_for(self, state: TrainState, target_batch_size: int | None = None) -> int:
        """Plans the size for a bound state (``target_batch_size``: a schedule's, if changed)."""
        if target_batch_size is not None:
            self.target_batch_size = target_batch_size
        self.chunking.reset()  # another shape: its chunks are its own
        self._limit, self._limit_raised = self.sizing.memory_limit, False
        self.sizing.measure_others(tree_bytes(self.executables.state_structs))
        if self.capacity() is not None:  # the state itself must fit: compile and check
            self.optimizer_step()
        if self.fixed is not None:
            size = self._fixed_for(self.target_batch_size)
            self.executables.micro(size)
            self._use(size, "fixed")
            return self.size
        self.largest, self._open = None, True
        size = self.program.cached(self.target_batch_size, "init")
        if size is not None:
            self._use(size, "plan cache")
            return self.size
        if self.background_search and jax.process_count() == 1:
            self._search_in_background()
            return self.size
        size = self._searched(self.target_batch_size, "init")
        self._use(self._chosen(state, size), "searched")
        return self.size

    def _search_in_background(self) -> None:
        """Starts the search on a thread and runs the first size it finds to fit.

        It asks an eighth of the target first, which fits most limits: the first update
        waits for one compile (and the optimizer step's, compiled beside it). Every plan
        trains the same, so the updates until the search ends are training.
        """
        T, multiple = self.target_batch_size, self._multiple
        self._search = BackgroundSearch(
            lambda found: self.program.largest_fitting(
                hi=T, reason="init", multiple_of=multiple, least=self.shards, on_fit=found,
                first=first_size(T, multiple),
            )
        )  # fmt: skip
        if self.capacity() is None:  # else compiled and checked before the search
            self.optimizer_step()  # on this thread while the search compiles its first size
        self._follow_search()

    def _follow_search(self, state: TrainState | None = None) -> None:
        """Runs the largest size the search has found so far; its plan once it has ended."""
        fit = self._search.first_fit()  # type: ignore[union-attr]
        if fit is None:  # it has ended
            self._end_search(state)
        else:  # one micro-step a dispatch, with the programs the search compiled
            self.size, self.source = fit.size, INTERIM
            self.chunking.least()

    def finish_search(self) -> bool:
        """Waits for a search in the background to end; its plan runs from the next update.

        Returns whether a search was going on.
        """
        if self._search is None:
            return False
        self._end_search()
        return True

    def _end_search(self, state: TrainState | None = None) -> None:
        """Takes the ended search's plan; its error, if any, is raised (and nothing is planned).

        ``objective="throughput"`` times the plans with ``state``, or at the next update's
        start when there is none at hand.
        """
        search, self._search = self._search, None
        try:
            largest = search.finish()  # type: ignore[union-attr]
        except BaseException:
            self.size = None  # as after an init that raised: init again
            raise
        self._found(largest, self.target_batch_size)
        self._timing_due = state is None and self.objective == "throughput"
        self._use(self._trimmed(largest) if state is None else self._chosen(state, largest),
                  "searched")  # fmt: skip

    def _chosen(self, state: TrainState, largest: int) -> int:
        """The size the objective takes below ``largest``: timed, for ``"throughput"``."""
        timing = None
        if self.objective == "throughput":
            T, budget = self.target_batch_size, self.timing_budget
            timing = plan_timing(T, largest, self._multiple, online=False, budget=budget)
        if timing is None:
            return self._trimmed(largest)
        self.program.timed = run_offline(timing, self._timer(state))
        return self.program.timed.chosen

    def _searched(self, hi: int, reason: str, lo: int = 1) -> int:
        """The largest size in ``[lo, hi]`` that fits, agreed; remembered as `largest`.

        A multiple of ``multiple_of`` (and always of the data shards) unless none fits.
        """
        largest = self.program.largest_fitting(
            hi=hi, reason=reason, lo=lo, multiple_of=self._multiple, least=self.shards
        )
        return self._found(largest, hi)

    def _found(self, largest: int, hi: int) -> int:
        """Remembers ``largest``, the largest size up to ``hi`` that fits."""
        self.largest = largest
        self._open = largest + self._multiple > hi  # nothing above it could be tried
        return largest

    def _fixed_for(self, T: int) -> int:
        """The fixed size, capped by ``T`` (a multiple of the data shards)."""
        return self.fixed if self.fixed <= T else max(self.shards, T // self.shards * self.shards)

    def set_target(self, T: int) -> None:
        """Plans for updates of ``T`` examples (a batch-size schedule's next size).

        The size: the largest known to fit at or below ``T`` (no compile), or, when ``T``
        lies above every size the last search could try, a search upward from it; then
        trimmed for ``T``. A fixed size is kept, capped by ``T``.
        """
        if T == self.target_batch_size:
            return
        self.finish_search()  # searched for the last target
        self.target_batch_size = T
        if self.size is None:  # not planned yet: plan_for plans for T
            return
        if self.fixed is not None:
            self._use(self._fixed_for(T), "fixed")
            return
        known = self.largest if self.largest is not None else self.size
        if T > known and self._open:
            size = self.program.cached(T, "init") if self.largest is None else None
            if size is not None:  # a run of the same job stored this target's plan
                self._use(size, "plan cache")
                return
            largest = self._searched(T, f"target batch {T}", lo=known)
        else:
            largest = self._below(min(known, T))
        self._use(self._trimmed(largest), "searched")

    def _below(self, cap: int) -> int:
        """The largest size at or below ``cap`` (which fits) that a search would prefer."""
        multiple = self._multiple
        if cap >= multiple:
            return cap // multiple * multiple
        return max(self.shards, cap // self.shards * self.shards)

    def _trimmed(self, largest: int) -> int:
        """The size the objective takes below the largest that fits (`least_padding_size`).

        ``"throughput"`` times its plans once, at `plan_for`; later it trims as the default.
        """
        if self.objective == "max":
            return largest
        return least_padding_size(self.target_batch_size, largest, self._multiple)

    @property
    def _multiple(self) -> int:
        """What every size should be a multiple of: ``multiple_of`` and the data shards."""
        return math.lcm(self.multiple_of, self.shards)

    def _use(self, size: int, source: str) -> None:
        """Takes ``size`` and its chunk, stores it in the plan cache, frees other sizes."""
        self.size, self.source = size, source
        if self.fixed is None:
            self.program.store(size, target_batch_size=self.target_batch_size)
        self.program.use(size)
        self.executables.release(keep={size})
        self.chunking.forget()

    def _timer(self, state: TrainState) -> Callable[[int], float]:
        """``time_once(size)``: an update of ``size``, from one micro-step on zeros.

        The micro-step's time times the micro-steps per update; an update's dispatches
        (its chunks, decided after the plan) are left out.
        """
        T, ex = self.target_batch_size, self.executables

        def time_once(size: int) -> float:
            self.program.check(size)
            seconds = ex.time_program(ex.micro(size), state, size, T, reps=1, warm=False)
            return seconds * math.ceil(T / size)

        return time_once

    # ------------------------------------------------------------ changes

    def start_update(self, state: TrainState) -> None:
        """Called at each update's start: follows the search, the limit, grows if it may."""
        self.program.start()
        if self._search is not None:
            self._follow_search(state)
            if self._search is not None:  # the limit is followed once the plan is made
                return
        if self._timing_due:  # ``objective="throughput"``: the ended search's plans
            self._timing_due = False
            self._use(self._chosen(state, self.largest), "searched")  # type: ignore[arg-type]
        self._follow_limit()
        if self.fixed is not None or self.size == self.target_batch_size:
            return
        periodic = isinstance(self.grow, int) and self._updates_since_grow >= self.grow
        # Every process counts the same updates; only a raised limit is local news.
        on_limit = self.grow == "on_limit_change" and process_any(self._limit_raised)
        if not (periodic or on_limit):
            return
        self._limit_raised, self._updates_since_grow = False, 0
        if periodic:
            self.program.forget_learned()  # memory may have come back: real runs decide
        self.sizing.measure_others(tree_bytes(self.executables.state_structs))
        try:
            self._searched(self.target_batch_size, "grow", lo=self.size)
        except NothingFitsError:  # not even the current size fits now: the step shrinks it
            self.largest, self._open = process_min(self.size), False
        self._use(self._trimmed(self.largest), "searched")

    def finish_update(self) -> None:
        """Called after each update: counts it for the periodic grow policy."""
        self._updates_since_grow += 1

    def _follow_limit(self) -> None:
        """Notes a limit changed since the plan (on the engine, maybe by another trainer).

        A raise lets the size grow; the chunk and the fused program are decided again, but
        for the chunk several processes agreed on (over a lowered limit it fails its check).
        """
        old, limit = self._limit, self.sizing.memory_limit
        if limit == old:
            return
        self._limit = limit
        self._limit_raised = limit is None or (old is not None and limit > old)
        self.chunking.forget(chunk=jax.process_count() == 1)

    def shrink(self, exc: BaseException, size: int) -> int:
        """Plans a smaller size after ``size`` ran out of memory (`Sizing.shrink`).

        A search in the background ends first; then ``size`` shrinks as any.
        """
        if self._search is not None:
            log.info("%s ran out of memory while the search went on", size)
            self._end_search()
            self._timing_due = False  # memory is tighter than planned: no timing
        largest = self.program.shrink(
            exc, size, reason="step", multiple_of=self._multiple, least=self.shards
        )
        self.largest, self._open = largest, False  # ``size`` did not fit
        self._use(self._trimmed(largest), "shrunk")
        return self.size
