"""What does Flax's NNX step cost once converted? Time per step against the original.

Flax's MNIST example (examples/nnx_mnist.py: its CNN, SGD with momentum, its metrics), one
batch of ``--batch-size`` examples per step, interleaved rounds, medians:

- ``original``: the example's ``@nnx.jit`` step with ``nnx.value_and_grad``, the whole
  batch at once;
- ``converted``: the same step converted (``@ja.AdaptiveNnxStep``,
  ``ja.micro_batch_value_and_grad``) with no memory limit: it plans the whole batch, so
  the difference is our host work (splitting the objects, the plan, writing them back);
- ``converted_m``: the converted step with micro-batches of ``--micro-batch-size``
  (``micro_batch_size=`` in the step), under ``nnx.jit``: the in-jit loop's cost where
  the batch would not fit.

Each ratio is taken round by round against ``original`` and reported as the median.
On a GPU, pass ``--memory-limit`` to plan the converted step as a smaller device would.

    python experiments/nnx_step.py            # writes experiments/results/nnx_step.json
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import jax
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from common import write_result

import jax_adaptive as ja

_SPEC = importlib.util.spec_from_file_location(
    "nnx_mnist", Path(__file__).parents[1] / "examples" / "nnx_mnist.py"
)
mnist = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mnist)


def original_step(model, optimizer, metrics, batch, rngs):
    """The example's step before conversion."""
    grad_fn = nnx.value_and_grad(mnist.loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def micro_step(size):
    """The converted step at a fixed micro-batch ``size``, under ``nnx.jit``."""

    @nnx.jit
    def step(model, optimizer, metrics, batch, rngs):
        grad_fn = ja.micro_batch_value_and_grad(mnist.loss_fn, has_aux=True, micro_batch_size=size)
        (loss, logits), grads = grad_fn(model, batch, rngs)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    return step


def objects():
    model = mnist.CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.01, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    model.train()
    return model, optimizer, metrics, nnx.Rngs(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--memory-limit", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="steps timed per round")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "nnx_step.json"))
    args = parser.parse_args()
    batch = next(mnist.random_batches(1, args.batch_size))
    batch = jax.device_put(batch)
    converted = ja.AdaptiveNnxStep(
        mnist.train_step.step_fn, memory_limit=args.memory_limit, plan_cache=False
    )
    steps = {
        "original": nnx.jit(original_step),
        "converted": converted,
        "converted_m": micro_step(args.micro_batch_size),
    }
    state = {name: objects() for name in steps}

    def timed(name):
        step, (model, optimizer, metrics, rngs) = steps[name], state[name]
        start = time.perf_counter()
        for _ in range(args.steps):
            step(model, optimizer, metrics, batch, rngs)
        jax.block_until_ready(nnx.state(model))
        return (time.perf_counter() - start) / args.steps * 1e3

    for name in steps:  # compile (and plan) outside the timing
        timed(name)
    rounds = [{name: timed(name) for name in steps} for _ in range(args.rounds)]
    ms = {name: statistics.median(r[name] for r in rounds) for name in steps}
    ratios = {
        name: statistics.median(r[name] / r["original"] for r in rounds)
        for name in steps
        if name != "original"
    }
    for name in steps:
        print(f"{name:12s} {ms[name]:8.2f} ms per step")
    plan = converted.plan_info
    print(f"converted plan: {plan.micro_batch_size} x {plan.accumulation_steps}")
    for name, ratio in ratios.items():
        print(f"{name} / original: {ratio:.3f}")
    write_result(
        args.out,
        {
            "batch_size": args.batch_size,
            "micro_batch_size": args.micro_batch_size,
            "memory_limit": args.memory_limit,
            "converted_plan": [plan.micro_batch_size, plan.accumulation_steps],
            "ms_per_step": ms,
            "ratio_to_original": ratios,
            "rounds": rounds,
        },
    )


if __name__ == "__main__":
    main()
