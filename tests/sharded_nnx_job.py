"""An NNX model sharded as Flax's sharding guide shards one, trained by AdaptiveNnxStep.

``python sharded_nnx_job.py OUT.json`` runs on 8 CPU devices (set before JAX starts, which
is why this is a script): an MLP whose kernels carry ``nnx.with_partitioning`` over the
``data`` axis, its state constrained to ``nnx.get_partition_spec`` under ``jax.set_mesh``,
trained 5 calls by the converted step under a memory limit that makes it micro-batch
(where its update must donate the sharded state, after a host copy), and 5 by the same
step under ``@nnx.jit`` on a copy. It writes the largest difference
of the parameters, the plan and the kernels' shardings before and after the calls.
"""

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import json

import jax
import numpy as np
import optax
from flax import nnx

import jax_adaptive as ja

T, WIDTH, CALLS = 256, 4096, 5


class MLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(
            64, WIDTH, kernel_init=nnx.with_partitioning(init, (None, "data")), rngs=rngs
        )
        self.l2 = nnx.Linear(
            WIDTH, 8, kernel_init=nnx.with_partitioning(init, ("data", None)), rngs=rngs
        )

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


@nnx.jit
def create():
    model = MLP(nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model


def loss_fn(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def step_fn(model, optimizer, batch):
    loss, grads = ja.micro_batch_value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def objects():
    model = create()
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def main(out):
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(CALLS):
        x = rng.normal(size=(T, 64)).astype(np.float32)
        batches.append({"x": x, "y": x[:, :8]})
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        probe = ja.AdaptiveNnxStep(step_fn, plan_cache=False)
        probe(*objects(), batches[0])
        limit = probe.step.ledger(T // 2).total  # micro-batches below T
        step = ja.AdaptiveNnxStep(step_fn, memory_limit=limit, objective="max", plan_cache=False)
        model, optimizer = objects()
        before = [str(model.l1.kernel[...].sharding.spec), str(model.l2.kernel[...].sharding.spec)]
        want_model, want_optimizer = objects()
        for batch in batches:
            step(model, optimizer, batch)
            nnx.jit(step_fn)(want_model, want_optimizer, batch)
    got, want = nnx.state(model, nnx.Param), nnx.state(want_model, nnx.Param)
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )
    result = {
        "max_diff": diff,
        "micro_batch_size": step.micro_batch_size,
        "accumulation_steps": step.plan_info.accumulation_steps,
        "before": before,
        "after": [str(model.l1.kernel[...].sharding.spec), str(model.l2.kernel[...].sharding.spec)],
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
