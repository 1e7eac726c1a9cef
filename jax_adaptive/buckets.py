"""Variable input shapes: shape buckets, a plan per bucket, token budgets.

A sequence is padded to the smallest bucket that holds it (with a mask), so a run
compiles one micro-step per bucket and micro-batch size, not one per length. Each update
takes the sequences of one bucket (as ``tf.data``'s ``bucket_by_sequence_length`` does),
and `BucketedTrainer` keeps one `AdaptiveTrainer` per bucket, sharing one train state:
each bucket's plan (micro-batch size, compiled executable) is searched on the bucket's
first use and stored in the plan cache.

* **Token budgets.** With ``target_tokens``, an update of bucket ``L`` holds
  ``target_tokens // L`` sequences: a budget of padded tokens, which is what memory
  sees (as fairseq's ``--max-tokens``). Micro-batches hold as many sequences of ``L``
  as fit.
* **Exact weighting.** The loss gives each sequence's summed token loss; a weight per
  sequence, set on the host from the update's real token count ``N``, makes the
  accumulated gradient ``sum over real tokens / N`` (``weighting="token"``, the default
  for language models) or the mean over sequences of their per-token means
  (``"example"``), whatever the micro-batch sizes and the padding.
* **Cheap new buckets.** The peak of a micro-step of ``m`` sequences of length ``L`` is
  close to ``a + b L + m (c L + d L^2)`` (activations grow with ``m L``, attention with
  ``m L^2``). Fitted to the estimates compiled for the buckets seen, it predicts a new
  bucket's line; seeded with it, the search checks the prediction and its neighbour:
  two compiles when it is right.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
import optax

from jax_adaptive.memory import MemoryModel
from jax_adaptive.step import Params, TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = [
    "BucketBatch",
    "BucketedTrainer",
    "bucket_batches",
    "bucket_for",
    "pad_to_bucket",
    "pow2_buckets",
    "predict_line",
]

Weighting = Literal["token", "example"]
_WEIGHT = "_jax_adaptive_weight"  # the per-sequence weight the trainer adds to a batch


def pow2_buckets(max_length: int, min_length: int = 16) -> tuple[int, ...]:
    """The default bucket policy: powers of two from ``min_length`` up, then ``max_length``.

    Example:
        >>> pow2_buckets(100)
        (16, 32, 64, 100)
    """
    if min_length < 1 or max_length < min_length:
        raise ValueError(f"need 1 <= {min_length=} <= {max_length=}.")
    sizes = []
    size = 1 << (min_length - 1).bit_length()
    while size < max_length:
        sizes.append(size)
        size *= 2
    return (*sizes, max_length)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length``.

    Raises:
        ValueError: when the length exceeds the largest bucket.

    Example:
        >>> bucket_for(33, (16, 32, 64))
        64
    """
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise ValueError(
        f"a sequence of length {length} is longer than the largest bucket {max(buckets)}: "
        "add a bucket or truncate the sequences."
    )


def _length(sequence: Mapping[str, Any]) -> int:
    lengths = {np.shape(v)[0] for v in sequence.values()}
    if len(lengths) != 1:
        raise ValueError(f"a sequence's fields disagree in length: {sorted(lengths)}.")
    return lengths.pop()


