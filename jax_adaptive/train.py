"""The command line: ``python -m jax_adaptive.train``.

A thin layer: parse the arguments into a `TrainConfig`, then call `train`, which tests
call too. The default trains the small CNN on synthetic images with a learnable signal,
on a CPU, in well under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import tqdm

from jax_adaptive.checkpoint import Checkpoints
from jax_adaptive.datasets import ShuffledBatches, load_source
from jax_adaptive.distributed import data_mesh
from jax_adaptive.models import (
    CNN,
    MLP,
    ResNet18,
    ResNet50,
    ResNetTiny,
    ViTMicro,
    ViTTiny,
    linen_classifier_loss,
)
from jax_adaptive.plan_cache import enable_compilation_cache
from jax_adaptive.train_lm import train_gpt
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = ["TrainConfig", "main", "parse_bytes", "train"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(text: str) -> int:
    """Parses a memory size: ``"8GiB"``, ``"512MB"``, ``"1.5GB"`` or a plain byte count.

    Example:
        >>> parse_bytes("8GiB"), parse_bytes("512MB"), parse_bytes("1000")
        (8589934592, 512000000, 1000)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size; write e.g. 8GiB, 512MB or 1000000."
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"memory size {text!r} must be at least one byte.")
    return int(value)


_MODELS = {
    "cnn": (CNN, ()),
    "mlp": (MLP, ()),
    "resnet-tiny": (ResNetTiny, ("batch_stats",)),
    "resnet18": (ResNet18, ("batch_stats",)),
    "resnet50": (ResNet50, ("batch_stats",)),
    "vit-micro": (ViTMicro, ()),
    "vit-tiny": (ViTTiny, ()),
}
_OPTIMIZERS = {"adam": optax.adam, "adamw": optax.adamw, "sgd": optax.sgd}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What `train` runs; every field is a command-line flag."""

    model: str = "cnn"
    dataset: str = "synthetic"
    data_dir: str | None = None
    target_batch_size: int = 256
    micro_batch_size: int | str = "auto"
    memory_limit: int | None = None
    optimizer: str = "adam"
    learning_rate: float = 3e-3
    updates: int = 20
    epochs: float | None = None
    seed: int = 0
    objective: str = "max"
    plan_cache: str | bool | None = None  # None: the default file; False: none
    compilation_cache: str | None = None
    workdir: str | None = None
    resume: bool = False
    checkpoint_every: int = 10
    progress: bool = True
    target_tokens: int | None = None  # --model gpt: padded tokens per update
    max_length: int = 256  # --model gpt: the longest sequence (and the largest bucket)
    data_parallel: bool = False  # split each micro-batch over all devices


_CHOICES = (*_MODELS, "gpt")


def _check(config: TrainConfig) -> None:
    if config.model not in _CHOICES:
        raise ValueError(f"unknown model {config.model!r}; choose one of {', '.join(_CHOICES)}.")
    if config.target_tokens is not None and config.model != "gpt":
        raise ValueError(
            "--target-tokens is for --model gpt; image models take --target-batch-size."
        )
    if config.optimizer not in _OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(_OPTIMIZERS)}."
        )
    if config.resume and config.workdir is None:
        raise ValueError("--resume needs --workdir (the directory of the run to resume).")
    if config.checkpoint_every <= 0:
        raise ValueError(f"checkpoint_every={config.checkpoint_every} must be positive.")


# What a checkpoint must agree on to be resumed: everything that changes the run's result.
_RUN_FIELDS = ("model", "dataset", "target_batch_size", "optimizer", "learning_rate", "seed")


def train(config: TrainConfig, *, out: Any = None) -> dict[str, Any]:
    """Trains a zoo model as configured; prints the plan, each update and a summary.

    With ``workdir``, writes ``plan.json``, ``metrics.jsonl`` (one line per update) and
    orbax checkpoints (train state and data position) every ``checkpoint_every``
    updates; ``resume`` goes on from the latest one.

    Returns:
        A summary: the plan, the search cost and the loss of each update.

    Example:
        >>> import io
        >>> summary = train(TrainConfig(target_batch_size=8, updates=2, progress=False),
        ...                 out=io.StringIO())
        >>> summary["micro_batch_size"], len(summary["losses"])
        (8, 2)
    """
    out = out or sys.stdout
    _check(config)
    if config.compilation_cache is not None:
        enable_compilation_cache(config.compilation_cache)
    if config.model == "gpt":
        return train_gpt(config, _OPTIMIZERS[config.optimizer](config.learning_rate), out=out)
    workdir = None if config.workdir is None else Path(config.workdir).absolute()
    run = {f: getattr(config, f) for f in _RUN_FIELDS}
    checkpoints = None if workdir is None else Checkpoints(workdir / "checkpoints", run)
    if checkpoints is not None and not config.resume and checkpoints.latest() is not None:
        raise ValueError(
            f"{workdir} already holds checkpoints; pass --resume to go on, or another --workdir."
        )
    source = load_source(config.dataset, data_dir=config.data_dir, seed=config.seed)
    if config.epochs is not None:
        updates = max(1, int(config.epochs * len(source) / config.target_batch_size))
    else:
        updates = config.updates
    module, mutable = _MODELS[config.model]
    model = module(num_classes=source.num_classes)
    plan_cache = config.plan_cache
    if plan_cache is None and workdir is not None:
        plan_cache = str(workdir / "plans.json")  # a resumed run keeps its plan
    trainer = AdaptiveTrainer(
        linen_classifier_loss(model, mutable=mutable),
        _OPTIMIZERS[config.optimizer](config.learning_rate),
        target_batch_size=config.target_batch_size,
        micro_batch_size=config.micro_batch_size,
        memory_limit=config.memory_limit,
        has_aux=True,
        has_state=bool(mutable),
        objective=config.objective,
        plan_cache=plan_cache,
        mesh=data_mesh() if config.data_parallel else None,
    )
    example = next(ShuffledBatches(source, 1))
    variables = model.init(jax.random.key(config.seed), jnp.asarray(example["image"]))
    params, model_state = variables.pop("params"), dict(variables)
    start = time.perf_counter()
    state = trainer.init(
        params, example, rng=jax.random.key(config.seed), model_state=model_state if mutable else ()
    )
    search_seconds = time.perf_counter() - start
    position, done = 0, 0
    if config.resume:
        restored = checkpoints.restore(state)
        if restored is not None:
            state, position = restored
            done = int(state.updates)
    cached = any(t.decided_by == "plan cache" for t in trainer.search_log)
    print(
        f"plan: micro-batch {trainer.micro_batch_size} x {trainer.accumulation_steps} "
        f"accumulation steps = target batch {config.target_batch_size}; "
        f"{trainer.compiles} sizes compiled in {search_seconds:.1f}s"
        + (
            f"; {trainer.micro_batch_size // trainer.shards} per device on {trainer.shards}"
            if trainer.shards > 1
            else ""
        )
        + (" (from the plan cache)" if cached else "")
        + (f"; resumed at update {done}" if done else ""),
        file=out,
    )
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        _write_plan(workdir / "plan.json", trainer, config, search_seconds)
    batches = ShuffledBatches(source, config.target_batch_size, seed=config.seed, start=position)
    losses, metrics, examples_per_s = [], {}, 0.0
    bar = tqdm.tqdm(total=updates, initial=done, disable=not config.progress, unit="update")
    log = None if workdir is None else open(workdir / "metrics.jsonl", "a")
    try:
        for update in range(done, updates):
            tick = time.perf_counter()
            state, metrics = trainer.step(state, next(batches))
            loss = float(metrics["loss"])
            examples_per_s = config.target_batch_size / (time.perf_counter() - tick)
            losses.append(loss)
            line = {
                "update": update + 1, "loss": loss, "accuracy": float(metrics["accuracy"]),
                "micro_batch_size": int(metrics["micro_batch_size"]),
                "accumulation_steps": trainer.accumulation_steps,
                "examples_per_s": examples_per_s,
            }  # fmt: skip
            if log is not None:
                log.write(json.dumps(line) + "\n")
                log.flush()
            if checkpoints is not None and (
                (update + 1) % config.checkpoint_every == 0 or update + 1 == updates
            ):
                checkpoints.save(update + 1, state, batches.position)
            bar.set_postfix(
                loss=f"{loss:.3f}",
                ex_s=f"{examples_per_s:.0f}",
                micro=f"{trainer.micro_batch_size}x{trainer.accumulation_steps}",
            )
            bar.update()
            tqdm.tqdm.write(
                f"update {update + 1:4d}  loss {loss:.4f}  accuracy "
                f"{line['accuracy']:.3f}  micro-batch {line['micro_batch_size']}",
                file=out,
            )
    finally:
        bar.close()
        if log is not None:
            log.close()
        if checkpoints is not None:
            checkpoints.close()
    summary = {
        "micro_batch_size": trainer.micro_batch_size,
        "accumulation_steps": trainer.accumulation_steps,
        "compiles": trainer.compiles,
        "search_seconds": search_seconds,
        "from_plan_cache": cached,
        "examples_per_s": examples_per_s,
        "losses": losses,
        "accuracy": float(metrics["accuracy"]) if metrics else None,
    }
    print(
        f"summary: plan {summary['micro_batch_size']} x {summary['accumulation_steps']}, "
        f"search {summary['compiles']} compiles in {search_seconds:.1f}s, "
        f"{examples_per_s:.0f} examples/s, final loss "
        + (f"{losses[-1]:.4f} accuracy {summary['accuracy']:.3f}" if losses else "n/a"),
        file=out,
    )
    return summary


def _write_plan(path: Path, trainer: AdaptiveTrainer, config: TrainConfig, seconds: float) -> None:
    plan = {
        "config": dataclasses.asdict(config),
        "micro_batch_size": trainer.micro_batch_size,
        "accumulation_steps": trainer.accumulation_steps,
        "compiles": trainer.compiles,
        "search_seconds": seconds,
        "memory_limit": trainer.memory_limit,
        "capacity": trainer.capacity(),
        "search_log": [t._asdict() for t in trainer.search_log],
    }
    path.write_text(json.dumps(plan, indent=1, default=str))


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


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_adaptive.train",
        description="Train with a fixed target batch size through the largest micro-batch "
        "that fits the device (or --memory-limit).",
    )
    parser.add_argument(
        "--model",
        default="cnn",
        choices=sorted(_CHOICES),
        help="the zoo model to train (default: cnn); gpt trains on synthetic sequences of "
        "mixed lengths, bucketed, with --target-tokens",
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
        "--data-parallel",
        action="store_true",
        help=f"split each micro-batch over all {jax.device_count()} devices (one 'data' mesh "
        "axis); the searched size is then per device",
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        choices=sorted(_OPTIMIZERS),
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
        "--checkpoint-every",
        type=int,
        default=10,
        help="updates between checkpoints (and one at the end)",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data, init and dropout")
    parser.add_argument(
        "--objective",
        choices=["max", "throughput"],
        default="max",
        help="'max': the largest micro-batch that fits; 'throughput': the fastest update "
        "among the largest and the least-padded sizes (each timed briefly)",
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
    args = parser.parse_args(argv)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    try:
        train(config)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(
            f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
