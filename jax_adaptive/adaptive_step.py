"""AdaptiveStep: your own jitted training step, at the largest micro-batch that fits.

For researchers who keep their loop: you write ``build_step(micro_batch_size)``, which
returns your jitted ``train_step(state, batch)`` for that size (typically with
`jax_adaptive.micro_batch_grad` inside, so the whole target batch is one exact update
whatever the size), and `AdaptiveStep` does the rest with the trainer's rules:

* **the plan**: it compiles your step ahead of time for candidate sizes
  (``jax.ShapeDtypeStruct``s of your state and batch, nothing allocated) and keeps the
  largest whose `jax_adaptive.Ledger` fits the capacity, through
  `jax_adaptive.search_max_size` guided by a `jax_adaptive.memory.MemoryModel`, remembered in
  the plan cache. The ledger counts everything live while the step runs: the arguments
  whole (JAX prunes the ones a program does not read, yet they stay resident), the
  step's new outputs (those not aliased to a donated argument), its temporaries and
  code. ``memory_limit`` is a device of that many bytes: a size over it raises
  `jax_adaptive.SimulatedOutOfMemory`, as a real device would raise its own error.
* **the guarded call**: ``step(state, batch)`` runs the compiled step and waits for
  it. An out-of-memory (real, or the simulated capacity) re-plans below the size that
  failed and runs the same batch again; any other error propagates as itself. A step
  that donates its state (``donate_argnums``) would lose it in a failed run (XLA
  deletes a failed call's donated inputs): the first run of each size keeps a host
  copy of the donated arguments and puts it back after a failure, so nothing is lost.
  A size that ran once is trusted (no copy); set ``host_backup="every_call"`` for a
  copy before every call.

It plans for one shape of arguments at a time: a call with other shapes (or dtypes)
plans anew.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np

from jax_adaptive.data import leading_size
from jax_adaptive.errors import NothingFitsError, SimulatedOutOfMemory, StateLostError, catch_oom
from jax_adaptive.executables import compile_measured
from jax_adaptive.memory import (
    Ledger,
    MemoryModel,
    device_capacity,
    others_bytes,
    tree_bytes,
    usable_capacity,
)
from jax_adaptive.plan import Plan, least_padding_size
from jax_adaptive.plan_cache import PlanCache, plan_key
from jax_adaptive.sizing import SizeSearch

__all__ = ["AdaptiveStep", "StepBuilder"]

log = logging.getLogger("jax_adaptive")

StepBuilder = Callable[[int], Callable[..., Any]]
"""``build_step(micro_batch_size) -> step``: your step for that (static) size, jitted
or not (a plain function is jitted as it is)."""

_STATE_LOST = (
    "the step donates its arguments, a failed run of it deleted them, and no host copy "
    "was kept (a size that ran before is trusted): restore the state from your last "
    "checkpoint; AdaptiveStep(..., host_backup='every_call') keeps a copy before every "
    "call, at the price of a copy to the host per step."
)


def _struct(x: Any, device: jax.Device) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x)
    sharding = x.sharding if isinstance(x, jax.Array) else None
    if sharding is not None and sharding.device_set == {device}:
        # An array on the step's device lowers as it would in a plain call of the step,
        # so the compiled program is the one jit's own cache holds for it.
        sharding = None
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding)


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a compiled step is specific to: the tree, the shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((np.shape(x), str(jax.typeof(x).dtype)) for x in leaves)


class AdaptiveStep:
    """Your jitted step at the largest micro-batch size that fits, re-planned on OOM.

    Args:
        build_step: ``micro_batch_size -> step`` (`StepBuilder`); the step takes
            positional array pytrees (your state, your batch, ...) and is compiled once
            per size tried. A larger size must need no less memory.
        batch_argnum: which argument is the batch: its leading size ``T`` is the
            largest size tried, and the ledger counts it as in flight.
        memory_limit: bytes: a device of that size (on a CPU, a simulated one), which
            must hold the step's ledger.
        headroom: the share of a device's real capacity (``memory_stats()``) left
            unused; never applied to ``memory_limit``.
        objective: ``"least_padding"`` (the default): the fewest micro-batches the
            largest fitting size allows, with the least padding
            (`jax_adaptive.plan.least_padding_size`); ``"max"``: the largest size itself.
        multiple_of: try only multiples of this.
        plan_cache: None for the default file (`jax_adaptive.PlanCache`), False for
            none, a path or a `jax_adaptive.PlanCache`.
        host_backup: ``"first_run"``: a host copy of the donated arguments before the
            first run of each size (and of a size retried after a failure);
            ``"every_call"``: before every call of a donating step.
        oom_retries: real out-of-memory errors in a row retried at the smallest size
            before giving up.
        device: the device whose capacity counts (the first local device by default).

    Attributes:
        search_log: every `jax_adaptive.SizeTrial`, in order.
        memory_model: the `jax_adaptive.memory.MemoryModel` of the sizes measured.
        compiles: step compiles so far.
        host_bytes: bytes copied to the host to make failures recoverable.
        fault_hook: an object with ``before_compile(size)`` and
            ``before_execution(size, args)`` (`jax_adaptive.testing.inject_oom`
            installs one), or None.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> import jax_adaptive as ja
        >>> def loss(params, batch, rng):  # per example
        ...     hidden = jnp.tanh(batch["x"] @ params["w1"])
        ...     return (hidden @ params["w2"] - batch["y"]) ** 2
        >>> def build_step(m):
        ...     @jax.jit
        ...     def train_step(params, batch):
        ...         grads = ja.micro_batch_grad(loss, m)(params, batch).grads
        ...         return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        ...     return train_step
        >>> train_step = ja.AdaptiveStep(build_step, memory_limit=200_000, plan_cache=False)
        >>> params = {"w1": jnp.ones((8, 512)) / 8, "w2": jnp.ones(512) / 512}
        >>> batch = {"x": np.ones((100, 8), np.float32), "y": np.zeros(100, np.float32)}
        >>> params = train_step(params, batch)  # plans, then runs 3 micro-batches of 34
        >>> train_step.micro_batch_size, train_step.plan_info.ledger.total <= 200_000
        (34, True)
    """

    def __init__(
        self,
        build_step: StepBuilder,
        *,
        batch_argnum: int = 1,
        memory_limit: int | None = None,
        headroom: float = 0.05,
        objective: Literal["least_padding", "max"] = "least_padding",
        multiple_of: int = 1,
        plan_cache: PlanCache | str | os.PathLike[str] | bool | None = None,
        host_backup: Literal["first_run", "every_call"] = "first_run",
        oom_retries: int = 3,
        device: jax.Device | None = None,
    ):
        if not callable(build_step):
            raise TypeError(f"build_step must be callable, got {build_step!r}.")
        if memory_limit is not None and memory_limit <= 0:
            raise ValueError(f"{memory_limit=} must be positive.")
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"{headroom=} must be in [0, 1).")
        if objective not in ("least_padding", "max"):
            raise ValueError(f"{objective=} must be 'least_padding' or 'max'.")
        if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
            raise ValueError(f"{multiple_of=} must be a positive int.")
        if host_backup not in ("first_run", "every_call"):
            raise ValueError(f"{host_backup=} must be 'first_run' or 'every_call'.")
        self.build_step, self.batch_argnum = build_step, batch_argnum
        self.memory_limit, self.headroom, self.objective = memory_limit, headroom, objective
        self.multiple_of, self.host_backup, self.oom_retries = multiple_of, host_backup, oom_retries
        self.plan_cache = PlanCache.from_arg(plan_cache)
        self.device = device or jax.local_devices()[0]
        self.sizes = SizeSearch(
            "step at micro-batch",
            ledger=self.ledger,
            capacity=self.capacity,
            known=lambda size: self.memory_model.points.get(size),
            propose=self._propose,
            lower=self._lower,
            headroom=headroom,
        )
        self.search_log = self.sizes.search_log
        self.compiles = 0
        self.host_bytes = 0
        self.fault_hook: Any = None
        self._signature: tuple[Any, ...] | None = None
        self._replan = False
        self._size: int | None = None

    # ------------------------------------------------------------ what is planned

    @property
    def micro_batch_size(self) -> int:
        """The size in use."""
        if self._size is None:
            raise RuntimeError("call step(*args) or step.plan(*args) first.")
        return self._size

    @property
    def plan_info(self) -> Plan:
        """The `jax_adaptive.Plan` in use (``accumulation_steps``: micro-batches per step)."""
        size = self.micro_batch_size
        return Plan(
            size,
            math.ceil(self.batch_size / size),
            self.ledger(size) if size in self._reports else None,
            self.capacity(),
            1,
            self.largest,
        )

    @property
    def compiled(self) -> Any:
        """The compiled step (a ``jax.stages.Compiled``) of the size in use."""
        return self.compile(self.micro_batch_size)

    def capacity(self) -> int | None:
        """The bytes a size's ledger may reach; None when unknown (a CPU with no limit).

        The smaller of ``memory_limit`` and, where the device says (a GPU), its
        ``bytes_limit`` less ``headroom`` less what other arrays held when the plan
        was made.
        """
        return usable_capacity(self.memory_limit, self.device, self.headroom, self._others)

    def set_memory_limit(self, memory_limit: int | None) -> None:
        """Changes the cap: a lower one applies at the next call, a higher one re-plans there.

        A higher cap (or none) lets a larger size fit: the next call searches again,
        without compiling again the sizes measured already.
        """
        raised = memory_limit is None or (
            self.memory_limit is not None and memory_limit > self.memory_limit
        )
        self.memory_limit = memory_limit
        self._replan = self._replan or raised

    # ------------------------------------------------------------ compiling, measuring

    def compile(self, size: int) -> Any:
        """The compiled step for ``size`` (compiled once; sizes not in use are released)."""
        self._require_bound()
        if size not in self._compiled:
            executable = compile_measured(lambda: self._lower(size), self.fault_hook, size)
            self.compiles += 1
            self._lowered.pop(size, None)
            self._compiled[size] = executable.compiled
            self._reports[size] = executable.report
        return self._compiled[size]

    def ledger(self, size: int) -> Ledger:
        """Everything live on the device while the step of ``size`` runs.

        ``state``: the arguments other than the batch, whole; ``in_flight``: the batch
        and the step's outputs not aliased to a donated argument; ``program``: the
        step's temporaries and code (XLA's memory analysis, compiled once per size).
        """
        self._require_bound()
        if size not in self._reports:
            self.compile(size)
        r = self._reports[size]
        ledger = Ledger(
            state=self._state_bytes,
            in_flight=self._batch_bytes + r["output"] - r["alias"],
            program=r["temp"] + r["code"],
        )
        self.memory_model.add(size, ledger.total)
        return ledger

    def check(self, size: int) -> None:
        """Raises `jax_adaptive.SimulatedOutOfMemory` when the ledger exceeds the capacity."""
        self.sizes.check(size)

    def _lower(self, size: int) -> Any:
        """Builds and traces the step for ``size`` (the user's errors propagate from here)."""
        if size not in self._lowered:
            step = self.build_step(size)
            if not hasattr(step, "lower"):
                step = jax.jit(step)
            self._lowered[size] = step.lower(*self._structs)
        return self._lowered[size]

    def _require_bound(self) -> None:
        if self._signature is None:
            raise RuntimeError("call step(*args) or step.plan(*args) first.")

    # ------------------------------------------------------------ planning

    def plan(self, *args: Any) -> Plan:
        """Plans the size for arguments like ``args`` (their shapes; nothing runs).

        Done by the first call; again for arguments of other shapes, and after
        `set_memory_limit` raised the cap.

        Returns:
            The `jax_adaptive.Plan`.
        """
        self._plan(args)
        return self.plan_info

    def _plan(self, args: tuple[Any, ...]) -> None:
        """Plans for ``args`` when their shapes or the cap changed; else nothing."""
        if self._bind(args):
            self._measure_others(args)
            size = self._cached_plan()
            if size is None:
                size = self._largest(hi=self.batch_size, reason="init")
            self._use(size)
        elif self._replan:
            self._replan = False
            self._use(self._largest(hi=self.batch_size, reason="memory limit raised"))

    def _bind(self, args: tuple[Any, ...]) -> bool:
        signature = _signature(args)
        if signature == self._signature:
            return False
        if not 0 <= self.batch_argnum < len(args):
            raise ValueError(
                f"batch_argnum={self.batch_argnum} is not one of {len(args)} arguments."
            )
        self.batch_size = leading_size(args[self.batch_argnum])
        self._structs = tuple(jax.tree.map(lambda x: _struct(x, self.device), args))
        others = self._structs[: self.batch_argnum] + self._structs[self.batch_argnum + 1 :]
        self._state_bytes = tree_bytes(others)
        self._batch_bytes = tree_bytes(self._structs[self.batch_argnum])
        self._signature = signature
        self._lowered: dict[int, Any] = {}
        self._compiled: dict[int, Any] = {}
        self._reports: dict[int, dict[str, int]] = {}
        self._ran: set[int] = set()
        self._fingerprint: str | None = None
        self.memory_model = MemoryModel()
        self.largest: int | None = None
        self.sizes.learned_cap = None
        self._others = 0
        self._oom_streak = 0
        self._replan = False
        return True

    def _measure_others(self, args: tuple[Any, ...]) -> None:
        own = tree_bytes([x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)])
        self._others = others_bytes(self.device, own)

    def _largest(self, *, hi: int, reason: str) -> int:
        """The largest size in ``[multiple_of, hi]`` whose ledger fits, guided by the model."""
        lo = self.multiple_of
        self.largest = self.sizes.largest(hi=hi // lo * lo, reason=reason, lo=lo, least=lo)
        if self.objective == "least_padding":
            return least_padding_size(self.batch_size, self.largest, lo)
        return self.largest

    def _propose(self, capacity: int) -> Callable[[int | None, int | None], int | None]:
        """The memory model's guess, from the sizes below the whole batch.

        At the whole batch a micro-batched step runs no loop (one micro-batch: no
        accumulator, other fusions), so its peak lies off the line of the looped sizes,
        above or below it (measured: 30% above for an MLP at T = 1024): the guesses
        leave it out.
        """

        def propose(good: int | None, bad: int | None) -> int | None:
            points = self.memory_model.points
            looped = {s: b for s, b in points.items() if s < self.batch_size}
            return MemoryModel(looped).propose(capacity)(good, bad)

        return propose

    def _use(self, size: int) -> None:
        """Takes ``size``, stores it in the plan cache, releases other sizes' programs."""
        self._size = size
        self._compiled = {s: c for s, c in self._compiled.items() if s == size}
        self._lowered = {s: low for s, low in self._lowered.items() if s == size}
        if self.plan_cache is not None:
            self.plan_cache.put(
                self._key(),
                {
                    "micro_batch_size": size,
                    "estimated_bytes": self.memory_model.points.get(size),
                    "batch_size": self.batch_size,
                    "capacity": self.capacity(),
                },
            )

    def _key(self) -> str:
        """The plan cache's key: the device, the limits, the shapes and the step's code."""
        if self._fingerprint is None:
            text = self._lower(self.multiple_of).as_text()
            self._fingerprint = hashlib.sha256(text.encode()).hexdigest()
        return plan_key(
            kind="adaptive_step",
            platform=self.device.platform,
            device_kind=self.device.device_kind,
            device_capacity=device_capacity(self.device),
            memory_limit=self.memory_limit,
            headroom=self.headroom,
            multiple_of=self.multiple_of,
            objective=self.objective,
            batch_argnum=self.batch_argnum,
            args=str(self._signature),
            step=self._fingerprint,
            jax=jax.__version__,
        )

    def _cached_plan(self) -> int | None:
        return self.sizes.from_cache(self.plan_cache, self._key, self.batch_size, "init")

    # ------------------------------------------------------------ the guarded call

    def __call__(self, *args: Any) -> Any:
        """Runs the step on ``args``; an out-of-memory re-plans smaller and runs them again.

        Returns:
            What the step returns, computed at the size in use when it succeeded.

        Raises:
            NothingFitsError: not even the smallest size fits; its ``arguments`` are
                ``args`` intact (a donated state put back).
            StateLostError: a trusted size failed in a run that deleted donated
                arguments (see ``host_backup``).
        """
        self._plan(args)
        self._real_ooms = 0
        while True:
            size = self.micro_batch_size
            cautious = size not in self._ran or self.host_backup == "every_call"
            saved: dict[int, tuple[np.ndarray, Any]] | None = {} if cautious else None
            out, error = catch_oom(functools.partial(self._run, size, args, saved))
            if error is None:
                self._ran.add(size)
                self._oom_streak = 0
                return out
            args = self._restore(args, saved)
            try:
                self._shrink(error, size)
            except NothingFitsError as exc:
                exc.arguments = args  # intact: the caller's own may have been donated
                raise

    def _run(self, size: int, args: tuple[Any, ...], saved: dict | None) -> Any:
        """One run of the step of ``size``, copying its donated arguments into ``saved``."""
        compiled = self.compile(size)
        self.check(size)
        if saved is not None:
            saved.update(self._backup(args, compiled))
        if self.fault_hook is not None:
            self.fault_hook.before_execution(size, args)
        # Wait inside the guard: with asynchronous dispatch an out-of-memory may surface
        # only when the result is read.
        return jax.block_until_ready(compiled(*args))

    def _backup(self, args: tuple[Any, ...], compiled: Any) -> dict[int, tuple[np.ndarray, Any]]:
        """Host copies of the device arrays the compiled step donates, by leaf index."""
        donated = [info.donated for info in jax.tree.leaves(compiled.args_info[0])]
        leaves = jax.tree.leaves(args)
        saved = {
            i: (jax.device_get(leaf), leaf.sharding)
            for i, (leaf, d) in enumerate(zip(leaves, donated, strict=True))
            if d and isinstance(leaf, jax.Array)
        }
        self.host_bytes += sum(host.nbytes for host, _ in saved.values())
        return saved

    def _restore(self, args: tuple[Any, ...], backup: dict | None) -> tuple[Any, ...]:
        """``args`` with every array a failed run deleted put back from its host copy."""
        leaves, treedef = jax.tree.flatten(args)
        deleted = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.is_deleted()]
        if not deleted:
            return args
        if backup is None or any(i not in backup for i in deleted):
            raise StateLostError(_STATE_LOST)
        for i in deleted:
            host, sharding = backup[i]
            leaves[i] = jax.device_put(host, sharding)
        return jax.tree.unflatten(treedef, leaves)

    def _shrink(self, exc: BaseException, size: int) -> None:
        """Marks ``size`` as not fitting after ``exc`` and plans a smaller size.

        A real out-of-memory says the ledger was optimistic: the capacity the search
        aims under becomes the failed size's peak less ``headroom`` (half of it on a
        further failure in the same call), as the trainer's planner does.
        """
        real = not isinstance(exc, SimulatedOutOfMemory)
        peak = self.memory_model.points.get(size)
        self.sizes.record(size, False, peak, 0.0, "run" if real else "estimate", "call")
        log.warning(
            "step at micro-batch %d ran out of memory (%s)", size, "real" if real else "simulated"
        )
        self._oom_streak += 1
        if real and peak is not None:
            self._real_ooms += 1
            self.sizes.learn(peak, first=self._real_ooms == 1)
        try:
            if size <= self.multiple_of:
                raise NothingFitsError(size, [], detail=f"it ran out of memory: {exc}")
            self._use(self._largest(hi=size - 1, reason=f"out of memory at size {size}"))
        except NothingFitsError:
            # A real out-of-memory can pass (fragmentation, another job's peak): retry the
            # smallest size a few times in a row before giving up.
            if not real or self._oom_streak > self.oom_retries:
                raise
            self._use(self.multiple_of)