def pad_to_bucket(
    sequences: Sequence[Mapping[str, Any]], length: int, mask_key: str = "mask"
) -> dict[str, np.ndarray]:
    """Stacks sequences (dicts of ``[len_i, ...]`` arrays) into ``[n, length, ...]`` arrays.

    Each field is padded with zeros at the end; ``mask_key`` marks the real positions.

    Example:
        >>> batch = pad_to_bucket([{"tokens": np.arange(3)}, {"tokens": np.arange(1)}], 4)
        >>> batch["tokens"].tolist(), batch["mask"].sum(axis=1).tolist()
        ([[0, 1, 2, 0], [0, 0, 0, 0]], [3, 1])
    """
    if not sequences:
        raise ValueError("pad_to_bucket needs at least one sequence.")
    lengths = [_length(s) for s in sequences]
    if max(lengths) > length:
        raise ValueError(f"a sequence of length {max(lengths)} does not fit the bucket {length}.")
    out = {}
    for key, first in sequences[0].items():
        first = np.asarray(first)
        field = np.zeros((len(sequences), length, *first.shape[1:]), first.dtype)
        for row, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
            field[row, :n] = seq[key]
        out[key] = field
    mask = np.zeros((len(sequences), length), bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    out[mask_key] = mask
    return out


class BucketBatch(NamedTuple):
    """One update's sequences, all of one bucket, padded to it."""

    length: int
    batch: dict[str, np.ndarray]


def bucket_batches(
    sequences: Iterable[Mapping[str, Any]],
    sizes: Mapping[int, int],
    mask_key: str = "mask",
) -> Iterator[BucketBatch]:
    """Groups a stream of sequences into padded batches of one bucket each.

    A bucket's batch is emitted as soon as it holds ``sizes[bucket]`` sequences, so the
    stream's order is kept within a bucket and no sequence is dropped or seen twice;
    what is left in the buckets when the stream ends is not emitted.

    Args:
        sequences: dicts of ``[len, ...]`` arrays.
        sizes: sequences per batch, for each bucket length.
        mask_key: the mask's name in the batches.

    Example:
        >>> stream = [{"t": np.ones(n)} for n in (3, 9, 4, 2, 12)]
        >>> [(b.length, len(b.batch["t"])) for b in bucket_batches(stream, {4: 2, 16: 2})]
        [(4, 2), (16, 2)]
    """
    pending: dict[int, list[Mapping[str, Any]]] = {length: [] for length in sizes}
    for sequence in sequences:
        length = bucket_for(_length(sequence), sizes)
        pending[length].append(sequence)
        if len(pending[length]) == sizes[length]:
            yield BucketBatch(length, pad_to_bucket(pending[length], length, mask_key))
            pending[length] = []


def _default_counts(batch: Mapping[str, Any], mask_key: str = "mask") -> np.ndarray:
    return np.asarray(batch[mask_key]).sum(axis=1)


class BucketedTrainer:
    """Trains on sequences of varying length: one plan per shape bucket, exact updates.

    Args:
        loss_fn: ``(params, batch, rng) -> [m]``, each sequence's loss summed over its
            real tokens (`jax_adaptive.models.gpt_token_loss` is one); the batch holds
            the padded fields ``[m, L, ...]`` and ``mask_key``.
        optimizer: any ``optax.GradientTransformation``.
        buckets: the bucket lengths (`pow2_buckets` gives the default policy).
        target_tokens: padded tokens per update: an update of bucket ``L`` takes
            ``target_tokens // L`` sequences. Give this or ``target_batch_size``.
        target_batch_size: sequences per update, whatever the bucket.
        weighting: ``"token"`` (each real token weighs the same: the update's gradient is
            the sum of token losses over its real token count) or ``"example"`` (each
            sequence weighs the same: the mean of per-token means).
        count_tokens: ``batch -> [n]`` real tokens per sequence, as the loss counts them
            (``mask.sum(axis=1)`` by default; for next-token prediction,
            ``mask[:, 1:].sum(axis=1)``).
        mask_key: the mask's name in batches.
        predict: seed a new bucket's search with the line the buckets seen predict.
        **trainer_kwargs: passed to each bucket's `AdaptiveTrainer` (``memory_limit``,
            ``plan_cache``, ``multiple_of``, ``device``, ``mesh``...).

    Example:
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
        buckets: Sequence[int],
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
        buckets = tuple(sorted({int(b) for b in buckets}))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be positive lengths, got {buckets}.")
        if target_tokens is not None and target_tokens < buckets[-1]:
            raise ValueError(
                f"{target_tokens=} is less than the largest bucket {buckets[-1]}: an update "
                "must hold at least one sequence of every bucket."
            )
        if weighting not in ("token", "example"):
            raise ValueError(f"{weighting=} must be 'token' or 'example'.")
        if "has_aux" in trainer_kwargs or "has_state" in trainer_kwargs:
            raise ValueError("BucketedTrainer takes a plain per-sequence loss (no aux, no state).")
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.buckets, self.weighting, self.mask_key = buckets, weighting, mask_key
        self.target_tokens, self.target_batch_size = target_tokens, target_batch_size
        self.count_tokens = count_tokens or (lambda b: _default_counts(b, mask_key))
        self.predict = predict
        self.trainer_kwargs = trainer_kwargs
        self.trainers: dict[int, AdaptiveTrainer] = {}
        self.bucket_log: list[dict[str, Any]] = []  # one entry per bucket, in first use
        self._points: dict[tuple[int, int], int] = {}  # (length, size) -> estimated bytes
        self._params: Params | None = None

    def examples_per_update(self, length: int) -> int:
        """Sequences in an update of bucket ``length``.

        Example:
            >>> import optax, jax_adaptive as ja
            >>> ja.BucketedTrainer(lambda p, b, r: b["x"].sum(1), optax.sgd(1.0),
            ...     buckets=(64, 128), target_tokens=4096).examples_per_update(128)
            32
        """
        if self.target_batch_size is not None:
            return self.target_batch_size
        return self.target_tokens // length

    def init(
        self, params: Params, example: Mapping[str, Any], *, rng: jax.Array | None = None
    ) -> TrainState:
        """Builds the train state from one example sequence (a dict of ``[len, ...]``).

        The example's bucket is planned here, the others on their first use in `step`.
        """
        self._example = {k: np.asarray(v) for k, v in example.items()}
        self._params, self._rng = params, rng
        return self._trainer(bucket_for(_length(self._example), self.buckets))[1]

    def step(self, state: TrainState, batch: BucketBatch) -> tuple[TrainState, dict[str, Any]]:
        """Runs one exact update on one bucket's padded batch (`bucket_batches` makes them).

        Returns:
            ``(state, metrics)``: the trainer's metrics (``loss`` is the mean per real
            token, or per sequence with ``weighting="example"``) with ``bucket``,
            ``tokens`` (real) and ``padded_tokens``.
        """
        if self._params is None:
            raise RuntimeError("call trainer.init(params, example) first.")
        length, padded = batch
        if length not in self.buckets:
            raise ValueError(f"{length} is not one of the buckets {self.buckets}.")
        trainer, _ = self._trainer(length)
        counts = np.asarray(self.count_tokens(padded))
        n = len(counts)
        total = int(counts.sum())
        if total <= 0:
            raise ValueError("the batch has no real tokens.")
        if self.weighting == "token":
            weight = np.full(n, n / total, np.float32)
        else:
            weight = (1.0 / np.maximum(counts, 1)).astype(np.float32)
        state, metrics = trainer.step(state, {**padded, _WEIGHT: weight})
        padding = int(np.size(padded[self.mask_key]))
        return state, {**metrics, "bucket": length, "tokens": total, "padded_tokens": padding}

    def fit(
        self,
        state: TrainState,
        sequences: Iterable[Mapping[str, Any]],
        num_updates: int | None = None,
        *,
        on_update: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> tuple[TrainState, list[dict[str, Any]]]:
        """Trains on a stream of sequences, bucketed by `bucket_batches`.

        Returns:
            The state and one metrics dict (host values) per update.
        """
        sizes = {length: self.examples_per_update(length) for length in self.buckets}
        history: list[dict[str, Any]] = []
        for batch in bucket_batches(sequences, sizes, self.mask_key):
            state, metrics = self.step(state, batch)
            history.append(jax.device_get(metrics))
            if on_update is not None:
                on_update(len(history), history[-1])
            if num_updates is not None and len(history) == num_updates:
                break
        return state, history

    def set_memory_limit(self, memory_limit: int | None) -> None:
        """Changes every bucket's cap (see `AdaptiveTrainer.set_memory_limit`)."""
        self.trainer_kwargs["memory_limit"] = memory_limit
        for trainer in self.trainers.values():
            trainer.set_memory_limit(memory_limit)

    # ----------------------------------------------------------------- internals

    def _weighted_loss(self, params, batch, rng):
        batch = dict(batch)
        weight = batch.pop(_WEIGHT)
        return self.loss_fn(params, batch, rng) * weight

    def _trainer(self, length: int) -> tuple[AdaptiveTrainer, TrainState]:
        """The bucket's trainer, planning it on first use; and the state it built."""
        if length in self.trainers:
            return self.trainers[length], None
        size = self.examples_per_update(length)
        trainer = AdaptiveTrainer(
            self._weighted_loss, self.optimizer, target_batch_size=size, **self.trainer_kwargs
        )
        example = {
            k: np.zeros((1, length, *v.shape[1:]), v.dtype) for k, v in self._example.items()
        }
        example[self.mask_key] = np.ones((1, length), bool)
        example[_WEIGHT] = np.ones(1, np.float32)
        prior = self._predicted_line(length) if self.predict else None
        trainer.memory_model = MemoryModel(prior=prior)
        start, compiles = time.perf_counter(), trainer.compiles
        state = trainer.init(self._params, example, rng=self._rng)
        for s, nbytes in trainer.memory_model.points.items():
            self._points[(length, s)] = nbytes
        capacity = trainer.capacity()
        predicted = None
        if prior is not None and capacity is not None:
            predicted = MemoryModel(prior=prior).largest_within(capacity)
        self.trainers[length] = trainer
        self.bucket_log.append(
            {
                "length": length,
                "examples_per_update": size,
                "micro_batch_size": trainer.micro_batch_size,
                "accumulation_steps": trainer.accumulation_steps,
                "compiles": trainer.compiles - compiles,
                "seconds": time.perf_counter() - start,
                "predicted_micro_batch_size": predicted,
            }
        )
        return trainer, state

    def _predicted_line(self, length: int) -> tuple[float, float] | None:
        capacity = next(iter(self.trainers.values())).capacity() if self.trainers else None
        if capacity is None:
            return None
        return predict_line(self._points, length, capacity)


