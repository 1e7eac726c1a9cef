"""AdaptiveTrainer: a thin facade over the executables, the planner and the update.

* `jax_adaptive.executables` compiles and measures the micro-step per size and the
  optimizer step (XLA's memory analysis, completed into a ledger of everything live);
* `jax_adaptive.planner` decides the micro-batch size (the plan cache, the search, the
  capacity, shrinking after an out-of-memory, growing back);
* `jax_adaptive.update` runs one exact update (bounded dispatch, host saves, recovery).

The trainer validates its arguments, places the state, wires the three together and
keeps the host loop (`fit`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, Literal

import jax
import optax

from jax_adaptive import checks
from jax_adaptive.data import Rebatcher, leading_size
from jax_adaptive.distributed import Placement, place
from jax_adaptive.evaluate import Evaluator, MetricFn
from jax_adaptive.executables import Executables, FaultHook
from jax_adaptive.loop import fit_loop
from jax_adaptive.memory import Ledger, MemoryModel
from jax_adaptive.plan import Objective, Plan, SizeTrial
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.planner import GrowPolicy, Planner
from jax_adaptive.schedule import BatchSchedule, ScheduleSpec
from jax_adaptive.step import Batch, Params, PerExampleLoss, TrainState, multi_steps
from jax_adaptive.update import Updater

__all__ = ["AdaptiveTrainer"]

log = logging.getLogger("jax_adaptive")


class AdaptiveTrainer:
    """Trains at a target batch size (fixed or scheduled) through the largest micro-batch that fits.

    Args:
        loss_fn: ``(params, batch, rng) -> losses`` of shape ``[m]``, one per example
            (with ``has_aux``: ``(losses, aux)``, aux a dict of per-example metrics; with
            ``has_state``: ``(params, model_state, batch, rng) -> (that, new_model_state)``).
        optimizer: any ``optax.GradientTransformation``; it is applied once per target
            batch to the exact mean gradient of its examples.
        target_batch_size: examples per optimizer update: any positive int, or a
            batch-size schedule over the updates applied so far (``state.updates``): a
            callable ``updates -> int``, a list of ``(update, size)`` steps such as
            ``[(0, 64), (100, 256)]`` or a `jax_adaptive.schedule.BatchSchedule`. Each update is
            exact for its own size; the micro-batch stays the largest that fits, only
            capped by the size, and one compile per micro-batch size serves every size.
            A restored state goes on with the schedule where it left it.
        micro_batch_size: ``"auto"`` (search the largest that fits) or a fixed int.
            A fixed size is used as given (capped by a scheduled size below it): an
            out-of-memory with it propagates.
        memory_limit: bytes: a device of that size, which must hold everything live
            while a micro-step runs (`ledger`: the whole train state, the micro-batches
            in flight, the program). On a CPU it simulates that device: a size whose
            peak exceeds it fails exactly as a real out-of-memory would, through the
            same code path.
        has_aux: ``loss_fn`` also returns a dict of per-example metrics, reported as
            means over the target batch.
        has_state: ``loss_fn`` takes and returns mutable model state (Flax
            ``batch_stats``); it is threaded through the micro-steps in order.
        headroom: the share of a device's real capacity (``memory_stats()``) left unused;
            never applied to ``memory_limit``.
        grow: when to try a larger micro-batch again, at an update boundary:
            ``"never"``, ``"on_limit_change"`` (after `set_memory_limit` raises the
            limit) or an int ``N`` (every ``N`` updates, with real trial runs).
        oom_retries: how many real out-of-memory errors in a row, with no micro-step
            running in between, are retried at micro-batch 1 before the trainer gives
            up (a transient peak of another job should not end a run).
        multiple_of: search only multiples of this (8 suits GPUs' tensor cores); a
            smaller size only when no multiple fits.
        plan_cache: where ``"auto"`` remembers the size it found, so that a second run
            of the same job compiles no search candidates: None for the default file
            (`jax_adaptive.PlanCache`; ``JAX_ADAPTIVE_PLAN_CACHE=off`` turns it off),
            False for none, a path, or a `jax_adaptive.PlanCache`.
        objective: ``"least_padding"`` (the default): the fewest micro-steps the
            largest size that fits allows, with the least padding (``ceil(T / k)``
            rounded up to ``multiple_of``; `jax_adaptive.plan.least_padding_size`);
            ``"max"``: the largest size that fits itself; ``"throughput"``: the fastest
            update among the largest size and the sizes with the fewest micro-steps and
            the least padding (``ceil(T / k)`` for the few smallest ``k``), each timed
            for a few micro-steps at ``init`` (`throughput_log`).
        chunk: micro-steps per dispatch, scanned in one program so that the host's
            work per micro-step does not starve the device: ``"auto"`` (the default)
            takes as many as the capacity leaves room for (a chunk's ledger adds its
            examples; a whole update at most), a positive int caps it (1: a dispatch
            per micro-step). An out-of-memory costs at most one chunk's micro-steps and
            falls back to one per dispatch. The update's last program runs the
            optimizer step too when its ledger fits (`Plan.fused`; with one process).
            Under a mesh each device scans its own rows (no collective in a chunk) and
            every process runs the same chunk; a loss with model state keeps one
            micro-step per dispatch there.
        device: the device to train on (the first local device by default), without
            ``mesh``.
        mesh: a ``jax.sharding.Mesh`` (`jax_adaptive.data_mesh` makes one over all
            devices) to train data parallel on: each micro-batch is split over its
            ``data_axis``; the searched size is per device and the global micro-batch a
            multiple of the number of data shards. Under ``jax.distributed`` every
            process passes the same global batches and the processes agree on every
            plan (the smallest size any found) and shrink together on any one's
            out-of-memory.
        data_axis: the mesh axis the micro-batch is split over.
        param_sharding: with ``mesh``, a pytree of ``PartitionSpec`` matching (a prefix
            of) the parameters, for parameters sharded over other mesh axes; the
            optimizer state follows its parameters (``optax.tree_map_params``). None
            replicates the parameters.
        in_flight: the most programs (micro-steps or chunks) dispatched and not finished
            at once. Each holds its examples, new outputs and temporaries, and the
            ledger counts them: 1 (the default) costs a dispatch's gap between programs,
            nothing next to a long one; 2 hides it at the memory of a second program.
        memory_prior: a predicted ``(intercept, slope)`` of the peak in bytes against
            the micro-batch size (`jax_adaptive.buckets.predict_line`) to guide the first
            compiles of the search.

    Attributes:
        fault_hook: an object with ``before_compile(size)`` and
            ``before_execution(size, args)``, called before each compile and each
            micro-step (`jax_adaptive.testing.inject_oom` installs one), or None.

    Example:
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
        >>> grown = ja.AdaptiveTrainer(loss_fn, optax.sgd(0.1), micro_batch_size=4,
        ...                            target_batch_size=[(0, 10), (1, 20)])
        >>> state = grown.init({"w": jnp.zeros(3)}, batch)
        >>> state, _ = grown.step(state, batch)  # update 0: 10 examples
        >>> grown.target_batch_size, grown.accumulation_steps  # update 1: 20
        (20, 5)
    """

    def __init__(
        self,
        loss_fn: PerExampleLoss,
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
        chunk: int | Literal["auto"] = "auto",
        device: jax.Device | None = None,
        mesh: jax.sharding.Mesh | None = None,
        data_axis: str = "data",
        param_sharding: Any = None,
        in_flight: int = 1,
        memory_prior: tuple[float, float] | None = None,
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                "optimizer must be an optax.GradientTransformation (with init and update), "
                f"got {type(optimizer).__name__}."
            )
        self.schedule = BatchSchedule(target_batch_size)
        self._next_update = 0  # the update the next step makes (state.updates)
        self._returned: tuple[Any, int] = (None, 0)  # (state.updates, its value) step returned
        self.optimizer = optimizer
        self.placement = Placement(checks.check_device(device), mesh, data_axis, param_sharding)
        T = self._checked_target(0)
        multiple_of = checks.positive_int("multiple_of", multiple_of)
        constant = self.schedule.constant is not None
        fixed = checks.fixed_size(
            micro_batch_size, multiple_of if constant else 1,
            T if constant else checks.MAX_TARGET_BATCH_SIZE, self.shards,
        )  # fmt: skip
        self._executables = Executables(
            checks.refuse_aux_named_loss(loss_fn, has_aux, has_state), optimizer, T,
            has_aux=has_aux, has_state=has_state,
            everywhere=self.placement.everywhere, data=self.placement.data,
            in_flight=checks.positive_int("in_flight", in_flight),
        )  # fmt: skip
        self._planner = Planner(
            self._executables, target_batch_size=T, fixed=fixed,
            memory_limit=checks.check_limit(memory_limit),
            headroom=checks.check_fraction("headroom", headroom), grow=checks.check_grow(grow),
            oom_retries=checks.non_negative_int("oom_retries", oom_retries),
            multiple_of=multiple_of,
            shards=self.shards, plan_cache=PlanCache.from_arg(plan_cache), objective=objective,
            chunk=chunk, device=self.placement.device, memory_prior=memory_prior,
        )  # fmt: skip
        self._updater = Updater(self._planner, self.placement, in_flight)
        self._has_state = has_state
        self._evaluators: dict[Callable[..., Any], Evaluator] = {}

    # ----------------------------------------------------------------- what it holds

    @property
    def target_batch_size(self) -> int:
        """Examples the next update takes: the schedule's size at the last state seen.

        The state last given to `init`, `plan` or `step` (after a step: the state it
        returned); `target_batch_size_for` gives any state's.
        """
        return self.schedule(self._next_update)

    def target_batch_size_for(self, state: TrainState) -> int:
        """The examples the update of ``state`` takes: the schedule at ``state.updates``.

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: b * p, optax.sgd(0.1),
            ...                              target_batch_size=lambda u: 4 * (u + 1))
            >>> state = trainer.init(jnp.zeros(()), np.ones(4, np.float32))
            >>> trainer.target_batch_size_for(state)
            4
        """
        return self._checked_target(self._updates_of(state))

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
        """The `jax_adaptive.Plan` in use: size, micro-steps, ledger, capacity.

        With a batch-size schedule, the plan of the next update's target batch size.
        """
        self._sync_target()
        return self._planner.plan

    @property
    def compiles(self) -> int:
        """How many times the micro-step has been compiled (once per size measured)."""
        return self._executables.compiles

    @property
    def search_log(self) -> list[SizeTrial]:
        """Every size decided: see `SizeTrial`."""
        return self._planner.search_log

    @property
    def throughput_log(self) -> list[dict[str, float]]:
        """The candidates ``objective="throughput"`` timed, with their update times."""
        return self._planner.throughput_log

    @property
    def memory_model(self) -> MemoryModel:
        """The `jax_adaptive.memory.MemoryModel`: every size measured, and its peak."""
        return self._planner.memory_model

    @property
    def trace_counts(self) -> dict[int, int]:
        """Traces of the micro-step per size (one each; a retrace would show here)."""
        return self._executables.trace_counts

    @property
    def compiled_sizes(self) -> list[int]:
        """The sizes whose compiled micro-step is held now (the size in use, after a plan)."""
        return self._executables.compiled_sizes()

    @property
    def host_bytes(self) -> int:
        """Bytes copied to the host so far by recovery saves and snapshots."""
        return self._updater.host_bytes

    @property
    def memory_limit(self) -> int | None:
        """The simulated device's bytes (`set_memory_limit` changes it)."""
        return self._planner.memory_limit

    @property
    def headroom(self) -> float:
        """The share of a device's real capacity left unused."""
        return self._planner.headroom

    @property
    def plan_cache(self) -> PlanCache | None:
        """Where plans are remembered, or None."""
        return self._planner.plan_cache

    @property
    def mesh(self) -> jax.sharding.Mesh | None:
        """The data-parallel mesh, or None."""
        return self.placement.mesh

    @property
    def shards(self) -> int:
        """The number of data shards (1 without a mesh)."""
        return self.placement.shards

    @property
    def device(self) -> jax.Device:
        """The device this process trains on (its first of the mesh)."""
        return self.placement.device

    @property
    def fault_hook(self) -> FaultHook | None:
        """Called before each compile and micro-step; see `jax_adaptive.testing`."""
        return self._executables.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: FaultHook | None) -> None:
        self._executables.fault_hook = hook

    # ----------------------------------------------------------------- public API

    def init(
        self,
        params: Params,
        example_batch: Batch,
        *,
        rng: jax.Array | None = None,
        model_state: Any = (),
    ) -> TrainState:
        """Builds the train state and plans the micro-batch size.

        Args:
            params: the initial parameters.
            example_batch: a batch (any leading size) whose leaves give the shape and
                dtype of one example.
            rng: the base key (``jax.random.key(0)`` by default).
            model_state: mutable model collections, for ``has_state=True``.

        Returns:
            The `TrainState`, on the device.

        Raises:
            NothingFitsError: when even a micro-batch of 1 does not fit.
        """
        leading_size(example_batch, "example_batch")
        rng = jax.random.key(0) if rng is None else rng
        steps = multi_steps(self.optimizer, 1)
        state = TrainState(params, steps.init(params), model_state, rng)
        state = place(state, self.placement.state(state, steps))
        self.plan(state, example_batch)
        return state

    def plan(self, state: TrainState, example_batch: Batch) -> None:
        """Plans the micro-batch size for a train state that already exists.

        `init` builds the state and calls this; call it directly to share one state
        between trainers of the same loss and optimizer that see other input shapes
        (`jax_adaptive.BucketedTrainer` does), with no second copy of the state, or to
        plan again for another example shape (the old shape's programs are dropped).
        For the shapes already planned (a state restored from a checkpoint) the plan
        holds, followed to the state's target batch size as `step` would: nothing is
        searched or compiled again.

        Args:
            state: a `TrainState` placed as this trainer places one (its device, or
                its mesh's shardings).
            example_batch: a batch (any leading size) whose leaves give the shape and
                dtype of one example.

        Raises:
            NothingFitsError: when even the smallest micro-batch does not fit.

        Example:
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
        self._next_update = self._updates_of(state)
        T = self._checked_target(self._next_update)
        if self._executables.bind(state, example_batch) or self._planner.size is None:
            self._planner.plan_for(state, T)
        else:  # the shapes it is planned for: the plan holds, for the state's target
            self._planner.set_target(T)

    def compile(self, size: int, chunk: int = 1, *, with_optimizer_step: bool = False) -> Any:
        """Returns the compiled micro-step for micro-batches of ``size``, compiling once.

        Args:
            size: the micro-batch size, in ``[1, target_batch_size]``.
            chunk: micro-steps in the program (`jax_adaptive.step.make_micro_step`'s arguments
                with ``chunk * size`` examples; `ledger` gives its peak).
            with_optimizer_step: the update's last program instead: those micro-steps,
                then the optimizer step; it returns ``(params, opt_state, model_state,
                means)``. When they are the whole update (``chunk * size`` covers the
                target), it starts from zeros, never reads the accumulator and returns
                ``opt_state.acc_grads=None``: keep the state's (zeros between updates).

        Returns:
            The ``jax.stages.Compiled`` program.

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p) ** 2, optax.sgd(0.1),
            ...                              target_batch_size=8, micro_batch_size=8)
            >>> _ = trainer.init(jnp.ones(()), np.ones(8, np.float32))
            >>> ja.estimate_peak_bytes(trainer.compile(3)) > 0
            True
        """
        self._sync_target()
        if with_optimizer_step:
            return self._executables.final(size, chunk).compiled
        return self._executables.micro(size, chunk).compiled

    def ledger(self, size: int, chunk: int = 1, *, with_optimizer_step: bool = False) -> Ledger:
        """Everything live on the device while micro-steps of ``size`` run, by part.

        This, not the program's own estimate, is what the capacity is compared with.
        With ``chunk``: the program of that many micro-steps in one dispatch. With
        ``with_optimizer_step``: the update's last program, those micro-steps and then
        the optimizer step, whose new state lives beside the old (`Plan.fused` says
        whether updates run it).

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p) ** 2, optax.adam(0.1),
            ...                              target_batch_size=8, micro_batch_size=8)
            >>> state = trainer.init(jnp.ones(()), np.ones(8, np.float32))
            >>> ledger = trainer.ledger(8)
            >>> ledger.total == ledger.state + ledger.in_flight + ledger.program
            True
        """
        self._sync_target()
        if with_optimizer_step:
            return self._executables.final_ledger(size, chunk)
        return self._planner.ledger(size, chunk)

    def capacity(self) -> int | None:
        """The bytes a size's ledger may reach; None when unknown (a CPU without a limit).

        The smaller of ``memory_limit`` and the device's capacity less ``headroom``
        less what other arrays held when the plan was made.

        Example:
            >>> import optax, jax_adaptive as ja
            >>> ja.AdaptiveTrainer(lambda p, b, r: b, optax.sgd(0.1), target_batch_size=8,
            ...                    memory_limit=10**9).capacity()
            1000000000
        """
        return self._planner.capacity()

    def set_memory_limit(self, memory_limit: int | None) -> None:
        """Changes the simulated device's bytes; it takes effect at the next step.

        A lower limit makes the next step fail as an out-of-memory would, which shrinks
        the micro-batch; a higher one lets the trainer grow it (policy ``grow``). Either
        way the next step decides the chunk and the fused last program again (one
        process), even when the micro-batch stays.

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p) ** 2, optax.sgd(0.1),
            ...                              target_batch_size=8)
            >>> trainer.set_memory_limit(2**30)
            >>> trainer.memory_limit
            1073741824
        """
        self._planner.set_memory_limit(checks.check_limit(memory_limit))

    def step(
        self, state: TrainState, batch: Batch, *, weights: Any = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """Runs one optimizer update on a batch of exactly ``target_batch_size`` examples.

        With a batch-size schedule, the size is the schedule's at ``state.updates``
        (`target_batch_size_for`); the update is exact for it.
        The state's accumulator buffers are donated: use the returned state.

        Args:
            state: the current `TrainState`.
            batch: a pytree of arrays (NumPy or jax) with leading size
                ``target_batch_size``.
            weights: per-example weights, shape ``[target_batch_size]`` (None: all 1).
                The update follows ``sum(weights * losses) / target_batch_size``; a 0/1
                mask drops examples, a token count per sequence weighs by tokens.

        Returns:
            ``(state, metrics)``; metrics hold ``loss`` (the weighted mean over the
            batch, a device scalar), each aux metric's, ``micro_batch_size``,
            ``accumulation_steps`` and ``examples``.

        Example:
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
        updates = self._updates_of(state)
        T = self._checked_target(updates)
        batch = checks.on_device(batch, self.device if self.mesh is None else None)
        scheduled = None if self.schedule.constant is not None else updates
        checks.check_batch(batch, weights, self._executables.example, T, scheduled)
        self._planner.set_target(T)
        out = self._updater.run(state, batch, weights)
        self._next_update = updates + 1
        self._returned = (out[0].updates, updates + 1)
        return out

    def evaluator(self, metric_fn: Callable[..., Any]) -> Evaluator:
        """The `jax_adaptive.Evaluator` this trainer keeps for ``metric_fn`` (made on first use).

        One per function object: it compiles each evaluation size once and remembers its
        plan, so pass the same function each time (not a new lambda). It shares the
        trainer's device, ``memory_limit`` (followed after `set_memory_limit`), ``headroom``
        and plan cache; its search, sizes and out-of-memory shrinking are its own.

        Args:
            metric_fn: as in `evaluate`.

        Returns:
            The evaluator: its ``batch_size``, ``largest``, ``search_log`` and
            ``fault_hook`` (`jax_adaptive.testing.inject_oom` takes it).

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p) ** 2, optax.sgd(0.1),
            ...                              target_batch_size=8, plan_cache=False)
            >>> error = lambda p, b: {"error": (b * p) ** 2}
            >>> trainer.evaluator(error) is trainer.evaluator(error)
            True
        """
        evaluator = self._evaluators.get(metric_fn)
        if evaluator is None:
            evaluator = self._evaluators[metric_fn] = Evaluator(
                _with_model_state(metric_fn) if self._has_state else metric_fn,
                memory_limit=self.memory_limit,
                headroom=self.headroom,
                plan_cache=False if self.plan_cache is None else self.plan_cache,
                device=self.device,
            )
        evaluator.memory_limit = self.memory_limit
        return evaluator

    def evaluate(
        self, state: TrainState, data: Any, metric_fn: Callable[..., Any], *, predict: bool = False
    ) -> Any:
        """Evaluates ``metric_fn`` over ``data`` at the largest batch that fits beside the state.

        The evaluation program holds no gradients, so its batch is usually many times the
        training micro-batch; it is sized by its own search under the same device (the
        train state counted as live: ``resident=state``). An out-of-memory while it runs
        shrinks the evaluation size only, never training's micro-batch, and loses or
        repeats no example. The means are those of one full pass (padding masked).

        Args:
            state: the `TrainState` (left as it is).
            data: one batch of all the examples (a dict, tuple or array with a leading
                example axis) or a stream of batches of any sizes (a list or iterable,
                read once).
            metric_fn: ``(params, batch) -> {name: per-example values}``, or with
                ``has_state=True`` ``(params, model_state, batch) -> ...``; with
                ``predict=True`` it may return any per-example pytree.
            predict: return every example's outputs (concatenated on the host) instead
                of the means.

        Returns:
            ``{name: mean, ..., "examples": n}``, or with ``predict`` the outputs.

        Under a ``mesh``, evaluation runs on this process's first device, on a copy of the
        parameters (and model state) gathered there, counted beside the state; a
        parameter not fully held by this process (several processes) cannot be copied.

        Raises:
            NothingFitsError: when even a batch of 1 does not fit beside the state.

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p - 1) ** 2, optax.sgd(0.1),
            ...                              target_batch_size=4, plan_cache=False)
            >>> state = trainer.init(jnp.ones(()), np.ones(4, np.float32))
            >>> trainer.evaluate(state, np.arange(3, dtype=np.float32),
            ...                  lambda p, b: {"error": (b * p - 1) ** 2})
            {'error': 0.6666666666666666, 'examples': 3}
        """
        self._require_init()
        evaluator = self.evaluator(metric_fn)
        params = (state.params, state.model_state) if self._has_state else state.params
        if self.mesh is not None:
            params = jax.device_put(params, self.device)
        run = evaluator.predict if predict else evaluator.evaluate
        return run(params, data, resident=state)

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

        With a batch-size schedule each update draws the schedule's size from the
        stream. Leftover examples carry over between updates; a change of micro-batch size
        never restarts, reshuffles or drops the stream. Nothing is lost:

        * examples read past the last update stay with the iterator (`Rebatcher`):
          ``fit(state, it, 1)`` called again on the same iterator ``it`` goes on with
          the very next example;
        * an optimizer step that runs out of memory (`OptimizerStepOutOfMemory`) is run
          again on the same batch from the state it kept;
        * any other error (a bad batch, the stream's own) raises `jax_adaptive.FitError`
          from it, holding the last good ``state``, the ``history`` of the updates made
          and the ``batch`` in flight: ``fit(error.state, it)`` goes on.

        Args:
            state: the current `TrainState`.
            batches: an iterable of host batches, each of any leading size.
            num_updates: how many updates to run; None runs until the stream ends.
            progress: show a progress bar (update, examples/s, micro-batch size and
                accumulation steps).
            on_update: called with the update's number and metrics after each update
                (after its evaluation, whose results it sees).
            eval_every: evaluate ``metric_fn`` over ``eval_data`` (`evaluate`) after
                every ``eval_every`` updates, and after the last one when
                ``num_updates`` is given; each mean goes into that update's metrics as
                ``eval_<name>`` (and ``eval_examples``). None: no evaluation.
            eval_data: the held-out data, as `evaluate` takes it: one batch, a list of
                batches, or a callable returning a fresh iterable each time (a
                generator would be spent after one evaluation).
            metric_fn: the per-example metrics, as `evaluate` takes them.
            read_ahead: how many of the stream's batches a background thread reads
                before they are needed, while the updates run (`Rebatcher`): the
                loader's host work then overlaps training instead of adding to it, as
                asynchronous dispatch gives a hand-written loop. 0 reads the stream in
                this thread, a batch when it is needed. What was read ahead and not
                trained on stays with the stream's iterator, as above.

        Returns:
            The state and one metrics dict (host values) per update.

        Raises:
            FitError: any error part-way, as its ``__cause__``, with what was done.

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p - 1) ** 2,
            ...                              optax.sgd(0.1), target_batch_size=8)
            >>> stream = (np.ones(5, np.float32) for _ in range(4))  # 20 examples
            >>> state = trainer.init(jnp.zeros(()), np.ones(1, np.float32))
            >>> state, history = trainer.fit(state, stream)
            >>> len(history), [h["examples"] for h in history]
            (2, [8, 8])
            >>> error = lambda p, b: {"error": (b * p - 1) ** 2}  # evaluated every update
            >>> state, history = trainer.fit(state, [np.ones(8, np.float32)], eval_every=1,
            ...                              eval_data=np.ones(3, np.float32), metric_fn=error)
            >>> sorted(history[0])[:3], history[0]["eval_examples"]
            (['accumulation_steps', 'eval_error', 'eval_examples'], 3)
        """
        if num_updates is not None:
            checks.positive_int("num_updates", num_updates)
        after = self._evaluation_hook(eval_every, eval_data, metric_fn, num_updates)
        stream = Rebatcher(batches, self.target_batch_size_for(state), read_ahead=read_ahead)

        def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
            state, metrics = self.step(state, batch)
            stream.size = self.target_batch_size  # the next update's (a schedule's)
            return state, metrics

        with stream:  # what was read ahead goes back to the stream's iterator
            state, history = fit_loop(
                step, state, stream, num_updates, progress=progress, on_update=on_update,
                after_update=after,
            )  # fmt: skip
        if stream.leftover and (num_updates is None or len(history) < num_updates):
            log.info("the stream ended with %d examples short of a target batch", stream.leftover)
        return state, history

    # ----------------------------------------------------------------- internals

    def _evaluation_hook(
        self, every: int | None, data: Any, metric_fn: Callable[..., Any] | None, last: int | None
    ) -> Callable[[int, TrainState, dict[str, Any]], dict[str, Any]] | None:
        """``fit``'s evaluation after an update: ``eval_<name>`` metrics when one is due."""
        if every is None:
            if data is not None or metric_fn is not None:
                raise ValueError("eval_data and metric_fn need eval_every (updates between).")
            return None
        checks.positive_int("eval_every", every)
        if data is None or not callable(metric_fn):
            raise ValueError("eval_every needs eval_data and a callable metric_fn.")

        def after(update: int, state: TrainState, _: dict[str, Any]) -> dict[str, Any]:
            if update % every and update != last:
                return {}
            metrics = self.evaluate(state, data() if callable(data) else data, metric_fn)
            return {f"eval_{name}": value for name, value in metrics.items()}

        return after

    def _updates_of(self, state: TrainState) -> int:
        """``state.updates`` on the host; 0 (nothing read) for a constant target."""
        if self.schedule.constant is not None:
            return 0
        updates = state.updates
        if updates is self._returned[0]:  # the state step returned: no device read
            return self._returned[1]
        if isinstance(updates, jax.Array) and not updates.is_fully_addressable:
            updates = updates.addressable_data(0)  # replicated: every process has it
        return int(jax.device_get(updates))

    def _checked_target(self, updates: int) -> int:
        """The schedule's size at ``updates``, checked against the data shards."""
        T = self.schedule(updates)
        if T < self.shards:
            where = "" if self.schedule.constant is not None else f" at update {updates}"
            raise ValueError(
                f"target_batch_size={T}{where} is smaller than the {self.shards} data shards "
                "of the mesh: every device needs an example."
            )
        return T

    def _sync_target(self) -> None:
        """Plans for the next update's target batch size, which a schedule moves."""
        if self._planner.size is not None:
            self._planner.set_target(self.target_batch_size)

    def _require_init(self) -> None:
        if self._planner.size is None:
            raise RuntimeError("call trainer.init(params, example_batch) first.")


def _with_model_state(metric_fn: Callable[..., Any]) -> MetricFn:
    """``(params, model_state, batch)`` as the evaluator's ``((params, model_state), batch)``."""

    def metric(variables: tuple[Any, Any], batch: Any) -> Any:
        return metric_fn(variables[0], variables[1], batch)

    return metric
