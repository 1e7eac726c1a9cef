"""Masked rows never reach the gradient: a row of weight 0 is selected out, not multiplied.

``0 * nan`` is ``nan``: a row of weight 0 whose loss is NaN or inf used to turn the
parameters into NaN (in the backward pass its zero cotangent met its NaN partials)
while the reported loss stayed finite. Both entry points share the micro-batch's
gradient (`jax_adaptive.step.weighted_grad`): the trainer and `micro_batch_grad`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, mlp_loss, mlp_params, regression_batches

import jax_adaptive as ja

T = 32
OPTIMIZER = optax.adam(1e-2)


def poisoned(seed):
    """A batch with NaN and inf losses on rows of weight 0, and those weights.

    Row 3's input is NaN, row 30's target inf (30 is also what the padding of the last
    micro-batch of 5 repeats), and rows 10-14, one of them NaN, are a whole micro-batch
    of 5 with no row of non-zero weight. Row 1 weighs 2.5: weights are not only 0 and 1.
    """
    batch = regression_batches(1, T, seed=seed)[0]
    batch["x"][3] = np.nan
    batch["x"][12] = np.nan
    batch["y"][30] = np.inf
    weights = np.ones(T, np.float32)
    weights[[3, 10, 11, 12, 13, 14, 30]] = 0
    weights[1] = 2.5
    return batch, weights


def reference_grads(params, batch, weights):
    """The gradient of sum(w * loss) / T over the rows of non-zero weight alone."""
    live = weights != 0
    rows = jax.tree.map(lambda x: x[live], batch)
    return jax.jit(
        jax.value_and_grad(lambda p: jnp.sum(weights[live] * mlp_loss(p, rows, None)) / T)
    )(params)


@pytest.mark.parametrize("micro", [16, 5])
def test_the_trainer_keeps_nan_rows_of_weight_0_out_of_the_update(micro):
    problems = [poisoned(seed) for seed in range(2)]
    trainer = ja.AdaptiveTrainer(mlp_loss, OPTIMIZER, target_batch_size=T, micro_batch_size=micro)
    state = trainer.init(mlp_params(), problems[0][0])
    params, opt_state, losses = mlp_params(), OPTIMIZER.init(mlp_params()), []
    for batch, weights in problems:
        state, metrics = trainer.step(state, batch, weights=weights)
        loss, grads = reference_grads(params, batch, weights)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append((float(metrics["loss"]), float(loss)))
    assert trainer.micro_batch_size == micro
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))
    assert_trees_close(state.params, params, 1e-5)
    got, want = np.array(losses).T
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("micro", [16, 5])
def test_micro_batch_grad_keeps_nan_rows_of_weight_0_out_of_the_gradient(micro):
    batch, weights = poisoned(0)
    out = jax.jit(ja.micro_batch_grad(mlp_loss, micro))(mlp_params(), batch, weights=weights)
    loss, grads = reference_grads(mlp_params(), batch, weights)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(out.grads))
    assert_trees_close(out.grads, grads, 1e-5)
    np.testing.assert_allclose(out.loss, loss, rtol=1e-5)


def test_a_micro_batch_with_no_live_row_leaves_the_model_state():
    def loss(params, model_state, batch, rng):  # counts the micro-batches that ran
        return mlp_loss(params, batch, rng), {"calls": model_state["calls"] + 1}

    batch, weights = poisoned(0)
    out = jax.jit(ja.micro_batch_grad(loss, 5, has_state=True))(
        mlp_params(), batch, weights=weights, model_state={"calls": jnp.int32(0)}
    )
    assert int(out.model_state["calls"]) == math.ceil(T / 5) - 1  # rows 10-14: none
    assert_trees_close(out.grads, reference_grads(mlp_params(), batch, weights)[1], 1e-5)


def test_an_update_whose_weights_are_all_0_applies_a_zero_gradient():
    batch, _ = poisoned(0)  # rows 3 and 12 NaN, row 30 inf: no live row to stand in
    weights = np.zeros(T, np.float32)
    trainer = ja.AdaptiveTrainer(mlp_loss, OPTIMIZER, target_batch_size=T, micro_batch_size=5)
    state, metrics = trainer.step(trainer.init(mlp_params(), batch), batch, weights=weights)
    zero = jax.tree.map(jnp.zeros_like, mlp_params())
    updates, _ = OPTIMIZER.update(zero, OPTIMIZER.init(mlp_params()), mlp_params())
    assert_trees_close(state.params, optax.apply_updates(mlp_params(), updates), 1e-6)
    assert float(metrics["loss"]) == 0.0
    out = jax.jit(ja.micro_batch_grad(mlp_loss, 5))(mlp_params(), batch, weights=weights)
    assert_trees_close(out.grads, zero, 0)
    assert float(out.loss) == 0.0
