"""What a plan is (`Plan`), the trials that decided it (`SizeTrial`), and its pure rules."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, NamedTuple

from jax_adaptive.memory import Ledger

__all__ = [
    "Collectives",
    "Objective",
    "Plan",
    "SearchCost",
    "SizeTrial",
    "chunk_length",
    "least_padding_size",
]

DecidedBy = Literal["estimate", "cache", "compile", "run", "learned", "plan cache"]
_DECIDED = {  # how each way of deciding reads in a trial's line
    "estimate": "compiled in {seconds:.1f} s",
    "cache": "measured before",
    "compile": "compiling it ran out of memory",
    "run": "a real run ran out of memory",
    "learned": "above the capacity real runs taught",
    "plan cache": "from the plan cache",
}
Objective = Literal["least_padding", "max", "throughput"]


class SizeTrial(NamedTuple):
    """One decision of whether a micro-batch size fits.

    Attributes:
        size: the micro-batch size.
        fits: the answer.
        estimated_bytes: the ledger's total (None if it did not compile).
        seconds: what deciding cost (compile, run).
        decided_by: ``"estimate"``, ``"cache"``, ``"compile"``, ``"run"``, ``"learned"`` or
            ``"plan cache"`` (`describe` says each in words).
        reason: why the search ran (``"init"``, ``"out of memory at size 64"``, ...).
        state_bytes: the `Ledger`'s ``state``.
        in_flight_bytes: its ``in_flight``.
        program_bytes: its ``program``.
    """

    size: int
    fits: bool
    estimated_bytes: int | None
    seconds: float
    decided_by: DecidedBy
    reason: str
    state_bytes: int | None = None
    in_flight_bytes: int | None = None
    program_bytes: int | None = None

    def describe(self, what: str = "micro-step of", capacity: int | None = None) -> str:
        """The trial in one line, as the search logs it.

        Examples:
            >>> trial = SizeTrial(64, True, 2_000_000, 4.1, "estimate", "init")
            >>> trial.describe(capacity=3_000_000)
            'micro-step of 64 fits: 2,000,000 of 3,000,000 bytes (compiled in 4.1 s; init)'
        """
        verdict = "fits" if self.fits else "does not fit"
        need = "? bytes" if self.estimated_bytes is None else f"{self.estimated_bytes:,}"
        if self.estimated_bytes is not None:
            need += " bytes" if capacity is None else f" of {capacity:,} bytes"
        how = _DECIDED[self.decided_by].format(seconds=self.seconds)
        return f"{what} {self.size} {verdict}: {need} ({how}; {self.reason})"


class SearchCost(NamedTuple):
    """What a search for the largest size cost, against one compile of the size it found.

    Attributes:
        seconds: its wall time (tracing, compiling, measuring).
        compiles: the sizes it compiled.
        size: the size it found.
        one_compile: the seconds compiling that size took (None: not compiled by it).

    Examples:
        >>> print(SearchCost(6.6, 4, 108, 2.1))
        search 6.6 s, 4 compiles (3.1x one compile of 108)
    """

    seconds: float
    compiles: int
    size: int
    one_compile: float | None

    def __str__(self) -> str:
        words = f"search {self.seconds:.1f} s, {self.compiles} compile{'s' * (self.compiles != 1)}"
        if self.one_compile:
            words += f" ({self.seconds / self.one_compile:.1f}x one compile of {self.size})"
        return words


class Collectives(NamedTuple):
    """The collective ops of an update's compiled programs, by kind (``{"all-gather": 8}``).

    Counted in the programs' text (`jax_adaptive.sharding.collective_counts`): what
    sharded state costs in communication. A micro-step's run once per micro-step, the
    optimizer step's once per update.

    Attributes:
        micro_step: in one micro-step's program.
        optimizer_step: in the optimizer step's program.

    Examples:
        >>> c = Collectives({"all-gather": 4, "all-reduce": 0}, {"all-reduce": 1})
        >>> c.per_update(3)
        {'all-gather': 12, 'all-reduce': 1}
        >>> c.describe(3)
        'collectives 4 all-gather per micro-step, 12 all-gather + 1 all-reduce per update'
    """

    micro_step: Mapping[str, int]
    optimizer_step: Mapping[str, int]

    def per_update(self, steps: int) -> dict[str, int]:
        """Ops run per update of ``steps`` micro-steps (kinds with none left out)."""
        ops = dict.fromkeys([*self.micro_step, *self.optimizer_step], 0)
        for op in ops:
            ops[op] = steps * self.micro_step.get(op, 0) + self.optimizer_step.get(op, 0)
        return {op: n for op, n in ops.items() if n}

    def describe(self, steps: int) -> str | None:
        """Per micro-step and per update in words, each only when nonzero; None if none."""
        micro = {op: n for op, n in self.micro_step.items() if n}
        update = self.per_update(steps)
        pairs = ((micro, "micro-step"), (update, "update"))
        words = [_ops(ops, when) for ops, when in pairs if ops]
        return f"collectives {', '.join(words)}" if words else None


def _ops(ops: Mapping[str, int], when: str) -> str:
    return " + ".join(f"{n} {op}" for op, n in ops.items() if n) + f" per {when}"


class Plan(NamedTuple):
    """The size in use and what it costs; ``str(plan)`` says it in words.

    Attributes:
        micro_batch_size: the size.
        accumulation_steps: micro-steps per update.
        ledger: the `Ledger` at the peak of an update's programs (None until measured:
            a fixed size or a cached plan before its first compile).
        capacity: the bytes it was planned under (None: unknown, a CPU with no limit).
        chunk: micro-steps per dispatch (`chunk_length`; the ledger is the chunk's);
            None until the size's first update decides it, as ``fused``.
        largest: the largest size that fits, which ``objective="least_padding"`` trims
            to the least padding (None: not searched).
        fused: whether the last program runs the optimizer step too (its ledger fits).
        source: ``"searched"``, ``"plan cache"``, ``"fixed"`` or ``"shrunk"`` (after an
            out-of-memory), `jax_adaptive.background.INTERIM` while a search goes on in
            the background; None when unknown.
        found: under ``jax.distributed``, the largest size each process found, in
            process order, when they differ (all plan from the smallest); else None.
        collectives: the `Collectives` of the update's programs under a mesh (None: one
            device, or not measured yet); the words say them when there are any.
        remat: the remat policy chosen and each policy's plan, in words
            (`jax_adaptive.remat.RematChoice`); None when the model offers no choice.
        sharding: the state's sharding the plan assumed, in a few words (``"state
            sharded over data (FSDP)"``, ``"state replicated over 8 devices"``); None on
            one device.
        timed: the plans timed and the one chosen, in words (`jax_adaptive.timing.Timed`,
            ``objective="throughput"``); None when the plan was not timed.
        search: what the search for the largest size cost (`SearchCost`), in words;
            None when no search ran (a fixed size, the plan cache).

    Examples:
        >>> ledger = Ledger(state=1_000, in_flight=200, program=300)
        >>> print(Plan(34, 3, ledger, 2_000, chunk=3, largest=40, fused=True, source="searched"))
        micro-batch 34 x 3 micro-steps (searched; the largest that fits is 40), peak 1,500 \
