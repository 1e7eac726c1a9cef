"""The command line's image path: a zoo image model on synthetic images or a TFDS dataset.

`train_images` builds the model and an `AdaptiveTrainer` from a
`jax_adaptive.run.TrainConfig`, plans, resumes from the workdir's latest checkpoint
when asked, and trains through the shared `jax_adaptive.run.host_loop`.
"""

from __future__ import annotations

import math
import time
from typing import Any, TextIO

import jax
import jax.numpy as jnp

from jax_adaptive import models
from jax_adaptive.datasets import ShuffledBatches, load_source
from jax_adaptive.distributed import data_mesh
from jax_adaptive.run import (
    IMAGE_MODELS,
    TrainConfig,
    Workdir,
    check_config,
    host_loop,
    make_optimizer,
    plan_entry,
    run_path,
)
from jax_adaptive.step import TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = ["train_images"]


_RUN_FIELDS = ("model", "dataset", "target_batch_size", "optimizer", "learning_rate", "seed")

GHOST_BATCH_SIZE = 32
"""The examples each BatchNorm statistic of the ResNets is computed over, by default."""


def _ghost_batch_size(config: TrainConfig, mutable: tuple[str, ...]) -> int | None:
    """The ghost batch of a model with BatchNorm: the same training on any device.

    The largest divisor of `GHOST_BATCH_SIZE` that divides the target batch (and a fixed
    micro-batch), at least 8; None (per-micro-batch statistics) for a model without
    batch statistics, when no such divisor exists, or in a data-parallel run (a
    micro-batch's groups, run one after another, would each sit on one device).

    Example:
        >>> _ghost_batch_size(TrainConfig(model="resnet-tiny", target_batch_size=96),
        ...                  ("batch_stats",))
        32
        >>> _ghost_batch_size(TrainConfig(model="resnet-tiny", target_batch_size=100),
        ...                  ("batch_stats",)) is None
        True
    """
    if not mutable or config.data_parallel:
        return None
    fixed = config.micro_batch_size if isinstance(config.micro_batch_size, int) else 0
    size = math.gcd(GHOST_BATCH_SIZE, config.target_batch_size, fixed)
    return size if size >= 8 else None


def _image_trainer(
    config: TrainConfig, num_classes: int
) -> tuple[Any, tuple[str, ...], AdaptiveTrainer]:
    module, mutable = IMAGE_MODELS[config.model]
    model = module(num_classes=num_classes)
    ghost = _ghost_batch_size(config, mutable)
    trainer = AdaptiveTrainer(
        models.linen_classifier_loss(model, mutable=mutable, ghost_batch_size=ghost),
        make_optimizer(config),
        target_batch_size=config.target_batch_size,
        micro_batch_size=config.micro_batch_size,
        memory_limit=config.memory_limit,
        multiple_of=ghost or 1,
        has_aux=True,
        has_state=bool(mutable),
        objective=config.objective,
        plan_cache=config.plan_cache_arg(),
        mesh=data_mesh() if config.data_parallel else None,
    )
    return model, mutable, trainer


def _plan_line(trainer: AdaptiveTrainer, seconds: float, done: int, cached: bool) -> str:
    per_device = trainer.micro_batch_size // trainer.shards
    return (
        f"plan: micro-batch {trainer.micro_batch_size} x {trainer.accumulation_steps} "
        f"accumulation steps = target batch {trainer.target_batch_size}; "
        f"{trainer.compiles} sizes compiled in {seconds:.1f}s"
        + (f"; {per_device} per device on {trainer.shards}" if trainer.shards > 1 else "")
        + (" (from the plan cache)" if cached else "")
        + (f"; resumed at update {done}" if done else "")
    )


def _image_line(line: dict[str, Any]) -> str:
    return (
        f"update {line['update']:4d}  loss {line['loss']:.4f}  accuracy "
        f"{line['accuracy']:.3f}  micro-batch {line['micro_batch_size']}"
    )


