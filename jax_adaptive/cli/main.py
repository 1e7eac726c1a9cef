"""``python -m jax_adaptive.train``: `main` parses the flags into a `TrainConfig` for `train`.

Nothing here imports JAX, optax or the models before the flags are checked: ``--help`` and
a bad flag answer at once (tests/test_train_cli.py asserts JAX is not imported).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import decimal
import io
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn, TextIO

from jax_adaptive.cli.config import (
    GHOST_BATCH_SIZE,
    MODEL_NAMES,
    OBJECTIVES,
    OPTIMIZER_NAMES,
    TrainConfig,
    check_config,
)

__all__ = ["TrainConfig", "main", "parse_bytes", "train"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def _one_line() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """What a run can stop with that one line explains, and the `FitError` that wraps it.

    A flag's or a refusal's ValueError, and the library's own errors. Anything else (a
    TypeError in a model, an OSError, an XLA error) propagates with its traceback. The
    library's errors are only looked for once loaded: a bad flag stops before JAX starts.
    """
    errors = sys.modules.get("jax_adaptive.errors")
    if errors is None:
        return (ValueError,), ()
    library = (errors.NothingFitsError, errors.OptimizerStepOutOfMemory, errors.StateLostError)
    return (ValueError, *library), (errors.FitError,)


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
    """Trains as configured (``gpt``, or an image model) and prints what it does (docs/cli.md).

    With ``distributed``, the processes first meet (`jax_adaptive.cli.hosts.join`), then
    start ``jax.distributed`` with ``distributed_timeout`` as its initialization and
    heartbeat timeouts; while they train, a process that ends early ends every other one
    with one line (`jax_adaptive.cli.hosts.Peers`). Process 0 alone prints (lines,
    progress bar, the library's log), and what JAX's C++ libraries print on stdout
    (gloo's ``[Gloo] Rank ...``) goes to stderr.

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
    peers = None
    if (args := config.distributed_args()) and not _distributed_started():
        from jax_adaptive.cli.hosts import join  # before JAX: the timeout is all waiting

        peers = join(args["coordinator_address"], args["num_processes"], args["process_id"],
                     config.distributed_timeout)  # fmt: skip
    import jax  # here: a bad flag is refused before JAX starts

    from jax_adaptive.cli.images import train_images
    from jax_adaptive.cli.language_model import train_gpt
    from jax_adaptive.plan_cache import enable_compilation_cache

    if config.compilation_cache is not None:
        enable_compilation_cache(Path(config.compilation_cache).resolve())
    started = config.distributed is not None and not jax.distributed.is_initialized()
    with contextlib.ExitStack() as stack:
        if started:
            stack.enter_context(_stdout_of_libraries_to_stderr())
            _start_distributed(config)
        if jax.process_index():  # process 0 alone prints (and writes the workdir's lines)
            out, config = io.StringIO(), dataclasses.replace(config, progress=False)
            stack.enter_context(_quiet_log())
        summary = (train_gpt if config.model == "gpt" else train_images)(config, out=out)
        if started:  # a failed process leaves at once (`main`): its peers see it gone
            jax.distributed.shutdown()
        if peers is not None:
            peers.close()
        return summary


def _start_distributed(config: TrainConfig) -> None:
    """Starts ``jax.distributed`` (gloo for CPU collectives), the processes joined."""
    import jax

    args, timeout = config.distributed_args() or {}, config.distributed_timeout
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        **args, initialization_timeout=timeout, heartbeat_timeout_seconds=timeout
    )


@contextlib.contextmanager
def _stdout_of_libraries_to_stderr() -> Iterator[None]:
    """File descriptor 1 points at stderr; Python's ``sys.stdout`` keeps the real stdout.

    Gloo writes "[Gloo] Rank ... is connected to ..." lines straight to descriptor 1.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real, sys.stdout = sys.stdout, open(saved, "w", closefd=False)
    try:
        yield
    finally:
        ours, sys.stdout = sys.stdout, real
        ours.close()  # flushed; the descriptor is ``saved``, put back below
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def _quiet_log() -> Iterator[None]:
    """The library's log says only warnings (another process than 0 of a job)."""
    log = logging.getLogger("jax_adaptive")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def _micro_batch_size(text: str) -> int | str:
    try:
        return text if text == "auto" else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int, got {text!r}") from None


def _memory_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _UsageError(Exception):
    """A flag argparse could not read (its message names the flag)."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default, unless it says it in words (or is a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.nargs == 0 or "default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag as one line with exit status 2 (`main` prints it), no usage."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m jax_adaptive.train",
        description="Train with a fixed target batch size through the largest micro-batch "
        "that fits the device (or --memory-limit). Guide: docs/cli.md.",
        formatter_class=_HelpFormatter,
    )
    add = parser.add_argument
    # fmt: off
    add("--model", default="cnn",
        metavar="{" + ",".join(MODEL_NAMES) + "} or package.module:factory",
        help="a zoo model (default: cnn; gpt: synthetic sequences of mixed lengths, bucketed, "
        "with --target-tokens) or yours: factory(num_classes) returns (a flax.linen Module "
        "from images [m, H, W, C] to logits, loss(logits, labels) -> losses [m], no mean)")
    add("--dataset", default="synthetic",
        help="'synthetic' (default: images with a learnable signal) or 'tfds:NAME', a TFDS "
        "image dataset prepared as array_record in --data-dir")
    add("--data-dir", default=None,
        help="TFDS data dir for tfds:NAME (default: none, TFDS's own default)")
    add("--target-batch-size", type=int, default=256, help="examples per optimizer update")
    add("--batch-schedule", default=None, metavar="UPDATE:SIZE,...",
        help="grow the target batch (image models): 0:64,20:256 takes 64 examples per "
        "update from update 0, 256 from update 20; overrides --target-batch-size (default: "
        "none, a constant --target-batch-size)")
    add("--target-tokens", type=int, default=None,
        help="--model gpt: padded tokens per update (default 4096)")
    add("--max-length", type=int, default=256,
        help="--model gpt: the longest sequence; buckets are powers of two up to it")
    add("--micro-batch-size", type=_micro_batch_size, default="auto",
        help="'auto' to search the largest that fits, or a fixed int")
    add("--memory-limit", type=_memory_size, default=None,
        help="cap on a micro-step's memory, e.g. 8GiB or 512MB; on a CPU it simulates a "
        "device of that size (default: none, the device's own capacity; on a CPU see "
        "--no-simulated-device)")
    add("--no-simulated-device", dest="simulate_device", action="store_false",
        help="on a CPU with no --memory-limit, train without a cap (by default a device of "
        "about a quarter of the target batch is simulated, so that the plan accumulates)")
    add("--multiple-of", type=int, default=None,
        help="search only micro-batches that are multiples of this (with a BatchNorm zoo "
        "model, combined with its ghost batch) (default: none, any size)")
    add("--ghost-batch-size", type=int, default=None,
        help="a model with BatchNorm (the zoo's ResNets, yours): examples per BatchNorm "
        f"statistic, the same on any device (default: the largest divisor of {GHOST_BATCH_SIZE} "
        "dividing every target batch, at least 8; 0: per micro-batch, which depends on the "
        "device); every micro-batch holds whole ghost batches")
    add("--data-parallel", action="store_true",
        help="split each micro-batch over all devices (of every process with "
        "--distributed); the searched size is then per device")
    add("--distributed", nargs="?", const="auto", default=None, metavar="HOST:PORT,N,ID",
        help="run as one of N processes under jax.distributed (with --data-parallel), each "
        "reading only its share of every batch; alone, the cluster's environment (SLURM, "
        "Open MPI, ...) says the coordinator, N and this process's ID (default: none, one "
        "process)")
    add("--distributed-timeout", type=int, default=45, metavar="SECONDS",
        help="with --distributed: how long each process waits for the others to join, and "
        "for a silent one before it stops")
    add("--optimizer", default="adam", choices=OPTIMIZER_NAMES,
        help="the optax optimizer")
    add("--learning-rate", type=float, default=3e-3, help="its learning rate")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--updates", type=int, default=20, help="optimizer updates to run")
    length.add_argument("--epochs", type=float, default=None,
                        help="passes over the dataset instead of --updates (default: none, "
                        "--updates)")
    add("--workdir", default=None,
        help="write plan.json, metrics.jsonl (one line per update) and checkpoints here; one "
        "run holds it at a time (default: none, nothing written)")
    add("--resume", action="store_true",
        help="go on from the latest checkpoint in --workdir (of the same training)")
    add("--tensorboard", action="store_true",
        help="also write each update's scalars (train_loss, train_learning_rate, eval_loss, "
        "micro_batch_size, ...) as TensorBoard event files in --workdir (needs the "
        "tensorboard extra: pip install 'jax_adaptive[tensorboard]')")
    add("--eval-every", type=int, default=10, metavar="N",
        help="held-out loss and accuracy every N updates and after the last; 0: none")
    add("--checkpoint-every", type=int, default=10,
        help="updates between checkpoints (and one at the end, or after the last update "
        "trained when an error or Ctrl-C stops the run)")
    add("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add("--seed", type=int, default=0, help="seed of data, init and dropout")
    add("--allow-nonfinite", action="store_true",
        help="go on when an update's loss is NaN or infinite (by default the run stops "
        "there, exit status 2)")
    add("--objective", choices=OBJECTIVES, default="auto",
        help="least_padding: the fewest micro-steps the largest size that fits "
        "allows, with the least padding; max: the largest itself; throughput: the fastest "
        "of a few plans, timed; auto: throughput for a run of 1000 updates or more, else "
        "least_padding")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--plan-cache", metavar="FILE", default=None,
                       help="where plans are remembered (default: the workdir's plans.json, "
                       "else ~/.cache/jax_adaptive/plans.json or $JAX_ADAPTIVE_PLAN_CACHE)")
    cache.add_argument("--no-plan-cache", dest="plan_cache", action="store_false",
                       help="search afresh and store nothing")
    add("--background-search", action="store_true",
        help="train from the first update at a size known to fit (an eighth of the target "
        "batch, usually one compile) while the search for the largest goes on on a thread; "
        "its plan takes over once it ends (default: off, the search comes first)")
    add("--compilation-cache", metavar="DIR", default=None,
        help="JAX's persistent compilation cache in DIR (second runs skip XLA compiles; "
        "default: none, off)")
    # fmt: on
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status.

    0: the run trained. 2: one line on stderr (a bad flag, before training; a refusal;
    the library's own errors; a non-finite loss; a ``sys.exit`` during the run).
    130: Ctrl-C. Any other error propagates with its traceback (status 1). A run stopped
    part-way first checkpoints its last update trained (with ``--workdir``).

    Examples:
        >>> main(["--resume"])  # prints "error: --resume needs --workdir ..." to stderr
        2
    """
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        print(f"error: {exc} (see --help)", file=sys.stderr)
        return 2
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    try:
        status, line = _run(config)
    except BaseException:
        if not _distributed_started():
            raise
        traceback.print_exc()
        status, line = 1, None
    if status and _distributed_started():
        # A process of a jax.distributed job that stops leaves at once (JAX's exit handler
        # would wait at its shutdown barrier for peers that wait for this one); they see
        # it gone and leave too, one line each.
        from jax_adaptive.cli.hosts import leave

        leave(status, line)
    if line:
        print(line, file=sys.stderr)
    return status


def _distributed_started() -> bool:
    """Whether this process started ``jax.distributed`` (without importing JAX)."""
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def _run(config: TrainConfig) -> tuple[int, str | None]:
    """`train`: the exit status and the one line of what stopped it."""
    error: BaseException
    try:
        train(config)
        return 0, None
    except KeyboardInterrupt:
        return 130, "interrupted"
    except SystemExit as exc:  # a user's model or loss ended the process: no run
        return 2, f"error: the run called sys.exit({exc.code!r}) before it ended"
    except Exception as exc:
        one_line, fit_error = _one_line()
        cause = exc.__cause__ if isinstance(exc, fit_error) else exc
        if _peer_lost(cause):
            from jax_adaptive.cli.hosts import gone_peer, lost_line

            gone = gone_peer()
            if gone is not None:  # named as the watch names it
                return 2, lost_line(gone)
            error, said = cause, "a process of the jax.distributed job is gone: "
        elif cause is not exc and isinstance(cause, one_line):
            error, said = cause, f"training stopped by {type(cause).__name__}: "
        elif cause is exc and isinstance(exc, one_line):
            error, said = exc, ""
        else:
            raise  # its traceback, and the cause's
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return 2, f"error: {said}{first}"


def _peer_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a collective that failed because another process is gone."""
    return (
        exc is not None and _distributed_started() and bool(re.search(r"Gloo \w+ failed", str(exc)))
    )
