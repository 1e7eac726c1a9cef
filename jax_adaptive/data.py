"""Data: cutting batches into micro-batches, rebatching streams, synthetic sources.

Host batches are cut as views, so a target batch never has to fit on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_adaptive.errors import HostOutOfMemory
from jax_adaptive.read_ahead import Unread, interrupts_deferred
from jax_adaptive.streams import Feed, Left

__all__ = [
    "ExampleQueue",
    "MicroBatch",
    "Rebatcher",
    "example_structs",
    "leading_size",
    "micro_batches",
    "synthetic_images",
    "synthetic_sequences",
]


class MicroBatch(NamedTuple):
    """A micro-batch of exactly ``m`` rows, of which ``mask`` marks the real ones."""

    batch: Any
    mask: np.ndarray
    offset: int


def leading_size(batch: Any, name: str = "batch") -> int:
    """Returns the leading size all leaves of ``batch`` share.

    Raises:
        ValueError: if the batch has no leaves, a leaf is a scalar, or leaves disagree.

    Examples:
        >>> leading_size({"x": np.zeros((8, 3)), "y": np.zeros(8)})
        8
    """
    shapes = [np.shape(leaf) for leaf in jax.tree.leaves(batch)]
    if not shapes:
        raise ValueError(f"{name} has no arrays in it.")
    if all(shapes) and len({shape[0] for shape in shapes}) == 1:
        return shapes[0][0]
    paths = [
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(batch)[0]
    ]
    for path, shape in zip(paths, shapes, strict=True):
        if not shape:
            raise ValueError(f"{name}{path} is a scalar; every leaf needs a leading batch axis.")
    sizes = {path: shape[0] for path, shape in zip(paths, shapes, strict=True)}
    raise ValueError(f"the leaves of {name} disagree in leading size: {sizes}.")


def example_structs(example_batch: Any) -> Any:
    """The shape and dtype of one example of each leaf of a batch.

    Examples:
        >>> example_structs({"x": np.zeros((8, 3), np.float32)})["x"]
        ShapeDtypeStruct(shape=(3,), dtype=float32)
    """

    def one(x: Any) -> jax.ShapeDtypeStruct:
        dtype = x.dtype if isinstance(x, jax.Array) else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(np.shape(x)[1:], dtype)

    return jax.tree.map(one, example_batch)


@functools.partial(jax.jit, static_argnums=2)
def _slice(leaves: list[jax.Array], start: Any, m: int) -> list[jax.Array]:
    return [jax.lax.dynamic_slice_in_dim(x, start, m) for x in leaves]


@jax.jit
def _take(leaves: list[jax.Array], idx: jax.Array) -> list[jax.Array]:
    return [jnp.take(x, idx, axis=0) for x in leaves]


def _host_rows(leaf: Any, start: int, idx: np.ndarray | None, m: int) -> np.ndarray:
    leaf = np.asarray(leaf)
    if idx is None:
        return leaf[start : start + m]  # a view: nothing allocated
    try:
        return leaf[idx]
    except MemoryError:
        raise HostOutOfMemory(leaf[:1].nbytes * m) from None


def _cut(batch: Any, start: int, idx: np.ndarray | None, m: int) -> Any:
    """Rows ``start`` to ``start + m`` (``idx``: padded); jax leaves in one dispatch."""
    leaves, treedef = jax.tree.flatten(batch)
    device = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    if len(device) < len(leaves):
        leaves = [x if isinstance(x, jax.Array) else _host_rows(x, start, idx, m) for x in leaves]
    if device and (idx is not None or start or m != leaves[device[0]].shape[0]):
        arrays = [leaves[i] for i in device]
        if idx is None:
            arrays = _slice(arrays, np.int32(start), m)
        else:
            arrays = _take(arrays, idx.astype(np.int32))
        for i, x in zip(device, arrays, strict=True):
            leaves[i] = x
    return treedef.unflatten(leaves)


def _joined(batches: list[Any]) -> Any:
    """The batches' leaves concatenated on the host, in order."""
    return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


