"""Data-parallel training on several CPU devices, run as a script in a subprocess.

``python data_parallel_job.py mesh OUT.json`` trains on 8 CPU devices;
``python data_parallel_job.py process ID PORT OUT.json`` is one of two ``jax.distributed``
processes on localhost (2 CPU devices each, gloo collectives) passing global batches;
``local ID PORT OUT.json`` one of two with 4 devices each, each reading only its own
rows, replicated and then FSDP-sharded over both processes' devices. Each writes its
figures and the final parameters next to an independent single-device reference (plain
optax, one full-batch step per update) for the test to compare. The device count is set
before JAX starts, which is why these run apart from the test process (DESIGN.md).
"""

import os
import sys

if __name__ == "__main__":
    devices = {"mesh": 8, "process": 2, "local": 4, "buckets": 2}[sys.argv[1]]
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import json

import jax
import numpy as np
import optax
from helpers import full_batch_reference, mlp_loss, mlp_params, regression_batches
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

T, UPDATES, D_IN, WIDTH, LENGTH = 100, 3, 8, 16, 32
OPTIMIZER = optax.adam(1e-2)


def problem():
    return mlp_params(0, D_IN, WIDTH), regression_batches(UPDATES, T, 1, D_IN, LENGTH)


def reference(params, batches):
    """Plain optax on one device, no mesh: what every configuration must equal."""
    with jax.default_device(jax.local_devices()[0]):
        return full_batch_reference(mlp_loss, OPTIMIZER, params, batches)


def host(tree):
    return {k: np.asarray(jax.device_get(v)).tolist() for k, v in tree.items()}


RUNS = [0]  # micro-batches whose loss ran on this process's devices (process job)


def counted_loss(params, batch, rng):
    """`mlp_loss`, counting on the host each device's run of it."""
    jax.debug.callback(lambda: RUNS.__setitem__(0, RUNS[0] + 1))
    return mlp_loss(params, batch, rng)


def train(params, batches, *, faults=None, loss=mlp_loss, **kwargs):
    import jax_adaptive as ja
    from jax_adaptive.testing import inject_oom

    trainer = ja.AdaptiveTrainer(
        loss, OPTIMIZER, target_batch_size=T, plan_cache=False, objective="max", **kwargs
    )
    state = trainer.init(params, batches[0])
    planned, sizes = trainer.micro_batch_size, []
    with inject_oom(trainer, executions=faults or ()) as injector:
        for batch in batches:
            state, metrics = trainer.step(state, batch)
            sizes.append(int(metrics["micro_batch_size"]))
    own = [t.size for t in trainer.search_log if t.fits and t.reason == "init"]
    return (
        trainer,
        state,
        {
            "searched": max(own, default=None),  # this process's own answer, before agreeing
            "planned": planned,
            "sizes": sizes,
            "injected": injector.injected,
            "compiles": trainer.compiles,
            "per_device": getattr(trainer._executables, "per_device", False),
            "fused": trainer.plan_info.fused,
            "params": host(state.params),
            "shardings": {
                k: str(getattr(v.sharding, "spec", None)) for k, v in state.params.items()
            },
        },
    )


def brute_force(trainer, limit):
    """The largest multiple of the shards whose estimate fits, by compiling every one."""

    fits = [
        s for s in range(trainer.shards, T + 1, trainer.shards) if trainer.ledger(s).total <= limit
    ]
    return max(fits)


def mesh_job(out):
    import jax_adaptive as ja

    params, batches = problem()
    limit = 80_000
    _, _, single_run = train(params, batches, memory_limit=limit)
    trainer, _, data = train(params, batches, memory_limit=limit, mesh=ja.data_mesh())
    grid = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model")}
    _, state, sharded = train(
        params, batches, memory_limit=limit, mesh=grid, param_sharding=specs, faults={2}
    )
    mu = state.opt_state.inner_opt_state[0].mu
    result = {
        "reference": host(reference(params, batches)),
        "single": single_run,
        "data": {**data, "brute_force": brute_force(trainer, limit)},
        "sharded": {
            **sharded,
            "mu_shardings": {k: str(getattr(v.sharding, "spec", None)) for k, v in mu.items()},
        },
    }
    with open(out, "w") as f:
        json.dump(result, f)


