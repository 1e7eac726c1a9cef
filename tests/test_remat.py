"""Remat as the planner's second lever: a plan over (policy, micro-batch), exact.

The model is a causal language model whose layers run under ``lax.scan``, as users write
them: XLA:CPU's memory analysis shows what ``jax.checkpoint`` saves only on scanned
layers (docs/memory.md).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, donating_step_builder, full_batch_reference

import jax_adaptive as ja
from jax_adaptive.adaptive_step import signature_of
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.remat import maybe_checkpoint

VOCAB, LENGTH, WIDTH, HIDDEN, LAYERS = 16, 32, 16, 64, 6
T = 8
POLICIES = {"none": None, "full": jax.checkpoint_policies.nothing_saveable}
# Ledgers with Adam on XLA:CPU (jax 0.10), micro-batch 1 to 4: without remat 612, 865,
# 1117, 1387 kB; with nothing_saveable 426, 492, 558, 624 kB.
SMALL = 600_000  # nothing fits without remat; 3 fits with it
LARGE = 10**9  # the whole target batch fits without remat


def init_params(key):
    keys = jax.random.split(key, 5)

    def normal(k, shape, scale):
        return scale * jax.random.normal(k, shape)

    return {
        "embed": normal(keys[0], (VOCAB, WIDTH), 0.5),
        "layers": {
            "qkv": normal(keys[1], (LAYERS, WIDTH, 3 * WIDTH), WIDTH**-0.5),
            "up": normal(keys[2], (LAYERS, WIDTH, HIDDEN), WIDTH**-0.5),
            "down": normal(keys[3], (LAYERS, HIDDEN, WIDTH), HIDDEN**-0.5),
        },
        "head": normal(keys[4], (WIDTH, VOCAB), WIDTH**-0.5),
    }


def block(x, p):
    """A causal self-attention layer and an MLP, both residual."""
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(WIDTH)
    scores = jnp.where(jnp.tril(jnp.ones((LENGTH, LENGTH), bool))[None], scores, -1e9)
    x = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)
    return x + jnp.tanh(x @ p["up"]) @ p["down"], None


def make_loss(policy):
    """Per-example mean next-token cross-entropy, the layers scanned under ``policy``."""
    body = maybe_checkpoint(block, policy)

    def loss(params, batch, rng):
        x, _ = jax.lax.scan(body, params["embed"][batch[:, :-1]], params["layers"])
        logits = x @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(axis=1)

    return loss


def token_batches(num, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, (T, LENGTH + 1)).astype(np.int32) for _ in range(num)]


def train(limit, batches, **kwargs):
    trainer = ja.AdaptiveTrainer(
        ja.RematChoices.from_factory(make_loss, POLICIES), optax.adam(1e-2),
        target_batch_size=T, memory_limit=limit, **kwargs,
    )  # fmt: skip
    state = trainer.init(init_params(jax.random.key(0)), batches[0])
    plan = trainer.plan_info
    for batch in batches:
        state, _ = trainer.step(state, batch)
    return trainer, plan, state


def test_when_nothing_fits_without_remat_the_plan_remats_and_stays_exact():
    batches = token_batches(3)
    # Without remat, not even one example fits this device.
    plain = ja.AdaptiveTrainer(make_loss(None), optax.adam(1e-2), target_batch_size=T,
                               memory_limit=SMALL, plan_cache=False)  # fmt: skip
    with pytest.raises(ja.NothingFitsError):
        plain.init(init_params(jax.random.key(0)), batches[0])

    trainer, plan, state = train(SMALL, batches, plan_cache=False)
    assert "remat policy full" in str(plan) and "none nothing fits" in str(plan)
    assert plan.micro_batch_size >= 2 and plan.accumulation_steps < T
    assert trainer.ledger(plan.micro_batch_size).total <= SMALL
    reference = full_batch_reference(
        make_loss(None), optax.adam(1e-2), init_params(jax.random.key(0)), batches
    )
    assert_trees_close(state.params, reference, 1e-5)


def test_with_room_the_plan_drops_remat_and_never_plans_it():
    batches = token_batches(2, seed=1)
    trainer, plan, state = train(LARGE, batches, plan_cache=False)
    assert plan.micro_batch_size == T and plan.accumulation_steps == 1
    assert "remat policy none (micro-batch by policy: none 8 x 1)" in str(plan)
    assert trainer.compiles == 1  # the whole batch without remat: remat never compiled
    reference = full_batch_reference(
        make_loss(None), optax.adam(1e-2), init_params(jax.random.key(0)), batches
    )
    assert_trees_close(state.params, reference, 1e-5)


def test_throughput_chooses_the_policy_by_measured_speed_and_stays_exact():
    # 1 MB: without remat 2 fits (4 micro-steps), with it the whole batch (1): the rule
    # takes remat; timed, the faster per update is taken unless remat is within 3%.
    batches = token_batches(2, seed=2)
    trainer, plan, state = train(1_000_000, batches, plan_cache=False, objective="throughput")
    timed = dict(trainer.remat.seconds)  # each policy's plan, timed per update
    assert set(timed) == {"none", "full"} and "timed per update: none" in plan.remat
    faster = min(timed, key=timed.get)
    assert trainer.remat.policy == (faster if timed["full"] > timed[faster] * 1.03 else "full")
    reference = full_batch_reference(
        make_loss(None), optax.adam(1e-2), init_params(jax.random.key(0)), batches
    )
    assert_trees_close(state.params, reference, 1e-5)


def test_when_no_policy_fits_the_error_names_them():
    with pytest.raises(ja.NothingFitsError, match=r"not under any remat policy \(none, full\)"):
        train(100_000, token_batches(1), plan_cache=False)


# ---------------------------------------------------------------- AdaptiveStep


def make_build_step(policy):
    """A user's own jitted Adam step at micro-batch ``m``, its layers under ``policy``."""
    return donating_step_builder(make_loss(policy), optax.adam(1e-2))


