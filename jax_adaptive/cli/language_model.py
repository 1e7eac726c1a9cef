"""``--model gpt``: the zoo's small GPT on synthetic sequences through a `BucketedTrainer`.

A checkpoint holds the sequences read; ``--resume`` draws and buckets the stream again
up to its update (docs/cli.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jax_adaptive.buckets import BucketBatch, BucketedTrainer, bucket_batches, pow2_buckets
from jax_adaptive.cli.config import TrainConfig, check_config, make_optimizer
from jax_adaptive.cli.run import RunHooks, plural, run_path
from jax_adaptive.cli.workdir import Workdir, plan_entry
from jax_adaptive.data import synthetic_sequences
from jax_adaptive.distributed import data_mesh
from jax_adaptive.models import GPT, gpt_token_loss
from jax_adaptive.step import TrainState

__all__ = ["VOCAB_SIZE", "train_gpt"]

VOCAB_SIZE = 64
# What defines the training (draws the stream, shapes the model): a resumed checkpoint
# must match them.
_RUN_FIELDS = ("model", "dataset", "max_length", "target_tokens", "optimizer", "learning_rate",
               "seed")  # fmt: skip


def _next_token_counts(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The tokens a next-token loss counts: every valid one but each sequence's first."""
    return batch["mask"][:, 1:].sum(axis=1)


def _stream(
    sequences: Iterable[dict[str, np.ndarray]], sizes: dict[int, int], done: int, position: int
) -> Iterator[tuple[BucketBatch, int]]:
    """Each update's bucket batch from update ``done + 1`` on, with the sequences read by then.

    The first ``done`` updates' batches are formed again, skipped, and must have read
    the checkpoint's ``position``.

    Examples:
        >>> import itertools
        >>> sizes = {16: 8, 32: 4, 64: 2}  # sequences per update of each bucket
        >>> batches = _stream(synthetic_sequences(max_length=64), sizes, 0, 0)
        >>> [(b.bucket, read) for b, read in itertools.islice(batches, 4)]
        [(64, 2), (32, 8), (64, 10), (64, 13)]
        >>> again = _stream(synthetic_sequences(max_length=64), sizes, 2, 8)  # after 2
        >>> [(b.bucket, read) for b, read in itertools.islice(again, 2)]
        [(64, 10), (64, 13)]
    """
    read = [0]

    def counted() -> Iterator[dict[str, np.ndarray]]:
        for sequence in sequences:
            read[0] += 1
            yield sequence

    batches = bucket_batches(counted(), sizes)
    for _ in range(done):
        next(batches)
    if read[0] != position:
        raise ValueError(
            f"the checkpoint of update {done} was saved after {position} sequences of the "
            f"stream, but drawing it again gives {read[0]}: the stream differs; resume "
            "with the same flags and version, or use a new --workdir."
        )
    return ((batch, read[0]) for batch in batches)  # counted as each batch is formed


def _train(config: TrainConfig, workdir: Workdir | None, out: TextIO) -> dict[str, Any]:
    model = GPT(vocab_size=VOCAB_SIZE, max_len=config.max_length, width=64, depth=2, heads=4)
    trainer = BucketedTrainer(
        gpt_token_loss(model), make_optimizer(config), buckets=pow2_buckets(config.max_length),
        target_tokens=config.target_tokens or 4096, count_tokens=_next_token_counts,
        memory_limit=config.memory_limit, objective=config.chosen_objective()[0],
        timing_budget=config.timing_budget(),
        plan_cache=config.plan_cache_arg(), mesh=data_mesh() if config.data_parallel else None,
    )  # fmt: skip
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

    def step(state: TrainState, batch: BucketBatch) -> tuple[TrainState, dict[str, Any]]:
        state, metrics = trainer.step(state, batch)
        metrics = jax.device_get(metrics)  # blocks: the update is done
        return state, {"loss": float(metrics["loss"])} | {
            key: int(metrics[key]) for key in ("bucket", "tokens", "padded_tokens",
            "micro_batch_size", "accumulation_steps", "examples")
        }  # fmt: skip

    printed = 0  # the buckets whose line was printed

    def describe(line: dict[str, Any]) -> str:
        nonlocal printed
        planned = trainer.bucket_log[printed:]  # the buckets planned since the last line
        printed = len(trainer.bucket_log)
        return "\n".join([
            *(f"bucket {b['bucket']}: micro-batch {b['micro_batch_size']} x "
              f"{b['accumulation_steps']} = {b['examples_per_update']} sequences; "
              f"{plural(b['compiles'], 'size')} compiled in {b['seconds']:.1f}s" for b in planned),
            f"update {line['update']:4d}  bucket {line['bucket']:4d}  loss {line['loss']:.4f}  "
            f"tokens {line['tokens']}/{line['padded_tokens']}",
        ])  # fmt: skip

    def plans() -> dict[str, Any]:  # one per bucket, in first use
        log = trainer.bucket_log
        return {
            "plans": [plan_entry(trainer.trainers[b["bucket"]], b["bucket"]) for b in log],
            "search_seconds": sum(b["seconds"] for b in log),
        }

    def compiles() -> int:
        return sum(t.compiles for t in trainer.trainers.values())

    hooks = RunHooks(
        config, done=done, updates=config.updates, describe=describe, plans=plans,
        compiles=compiles, unit="tokens", workdir=workdir, out=out,
    )  # fmt: skip
    hooks.run(step, state, batches)
    tokens = sum(line["tokens"] for line in hooks.lines)
    padded = sum(line["padded_tokens"] for line in hooks.lines)
    return {
        "buckets": trainer.bucket_log,
        "compiles": compiles(),  # plan.json's: every bucket's searches and re-plans
        "losses": [line["loss"] for line in hooks.lines],
        "updates": len(hooks.lines),
        **hooks.timing(),
        "padding_share": 1.0 - tokens / padded if padded else 0.0,
    }


def train_gpt(config: TrainConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """Trains the small GPT (`jax_adaptive.cli.main.train`): a summary, with each bucket's plan."""
    check_config(config)
    run = {f: getattr(config, f) for f in _RUN_FIELDS}  # what a resumed checkpoint must match
    # The position (sequences read) has no fixed count per update: `_stream` checks it.
    return run_path(config, _train, _summary_line, out=out, run=run)


def _summary_line(summary: dict[str, Any]) -> str:
    losses = summary["losses"]
    return (
        f"summary: {plural(len(summary['buckets']), 'bucket')} planned with {summary['compiles']} "
        f"compiles, {summary['speed']}, padding {summary['padding_share']:.1%}, final loss "
        + (f"{losses[-1]:.4f}" if losses else "n/a")
    )
