"""A causal language model sharded as Flax's NNX guide shards one, through every entry point.

``python sharded_lm_job.py OUT.json`` runs on 8 CPU devices (set before JAX starts, which
is why this is a script). The model is examples/nnx_lm.py's Transformer (layers stacked
by ``nnx.vmap``, run by ``nnx.scan``) with its kernels and embedding annotated by
``nnx.with_partitioning`` over the ``data`` axis (FSDP) and its state constrained to
``nnx.get_partition_spec`` under ``jax.set_mesh``. One process checks, each against an
independent reference on one device:

- ``step``: examples/nnx_lm.py's ``train_step`` under `AdaptiveNnxStep`, 5 calls, under a
  memory limit the replicated state does not fit at micro-batch 1 (`NothingFitsError`)
  and the sharded state fits at a micro-batch that does not divide T = 47, against the
  same step written with ``nnx.value_and_grad`` under plain ``nnx.jit`` on one device.
  Calls 2, 3 and 4 run out of memory, injected: the gradient's run (run again: the size
  ran before), the update's run (`OptimizerStepOutOfMemory`; the objects as they were,
  then the call again), the gradient's run and its retry (the plan shrinks);
- ``nnx_trainer``: `NnxTrainer` with the mesh and no ``param_sharding`` (the annotations
  taken) on a fresh model, 3 updates at 16 x 3 (the plan's micro-batch must be a multiple
  of the 8 data shards) with the token count as its ``normalizer``, against the NNX
  step's reference after 3 calls;
- ``evaluator``: `Evaluator` on the sharded parameters, per-sequence loss and token count;
- ``own_step``: `AdaptiveStep` around a user's jitted SGD step on the sharded parameters
  (``micro_batch_grad`` of the per-sequence summed loss), 3 calls.
"""

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from helpers import FailedRuns, load_example
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_adaptive as ja

lm = load_example("nnx_lm")
CONFIG = lm.Config(vocab_size=64, max_length=8, features=64, num_heads=4, hidden=256)
T, CALLS, EVAL = 47, 5, 37  # T prime: no micro-batch in 2..46 divides it
# Adam's eps at 1e-3, not 1e-8: a parameter whose gradient is 0 but for rounding (the
# padding's embedding) moves by the learning rate's order at eps 1e-8, whatever the sign of
# its noise, so even plain nnx.jit on the sharded model differed from one device by 2.7e-3
# after 2 steps (measured); at 1e-3 rounding stays rounding.
OPTIMIZER = optax.adamw(1e-2, eps=1e-3)


def partitioned(spec, init=None):
    return nnx.with_partitioning(init or nnx.initializers.lecun_normal(), spec)


class Block(lm.Block):
    """examples/nnx_lm.py's block, its kernels split over ``data`` (FSDP)."""

    def __init__(self, config, *, rngs):
        c = config
        self.attention_norm = nnx.LayerNorm(c.features, rngs=rngs)
        # query/key/value kernels are (features, heads, head dim), the output's (heads,
        # head dim, features): the last dimension splits over 8 in both.
        self.attention = nnx.MultiHeadAttention(
            c.num_heads, c.features, decode=False, rngs=rngs,
            kernel_init=partitioned((None, None, "data")),
        )  # fmt: skip
        self.mlp_norm = nnx.LayerNorm(c.features, rngs=rngs)
        self.up = nnx.Linear(c.features, c.hidden, kernel_init=partitioned((None, "data")),
                             rngs=rngs)  # fmt: skip
        self.down = nnx.Linear(c.hidden, c.features, kernel_init=partitioned(("data", None)),
                               rngs=rngs)  # fmt: skip


class ShardedLM(lm.TransformerLM):
    """examples/nnx_lm.py's model, annotated as Flax's sharding guide annotates one."""

    def __init__(self, config, *, rngs):
        embed_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
        self.embed = nnx.Embed(config.vocab_size, config.features, rngs=rngs,
                               embedding_init=partitioned(("data", None), embed_init))  # fmt: skip
        self.positions = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (config.max_length, config.features))
        )

        # The stacked layers' leading axis is unsplit (None), as the guide's scan does.
        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def layers(rngs):
            return Block(config, rngs=rngs)

        self.layers = layers(rngs)
        self.final_norm = nnx.LayerNorm(config.features, rngs=rngs)
        self.head = nnx.Linear(config.features, config.vocab_size,
                               kernel_init=partitioned(("data", None)), rngs=rngs)  # fmt: skip


