"""The one sizing engine: which sizes of a program fit the device, and which one to run.

A client (the planner, `jax_adaptive.Evaluator`, `jax_adaptive.AdaptiveStep`) describes
its program for one input signature as a `Sized`; `Sizing.bind` gives it that
signature's `Binding` (`jax_adaptive.binding`), kept for when the signature comes
back. The engine owns, for every client: the capacity, each size's ledger (compiled and
measured once), the search, the plan cache, and the shrink after an out-of-memory
(docs/memory.md, docs/recovery.md). Every trial is logged at INFO on the
``jax_adaptive`` logger.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import jax

from jax_adaptive import checks
from jax_adaptive.binding import Binding, Sized, log
from jax_adaptive.memory import FaultHook, Ledger, others_bytes, usable_capacity
from jax_adaptive.plan import DecidedBy, SizeTrial
from jax_adaptive.plan_cache import PlanCache

__all__ = ["Binding", "Sized", "Sizing", "log"]


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
            `jax_adaptive.checks.compile_workers`; 1: one at a time).
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
        self.compile_workers = checks.compile_workers()
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
