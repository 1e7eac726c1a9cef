"""Evaluation and prediction at the largest batch that fits (guide: docs/evaluation.md)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from operator import attrgetter
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_adaptive import checks
from jax_adaptive.data import ExampleQueue, MicroBatch, example_structs
from jax_adaptive.distributed import local_copy, process_means, replicated
from jax_adaptive.errors import catch_oom
from jax_adaptive.forwarding import forwarded
from jax_adaptive.memory import Ledger, tree_bytes
from jax_adaptive.plan import least_padding_size
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.sizing import Binding, Sized, Sizing

__all__ = ["STREAM_MAX_BATCH_SIZE", "Evaluator", "MetricFn", "TrainerEvaluations"]


MetricFn = Callable[[Any, Any], Any]
"""``(params, batch) -> outputs`` with a leading axis of the batch's size: for
`Evaluator.evaluate` a dict of per-example metrics, for `Evaluator.predict` any pytree."""

STREAM_MAX_BATCH_SIZE = 16_384
"""The largest evaluation batch considered for a stream that holds more examples
(``max_batch_size`` changes it); a stream that ends sooner, or arrays, cap it at their
number of examples."""

_Mode = Literal["evaluate", "predict"]


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding)


def _batch_sharding(params: Any, device: jax.Device) -> jax.sharding.Sharding:
    """Where the batches go: on ``device``, or whole on every device of sharded ``params``.

    One program's arguments live on one set of devices: a batch on one device beside
    parameters split over a mesh is refused (``Received incompatible devices``).
    """
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.device_set) > 1:
            return replicated(sharding.mesh)
    return jax.sharding.SingleDeviceSharding(device)


def _masked(value: jax.Array, mask: jax.Array) -> jax.Array:
    """A float metric's sum over the real rows; an integer metric's real rows (`_host_sum`).

    ``where``, not a product: a padding row's NaN stays out; int32 sums overflow at 2**31.
    """
    kept = jnp.where(mask.reshape(mask.shape + (1,) * (value.ndim - 1)), value, 0)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        return kept
    return jnp.sum(kept.astype(jnp.promote_types(value.dtype, jnp.float32)), axis=0)


def _host_sum(value: Any) -> np.ndarray:
    """A batch's metric on the host: a float sum, or the 64-bit sum of an integer's rows."""
    value = np.asarray(value)
    if np.issubdtype(value.dtype, np.floating):
        return value.astype(np.float64)
    wide = np.uint64 if np.issubdtype(value.dtype, np.unsignedinteger) else np.int64
    return value.astype(wide).sum(axis=0)


class Evaluator:
    """Runs a per-example function over a dataset at the largest batch whose program fits.

    Args:
        metric_fn: a `MetricFn`; it sees padded batches of exactly the planned size, the
            padding rows repeating real ones, masked.
        memory_limit: bytes of a device (simulated on a CPU) that must hold the ledger.
        headroom: the share of a real device left unused (never of ``memory_limit``).
        multiple_of: search only multiples of this; a smaller size only when none fits.
        max_batch_size: the largest batch considered (None: see `STREAM_MAX_BATCH_SIZE`).
        plan_cache: None for the default file, False for none, a path or a `PlanCache`.
        oom_retries: real out-of-memory errors in a row retried at batch size 1.
        device: the device to evaluate on (the first local device by default).
        progress: show a progress bar of the examples evaluated.

    Attributes:
        batch_size: the batch size of the last run (None before one).
        largest: the largest size found to fit in the last run (None before one).
        sizing: the `jax_adaptive.sizing.Sizing` engine that decides the sizes.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, jax_adaptive as ja
        >>> metric_fn = lambda w, b: {"error": (b["x"] @ w - b["y"]) ** 2}
        >>> data = {"x": np.ones((10, 3), np.float32), "y": np.arange(10, dtype=np.float32)}
        >>> evaluator = ja.Evaluator(metric_fn, max_batch_size=4, plan_cache=False)
        >>> metrics = evaluator.evaluate(jnp.ones(3), data)
        >>> metrics["error"], metrics["examples"], evaluator.batch_size  # 3 batches of 4
        (10.5, 10, 4)
    """

    def __init__(
        self,
        metric_fn: MetricFn,
        *,
        memory_limit: int | None = None,
        headroom: float = 0.05,
        multiple_of: int = 1,
        max_batch_size: int | None = None,
        plan_cache: PlanCache | str | os.PathLike[str] | bool | None = None,
        oom_retries: int = 3,
        device: jax.Device | None = None,
        progress: bool = False,
    ):
        if not callable(metric_fn):
            raise TypeError(f"metric_fn must be callable, got {type(metric_fn).__name__}.")
        if max_batch_size is not None:
            checks.positive_int("max_batch_size", max_batch_size)
        self.metric_fn, self.max_batch_size = metric_fn, max_batch_size
        self.multiple_of = checks.positive_int("multiple_of", multiple_of)
        self.progress = progress
        self.sizing = Sizing(
            "evaluation batch of",
            memory_limit=memory_limit,
            headroom=headroom,
            device=checks.check_device(device),
            plan_cache=PlanCache.from_arg(plan_cache),
            oom_retries=oom_retries,
        )
        self.batch_size: int | None = None
        self.largest: int | None = None
        self._mode: _Mode = "evaluate"
        self._program: Binding | None = None  # the engine's binding of the last run

    search_log = forwarded("sizing.search_log", "Every `SizeTrial`, both modes.")
    compiles = forwarded("sizing.compiles", "Programs compiled, one per size.")
    memory_limit = property(
        attrgetter("sizing.memory_limit"),
        lambda self, limit: self.sizing.set_memory_limit(limit),
        doc="The simulated device's bytes; set it to change the cap for the next run.",
    )
    fault_hook = forwarded("sizing.fault_hook", "Called before each compile and each batch "
                           "that runs (see `jax_adaptive.testing`).", settable=True)  # fmt: skip

    def capacity(self) -> int | None:
        """The bytes a size's ledger may reach (docs/memory.md); None: unknown.

        Examples:
            >>> import jax_adaptive as ja
            >>> ja.Evaluator(lambda p, b: b, memory_limit=10**6).capacity()
            1000000
        """
        return self.sizing.capacity()

    def evaluate(self, params: Any, dataset: Any, *, resident: Any = None) -> dict[str, Any]:
        """The mean of each per-example metric over every example of ``dataset``.

        ``dataset`` is one batch of all the examples (a dict, tuple or array, NumPy or jax)
        or a stream of batches of any sizes (any other iterable), read once. ``resident``:
        other arrays live meanwhile (the train state), counted in the ledger, not passed;
        arrays also in ``params`` count once.

        Returns ``{name: mean}`` (a float, or an array for a metric with trailing axes) and
        ``examples``, their number. Raises `NothingFitsError` when a batch of 1 does not fit.

        Examples:
            >>> import jax.numpy as jnp, numpy as np, jax_adaptive as ja
            >>> evaluator = ja.Evaluator(lambda p, b: {"hit": b == p}, plan_cache=False)
            >>> stream = [np.array([0, 1, 1]), np.array([1, 2])]  # a stream of 5 examples
            >>> evaluator.evaluate(jnp.int32(1), stream)
            {'hit': 0.6, 'examples': 5}
        """
        sums, count = self._run("evaluate", params, dataset, resident)
        means = {name: total / count for name, total in sums.items()}
        means = {name: float(m) if np.ndim(m) == 0 else m for name, m in means.items()}
        return {**means, "examples": count}

    def predict(self, params: Any, dataset: Any, *, resident: Any = None) -> Any:
        """``metric_fn``'s outputs for every example of ``dataset``, padding removed, on the host.

        The arguments are `evaluate`'s; each leaf is the NumPy concatenation over all examples.

        Examples:
            >>> import jax.numpy as jnp, numpy as np, jax_adaptive as ja
            >>> evaluator = ja.Evaluator(lambda w, x: x @ w, max_batch_size=2, plan_cache=False)
            >>> evaluator.predict(jnp.ones(2), np.arange(10.0, dtype=np.float32).reshape(5, 2))
            array([ 1.,  5.,  9., 13., 17.], dtype=float32)
        """
        pieces, _ = self._run("predict", params, dataset, resident)
        return jax.tree.map(lambda *xs: np.concatenate(xs), *pieces)

    def _run(self, mode: _Mode, params: Any, dataset: Any, resident: Any) -> tuple[Any, int]:
        from tqdm.auto import tqdm

        examples = ExampleQueue(dataset)
        reach = self.max_batch_size or STREAM_MAX_BATCH_SIZE
        if not examples.fill(reach):
            raise ValueError("the dataset has no examples.")
        hi = reach if not examples.exhausted else examples.buffered
        if self.max_batch_size is not None:
            hi = min(hi, self.max_batch_size)
        where = _batch_sharding(params, self.sizing.device)
        params = jax.tree.map(
            lambda x: x if isinstance(x, jax.Array) else jax.device_put(x, where), params
        )
        self._bind(mode, params, examples.first, resident, hi)
        size = self._take(self._plan(hi), examples)
        sums: dict[str, np.ndarray] = {}
        pieces: list[Any] = []
        count = 0
        total = examples.buffered if examples.exhausted else None
        with tqdm(total=total, disable=not self.progress, unit="example", leave=False) as bar:
            while (piece := examples.take(size)) is not None:
                self._program.start()
                out, error = catch_oom(lambda p=piece, s=size: self._execute(s, params, p))
                if error is not None:
                    largest = self._program.shrink(error, size, reason=mode)
                    size = self._take(self._planned(hi, largest), examples)
                    continue
                self._program.ran(size)
                real = int(piece.mask.sum())
                examples.advance(real)
                count += real
                if mode == "evaluate":
                    for name, value in out.items():
                        sums[name] = sums.get(name, 0) + _host_sum(value)
                else:  # the mask marks a prefix: the padding is the tail
                    pieces.append(jax.tree.map(lambda x, n=real: np.asarray(x)[:n], out))
                bar.set_postfix(batch=size)
                bar.update(real)
        return (sums if mode == "evaluate" else pieces), count

    def _execute(self, size: int, params: Any, piece: MicroBatch) -> Any:
        """Runs one batch and brings its outputs to the host; an out-of-memory raises here."""
        compiled = self._program.executable(size).compiled
        self._program.check(size)
        if self.fault_hook is not None:
            self.fault_hook.before_execution(size, ())
        out = compiled(params, piece.batch, piece.mask)
        # A failed run raises when waited for; reading its buffers first may abort XLA:CPU.
        jax.block_until_ready(out)
        return jax.device_get(out)

    def _bind(self, mode: _Mode, params: Any, batch: Any, resident: Any, hi: int) -> None:
        """Binds the engine to this mode's program for these shapes (kept per shapes)."""
        structs = jax.tree.map(_struct, params), example_structs(batch)
        leaves = {id(x): x for x in jax.tree.leaves((params, resident))}  # each array once
        resident_bytes = tree_bytes(list(leaves.values()))
        signature = (mode, jax.tree.structure(structs), tuple(jax.tree.leaves(structs)))
        signature += (resident_bytes,)
        self._mode = mode
        self._program = self.sizing.bind(
            signature, lambda: self._sized(mode, *structs, resident_bytes)
        )
        self._hi, self._resident_bytes = hi, resident_bytes

    def _sized(self, mode: _Mode, params: Any, example: Any, resident_bytes: int) -> Sized:
        """What the engine needs of the ``mode`` program for these shapes."""
        sharding = _batch_sharding(params, self.sizing.device)

        def structs(size: int) -> tuple[Any, Any, jax.ShapeDtypeStruct]:
            batch = jax.tree.map(
                # A float64 host array runs as float32 unless x64 is on: count what the
                # device holds.
                lambda x: jax.ShapeDtypeStruct(
                    (size, *x.shape), jax.dtypes.canonicalize_dtype(x.dtype), sharding=sharding
                ),
                example,
            )
            return params, batch, jax.ShapeDtypeStruct((size,), jnp.bool_, sharding=sharding)

        def function(params: Any, batch: Any, mask: jax.Array) -> Any:
            return self._function(mode, params, batch, mask)

        return Sized(
            lower=lambda size: jax.jit(function).lower(*structs(size)),
            resident=resident_bytes,
            inputs=lambda size: tree_bytes(structs(size)[1:]),
            key=lambda: {
                "kind": mode,
                "multiple_of": self.multiple_of,
                "max_batch_size": self._hi,
                "resident_bytes": resident_bytes,
                "example": str(example),
            },
        )

    def _function(self, mode: _Mode, params: Any, batch: Any, mask: jax.Array) -> Any:
        size = mask.shape[0]
        with jax.named_scope(f"{mode}_batch_{size}"):
            out = self.metric_fn(params, batch)
        if mode == "evaluate" and not isinstance(out, Mapping):
            raise TypeError(
                f"metric_fn must return a dict of per-example metrics, got {type(out).__name__}."
            )
        if mode == "evaluate" and "examples" in out:
            raise ValueError("metric_fn returned a metric named 'examples', a name reserved.")
        for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
            if np.shape(leaf)[:1] != (size,):
                raise ValueError(
                    f"metric_fn's output{jax.tree_util.keystr(path)} must be per-example, with "
                    f"a leading axis of {size} for a batch of {size}; got shape {np.shape(leaf)}."
                )
        if mode == "predict":
            return out
        return {name: _masked(value, mask) for name, value in out.items()}

    def ledger(self, size: int) -> Ledger:
        """Everything live while a batch of ``size`` of the last run's program runs, by part.

        The resident arrays; the batch, its mask and the outputs; temporaries and code.

        Examples:
            >>> import jax.numpy as jnp, numpy as np, jax_adaptive as ja
            >>> evaluator = ja.Evaluator(lambda w, x: {"y": x @ w}, plan_cache=False)
            >>> _ = evaluator.evaluate(jnp.ones(256), np.ones((8, 256), np.float32))
            >>> ledger = evaluator.ledger(8)
            >>> ledger.state, ledger.in_flight >= 8 * 256 * 4  # the params; the batch
            (1024, True)
        """
        if self.batch_size is None:
            raise RuntimeError("run evaluate or predict on a dataset first.")
        return self._program.ledger(size)

    def _plan(self, hi: int) -> int:
        """The largest size in ``[1, hi]`` that fits: known, from the plan cache, or searched."""
        plans, limit = self._program.plans, self.memory_limit
        if (hi, limit) in plans:
            return plans[hi, limit]
        self.sizing.measure_others(self._resident_bytes)
        largest = self._program.cached(hi, self._mode)
        if largest is None:
            largest = self._program.largest_fitting(
                hi=hi, reason=self._mode, multiple_of=self.multiple_of
            )
        return self._planned(hi, largest)

    def _planned(self, hi: int, largest: int) -> int:
        """Keeps ``largest`` as the plan under ``hi`` and the limit, here and in the plan cache."""
        self._program.plans[hi, self.memory_limit] = self.largest = largest
        self._program.store(largest)
        return largest

    def _take(self, largest: int, examples: ExampleQueue) -> int:
        """The size to run (the fewest batches, the least padding, once the rest is known)."""
        size = largest
        if examples.exhausted:
            size = least_padding_size(examples.buffered, largest, self.multiple_of)
        self._program.use(size)
        self.batch_size = size
        return size


