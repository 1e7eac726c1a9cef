"""The command line's language-model path: ``python -m jax_adaptive.train --model gpt``.

The zoo's small GPT trains on synthetic sequences of log-normal lengths
(`jax_adaptive.data.synthetic_sequences`) through a `BucketedTrainer`: power-of-two buckets
up to ``--max-length``, ``--target-tokens`` padded tokens per update, each bucket's
plan searched on its first use, and the loss weighted per real token. The workdir and
the loop are `jax_adaptive.cli.run`'s; ``plan.json`` holds one plan per bucket planned.

With ``--workdir`` it checkpoints the state and the stream's position (the sequences
read) every ``--checkpoint-every`` updates. ``--resume`` goes on from the latest
checkpoint with the very batches the uninterrupted run would have trained on: the
stream is drawn again from its seed and bucketed again up to the checkpoint's update,
so the sequences that waited in partly filled buckets then wait there again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jax_adaptive.buckets import BucketBatch, BucketedTrainer, bucket_batches, pow2_buckets
from jax_adaptive.cli.config import TrainConfig, check_config, make_optimizer
from jax_adaptive.cli.run import RunHooks, run_path, speed_text
from jax_adaptive.cli.workdir import Workdir, plan_entry
from jax_adaptive.data import synthetic_sequences
from jax_adaptive.distributed import data_mesh
from jax_adaptive.models import GPT, gpt_token_loss
from jax_adaptive.step import TrainState

__all__ = ["train_gpt"]

VOCAB_SIZE = 64
# What a resumed checkpoint must match: what draws the stream and shapes the model.
_RUN_FIELDS = (
    "model",
    "dataset",
    "max_length",
    "target_tokens",
    "optimizer",
    "learning_rate",
    "seed",
)


def _next_token_counts(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The tokens a next-token loss counts: every valid one but each sequence's first."""
    return batch["mask"][:, 1:].sum(axis=1)


def _check(config: TrainConfig) -> None:
    check_config(config)
    if config.dataset != "synthetic":
        raise ValueError("--model gpt trains on synthetic sequences: use --dataset synthetic.")
    if config.micro_batch_size != "auto":
        raise ValueError("--model gpt plans each bucket itself: use --micro-batch-size auto.")
    if config.epochs is not None:
        raise ValueError("--model gpt reads an endless stream: use --updates, not --epochs.")
    if config.max_length < 16:
        raise ValueError(f"--max-length {config.max_length} must be at least 16.")
    if config.target_tokens is not None and config.target_tokens < config.max_length:
        raise ValueError(
            f"--target-tokens {config.target_tokens} must be at least --max-length "
            f"{config.max_length}: an update holds at least one sequence of each bucket."
        )


class _Counted:
    """An iterator over ``sequences`` that counts the ones it handed out (``read``)."""

    def __init__(self, sequences: Iterable[dict[str, np.ndarray]]):
        self._sequences, self.read = iter(sequences), 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        sequence = next(self._sequences)
        self.read += 1
        return sequence


def _stream(
    sequences: Iterable[dict[str, np.ndarray]], sizes: dict[int, int], done: int, position: int
) -> Iterator[tuple[BucketBatch, int]]:
    """Each update's bucket batch from update ``done + 1`` on, with the sequences read by then.

    The batches of the first ``done`` updates are formed again and skipped, so the
    sequences they left waiting wait again. Their count must be the checkpoint's
    ``position``: else the stream is not the one the checkpoint's run read.

    Examples:
        >>> import itertools
        >>> from jax_adaptive.data import synthetic_sequences
        >>> sizes = {16: 8, 32: 4, 64: 2}  # sequences per update of each bucket
        >>> batches = _stream(synthetic_sequences(max_length=64), sizes, 0, 0)
        >>> [(b.bucket, read) for b, read in itertools.islice(batches, 4)]
        [(64, 2), (32, 8), (64, 10), (64, 13)]
        >>> again = _stream(synthetic_sequences(max_length=64), sizes, 2, 8)  # after 2
        >>> [(b.bucket, read) for b, read in itertools.islice(again, 2)]
        [(64, 10), (64, 13)]
    """
    counted = _Counted(sequences)
    batches = bucket_batches(counted, sizes)
    for _ in range(done):
        next(batches)
    if counted.read != position:
        raise ValueError(
            f"the checkpoint of update {done} was saved after {position} sequences of the "
            f"stream, but drawing it again gives {counted.read}: the stream differs; resume "
            "with the same flags and version, or use a new --workdir."
        )
    return ((batch, counted.read) for batch in batches)  # counted as each batch is formed


def _plans(trainer: BucketedTrainer) -> dict[str, Any]:
    """The keyword arguments of `Workdir.write_plan`: one plan per bucket, in first use."""
    log = trainer.bucket_log
    return {
        "plans": [plan_entry(trainer.trainers[b["bucket"]], b["bucket"]) for b in log],
        "search_seconds": sum(b["seconds"] for b in log),
    }


