"""Variable input shapes: shape buckets, a plan per bucket, token budgets (docs/buckets.md)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
import optax

from jax_adaptive.checks import check_buckets
from jax_adaptive.distributed import first_ready_everywhere, process_sum
from jax_adaptive.loop import fit_loop
from jax_adaptive.memory import MemoryModel, predict_line
from jax_adaptive.plan import SizeTrial
from jax_adaptive.read_ahead import Unread
from jax_adaptive.sizing import Sizing
from jax_adaptive.step import Params, TrainState
from jax_adaptive.streams import Feed, Left
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = [
    "Bucket",
    "BucketBatch",
    "BucketedTrainer",
    "bucket_batches",
    "bucket_for",
    "pad_to_bucket",
    "pow2_buckets",
]

Weighting = Literal["token", "example", "none"]


def pow2_buckets(max_length: int, min_length: int = 16) -> tuple[int, ...]:
    """The default bucket policy: powers of two from ``min_length`` up, then ``max_length``.

    Examples:
        >>> pow2_buckets(100)
        (16, 32, 64, 100)
    """
    if min_length < 1 or max_length < min_length:
        raise ValueError(f"need 1 <= {min_length=} <= {max_length=}.")
    low, high = (min_length - 1).bit_length(), (max_length - 1).bit_length()
    return (*(1 << k for k in range(low, high)), max_length)


Bucket = int | tuple[int, ...]
"""A bucket: a length (sequences), or a shape of the leading axes (``(H, W)`` images)."""


def _dims(bucket: Bucket) -> tuple[int, ...]:
    return (int(bucket),) if isinstance(bucket, int | np.integer) else tuple(map(int, bucket))


def _volume(bucket: Bucket) -> int:
    return int(np.prod(_dims(bucket)))


def _key(bucket: Bucket) -> Bucket:
    """A bucket as a dict key: an int for one axis, a tuple of ints for several."""
    dims = _dims(bucket)
    return dims[0] if len(dims) == 1 and not isinstance(bucket, tuple) else dims


def bucket_for(shape: Bucket, buckets: Sequence[Bucket]) -> Bucket:
    """The smallest bucket (fewest positions) that holds ``shape`` in every axis.

    Raises:
        ValueError: when no bucket holds it.

    Examples:
        >>> bucket_for(33, (16, 32, 64))
        64
        >>> bucket_for((20, 40), [(32, 32), (64, 64), (32, 64)])
        (32, 64)
    """
    dims = _dims(shape)
    holding = [b for b in buckets if len(_dims(b)) == len(dims)]
    holding = [b for b in holding if all(d <= c for d, c in zip(dims, _dims(b), strict=True))]
    if not holding:
        what = f"length {dims[0]}" if len(dims) == 1 else f"shape {dims}"
        raise ValueError(
            f"an example of {what} does not fit any bucket of {list(buckets)}: add a bucket "
            "or truncate the examples."
        )
    return min(holding, key=_volume)


def _shape(example: Mapping[str, Any], axes: int) -> tuple[int, ...]:
    shapes = {tuple(np.shape(v)[:axes]) for v in example.values() if np.ndim(v) >= axes}
    if len(shapes) != 1:
        raise ValueError(f"an example's fields disagree in their variable axes: {sorted(shapes)}.")
    return shapes.pop()


def pad_to_bucket(
    examples: Sequence[Mapping[str, Any]], bucket: Bucket, mask_key: str = "mask"
) -> dict[str, np.ndarray]:
    """Stacks examples (dicts of arrays) into ``[n, *bucket, ...]`` arrays, zero-padded.

    The bucket's axes are each field's leading ones; ``mask_key`` (``[n, *bucket]``) marks
    the real positions. Fields of fewer dimensions (a label) are stacked as they are.

    Examples:
        >>> batch = pad_to_bucket([{"tokens": np.arange(3)}, {"tokens": np.arange(1)}], 4)
        >>> batch["tokens"].tolist(), batch["mask"].sum(axis=1).tolist()
        ([[0, 1, 2, 0], [0, 0, 0, 0]], [3, 1])
    """
    if not examples:
        raise ValueError("pad_to_bucket needs at least one example.")
    dims = _dims(bucket)
    shapes = [_shape(e, len(dims)) for e in examples]
    for shape in shapes:
        bucket_for(shape, [bucket])  # raises when an example does not fit the bucket
    out = {}
    for key, first in examples[0].items():
        first = np.asarray(first)
        if first.ndim < len(dims):
            out[key] = np.stack([np.asarray(e[key]) for e in examples])
            continue
        field = np.zeros((len(examples), *dims, *first.shape[len(dims) :]), first.dtype)
        for row, (example, shape) in enumerate(zip(examples, shapes, strict=True)):
            field[(row, *map(slice, shape))] = example[key]
        out[key] = field
    mask = np.zeros((len(examples), *dims), bool)
    for row, shape in enumerate(shapes):
        mask[(row, *map(slice, shape))] = True
    out[mask_key] = mask
    return out


class BucketBatch(NamedTuple):
    """One update's examples, all of one bucket, padded to it."""

    bucket: Bucket
    batch: dict[str, np.ndarray]


