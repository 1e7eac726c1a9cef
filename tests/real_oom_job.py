"""Trains under a real address-space limit, where XLA:CPU raises real out-of-memory errors.

Run as a script in a subprocess (the limit cannot be lifted once set):
``python real_oom_job.py MARGIN_MB UPDATES OUT.npz [trainer|step]``: the trainer, or a
user's own jitted step (`micro_batch_grad` inside) under `AdaptiveStep`. DESIGN.md: the
limit is the process's address space after JAX has started plus a margin; YNNPACK is
turned off so a failed allocation reads as "Out of memory". The model is elementwise (no
matmul): its only memory is XLA's own buffers, so a size either fails cleanly or runs,
with no library scratch allocation that could abort the process in between.
"""

import os

if __name__ == "__main__":  # before JAX starts; never when a test imports this module
    # Its own flags alone, not the test session's fast compile: its time is running 256
    # MiB through XLA's code, not compiling (real_oom_job.py 150 12 took 19 s of CPU at
    # the session's optimisation level 0, 11 s at the default).
    os.environ["XLA_FLAGS"] = "--xla_cpu_experimental_ynn_fusion_type="
    os.environ["JAX_PLATFORMS"] = "cpu"
    # No compilation cache: a hit loads a program without compiling, and XLA makes its
    # compile thread pool at its first compile, which must come before the limit (a
    # pool made under it failed: "Thread tf_xla-cpu-codegen creation via
    # pthread_create() failed", an abort, once in about 15 suite runs).
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import functools
import gc
import json
import resource
import sys

import jax.numpy as jnp
import numpy as np
import optax
from helpers import vmsize

T, D = 512, 65536  # a target batch of 256 MiB: more than the margin, all in flight
DISTINCT = 2  # the updates cycle over this many batches


def loss_fn(params, batch, rng):
    h = jnp.tanh(batch["x"] * params["w"][None, :] + params["b"][None, :])
    return jnp.mean((h - batch["y"]) ** 2, axis=1)


def make_problem():
    rng = np.random.default_rng(0)
    params = {"w": jnp.ones(D) * 0.5, "b": jnp.zeros(D)}
    batches = [
        {
            "x": rng.standard_normal((T, D), dtype=np.float32),  # twice as fast as
            "y": rng.standard_normal((T, D), dtype=np.float32),  # float64 cast down
        }
        for _ in range(DISTINCT)
    ]
    return params, batches, optax.adam(1e-2)


def main(margin_mb: int, updates: int, out: str) -> None:
    import jax_adaptive as ja

    params, batches, optimizer = make_problem()
    trainer = ja.AdaptiveTrainer(loss_fn, optimizer, target_batch_size=T, plan_cache=False)
    state = trainer.init(params, batches[0])
    planned = trainer.micro_batch_size  # a CPU gives no capacity: the estimate says T fits
    gc.collect()
    resource.setrlimit(resource.RLIMIT_AS, (vmsize() + margin_mb * 2**20, resource.RLIM_INFINITY))
    sizes = []
    for update in range(updates):
        state, metrics = trainer.step(state, batches[update % DISTINCT])
        sizes.append(metrics["micro_batch_size"])
    np.savez(out, **{k: np.asarray(v) for k, v in state.params.items()})
    print(
        "RESULT "
        + json.dumps(
            {
                "planned": planned,
                "sizes": sizes,
                "log": [[t.size, t.fits, t.decided_by, t.reason] for t in trainer.search_log],
            }
        ),
        flush=True,
    )


def main_step(margin_mb: int, updates: int, out: str) -> None:
    import jax
    import optax

    import jax_adaptive as ja

    params, batches, optimizer = make_problem()

    def build(m):
        @functools.partial(jax.jit, donate_argnums=0)
        def train_step(state, batch):
            params, opt_state = state
            grads = ja.micro_batch_grad(loss_fn, m)(params, batch).grads
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return train_step

    step = ja.AdaptiveStep(build, plan_cache=False)
    state = (params, optimizer.init(params))
    planned = step.plan(state, batches[0]).micro_batch_size  # a CPU gives no capacity: T
    gc.collect()
    # Python's collector runs when allocation counts say, not when memory is short: off,
    # what a failed attempt held is freed when the library releases it, and only then.
    gc.disable()
    limit = vmsize() + margin_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    print(f"address-space limit {limit / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    sizes = []
    for update in range(updates):
        state = step(state, batches[update % DISTINCT])
        sizes.append(step.micro_batch_size)
        mib = vmsize() / 2**20  # the address space the limit counts, after the call
        print(
            f"call {update} ran at {sizes[-1]}; VmSize {mib:.0f} MiB", file=sys.stderr, flush=True
        )
    np.savez(out, **{k: np.asarray(v) for k, v in state[0].items()})
    log = [[t.size, t.fits, t.decided_by, t.reason] for t in step.search_log]
    print("RESULT " + json.dumps({"planned": planned, "sizes": sizes, "log": log}), flush=True)


if __name__ == "__main__":
    run = main_step if sys.argv[4:] == ["step"] else main
    run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