of 2,000 bytes (state 1,000 + in flight 200 + program 300), 3 micro-steps per dispatch, \
the optimizer step in the last program
    """

    micro_batch_size: int
    accumulation_steps: int
    ledger: Ledger | None
    capacity: int | None
    chunk: int | None = None
    largest: int | None = None
    fused: bool | None = None
    source: str | None = None
    found: tuple[int, ...] | None = None
    collectives: Collectives | None = None
    remat: str | None = None
    sharding: str | None = None
    timed: str | None = None
    search: str | None = None

    def bound(self) -> str | None:
        """Which process bound the plan and how much further the others could have gone.

        Examples:
            >>> print(Plan(48, 2, None, None, found=(64, 48, 56)).bound())
            process 1 bound it at 48; the others could have gone to 64 (process 0, +16), \
56 (process 2, +8)
        """
        if self.found is None:
            return None
        least = min(self.found)
        further = ", ".join(
            f"{s} (process {i}, +{s - least})" for i, s in enumerate(self.found) if s != least
        )
        bound = f"process {self.found.index(least)} bound it at {least}"
        return f"{bound}; the others could have gone to {further}"

    def __str__(self) -> str:
        m, k = self.micro_batch_size, self.accumulation_steps
        words = [f"micro-batch {m} x {k} micro-step{'s' * (k != 1)}"]
        why = [self.source] if self.source else []
        if self.largest is not None and self.largest != m:
            why.append(f"the largest that fits is {self.largest}")
        if self.found is not None:
            why.append(str(self.bound()))
        if self.remat is not None:
            why.append(f"remat policy {self.remat}")
        if self.timed is not None:
            why.append(self.timed)
        if why:
            words[0] += f" ({'; '.join(why)})"
        of = "" if self.capacity is None else f" of {self.capacity:,}"
        if self.ledger is None:
            words.append(f"peak not measured yet{of and f' (capacity{of} bytes)'}")
        else:
            parts = self.ledger
            words.append(
                f"peak {parts.total:,}{of} bytes (state {parts.state:,} + in flight "
                f"{parts.in_flight:,} + program {parts.program:,})"
            )
        if self.chunk is not None:
            words.append(f"{self.chunk} micro-step{'s' * (self.chunk != 1)} per dispatch")
        if self.fused is not None:
            where = "in the last program" if self.fused else "apart"
            words.append(f"the optimizer step {where}")
        if self.sharding is not None:
            words.append(self.sharding)
        if self.collectives is not None and (said := self.collectives.describe(k)):
            words.append(said)
        if self.search is not None:
            words.append(self.search)
        return ", ".join(words)


def least_padding_size(target_batch_size: int, largest: int, multiple_of: int = 1) -> int:
    """The size with the fewest micro-steps ``largest`` allows, and the least padding.

    ``ceil(T / k)`` for ``k = ceil(T / largest)`` micro-steps, rounded up to
    ``multiple_of``, never above ``largest``.

    Examples:
        >>> least_padding_size(4096, 1342)  # 4 micro-steps of 1024, not 1342 x 4
        1024
        >>> least_padding_size(100, 48, multiple_of=8)  # 3 x 40 would pad 20; 3 x 34 -> 40
        40
    """
    steps = math.ceil(target_batch_size / largest)
    size = -(-math.ceil(target_batch_size / steps) // multiple_of) * multiple_of
    return min(size, largest)


def chunk_length(steps: int, most: int) -> int:
    """Micro-steps per dispatch: the fewest dispatches for ``steps``, at most ``most`` each.

    An update runs ``steps // c`` chunks of ``c``, then ``steps % c`` single micro-steps;
    of the lengths with the fewest dispatches, the shortest (the least in flight).

    Examples:
        >>> chunk_length(128, 16), chunk_length(7, 16), chunk_length(10, 4), chunk_length(5, 1)
        (16, 7, 3, 1)
    """
    most = max(1, min(most, steps))
    return min(range(1, most + 1), key=lambda c: (steps // c + steps % c, c))
