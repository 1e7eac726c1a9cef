"""The command line's language-model path: ``python -m jax_adaptive.train --model gpt``.

The zoo's small GPT trains on synthetic sequences of log-normal lengths
(`jax_adaptive.synthetic_sequences`) through a `BucketedTrainer`: power-of-two buckets
up to ``--max-length``, ``--target-tokens`` padded tokens per update, each bucket's
plan searched on its first use, and the loss weighted per real token. The workdir and
the loop are `jax_adaptive.run`'s; ``plan.json`` holds one plan per bucket planned.
"""

from __future__ import annotations

import time
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jax_adaptive.buckets import BucketBatch, BucketedTrainer, bucket_batches, pow2_buckets
from jax_adaptive.data import synthetic_sequences
from jax_adaptive.distributed import data_mesh
from jax_adaptive.models import GPT, gpt_token_loss
from jax_adaptive.run import (
    TrainConfig,
    Workdir,
    check_config,
    host_loop,
    make_optimizer,
    plan_entry,
    run_path,
)
from jax_adaptive.step import TrainState

__all__ = ["train_gpt"]

VOCAB_SIZE = 64


def _next_token_counts(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The tokens a next-token loss counts: every valid one but each sequence's first."""
    return batch["mask"][:, 1:].sum(axis=1)


def _check(config: TrainConfig) -> None:
    check_config(config)
    if config.dataset != "synthetic":
        raise ValueError("--model gpt trains on synthetic sequences: use --dataset synthetic.")
    if config.micro_batch_size != "auto":
        raise ValueError("--model gpt plans each bucket itself: use --micro-batch-size auto.")
    if config.resume:
        raise ValueError("--resume is not supported with --model gpt (sequences wait in buckets).")
    if config.epochs is not None:
        raise ValueError("--model gpt reads an endless stream: use --updates, not --epochs.")
    if config.max_length < 16:
        raise ValueError(f"--max-length {config.max_length} must be at least 16.")
    if config.target_tokens is not None and config.target_tokens < config.max_length:
        raise ValueError(
            f"--target-tokens {config.target_tokens} must be at least --max-length "
            f"{config.max_length}: an update holds at least one sequence of each bucket."
        )


def _plans(trainer: BucketedTrainer) -> dict[str, Any]:
    """The keyword arguments of `Workdir.write_plan`: one plan per bucket, in first use."""
    log = trainer.bucket_log
    return {
        "plans": [plan_entry(trainer.trainers[b["bucket"]], b["bucket"]) for b in log],
        "search_seconds": sum(b["seconds"] for b in log),
    }


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
    sizes = {bucket: trainer.examples_per_update(bucket) for bucket in trainer.buckets}
    batches = bucket_batches(sequences, sizes)
    printed = 0
    start = time.perf_counter()

    def step(state: TrainState, batch: BucketBatch) -> tuple[TrainState, dict[str, Any]]:
        nonlocal printed
        state, metrics = trainer.step(state, batch)
        metrics = jax.device_get(metrics)
        for entry in trainer.bucket_log[printed:]:  # the buckets planned since the last
            tqdm.tqdm.write(
                f"bucket {entry['bucket']}: micro-batch {entry['micro_batch_size']} x "
                f"{entry['accumulation_steps']} = {entry['examples_per_update']} sequences; "
                f"{entry['compiles']} sizes compiled in {entry['seconds']:.1f}s",
                file=out,
            )
        printed = len(trainer.bucket_log)
        return state, {
            "loss": float(metrics["loss"]), "bucket": int(metrics["bucket"]),
            "tokens": int(metrics["tokens"]), "padded_tokens": int(metrics["padded_tokens"]),
            "micro_batch_size": int(metrics["micro_batch_size"]),
            "accumulation_steps": int(metrics["accumulation_steps"]),
        }  # fmt: skip

    _, lines = host_loop(
        step, state, batches, config, done=0, updates=config.updates, describe=_gpt_line,
        plans=lambda: _plans(trainer), workdir=workdir, out=out,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    tokens = sum(line["tokens"] for line in lines)
    padded = sum(line["padded_tokens"] for line in lines)
    return {
        "buckets": trainer.bucket_log,
        "compiles": sum(b["compiles"] for b in trainer.bucket_log),
        "losses": [line["loss"] for line in lines],
        "tokens_per_s": tokens / seconds,
        "padding_share": 1.0 - tokens / padded if padded else 0.0,
    }


def train_gpt(config: TrainConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """Trains the small GPT with a token budget per update; see `jax_adaptive.train.train`.

    Returns:
        A summary: each bucket's plan, the search compiles, the losses and the padding.

    Example:
        >>> import io
        >>> config = TrainConfig(model="gpt", max_length=16, target_tokens=64, updates=2,
        ...                      progress=False, plan_cache=False)
        >>> summary = train_gpt(config, out=io.StringIO())
        >>> len(summary["losses"]), [b["bucket"] for b in summary["buckets"]]
        (2, [16])
    """
    _check(config)
    return run_path(config, _train, _summary_line, out=out)


def _summary_line(summary: dict[str, Any]) -> str:
    losses = summary["losses"]
    return (
        f"summary: {len(summary['buckets'])} buckets planned with {summary['compiles']} "
        f"compiles, {summary['tokens_per_s']:.0f} tokens/s (including the searches), "
        f"padding {summary['padding_share']:.1%}, final loss "
        + (f"{losses[-1]:.4f}" if losses else "n/a")
    )