def _train_images(config: TrainConfig, workdir: Workdir | None, out: TextIO) -> dict[str, Any]:
    source = load_source(config.dataset, data_dir=config.data_dir, seed=config.seed)
    updates = config.updates
    if config.epochs is not None:
        updates = max(1, int(config.epochs * len(source) / config.target_batch_size))
    model, mutable, trainer = _image_trainer(config, source.num_classes)
    example = next(ShuffledBatches(source, 1))
    variables = model.init(jax.random.key(config.seed), jnp.asarray(example["image"]))
    params, model_state = variables.pop("params"), dict(variables)
    start = time.perf_counter()
    state = trainer.init(
        params, example, rng=jax.random.key(config.seed), model_state=model_state if mutable else ()
    )
    search_seconds = time.perf_counter() - start
    position, done = 0, 0
    if config.resume and workdir is not None and workdir.checkpoints is not None:
        restored = workdir.checkpoints.restore(state)
        if restored is not None:
            state, position = restored
            done = int(state.updates)
    cached = any(t.decided_by == "plan cache" for t in trainer.search_log)
    print(_plan_line(trainer, search_seconds, done, cached), file=out)
    batches = ShuffledBatches(source, config.target_batch_size, seed=config.seed, start=position)

    def step(state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        tick = time.perf_counter()
        state, metrics = trainer.step(state, next(batches))
        loss = float(metrics["loss"])  # blocks: the time below is the update's
        return state, {
            "loss": loss, "accuracy": float(metrics["accuracy"]),
            "micro_batch_size": int(metrics["micro_batch_size"]),
            "accumulation_steps": trainer.accumulation_steps,
            "examples_per_s": config.target_batch_size / (time.perf_counter() - tick),
        }  # fmt: skip

    state, lines = host_loop(
        step, state, config, done=done, updates=updates, describe=_image_line,
        plans=lambda: {"plans": [plan_entry(trainer)], "search_seconds": search_seconds},
        workdir=workdir, position=lambda: batches.position, out=out,
    )  # fmt: skip
    return {
        "micro_batch_size": trainer.micro_batch_size,
        "accumulation_steps": trainer.accumulation_steps,
        "compiles": trainer.compiles,
        "search_seconds": search_seconds,
        "from_plan_cache": cached,
        "examples_per_s": lines[-1]["examples_per_s"] if lines else 0.0,
        "losses": [line["loss"] for line in lines],
        "accuracy": lines[-1]["accuracy"] if lines else None,
    }


def train_images(config: TrainConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """Trains a zoo image model as configured; prints the plan, each update and a summary.

    With ``workdir``, writes ``plan.json``, ``metrics.jsonl`` (one line per update) and
    orbax checkpoints (train state and data position) every ``checkpoint_every``
    updates and at the end; ``resume`` goes on from the latest one.

    Returns:
        A summary: the plan, the search cost and the loss of each update.

    Example:
        >>> import io
        >>> config = TrainConfig(model="mlp", target_batch_size=8, updates=2, progress=False)
        >>> summary = train_images(config, out=io.StringIO())
        >>> summary["micro_batch_size"], len(summary["losses"])
        (8, 2)
    """
    check_config(config)
    run = {f: getattr(config, f) for f in _RUN_FIELDS}  # what a resumed checkpoint must match
    return run_path(config, _train_images, _summary_line, out=out, run=run)


def _summary_line(summary: dict[str, Any]) -> str:
    losses = summary["losses"]
    return (
        f"summary: plan {summary['micro_batch_size']} x {summary['accumulation_steps']}, "
        f"search {summary['compiles']} compiles in {summary['search_seconds']:.1f}s, "
        f"{summary['examples_per_s']:.0f} examples/s, final loss "
        + (f"{losses[-1]:.4f} accuracy {summary['accuracy']:.3f}" if losses else "n/a")
    )
