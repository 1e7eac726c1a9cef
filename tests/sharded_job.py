"""Sharded train state on 8 CPU devices: FSDP, ZeRO-1 and an NNX model, against one device.

``python sharded_job.py OUT.json`` runs on 8 CPU devices (set before JAX starts, which is
why this is a script). It trains the same MLP with Adam, 3 updates of T = 100 at 5
micro-batches of 24 (which do not divide it), with its parameters replicated, sharded
over the data axis (FSDP) and replicated beside an optimizer state sharded over it
(ZeRO-1), and an NNX classifier whose kernels carry ``nnx.with_partitioning`` through
`NnxTrainer`, without and with BatchNorm (ghost batches of 4, its running averages as
model state, against one device's groups of 4 in order). It writes each one's largest
difference from plain optax on one device (one full-batch step per update), the
shardings, each plan's collectives, the ledger's per-device state next to the bytes of the
live arrays' shards on device 0, the searched sizes under one memory limit, and the errors
of specs that cannot hold.
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
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from helpers import full_batch_reference, mlp_loss, mlp_params, regression_batches
from jax.sharding import PartitionSpec as P

import jax_adaptive as ja

T, MICRO, UPDATES, D_IN, WIDTH, LENGTH = 100, 24, 3, 64, 512, 32
GHOST = 4  # BatchNorm over groups of 4: 25 per update, the plan's last 5 all padding
OPTIMIZER = optax.adam(1e-2)
FSDP = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data")}
ZERO1 = {"w1": P("data", None), "b1": P("data"), "w2": P("data")}
MODES = {
    "replicated": {},
    "fsdp": {"param_sharding": FSDP},
    "zero1": {"opt_state_sharding": ZERO1},
}


def spec(x):
    return str(x.sharding.spec)


def shard_bytes(tree, device):
    """The bytes of ``tree``'s arrays' shards on ``device`` (what it holds of them)."""
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def largest_difference(params, reference):
    return max(float(np.max(np.abs(np.asarray(params[k]) - reference[k]))) for k in reference)


def train(params, batches, **kwargs):
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPTIMIZER, target_batch_size=T, micro_batch_size=MICRO,
        mesh=ja.data_mesh(), plan_cache=False, **kwargs,
    )  # fmt: skip
    state = trainer.init(params, batches[0])
    for batch in batches:
        state, _ = trainer.step(state, batch)
    plan = trainer.plan_info
    mu = state.opt_state.inner_opt_state[0].mu
    return {
        "params": {k: np.asarray(v).tolist() for k, v in state.params.items()},
        "param_specs": {k: spec(v) for k, v in state.params.items()},
        "mu_specs": {k: spec(v) for k, v in mu.items()},
        "steps": plan.accumulation_steps,
        "plan": str(plan),
        "micro_step": dict(plan.collectives.micro_step),
        "per_update": plan.collectives.per_update(plan.accumulation_steps),
        "ledger_state": trainer.ledger(MICRO).state,
        # The live train state's shards on one device, and the loss total (a float32
        # scalar on each device) the micro-steps carry beside it.
        "live_state": shard_bytes(state, jax.devices()[0]) + 4,
    }


def searched(params, batches, limit, **kwargs):
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPTIMIZER, target_batch_size=T, memory_limit=limit, objective="max",
        mesh=ja.data_mesh(), plan_cache=False, **kwargs,
    )  # fmt: skip
    trainer.init(params, batches[0])
    return trainer.micro_batch_size


class MLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(
            16, 64, kernel_init=nnx.with_partitioning(init, (None, "data")), rngs=rngs
        )
        self.l2 = nnx.Linear(
            64, 5, kernel_init=nnx.with_partitioning(init, ("data", None)), rngs=rngs
        )

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def classifier_batches():
    rng = np.random.default_rng(1)
    return [
        {
            "image": rng.normal(size=(T, 16)).astype(np.float32),
            "label": rng.integers(0, 5, size=T).astype(np.int32),
        }
        for _ in range(UPDATES)
    ]


def tree_difference(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def nnx_trainer():
    """`NnxTrainer` on a model sharded as Flax's guide shards one, against plain optax."""
    batches = classifier_batches()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(0))
    host = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    def reference_loss(p, batch):
        hidden = jax.nn.relu(batch["image"] @ p["l1"]["kernel"] + p["l1"]["bias"])
        logits = hidden @ p["l2"]["kernel"] + p["l2"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    with jax.default_device(jax.devices()[0]):
        params, opt_state = host, OPTIMIZER.init(host)
        for batch in batches:
            grads = jax.jit(jax.grad(reference_loss))(params, batch)
            updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
    trainer = ja.NnxTrainer(
        model, OPTIMIZER, target_batch_size=T, micro_batch_size=MICRO, mesh=mesh,
        plan_cache=False,
    )  # fmt: skip
    for batch in batches:
        trainer.step(batch)
    trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    plan = trainer.trainer.plan_info
    return {
        "difference": max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(params), strict=True)
        ),
        "kernel_specs": [spec(model.l1.kernel[...]), spec(model.l2.kernel[...])],
        "steps": plan.accumulation_steps,
        "micro_step": dict(plan.collectives.micro_step),
        "plan": str(plan),
    }


