"""The command line: ``python -m jax_adaptive.train``.

A thin layer: parse the arguments into a `TrainConfig`, then call `train`, which tests
call too; the run itself (workdir, loop, ``plan.json``) is `jax_adaptive.cli.run`'s. The
default trains the small CNN on synthetic images with a learnable signal, on a CPU, in
well under a minute: on a simulated small device there (no ``--memory-limit``), so that
the plan searches the micro-batch and accumulates, with a held-out evaluation every 10
updates and at the end. ``--model package.module:factory`` trains a model of your own.
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import re
import sys
from pathlib import Path
from typing import Any, NoReturn, TextIO

import jax

from jax_adaptive.cli.config import (
    MODEL_NAMES,
    OBJECTIVES,
    OPTIMIZER_NAMES,
    TrainConfig,
    check_config,
)
from jax_adaptive.cli.images import train_images
from jax_adaptive.cli.language_model import train_gpt
from jax_adaptive.errors import (
    FitError,
    NothingFitsError,
    OptimizerStepOutOfMemory,
    StateLostError,
)
from jax_adaptive.plan_cache import enable_compilation_cache

__all__ = ["TrainConfig", "main", "parse_bytes", "train"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(text: str) -> int:
    """Parses a memory size: ``"8GiB"``, ``"512MB"``, ``"1.5GB"`` or a plain byte count.

    Examples:
        >>> parse_bytes("8GiB"), parse_bytes("512MB"), parse_bytes("1000")
        (8589934592, 512000000, 1000)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size; write e.g. 8GiB, 512MB or 1000000."
        )
    value = decimal.Decimal(match.group(1)) * _UNITS[match.group(2).lower()]  # exact
    if value < 1:
        raise ValueError(f"memory size {text!r} must be at least one byte.")
    if value != value.to_integral_value():
        raise ValueError(
            f"memory size {text!r} is {value} bytes, not a whole number; give a unit "
            "(e.g. 1.5GB) or whole bytes."
        )
    return int(value)


def train(config: TrainConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """Trains as configured: `jax_adaptive.cli.images.train_images`, or `train_gpt` for ``gpt``.

    Prints the plan (after the simulated device's line, on a CPU with no
    ``memory_limit``), each update, a line whenever the plan changes, each held-out
    evaluation (every ``eval_every`` updates and after the last) and a summary (every
    compile of the run, the steady speed apart from the updates that compiled). With
    ``workdir``, writes ``plan.json`` (the plans and every size tried),
    ``metrics.jsonl`` (one line per update) and orbax checkpoints (train state and data
    position) every ``checkpoint_every`` updates, at the end, and after the last update
    trained when the run stops on an error or a KeyboardInterrupt; ``resume`` goes on
    from the latest one.

    Returns:
        A summary: the plan, the search cost and the loss of each update.

    Raises:
        FitError: an error part-way, as its ``__cause__``, with the last good state.

    Examples:
        >>> import io
        >>> summary = train(TrainConfig(target_batch_size=8, updates=2, progress=False),
        ...                 out=io.StringIO())
        >>> summary["micro_batch_size"], len(summary["losses"])
        (8, 2)
    """
    check_config(config)
    if config.compilation_cache is not None:
        enable_compilation_cache(Path(config.compilation_cache).resolve())
    if config.model == "gpt":
        return train_gpt(config, out=out)
    return train_images(config, out=out)


def _micro_batch_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int, got {text!r}") from None


def _memory_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _UsageError(Exception):
    """A flag argparse could not read (its message names the flag)."""


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag as one line with exit status 2 (`main` prints it), no usage."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m jax_adaptive.train",
        description="Train with a fixed target batch size through the largest micro-batch "
        "that fits the device (or --memory-limit).",
    )
    _add_what_flags(parser)
    _add_how_flags(parser)
    _add_cache_flags(parser)
    return parser