def predict_line(
    points: Mapping[tuple[int, int], int], length: int, capacity: int
) -> tuple[float, float] | None:
    """A new bucket's predicted ``(intercept, slope)`` of peak bytes against micro-batch size.

    Least squares over the estimates compiled for the buckets seen, those near the
    capacity (XLA's peak is least linear at tiny sizes), of ``a + m L`` from one bucket
    (its line scaled by the length) and of ``a + b L + m (c L + d L^2)`` from two on.

    Args:
        points: ``{(length, size): estimated bytes}`` of the buckets seen.
        length: the new bucket.
        capacity: the bytes a micro-step may use.

    Returns:
        The line, or None without points or when the fit does not grow with the size.

    Example:
        >>> peak = lambda L, m: 1_000 + 10 * L + m * (3 * L + L * L)
        >>> seen = {(L, m): peak(L, m) for L in (16, 32) for m in (2, 5, 9)}
        >>> [round(x) for x in predict_line(seen, 64, capacity=1)]  # a + bL, cL + dL^2
        [1640, 4288]
    """
    if not points:
        return None
    lengths = {L for L, _ in points}
    near = [k for k, v in points.items() if v >= capacity / 4]
    keys = near if {L for L, _ in near} == lengths else list(points)
    one_bucket = len(lengths) == 1

    def features(L: int, m: int) -> list[float]:
        return [1.0, m * L] if one_bucket else [1.0, L, m * L, m * L * L]

    a = np.array([features(L, m) for L, m in keys], np.float64)
    b = np.array([points[k] for k in keys], np.float64)
    scale = np.abs(a).max(axis=0)
    coeffs = np.linalg.lstsq(a / scale, b, rcond=None)[0] / scale
    intercept = float(np.dot(features(length, 0), coeffs))
    slope = float(np.dot(features(length, 1), coeffs)) - intercept
    return (intercept, slope) if slope > 0 else None
