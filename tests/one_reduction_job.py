"""One gradient reduction per update on 8 CPU devices, run as a script in a subprocess.

``python one_reduction_job.py OUT.json`` counts the collectives in the compiled
micro-step, chunk and optimizer step of a data-parallel trainer, trains with padding,
per-example weights, aux metrics, a random loss, chunks and injected out-of-memory
errors, and writes the figures and final parameters next to their single-device
references for tests/test_one_reduction.py to compare. The device count is set before
JAX starts, which is why this runs apart from the test process (DESIGN.md).
"""

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import mlp_params, regression_batches

T, UPDATES, D_IN, WIDTH, LENGTH = 100, 3, 8, 16, 32
SIZE = 24  # 5 micro-steps of 24 on 8 devices, 3 rows each; the last one padded
OPTIMIZER = optax.adam(1e-2)
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


def collectives(compiled) -> dict[str, int]:
    """How many of each collective op the compiled program's HLO holds."""
    text = compiled.as_text()
    return {op: len(re.findall(rf"= [^\n]*? {op}(?:-start)?\(", text)) for op in COLLECTIVES}


def aux_loss(params, batch, rng):
    """A per-example loss with a per-example aux metric (no randomness)."""
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, None, :])
    err = (hidden @ params["w2"] - batch["y"]) ** 2
    return jnp.mean(err, axis=1), {"worst": jnp.max(err, axis=1)}


def noisy_loss(params, batch, rng):
    """A loss that draws from its key: noise on the targets, per row and position."""
    noise = 1 + 0.1 * jax.random.normal(rng, batch["y"].shape)
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, None, :])
    return jnp.mean((hidden @ params["w2"] - batch["y"] * noise) ** 2, axis=1)


def stateful_loss(params, model_state, batch, rng):
    """Normalises by the micro-batch's mean, as BatchNorm does, and keeps a running mean."""
    mean = jnp.mean(batch["x"], axis=(0, 1))
    hidden = jnp.tanh((batch["x"] - mean) @ params["w1"] + params["b1"][None, None, :])
    losses = jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2, axis=1)
    return losses, {"mean": 0.9 * model_state["mean"] + 0.1 * mean}


def weights_for(update: int) -> np.ndarray:
    weights = np.ones(T, np.float32)
    weights[update::7] = 0  # masked examples, a different set each update
    weights[1 + update] = 2.5  # and a weighted one
    return weights


def host(tree):
    return {k: np.asarray(jax.device_get(v)).tolist() for k, v in tree.items()}


