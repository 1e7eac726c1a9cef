"""What does Flax's NNX step cost once converted? Time per step and bytes, against the original.

Flax's MNIST example (examples/nnx_mnist.py: its CNN, SGD with momentum, its metrics), one
batch of ``--batch-size`` examples per step, interleaved rounds, medians:

- ``original``: the example's ``@nnx.jit`` step with ``nnx.value_and_grad``, the whole
  batch at once;
- ``one_program``: the converted step (each micro-batch's own BatchNorm statistics) as
  one donating program, as `AdaptiveNnxStep` ran it before it split the gradient from
  the update: the baseline of what making every out-of-memory survivable costs;
- ``converted``: that step under ``@ja.AdaptiveNnxStep`` with no memory limit: it plans
  the whole batch and runs the gradient and the update as two programs, so the
  difference from ``one_program`` is the split and our host work;
- ``converted_ghost``: the example's converted step as written, BatchNorm over ghost
  batches of 32 by default (in order): the price of the same training on every device;
- ``converted_m``: the converted step with micro-batches of ``--micro-batch-size``
  (``micro_batch_size=`` in the step), under ``nnx.jit``: the in-jit loop's cost where
  the batch would not fit.

Bytes: each program's ledger (the state, the batch and new outputs, the temporaries:
docs/memory.md); the converted step's peak is the larger of its gradient's and its
update's. Each ratio is taken round by round against ``original`` and reported as the
median. On a GPU, pass ``--memory-limit`` to plan the converted steps as a smaller
device would.

    python experiments/nnx_step.py            # writes experiments/results/nnx_step.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).parent))
from common import load_example, write_result

import jax_adaptive as ja
from jax_adaptive.memory import memory_report, program_ledger, tree_bytes

mnist = load_example("nnx_mnist")


def original_step(model, optimizer, metrics, batch, rngs):
    """The example's step before conversion."""
    grad_fn = nnx.value_and_grad(mnist.loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def own_statistics_step(model, optimizer, metrics, batch, rngs):
    """The converted step with each micro-batch's own BatchNorm statistics."""
    grad_fn = ja.micro_batch_value_and_grad(
        mnist.loss_fn, has_aux=True, ghost_batch_size="micro_batch"
    )
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def one_program(step_fn, objects, batch):
    """``step_fn`` on the objects' state as one jitted program that donates it, and its ledger."""
    graphdef, state = nnx.split(objects)

    def step(state, batch):
        model, optimizer, metrics, rngs = nnx.merge(graphdef, state)
        step_fn(model, optimizer, metrics, batch, rngs)
        return nnx.state((model, optimizer, metrics, rngs))

    jitted = jax.jit(step, donate_argnums=0)
    compiled = jitted.lower(state, batch).compile()
    ledger = program_ledger(
        memory_report(compiled), resident=tree_bytes(state), inputs=tree_bytes(batch)
    )

    def run(model, optimizer, metrics, batch, rngs):
        objects = (model, optimizer, metrics, rngs)
        nnx.update(objects, compiled(nnx.state(objects), batch))

    return run, ledger


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
        own_statistics_step, memory_limit=args.memory_limit, plan_cache=False
    )
    converted_ghost = ja.AdaptiveNnxStep(
        mnist.train_step.step_fn, memory_limit=args.memory_limit, plan_cache=False
    )
    fused, fused_ledger = one_program(own_statistics_step, objects(), batch)
    _, original_ledger = one_program(original_step, objects(), batch)  # its bytes only
    steps = {
        "original": nnx.jit(original_step),
        "one_program": fused,
        "converted": converted,
        "converted_ghost": converted_ghost,
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
    split = statistics.median(r["converted"] / r["one_program"] for r in rounds)
    print(f"converted / one_program (the split's cost in time): {split:.3f}")
    nbytes = {
        "original (not donating, as @nnx.jit)": original_ledger.total,
        "one_program (donating)": fused_ledger.total,
        "converted: gradient": plan.ledger.total,
        "converted: update": converted.update_ledger.total,
        "converted: peak": max(plan.ledger.total, converted.update_ledger.total),
    }
    for name, value in nbytes.items():
        print(f"{name:38s} {value:>14,} bytes")
    write_result(
        args.out,
        {
            "batch_size": args.batch_size,
            "micro_batch_size": args.micro_batch_size,
            "memory_limit": args.memory_limit,
            "converted_plan": [plan.micro_batch_size, plan.accumulation_steps],
            "ms_per_step": ms,
            "ratio_to_original": ratios,
            "converted_to_one_program": split,
            "ledger_bytes": nbytes,
            "host_bytes_per_call": converted.host_bytes // (args.rounds + 1) // args.steps,
            "rounds": rounds,
        },
    )


if __name__ == "__main__":
    main()