class BnMLP(nnx.Module):
    """`MLP` with BatchNorm between its layers; ``sharded``: all but the statistics split."""

    def __init__(self, rngs, sharded=True):
        def split(init, spec):
            return nnx.with_partitioning(init, spec) if sharded else init

        init, ones, zeros = (nnx.initializers.lecun_normal(), nnx.initializers.ones,
                             nnx.initializers.zeros)  # fmt: skip
        # No bias before BatchNorm: its gradient is 0 but for rounding, which Adam moves by
        # its learning rate (9.5e-3 from the reference after 3 updates, on one device too).
        self.l1 = nnx.Linear(16, 64, use_bias=False, kernel_init=split(init, (None, "data")),
                             rngs=rngs)  # fmt: skip
        self.norm = nnx.BatchNorm(
            64, momentum=0.9, rngs=rngs, scale_init=split(ones, ("data",)),
            bias_init=split(zeros, ("data",)),
        )  # fmt: skip
        self.l2 = nnx.Linear(64, 5, kernel_init=split(init, ("data", None)), rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.norm(self.l1(x))))


def ghost_reference(values, batches):
    """Plain optax on one device from ``values`` (pure dicts of the model's parameters
    and statistics): each
    batch's groups of `GHOST` in order, BatchNorm statistics threaded from group to group,
    gradients summed, one full-batch update."""
    one = jax.devices()[0]
    with jax.default_device(one):
        graphdef, params, stats = nnx.split(BnMLP(nnx.Rngs(0), sharded=False), nnx.Param,
                                            nnx.BatchStat)  # fmt: skip
    values = jax.device_put(values, one)
    nnx.replace_by_pure_dict(params, values[0])
    nnx.replace_by_pure_dict(stats, values[1])

    @jax.jit
    def group_grad(params, stats, x, y):
        def loss(p):
            module = nnx.merge(graphdef, p, stats, copy=True)
            module.train()
            logits = module(x)
            labels = jax.nn.one_hot(y, 5)  # -log softmax at the label, without optax
            loss = -jnp.sum(jax.nn.log_softmax(logits) * labels) / T
            return loss, nnx.state(module, nnx.BatchStat)

        return jax.grad(loss, has_aux=True)(params)

    opt_state = OPTIMIZER.init(params)
    for batch in batches:
        grads = jax.tree.map(jnp.zeros_like, params)
        for start in range(0, T, GHOST):
            part = slice(start, start + GHOST)
            g, stats = group_grad(params, stats, batch["image"][part], batch["label"][part])
            grads = jax.tree.map(jnp.add, grads, g)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(stats)


def ghost_nnx_trainer():
    """`NnxTrainer` with ghost batches on `BnMLP` sharded by its annotations (FSDP)."""
    batches = classifier_batches()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        model = BnMLP(nnx.Rngs(0))
    values = jax.device_get(
        [nnx.to_pure_dict(nnx.state(model, kind)) for kind in (nnx.Param, nnx.BatchStat)]
    )
    want_params, want_stats = ghost_reference(values, batches)
    trainer = ja.NnxTrainer(
        model, OPTIMIZER, target_batch_size=T, micro_batch_size=MICRO, ghost_batch_size=GHOST,
        mesh=mesh, plan_cache=False,
    )  # fmt: skip
    for batch in batches:
        trainer.step(batch)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    plan = trainer.trainer.plan_info
    return {
        "difference": tree_difference(params, want_params),
        "stats_difference": tree_difference(stats, want_stats),
        "stats_moved": tree_difference(stats, values[1]),
        "specs": [spec(model.l1.kernel[...]), spec(model.norm.scale[...])],
        "stats_spec": spec(model.norm.mean[...]),
        "steps": plan.accumulation_steps,
        "plan": str(plan),
    }


def error_of(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def main(out):
    params = mlp_params(0, D_IN, WIDTH)
    batches = regression_batches(UPDATES, T, 1, D_IN, LENGTH)
    with jax.default_device(jax.devices()[0]):
        reference = jax.device_get(full_batch_reference(mlp_loss, OPTIMIZER, params, batches))
    result = {}
    for mode, kwargs in MODES.items():
        run = train(params, batches, **kwargs)
        run["difference"] = largest_difference(run.pop("params"), reference)
        result[mode] = run
    # One limit: what the replicated state's micro-step of 40 needs.
    probe = ja.AdaptiveTrainer(
        mlp_loss, OPTIMIZER, target_batch_size=T, micro_batch_size=40, mesh=ja.data_mesh(),
        plan_cache=False,
    )  # fmt: skip
    probe.init(params, batches[0])
    limit = probe.ledger(40).total
    result["limit"] = limit
    result["searched"] = {m: searched(params, batches, limit, **kw) for m, kw in MODES.items()}
    result["nnx"] = nnx_trainer()
    result["ghost"] = ghost_nnx_trainer()
    narrow = mlp_params(0, D_IN, 12)  # a hidden width of 12 does not split over 8 devices
    result["errors"] = {
        "divide": error_of(lambda: train(narrow, batches, param_sharding=FSDP)),
        "axis": error_of(
            lambda: train(params, batches, opt_state_sharding={**ZERO1, "w2": P("model")})
        ),
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
