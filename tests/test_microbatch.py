"""micro_batch_grad and micro_batch_sum against plain full-batch JAX and optax."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_adaptive as ja
from jax_adaptive.microbatch import micro_batch_sum

T = 12


def _loss(params, batch, rng):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None])
    logits = hidden @ params["w2"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses, {"correct": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}


def _problem(total=T, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(rng.normal(size=(5, 16)), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=16), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
    }
    batch = {
        "x": rng.normal(size=(total, 5)).astype(np.float32),
        "y": rng.integers(0, 3, size=total).astype(np.int32),
    }
    return params, batch


def _close(got, want, rtol=1e-5, atol=1e-6):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


@pytest.mark.parametrize("m", [1, 4, 5, 7, 12, 13])
def test_equals_the_full_batch_gradient_for_divisors_and_non_divisors(m):
    params, batch = _problem()

    def mean_loss(p):  # the reference: the plain full-batch mean, one jax.grad
        losses, aux = _loss(p, batch, None)
        return losses.mean(), aux["correct"].mean()

    (want_loss, want_correct), want_grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    out = jax.jit(ja.micro_batch_grad(_loss, m, has_aux=True))(params, batch)
    _close(out.grads, want_grads)
    np.testing.assert_allclose(out.loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(out.aux["correct"], want_correct, rtol=1e-6)
    np.testing.assert_allclose(out.sums["correct"], want_correct * T, rtol=1e-6)


@pytest.mark.parametrize("m", [3, 5])
def test_weights_weight_each_loss_of_the_sum(m):
    params, batch = _problem()
    weights = np.random.default_rng(1).uniform(size=T).astype(np.float32)
    weights[[2, 11]] = 0.0

    def weighted(p):
        return jnp.sum(weights * _loss(p, batch, None)[0]) / T

    want = jax.grad(weighted)(params)
    out = jax.jit(ja.micro_batch_grad(_loss, m, has_aux=True))(params, batch, weights=weights)
    _close(out.grads, want)
    np.testing.assert_allclose(out.loss, weighted(params), rtol=1e-6)


@pytest.mark.parametrize("m", [4, 5])
def test_one_optax_update_equals_the_full_batch_update_and_optax_microbatch(m):
    params, batch = _problem()
    opt = optax.adam(0.1)

    def mean_loss(p, b):
        return _loss(p, b, None)[0].mean()

    def update(grads):
        updates, _ = opt.update(grads, opt.init(params), params)
        return optax.apply_updates(params, updates)

    want = update(jax.grad(mean_loss)(params, batch))
    got = update(jax.jit(ja.micro_batch_grad(_loss, m, has_aux=True))(params, batch).grads)
    _close(got, want)
    if T % m == 0:  # optax.microbatch needs a divisor: the sum of per-micro-batch sums
        sum_grad = jax.grad(lambda p, b: _loss(p, b, None)[0].sum())
        summed = optax.microbatch(sum_grad, argnums=1, microbatch_size=m)(params, batch)
        _close(update(jax.tree.map(lambda g: g / T, summed)), got)


def test_model_state_is_threaded_through_the_micro_batches_in_order():
    def loss(params, model_state, batch, rng):  # counts micro-batches, sums the rows seen
        losses = (batch * params) ** 2
        return losses, {"calls": model_state["calls"] + 1, "last": batch[0]}

    batch = jnp.arange(10.0)
    out = jax.jit(ja.micro_batch_grad(loss, 4, has_state=True))(
        2.0, batch, model_state={"calls": jnp.int32(0), "last": jnp.float32(-1)}
    )
    assert int(out.model_state["calls"]) == math.ceil(10 / 4)
    assert float(out.model_state["last"]) == 6.0  # the last micro-batch: rows 6..9
    np.testing.assert_allclose(out.grads, jax.grad(lambda w: ((batch * w) ** 2).mean())(2.0))


def test_each_micro_batch_gets_its_own_key():
    def loss(params, batch, rng):
        return params * batch + jax.random.uniform(rng, batch.shape)

    out = jax.jit(ja.micro_batch_grad(loss, 3))(1.0, jnp.zeros(6), jax.random.key(0))
    keys = [jax.random.fold_in(jax.random.key(0), offset) for offset in (0, 3)]
    want = sum(float(jax.random.uniform(k, (3,)).sum()) for k in keys) / 6
    np.testing.assert_allclose(out.loss, want, rtol=1e-6)


def test_the_micro_batches_run_in_one_in_jit_loop():
    params, batch = _problem()
    jaxpr = jax.make_jaxpr(ja.micro_batch_grad(_loss, 5, has_aux=True))(params, batch)
    top = [eqn.primitive.name for eqn in jaxpr.eqns]
    loops = [eqn for eqn in jaxpr.eqns if eqn.primitive.name in ("scan", "while")]
    assert len(loops) == 1 and "dot_general" not in top  # all the work in one loop
    assert "dot_general" in str(loops[0])  # which holds the loss and its gradient


@pytest.mark.parametrize("m", [1, 5, 12])
def test_micro_batch_sum_of_clipped_per_example_gradients(m):
    params, batch = _problem()

    def per_example_grads(b):
        def one(x, y):
            single = jax.tree.map(lambda v: v[None], {"x": x, "y": y})
            return jax.grad(lambda p: _loss(p, single, None)[0][0])(params)

        return jax.vmap(one)(b["x"], b["y"])

    def clipped(grads):  # each example's gradient clipped to norm 1
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, 1) for g in grads.values()))
        scale = jnp.minimum(1.0, 1.0 / norms)
        return jax.tree.map(lambda g: g * scale.reshape(-1, *[1] * (g.ndim - 1)), grads)

    want = jax.tree.map(lambda g: g.sum(0), clipped(per_example_grads(batch)))

    def fn(micro_batch, weights, offset):
        grads = clipped(per_example_grads(micro_batch))
        return jax.tree.map(lambda g: jnp.tensordot(weights, g, 1), grads)

    _close(jax.jit(micro_batch_sum(fn, m))(batch), want, rtol=1e-5, atol=1e-5)


def test_errors_show_the_values():
    with pytest.raises(ValueError, match="micro_batch_size=0 must be positive"):
        ja.micro_batch_grad(_loss, 0)
    with pytest.raises(TypeError, match="must be an int"):
        ja.micro_batch_grad(_loss, 2.0)
    params, batch = _problem()
    with pytest.raises(ValueError, match=r"weights must have shape \(12,\)"):
        ja.micro_batch_grad(_loss, 4, has_aux=True)(params, batch, weights=np.ones(5))
    with pytest.raises(ValueError, match="per-example"):
        ja.micro_batch_grad(lambda p, b, r: _loss(p, b, r)[0].mean(), 4)(params, batch)


@pytest.mark.parametrize("has_state", [False, True])
def test_an_aux_metric_named_loss_is_refused_as_the_trainer_does(has_state):
    params, batch = _problem()

    def loss(p, b, r):  # an aux "loss" of 7 would replace the loss of about 1
        losses, _ = _loss(p, b, r)
        return losses, {"loss": jnp.full_like(losses, 7.0)}

    def stateful(p, state, b, r):
        return loss(p, b, r), state

    grad_fn = ja.micro_batch_grad(stateful if has_state else loss, 5, has_aux=True,
                                  has_state=has_state)  # fmt: skip
    with pytest.raises(ValueError, match="aux has a metric named 'loss'"):
        jax.jit(grad_fn)(params, batch)
