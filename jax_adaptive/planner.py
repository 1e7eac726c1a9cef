"""The plan: which micro-batch size to run, and how it changes when memory does.

`Planner` decides the size from the capacity and each size's `jax_adaptive.Ledger`
(everything live on the device while its micro-steps run), through the plan cache or a
search guided by the memory model; it shrinks the size after an out-of-memory and grows
it back at an update boundary. Under ``jax.distributed`` every process plans the same
size (the smallest any found), so all run the same programs.

The capacity a size's ledger is compared with is the smaller of ``memory_limit`` (a
device of that many bytes: the comparison is exact) and, where the device says (a GPU),
its ``bytes_limit`` less ``headroom`` less what other live arrays held when the plan was
made. A real out-of-memory teaches a lower capacity (`Planner.shrink`).

How the size's micro-steps are dispatched (the chunk, the fused last program) is
decided by its `jax_adaptive.chunking.Chunking`, again whenever the size, the target or
the limit changes.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import jax

from jax_adaptive.chunking import Chunking
from jax_adaptive.distributed import process_any, process_min
from jax_adaptive.errors import NothingFitsError, PeerOutOfMemory, SimulatedOutOfMemory, catch_oom
from jax_adaptive.executables import Executable, Executables
from jax_adaptive.memory import (
    Ledger,
    MemoryModel,
    device_capacity,
    others_bytes,
    tree_bytes,
    usable_capacity,
)
from jax_adaptive.plan import Objective, Plan, least_padding_size
from jax_adaptive.plan_cache import PlanCache, plan_key
from jax_adaptive.sizing import SizeSearch
from jax_adaptive.step import TrainState

__all__ = ["Planner"]

log = logging.getLogger("jax_adaptive")

GrowPolicy = Literal["never", "on_limit_change"] | int


class Planner:
    """Plans the micro-batch size over an `jax_adaptive.executables.Executables`.

    The plan does not depend on the target batch size ``T``, only capped by it: a
    batch-size schedule changes ``T`` between updates (`set_target`) and the size is
    then the largest known to fit below the new ``T`` (searched upward, from the sizes
    already measured, when ``T`` grows past the sizes the last search could try),
    trimmed to the least padding for the new ``T``; the chunk is decided again for the
    new number of micro-steps.

    Args:
        executables: the compiled pieces (bound to a state and an example shape).
        target_batch_size: examples per update (the first update's, with a schedule).
        fixed: a fixed size, never searched nor changed; None to search.
        memory_limit, headroom, grow, oom_retries, multiple_of, plan_cache,
            objective, chunk: as `jax_adaptive.AdaptiveTrainer` documents them.
        shards: the data shards every size must be a multiple of.
        device: the device whose capacity counts.
        memory_prior: a predicted ``(intercept, slope)`` of the peak against the size
            (`jax_adaptive.buckets.predict_line`), guiding the first compiles of a search.

    Attributes:
        search_log: every `SizeTrial`.
        sizes: the `jax_adaptive.sizing.SizeSearch` deciding which sizes fit.
        throughput_log: the timed candidates of ``objective="throughput"``.
        memory_model: the `jax_adaptive.memory.MemoryModel` of every size measured.
    """

    def __init__(
        self,
        executables: Executables,
        *,
        target_batch_size: int,
        fixed: int | None = None,
        memory_limit: int | None = None,
        headroom: float = 0.05,
        grow: GrowPolicy = "on_limit_change",
        oom_retries: int = 3,
        multiple_of: int = 1,
        shards: int = 1,
        plan_cache: PlanCache | None = None,
        objective: Objective = "least_padding",
        chunk: int | Literal["auto"] = "auto",
        device: Any = None,
        memory_prior: tuple[float, float] | None = None,
    ):
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"{headroom=} must be in [0, 1).")
        if not (grow in ("never", "on_limit_change") or (isinstance(grow, int) and grow > 0)):
            raise ValueError(f"{grow=} must be 'never', 'on_limit_change' or a positive int.")
        if objective not in ("least_padding", "max", "throughput"):
            raise ValueError(f"{objective=} must be 'least_padding', 'max' or 'throughput'.")
        if chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"{chunk=} must be 'auto' or a positive int.")
        self.executables, self.target_batch_size, self.fixed = executables, target_batch_size, fixed
        self.memory_limit, self.headroom, self.grow = memory_limit, headroom, grow
        self.oom_retries, self.multiple_of, self.shards = oom_retries, multiple_of, shards
        self.plan_cache, self.objective, self.device = plan_cache, objective, device
        self.memory_model = MemoryModel(prior=memory_prior)
        self.sizes = SizeSearch(
            "micro-step of",
            ledger=self.ledger,
            capacity=self.capacity,
            known=lambda size: self.memory_model.points.get(size),
            propose=lambda capacity: self.memory_model.propose(capacity),
            lower=self.executables.lower,
            headroom=headroom,
        )
        self.search_log = self.sizes.search_log
        self.throughput_log: list[dict[str, float]] = []
        self.size: int | None = None
        # XLA:CPU's slow loops: a chunk is timed there, by one process (`settle`)
        platform = getattr(device, "platform", jax.default_backend())
        self.chunking = Chunking(
            executables,
            ledger=self.ledger,
            capacity=self.sizes.guide_capacity,
            limit=chunk,
            timed=platform == "cpu" and jax.process_count() == 1,
        )
        self.largest: int | None = None  # the largest size that fits, when searched
        self._open = True  # no size above `largest` was tried: a larger target searches up
        self._generation = 0  # the executables' binding the memory model measured
        self._others = 0  # bytes other live arrays held on the device at the last plan
        self._oom_streak = 0  # out-of-memory errors since the last micro-step that ran
        self._real_ooms_this_update = 0
        self._limit_raised = False
        self._updates_since_grow = 0

    # ------------------------------------------------------------ capacity and ledgers

    def capacity(self) -> int | None:
        """The bytes a size's ledger may reach; None when unknown (a CPU with no limit)."""
        return usable_capacity(self.memory_limit, self.device, self.headroom, self._others)

    def _measure_others(self) -> None:
        own = tree_bytes(self.executables.state_structs)  # live now; totals are not yet
        self._others = others_bytes(self.device, own)

    def ledger(self, size: int, chunk: int = 1) -> Ledger:
        """The `jax_adaptive.Ledger` of ``chunk`` micro-steps of ``size``, compiled if need be."""
        ledger = self.executables.ledger(size, chunk)
        if chunk == 1:
            self.memory_model.add(size, ledger.total)
        return ledger

    def check(self, size: int, chunk: int = 1) -> None:
        """Raises the simulated out-of-memory when the program's peak exceeds the capacity."""
        if chunk == 1:
            return self.sizes.check(size)
        capacity, needed = self.capacity(), self.ledger(size, chunk).total
        if capacity is not None and needed > capacity:
            raise SimulatedOutOfMemory(needed, capacity, what=f"chunk of {chunk} x {size}")

    def optimizer_step(self) -> tuple[Executable, bool]:
        """The optimizer step to use, and whether it donates the state.

        Without donation (a failure loses nothing) when the state twice fits; donating
        the state when only that fits.
        """
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
        """The `Plan` in use."""
        if self.size is None:
            raise RuntimeError("call trainer.init(params, example_batch) first.")
        known = self.size in self.memory_model.points
        return Plan(
            self.size,
            math.ceil(self.target_batch_size / self.size),
            self._peak() if known else None,
            self.capacity(),
            self.chunking.chunk_of,
            None if self.largest is None else min(self.largest, self.target_batch_size),
            self.chunking.fused,
        )

    def _peak(self) -> Ledger:
        """The largest ledger of the programs an update runs (chunks, the last one)."""
        final, steps = self.final, math.ceil(self.target_batch_size / self.size)
        ledgers = [] if final is None else [self.executables.final_ledger(self.size, final[0])]
        if final is None or steps > final[0]:
            ledgers.append(self.executables.ledger(self.size, self.chunk))
        return max(ledgers, key=lambda ledger: ledger.total)

    # ------------------------------------------------------------ planning

    def plan_for(self, state: TrainState, target_batch_size: int | None = None) -> int:
        """Plans the size for a bound state: fixed, from the plan cache, or searched.

        ``target_batch_size``: the next update's (a schedule's), if it changed.
        """
        if target_batch_size is not None:
            self.target_batch_size = self.executables.target_batch_size = target_batch_size
        if self._generation != self.executables.generation:  # another shape: measure anew
            self._generation = self.executables.generation
            self.memory_model = MemoryModel(prior=self.memory_model.prior)
        self._measure_others()
        if self.capacity() is not None:  # the state itself must fit: compile and check
            self.optimizer_step()
        if self.fixed is not None:
            size = self._fixed_for(self.target_batch_size)
            self.executables.micro(size)
            self._use(size)
            return self.size
        self.largest, self._open = None, True
        size = self._cached_plan()
        if size is None:
            size = self._searched(self.target_batch_size, "init")
            size = self._fastest(state, size) if self.objective == "throughput" else size
        self._use(self._trimmed(size))
        return self.size

    def _searched(self, hi: int, reason: str, lo: int = 1) -> int:
        """The largest size in ``[lo, hi]`` that fits, agreed; remembered as `largest`."""
        self.largest = process_min(self._search(lo=lo, hi=hi, reason=reason))
        self._open = self.largest + self._multiple > hi  # nothing above it could be tried
        return self.largest

    def _fixed_for(self, T: int) -> int:
        """The fixed size, capped by ``T`` (a multiple of the data shards)."""
        return self.fixed if self.fixed <= T else max(self.shards, T // self.shards * self.shards)

    def set_target(self, T: int) -> None:
        """Plans for updates of ``T`` examples (a batch-size schedule's next size).

        Nothing changes when ``T`` does not. Otherwise the size is the largest known
        to fit at or below ``T`` (no compile: a size below one that fits fits), or, when
        ``T`` lies above every size the last search could try, the largest found by a
        search from the largest known upward (sizes already measured are not compiled
        again); then trimmed for ``T`` by the objective. The chunk is decided again.
        A fixed size is kept, capped by ``T``.
        """
        if T == self.target_batch_size:
            return
        self.target_batch_size = self.executables.target_batch_size = T
        if self.size is None:  # not planned yet: plan_for plans for T
            return
        if self.fixed is not None:
            self._use(self._fixed_for(T))
            return
        known = self.largest if self.largest is not None else self.size
        if T > known and self._open:
            size = self._cached_plan() if self.largest is None else None
            if size is not None:  # a run of the same job stored this target's plan
                self._use(size)
                return
            largest = self._searched(T, f"target batch {T}", lo=known)
        else:
            largest = self._below(min(known, T))
        self._use(self._trimmed(largest))

    def _below(self, cap: int) -> int:
        """The largest size at or below ``cap`` (which fits) that a search would prefer."""
        multiple = self._multiple
        if cap >= multiple:
            return cap // multiple * multiple
        return max(self.shards, cap // self.shards * self.shards)

    def _trimmed(self, largest: int) -> int:
        """The size the objective takes below the largest that fits (`least_padding_size`)."""
        if self.objective != "least_padding":
            return largest
        return least_padding_size(self.target_batch_size, largest, self._multiple)

    @property
    def _multiple(self) -> int:
        """What every size should be a multiple of: ``multiple_of`` and the data shards."""
        return math.lcm(self.multiple_of, self.shards)

    def _use(self, size: int) -> None:
        """Takes ``size`` and its chunk, stores it under the live key, frees other sizes."""
        self.size = size
        self._store_plan()
        self.executables.release(keep={size})
        self.chunking.forget()

    @property
    def chunk(self) -> int:
        """Micro-steps per dispatch for the size in use (`Chunking.chunk`)."""
        return self.chunking.chunk(self.size, self.target_batch_size)

    @property
    def final(self) -> tuple[int, Executable] | None:
        """The update's last program with the optimizer step in it (`Chunking.final`)."""
        return self.chunking.final(self.size, self.target_batch_size)

    def settle(self, state: TrainState) -> None:
        """At an update's start: the chunk, if it is not much slower (`Chunking.settle`)."""
        self.chunking.settle(state, self.size, self.target_batch_size)

    def unchunk(self) -> None:
        """After a program of several micro-steps, or the optimizer step's, ran out of memory."""
        self.chunking.unchunk(self.size)

    def key(self) -> str:
        """The plan cache's key: what decides the plan, as it is now (the live limit)."""
        device = self.device
        return plan_key(
            platform=device.platform,
            device_kind=device.device_kind,
            device_capacity=device_capacity(device),
            memory_limit=self.memory_limit,
            headroom=self.headroom,
            multiple_of=self.multiple_of,
            shards=self.shards,
            target_batch_size=self.target_batch_size,
            objective=self.objective,
            example=str(self.executables.example),
            # at a size every model accepts (ghost batches need a multiple of the group)
            micro_step=self.executables.fingerprint(min(self._multiple, self.target_batch_size)),
            jax=jax.__version__,
        )

    def _cached_plan(self) -> int | None:
        """The size a run of the same job stored, if it makes sense; else None."""
        return self.sizes.from_cache(self.plan_cache, self.key, self.target_batch_size, "init")

    def _store_plan(self) -> None:
        if self.plan_cache is None or self.fixed is not None:
            return
        known = self.size in self.memory_model.points
        self.plan_cache.put(
            self.key(),
            {
                "micro_batch_size": self.size,
                "estimated_bytes": self.memory_model.points[self.size] if known else None,
                "target_batch_size": self.target_batch_size,
                "capacity": self.capacity(),
            },
        )

    def _search(self, *, hi: int, reason: str, lo: int = 1) -> int:
        """The largest size in [lo, hi] whose ledger fits, guided by the memory model.

        Sizes are multiples of ``multiple_of`` (and always of the data shards) unless
        none fits. The capacity learned from real out-of-memory errors guides the search
        but never makes a run fail: only a real run says a size does not fit.
        """
        return self.sizes.largest(
            hi=hi, reason=reason, lo=lo, multiple_of=self._multiple, least=self.shards
        )

    def _fastest(self, state: TrainState, largest: int) -> int:
        """The candidate at or below ``largest`` whose update is fastest, timed on zeros.

        Candidates: ``largest`` and ``ceil(T / k)`` for the three smallest ``k`` it
        allows (the same micro-steps with less padding, or one or two more).
        """
        T, multiple, ex = self.target_batch_size, self._multiple, self.executables
        k = math.ceil(T / largest)
        fewest = (
            min(largest, -(-math.ceil(T / j) // multiple) * multiple) for j in range(k, k + 3)
        )
        timings = {}
        for size in sorted({largest, *fewest}, reverse=True):
            capacity = self.sizes.guide_capacity()
            if capacity is not None and self.ledger(size).total > capacity:
                continue
            seconds, error = catch_oom(
                lambda size=size: ex.time_program(ex.micro(size), state, size)
            )
            if error is not None:
                continue  # a real out-of-memory: not a candidate
            seconds *= math.ceil(T / size)
            timings[size] = seconds
            self.throughput_log.append(
                {"size": size, "seconds_per_update": seconds, "examples_per_second": T / seconds}
            )
        return min(timings, key=timings.get)

    # ------------------------------------------------------------ changes

    def start_update(self) -> None:
        """Called at each update's start: grows back if the policy says so."""
        self._real_ooms_this_update = 0
        if self.fixed is not None or self.size == self.target_batch_size:
            return
        periodic = isinstance(self.grow, int) and self._updates_since_grow >= self.grow
        # Every process counts the same updates; only a raised limit is local news.
        on_limit = self.grow == "on_limit_change" and process_any(self._limit_raised)
        if not (periodic or on_limit):
            return
        self._limit_raised = False
        self._updates_since_grow = 0
        if periodic:
            self.sizes.learned_cap = None  # memory may have come back: let real runs decide
        self._measure_others()
        try:
            self._searched(self.target_batch_size, "grow", lo=self.size)
        except NothingFitsError:  # not even the current size fits now: the step shrinks it
            self.largest, self._open = process_min(self.size), False
        self._use(self._trimmed(self.largest))

    def finish_update(self) -> None:
        """Called after each update: counts it for the periodic grow policy."""
        self._updates_since_grow += 1

    def ran(self) -> None:
        """Called after a micro-step ran: out-of-memory errors are no longer in a row."""
        self._oom_streak = 0

    def set_memory_limit(self, memory_limit: int | None) -> None:
        """Changes the cap; a raise lets the planner grow at the next update.

        The chunk and whether the last program runs the optimizer step were decided
        under the old cap: the next update decides them again, even at the same size.
        With several processes the chunk stays (the processes agree on it together, and
        a cap is one process's news): a chunk over a lowered cap fails its check and
        the update goes on one micro-step per dispatch.
        """
        old = self.memory_limit
        self._limit_raised = (memory_limit is None) if old is not None else False
        if memory_limit is not None and old is not None:
            self._limit_raised = memory_limit > old
        self.memory_limit = memory_limit
        if memory_limit != old:
            self.chunking.forget(chunk=jax.process_count() == 1)

    def shrink(self, exc: BaseException, size: int) -> int:
        """Marks ``size`` as not fitting after ``exc`` and plans a smaller one.

        A real out-of-memory says the ledger was too optimistic here: the capacity
        becomes the failed size's peak less ``headroom`` the first time in an update,
        and half of it each further time (the peak is then no guide), so a few compiles
        reach a size that runs; the memory model picks each size.
        """
        real = not isinstance(exc, SimulatedOutOfMemory | PeerOutOfMemory)
        peak = self.memory_model.points.get(size)
        if peak is None:
            peak = self.ledger(size).total
        self.sizes.record(size, False, peak, 0.0, "run" if real else "estimate", "step")
        log.warning("micro-batch %d ran out of memory (%s)", size, "real" if real else "simulated")
        self._oom_streak += 1
        if real:
            self._real_ooms_this_update += 1
            self.sizes.learn(peak, first=self._real_ooms_this_update == 1)
        try:
            if size <= self.shards:
                raise self.sizes.nothing_fits(size, []) from exc
            self._searched(size - 1, f"out of memory at size {size}")
            self._open = False  # ``size`` did not fit
            self._use(self._trimmed(self.largest))
        except NothingFitsError:
            # A real out-of-memory can pass (fragmentation, another job's peak): retry the
            # smallest size a few times in a row before giving up.
            if not real or self._oom_streak > self.oom_retries:
                raise
            self._use(self.shards)
        return self.size
