"""AdaptiveTrainer: the micro-batch search, the executable cache, the step loop, recovery.

The host loop kept apart from the jitted pieces of `jax_adaptive.step`:

* ``init`` puts the state on the device, compiles the optimizer step and, with
  ``micro_batch_size="auto"``, searches the largest micro-batch that fits by compiling
  the micro-step ahead of time for candidate sizes (``lower(ShapeDtypeStruct...)``) and
  comparing XLA's estimate of its peak with the capacity.
* ``step`` runs one update of ``target_batch_size`` examples. An out-of-memory in any
  micro-step (real, or simulated by ``memory_limit``) leaves the parameters, the
  optimizer state and the model state alive (the micro-step donates only the
  accumulator), so the trainer shrinks the micro-batch and redoes the update from its
  start: nothing is lost, no example is counted twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jax_adaptive.data import Rebatcher, leading_size, micro_batches
from jax_adaptive.distributed import place, process_any, process_min, replicated
from jax_adaptive.memory import MemoryModel, device_capacity, estimate_peak_bytes, memory_report
from jax_adaptive.oom import PeerOutOfMemory, SimulatedOutOfMemory, is_oom
from jax_adaptive.plan_cache import PlanCache, plan_key
from jax_adaptive.search import NothingFitsError, search_max_size
from jax_adaptive.step import (
    Batch,
    Params,
    PerExampleLoss,
    TrainState,
    make_micro_step,
    make_optimizer_step,
    multi_steps,
)

__all__ = ["AdaptiveTrainer", "OptimizerStepOutOfMemory", "SizeTrial", "StateLostError"]

log = logging.getLogger("jax_adaptive")

DecidedBy = Literal["estimate", "cache", "compile", "run", "learned", "plan cache"]
GrowPolicy = Literal["never", "on_limit_change"] | int


class SizeTrial(NamedTuple):
    """One decision of whether a micro-batch size fits.

    Attributes:
        size: the micro-batch size.
        fits: the answer.
        estimated_bytes: XLA's estimate of the micro-step's peak (None if it did not
            compile).
        seconds: what deciding cost (compile, run).
        decided_by: ``"estimate"`` (a fresh compile's estimate against the capacity),
            ``"cache"`` (the estimate of an executable compiled before), ``"compile"``
            (compiling ran out of memory), ``"run"`` (a real run ran out of memory),
            ``"learned"`` (the estimate is above the capacity learned from real
            out-of-memory errors), ``"plan cache"`` (a plan a run of the same job
            stored; its first run is still guarded).
        reason: why the search ran (``"init"``, ``"out of memory at size 64"``, ...).
    """

    size: int
    fits: bool
    estimated_bytes: int | None
    seconds: float
    decided_by: DecidedBy
    reason: str


class OptimizerStepOutOfMemory(RuntimeError):
    """The optimizer step ran out of memory; ``.state`` is the update's intact start state.

    The optimizer step needs the same memory whatever the micro-batch size, so shrinking
    cannot help: free device memory, then call ``step(error.state, batch)`` again.
    """

    def __init__(self, state: TrainState):
        self.state = state
        super().__init__(
            "the optimizer step ran out of memory (its need does not depend on the "
            "micro-batch size); the state at the start of the update is in error.state."
        )


class StateLostError(RuntimeError):
    """A donating call failed after its first run and XLA deleted the train state."""


@dataclasses.dataclass
class _Progress:
    """How far the current update got: what a failed micro-step lets it go on from."""

    acc: Any
    opt: Any  # the MultiStepsState without its accumulator
    model_state: Any
    totals: Any
    offset: int = 0  # the first example not yet accumulated
    steps: int = 0  # micro-steps accumulated

    saved: _Saved | None = None  # a host copy of a point the update can go on from

    def advance(self, acc, mini_step, model_state, totals, size: int, total: int) -> None:
        self.acc, self.model_state, self.totals = acc, model_state, totals
        self.opt = self.opt._replace(mini_step=mini_step)
        self.offset = min(self.offset + size, total)
        self.steps += 1

    def save(self) -> None:
        """Copies the progress to the host, once the last micro-step ran.

        It blocks first: that raises a failed run's error, where reading a failed
        buffer straight away can abort the process on XLA:CPU.
        """
        jax.block_until_ready((self.acc, self.model_state, self.totals))
        arrays = jax.device_get((self.acc, self.model_state, self.totals))
        self.saved = _Saved(arrays, jax.device_get(self.opt), self.offset, self.steps)


class _Saved(NamedTuple):
    arrays: Any  # host copies of (acc, model_state, totals)
    opt: Any
    offset: int
    steps: int


class _Executable(NamedTuple):
    compiled: Any
    estimate: int
    report: dict[str, int]
    seconds: float


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__}).")
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive.")
    return int(value)


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _shardings(structs: Any) -> Any:
    return jax.tree.map(lambda s: s.sharding, structs)


def _is_deleted(tree: Any) -> bool:
    return any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree.leaves(tree))


class AdaptiveTrainer:
    """Trains with a fixed target batch size through the largest micro-batch that fits.

    Args:
        loss_fn: ``(params, batch, rng) -> losses`` of shape ``[m]``, one per example
            (with ``has_aux``: ``(losses, aux)``, aux a dict of per-example metrics; with
            ``has_state``: ``(params, model_state, batch, rng) -> (that, new_model_state)``).
        optimizer: any ``optax.GradientTransformation``; it is applied once per target
            batch to the exact mean gradient of its examples.
        target_batch_size: examples per optimizer update, any positive int.
        micro_batch_size: ``"auto"`` (search the largest that fits) or a fixed int.
            A fixed size is used as given: an out-of-memory with it propagates.
        memory_limit: bytes; a cap on the estimated peak of a micro-step. On a CPU it
            simulates a device of that size: a size whose estimate exceeds it fails
            exactly as a real out-of-memory would, through the same code path.
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
        objective: ``"max"``, the largest micro-batch that fits, or ``"throughput"``:
            the fastest update among the largest size and the sizes with the fewest
            micro-steps and the least padding (``ceil(T / k)`` for the few smallest
            ``k``), each timed for a few micro-steps at ``init`` (`throughput_log`).
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
    """

    def __init__(
        self,
        loss_fn: PerExampleLoss,
        optimizer: optax.GradientTransformation,
        *,
        target_batch_size: int,
        micro_batch_size: int | Literal["auto"] = "auto",
        memory_limit: int | None = None,
        has_aux: bool = False,
        has_state: bool = False,
        headroom: float = 0.05,
        grow: GrowPolicy = "on_limit_change",
        oom_retries: int = 3,
        multiple_of: int = 1,
        plan_cache: PlanCache | str | os.PathLike[str] | bool | None = None,
        objective: Literal["max", "throughput"] = "max",
        device: jax.Device | None = None,
        mesh: jax.sharding.Mesh | None = None,
        data_axis: str = "data",
        param_sharding: Any = None,
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                "optimizer must be an optax.GradientTransformation (with init and update), "
                f"got {type(optimizer).__name__}."
            )
        self.target_batch_size = _positive_int("target_batch_size", target_batch_size)
        if micro_batch_size != "auto":
            micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
            if micro_batch_size > self.target_batch_size:
                raise ValueError(
                    f"{micro_batch_size=} must not exceed target_batch_size="
                    f"{self.target_batch_size}."
                )
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"{headroom=} must be in [0, 1).")
        if not (grow in ("never", "on_limit_change") or (isinstance(grow, int) and grow > 0)):
            raise ValueError(f"{grow=} must be 'never', 'on_limit_change' or a positive int.")
        self.multiple_of = _positive_int("multiple_of", multiple_of)
        self.mesh, self.data_axis, self.param_sharding = mesh, data_axis, param_sharding
        self.shards = self._check_mesh(device)
        if self.shards > self.target_batch_size:
            raise ValueError(
                f"target_batch_size={self.target_batch_size} is smaller than the "
                f"{self.shards} data shards of the mesh: every device needs an example."
            )
        if micro_batch_size != "auto" and micro_batch_size % self.shards:
            raise ValueError(
                f"{micro_batch_size=} must be a multiple of the {self.shards} data shards."
            )
        if multiple_of > self.target_batch_size:
            raise ValueError(
                f"{multiple_of=} must not exceed target_batch_size={self.target_batch_size}."
            )
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.has_aux = has_aux
        self.has_state = has_state
        self.headroom = headroom
        self.grow = grow
        self.oom_retries = oom_retries
        self.device = device or (
            next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
            if mesh is not None
            else jax.local_devices()[0]
        )
        # A full copy on every device (the device itself without a mesh), and the
        # micro-batch's split over the data axis (None without a mesh).
        self._everywhere = (
            jax.sharding.SingleDeviceSharding(self.device) if mesh is None else replicated(mesh)
        )
        self._data = None if mesh is None else NamedSharding(mesh, PartitionSpec(data_axis))
        self.plan_cache = PlanCache.from_arg(plan_cache)
        if objective not in ("max", "throughput"):
            raise ValueError(f"{objective=} must be 'max' or 'throughput'.")
        self.objective = objective
        self.throughput_log: list[dict[str, float]] = []
        self._plan_key: str | None = None
        self._fixed = None if micro_batch_size == "auto" else micro_batch_size
        self.memory_limit = None if memory_limit is None else self._check_limit(memory_limit)
        self.trace_counts: Counter[int] = Counter()
        self.search_log: list[SizeTrial] = []
        self._micro_fn = make_micro_step(
            loss_fn,
            optimizer,
            self.target_batch_size,
            has_aux=has_aux,
            has_state=has_state,
            on_trace=lambda size: self.trace_counts.update([size]),
        )
        self._micro_jit = jax.jit(self._micro_fn, donate_argnums=(2, 4))
        self._executables: dict[int, _Executable] = {}
        self._compiles = 0
        self.memory_model = MemoryModel()  # the estimate of every size compiled
        self._lowerings: dict[int, Any] = {}
        self._optimizer_steps: dict[bool, _Executable] = {}
        self._optimizer_step_ran: set[bool] = set()
        self._faults: Any = None  # a jax_adaptive.testing.FaultInjector, in tests
        self._oom_streak = 0  # out-of-memory errors since the last micro-step that ran
        self._size: int | None = None
        self._ran: set[int] = set()
        self._learned_cap: int | None = None  # below the estimates that really failed
        self._real_ooms_this_update = 0
        self._limit_raised = False
        self._updates_since_grow = 0

    # ----------------------------------------------------------------- public API

    @property
    def micro_batch_size(self) -> int:
        """The micro-batch size in use."""
        self._require_init()
        return self._size

    @property
    def accumulation_steps(self) -> int:
        """Micro-steps per optimizer update: ``ceil(target_batch_size / micro_batch_size)``."""
        return math.ceil(self.target_batch_size / self.micro_batch_size)

    @property
    def compiles(self) -> int:
        """How many times the micro-step has been compiled (once per size tried)."""
        return self._compiles

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
        opt_state = multi_steps(self.optimizer, 1).init(params)
        state = TrainState(params, opt_state, model_state, rng)
        state = place(state, self._placement(state))
        self.plan(state, example_batch)
        return state

    def plan(self, state: TrainState, example_batch: Batch) -> None:
        """Plans the micro-batch size for a train state that already exists.

        `init` builds the state and calls this; call it directly to share one state
        between trainers of the same loss and optimizer that see other input shapes
        (`jax_adaptive.BucketedTrainer` does), with no second copy of the state.

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
        self._example = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                np.shape(x)[1:], np.asarray(x).dtype if not isinstance(x, jax.Array) else x.dtype
            ),
            example_batch,
        )
        self._state_structs = jax.tree.map(_struct, state)
        self._totals_struct = self._totals_for(state)
        if self.mesh is not None:  # the outputs keep the inputs' shardings, call after call
            s = self._state_structs
            outs = (
                s.opt_state.acc_grads,
                s.opt_state.mini_step,
                s.model_state,
                self._totals_struct,
            )
            self._micro_jit = jax.jit(
                self._micro_fn, donate_argnums=(2, 4), out_shardings=_shardings(outs)
            )
        self._optimizer_step()  # compiles it, and checks that the state itself fits
        self._size = self._fixed or process_min(
            self._cached_plan() or self._search_and_store(state)
        )
        if self._fixed:
            self.compile(self._fixed)

    def compile(self, size: int) -> Any:
        """Returns the compiled micro-step for micro-batches of ``size``, compiling once.

        Args:
            size: the micro-batch size, in ``[1, target_batch_size]``.

        Returns:
            The ``jax.stages.Compiled`` micro-step.

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p) ** 2, optax.sgd(0.1),
            ...                              target_batch_size=8, micro_batch_size=8)
            >>> _ = trainer.init(jnp.ones(()), np.ones(8, np.float32))
            >>> ja.estimate_peak_bytes(trainer.compile(3)) > 0
            True
        """
        return self._executable(size).compiled

    def set_memory_limit(self, memory_limit: int | None) -> None:
        """Changes the cap on a micro-step's estimated peak; it takes effect at the next step.

        A lower limit makes the next step fail as an out-of-memory would, which shrinks
        the micro-batch; a higher one lets the trainer grow it (policy ``grow``).

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p) ** 2, optax.sgd(0.1),
            ...                              target_batch_size=8)
            >>> trainer.set_memory_limit(2**30)
            >>> trainer.memory_limit
            1073741824
        """
        new = None if memory_limit is None else self._check_limit(memory_limit)
        old = self.memory_limit
        self._limit_raised = new is None if old is not None else False
        if new is not None and old is not None:
            self._limit_raised = new > old
        self.memory_limit = new

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        """Runs one optimizer update on a batch of exactly ``target_batch_size`` examples.

        The state's accumulator buffers are donated: use the returned state.

        Args:
            state: the current `TrainState`.
            batch: a pytree of arrays (NumPy or jax) with leading size
                ``target_batch_size``.

        Returns:
            ``(state, metrics)``; metrics hold ``loss`` (mean over the batch, a device
            scalar), each aux metric's mean, ``micro_batch_size``,
            ``accumulation_steps`` and ``examples``.
        """
        self._require_init()
        self._check_batch(batch)
        self._maybe_grow()
        self._real_ooms_this_update = 0
        progress = self._fresh_progress(state)
        failed = False
        while True:
            size = self._size
            try:
                self._accumulate(state, batch, size, progress, cautious=failed)
                break
            except Exception as exc:
                if self._fixed is not None or not is_oom(exc):
                    raise
                self._recover(exc, size)
                # Go on from the micro-step that failed when what came before survived;
                # else start the update again from the state, which nothing donated.
                salvaged = self._salvage(progress)
                if not process_min(salvaged is not None):  # all go on, or all start again
                    salvaged = None
                progress = salvaged or self._fresh_progress(state)
                failed = True
        return self._apply(state, progress)

    def fit(
        self,
        state: TrainState,
        batches: Iterable[Batch],
        num_updates: int | None = None,
        *,
        progress: bool = False,
        on_update: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> tuple[TrainState, list[dict[str, Any]]]:
        """Trains on a stream of batches of any leading size, ``target_batch_size`` per update.

        Leftover examples carry over between updates; a change of micro-batch size
        never restarts, reshuffles or drops the stream.

        Args:
            state: the current `TrainState`.
            batches: an iterable of host batches, each of any leading size.
            num_updates: how many updates to run; None runs until the stream ends.
            progress: show a progress bar (update, examples/s, micro-batch size and
                accumulation steps).
            on_update: called with the update's number and metrics after each update.

        Returns:
            The state and one metrics dict (host values) per update.

        Example:
            >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
            >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p - 1) ** 2,
            ...                              optax.sgd(0.1), target_batch_size=8)
            >>> stream = (np.ones(5, np.float32) for _ in range(4))  # 20 examples
            >>> state = trainer.init(jnp.zeros(()), np.ones(1, np.float32))
            >>> state, history = trainer.fit(state, stream)
            >>> len(history), [h["examples"] for h in history]
            (2, [8, 8])
        """
        from tqdm.auto import tqdm

        if num_updates is not None:
            _positive_int("num_updates", num_updates)
        stream = Rebatcher(batches, self.target_batch_size)
        history: list[dict[str, Any]] = []
        bar = tqdm(total=num_updates, disable=not progress, unit="update", leave=False)
        start = time.perf_counter()
        try:
            for batch in stream:
                state, metrics = self.step(state, batch)
                metrics = jax.device_get(metrics)
                history.append(metrics)
                if on_update is not None:
                    on_update(len(history), metrics)
                rate = len(history) * self.target_batch_size / (time.perf_counter() - start)
                bar.set_postfix(
                    loss=f"{float(metrics['loss']):.4f}",
                    ex_s=f"{rate:,.0f}",
                    micro=metrics["micro_batch_size"],
                    accum=metrics["accumulation_steps"],
                )
                bar.update()
                if num_updates is not None and len(history) == num_updates:
                    break
        finally:
            bar.close()
        if stream.leftover and (num_updates is None or len(history) < num_updates):
            log.info("the stream ended with %d examples short of a target batch", stream.leftover)
        return state, history

    # ----------------------------------------------------------------- internals

    def _require_init(self) -> None:
        if self._size is None:
            raise RuntimeError("call trainer.init(params, example_batch) first.")

    def _check_mesh(self, device: jax.Device | None) -> int:
        """The number of data shards (1 without a mesh), checking the mesh arguments."""
        if self.mesh is None:
            if self.param_sharding is not None:
                raise ValueError("param_sharding needs a mesh (mesh=ja.data_mesh(), ...).")
            return 1
        if not isinstance(self.mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}.")
        if device is not None:
            raise ValueError("pass either device or mesh, not both.")
        if self.data_axis not in self.mesh.shape:
            raise ValueError(
                f"data_axis={self.data_axis!r} is not an axis of the mesh {dict(self.mesh.shape)}."
            )
        return int(self.mesh.shape[self.data_axis])

    def _placement(self, state: TrainState) -> Any:
        """Where the state lives: the device, or shardings over the mesh."""
        everywhere = self._everywhere
        if self.mesh is None:
            return everywhere
        if self.param_sharding is None:
            params = jax.tree.map(lambda _: everywhere, state.params)
        else:
            params = jax.tree.map(
                lambda spec, p: jax.tree.map(lambda _: NamedSharding(self.mesh, spec), p),
                self.param_sharding,
                state.params,
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )
        opt = optax.tree_map_params(
            multi_steps(self.optimizer, 1),
            lambda _, sharding: sharding,
            state.opt_state,
            params,
            transform_non_params=lambda _: everywhere,
        )
        return TrainState(
            params, opt, jax.tree.map(lambda _: everywhere, state.model_state), everywhere
        )

    @staticmethod
    def _check_limit(memory_limit: Any) -> int:
        return _positive_int("memory_limit", memory_limit)

    def _check_batch(self, batch: Batch) -> None:
        size = leading_size(batch)
        if size != self.target_batch_size:
            raise ValueError(
                f"the batch has leading size {size}, but each step takes exactly "
                f"target_batch_size={self.target_batch_size} examples."
            )
        got = jax.tree.structure(batch)
        want = jax.tree.structure(self._example)
        if got != want:
            raise ValueError(f"the batch's structure {got} differs from example_batch's {want}.")
        for x, spec in zip(jax.tree.leaves(batch), jax.tree.leaves(self._example), strict=True):
            if np.shape(x)[1:] != spec.shape:
                raise ValueError(
                    f"a batch leaf has per-example shape {np.shape(x)[1:]}, but example_batch "
                    f"had {spec.shape}."
                )

    def _totals_for(self, state: TrainState) -> dict[str, jax.ShapeDtypeStruct]:
        # The aux metrics' names are known only from the loss's output: trace it once.
        m = 1
        batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct((m, *s.shape), s.dtype), self._example)

        def losses(params, model_state, b, rng):
            from jax_adaptive.step import _call_loss, _check_per_example

            out, aux, _ = _call_loss(
                self.loss_fn, self.has_aux, self.has_state, params, model_state, b, rng
            )
            _check_per_example("loss_fn's losses", out, m)
            return aux

        aux = jax.eval_shape(losses, state.params, state.model_state, batch, state.rng)
        if not isinstance(aux, dict):
            raise TypeError(f"aux must be a dict of per-example metrics, got {type(aux).__name__}.")
        return {
            name: jax.ShapeDtypeStruct((), jnp.float32, sharding=self._everywhere)
            for name in ("loss", *aux)
        }

    def _micro_structs(self, size: int) -> tuple[Any, ...]:
        s = self._state_structs
        data = self._data
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((size, *x.shape), x.dtype, sharding=data), self._example
        )
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        return (
            s.params,
            s.opt_state._replace(acc_grads=None),
            s.opt_state.acc_grads,
            s.model_state,
            self._totals_struct,
            batch,
            jax.ShapeDtypeStruct((size,), jnp.bool_, sharding=data),
            s.rng,
            i32,
            i32,
        )

    def _executable(self, size: int) -> _Executable:
        self._require_structs()
        if isinstance(size, bool) or not isinstance(size, int | np.integer):
            raise TypeError(f"size must be an int, got {size!r}.")
        if not 1 <= size <= self.target_batch_size:
            raise ValueError(f"{size=} must be in [1, target_batch_size={self.target_batch_size}].")
        size = int(size)
        if size not in self._executables:
            start = time.perf_counter()
            if self._faults is not None:
                self._faults.before_compile(size)
            compiled = self._lowered(size).compile()
            del self._lowerings[size]
            seconds = time.perf_counter() - start
            self._compiles += 1
            self._executables[size] = _Executable(
                compiled, estimate_peak_bytes(compiled), memory_report(compiled), seconds
            )
            self.memory_model.add(size, self._executables[size].estimate)
        return self._executables[size]

    def _lowered(self, size: int) -> Any:
        """Traces the micro-step for ``size`` (the user's loss runs here, errors and all)."""
        if size not in self._lowerings:
            self._lowerings[size] = self._micro_jit.lower(*self._micro_structs(size))
        return self._lowerings[size]

    def _require_structs(self) -> None:
        if not hasattr(self, "_state_structs"):
            raise RuntimeError("call trainer.init(params, example_batch) first.")

    def _optimizer_executable(self, donate: bool) -> _Executable:
        if donate not in self._optimizer_steps:
            s = self._state_structs
            k = jax.ShapeDtypeStruct((), jnp.int32)
            start = time.perf_counter()
            compiled = (
                jax.jit(
                    make_optimizer_step(self.optimizer, self.target_batch_size),
                    donate_argnums=(0, 1) if donate else (),
                    out_shardings=_shardings((s.params, s.opt_state, self._totals_struct)),
                )
                .lower(s.params, s.opt_state, self._totals_struct, k)
                .compile()
            )
            self._optimizer_steps[donate] = _Executable(
                compiled,
                estimate_peak_bytes(compiled),
                memory_report(compiled),
                time.perf_counter() - start,
            )
        return self._optimizer_steps[donate]

    def _optimizer_step(self) -> tuple[_Executable, bool]:
        """The optimizer step to use, compiling it once.

        Without donation (a failure loses nothing) when the state twice fits; donating
        the state when only that fits.
        """
        capacity = self.capacity()
        plain = self._optimizer_executable(donate=False)
        if capacity is None or plain.estimate <= capacity:
            return plain, False
        donating = self._optimizer_executable(donate=True)
        if donating.estimate > capacity:
            raise NothingFitsError(
                1,
                [],
                detail=f"the optimizer step alone needs {donating.estimate:,} bytes (estimate, "
                f"the train state updated in place) and {capacity:,} bytes are available",
            )
        return donating, True

    def capacity(self) -> int | None:
        """The bytes a micro-step may use; None when unknown (a CPU without a limit).

        The smaller of ``memory_limit`` and the device's capacity less ``headroom``.

        Example:
            >>> import optax, jax_adaptive as ja
            >>> ja.AdaptiveTrainer(lambda p, b, r: b, optax.sgd(0.1), target_batch_size=8,
            ...                    memory_limit=10**9).capacity()
            1000000000
        """
        caps = []
        if self.memory_limit is not None:
            caps.append(self.memory_limit)
        device_bytes = device_capacity(self.device)
        if device_bytes is not None:
            caps.append(int(device_bytes * (1.0 - self.headroom)))
        return min(caps) if caps else None

    def _check_capacity(self, size: int) -> None:
        """Raises the simulated out-of-memory when the size's estimate exceeds the cap."""
        capacity = self.capacity()
        needed = self._executable(size).estimate
        if capacity is not None and needed > capacity:
            raise SimulatedOutOfMemory(needed, capacity, what=f"micro-step of {size}")

    def _key(self) -> str:
        """The plan cache's key: what decides the plan (see `jax_adaptive.plan_cache`)."""
        if self._plan_key is None:
            fingerprint = hashlib.sha256(self._lowered(self.shards).as_text().encode()).hexdigest()
            self._plan_key = plan_key(
                platform=self.device.platform,
                device_kind=self.device.device_kind,
                device_capacity=device_capacity(self.device),
                memory_limit=self.memory_limit,
                headroom=self.headroom,
                multiple_of=self.multiple_of,
                mesh=None if self.mesh is None else dict(self.mesh.shape),
                target_batch_size=self.target_batch_size,
                example=str(self._example),
                micro_step=fingerprint,
                jax=jax.__version__,
            )
        return self._plan_key

    def _cached_plan(self) -> int | None:
        """The size a run of the same job stored, if it makes sense; else None."""
        if self.plan_cache is None:
            return None
        start = time.perf_counter()
        entry = self.plan_cache.get(self._key())
        if entry is None:
            return None
        size = entry.get("micro_batch_size")
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or not 1 <= size <= self.target_batch_size
        ):
            warnings.warn(
                f"ignoring a stale plan in {self.plan_cache.path}: micro_batch_size={size!r} "
                f"is not in [1, {self.target_batch_size}]",
                stacklevel=3,
            )
            return None
        self.search_log.append(
            SizeTrial(size, True, entry.get("estimated_bytes"), time.perf_counter() - start,
                      "plan cache", "init")
        )  # fmt: skip
        return size

    def _search_and_store(self, state: TrainState) -> int:
        self._size = self._search(hi=self.target_batch_size, reason="init")
        if self.objective == "throughput":
            self._size = self._fastest(state, self._size)
        self._store_plan()
        return self._size

    def _fastest(self, state: TrainState, largest: int, reps: int = 3) -> int:
        """The candidate at or below ``largest`` whose update is fastest, timed on zeros.

        Candidates: ``largest`` and ``ceil(T / k)`` for the three smallest ``k`` it
        allows (the same micro-steps with less padding, or one or two more).
        """
        T = self.target_batch_size
        k = math.ceil(T / largest)
        shards = self.shards  # each candidate rounded up to whole data shards
        fewest = (min(largest, -(-math.ceil(T / j) // shards) * shards) for j in range(k, k + 3))
        candidates = sorted({largest, *fewest}, reverse=True)
        timings = {}
        for size in candidates:
            if not self._fits_known(size):
                continue
            compiled = self._executable(size).compiled
            structs = self._micro_structs(size)
            seconds = []
            for _ in range(reps + 1):  # the first run warms up
                zeros = _Progress(
                    self._zeros(structs[2]), state.opt_state._replace(acc_grads=None),
                    state.model_state, self._zeros(structs[4]),
                )  # fmt: skip
                batch, mask = self._zeros(structs[5]), jnp.ones(size, bool)
                args = self._micro_args(state, zeros, batch, mask, 0, np.int32(2))
                start = time.perf_counter()
                try:
                    jax.block_until_ready(compiled(*args))
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    break  # a real out-of-memory: not a candidate
                seconds.append(time.perf_counter() - start)
            if len(seconds) <= reps:
                continue
            timings[size] = min(seconds[1:]) * math.ceil(T / size)
            self.throughput_log.append(
                {
                    "size": size,
                    "seconds_per_update": timings[size],
                    "examples_per_second": T / timings[size],
                }
            )
        return min(timings, key=timings.get)

    def _guide_capacity(self) -> int | None:
        """The capacity the search aims under: the real one or the learned one if lower."""
        return min([c for c in (self.capacity(), self._learned_cap) if c is not None], default=None)

    def _fits_known(self, size: int) -> bool:
        """Whether ``size``'s estimate fits the capacity (compiling it if need be)."""
        capacity = self._guide_capacity()
        return capacity is None or self._executable(size).estimate <= capacity

    def _store_plan(self) -> None:
        if self.plan_cache is None:
            return
        estimate = self._executables.get(self._size)
        self.plan_cache.put(
            self._key(),
            {
                "micro_batch_size": self._size,
                "estimated_bytes": estimate.estimate if estimate else None,
                "target_batch_size": self.target_batch_size,
                "capacity": self.capacity(),
            },
        )

    def _search(self, *, hi: int, reason: str, lo: int = 1) -> int:
        """The largest size in [lo, hi] whose estimate fits, guided by the memory model.

        Sizes are multiples of ``multiple_of`` unless none fits (then any size). The
        capacity learned from real out-of-memory errors guides the search here, but
        never makes a run fail: only a real run says a size does not fit.
        """
        learned = self._learned_cap
        capacity = self._guide_capacity()

        def fits(size: int) -> bool:
            start = time.perf_counter()
            cached = size in self._executables
            estimate, decided = None, "compile"
            if not cached:
                self._lowered(size)  # outside the try: only XLA's errors can be OOMs
            try:
                estimate = self._executable(size).estimate
                decided = "cache" if cached else "estimate"
                self._check_capacity(size)
                if learned is not None and estimate > learned:
                    decided = "learned"
                    raise SimulatedOutOfMemory(estimate, learned, f"micro-step of {size}")
                ok = True
            except Exception as exc:
                if not is_oom(exc):
                    raise
                ok = False
            entry = SizeTrial(size, ok, estimate, time.perf_counter() - start, decided, reason)
            self.search_log.append(entry)
            log.info(
                "micro-batch %d %s (%s, %s bytes)",
                size,
                "fits" if ok else "does not fit",
                decided,
                f"{estimate:,}" if estimate is not None else "?",
            )
            return ok

        propose = self.memory_model.propose(capacity) if capacity is not None else None
        # Multiples of the data shards always; of multiple_of too unless none fits.
        least = self.shards
        preferred = math.lcm(self.multiple_of, least)
        multiple = preferred if hi // preferred * preferred >= max(lo, least) else least
        try:
            try:
                return search_max_size(
                    fits, lo=max(lo, least), hi=hi, multiple_of=multiple, propose=propose
                ).size
            except NothingFitsError:
                if multiple == least or lo >= multiple:
                    raise
                return search_max_size(
                    fits, lo=least, hi=multiple - 1, multiple_of=least, propose=propose
                ).size
        except NothingFitsError as exc:
            smallest = self._executables.get(exc.smallest)
            needed = f"{smallest.estimate:,}" if smallest else "?"
            available = f"{capacity:,}" if capacity is not None else "what the device had"
            raise NothingFitsError(
                exc.smallest,
                exc.trials,
                detail=f"a micro-step of {exc.smallest} needs {needed} bytes (estimate) "
                f"and {available} bytes are available",
            ) from None

    def _zeros(self, structs: Any) -> Any:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), structs)

    def _fresh_progress(self, state: TrainState) -> _Progress:
        acc = state.opt_state.acc_grads
        if _is_deleted(acc):  # donated to a micro-step that failed
            acc = self._zeros(self._state_structs.opt_state.acc_grads)
        return _Progress(
            acc=acc,
            opt=state.opt_state._replace(acc_grads=None),
            model_state=state.model_state,
            totals=self._zeros(self._totals_struct),
        )

    def _salvage(self, progress: _Progress | None) -> _Progress | None:
        """The progress of a failed update if it can go on, else None (start it again).

        It goes on from the device buffers when the failure left them alive (a simulated
        limit, an out-of-memory at dispatch), else from the host copy of the last
        micro-step that a new size's first run keeps.
        """
        if progress is None or progress.steps == 0:
            return None
        kept = (progress.acc, progress.model_state, progress.totals)
        if not _is_deleted(kept):
            try:  # a failure may have surfaced late, poisoning buffers still alive
                jax.block_until_ready(kept)
                return progress
            except Exception as exc:
                if not is_oom(exc):
                    raise
        if progress.saved is None:
            return None
        saved = progress.saved
        s = self._state_structs
        places = _shardings((s.opt_state.acc_grads, s.model_state, self._totals_struct))
        acc, model_state, totals = place(saved.arrays, places)
        return _Progress(acc, saved.opt, model_state, totals, saved.offset, saved.steps)

    @staticmethod
    def _micro_args(
        state: TrainState, p: _Progress, batch: Batch, mask: Any, offset: int, k: Any
    ) -> tuple[Any, ...]:
        """The micro-step's arguments, in `jax_adaptive.make_micro_step`'s order."""
        return (
            state.params, p.opt, p.acc, p.model_state, p.totals,
            batch, mask, state.rng, np.int32(offset), k,
        )  # fmt: skip

    def _run_micro_step(self, size: int, args: tuple[Any, ...]) -> Any:
        """The one place a micro-step executes (fault injection hooks in here).

        An injected fault stands for a failure at dispatch: it is agreed between
        processes, so that all raise at the same micro-step or none does.
        """
        if self._faults is not None:
            self._agreed(size, lambda: self._faults.before_execution(size, args))
        return self._executable(size).compiled(*args)

    def _agreed(self, size: int, fn: Callable[[], Any]) -> Any:
        """Runs ``fn``, raising on every process if it ran out of memory on any.

        Under ``jax.distributed`` the process that ran out raises its own error and the
        others `PeerOutOfMemory`; with one process this is ``fn()``.
        """
        if jax.process_count() == 1:
            return fn()
        error = None
        try:
            out = fn()
        except Exception as exc:
            if not is_oom(exc):
                raise
            error = exc
        if process_any(error is not None):
            raise error or PeerOutOfMemory(size)
        return out

    def _accumulate(
        self, state: TrainState, batch: Batch, size: int, p: _Progress, cautious: bool
    ) -> None:
        """Runs the micro-steps of ``size`` from ``p.offset`` to the end of the batch.

        ``cautious`` (after an out-of-memory in this update) and a size's first run
        keep a host copy of each micro-step's result, so that a failure costs one
        micro-step, not the update.
        """
        # What would fail before any micro-step runs (a compile, the capacity), agreed.
        self._agreed(size, lambda: (self._executable(size), self._check_capacity(size)))
        cautious = cautious or size not in self._ran
        remaining = math.ceil((self.target_batch_size - p.offset) / size)
        k = np.int32(p.steps + remaining + 1)  # never emits: the optimizer step does
        for micro in micro_batches(batch, size, start=p.offset):
            chunk, mask = micro.batch, micro.mask
            if self._data is not None:
                chunk, mask = place((chunk, mask), self._data)
            args = self._micro_args(state, p, chunk, mask, micro.offset, k)
            acc, mini_step, model_state, totals = self._run_micro_step(size, args)
            p.advance(acc, mini_step, model_state, totals, size, self.target_batch_size)
            if cautious:
                # A new size's first update, or one that already failed, is where an
                # out-of-memory is likeliest: each micro-step must fail inside the try,
                # and a host copy of its result lets a failure go on from there.
                self._agreed(size, p.save)
                self._oom_streak = 0
        # A late (asynchronous) failure must surface as the micro-step's, not later.
        self._agreed(size, lambda: jax.block_until_ready((p.acc, p.totals, p.model_state)))
        self._oom_streak = 0
        self._ran.add(size)

    def _apply(self, state: TrainState, p: _Progress) -> tuple[TrainState, dict[str, Any]]:
        optimizer_step, donating = self._optimizer_step()
        inputs = (state.params, p.opt._replace(acc_grads=p.acc), p.totals, np.int32(p.steps + 1))
        # A donating call that fails deletes its inputs: keep a host copy for its first run.
        snapshot = jax.device_get(inputs[:2]) if donating not in self._optimizer_step_ran else None
        try:
            params, opt_state, means = optimizer_step.compiled(*inputs)
            jax.block_until_ready((params, opt_state, means))
        except Exception as exc:
            if not is_oom(exc):
                raise
            raise self._optimizer_step_failed(state, inputs, snapshot) from exc
        self._optimizer_step_ran.add(donating)
        self._updates_since_grow += 1
        metrics = {
            **means,
            "micro_batch_size": self._size,
            "accumulation_steps": p.steps,
            "examples": self.target_batch_size,
        }
        return TrainState(params, opt_state, p.model_state, state.rng), metrics

    def _optimizer_step_failed(
        self, state: TrainState, inputs: tuple[Any, ...], snapshot: Any
    ) -> Exception:
        """The error for an optimizer step that ran out of memory, with the state kept."""
        params, opt = inputs[:2]
        if _is_deleted(inputs[:2]):
            if snapshot is None:
                return StateLostError(
                    "the optimizer step, donating the train state because the state twice "
                    "does not fit, ran out of memory inside its run and XLA deleted the "
                    "state: restore it from your last checkpoint, and leave more memory free."
                )
            s = self._state_structs
            params, opt = place(snapshot, _shardings((s.params, s.opt_state)))
        restored = TrainState(
            params,
            opt._replace(
                acc_grads=self._zeros(self._state_structs.opt_state.acc_grads),
                mini_step=jnp.zeros((), jnp.int32),
            ),
            state.model_state,
            state.rng,
        )
        return OptimizerStepOutOfMemory(restored)

    def _recover(self, exc: BaseException, size: int) -> None:
        """Marks ``size`` as not fitting and picks the next size (a smaller one).

        A real out-of-memory says the estimate was too optimistic here: the capacity
        becomes the failed size's estimate less ``headroom`` the first time in an
        update, and half of it each further time (the estimate is then no guide), so
        a few compiles reach a size that runs; the memory model picks each size.
        """
        real = not isinstance(exc, SimulatedOutOfMemory | PeerOutOfMemory)
        estimate = self._executable(size).estimate
        self.search_log.append(
            SizeTrial(size, False, estimate, 0.0, "run" if real else "estimate", "step")
        )
        log.warning("micro-batch %d ran out of memory (%s)", size, "real" if real else "simulated")
        self._oom_streak += 1
        if real:
            self._real_ooms_this_update += 1
            first = self._real_ooms_this_update == 1
            cap = (
                min(int(estimate * (1.0 - self.headroom)), estimate - 1) if first else estimate // 2
            )
            self._learned_cap = min(cap, self._learned_cap or cap)
            # The failed size is not tried again before memory comes back: free its code.
            self._executables.pop(size, None)
        try:
            if size <= self.shards:
                capacity = self.capacity()
                raise NothingFitsError(
                    1,
                    [],
                    detail=f"a micro-step of 1 needs {estimate:,} bytes (estimate) and "
                    f"{f'{capacity:,}' if capacity is not None else 'fewer'} bytes are available",
                ) from exc
            self._size = process_min(
                self._search(hi=size - 1, reason=f"out of memory at size {size}")
            )
            self._store_plan()
        except NothingFitsError:
            # A real out-of-memory can pass (fragmentation, another job's peak): retry the
            # smallest size a few times in a row before giving up.
            if not real or self._oom_streak > self.oom_retries:
                raise
            self._size = self.shards

    def _maybe_grow(self) -> None:
        if self._fixed is not None or self._size == self.target_batch_size:
            return
        periodic = isinstance(self.grow, int) and self._updates_since_grow >= self.grow
        on_limit = self.grow == "on_limit_change" and self._limit_raised
        if not process_any(periodic or on_limit):  # every process grows, or none
            return
        self._limit_raised = False
        self._updates_since_grow = 0
        if periodic:
            self._learned_cap = None  # memory may have come back: let real runs decide
        try:
            grown = self._search(lo=self._size, hi=self.target_batch_size, reason="grow")
        except NothingFitsError:
            grown = self._size  # not even the current size fits now: the step shrinks it
        self._size = process_min(grown)