def weighted_reference(params, batches):
    """Plain optax on one device: one full-batch step of sum(w * loss) / T per update."""
    opt_state = OPTIMIZER.init(params)

    @jax.jit
    def step(params, opt_state, batch, weights):
        def objective(p):
            losses, aux = aux_loss(p, batch, None)
            return jnp.sum(weights * losses) / T, (losses, aux)

        grads, (losses, aux) = jax.grad(objective, has_aux=True)(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        means = {
            "loss": jnp.sum(weights * losses) / T,
            "worst": jnp.sum(weights * aux["worst"]) / T,
        }
        return optax.apply_updates(params, updates), opt_state, means

    metrics = []
    with jax.default_device(jax.local_devices()[0]):
        for i, batch in enumerate(batches):
            params, opt_state, means = step(params, opt_state, batch, weights_for(i))
            metrics.append({k: float(v) for k, v in means.items()})
    return params, metrics


def train(loss, params, batches, *, faults=(), weighted=False, **kwargs):
    """Trains with `AdaptiveTrainer`; returns the parameters, metrics and what was injected."""
    import jax_adaptive as ja
    from jax_adaptive.testing import inject_oom

    trainer = ja.AdaptiveTrainer(loss, OPTIMIZER, target_batch_size=T, plan_cache=False, **kwargs)
    state = trainer.init(params, batches[0])
    metrics, sizes = [], []
    with inject_oom(trainer, executions=faults) as injector:
        for i, batch in enumerate(batches):
            state, m = trainer.step(state, batch, weights=weights_for(i) if weighted else None)
            metrics.append({k: float(m[k]) for k in m if k in ("loss", "worst")})
            sizes.append(int(m["micro_batch_size"]))
    return {
        "params": host(state.params),
        "metrics": metrics,
        "sizes": sizes,
        "injected": injector.injected,
        "acc_shapes": [list(a.shape) for a in jax.tree.leaves(state.opt_state.acc_grads)],
        "chunk": trainer.plan_info.chunk,
        "fused": trainer.plan_info.fused,
    }


def executables_for(loss, params, batch, *, has_aux=False, has_state=False, model_state=()):
    """The compiled pieces of a data-parallel trainer over all 8 devices, bound."""
    import jax_adaptive as ja
    from jax_adaptive.distributed import Placement, place
    from jax_adaptive.executables import Executables
    from jax_adaptive.sizing import Sizing
    from jax_adaptive.step import TrainState, multi_steps

    placement = Placement(mesh=ja.data_mesh()) if jax.device_count() > 1 else Placement()
    steps = multi_steps(OPTIMIZER, 1)
    state = TrainState(params, steps.init(params), model_state, jax.random.key(0))
    state = place(state, placement.state(state, steps))
    executables = Executables(
        loss,
        OPTIMIZER,
        Sizing("micro-step of"),
        key=dict,
        has_aux=has_aux,
        has_state=has_state,
        everywhere=placement.everywhere,
        data=placement.data,
    )
    executables.bind(state, batch)
    return executables


def counts(params, batch):
    """Collectives per program and per update, and the state each device holds."""
    ex = executables_for(aux_loss, params, batch, has_aux=True)
    micro, chunk = ex.micro(SIZE).compiled, ex.micro(SIZE, 2).compiled
    optimizer = {str(d): collectives(ex.optimizer_step(d).compiled) for d in (False, True)}
    stateful = executables_for(
        stateful_loss, params, batch, has_state=True, model_state={"mean": jnp.zeros(D_IN)}
    )
    with jax.default_device(jax.devices()[0]):
        one = executables_for(aux_loss, params, batch, has_aux=True)
    return {
        "per_device": getattr(ex, "per_device", False),
        "micro": collectives(micro),
        "chunk": collectives(chunk),
        "optimizer": optimizer,
        # an update's last program: its micro-steps and the optimizer step
        "final": {str(c): collectives(ex.final(SIZE, c, T).compiled) for c in (1, 5)},
        "micro_steps_per_update": -(-T // SIZE),
        "stateful_per_device": getattr(stateful, "per_device", False),
        "stateful_micro": collectives(stateful.micro(SIZE).compiled),
        "state_bytes": ex.state_bytes(),
        "single_device_state_bytes": one.state_bytes(),
        "ledger_state": ex.ledger(SIZE).state,
        "params_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
    }


def main(out):
    params = mlp_params(0, D_IN, WIDTH)
    batches = regression_batches(UPDATES, T, 1, D_IN, LENGTH)
    import jax_adaptive as ja

    mesh = ja.data_mesh()
    reference, reference_metrics = weighted_reference(params, batches)
    result = {
        "counts": counts(params, batches[0]),
        "reference": host(reference),
        "reference_metrics": reference_metrics,
        "weighted": {
            str(chunk): train(
                aux_loss,
                params,
                batches,
                has_aux=True,
                weighted=True,
                mesh=mesh,
                micro_batch_size=SIZE,
                chunk=chunk,
            )
            for chunk in (1, 2, "auto")
        },
        # A device's rows draw what a micro-batch of those rows draws on one device.
        "noisy": {
            "mesh": train(noisy_loss, params, batches, mesh=mesh, micro_batch_size=SIZE, chunk=2),
            "one_device": train(noisy_loss, params, batches, micro_batch_size=SIZE // 8, chunk=1),
        },
        # Out of memory in a new size's first update and in a later one (its saves
        # skipped), under a simulated capacity that the search plans for.
        "recovery": train(
            aux_loss,
            params,
            batches,
            has_aux=True,
            weighted=True,
            mesh=mesh,
            memory_limit=80_000,
            objective="max",
            faults={2, 5},
        ),
        "recovery_chunk": train(
            aux_loss,
            params,
            batches,
            has_aux=True,
            weighted=True,
            mesh=mesh,
            micro_batch_size=SIZE,
            chunk=2,
            faults={2},
        ),
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