class _Waiting:
    """Examples read and not yet emitted: in ``buckets``, or read ahead and handed back."""

    def __init__(self) -> None:
        self.buckets: dict[Bucket, list[Mapping[str, Any]]] = {}
        self.unread = Unread([])

    def __bool__(self) -> bool:
        """Whether anything waits: in a bucket, or handed back."""
        return bool(self.buckets or self.unread)


# What each source iterator has had read and not yet emitted, so that a later
# bucket_batches of it (a second ``fit``) starts from it.
_LEFT: Left[_Waiting] = Left(_Waiting)


def bucket_batches(
    examples: Iterable[Mapping[str, Any]],
    sizes: Mapping[Bucket, int],
    mask_key: str = "mask",
    *,
    read_ahead: int = 0,
    across_processes: bool = False,
) -> Iterator[BucketBatch]:
    """Groups a stream of examples (dicts of ``[len, ...]`` arrays) into padded batches.

    A bucket's batch is emitted once it holds ``sizes[bucket]`` examples, in order;
    ``read_ahead`` examples may be read in a background thread. What waits in the buckets,
    or was read ahead, stays with an iterator's stream when the generator is closed, for
    its next reader; a list is read afresh (docs/buckets.md). ``across_processes``: each
    ``jax.distributed`` process reads its own stream, and a bucket's batch is emitted on
    every process at once, once it is full on all (every process must iterate); all end
    when no bucket is full on all and none can fill another.

    Examples:
        >>> stream = [{"t": np.ones(n)} for n in (3, 9, 4, 2, 12)]
        >>> [(b.bucket, len(b.batch["t"])) for b in bucket_batches(stream, {4: 2, 16: 2})]
        [(4, 2), (16, 2)]
        >>> it = iter(stream)
        >>> next(bucket_batches(it, {4: 2, 16: 2})).bucket  # 9 waits in bucket 16
        4
        >>> [len(b.batch["t"]) for b in bucket_batches(it, {16: 3})]  # 9 waited; 2, 12
        [3]
    """
    iterator, left, keep = _LEFT.reader(examples)
    feed = Feed(iterator, left, read_ahead)
    return _bucketed(feed, left, keep, sizes, mask_key, across_processes)


