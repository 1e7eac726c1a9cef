import jax
import numpy as np
import optax
import pytest
from helpers import load_example

import jax_adaptive as ja
from jax_adaptive.data import synthetic_images

eqx = pytest.importorskip("equinox")
example = load_example("equinox_model")


def test_the_equinox_adapter_gives_the_full_batch_update():
    model = eqx.nn.MLP(16 * 16 * 3, 10, width_size=8, depth=1, key=jax.random.key(0))
    params, loss_fn = example.equinox_classifier_loss(model)
    batch = synthetic_images(40)
    trainer = ja.AdaptiveTrainer(loss_fn, optax.sgd(0.5), target_batch_size=40,
                                 micro_batch_size=7, has_aux=True, plan_cache=False)  # fmt: skip
    state, _ = trainer.step(trainer.init(params, batch), batch)

    def mean_loss(p):  # the reference: one plain full-batch optax step
        return loss_fn(p, batch, None)[0].mean()

    grads = jax.grad(mean_loss)(params)
    updates, _ = optax.sgd(0.5).update(grads, optax.sgd(0.5).init(params))
    expected = optax.apply_updates(params, updates)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_example_trains_under_a_memory_limit():
    losses_fall = example.main(updates=6, memory_limit=2 * 10**6)
    assert losses_fall < 2.0