def micro_batches(batch: Any, size: int, start: int = 0) -> Iterator[MicroBatch]:
    """Cuts ``batch`` (NumPy or jax arrays) from row ``start`` into ``size``-row `MicroBatch`es.

    The last is padded with repeats of its real rows (never zeros, which could make a
    loss infinite: a masked infinity still poisons the gradient with NaN) and masked.

    Examples:
        >>> [(mb.batch.tolist(), mb.mask.tolist()) for mb in micro_batches(np.arange(5), 2)]
        [([0, 1], [True, True]), ([2, 3], [True, True]), ([4, 4], [True, False])]
    """
    total = leading_size(batch)
    for offset in range(start, total, size):
        real = min(size, total - offset)
        idx = offset + np.arange(size) % real if real < size else None
        yield MicroBatch(_cut(batch, offset, idx, size), np.arange(size) < real, offset)


class ExampleQueue:
    """A dataset's examples, taken ``n`` at a time in order, the last batch padded.

    Batches of the stream are read only as far as needed and joined only where a taken
    batch crosses their boundary. Taking does not consume: `advance` does, once the
    batch has run, so a batch that failed is taken again at another size. A dict, tuple
    or array is one batch of all the examples; a list or any other iterable, a stream.

    Examples:
        >>> queue = ExampleQueue([np.arange(3), np.arange(3, 5)])
        >>> piece = queue.take(4)
        >>> piece.batch.tolist(), piece.mask.tolist()
        ([0, 1, 2, 3], [True, True, True, True])
        >>> queue.advance(4)
        >>> queue.take(4).mask.tolist()  # the last example, padded
        [True, False, False, False]
    """

    def __init__(self, dataset: Any):
        one = isinstance(dataset, Mapping | tuple | np.ndarray | jax.Array)
        self._batches: Iterator[Any] = iter(() if one else dataset)
        self._pending: list[Any] = [dataset] if one else []
        self.exhausted = one
        self.buffered = leading_size(dataset, "the dataset") if one else 0
        self._structure = jax.tree.structure(dataset) if one else None
        self._start = 0  # rows of the first pending batch already evaluated

    @property
    def first(self) -> Any:
        """The first pending batch (its leaves give an example's shape)."""
        return self._pending[0]

    def fill(self, n: int) -> int:
        """Reads the stream until ``n`` examples are pending or it ends; returns how many are."""
        while self.buffered < n and not self.exhausted:
            try:
                batch = next(self._batches)
            except StopIteration:
                self.exhausted = True
                break
            structure = jax.tree.structure(batch)
            if self._structure is None:
                self._structure = structure
            elif structure != self._structure:
                raise ValueError(
                    f"a batch of the dataset has structure {structure}, the ones before it "
                    f"{self._structure}."
                )
            size = leading_size(batch, "a batch of the dataset")
            if size:
                self._pending.append(batch)
                self.buffered += size
        return self.buffered

    def take(self, n: int) -> MicroBatch | None:
        """The next ``n`` examples (padded and masked at the end), or None when none are left."""
        if not self.fill(n):
            return None
        if leading_size(self.first) - self._start < n and len(self._pending) > 1:
            rest = [jax.tree.map(lambda x: np.asarray(x)[self._start :], self.first)]
            joined = _joined([*rest, *self._pending[1:]])
            self._pending, self._start = [joined], 0
        return next(micro_batches(self.first, n, start=self._start))

    def advance(self, count: int) -> None:
        """Marks the ``count`` examples taken last as evaluated."""
        self._start += count
        self.buffered -= count
        if self._start == leading_size(self.first):
            self._pending.pop(0)
            self._start = 0


class _Pending:
    """Examples read from a stream and not yet taken, kept with the stream's iterator."""

    def __init__(self) -> None:
        self.batches: list[Any] = []  # read in: ``count`` examples
        self.count = self.read = 0  # ``read``: examples read from the stream
        self.lent: Any = None  # yielded and not yet `Rebatcher.taken`
        self.unread = Unread([])  # read ahead and handed back
        self.spec: Any = None  # the stream's structure and per-example shapes

    def __bool__(self) -> bool:
        """Whether anything waits: examples read in or lent, batches or an error handed back."""
        return bool(self.count or self.lent is not None or self.unread)

    def give_back(self) -> int:
        """Puts a batch lent and not taken back in front; returns its examples (0: none)."""
        if self.lent is None:
            return 0
        size = leading_size(self.lent)
        self.batches.insert(0, self.lent)
        self.count, self.lent = self.count + size, None
        return size