def _bucketed(
    feed: Feed,
    left: _Waiting,
    keep: Callable[[], None],
    sizes: Mapping[Bucket, int],
    mask_key: str,
    across: bool,
) -> Iterator[BucketBatch]:
    """`bucket_batches`' generator: what waits in ``left`` first, then ``feed``'s examples."""
    axes, buckets, waiting = len(_dims(next(iter(sizes)))), list(sizes), left.buckets
    # An earlier reader's buckets that this one lacks: bucketed again (all placed first,
    # so an example longer than every bucket raises with nothing moved).
    old = [b for b in waiting if b not in sizes]
    moved = [(bucket_for(_shape(x, axes), buckets), x) for b in old for x in waiting[b]]
    for bucket in old:
        del waiting[bucket]
    for bucket, example in moved:
        waiting.setdefault(bucket, []).append(example)

    def take(bucket: Bucket) -> BucketBatch:
        """The bucket's next batch, out of ``waiting`` before it is yielded."""
        batch, rest = waiting[bucket][: sizes[bucket]], waiting[bucket][sizes[bucket] :]
        if rest:
            waiting[bucket] = rest
        else:
            del waiting[bucket]
        keep()
        return BucketBatch(bucket, pad_to_bucket(batch, bucket, mask_key))

    def add(example: Mapping[str, Any]) -> Bucket:
        bucket = bucket_for(_shape(example, axes), buckets)
        waiting.setdefault(bucket, []).append(example)
        keep()
        return bucket

    def full() -> list[bool]:
        return [len(waiting.get(b, ())) >= sizes[b] for b in buckets]

    try:
        exhausted, end = False, object()
        while across:  # a round: the first bucket full on all, else each reads on
            ready = full()
            stuck = exhausted or all(ready)  # reading on cannot fill another bucket
            index, all_stuck = first_ready_everywhere(ready, stuck)
            if index is not None:
                yield take(buckets[index])
                continue
            if all_stuck:
                return
            while not stuck and full() == ready:  # until one of its buckets fills
                example = next(feed, end)
                exhausted = stuck = example is end
                if not exhausted:
                    add(example)
        for bucket in list(waiting):
            while len(waiting.get(bucket, ())) >= sizes[bucket]:
                yield take(bucket)
        for example in feed:
            bucket = add(example)
            if len(waiting[bucket]) == sizes[bucket]:
                yield take(bucket)
    finally:  # what was read ahead and not bucketed stays with the stream
        feed.close()
        keep()