def _bucket_line(entry: dict[str, Any]) -> str:
    """The line of a bucket planned on its first use."""
    return (
        f"bucket {entry['bucket']}: micro-batch {entry['micro_batch_size']} x "
        f"{entry['accumulation_steps']} = {entry['examples_per_update']} sequences; "
        f"{entry['compiles']} sizes compiled in {entry['seconds']:.1f}s"
    )


def _gpt_line(line: dict[str, Any]) -> str:
    return (
        f"update {line['update']:4d}  bucket {line['bucket']:4d}  loss {line['loss']:.4f}  "
        f"tokens {line['tokens']}/{line['padded_tokens']}"
    )


def _train(config: TrainConfig, workdir: Workdir | None, out: TextIO) -> dict[str, Any]:
    model = GPT(vocab_size=VOCAB_SIZE, max_len=config.max_length, width=64, depth=2, heads=4)
    trainer = BucketedTrainer(
        gpt_token_loss(model),
        make_optimizer(config),
        buckets=pow2_buckets(config.max_length),
        target_tokens=config.target_tokens or 4096,
        count_tokens=_next_token_counts,
        memory_limit=config.memory_limit,
        objective=config.objective,
        plan_cache=config.plan_cache_arg(),
        mesh=data_mesh() if config.data_parallel else None,
    )
    sequences = synthetic_sequences(
        vocab_size=VOCAB_SIZE, max_length=config.max_length, seed=config.seed
    )
    first = next(sequences)
    params = model.init(jax.random.key(config.seed), jnp.asarray(first["tokens"][None]))["params"]
    state = trainer.init(params, first, rng=jax.random.key(config.seed))
    state, position, done = (state, 0, 0) if workdir is None else workdir.resume(state)
    sizes = {bucket: trainer.examples_per_update(bucket) for bucket in trainer.buckets}
    batches = _stream(sequences, sizes, done, position)
    if done:
        print(f"resumed at update {done} ({position} sequences of the stream read)", file=out)
    consumed = [position]  # the sequences read by the last batch trained on

    def compiles() -> int:
        return sum(trainer.trainers[b].compiles for b in trainer.trainers)

    def step(
        state: TrainState, drawn: tuple[BucketBatch, int]
    ) -> tuple[TrainState, dict[str, Any]]:
        tick = time.perf_counter()
        batch, read = drawn
        state, metrics = trainer.step(state, batch)
        metrics = jax.device_get(metrics)  # blocks: the time below is the update's
        seconds = time.perf_counter() - tick
        consumed[0] = read  # trained on
        return state, {
            "loss": float(metrics["loss"]), "bucket": int(metrics["bucket"]),
            "tokens": int(metrics["tokens"]), "padded_tokens": int(metrics["padded_tokens"]),
            "micro_batch_size": int(metrics["micro_batch_size"]),
            "accumulation_steps": int(metrics["accumulation_steps"]),
            "examples": int(metrics["examples"]), "seconds": seconds, "compiles": compiles(),
        }  # fmt: skip

    printed = 0  # the buckets whose line was printed

    def describe(line: dict[str, Any]) -> str:
        nonlocal printed
        planned = trainer.bucket_log[printed:]  # the buckets planned since the last line
        printed = len(trainer.bucket_log)
        return "\n".join([*map(_bucket_line, planned), _gpt_line(line)])

    hooks = RunHooks(
        config, done=done, updates=config.updates, describe=describe,
        plans=lambda: _plans(trainer), workdir=workdir, position=lambda: consumed[0], out=out,
        compiles=compiles(),
    )  # fmt: skip
    hooks.run(step, state, batches)
    lines = hooks.lines
    tokens = sum(line["tokens"] for line in lines)
    padded = sum(line["padded_tokens"] for line in lines)
    return {
        "buckets": trainer.bucket_log,
        "compiles": compiles(),  # plan.json's: every bucket's searches and re-plans
        "losses": [line["loss"] for line in lines],
        "updates": len(lines),
        **hooks.timing("tokens"),
        "padding_share": 1.0 - tokens / padded if padded else 0.0,
    }


def train_gpt(config: TrainConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """Trains the small GPT with a token budget per update; see `jax_adaptive.cli.main.train`.

    Returns:
        A summary: each bucket's plan, the search compiles, the losses and the padding.

    Examples:
        >>> import io
        >>> config = TrainConfig(model="gpt", max_length=16, target_tokens=64, updates=2,
        ...                      progress=False, plan_cache=False)
        >>> summary = train_gpt(config, out=io.StringIO())
        >>> len(summary["losses"]), [b["bucket"] for b in summary["buckets"]]
        (2, [16])
    """
    _check(config)
    run = {f: getattr(config, f) for f in _RUN_FIELDS}  # what a resumed checkpoint must match
    # The position (sequences read) has no fixed count per update: `_stream` checks it.
    return run_path(config, _train, _summary_line, out=out, run=run, examples_per_update=None)


def _summary_line(summary: dict[str, Any]) -> str:
    losses = summary["losses"]
    return (
        f"summary: {len(summary['buckets'])} buckets planned with {summary['compiles']} "
        f"compiles, {speed_text(summary, 'tokens', summary['updates'])}, "
        f"padding {summary['padding_share']:.1%}, final loss "
        + (f"{losses[-1]:.4f}" if losses else "n/a")
    )
