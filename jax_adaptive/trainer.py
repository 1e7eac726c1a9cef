"""AdaptiveTrainer: a facade over `jax_adaptive.sizing`, `.executables`, `.planner`, `.update`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, Literal

import jax
import optax

from jax_adaptive import checks
from jax_adaptive.data import Rebatcher, leading_size
from jax_adaptive.distributed import Agreement, Placement, place, process_sum, while_all
from jax_adaptive.evaluate import Evaluator, TrainerEvaluations
from jax_adaptive.executables import Executables
from jax_adaptive.forwarding import forwarded
from jax_adaptive.levers import Lever, Levers
from jax_adaptive.loop import Kept, fit_loop
from jax_adaptive.memory import Ledger
from jax_adaptive.normalizer import Normalizer, example_weights
from jax_adaptive.plan import Objective, Plan
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.planner import GrowPolicy, Planner
from jax_adaptive.read_ahead import interrupts_relayed
from jax_adaptive.remat import RematChoice, RematChoices, choices_of
from jax_adaptive.schedule import BatchSchedule, ScheduleCursor, ScheduleSpec
from jax_adaptive.sizing import Sizing
from jax_adaptive.step import Batch, Params, PerExampleLoss, TrainState, multi_steps
from jax_adaptive.update import Updater

__all__ = ["AdaptiveTrainer"]

log = logging.getLogger("jax_adaptive")


class AdaptiveTrainer:
    """Trains at a target batch size (fixed or scheduled) through the largest micro-batch that fits.

    Each option at length: docs/trainer.md.

    Args:
        loss_fn: ``(params, batch, rng) -> losses`` of shape ``[m]``, one per example; or
            a `jax_adaptive.remat.RematChoices` of such losses, one per remat policy: the
            plan takes the policy with the fewest micro-steps (docs/memory.md).
        optimizer: any ``optax.GradientTransformation``, applied once per target batch.
        target_batch_size: examples per update: an int, or a schedule (docs/schedules.md).
        micro_batch_size: ``"auto"`` (the largest that fits) or a fixed int.
        memory_limit: bytes of the device (on a CPU, a simulated one): docs/memory.md.
        has_aux: ``loss_fn`` returns ``(losses, aux)``, aux a dict of per-example metrics.
        has_state: ``loss_fn`` is ``(params, model_state, batch, rng) -> (out, model_state)``.
        headroom: the share of a device's real capacity left unused (not of the limit).
        grow: ``"never"``, ``"on_limit_change"`` or every ``N`` updates: when to grow.
        oom_retries: real out-of-memory errors in a row retried at the smallest size.
        multiple_of: search multiples of this (a smaller size only when none fits).
        plan_cache: None (the default file), False (none), a path or a `PlanCache`.
        objective: ``"least_padding"``, ``"max"`` or ``"throughput"``.
        timing_budget: under ``objective="throughput"``, the most the timing may cost, in
            updates at the default plan's speed (``0.02 * updates``: 2% of a run); None: no
            bound.
        chunk: ``"auto"`` or the most micro-steps per dispatch.
        device: the device to train on without a mesh (the first local one by default).
        mesh: a ``jax.sharding.Mesh`` to train data parallel over, split along
            ``data_axis``; ``param_sharding``: ``PartitionSpec`` s for the parameters over
            any mesh axes, the data axis included (FSDP); the optimizer state follows them
            (docs/devices.md).
        opt_state_sharding: specs for the optimizer state (its parameter-shaped leaves,
            a prefix of the parameters as ``param_sharding``) instead of following the
            parameters: ZeRO-1 splits it over ``data_axis`` and keeps the parameters
            replicated. A spec that cannot hold raises a one-line ValueError at `init`.
        in_flight: programs dispatched and not finished at once.
        memory_prior: a predicted ``(intercept, slope)`` of the peak bytes against the size.
        sizing: a `jax_adaptive.sizing.Sizing` shared with other trainers (its limit,
            headroom, cache and retries count).
        global_batches: under ``jax.distributed``, every process passes the whole
            target batch and keeps its rows, instead of its own share
            (`process_batch_size` rows, the default: docs/devices.md).
        normalizer: ``fn(batch) -> count``: the update divides the summed losses by the
            batch's count (its real tokens, over every process) instead of
            ``target_batch_size``: ``loss_fn`` then returns each example's sum (its tokens'
            losses summed), and a token weighs the same in every batch and plan.
        background_search: the first update waits only for one size known to fit (an
            eighth of the target, usually one compile): the search goes on on a thread
            while updates run that size, one micro-step a dispatch, and its plan runs
            from the update after it ends (`finish_search` waits for it; `fit` does
            at its end, so that the plan cache gets the plan). Every plan
            trains the same. One loss (not `jax_adaptive.RematChoices`); several
            processes search before the first update.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np, optax
        >>> import jax_adaptive as ja
        >>> def loss_fn(params, batch, rng):
        ...     return (batch["x"] @ params["w"] - batch["y"]) ** 2
        >>> trainer = ja.AdaptiveTrainer(loss_fn, optax.sgd(0.1), target_batch_size=10,
        ...                              micro_batch_size=4)
        >>> batch = {"x": np.ones((10, 3), np.float32), "y": np.ones(10, np.float32)}
        >>> state = trainer.init({"w": jnp.zeros(3)}, batch)
        >>> state, metrics = trainer.step(state, batch)
        >>> trainer.accumulation_steps, float(metrics["loss"]), int(state.updates)
        (3, 1.0, 1)
    """

    def __init__(
        self,
        loss_fn: PerExampleLoss | RematChoices[PerExampleLoss],
        optimizer: optax.GradientTransformation,
        *,
        target_batch_size: ScheduleSpec,
        micro_batch_size: int | Literal["auto"] = "auto",
        memory_limit: int | None = None,
        has_aux: bool = False,
        has_state: bool = False,
        headroom: float = 0.05,
        grow: GrowPolicy = "on_limit_change",
        oom_retries: int = 3,
        multiple_of: int = 1,
        plan_cache: PlanCache | str | os.PathLike[str] | bool | None = None,
        objective: Objective = "least_padding",
        timing_budget: float | None = None,
        chunk: int | Literal["auto"] = "auto",
        device: jax.Device | None = None,
        mesh: jax.sharding.Mesh | None = None,
        data_axis: str = "data",
        param_sharding: Any = None,
        in_flight: int = 1,
        memory_prior: tuple[float, float] | None = None,
        sizing: Sizing | None = None,
        global_batches: bool = False,
        normalizer: Normalizer | None = None,
        opt_state_sharding: Any = None,
        background_search: bool = False,
    ):
        # Several losses, one per remat policy: a plan over (policy, size) picks one.
        losses = choices_of(loss_fn, "loss_fn")
        background_search = checks.background_search(background_search, losses, "loss")
        self.optimizer = checks.check_optimizer(optimizer)
        self.normalizer = checks.check_normalizer(normalizer)
        self.schedule = BatchSchedule(target_batch_size)
        self.placement = Placement(
            checks.check_device(device), mesh, data_axis, param_sharding, global_batches,
            opt_state_sharding,
        )  # fmt: skip
        self._cursor = ScheduleCursor(self.schedule, self.shards)
        T = self._cursor.size_at(0)
        constant = self.schedule.constant is not None
        multiple_of = checks.positive_int("multiple_of", multiple_of)
        for loss in losses.values():
            multiple_of = checks.ghost_multiple(loss, multiple_of, self.schedule.known_sizes)
        fixed = checks.fixed_size(
            micro_batch_size, multiple_of if constant else 1,
            T if constant else checks.MAX_TARGET_BATCH_SIZE, self.shards,
        )  # fmt: skip
        self._sizing = sizing or Sizing(
            "micro-step of", memory_limit=memory_limit, headroom=headroom,
            device=self.placement.device, plan_cache=PlanCache.from_arg(plan_cache),
            oom_retries=oom_retries, agree=Agreement(),
        )  # fmt: skip
        checks.positive_int("in_flight", in_flight)

        def build(loss: PerExampleLoss, remat: str | None) -> Lever:
            """One loss's programs, plan and update (its remat policy in the cache's key)."""
            policy = {} if remat is None else {"remat": remat}
            executables = Executables(
                checks.refuse_aux_named_loss(loss, has_aux, has_state), optimizer, self._sizing,
                has_aux=has_aux, has_state=has_state,
                everywhere=self.placement.everywhere, data=self.placement.data,
                in_flight=in_flight, key=lambda: {**planner.key_parts(), **policy},
                memory_prior=memory_prior, fingerprint_at=lambda: planner.fingerprint_size(),
                variant=remat,
            )  # fmt: skip
            planner = Planner(
                executables, target_batch_size=T, fixed=fixed, grow=grow,
                multiple_of=multiple_of, shards=self.shards, objective=objective, chunk=chunk,
                timing_budget=timing_budget, background_search=background_search,
            )  # fmt: skip
            return Lever(executables, planner, Updater(planner, self.placement, in_flight))

        # Each policy's programs and plan; the chosen one's run (`plan`).
        self._levers = Levers({name: build(loss, name) for name, loss in losses.items()})
        self._executables, self._planner, self._updater = self._levers.in_use
        self._evaluations = TrainerEvaluations(
            has_state=has_state, device=self.device, mesh=self.mesh,
            limit=lambda: self.memory_limit, headroom=self.headroom,
            plan_cache=self.plan_cache, processes=self.placement.processes,
        )  # fmt: skip

    # ----------------------------------------------------------------- what it holds

    compiles = forwarded("_sizing.compiles", "Micro-step compiles so far (one per size measured).")
    search_log = forwarded("_sizing.search_log", "Every size decided (`jax_adaptive.SizeTrial`).")
    throughput_log = forwarded("_planner.throughput_log", "What objective='throughput' timed.")
    memory_model = forwarded("_planner.memory_model", "The sizes measured and their peaks.")
    trace_counts = forwarded("_executables.trace_counts", "Traces of the micro-step per size.")
    host_bytes = forwarded("_updater.host_bytes", "Bytes copied to the host for recovery.")
    memory_limit = forwarded("_sizing.memory_limit", "The simulated device's bytes.")
    sizing = forwarded("_sizing", "The sizing engine (`jax_adaptive.sizing.Sizing`).")
    headroom = forwarded("_sizing.headroom", "The share of a device's capacity left unused.")
    plan_cache = forwarded("_sizing.plan_cache", "Where plans are remembered, or None.")
    mesh = forwarded("placement.mesh", "The data-parallel mesh, or None.")
    shards = forwarded("placement.shards", "The data shards (1 without a mesh).")
    device = forwarded("placement.device", "The device this process trains on.")

    @property
    def target_batch_size(self) -> int:
        """Examples the next update takes (the schedule's, at the last state seen)."""
        return self._cursor.target

    @property
    def process_batch_size(self) -> int:
        """Examples this process passes per update: its share of `target_batch_size`.

        ``target_batch_size / processes`` under ``jax.distributed`` (docs/devices.md),
        all of it on one process or with ``global_batches``.
        """
        return self.placement.share(self.target_batch_size)

    def target_batch_size_for(self, state: TrainState) -> int:
        """The examples the update of ``state`` takes: the schedule at ``state.updates``."""
        return self._cursor.size_at(self._cursor.updates_of(state.updates))

    @property
    def micro_batch_size(self) -> int:
        """The micro-batch size in use (for the next update's target batch size)."""
        self._require_init()
        self._sync_target()
        return self._planner.size

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per optimizer update: ``ceil(target_batch_size / micro_batch_size)``."""
        return -(-self.target_batch_size // self.micro_batch_size)

    @property
    def plan_info(self) -> Plan:
        """The `jax_adaptive.Plan` of the next update (``print`` it for the plan in words)."""
        self._sync_target()
        plan = self._planner.plan._replace(sharding=self.placement.describe())
        choice = self._levers.choice
        return plan if choice is None else plan._replace(remat=str(choice))

    @property
    def remat(self) -> RematChoice | None:
        """The remat policy chosen and why (None: one loss, no choice)."""
        return self._levers.choice

    @property
    def compiled_sizes(self) -> list[int]:
        """The sizes whose compiled micro-step is held now (the size in use, after a plan)."""
        return self._executables.compiled_sizes()

    fault_hook = forwarded("_sizing.fault_hook", "Called before each compile and micro-step; "
                           "see `jax_adaptive.testing`.", settable=True)  # fmt: skip

    # ----------------------------------------------------------------- public API

    def init(
        self,
        params: Params,
        example_batch: Batch,
        *,
        rng: jax.Array | None = None,
        model_state: Any = (),
    ) -> TrainState:
        """Builds the train state on the device and plans the micro-batch size.

        ``example_batch`` (any leading size) gives one example's shapes; ``rng`` is the
        base key (``key(0)``); ``model_state`` ``has_state``'s. Raises `NothingFitsError`.
        """
        leading_size(example_batch, "example_batch")
        rng = jax.random.key(0) if rng is None else rng
        steps = multi_steps(self.optimizer, 1)
        state = TrainState(params, steps.init(params), model_state, rng)
        state = place(state, self.placement.state(state, steps))
        self.plan(state, example_batch)
        return state

    def plan(self, state: TrainState, example_batch: Batch) -> None:
        """Plans the micro-batch size for an existing train state (placed as `init` places one).

        For another example shape, or a state shared between trainers; for shapes
        already planned (a restored state) the plan holds: nothing is compiled. Raises
        `NothingFitsError` as `init` does.

        Examples:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> loss = lambda p, b, r: jnp.sum((b * p) ** 2, axis=1)
            >>> short, long = (ja.AdaptiveTrainer(loss, optax.sgd(0.1), target_batch_size=8)
            ...                for _ in range(2))
            >>> state = short.init(jnp.ones(()), np.ones((8, 4), np.float32))
            >>> long.plan(state, np.ones((8, 16), np.float32))
            >>> state, _ = long.step(state, np.ones((8, 16), np.float32))
            >>> int(state.updates)
            1
        """
        leading_size(example_batch, "example_batch")
        self._planner.finish_search()  # the last shapes' search, before others bind
        T = self._cursor.size_at(self._cursor.seen(state.updates))
        lever = self._levers.plan(state, example_batch, T, self.plan_cache)
        self._executables, self._planner, self._updater = lever

    def finish_search(self) -> None:
        """Waits for a search in the background (``background_search``) to end.

        Its plan runs from the next update; its error, if it raised one, is raised here
        (the trainer is then not planned: `init` or `plan` again). Nothing when no
        search runs.

        Examples:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p - 1) ** 2, optax.sgd(0.1),
            ...     target_batch_size=64, memory_limit=2**20, background_search=True,
            ...     plan_cache=False)
            >>> state = trainer.init(jnp.ones(()), np.ones(64, np.float32))
            >>> state, _ = trainer.step(state, np.ones(64, np.float32))  # the largest found yet
            >>> trainer.finish_search()
            >>> trainer.micro_batch_size  # the plan: the whole batch fits a MiB
            64
        """
        self._planner.finish_search()

    def compile(self, size: int, chunk: int = 1, *, with_optimizer_step: bool = False) -> Any:
        """The compiled program of ``chunk`` micro-steps of ``size`` (compiled once).

        With ``with_optimizer_step``, the update's last program: then the optimizer step.
        """
        self._checked_program(size, chunk)
        if with_optimizer_step:
            return self._executables.final(size, chunk, self.target_batch_size).compiled
        return self._executables.micro(size, chunk).compiled

    def ledger(self, size: int, chunk: int = 1, *, with_optimizer_step: bool = False) -> Ledger:
        """Everything live on the device while `compile`'s program runs, by part: docs/memory.md."""
        self._checked_program(size, chunk)
        if with_optimizer_step:
            return self._executables.final_ledger(size, chunk, self.target_batch_size)
        return self._executables.ledger(size, chunk)

    def capacity(self) -> int | None:
        """The bytes a size's ledger may reach; None when unknown (a CPU without a limit)."""
        return self._planner.capacity()

    def set_memory_limit(self, memory_limit: int | None) -> None:
        """Changes the device's bytes from the next step on: lower shrinks, higher may grow.

        Examples:
            >>> import optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: b, optax.sgd(0.1), target_batch_size=8)
            >>> trainer.set_memory_limit(2**30)
            >>> trainer.memory_limit, trainer.capacity()
            (1073741824, 1073741824)
        """
        self._sizing.set_memory_limit(memory_limit)

    def step(
        self, state: TrainState, batch: Batch, *, weights: Any = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """Runs one exact optimizer update on ``target_batch_size`` examples (at ``state.updates``).

        The state's accumulator is donated: use the returned state.

        Args:
            state: the current `TrainState`.
            batch: a pytree of arrays (NumPy or jax) with that leading size; under
                ``jax.distributed``, this process's rows: `process_batch_size` of them.
            weights: per-example weights (None: all 1): the update follows
                ``sum(weights * losses) / target_batch_size`` (``/ normalizer(batch)``
                with a ``normalizer``).

        Returns:
            ``(state, metrics)``: ``loss`` (the weighted mean, a device scalar), each aux
            metric's, ``micro_batch_size``, ``accumulation_steps`` and ``examples``.

        Examples:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: b * p, optax.sgd(1.0),
            ...                              target_batch_size=4, micro_batch_size=3)
            >>> state = trainer.init(jnp.zeros(()), np.ones(4, np.float32))
            >>> state, m = trainer.step(state, np.ones(4, np.float32),
            ...                         weights=np.array([1, 1, 0, 0], np.float32))
            >>> float(state.params)  # the gradient is (1 + 1) / 4
            -0.5
        """
        self._require_init()
        updates = self._cursor.updates_of(state.updates)
        T = self._cursor.size_at(updates)
        if self.normalizer is not None:
            add_up = process_sum if self.placement.processes > 1 else None
            weights = example_weights(self.normalizer, batch, weights, T, add_up)
        batch = checks.on_device(batch, self.device if self.mesh is None else None)
        scheduled = None if self.schedule.constant is not None else updates
        share = self.placement.check_share(leading_size(batch), T)
        checks.check_batch(batch, weights, self._executables.example, share, scheduled)
        self._planner.set_target(T)
        out = self._updater.run(state, batch, weights)
        self._cursor.stepped(out[0].updates, updates + 1)
        return out

    def evaluator(self, metric_fn: Callable[..., Any]) -> Evaluator:
        """The `Evaluator` kept for ``metric_fn``, sharing the trainer's device, limit and cache."""
        return self._evaluations.evaluator(metric_fn)

    def evaluate(
        self, state: TrainState, data: Any, metric_fn: Callable[..., Any], *, predict: bool = False
    ) -> Any:
        """Evaluates ``metric_fn`` over ``data`` at the largest batch that fits beside the state.

        An out-of-memory shrinks the evaluation batch only (docs/evaluation.md).

        Args:
            state: the `TrainState` (left as it is).
            data: one batch of all the examples, or a stream of batches (read once);
                under ``jax.distributed`` this process's examples (the means are over
                every process's; with ``predict``, its own outputs).
            metric_fn: ``(params, batch) -> {name: per-example values}``; with
                ``has_state`` ``(params, model_state, batch)``.
            predict: return every example's outputs (any pytree) instead of the means.

        Returns:
            ``{name: mean, ..., "examples": n}``, or with ``predict`` the outputs.

        Examples:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p - 1) ** 2, optax.sgd(0.1),
            ...                              target_batch_size=4, plan_cache=False)
            >>> state = trainer.init(jnp.ones(()), np.ones(4, np.float32))
            >>> trainer.evaluate(state, np.arange(3, dtype=np.float32),
            ...                  lambda p, b: {"error": (b * p - 1) ** 2})
            {'error': 0.6666666666666666, 'examples': 3}
        """
        self._require_init()
        return self._evaluations.evaluate(state, data, metric_fn, predict)

    # From the first line: a Ctrl-C Python drops in a gc callback while fit sets up is kept
    # and raised by fit_loop (a test's interrupt landed there and fit trained on).
    @interrupts_relayed()
    def fit(
        self,
        state: TrainState,
        batches: Iterable[Batch],
        num_updates: int | None = None,
        *,
        progress: bool = False,
        on_update: Callable[[int, dict[str, Any]], None] | None = None,
        eval_every: int | None = None,
        eval_data: Any = None,
        metric_fn: Callable[..., Any] | None = None,
        read_ahead: int = 2,
    ) -> tuple[TrainState, list[dict[str, Any]]]:
        """Trains on a stream of batches of any leading size, ``target_batch_size`` per update.

        Examples read and not trained on stay with the iterator (docs/recovery.md).

        Args:
            state: the current `TrainState`.
            batches: host batches, each of any leading size (under ``jax.distributed``,
                this process's examples: it reads `process_batch_size` per update).
            num_updates: how many updates; None until the stream ends.
            progress: show a progress bar.
            on_update: ``on_update(update, metrics)`` after each update.
            eval_every: `evaluate` every this many updates and after the last (``eval_*``).
            eval_data: one batch, a list of batches, or a callable giving a fresh one.
            metric_fn: the per-example metrics, as `evaluate` takes them.
            read_ahead: batches a background thread reads while updates run (0: none);
                the thread ends with ``fit`` (a read in progress is waited for).

        Returns:
            The state and one metrics dict (host values) per update.

        Raises:
            FitError: any error part-way, as its ``__cause__``, with the last good
                ``state``, the ``history`` and the ``batch`` in flight.
            KeyboardInterrupt: from wherever it landed (Ctrl-C, or a handler of any
                signal), with ``.state`` and ``.history``; the examples not trained on
                stay with the iterator.

        Examples:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p - 1) ** 2,
            ...                              optax.sgd(0.1), target_batch_size=8)
            >>> stream = (np.ones(5, np.float32) for _ in range(4))  # 20 examples
            >>> state = trainer.init(jnp.zeros(()), np.ones(1, np.float32))
            >>> state, history = trainer.fit(state, stream)
            >>> len(history), [h["examples"] for h in history]
            (2, [8, 8])
        """
        if num_updates is not None:
            checks.positive_int("num_updates", num_updates)
        after = self._evaluations.after_update(eval_every, eval_data, metric_fn, num_updates)
        T = self.placement.share(self.target_batch_size_for(state))
        stream = Rebatcher(batches, T, read_ahead=read_ahead, lend=True)

        def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
            state, metrics = self.step(state, batch)
            stream.size = self.process_batch_size  # the next update's (a schedule's)
            return state, metrics

        kept = Kept(state)  # what was done, whole, wherever an interrupt lands
        try:
            with stream:  # what was read and not trained on goes back to the stream
                fit_loop(
                    step, state, stream if self.placement.processes == 1 else while_all(stream),
                    num_updates, progress=progress, on_update=on_update,
                    after_update=after, taken=stream.taken, kept=kept,
                )  # fmt: skip
        except KeyboardInterrupt as exc:  # wherever it landed, it carries what was done
            exc.state, exc.history = kept.state, kept.history  # type: ignore[attr-defined]
            raise
        state, history = kept.state, kept.history
        if stream.leftover and (num_updates is None or len(history) < num_updates):
            log.info("the stream ended with %d examples short of a target batch", stream.leftover)
        if self._planner.finish_search():  # a fit shorter than the search: its plan, cached
            log.info(
                "the search beside training ended after the last update: %s; the next "
                "update runs its plan %d x %d", self.plan_info.search, self.micro_batch_size,
                self.accumulation_steps,
            )  # fmt: skip
        return state, history

    # ----------------------------------------------------------------- internals

    def _sync_target(self) -> None:
        """Plans for the next update's target batch size, which a schedule moves."""
        if self._planner.size is not None:
            self._planner.set_target(self.target_batch_size)

    def _checked_program(self, size: int, chunk: int) -> None:
        """Plans for the next update's target and checks a program's size and chunk."""
        self._require_init()
        self._planner.finish_search()  # its thread compiles the same programs
        self._sync_target()
        checks.check_program(size, chunk, self.target_batch_size)

    def _require_init(self) -> None:
        if self._planner.size is None:
            raise RuntimeError("call trainer.init(params, example_batch) first.")