def run_steps(limit, batches, **kwargs):
    """An ``AdaptiveStep`` of a build_step per policy (its ledgers: the trainer's, to 0.2%)."""
    step = ja.AdaptiveStep(
        ja.RematChoices.from_factory(make_build_step, POLICIES), memory_limit=limit, **kwargs
    )
    params = init_params(jax.random.key(0))
    state = (params, optax.adam(1e-2).init(params))
    plan = step.plan(state, batches[0])
    for batch in batches:
        state, _ = step(state, batch)
    return step, plan, state


def test_adaptive_step_remats_when_nothing_fits_without_it_and_stays_exact():
    batches = token_batches(3)
    plain = ja.AdaptiveStep(make_build_step(None), memory_limit=SMALL, plan_cache=False)
    params = init_params(jax.random.key(0))
    with pytest.raises(ja.NothingFitsError):
        plain.plan((params, optax.adam(1e-2).init(params)), batches[0])

    step, plan, state = run_steps(SMALL, batches, plan_cache=False)
    assert "remat policy full" in str(plan) and "none nothing fits" in str(plan)
    assert step.remat.policy == "full" and plan.remat == str(step.remat)
    assert 1 <= plan.micro_batch_size < T and plan.ledger.total <= SMALL
    # Only the chosen size's step stays compiled; the policy not chosen holds none.
    signature = signature_of((state, batches[0]))
    held = {name: step.sizing.bind((signature, name), None).compiled_sizes() for name in POLICIES}
    assert held == {"none": [], "full": [plan.micro_batch_size]}
    reference = full_batch_reference(
        make_loss(None), optax.adam(1e-2), init_params(jax.random.key(0)), batches
    )
    assert_trees_close(state[0], reference, 1e-5)


def test_adaptive_step_with_room_drops_remat_and_never_plans_it():
    batches = token_batches(2, seed=1)
    step, plan, state = run_steps(LARGE, batches, plan_cache=False)
    assert plan.micro_batch_size == T and plan.accumulation_steps == 1
    assert plan.remat == "none (micro-batch by policy: none 8 x 1)"
    remat = step.sizing.bind((signature_of((state, batches[0])), "full"), None)
    assert remat.memory_model.points == {}  # the whole batch without remat: full never compiled
    reference = full_batch_reference(
        make_loss(None), optax.adam(1e-2), init_params(jax.random.key(0)), batches
    )
    assert_trees_close(state[0], reference, 1e-5)