def process_job(process_id, port, out):
    import jax_adaptive as ja

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    params, batches = problem()
    # The processes see different capacities, and only process 0 runs out of memory,
    # inside its third micro-step's run: process 1 runs that micro-step to its end (no
    # collective waits for process 0), then both agree, shrink and go on together.
    limit = 80_000 if process_id == 0 else 60_000
    faults = {3} if process_id == 0 else ()
    _, _, run = train(
        params, batches, memory_limit=limit, mesh=ja.data_mesh(), faults=faults,
        loss=counted_loss, global_batches=True,
    )  # fmt: skip
    run["runs"] = RUNS[0] // jax.local_device_count()
    run["reference"] = host(reference(params, batches))
    run["devices"] = jax.device_count()
    with open(out, "w") as f:
        json.dump(run, f)
    jax.distributed.shutdown()


def local_job(process_id, port, out):
    """Each process reads only its half of every target batch, through `fit`.

    Process ``p``'s rows of an update are rows ``[p * T/2, (p + 1) * T/2)`` of the
    reference's full batch: the concatenation of the processes' rows, in process order.
    """
    import jax_adaptive as ja
    from jax_adaptive.testing import inject_oom

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    params, batches = problem()
    share, read = T // 2, [0]

    def loader(updates):  # this process's rows, 25 at a time, counted as they are read
        for batch in batches[:updates]:
            for start in range(process_id * share, (process_id + 1) * share, 25):
                read[0] += 25
                yield {k: v[start : start + 25] for k, v in batch.items()}

    trainer = ja.AdaptiveTrainer(
        counted_loss, OPTIMIZER, target_batch_size=T, plan_cache=False, objective="max",
        memory_limit=60_000 if process_id == 0 else 80_000, mesh=ja.data_mesh(),
    )  # fmt: skip
    state = trainer.init(params, batches[0])
    planned, plan = trainer.micro_batch_size, trainer.plan_info
    # Only process 0 runs out of memory, inside its second micro-step's run.
    with inject_oom(trainer, executions={2} if process_id == 0 else ()) as injector:
        state, history = trainer.fit(state, loader(UPDATES), read_ahead=0)
    # Each process evaluates its own rows of a held-out batch; the means are over all.
    held_out = regression_batches(1, 30, 7, D_IN, LENGTH)[0]
    own = {k: v[process_id * 10 : 10 + process_id * 20] for k, v in held_out.items()}
    metric = lambda p, b: {"loss": mlp_loss(p, b, None)}  # noqa: E731
    evaluated = trainer.evaluate(state, own, metric)
    errors = []
    wrong = {k: v[: share - 10 * process_id] for k, v in batches[0].items()}
    try:  # the processes pass different counts: both refuse, in one line, none hangs
        trainer.step(state, wrong)
    except ValueError as exc:
        errors.append(str(exc))
    # Process 1's stream is empty: both stop at once, none waits for the other.
    short = [{k: v[:share] for k, v in batches[0].items()}] if process_id == 0 else []
    _, after_end = trainer.fit(state, short)
    # The processes split a mesh's data shards in blocks, or hold them all (then every
    # process passes the whole batch).
    from jax_adaptive.distributed import Placement

    grid = np.array(jax.devices()).reshape(2, 4)  # a row of 4 devices per process
    splits = [Placement(mesh=Mesh(d, ("data", "model"))).processes for d in (grid, grid.T)]
    host_state = jax.tree.map(lambda x: x.addressable_shards[0].data, state.params)
    run = {
        "planned": planned,
        "found": plan.found,
        "plan": str(plan),
        "process_batch_size": trainer.process_batch_size,
        "sizes": [int(h["micro_batch_size"]) for h in history],
        "examples": [int(h["examples"]) for h in history],
        "read": read[0],
        "injected": injector.injected,
        "runs": RUNS[0] // jax.local_device_count(),
        "errors": errors,
        "updates_after_end": len(after_end),
        "splits": splits,
        "evaluated": evaluated,
        "evaluated_reference": float(mlp_loss(host_state, held_out, None).mean()),
        "params": host(state.params),
        "reference": host(reference(params, batches)),
        "devices": jax.device_count(),
        "sharded": sharded_local(params, batches, process_id),
    }
    with open(out, "w") as f:
        json.dump(run, f)
    jax.distributed.shutdown()


