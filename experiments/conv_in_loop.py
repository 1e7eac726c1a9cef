"""XLA:CPU's convolutions inside a loop or a branch: what micro-batching in one program costs.

A micro-batched step runs its micro-batches in a loop (`micro_batch_value_and_grad`'s
scan, with a branch for the last, shorter one). On a CPU, XLA runs a convolution's
gradient inside a loop body or a ``lax.cond`` branch with slower kernels than at the top
level (jax-ml/jax#12868). This times one convolution layer's gradients (NHWC, 3x3,
32 -> 64 channels on 14x14, the MNIST CNN's second layer at batch 24) at the top level,
in a ``lax.cond`` and in a ``fori_loop`` of one turn, at the XLA flags in effect (run it
with ``XLA_FLAGS`` as you train). A GPU runs its convolutions through cuDNN; this is a
CPU figure.

    python experiments/conv_in_loop.py --out experiments/results/conv_in_loop.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
from common import write_result
from jax import lax


def conv(x: jax.Array, k: jax.Array) -> jax.Array:
    """One NHWC convolution, as ``nnx.Conv`` writes it."""
    return lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def loss(x: jax.Array, k: jax.Array) -> jax.Array:
    return (conv(x, k) ** 2).sum()


def wrapped(grad) -> dict[str, object]:
    """The gradient at the top level, in a branch, and in a loop of one turn."""
    return {
        "top level": jax.jit(grad),
        "in lax.cond": jax.jit(
            lambda x, k: lax.cond(x[0, 0, 0, 0] > -1, lambda: grad(x, k), lambda: grad(2 * x, k))
        ),
        "in fori_loop": jax.jit(
            lambda x, k: lax.fori_loop(0, 1, lambda i, g: grad(x, k), grad(x, k))
        ),
    }


def median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compiled and run once
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="experiments/results/conv_in_loop.json")
    args = parser.parse_args()
    x, k = jnp.ones((24, 14, 14, 32)), jnp.ones((3, 3, 32, 64))
    grads = {
        "kernel gradient": lambda x, k: jax.grad(loss, 1)(x, k),
        "input gradient": lambda x, k: jax.grad(loss, 0)(x, k),
        "forward": conv,
    }
    rows = []
    for name, grad in grads.items():
        times = {
            where: median_seconds(fn, (x, k), args.repeats) for where, fn in wrapped(grad).items()
        }
        top = times["top level"]
        for where, seconds in times.items():
            rows.append({"op": name, "where": where, "ms": 1e3 * seconds, "x_top": seconds / top})
            line = f"{name:16s} {where:13s} {1e3 * seconds:8.2f} ms"
            print(f"{line}  {seconds / top:5.1f}x the top level")
    result = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