def _add_what_flags(parser: argparse.ArgumentParser) -> None:
    """The model, the data, the batch sizes and the memory."""
    parser.add_argument(
        "--model",
        default="cnn",
        metavar="{" + ",".join(sorted(MODEL_NAMES)) + "} or package.module:factory",
        help="the zoo model to train (default: cnn; gpt trains on synthetic sequences of "
        "mixed lengths, bucketed, with --target-tokens), or your own: factory(num_classes) "
        "returns (model, loss), model a flax.linen Module from images [m, H, W, C] to logits "
        "[m, classes] (called with train= if its __call__ takes it; collections besides "
        "params, e.g. batch_stats, are updated in training) and loss(logits, labels) -> "
        "losses [m], one per example, no mean",
    )
    parser.add_argument(
        "--dataset",
        default="synthetic",
        help="'synthetic' (default: images with a learnable signal, nothing to download) "
        "or 'tfds:NAME', a TFDS image dataset prepared as array_record in --data-dir",
    )
    parser.add_argument("--data-dir", default=None, help="TFDS data dir for tfds:NAME")
    parser.add_argument(
        "--target-batch-size",
        type=int,
        default=256,
        help="examples per optimizer update (default: 256)",
    )
    parser.add_argument(
        "--batch-schedule",
        default=None,
        metavar="UPDATE:SIZE,...",
        help="grow the target batch during training (image models): e.g. 0:64,20:256 takes "
        "64 examples per update from update 0 and 256 from update 20 (updates strictly "
        "increasing from 0, sizes positive); overrides --target-batch-size. Each update is "
        "exact for its size; the micro-batch stays the largest that fits",
    )
    parser.add_argument(
        "--target-tokens",
        type=int,
        default=None,
        help="--model gpt: padded tokens per update (default 4096); an update of bucket L "
        "holds target-tokens // L sequences, its loss the mean over their real tokens",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=256,
        help="--model gpt: the longest sequence; buckets are powers of two up to it",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=_micro_batch_size,
        default="auto",
        help="'auto' to search the largest that fits, or a fixed int",
    )
    parser.add_argument(
        "--memory-limit",
        type=_memory_size,
        default=None,
        help="cap on a micro-step's memory, e.g. 8GiB or 512MB; on a CPU "
        "it simulates a device of that size",
    )
    parser.add_argument(
        "--no-simulated-device",
        dest="simulate_device",
        action="store_false",
        help="on a CPU with no --memory-limit, train without a cap (by default a small "
        "device is simulated, about a quarter of the target batch, so the plan searches and "
        "accumulates)",
    )
    parser.add_argument(
        "--multiple-of",
        type=int,
        default=None,
        help="search only micro-batches that are multiples of this (8 suits GPUs' tensor "
        "cores; with a BatchNorm zoo model, combined with its ghost batch)",
    )
    parser.add_argument(
        "--data-parallel",
        action="store_true",
        help=f"split each micro-batch over all {jax.device_count()} devices (one 'data' mesh "
        "axis); the searched size is then per device",
    )


def _add_how_flags(parser: argparse.ArgumentParser) -> None:
    """The optimizer, the run's length, its workdir and seed."""
    parser.add_argument(
        "--optimizer",
        default="adam",
        choices=sorted(OPTIMIZER_NAMES),
        help="the optax optimizer (default: adam)",
    )
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="its learning rate")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--updates", type=int, default=20, help="optimizer updates to run")
    length.add_argument(
        "--epochs", type=float, default=None, help="passes over the dataset instead of --updates"
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="write plan.json, metrics.jsonl (one line per update) and orbax checkpoints here",
    )
    parser.add_argument(
        "--resume", action="store_true", help="go on from the latest checkpoint in --workdir"
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=10,
        metavar="N",
        help="evaluate held-out loss and accuracy every N updates and after the last, at "
        "the largest evaluation batch that fits (the test split of tfds:NAME, 1024 new "
        "examples for synthetic); 0: no evaluation (default: 10)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        help="updates between checkpoints (and one at the end, or after the last update "
        "trained when an error or Ctrl-C stops the run)",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data, init and dropout")
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="go on when an update's loss is NaN or infinite (by default the run stops there "
        "with exit status 2, its last finite update checkpointed)",
    )


def _add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The objective of the plan and the caches."""
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="least_padding",
        help="'least_padding' (default): the fewest micro-steps the largest micro-batch that "
        "fits allows, with the least padding; 'max': the largest itself; 'throughput': the "
        "fastest update among the largest and the least-padded sizes (each timed briefly)",
    )
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--plan-cache",
        metavar="FILE",
        default=None,
        help="JSON file remembering the plan found, so a second run compiles no search "
        "candidates (default: ~/.cache/jax_adaptive/plans.json, or $JAX_ADAPTIVE_PLAN_CACHE)",
    )
    cache.add_argument(
        "--no-plan-cache",
        dest="plan_cache",
        action="store_false",
        help="search afresh and store nothing",
    )
    parser.add_argument(
        "--compilation-cache",
        metavar="DIR",
        default=None,
        help="turn on JAX's persistent compilation cache in DIR (second runs skip XLA compiles)",
    )


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# What a run can stop with that one line explains: a flag's or a refusal's ValueError, the
# library's own errors. Anything else (a TypeError in a model, an OSError, an XLA error)
# propagates with its traceback.
_ONE_LINE = (ValueError, NothingFitsError, OptimizerStepOutOfMemory, StateLostError)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 with a one-line error).

    Every bad flag gives one line on stderr (naming the flag and what it allows) and
    status 2, before any training starts; so do the library's own errors (nothing fits,
    an optimizer step out of memory after its retries). Ctrl-C stops with status 130
    after checkpointing the last update trained (with ``--workdir``). Any other error
    propagates with its traceback, the last update trained checkpointed first.

    Examples:
        >>> main(["--resume"])  # prints "error: --resume needs --workdir ..." to stderr
        2
        >>> main(["--updates", "0"])  # "error: --updates 0 must be a positive int."
        2
    """
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        print(f"error: {exc} (see --help)", file=sys.stderr)
        return 2
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    try:
        train(config)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:  # a user's model or loss ended the process: no run
        print(f"error: the run called sys.exit({exc.code!r}) before it ended", file=sys.stderr)
        return 2
    except FitError as exc:
        if not isinstance(exc.__cause__, _ONE_LINE):
            raise  # its traceback, and the cause's
        cause = exc.__cause__
        print(f"error: training stopped by {type(cause).__name__}: {_first_line(cause)}",
              file=sys.stderr)  # fmt: skip
        return 2
    except _ONE_LINE as exc:
        print(f"error: {_first_line(exc)}", file=sys.stderr)
        return 2
    return 0