@pytest.mark.parametrize("entry", ["trainer", "step"])
def test_a_second_run_takes_the_choice_from_the_plan_cache_and_compiles_no_size(tmp_path, entry):
    run = {"trainer": train, "step": run_steps}[entry]
    cache = PlanCache(tmp_path / "plans.json")
    first, first_plan, _ = run(SMALL, token_batches(1), plan_cache=cache)
    second, second_plan, _ = run(SMALL, token_batches(1), plan_cache=cache)
    assert first.compiles >= 3
    assert second.compiles == 1  # the chosen size's program, to run it; nothing searched
    assert [t.decided_by for t in second.search_log] == ["plan cache"]
    assert second_plan.micro_batch_size == first_plan.micro_batch_size
    assert "full" in second_plan.remat and "none nothing fits" in second_plan.remat
    assert second.remat.source == "plan cache" and second.remat.sizes == first.remat.sizes


def test_adaptive_step_when_no_policy_fits_the_error_names_them():
    with pytest.raises(ja.NothingFitsError, match=r"not under any remat policy \(none, full\)"):
        run_steps(100_000, token_batches(1), plan_cache=False)


# ---------------------------------------------------------------- AdaptiveNnxStep

# Ledgers of the NNX model's gradient (Adam, XLA:CPU, jax 0.10), micro-batch 1 to 3:
# without remat 422, 549, 682 kB; with nothing_saveable 330, 365, 408 kB.
NNX_SMALL = 400_000  # nothing fits without remat; 2 fits with it


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class Stack(nnx.Module):
    """Residual MLP layers stacked by ``nnx.vmap`` and run by ``nnx.scan``, as Flax writes them."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x, policy=None):
        def layer(x, block):
            return block(x)

        layer = layer if policy is None else nnx.remat(layer, policy=policy)
        x = nnx.scan(layer, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        return self.head(x)[..., 0]


def nnx_loss(policy):
    return lambda model, batch: jnp.mean((model(batch["x"], policy) - batch["y"]) ** 2)


def make_train_step(policy):
    """Flax's NNX step, its loss running the layers under ``policy``."""

    def train_step(model, optimizer, batch):
        loss, grads = ja.micro_batch_value_and_grad(nnx_loss(policy))(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step


def nnx_batches(num, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(T, LENGTH, WIDTH)).astype(np.float32),
            "y": rng.normal(size=(T, LENGTH)).astype(np.float32),
        }
        for _ in range(num)
    ]


def nnx_objects():
    model = Stack(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def nnx_reference(batches):
    """Flax's own step under ``nnx.jit``: the whole batch, no remat, no jax_adaptive."""
    model, optimizer = nnx_objects()

    @nnx.jit
    def train_step(model, optimizer, batch):
        grads = nnx.grad(nnx_loss(None))(model, batch)
        optimizer.update(model, grads)

    for batch in batches:
        train_step(model, optimizer, batch)
    return nnx.state(model, nnx.Param)


def run_nnx(limit, batches):
    model, optimizer = nnx_objects()
    choices = ja.RematChoices.from_factory(make_train_step, POLICIES)
    step = ja.AdaptiveNnxStep(choices, memory_limit=limit, plan_cache=False)
    for batch in batches:
        step(model, optimizer, batch)
    return step, nnx.state(model, nnx.Param)


def test_nnx_step_remats_when_nothing_fits_without_it_and_stays_exact():
    batches = nnx_batches(3)
    plain = ja.AdaptiveNnxStep(make_train_step(None), memory_limit=NNX_SMALL, plan_cache=False)
    with pytest.raises(ja.NothingFitsError):
        plain(*nnx_objects(), batches[0])

    step, params = run_nnx(NNX_SMALL, batches)
    plan = step.plan_info
    assert "remat policy full" in str(plan) and "none nothing fits" in str(plan)
    assert 1 <= plan.micro_batch_size < T and plan.ledger.total <= NNX_SMALL
    assert_trees_close(params, nnx_reference(batches), 1e-5)


def test_nnx_step_with_room_drops_remat():
    batches = nnx_batches(2, seed=1)
    step, params = run_nnx(LARGE, batches)
    assert step.plan_info.remat == "none (micro-batch by policy: none 8 x 1)"
    assert_trees_close(params, nnx_reference(batches), 1e-5)
