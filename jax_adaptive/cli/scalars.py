"""``--tensorboard``: each update's scalars as TensorBoard event files, as Flax's examples write.

Flax's examples write through ``clu.metric_writers`` (``train_loss``, ``train_accuracy``,
``train_learning_rate``, ``steps_per_second``, ``eval_loss``, ``eval_accuracy``); we write
the same tags, and the plan's (``micro_batch_size``, ``accumulation_steps``), through
tensorboardX, which writes event files without TensorFlow (the ``tensorboard`` extra).
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

from jax_adaptive.cli.extras import import_extra

__all__ = ["ScalarWriter", "scalars"]

_RUNS = itertools.count()

_SAME = ("train_accuracy", "micro_batch_size", "accumulation_steps", "eval_loss", "eval_accuracy")
_RATES = {"examples_per_s": "examples_per_second", "tokens_per_s": "tokens_per_second"}


def scalars(line: dict[str, Any], learning_rate: float) -> dict[str, float]:
    """The TensorBoard scalars of one update's metrics line (``metrics.jsonl``'s).

    Examples:
        >>> line = {"update": 3, "loss": 0.5, "train_accuracy": 0.75, "micro_batch_size": 64,
        ...         "accumulation_steps": 4, "examples": 256, "seconds": 0.25,
        ...         "examples_per_s": 1024.0, "eval_loss": 0.6}
        >>> scalars(line, learning_rate=3e-3)  # doctest: +NORMALIZE_WHITESPACE
        {'train_loss': 0.5, 'train_learning_rate': 0.003, 'train_accuracy': 0.75,
         'micro_batch_size': 64.0, 'accumulation_steps': 4.0, 'eval_loss': 0.6,
         'examples_per_update': 256.0, 'steps_per_second': 4.0, 'examples_per_second': 1024.0}
    """
    out = {"train_loss": float(line["loss"]), "train_learning_rate": float(learning_rate)}
    out |= {key: float(line[key]) for key in _SAME if key in line}
    if "examples" in line:  # a batch schedule's target batch; --model gpt: its sequences
        out["examples_per_update"] = float(line["examples"])
    if line.get("seconds"):
        out["steps_per_second"] = 1.0 / line["seconds"]
    out |= {tag: float(line[key]) for key, tag in _RATES.items() if key in line}
    return out


class ScalarWriter:
    """Writes `scalars` at each update to TensorBoard event files in ``directory``.

    ``tensorboard --logdir DIRECTORY`` shows them. A run resumed after update ``start``
    purges what an earlier run wrote from update ``start + 1`` on (it trains those again),
    so each update has one value. Each run writes its own file, named with its process id
    and a count of this process's runs: a run and its resume in the same second keep
    apart, in two processes or in one (``train`` called twice: with the id alone, the
    resume's file replaced the run's, and TensorBoard read back update 3 alone).

    Args:
        directory: where the event files go (the workdir).
        learning_rate: the run's (``train_learning_rate``).
        start: the updates done before this run (0: a new run).

    Raises:
        ValueError: tensorboardX is not installed (one line: which extra to install).

    Examples:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> with ScalarWriter(directory, learning_rate=0.1) as writer:
        ...     writer.write({"update": 1, "loss": 2.0})
        >>> [p.name.startswith("events.out.tfevents.") for p in Path(directory).iterdir()]
        [True]
    """

    def __init__(self, directory: str | os.PathLike[str], learning_rate: float, start: int = 0):
        tensorboardx = import_extra("tensorboardX", "tensorboard", "--tensorboard")
        self.learning_rate = learning_rate
        self._writer = tensorboardx.SummaryWriter(
            str(Path(directory)), purge_step=start + 1 if start else None,
            filename_suffix=f".{os.getpid()}.{next(_RUNS)}",
        )  # fmt: skip

    def write(self, line: dict[str, Any]) -> None:
        """Writes one update's scalars at its step, the update number, and flushes them."""
        for tag, value in scalars(line, self.learning_rate).items():
            if math.isfinite(value) or tag == "train_loss":  # a NaN loss shows as one
                self._writer.add_scalar(tag, value, line["update"])
        self._writer.flush()  # a run killed after this update keeps its scalars

    def close(self) -> None:
        """Flushes and closes the event file."""
        self._writer.close()

    def __enter__(self) -> ScalarWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