class TrainerEvaluations:
    """A trainer's evaluators, one per metric function, sized beside its train state.

    Each shares the trainer's device, limit (followed when it changes), headroom and
    plan cache; its sizes and out-of-memory shrinking are its own. With model state,
    ``metric_fn(params, model_state, batch)``. With several ``processes`` each evaluates
    its own examples on its own device, and the means are over all of them.
    """

    def __init__(
        self,
        *,
        has_state: bool,
        device: jax.Device,
        mesh: Any,
        limit: Callable[[], int | None],
        headroom: float,
        plan_cache: PlanCache | None,
        processes: int = 1,
    ):
        self.has_state, self.device, self.mesh = has_state, device, mesh
        self.processes = processes
        self._limit, self._headroom, self._plan_cache = limit, headroom, plan_cache
        self._evaluators: dict[Callable[..., Any], Evaluator] = {}

    def evaluator(self, metric_fn: Callable[..., Any]) -> Evaluator:
        """The evaluator kept for ``metric_fn`` (made on first use)."""
        evaluator = self._evaluators.get(metric_fn)
        if evaluator is None:
            evaluator = self._evaluators[metric_fn] = Evaluator(
                # ``(params, model_state, batch)`` as ``((params, model_state), batch)``
                (lambda v, batch: metric_fn(v[0], v[1], batch)) if self.has_state else metric_fn,
                memory_limit=self._limit(),
                headroom=self._headroom,
                plan_cache=False if self._plan_cache is None else self._plan_cache,
                device=self.device,
            )
        evaluator.memory_limit = self._limit()
        return evaluator

    def evaluate(
        self, state: Any, data: Any, metric_fn: Callable[..., Any], predict: bool = False
    ) -> Any:
        """``metric_fn``'s means over ``data`` (or its outputs), the state counted as live."""
        evaluator = self.evaluator(metric_fn)
        params = (state.params, state.model_state) if self.has_state else state.params
        if self.mesh is not None:  # evaluated on this process's device
            params = local_copy(params, self.device)
        if predict:
            return evaluator.predict(params, data, resident=state)
        means = evaluator.evaluate(params, data, resident=state)
        return means if self.processes == 1 else process_means(means)

    def after_update(
        self, every: int | None, data: Any, metric_fn: Callable[..., Any] | None, last: int | None
    ) -> Callable[[int, Any, dict[str, Any]], dict[str, Any]] | None:
        """``fit``'s evaluation after an update: ``eval_<name>`` metrics when one is due."""
        if every is None:
            if data is not None or metric_fn is not None:
                raise ValueError("eval_data and metric_fn need eval_every (updates between).")
            return None
        checks.positive_int("eval_every", every)
        if data is None or not callable(metric_fn):
            raise ValueError("eval_every needs eval_data and a callable metric_fn.")

        def after(update: int, state: Any, _: dict[str, Any]) -> dict[str, Any]:
            if update % every and update != last:
                return {}
            metrics = self.evaluate(state, data() if callable(data) else data, metric_fn)
            return {f"eval_{name}": value for name, value in metrics.items()}

        return after
