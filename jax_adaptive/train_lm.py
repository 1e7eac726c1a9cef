"""The command line's language-model path: ``python -m jax_adaptive.train --model gpt``.

The zoo's small GPT trains on synthetic sequences of log-normal lengths
(`jax_adaptive.synthetic_sequences`) through a `BucketedTrainer`: power-of-two buckets
up to ``--max-length``, ``--target-tokens`` padded tokens per update, each bucket's
plan searched on its first use, and the loss weighted per real token.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jax_adaptive.buckets import BucketedTrainer, pow2_buckets
from jax_adaptive.data import synthetic_sequences
from jax_adaptive.distributed import data_mesh
from jax_adaptive.models import GPT, gpt_token_loss

__all__ = ["train_gpt"]

VOCAB_SIZE = 64


def _next_token_counts(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The tokens a next-token loss counts: every valid one but each sequence's first."""
    return batch["mask"][:, 1:].sum(axis=1)


def _check(config: Any) -> None:
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


def train_gpt(config: Any, optimizer: Any, *, out: Any) -> dict[str, Any]:
    """Trains the small GPT with a token budget per update; see `jax_adaptive.train.train`.

    Returns:
        A summary: each bucket's plan, the search compiles, the losses and the padding.

    Example:
        >>> import io, optax
        >>> from jax_adaptive.train import TrainConfig
        >>> config = TrainConfig(model="gpt", max_length=16, target_tokens=64, updates=2,
        ...                      progress=False, plan_cache=False)
        >>> summary = train_gpt(config, optax.adam(1e-3), out=io.StringIO())
        >>> len(summary["losses"]), [b["bucket"] for b in summary["buckets"]]
        (2, [16])
    """
    _check(config)
    target_tokens = config.target_tokens or 4096
    model = GPT(vocab_size=VOCAB_SIZE, max_len=config.max_length, width=64, depth=2, heads=4)
    workdir = None if config.workdir is None else Path(config.workdir).absolute()
    plan_cache = config.plan_cache
    if plan_cache is None and workdir is not None:
        plan_cache = str(workdir / "plans.json")
    trainer = BucketedTrainer(
        gpt_token_loss(model),
        optimizer,
        buckets=pow2_buckets(config.max_length),
        target_tokens=target_tokens,
        count_tokens=_next_token_counts,
        memory_limit=config.memory_limit,
        objective=config.objective,
        plan_cache=plan_cache,
        mesh=data_mesh() if config.data_parallel else None,
    )
    sequences = synthetic_sequences(
        vocab_size=VOCAB_SIZE, max_length=config.max_length, seed=config.seed
    )
    first = next(sequences)
    params = model.init(jax.random.key(config.seed), jnp.asarray(first["tokens"][None]))["params"]
    state = trainer.init(params, first, rng=jax.random.key(config.seed))
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    log = None if workdir is None else open(workdir / "metrics.jsonl", "a")
    bar = tqdm.tqdm(total=config.updates, disable=not config.progress, unit="update")
    planned, losses, tokens, padded = 0, [], 0, 0
    start = time.perf_counter()

    def on_update(update: int, metrics: dict[str, Any]) -> None:
        nonlocal planned, tokens, padded
        for entry in trainer.bucket_log[planned:]:
            tqdm.tqdm.write(
                f"bucket {entry['bucket']}: micro-batch {entry['micro_batch_size']} x "
                f"{entry['accumulation_steps']} = {entry['examples_per_update']} sequences; "
                f"{entry['compiles']} sizes compiled in {entry['seconds']:.1f}s",
                file=out,
            )
        planned = len(trainer.bucket_log)
        loss = float(metrics["loss"])
        losses.append(loss)
        tokens += int(metrics["tokens"])
        padded += int(metrics["padded_tokens"])
        line = {
            "update": update, "loss": loss, "bucket": int(metrics["bucket"]),
            "tokens": int(metrics["tokens"]), "padded_tokens": int(metrics["padded_tokens"]),
            "micro_batch_size": int(metrics["micro_batch_size"]),
            "accumulation_steps": int(metrics["accumulation_steps"]),
        }  # fmt: skip
        if log is not None:
            log.write(json.dumps(line) + "\n")
            log.flush()
        bar.set_postfix(loss=f"{loss:.3f}", bucket=line["bucket"], micro=line["micro_batch_size"])
        bar.update()
        tqdm.tqdm.write(
            f"update {update:4d}  bucket {line['bucket']:4d}  loss {loss:.4f}  "
            f"tokens {line['tokens']}/{line['padded_tokens']}",
            file=out,
        )

    try:
        state, _ = trainer.fit(state, sequences, config.updates, on_update=on_update)
    finally:
        bar.close()
        if log is not None:
            log.close()
    seconds = time.perf_counter() - start
    summary = {
        "buckets": trainer.bucket_log,
        "compiles": sum(b["compiles"] for b in trainer.bucket_log),
        "losses": losses,
        "tokens_per_s": tokens / seconds,
        "padding_share": 1.0 - tokens / padded if padded else 0.0,
    }
    if workdir is not None:
        (workdir / "plan.json").write_text(json.dumps(summary | {"losses": None}, indent=1))
    print(
        f"summary: {len(trainer.bucket_log)} buckets planned with {summary['compiles']} "
        f"compiles, {summary['tokens_per_s']:.0f} tokens/s (including the searches), "
        f"padding {summary['padding_share']:.1%}, final loss "
        + (f"{losses[-1]:.4f}" if losses else "n/a"),
        file=out,
    )
    return summary
