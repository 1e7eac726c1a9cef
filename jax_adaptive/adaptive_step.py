"""AdaptiveStep: your own jitted training step, at the largest micro-batch that fits.

Guide: docs/own-loop.md. One binding of the sizing engine per shape of arguments.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal

import jax

from jax_adaptive import checks
from jax_adaptive.background import INTERIM, BackgroundSearch, Fit, first_size
from jax_adaptive.backup import Backup, backup_bytes, deleted_leaves, donated_backup, put_back
from jax_adaptive.data import leading_size
from jax_adaptive.errors import NothingFitsError, StateLostError, catch_oom
from jax_adaptive.forwarding import forwarded
from jax_adaptive.memory import Ledger, MemoryModel, tree_bytes
from jax_adaptive.plan import Plan, least_padding_size
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.remat import RematChoice, RematChoices, choices_of, plan_policies
from jax_adaptive.sharding import describe_sharding
from jax_adaptive.sizing import Binding, Sized, Sizing, log
from jax_adaptive.step_program import signature_of, sized_step
from jax_adaptive.timing import Timed, Timing, plan_timing

__all__ = ["AdaptiveStep", "StepBuilder", "StepBuilders", "signature_of"]

StepBuilder = Callable[[int], Callable[..., Any]]
"""``build_step(micro_batch_size) -> step``: your step for that (static) size, jitted
or not (a plain function is jitted as it is)."""

StepBuilders = StepBuilder | RematChoices[StepBuilder]
"""One `StepBuilder`, or a `jax_adaptive.RematChoices` of them, one per remat policy."""

_STATE_LOST = (
    "the step donates its arguments, a failed run of it deleted them, and no host copy "
    "was kept (a size that ran before is trusted): restore the state from your last "
    "checkpoint; AdaptiveStep(..., host_backup='every_call') keeps a copy before every "
    "call, at the price of a copy to the host per step."
)


class AdaptiveStep:
    """Your jitted step at the largest micro-batch size that fits, re-planned on OOM.

    Args:
        build_step: ``micro_batch_size -> step`` (`StepBuilder`); the step takes positional
            array pytrees (your state, your batch, ...). A larger size must need no less memory.
            Or a `jax_adaptive.RematChoices` of such builders, one per remat policy (the
            same step, its layers under each policy): the plan takes the policy with the
            fewest micro-steps, the least rematerialised on a tie (docs/memory.md).
        batch_argnum: which argument is the batch: its leading size ``T`` is the largest
            size tried, and the ledger counts it as in flight.
        memory_limit: bytes: a device of that size (simulated on a CPU).
        headroom: the share of a device's real capacity left unused (never of ``memory_limit``).
        objective: ``"least_padding"``: the fewest micro-batches the largest fitting size
            allows, with the least padding; ``"max"``: the largest size itself;
            ``"throughput"``: of a few plans at or below the largest
            (`jax_adaptive.timing.candidate_sizes`), the one whose call is fastest: the
            first calls of each new shape run the candidates (every plan trains the same)
            and are timed, then the fastest is kept, and in the plan cache: a second run
            times nothing (``plan_info.timed`` says what won).
        timing_budget: the most that timing may cost, in calls at the default plan's speed
            (``0.02 * calls``: 2% of a run); None: no bound.
        multiple_of: try only multiples of this.
        plan_cache: None for the default file, False for none, a path or a `PlanCache`.
        host_backup: ``"first_run"``: a host copy of the donated arguments before the
            first run of each size (and a retry); ``"every_call"``: before every call.
        oom_retries: real out-of-memory errors in a row retried at the smallest size.
        device: the device whose capacity counts (the first local device by default).
        background_search: the first call of a new shape runs as soon as one size is
            known to fit, while the search goes on on a thread; a later call takes the
            plan once the search has ended (`jax_adaptive.background`). Every plan
            trains the same. The search then first asks an eighth of the batch (a
            multiple of ``multiple_of``): it fits most limits, so the first call waits
            for one compile, and its 8 micro-steps keep those calls near the plan's
            speed; the calls run the largest size found so far, as compiled for the
            search (its micro-batches padded). One `StepBuilder` only; under several
            processes (which must run the same size in each call) the search runs
            before the first call, as without it. ``plan(*args)`` waits for the search.

    Attributes:
        host_bytes: bytes copied to the host to make failures recoverable.
        sizing: the `jax_adaptive.sizing.Sizing` engine that decides the sizes.

    Examples:
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
        build_step: StepBuilders,
        *,
        batch_argnum: int = 1,
        memory_limit: int | None = None,
        headroom: float = 0.05,
        objective: Literal["least_padding", "max", "throughput"] = "least_padding",
        timing_budget: float | None = None,
        multiple_of: int = 1,
        plan_cache: PlanCache | str | os.PathLike[str] | bool | None = None,
        host_backup: Literal["first_run", "every_call"] = "first_run",
        oom_retries: int = 3,
        device: jax.Device | None = None,
        background_search: bool = False,
    ):
        # Several builders, one per remat policy: a plan over (policy, size) picks one.
        builders = choices_of(build_step, "build_step")
        self.build_step = build_step
        self._builders: Mapping[str | None, StepBuilder] = builders
        self.batch_argnum = checks.non_negative_int("batch_argnum", batch_argnum)
        self.objective = checks.one_of(
            "objective", objective, ("least_padding", "max", "throughput")
        )
        self.multiple_of = checks.positive_int("multiple_of", multiple_of)
        self.timing_budget = timing_budget
        self.host_backup = checks.one_of("host_backup", host_backup, ("first_run", "every_call"))
        self.background_search = checks.background_search(
            background_search, builders, "StepBuilder"
        )
        self.sizing = Sizing(
            "step at micro-batch",
            memory_limit=memory_limit,
            headroom=headroom,
            device=checks.check_device(device),
            plan_cache=PlanCache.from_arg(plan_cache),
            oom_retries=oom_retries,
        )
        self.host_bytes = 0
        self._program: Binding | None = None  # the engine's binding for the shapes in use
        self._signature: Hashable = None
        self._batch_size = 0
        self._replan = False
        self._sharding: str | None = None  # the state's, in words (`describe_sharding`)
        self._timing: Timing | None = None  # objective="throughput": the calls being timed
        self._choices: dict[Hashable, RematChoice] = {}  # by signature, with RematChoices
        self._search: BackgroundSearch | None = None  # background_search: while it runs
        self._interim: Fit | None = None  # what the calls run while it runs

    # ------------------------------------------------------------ what is planned

    @property
    def micro_batch_size(self) -> int:
        """The size in use (for the arguments' shapes of the last call)."""
        if self._interim is not None:
            return self._interim.size
        if self._program is None or self._program.size is None:
            raise RuntimeError("call step(*args) or step.plan(*args) first.")
        return self._program.size

    @property
    def plan_info(self) -> Plan:
        """The `jax_adaptive.Plan` in use (``accumulation_steps``: micro-batches per step)."""
        return self._plan_of(self.micro_batch_size, interim=self._interim is not None)

    def _plan_of(self, size: int, interim: bool = False) -> Plan:
        program = self._program
        ledger = program.ledger(size) if program.peak(size) is not None else None
        source = None if program.largest is None else "searched"
        if self._timing is not None:
            source = f"searched; the next calls time {self._timing.sizes}"
        if interim:
            source = INTERIM
        steps = math.ceil(self._batch_size / size)
        timed, remat, search = program.timed_for(size), self.remat, program.search
        return Plan(size, steps, ledger, self.capacity(), 1, program.largest, source=source,
                    remat=remat and str(remat), sharding=self._sharding,
                    timed=timed and str(timed), search=search and str(search))  # fmt: skip

    @property
    def timed(self) -> Timed | None:
        """What ``objective="throughput"`` timed for the shapes in use (None: not timed)."""
        return None if self._program is None else self._program.timed

    @property
    def remat(self) -> RematChoice | None:
        """The remat policy run for the shapes in use, and why (None: one `StepBuilder`).

        Examples:
            >>> import jax, jax.numpy as jnp, numpy as np
            >>> import jax_adaptive as ja
            >>> from jax_adaptive.remat import maybe_checkpoint
            >>> def make_build_step(policy):  # the same step, its scanned layers under policy
            ...     layer = maybe_checkpoint(lambda x, w: (jnp.tanh(x @ w), None), policy)
            ...     loss = lambda p, b, r: jax.lax.scan(layer, b, p)[0].sum(axis=1)
            ...     grad = lambda m, p, b: ja.micro_batch_grad(loss, m)(p, b).grads
            ...     return lambda m: jax.jit(lambda p, b: p - 0.1 * grad(m, p, b))
            >>> choices = ja.RematChoices.from_factory(make_build_step)
            >>> step = ja.AdaptiveStep(choices, memory_limit=10**6, plan_cache=False)
            >>> params = step(jnp.zeros((4, 8, 8)), np.ones((16, 8), np.float32))
            >>> print(step.remat)  # room for the whole batch: no remat, the others not planned
            none (micro-batch by policy: none 16 x 1)
        """
        return self._choices.get(self._signature)

    @property
    def compiled(self) -> Any:
        """The compiled step (a ``jax.stages.Compiled``) of the size in use."""
        return self.compile(self.micro_batch_size)

    search_log = forwarded("sizing.search_log", "Every `SizeTrial`, every shape.")
    compiles = forwarded("sizing.compiles", "Step compiles, for every shape.")
    memory_limit = forwarded("sizing.memory_limit", "The simulated device's bytes.")
    fault_hook = forwarded("sizing.fault_hook", "Called before each compile and each run; see "
                           "`jax_adaptive.testing`.", settable=True)  # fmt: skip

    @property
    def memory_model(self) -> MemoryModel:
        """The `jax_adaptive.memory.MemoryModel` of the sizes measured for the shapes in use."""
        return self._bound().memory_model

    @property
    def largest(self) -> int | None:
        """The largest size found to fit for the shapes in use (None: not searched)."""
        return None if self._program is None else self._program.largest

    def capacity(self) -> int | None:
        """The bytes a size's ledger may reach (docs/memory.md); None: unknown."""
        return self.sizing.capacity()

    def set_memory_limit(self, memory_limit: int | None) -> None:
        """Changes the cap: a lower one applies at the next call, a higher one re-plans there."""
        self._replan = self.sizing.set_memory_limit(memory_limit) or self._replan

    # ------------------------------------------------------------ compiling, measuring

    def compile(self, size: int) -> Any:
        """The compiled step for ``size`` (compiled once; sizes not in use are released)."""
        return self._bound().executable(size).compiled

    def ledger(self, size: int) -> Ledger:
        """Everything live while the step of ``size`` runs, by part.

        ``state``: the arguments but the batch, whole; ``in_flight``: the batch and the
        outputs not aliased to a donated argument; ``program``: temporaries and code.
        """
        return self._bound().ledger(size)

    def check(self, size: int) -> None:
        """Raises `jax_adaptive.SimulatedOutOfMemory` when the ledger exceeds the capacity."""
        self._program.check(size)

    def _bound(self) -> Binding:
        if self._program is None:
            raise RuntimeError("call step(*args) or step.plan(*args) first.")
        return self._program

    # ------------------------------------------------------------ planning

    def plan(self, *args: Any) -> Plan:
        """Plans the size for arguments like ``args`` (their shapes; nothing runs).

        A call plans each new shape of arguments itself, and again after a raised cap.
        A search in the background (``background_search``) is waited for.
        """
        self._plan(args)
        self._end_search()
        return self.plan_info

    def _plan(self, args: tuple[Any, ...]) -> None:
        """Plans for ``args`` when their shapes are new or the cap was raised; else nothing.

        A search in the background gives the size that runs while it goes on (`_interim`).
        """
        signature = signature_of(args)
        if signature != self._signature:
            self._end_search()  # the last shape's, before another plans
            if not 0 <= self.batch_argnum < len(args):
                raise ValueError(
                    f"batch_argnum={self.batch_argnum} is not one of {len(args)} arguments."
                )
            self._batch_size = leading_size(args[self.batch_argnum])
            self._signature = signature
            i = self.batch_argnum
            self._sharding = describe_sharding(args[:i] + args[i + 1 :])
            try:
                self._plan_shape(args, signature)
            except BaseException:  # not planned: the next call with these shapes plans again
                self._signature = None
                raise
        if self._search is not None:  # runs the largest size found to fit so far
            self._interim = self._search.first_fit()
            if self._interim is None:  # it ended while waiting
                self._end_search()
        if self._replan and self._search is None:
            self._replan = False
            self._use(self._largest("memory limit raised"), "the memory limit was raised")

    def _plan_shape(self, args: tuple[Any, ...], signature: Hashable) -> None:
        """Runs the plan of ``args``' shapes: made once (each policy's binding), kept."""
        bindings = {
            name: self.sizing.bind(
                signature if name is None else (signature, name),
                functools.partial(self._sized, args, signature, name),
            )
            for name in self._builders
        }
        if None in bindings:  # one builder
            self._program = bindings[None]
            if self._program.size is not None:
                return
        elif signature in self._choices:
            self._program = bindings[self._choices[signature].policy]
            return
        own = tree_bytes([x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)])
        self.sizing.measure_others(own)
        if None not in bindings:
            self._choose(bindings)
        elif not self.background_search or jax.process_count() > 1:
            self._plan_size(self._program)
        elif not self._plan_cached(self._program):
            first = first_size(self._batch_size, self.multiple_of)
            self._search = BackgroundSearch(
                lambda found: self._use(self._largest("init", on_fit=found, first=first), None)
            )
            return  # the timing, if any, once the search has ended (`_end_search`)
        self._start_timing()

    def finish_search(self) -> None:
        """Waits for a search in the background (``background_search``) to end.

        Its plan runs from the next call; its error, if it raised one, is raised here.
        Nothing when no search runs.

        Examples:
            >>> import jax, jax.numpy as jnp, numpy as np
            >>> import jax_adaptive as ja
            >>> def build_step(m):
            ...     loss = lambda p, b, r: (b["x"] @ p - b["y"]) ** 2
            ...     grad = lambda p, b: ja.micro_batch_grad(loss, m)(p, b).grads
            ...     return jax.jit(lambda p, b: p - 0.1 * grad(p, b))
            >>> step = ja.AdaptiveStep(build_step, background_search=True, plan_cache=False)
            >>> batch = {"x": np.ones((64, 4), np.float32), "y": np.zeros(64, np.float32)}
            >>> params = step(jnp.zeros(4), batch)  # at the first size found to fit
            >>> step.finish_search()
            >>> params = step(params, batch)  # at the plan
            >>> step.micro_batch_size  # no limit: the whole batch
            64
        """
        self._end_search()

    def _end_search(self) -> None:
        """Waits for a search in the background to end, and runs its plan from now on.

        Its error (the user's code failing to trace at a size, nothing fitting) is raised
        here; the next call with these shapes plans again.
        """
        search, self._search, self._interim = self._search, None, None
        if search is None:
            return
        try:
            search.finish()
        except BaseException:
            self._signature = None
            raise
        self._start_timing()

    def _start_timing(self) -> None:
        """``objective="throughput"``: the next calls time the candidates (if searched)."""
        if self.objective == "throughput" and self._program.largest is not None:
            # searched, not from the plan cache: the next calls time the candidates
            program, T, budget = self._program, self._batch_size, self.timing_budget
            self._timing = plan_timing(
                T, program.largest, self.multiple_of, online=True, budget=budget
            )

    def _choose(self, bindings: dict[str, Binding]) -> None:
        """Plans every remat policy (`jax_adaptive.remat.plan_policies`) and runs the chosen."""
        choice = plan_policies(
            lambda name: self._plan_size(bindings[name], name), list(bindings), self._batch_size,
            cache=self.sizing.plan_cache, keys=lambda: [b.key() for b in bindings.values()],
            log=log.info,
        )  # fmt: skip
        self._choices[self._signature] = choice
        self._program = bindings[choice.policy]
        for binding in bindings.values():
            if binding is not self._program:
                binding.release()  # the programs of the policies not chosen

    def _plan_size(self, binding: Binding, policy: str | None = None) -> int:
        """Plans ``binding``'s size (the plan cache's, else searched) and runs it from now on."""
        if not self._plan_cached(binding, policy):
            why = None if policy is None else f"remat policy {policy}"
            self._use(self._largest("init"), why)
        return binding.size

    def _plan_cached(self, binding: Binding, policy: str | None = None) -> bool:
        """Runs ``binding`` at the plan cache's size from now on; False: none stored."""
        self._program = binding
        size = binding.cached(self._batch_size, "init")
        if size is not None:
            why = [] if policy is None else [f"remat policy {policy}"]
            self._use(size, ", ".join([*why, "from the plan cache"]))
        return size is not None

    def _sized(self, args: tuple[Any, ...], signature: Hashable, policy: str | None) -> Sized:
        """What the engine needs of ``policy``'s step for arguments like ``args``."""
        remat = {} if policy is None else {"remat": policy}
        key = {"kind": "adaptive_step", "multiple_of": self.multiple_of,
               "objective": self.objective, "batch_argnum": self.batch_argnum,
               "args": str(signature), **remat}  # fmt: skip
        return sized_step(
            self._builders[policy], args, batch_argnum=self.batch_argnum,
            device=self.sizing.device, key=key, multiple_of=self.multiple_of,
        )  # fmt: skip

    def _largest(
        self,
        reason: str,
        on_fit: Callable[[int, Any], None] | None = None,
        first: int | None = None,
    ) -> int:
        """The largest multiple of ``multiple_of`` up to the batch size that fits, trimmed.

        ``on_fit(size, compiled)`` hears of each size found to fit as the search goes;
        ``first`` is asked before the search (`Binding.largest_fitting`).
        """
        lo, hi = self.multiple_of, self._batch_size // self.multiple_of * self.multiple_of
        largest = self._program.largest_fitting(
            hi=hi, reason=reason, lo=lo, multiple_of=lo, least=lo, on_fit=on_fit, first=first
        )
        return self._trimmed(largest)

    def _trimmed(self, largest: int) -> int:
        if self.objective != "max":
            return least_padding_size(self._batch_size, largest, self.multiple_of)
        return largest

    def _use(self, size: int, why: str | None) -> None:
        """Runs ``size`` from now on; a changed plan is one line on the ``jax_adaptive`` logger."""
        before = self._program.size
        self._timing = None
        self._program.use(size)
        self._program.store(size, batch_size=self._batch_size)
        if size != before:
            log.info("plan%s: %s", f" ({why})" if why else "", self._plan_of(size))

    def _timed(self, size: int, seconds: float, spent: float) -> None:
        """A timing call of ``size`` ran; once the timing is done, the fastest is used."""
        timing = self._timing
        timing.record(size, seconds, spent)
        if timing.result is not None:
            self._program.timed = timing.result
            self._use(timing.result.chosen, "the fastest timed")

    # ------------------------------------------------------------ the guarded call

    def __call__(self, *args: Any) -> Any:
        """Runs the step on ``args``; an out-of-memory re-plans smaller and runs them again.

        A size that ran before is kept unless it fails twice in one call (the trainer's
        rule): its first real out-of-memory runs it once more, after a full collection and
        with a host copy of the donated arguments.

        Raises:
            NothingFitsError: not even the smallest size fits; its ``arguments`` are
                ``args`` intact (a donated state put back).
            StateLostError: a trusted size failed in a run that deleted donated
                arguments (see ``host_backup``).
        """
        self._plan(args)
        interim = self._interim  # a search in the background: the size it found to fit
        if interim is None:
            self._program.start()
        again = False  # a size that ran failed: its second run keeps a host copy
        while True:
            timing = self._timing  # the first calls run the sizes it times: all train alike
            size = self.micro_batch_size if timing is None else timing.size
            cautious = again or not self._program.has_run(size) or self.host_backup == "every_call"
            saved: Backup | None = {} if cautious or interim is not None else None
            start = time.perf_counter()
            run = functools.partial(self._run, size, args, saved, interim and interim.compiled)
            out, error = catch_oom(run)
            if error is None:
                out, seconds = out
                if interim is None:  # the binding is the search's while it runs
                    self._program.ran(size)
                if timing is not None:
                    self._timed(size, seconds, time.perf_counter() - start)
                return out
            if timing is not None:  # memory is tighter than planned: plan as without timing
                log.info("the timing stopped: %s ran out of memory", size)
                self._timing = None
            args = self._restore(args, saved)
            if interim is not None:  # the search ends first; then ``size`` shrinks as any
                log.info("%s ran out of memory while the search went on", size)
                self._end_search()
                self._timing, interim = None, None
                self._program.start()
            del out, saved  # what the failed attempt held goes before the retry
            # A size that ran is kept unless it fails again (the trainer's rule): one
            # failure can be a moment's (another job's peak, the last call's arrays).
            again = self._program.again(error, size, reason="call")
            if again:
                continue
            try:
                lo = self.multiple_of
                largest = self._program.shrink(error, size, reason="call", multiple_of=lo, least=lo)
                self._use(self._trimmed(largest), f"{size} ran out of memory")
            except NothingFitsError as exc:
                exc.arguments = args  # intact: the caller's own may have been donated
                raise

    def _run(
        self, size: int, args: tuple[Any, ...], saved: dict | None, compiled: Any = None
    ) -> tuple[Any, float]:
        """One run of the step of ``size``, copying its donated arguments into ``saved``.

        ``compiled``: its program (a search in the background compiled it); else the
        binding's. Returns what the step returned, and the seconds its run took (for a
        timing).
        """
        compiled = self.compile(size) if compiled is None else compiled
        self.check(size)
        if saved is not None:
            saved.update(donated_backup(args, compiled))
            self.host_bytes += backup_bytes(saved)
        if self.fault_hook is not None:
            self.fault_hook.before_execution(size, args)
        # Wait inside the guard: with asynchronous dispatch an out-of-memory may surface
        # only when the result is read.
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        return out, time.perf_counter() - start

    def _restore(self, args: tuple[Any, ...], saved: Backup | None) -> tuple[Any, ...]:
        """``args`` with every array a failed run deleted put back from its host copy."""
        deleted = deleted_leaves(args)
        if deleted and (saved is None or any(i not in saved for i in deleted)):
            raise StateLostError(_STATE_LOST)
        return put_back(args, saved or {})