class BucketedTrainer:
    """Trains on inputs of varying shape: one plan per shape bucket, exact updates.

    The guide, docs/buckets.md, explains the arguments. ``loss_fn(params, batch, rng)``
    returns ``[m]``, each example's loss summed over its real positions
    (`jax_adaptive.models.gpt_token_loss`), of a batch of padded fields
    ``[m, *bucket, ...]`` and ``mask_key``. ``buckets`` are lengths (`pow2_buckets`) or
    shapes; give ``target_tokens`` (padded positions per update) or ``target_batch_size``.
    ``weighting``: ``"token"``, ``"example"`` or ``"none"``. The other keyword arguments
    go to each bucket's `AdaptiveTrainer`, which all share one sizing engine. Under
    ``jax.distributed`` each process passes its own sequences, its share of each update's
    (`processes`; ``global_batches=True``: every process the same ones).

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
        >>> def loss_fn(params, batch, rng):  # summed over each sequence's real tokens
        ...     return jnp.sum(batch["mask"] * (batch["x"] - params) ** 2, axis=1)
        >>> trainer = ja.BucketedTrainer(loss_fn, optax.sgd(0.1), buckets=(4, 8),
        ...                              target_tokens=16)
        >>> sequences = [{"x": np.ones(n, np.float32)} for n in (3, 7, 2, 4, 6, 1)]
        >>> state = trainer.init(jnp.zeros(()), sequences[0])
        >>> state, history = trainer.fit(state, sequences)
        >>> [(h["bucket"], h["examples"], h["tokens"]) for h in history]
        [(8, 2, 13), (4, 4, 10)]
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        buckets: Sequence[Bucket],
        target_tokens: int | None = None,
        target_batch_size: int | None = None,
        weighting: Weighting = "token",
        count_tokens: Callable[[Mapping[str, Any]], np.ndarray] | None = None,
        mask_key: str = "mask",
        predict: bool = True,
        **trainer_kwargs: Any,
    ):
        if (target_tokens is None) == (target_batch_size is None):
            raise ValueError("give exactly one of target_tokens and target_batch_size.")
        buckets = tuple(sorted({_key(b) for b in check_buckets(buckets)}, key=_volume))
        if not buckets or min(min(_dims(b)) for b in buckets) < 1:
            raise ValueError(f"buckets must be positive lengths or shapes, got {buckets}.")
        if len({len(_dims(b)) for b in buckets}) != 1:
            raise ValueError(f"the buckets {buckets} must all have the same number of axes.")
        if target_tokens is not None and target_tokens < _volume(buckets[-1]):
            raise ValueError(
                f"{target_tokens=} is less than the largest bucket {buckets[-1]}: an update "
                "must hold at least one example of every bucket."
            )
        if weighting not in ("token", "example", "none"):
            raise ValueError(f"{weighting=} must be 'token', 'example' or 'none'.")
        if "has_aux" in trainer_kwargs or "has_state" in trainer_kwargs:
            raise ValueError("BucketedTrainer takes a plain per-sequence loss (no aux, no state).")
        if trainer_kwargs.get("background_search"):
            raise ValueError(
                "BucketedTrainer plans each bucket at its first batch, all on one sizing "
                "engine: background_search=True is for one AdaptiveTrainer."
            )
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.buckets, self.weighting, self.mask_key = buckets, weighting, mask_key
        self.target_tokens, self.target_batch_size = target_tokens, target_batch_size
        self.count_tokens = count_tokens or (
            lambda b: np.asarray(b[mask_key]).reshape(len(b[mask_key]), -1).sum(axis=1)
        )
        self.predict, self.trainer_kwargs = predict, trainer_kwargs
        self.axes = len(_dims(buckets[0]))
        self.trainers: dict[Bucket, AdaptiveTrainer] = {}
        self.processes = 1  # the processes that each pass their share (decided at init)
        self.sizing: Sizing | None = None  # the buckets' one engine, once the first is made
        self.bucket_log: list[dict[str, Any]] = []  # one entry per bucket, in first use
        self._points: dict[tuple[int, int], int] = {}  # (positions, size) -> estimated bytes

    def examples_per_update(self, bucket: Bucket) -> int:
        """Examples in an update of ``bucket`` (``target_tokens // L`` in bucket ``L``)."""
        if self.target_batch_size is not None:
            return self.target_batch_size
        return self.target_tokens // _volume(bucket)

    def init(
        self, params: Params, example: Mapping[str, Any], *, rng: jax.Array | None = None
    ) -> TrainState:
        """Builds the train state from one example (a dict of ``[len, ...]`` arrays).

        The example's bucket is planned here, the others on their first use in `step`.
        """
        self._example = {k: np.asarray(v) for k, v in example.items()}
        bucket = bucket_for(_shape(self._example, self.axes), self.buckets)
        trainer = self._new_trainer(bucket)
        return self._planned(bucket, trainer, lambda e: trainer.init(params, e, rng=rng))

    def step(self, state: TrainState, batch: BucketBatch) -> tuple[TrainState, dict[str, Any]]:
        """Runs one exact update on one bucket's padded batch (`bucket_batches` makes them).

        Returns ``(state, metrics)``: the trainer's metrics (``loss`` the mean per real token,
        or per sequence with ``weighting="example"``), ``bucket``, ``tokens``, ``padded_tokens``.
        """
        if not self.trainers:
            raise RuntimeError("call trainer.init(params, example) first.")
        bucket, padded = batch
        bucket = _key(bucket)
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not one of the buckets {self.buckets}.")
        trainer = self.trainers.get(bucket)
        if trainer is None:  # the bucket's first use: plan it for the state as it is
            trainer = self._new_trainer(bucket)
            self._planned(bucket, trainer, lambda e: trainer.plan(state, e))
        counts = np.asarray(self.count_tokens(padded))
        n, total = len(counts), int(counts.sum())
        if self.processes > 1:  # a token weighs the same on every process
            total = process_sum(total)
        if total <= 0:
            raise ValueError("the batch has no real tokens.")
        if self.weighting == "token":
            weight = np.full(n, n * self.processes / total, np.float32)
        elif self.weighting == "none":
            weight = np.ones(n, np.float32)
        else:
            weight = (1.0 / np.maximum(counts, 1)).astype(np.float32)
        state, metrics = trainer.step(state, padded, weights=weight)
        padding = int(np.size(padded[self.mask_key])) * self.processes
        return state, {**metrics, "bucket": bucket, "tokens": total, "padded_tokens": padding}

    def fit(
        self,
        state: TrainState,
        sequences: Iterable[Mapping[str, Any]],
        num_updates: int | None = None,
        *,
        on_update: Callable[[int, dict[str, Any]], None] | None = None,
        read_ahead: int = 0,
    ) -> tuple[TrainState, list[dict[str, Any]]]:
        """Trains on a stream of sequences bucketed by `bucket_batches`.

        The arguments, result and errors are `jax_adaptive.AdaptiveTrainer.fit`'s
        (``read_ahead`` counts sequences); the sequences read and not trained on stay with
        the stream's iterator.
        """
        P = self.processes
        sizes = {bucket: self.examples_per_update(bucket) // P for bucket in self.buckets}
        batches = bucket_batches(
            sequences, sizes, self.mask_key, read_ahead=read_ahead, across_processes=P > 1
        )
        with contextlib.closing(batches):  # what was read ahead goes back to the stream
            return fit_loop(self.step, state, batches, num_updates, on_update=on_update)

    def set_memory_limit(self, memory_limit: int | None) -> None:
        """Changes every bucket's cap (see `AdaptiveTrainer.set_memory_limit`)."""
        self.trainer_kwargs["memory_limit"] = memory_limit
        if self.sizing is not None:  # the buckets' one engine
            self.sizing.set_memory_limit(memory_limit)

    @property
    def search_log(self) -> list[SizeTrial]:
        """Every size decided, for every bucket: see `jax_adaptive.SizeTrial`."""
        return [] if self.sizing is None else self.sizing.search_log

    def _new_trainer(self, bucket: Bucket) -> AdaptiveTrainer:
        """A bucket's trainer, its search seeded by `jax_adaptive.memory.predict_line`."""
        size, prior = self.examples_per_update(bucket), None
        if self.predict and self.trainers:  # the line the buckets seen predict
            capacity = next(iter(self.trainers.values())).capacity()
            if capacity is not None:
                prior = predict_line(self._points, _volume(bucket), capacity)
        trainer = AdaptiveTrainer(
            self.loss_fn,
            self.optimizer,
            target_batch_size=size,
            memory_prior=prior,
            sizing=self.sizing,  # one engine: one device, limit, plan cache and search log
            **self.trainer_kwargs,
        )
        self.sizing, self.processes = trainer.sizing, trainer.placement.processes
        for bucket in self.buckets:  # each update's examples divide over the processes
            trainer.placement.share(self.examples_per_update(bucket))
        return trainer

    def _planned(
        self, bucket: Bucket, trainer: AdaptiveTrainer, plan: Callable[[dict[str, Any]], Any]
    ) -> Any:
        """Runs ``plan(example_batch)`` for the bucket's new trainer and logs its plan."""
        dims = _dims(bucket)
        example = {
            k: np.zeros(
                (1, *dims, *v.shape[self.axes :]) if v.ndim >= self.axes else (1, *v.shape), v.dtype
            )
            for k, v in self._example.items()
        }
        example[self.mask_key] = np.ones((1, *dims), bool)
        start, compiles, tried = time.perf_counter(), trainer.compiles, len(trainer.search_log)
        out = plan(example)
        for s, nbytes in trainer.memory_model.points.items():
            self._points[(_volume(bucket), s)] = nbytes
        prior, capacity = trainer.memory_model.prior, trainer.capacity()
        predicted = None
        if prior is not None and capacity is not None:
            predicted = MemoryModel(prior=prior).largest_within(capacity)
        self.trainers[bucket] = trainer
        self.bucket_log.append(
            {
                "bucket": bucket,
                "examples_per_update": trainer.target_batch_size,
                "micro_batch_size": trainer.micro_batch_size,
                "accumulation_steps": trainer.accumulation_steps,
                "compiles": trainer.compiles - compiles,
                "sizes_tried": [trial.size for trial in trainer.search_log[tried:]],
                "seconds": time.perf_counter() - start,
                "predicted_micro_batch_size": predicted,
            }
        )
        return out
