"""The command line's data: random-access sources (synthetic, TFDS) and a resumable stream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from jax_adaptive.cli.extras import import_extra
from jax_adaptive.data import synthetic_images

__all__ = [
    "HELD_OUT_EXAMPLES", "ShuffledBatches", "Source", "SyntheticSource", "load_held_out",
    "load_source", "shard_rows",
]  # fmt: skip

HELD_OUT_EXAMPLES = 1024
"""The examples of the synthetic held-out set: new noise and labels, the same class patterns."""


class Source(Protocol):
    """Random access to examples: ``len(source)`` and ``source[i]`` (a dict of arrays)."""

    num_classes: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...


class SyntheticSource:
    """The images of `jax_adaptive.data.synthetic_images` as a source.

    Examples:
        >>> source = SyntheticSource(100)
        >>> len(source), source[3]["image"].shape
        (100, (16, 16, 3))
    """

    num_classes = 10

    def __init__(self, num_examples: int, *, seed: int = 0):
        self._data = synthetic_images(num_examples, seed=seed)

    def __len__(self) -> int:
        return len(self._data["label"])

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {k: v[index] for k, v in self._data.items()}


class _Images:
    """A TFDS image source, its images scaled to float32 in [0, 1]."""

    def __init__(self, source: Any):
        self._source = source
        self.num_classes = int(source.dataset_info.features["label"].num_classes)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self._source[int(index)]
        return {
            "image": np.asarray(record["image"], np.float32) / 255.0,
            "label": np.asarray(record["label"], np.int32),
        }


def load_source(
    dataset: str, *, data_dir: str | None = None, split: str = "train", seed: int = 0
) -> Source:
    """Opens ``"synthetic"`` (``"synthetic:N"``: N examples) or ``"tfds:NAME"``.

    What cannot be read is one line with the fix.

    Examples:
        >>> len(load_source("synthetic")), len(load_source("synthetic:96"))
        (8192, 96)
    """
    if dataset == "synthetic" or dataset.startswith("synthetic:"):
        count = dataset.partition(":")[2] or "8192"
        if not count.isdigit() or not int(count):
            raise ValueError(f"--dataset {dataset!r}: synthetic:N takes a positive count N.")
        return SyntheticSource(int(count), seed=seed)
    if not dataset.startswith("tfds:") or not dataset[5:]:
        raise ValueError(
            f"unknown dataset {dataset!r}; use 'synthetic', 'synthetic:N' or 'tfds:NAME'."
        )
    tfds = import_extra("tensorflow_datasets", "tfds", f"--dataset {dataset}")
    name = dataset[5:]
    try:
        source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as exc:  # TFDS raises several types for "not there"
        raise ValueError(
            f"cannot read TFDS dataset {name!r} (split {split!r}) from "
            f"{data_dir or 'the default TFDS data dir'}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}. Prepare it as array_record on a machine with "
            f"network: `tfds build {name} --file_format=array_record --data_dir DIR`, then "
            "pass --data-dir DIR."
        ) from exc
    return _Images(source)


def load_held_out(
    dataset: str, *, data_dir: str | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Every held-out example as one batch: ``tfds:NAME``'s test split, or new synthetic ones.

    Examples:
        >>> held_out, train = load_held_out("synthetic"), load_source("synthetic")
        >>> held_out["image"].shape, bool((held_out["image"][0] != train[0]["image"]).any())
        ((1024, 16, 16, 3), True)
    """
    if dataset.partition(":")[0] == "synthetic":
        source: Source = SyntheticSource(HELD_OUT_EXAMPLES, seed=2**63 + seed)
    else:
        try:
            source = load_source(dataset, data_dir=data_dir, split="test")
        except ValueError as exc:
            raise ValueError(f"{exc} Or pass --eval-every 0: no held-out evaluation.") from exc
    if not len(source):
        raise ValueError("the held-out split has no examples.")
    return _stack([source[i] for i in range(len(source))])


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Examples (dicts of arrays) as one batch: each field stacked on a leading axis."""
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def shard_rows(n: int, shard: tuple[int, int]) -> slice:
    """The rows of ``n`` that process ``index`` of ``count`` reads: ``shard=(index, count)``.

    Examples:
        >>> [shard_rows(10, (i, 3)) for i in range(3)]
        [slice(0, 3, None), slice(3, 6, None), slice(6, 10, None)]
    """
    index, count = shard
    return slice(n * index // count, n * (index + 1) // count)


class ShuffledBatches:
    """Batches in the permutation of ``(seed, epoch)``; ``position`` counts examples drawn.

    With ``shard=(index, count)`` (a process of ``jax.distributed`` and how many there are)
    it reads only the ``index``-th of ``count`` equal slices of each batch: together the
    processes read every example of an epoch once, and the batches one process reads.

    Examples:
        >>> batches = ShuffledBatches(SyntheticSource(10), 4, seed=1, start=8)
        >>> batch = next(batches)
        >>> batch["label"].shape, batches.position
        ((4,), 12)
        >>> halves = [ShuffledBatches(SyntheticSource(10), 4, shard=(i, 2)) for i in (0, 1)]
        >>> [next(half)["label"].shape for half in halves], halves[1].position
        ([(2,), (2,)], 4)
    """

    def __init__(
        self,
        source: Source,
        batch_size: int,
        *,
        seed: int = 0,
        start: int = 0,
        shard: tuple[int, int] = (0, 1),
    ):
        if len(source) == 0:
            raise ValueError("the dataset has no examples.")
        if batch_size <= 0 or start < 0:
            raise ValueError(f"{batch_size=} must be positive and {start=} non-negative.")
        self.source, self.batch_size, self.seed, self.position = source, batch_size, seed, start
        self.shard = shard
        self._order: tuple[int, np.ndarray] | None = None  # the current epoch's

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        n, rows = len(self.source), []
        own = shard_rows(self.batch_size, self.shard)
        for i in range(self.position + own.start, self.position + own.stop):
            if self._order is None or self._order[0] != i // n:
                order = np.random.default_rng([self.seed, i // n]).permutation(n)
                self._order = (i // n, order)
            rows.append(self.source[int(self._order[1][i % n])])
        self.position += self.batch_size
        return _stack(rows)