@nnx.jit
def create():
    model = ShardedLM(CONFIG, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model


def objects(model):
    return (model, nnx.Optimizer(model, OPTIMIZER, wrt=nnx.Param),
            nnx.MultiMetric(loss=nnx.metrics.Average("loss")))  # fmt: skip


def plain_step(model, optimizer, metrics, batch):
    """The step as one writes it for ``@nnx.jit``: the full batch, ``nnx.value_and_grad``."""
    (loss, _), grads = nnx.value_and_grad(lm.loss_fn, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    metrics.update(loss=loss)


def on_one_device(model):
    """A replicated model on device 0 with ``model``'s values (no sharding annotations)."""
    with jax.default_device(jax.devices()[0]):
        copy = lm.TransformerLM(CONFIG, rngs=nnx.Rngs(0))
    state = nnx.state(copy)
    values = jax.device_put(jax.device_get(nnx.to_pure_dict(nnx.state(model))), jax.devices()[0])
    nnx.replace_by_pure_dict(state, values)  # values only: no sharding metadata
    nnx.update(copy, state)
    return copy


def params_of(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def everything(objects):
    return [np.asarray(x) for o in objects for x in jax.tree.leaves(nnx.state(o))]


def largest_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def specs(model):
    return {
        "up": str(model.layers.up.kernel[...].sharding.spec),
        "query": str(model.layers.attention.query.kernel[...].sharding.spec),
        "embed": str(model.embed.embedding[...].sharding.spec),
    }


def named(fired):
    """``FailedRuns.fired`` with each run named by its program."""
    return [(run, "update" if size == 0 else "gradient") for run, size in fired]


def nnx_step(mesh, batches):
    result = {}
    train_step = lm.train_step.step_fn
    with jax.set_mesh(mesh):
        model = create()
    reference = objects(on_one_device(model))  # outside the mesh: one device's
    with jax.set_mesh(mesh):
        # The limit: the sharded step's ledger at 20 (measured on a copy, no limit yet).
        step = ja.AdaptiveNnxStep(train_step, objective="max", plan_cache=False)
        step(*objects(create()), batches[0])
        limit = step.step.ledger(20).total
        result["limit"] = limit
        # The same values replicated on every device do not fit even one example: a
        # batch of 1 (no micro-batch of T needs less) raises NothingFitsError.
        replicated = on_one_device(model)
        nnx.update(replicated, jax.device_put(nnx.state(replicated), NamedSharding(mesh, P())))
        alone = ja.AdaptiveNnxStep(train_step, memory_limit=limit, plan_cache=False)
        try:
            alone(*objects(replicated), jax.tree.map(lambda x: x[:1], batches[0]))
            result["replicated"] = "fitted"
        except ja.NothingFitsError as error:
            result["replicated"] = str(error).splitlines()[0]
            result["replicated_needs"] = alone.search_log[-1].estimated_bytes
        step.set_memory_limit(limit)  # what it measured is kept: fewer compiles
        trained = objects(model)
        result["before"] = specs(model)
        plans, fired, sizes = [], [], []
        faults = FailedRuns(step, runs=set())
        for call, batch in enumerate(batches, 1):
            if call == 2:  # the gradient's first run at the planned size: run again
                step.fault_hook = faults = FailedRuns(step, runs={1})
            if call == 4:  # the gradient's run and its retry: the plan shrinks
                step.fault_hook = faults = FailedRuns(step, runs={1, 2})
            if call == 3:  # the update's run (the gradient's comes first)
                step.fault_hook = faults = FailedRuns(step, runs={2})
                values = everything(trained)
                try:
                    step(*trained, batch)
                except ja.OptimizerStepOutOfMemory:
                    result["intact"] = largest_difference(everything(trained), values)
                    result["intact_specs"] = specs(model)
                fired += named(faults.fired)
                step.fault_hook = None
            step(*trained, batch)
            fired += named(faults.fired) if call in (2, 4) else []
            step.fault_hook = None
            plans.append(str(step.plan_info))
            sizes.append(step.micro_batch_size)
            if call == 3:
                after_3 = params_of(model)
        result["after"] = specs(model)
    for call, batch in enumerate(batches, 1):  # outside the mesh: on one device
        nnx.jit(plain_step)(*reference, jax.device_put(batch, jax.devices()[0]))
        if call == 3:
            reference_3 = params_of(reference[0])
            result["difference_3"] = largest_difference(after_3, reference_3)
    result["difference"] = largest_difference(params_of(model), params_of(reference[0]))
    result.update(plans=plans, sizes=sizes, fired=fired, T=T)
    return result, model, reference_3


def nnx_trainer(mesh, batches, reference_3):
    """`NnxTrainer` on a fresh sharded model (its annotations taken), 3 updates at 16 x 3.

    ``reference_3``: the parameters of the same model after 3 plain full-batch ``nnx.jit``
    steps on one device (`nnx_step`'s reference), which this run must equal.
    """
    with jax.set_mesh(mesh):
        model = create()
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, batch, rng):  # each sequence's summed loss; the normalizer divides
        return sequence_loss(nnx.merge(graphdef, params, rest), batch)[0]

    trainer = ja.NnxTrainer(
        model, OPTIMIZER, target_batch_size=T, loss_fn=loss, micro_batch_size=16,
        normalizer=lm.count_tokens, mesh=mesh, plan_cache=False,
    )  # fmt: skip
    with jax.set_mesh(mesh):
        for batch in batches:
            trainer.step(batch)
    plan = trainer.trainer.plan_info
    return {
        "difference": largest_difference(params_of(model), reference_3),
        "specs": specs(model),
        "steps": plan.accumulation_steps,
        "micro_batch_size": plan.micro_batch_size,
        "plan": str(plan),
    }


def sequence_loss(model, batch):
    """Per sequence: its summed cross-entropy over real target tokens, and their number."""
    inputs, targets = batch["inputs"], batch["targets"]
    weights = (targets > lm.PAD_ID).astype(jnp.float32)
    logits = model(inputs, lm.make_causal_attn_mask(inputs > lm.PAD_ID))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (losses * weights).sum(axis=1), weights.sum(axis=1)


def evaluator(mesh, model, data):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def metric_fn(params, batch):
        loss, tokens = sequence_loss(nnx.merge(graphdef, params, rest), batch)
        return {"loss": loss, "tokens": tokens}

    with jax.set_mesh(mesh):
        got = ja.Evaluator(metric_fn, max_batch_size=16, plan_cache=False).evaluate(params, data)
    want_loss, want_tokens = jax.jit(sequence_loss)(on_one_device(model), data)
    return {
        "loss": got["loss"],
        "want_loss": float(np.mean(want_loss)),
        "tokens": got["tokens"],
        "want_tokens": float(np.mean(want_tokens)),
        "examples": got["examples"],
    }


def own_step(mesh, model, batches):
    """`AdaptiveStep` around a user's jitted SGD step with FSDP-sharded parameters."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, batch, rng):
        return sequence_loss(nnx.merge(graphdef, params, rest), batch)[0]

    def build(m):
        @jax.jit
        def train_step(params, batch):
            grads = ja.micro_batch_grad(loss, m)(params, batch).grads
            return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

        return train_step

    step = ja.AdaptiveStep(build, objective="max", plan_cache=False)
    got = params
    with jax.set_mesh(mesh):
        for i, batch in enumerate(batches):
            if i == 1:  # a limit under the whole batch: micro-batches from here on
                step.set_memory_limit(step.ledger(20).total)
            got = step(got, batch)
    one = jax.devices()[0]
    want = jax.device_put(jax.device_get(params), one)
    rest_one = jax.device_put(jax.device_get(rest), one)

    @jax.jit
    def full(p, batch):
        per = sequence_loss(nnx.merge(graphdef, p, rest_one), batch)[0]
        return per.mean()

    for batch in batches:
        grads = jax.grad(full)(want, jax.device_put(batch, one))
        want = jax.tree.map(lambda p, g: p - 0.01 * g, want, grads)
    flat = [np.asarray(x) for x in jax.tree.leaves(got)]
    return {
        "difference": largest_difference(flat, [np.asarray(x) for x in jax.tree.leaves(want)]),
        "micro_batch_size": step.micro_batch_size,
        "steps": step.plan_info.accumulation_steps,
        "plan": str(step.plan_info),
        "up_spec": str(got["layers"]["up"]["kernel"][...].sharding.spec),
    }


def main(out):
    start = time.perf_counter()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batches = list(lm.random_batches(CALLS, T, CONFIG, seed=0))
    result = {}
    result["step"], model, reference_3 = nnx_step(mesh, batches)
    result["seconds_step"] = time.perf_counter() - start
    result["nnx_trainer"] = nnx_trainer(mesh, batches[:3], reference_3)
    result["seconds_nnx_trainer"] = time.perf_counter() - start
    (data,) = lm.random_batches(1, EVAL, CONFIG, seed=1)
    result["evaluator"] = evaluator(mesh, model, data)
    result["seconds_evaluator"] = time.perf_counter() - start
    result["own_step"] = own_step(mesh, model, batches[:3])
    result["seconds"] = time.perf_counter() - start
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
