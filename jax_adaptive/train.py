"""The command line: ``python -m jax_adaptive.train``.

A thin layer: parse the arguments into a `TrainConfig`, then call `train`, which tests
call too. The default trains the small CNN on synthetic images with a learnable signal,
on a CPU, in well under a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax_adaptive.data import synthetic_images
from jax_adaptive.models import CNN, linen_classifier_loss
from jax_adaptive.plan_cache import enable_compilation_cache
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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What `train` runs; every field is a command-line flag."""

    target_batch_size: int = 256
    micro_batch_size: int | str = "auto"
    memory_limit: int | None = None
    learning_rate: float = 3e-3
    updates: int = 20
    seed: int = 0
    objective: str = "max"
    plan_cache: str | bool | None = None  # None: the default file; False: none
    compilation_cache: str | None = None


def train(config: TrainConfig, *, out: Any = None) -> dict[str, Any]:
    """Trains the CNN on synthetic images as configured; prints the plan and each update.

    Returns:
        A summary: the plan, the search cost and the loss of each update.

    Example:
        >>> import io
        >>> summary = train(TrainConfig(target_batch_size=8, updates=2), out=io.StringIO())
        >>> summary["micro_batch_size"], len(summary["losses"])
        (8, 2)
    """
    out = out or sys.stdout
    if config.compilation_cache is not None:
        enable_compilation_cache(config.compilation_cache)
    model = CNN(num_classes=10)
    trainer = AdaptiveTrainer(
        linen_classifier_loss(model),
        optax.adam(config.learning_rate),
        target_batch_size=config.target_batch_size,
        micro_batch_size=config.micro_batch_size,
        memory_limit=config.memory_limit,
        has_aux=True,
        objective=config.objective,
        plan_cache=config.plan_cache,
    )
    example = synthetic_images(config.target_batch_size, seed=config.seed)
    params = model.init(jax.random.key(config.seed), jnp.asarray(example["image"][:1]))["params"]
    start = time.perf_counter()
    state = trainer.init(params, example, rng=jax.random.key(config.seed))
    search_seconds = time.perf_counter() - start
    cached = any(t.decided_by == "plan cache" for t in trainer.search_log)
    print(
        f"plan: micro-batch {trainer.micro_batch_size} x {trainer.accumulation_steps} "
        f"accumulation steps = target batch {config.target_batch_size}; "
        f"{trainer.compiles} sizes compiled in {search_seconds:.1f}s"
        + (" (from the plan cache)" if cached else ""),
        file=out,
    )
    losses = []
    for update in range(config.updates):
        batch = synthetic_images(config.target_batch_size, seed=config.seed + 1 + update)
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
        print(
            f"update {update + 1:4d}  loss {losses[-1]:.4f}  accuracy "
            f"{float(metrics['accuracy']):.3f}  micro-batch {metrics['micro_batch_size']}",
            file=out,
        )
    return {
        "micro_batch_size": trainer.micro_batch_size,
        "accumulation_steps": trainer.accumulation_steps,
        "compiles": trainer.compiles,
        "search_seconds": search_seconds,
        "from_plan_cache": cached,
        "losses": losses,
    }


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
        "--target-batch-size",
        type=int,
        default=256,
        help="examples per optimizer update (default: 256)",
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
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="Adam's rate")
    parser.add_argument("--updates", type=int, default=20, help="optimizer updates to run")
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
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