# What each source iterator has had read past the last batch yielded from it, so that a
# later Rebatcher of the same iterator (a second ``fit`` on it) yields it first.
_LEFT: Left[_Pending] = Left(_Pending)


class Rebatcher:
    """Turns a stream of batches of any leading size into batches of exactly ``size``.

    Nothing is reordered, skipped or repeated (guide: docs/own-loop.md). What was read
    past the last batch belongs to the stream's iterator: a later Rebatcher of the same
    iterator (``iter(x) is x``) yields it first; a list is read afresh by each. A batch
    whose structure or per-example shapes differ from the stream's first is refused
    once, naming its position, and skipped.

    Args:
        batches: an iterable of pytrees of host arrays, any leading size (0 included).
        size: the leading size of each batch yielded; it may be set again between
            batches (a batch-size schedule).
        read_ahead: how many of the stream's batches a background thread may read
            before they are needed (0: none); `close` (or a ``with`` block's end) stops it.
        lend: a batch yielded stays with the stream until `taken` (a training loop calls
            it once the update is kept), so a Ctrl-C leaves every example not trained on
            with the stream.

    Attributes:
        consumed: examples this Rebatcher yielded (the stream position, for resuming).

    Examples:
        >>> stream = [{"id": np.arange(0, 3)}, {"id": np.arange(3, 8)}, {"id": np.arange(8, 9)}]
        >>> rebatched = Rebatcher(stream, 4)
        >>> [b["id"].tolist() for b in rebatched], rebatched.leftover, rebatched.consumed
        ([[0, 1, 2, 3], [4, 5, 6, 7]], 1, 8)
        >>> chunks = iter([np.arange(0, 5), np.arange(5, 10)])
        >>> next(Rebatcher(chunks, 4)).tolist(), next(Rebatcher(chunks, 4)).tolist()
        ([0, 1, 2, 3], [4, 5, 6, 7])
        >>> chunks = iter([np.arange(0, 3), np.arange(3, 6), np.arange(6, 9)])
        >>> with Rebatcher(chunks, 2, read_ahead=2) as ahead:  # read in a thread
        ...     first = next(ahead).tolist()
        >>> first, next(Rebatcher(chunks, 7)).tolist()  # what it read ahead was kept
        ([0, 1], [2, 3, 4, 5, 6, 7, 8])
    """

    def __init__(
        self, batches: Iterable[Any], size: int, *, read_ahead: int = 0, lend: bool = False
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{size=} must be a positive int.")
        # _hold, after each change: what waits stays with the caller's iterator.
        batches, self._pending, self._hold = _LEFT.reader(batches)
        self._feed = Feed(batches, self._pending, read_ahead)
        self.size, self.read_ahead, self.lend = size, read_ahead, lend
        self.consumed = 0

    @property
    def leftover(self) -> int:
        """Examples read from the stream but not yet yielded (handed back ones too)."""
        unread = self._pending.unread.items
        return self._pending.count + sum(leading_size(b, "a batch of the stream") for b in unread)

    def taken(self) -> None:
        """With ``lend``: the batch yielded last is trained on; it leaves the stream."""
        with interrupts_deferred():
            self._pending.lent = None
            self._hold()

    def __enter__(self) -> Rebatcher:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stops reading ahead; what was read and not yielded stays with the stream.

        So do a batch lent and not `taken` and a read in progress. Iterating reads ahead again.
        """
        with interrupts_deferred():
            self.consumed -= self._pending.give_back()
            self._feed.close()
            self._hold()

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        pending = self._pending
        self.consumed -= pending.give_back()  # lent and not taken: yielded again
        while pending.count < self.size:
            self._feed.wait()  # a Ctrl-C here leaves everything where it was
            with interrupts_deferred():  # an item leaves the feed only into `pending`
                try:
                    batch = next(self._feed)
                except StopIteration:
                    raise StopIteration from None
                finally:
                    self._hold()
                self._take_in(batch)
        with interrupts_deferred():  # the batch leaves `pending` only to be yielded (or lent)
            joined = pending.batches[0] if len(pending.batches) == 1 else _joined(pending.batches)
            out = jax.tree.map(lambda x: x[: self.size], joined)
            rest = jax.tree.map(lambda x: x[self.size :], joined)
            pending.count -= self.size
            pending.batches = [rest] if pending.count else []
            pending.lent = out if self.lend else None
            self.consumed += self.size
            self._hold()
        return out

    def _take_in(self, batch: Any) -> None:
        """Keeps a batch read from the stream, or refuses one unlike the stream's first."""
        pending = self._pending
        size = leading_size(batch, "a batch of the stream")
        leaves, treedef = jax.tree.flatten(batch)
        spec, at = (treedef, [np.shape(leaf)[1:] for leaf in leaves]), pending.read
        pending.read += size
        if pending.spec is None:
            pending.spec = spec
        kinds = ("structure", "per-example shapes")
        for what, got, before in zip(kinds, spec, pending.spec, strict=True):
            if got != before:
                raise ValueError(
                    f"the batch of the stream after example {at} has {what} {got}, the ones "
                    f"before it {before}; it is skipped."
                )
        pending.batches.append(jax.tree.map(np.asarray, batch))
        pending.count += size


def synthetic_images(
    num_examples: int,
    *,
    image_shape: tuple[int, int, int] = (16, 16, 3),
    num_classes: int = 10,
    seed: int = 0,
    pattern_seed: int = 0,
) -> dict[str, np.ndarray]:
    """Images with a learnable signal: each class adds its own fixed pattern to noise.

    ``{"image": float32[N, H, W, C], "label": int32[N]}``. ``seed`` draws the labels and
    noise (vary it for new examples), ``pattern_seed`` the patterns (keep it for the task).

    Examples:
        >>> data = synthetic_images(4, image_shape=(8, 8, 1))
        >>> data["image"].shape, data["label"].dtype
        ((4, 8, 8, 1), dtype('int32'))
    """
    patterns = np.random.default_rng(pattern_seed).normal(size=(num_classes, *image_shape))
    patterns = patterns.astype(np.float32)
    rng = np.random.default_rng([seed, pattern_seed])
    labels = rng.integers(0, num_classes, size=num_examples).astype(np.int32)
    noise = rng.normal(size=(num_examples, *image_shape)).astype(np.float32)
    return {"image": noise + patterns[labels], "label": labels}


def synthetic_sequences(
    num_sequences: int | None = None,
    *,
    vocab_size: int = 64,
    max_length: int = 256,
    median_length: float = 48.0,
    sigma: float = 0.8,
    min_length: int = 4,
    seed: int = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Token sequences of log-normal lengths with a learnable rule, as language data has.

    Yields ``num_sequences`` (None: endless) ``{"tokens": int32[length]}``, the lengths
    log-normal (median ``median_length``, log-sd ``sigma``) clipped to ``[min_length,
    max_length]``. Each counts up from a random start by its own step (1 to 7), modulo
    ``vocab_size``: after two tokens every next one is predictable, so a language model's
    loss falls from ``log(vocab_size)`` towards zero.

    Examples:
        >>> tokens = next(synthetic_sequences(seed=1))["tokens"]
        >>> steps = np.diff(tokens) % 64  # one step throughout: predictable
        >>> len(set(steps.tolist())), 4 <= len(tokens) <= 256
        (1, True)
    """
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= {min_length=} <= {max_length=}.")
    rng = np.random.default_rng(seed)
    count = 0
    while num_sequences is None or count < num_sequences:
        length = int(np.clip(rng.lognormal(np.log(median_length), sigma), min_length, max_length))
        start, step = rng.integers(0, vocab_size), rng.integers(1, 8)
        yield {"tokens": ((start + step * np.arange(length)) % vocab_size).astype(np.int32)}
        count += 1