def sharded_local(params, batches, process_id):
    """FSDP over both processes' 8 devices, each passing only its own rows to `step`.

    The parameters and Adam's moments are split over the data axis, which spans the two
    processes (each holds half of every leaf); 24 x 5 for T = 100, 12 rows a process per
    micro-step, which do not divide its 50.
    """
    from jax.experimental import multihost_utils

    import jax_adaptive as ja

    share = T // 2
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPTIMIZER, target_batch_size=T, micro_batch_size=24, plan_cache=False,
        mesh=ja.data_mesh(), param_sharding={"w1": P(None, "data"), "b1": P("data"),
                                             "w2": P("data")},
    )  # fmt: skip
    own = [{k: v[process_id * share : (process_id + 1) * share] for k, v in b.items()}
           for b in batches]  # fmt: skip
    state = trainer.init(params, own[0])
    for batch in own:
        state, _ = trainer.step(state, batch)
    mu = state.opt_state.inner_opt_state[0].mu
    whole = multihost_utils.process_allgather(state.params, tiled=True)
    return {
        "params": host(whole),
        "specs": {k: str(v.sharding.spec) for k, v in state.params.items()},
        "mu_specs": {k: str(v.sharding.spec) for k, v in mu.items()},
        # What this process holds of w1: half of it, on its 4 devices.
        "w1_local": sum(s.data.size for s in state.params["w1"].addressable_shards),
        "w1_size": int(state.params["w1"].size),
        "steps": trainer.plan_info.accumulation_steps,
        "process_batch_size": trainer.process_batch_size,
        "plan": str(trainer.plan_info),
    }


def buckets_job(process_id, port, out):
    """Each process buckets its own sequences; every update equals one device's on both."""
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    import jax_adaptive as ja

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    rng = np.random.default_rng(10 + process_id)  # each process its own lengths
    sequences = [{"x": rng.normal(size=(n, 3)).astype(np.float32)} for n in rng.integers(1, 9, 40)]

    def loss_fn(params, batch, rng):  # summed over each sequence's real tokens
        return jnp.sum(batch["mask"] * (batch["x"] @ params - 1.0) ** 2, axis=1)

    trainer = ja.BucketedTrainer(
        loss_fn, OPTIMIZER, buckets=(4, 8), target_tokens=96, mesh=ja.data_mesh(),
        micro_batch_size=8, plan_cache=False,
    )  # fmt: skip
    trained, step = [], trainer.step

    def recorded(state, batch):
        trained.append(batch)
        return step(state, batch)

    trainer.step = recorded
    params = jnp.zeros(3)
    state, history = trainer.fit(trainer.init(params, sequences[0]), sequences)
    # Each update's examples: both processes' rows, in process order, on one device.
    opt_state, reference = OPTIMIZER.init(params), params
    for batch in trained:
        whole = multihost_utils.process_allgather(batch.batch, tiled=True)
        whole = jax.device_put(whole, jax.local_devices()[0])

        def mean(p, whole=whole):
            return jnp.sum(loss_fn(p, whole, None)) / jnp.sum(whole["mask"])

        updates, opt_state = OPTIMIZER.update(jax.grad(mean)(reference), opt_state, reference)
        reference = optax.apply_updates(reference, updates)
    params = np.asarray(state.params.addressable_shards[0].data)
    run = {
        "buckets": [int(h["bucket"]) for h in history],
        "rows": [len(b.batch["mask"]) for b in trained],
        "tokens": [int(h["tokens"]) for h in history],
        "difference": float(np.max(np.abs(params - np.asarray(reference)))),
    }
    with open(out, "w") as f:
        json.dump(run, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "mesh":
        mesh_job(sys.argv[2])
    else:
        jobs = {"process": process_job, "local": local_job, "buckets": buckets_job}
        jobs[sys.argv[1]](int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
