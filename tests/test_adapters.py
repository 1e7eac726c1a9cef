"""The adapters take models written as Flax's own examples write them, with no glue.

Two models in the style of their sources (not copied): the ResNet of
examples/imagenet_resnet.py, as the Flax ImageNet example writes one (BatchNorm with
``axis_name="batch"``, written for ``pmap``), and a CNN here in the style of the NNX MNIST
tutorial (Dropout given ``rngs`` at call time). Both train through the adapters
unchanged and match a plain optax loop.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, full_batch_reference, load_example

import jax_adaptive as ja
from jax_adaptive import NnxTrainer
from jax_adaptive.models import (
    ResNet,
    linen_classifier_loss,
    nnx_classifier_loss,
)

KEY = jax.random.key(0)
SGD = optax.sgd(0.1)


def cross_entropy(logits, labels):
    """Independent of optax's loss: -log softmax at the label."""
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]


def image_batches(num, n, side=8, channels=3, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.normal(size=(n, side, side, channels)).astype(np.float32),
            "label": rng.integers(0, classes, n).astype(np.int32),
        }
        for _ in range(num)
    ]


# ------------------------------------------------------------------ linen, pmap style


# examples/imagenet_resnet.py: a ResNet as the Flax ImageNet example writes one
PMAP_MODEL = load_example("imagenet_resnet").ResNet(
    stage_sizes=(1, 1), num_classes=3, num_filters=4
)


def pmap_style_variables(batch):
    # the only hand-written binding of the axis, as a pmap-style script initialises
    init = jax.vmap(PMAP_MODEL.init, in_axes=(None, 0), axis_name="batch")
    variables = jax.jit(init)(jax.random.key(0, impl="rbg"), batch["image"][None, :2])
    return jax.tree.map(lambda a: a[0], variables)


def pmap_style_reference(variables, batches, micro):
    """Plain optax; the model under a hand-written size-1 vmap that names the axis."""
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = SGD.init(params)

    @jax.jit
    def grad(params, stats, x, y, total):
        def loss(p):
            def apply(x):
                return PMAP_MODEL.apply(
                    {"params": p, "batch_stats": stats}, x, mutable=["batch_stats"]
                )

            logits, new = jax.tree.map(lambda a: a[0], jax.vmap(apply, axis_name="batch")(x[None]))
            return jnp.sum(cross_entropy(logits, y)) / total, new["batch_stats"]

        return jax.grad(loss, has_aux=True)(params)

    for batch in batches:
        total = len(batch["label"])
        grads = jax.tree.map(jnp.zeros_like, params)
        for start in range(0, total, micro):
            part = slice(start, start + micro)
            g, stats = grad(params, stats, batch["image"][part], batch["label"][part], total)
            grads = jax.tree.map(jnp.add, grads, g)
        updates, opt_state = SGD.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats


def test_the_unbound_axis_is_the_error_the_option_removes():
    batch = image_batches(1, 4)[0]
    variables = pmap_style_variables(batch)
    params, state = variables["params"], {"batch_stats": variables["batch_stats"]}
    plain = linen_classifier_loss(PMAP_MODEL, mutable=("batch_stats",))
    with pytest.raises(NameError, match="pass axis_name='batch' to linen_classifier_loss") as e:
        plain(params, state, batch, KEY)
    assert "unbound axis name: batch" in str(e.value.__cause__)  # JAX's own, kept
    bound = linen_classifier_loss(PMAP_MODEL, mutable=("batch_stats",), axis_name="batch")
    (losses, aux), new_state = jax.jit(bound)(params, state, batch, KEY)
    assert losses.shape == aux["accuracy"].shape == (4,)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_a_pmap_style_resnet_trains_through_the_adapter_exactly():
    T, micro = 8, 4
    batches = image_batches(2, T)
    variables = pmap_style_variables(batches[0])
    trainer = ja.AdaptiveTrainer(
        linen_classifier_loss(PMAP_MODEL, mutable=("batch_stats",), axis_name="batch"),
        SGD, target_batch_size=T, micro_batch_size=micro, has_aux=True, has_state=True,
    )  # fmt: skip
    state = trainer.init(
        variables["params"], batches[0], model_state={"batch_stats": variables["batch_stats"]}
    )
    for batch in batches:
        state, _ = trainer.step(state, batch)
    params, stats = pmap_style_reference(variables, batches, micro)
    assert_trees_close(state.model_state["batch_stats"], stats, 1e-5)
    assert_trees_close(state.params, params, 1e-5)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), stats, variables["batch_stats"])
    assert min(jax.tree.leaves(moved)) > 1e-4  # every running average moved


def test_frozen_batch_norm_is_exact_at_a_micro_batch_that_does_not_divide():
    T = 8
    batches = image_batches(2, T, seed=1)
    variables = pmap_style_variables(batches[0])
    # running averages away from init (0 and 1), so that frozen is not the identity
    stats = jax.tree.map(lambda a: a + 0.3, variables["batch_stats"])
    trainer = ja.AdaptiveTrainer(
        linen_classifier_loss(PMAP_MODEL, mutable=("batch_stats",), train=False),
        SGD, target_batch_size=T, micro_batch_size=3, has_aux=True, has_state=True,
    )  # fmt: skip
    state = trainer.init(variables["params"], batches[0], model_state={"batch_stats": stats})
    for batch in batches:
        state, _ = trainer.step(state, batch)

    def frozen_loss(params, batch, rng):
        logits = PMAP_MODEL.apply(
            {"params": params, "batch_stats": stats}, batch["image"], train=False
        )
        return cross_entropy(logits, batch["label"])

    expected = full_batch_reference(frozen_loss, SGD, variables["params"], batches)
    assert_trees_close(state.params, expected, 1e-5)
    assert_trees_close(state.model_state["batch_stats"], stats, 0)  # frozen


def test_evaluation_mode_is_the_models_evaluation():
    model = ResNet(stage_sizes=(1,), num_filters=4, num_classes=3)
    batch = image_batches(1, 5)[0]
    variables = jax.jit(model.init)(jax.random.key(0, impl="rbg"), batch["image"][:1])
    variables = {
        "params": variables["params"],
        "batch_stats": jax.tree.map(lambda a: a + 0.5, variables["batch_stats"]),
    }
    loss_fn = linen_classifier_loss(model, mutable=("batch_stats",), train=False)
    (losses, aux), state = jax.jit(loss_fn)(
        variables["params"], {"batch_stats": variables["batch_stats"]}, batch, KEY
    )
    logits = model.apply(variables, batch["image"], train=False)
    np.testing.assert_allclose(losses, cross_entropy(logits, batch["label"]), rtol=1e-5)
    np.testing.assert_array_equal(aux["accuracy"], logits.argmax(-1) == batch["label"])
    assert_trees_close(state["batch_stats"], variables["batch_stats"], 0)


def test_ghost_batches_need_batch_statistics_in_training():
    model = ResNet(stage_sizes=(1,), num_filters=4, num_classes=3)
    with pytest.raises(ValueError, match="ghost_batch_size=8 needs batch statistics"):
        linen_classifier_loss(model, ghost_batch_size=8)
    with pytest.raises(ValueError, match="train=False"):
        linen_classifier_loss(model, mutable=("batch_stats",), train=False, ghost_batch_size=8)


# ------------------------------------------------------------------ NNX, tutorial style


class TutorialStyleCNN(nnx.Module):
    """Conv, BatchNorm, average pooling; Dropout built without rngs, given them per call."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(8, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(16, rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(16 * 2 * 2, 32, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def digit_batches(num, n, seed=0):
    return image_batches(num, n, side=8, channels=1, classes=10, seed=seed)


def test_a_tutorial_style_cnn_takes_its_rngs_from_the_trainer():
    model, batch = TutorialStyleCNN(rngs=nnx.Rngs(0)), digit_batches(1, 6)[0]
    loss_fn = jax.jit(nnx_classifier_loss(model, mutable=nnx.BatchStat))
    params, stats = nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat)
    (losses, _aux), new_stats = loss_fn(params, stats, batch, KEY)

    reference = nnx.clone(model)  # what a tutorial-style training step would call
    reference.train()
    logits = reference(batch["image"], rngs=nnx.Rngs(KEY))
    np.testing.assert_allclose(losses, cross_entropy(logits, batch["label"]), rtol=1e-5)
    assert_trees_close(new_stats, nnx.state(reference, nnx.BatchStat), 1e-5)
    (other, _), _ = loss_fn(params, stats, batch, jax.random.key(1))
    assert not np.allclose(other, losses)  # the masks follow the trainer's key
    assert model.dropout1.deterministic is False  # the model itself untouched


def test_a_tutorial_style_cnn_in_evaluation_mode_trains_exactly():
    T = 8
    model, batches = TutorialStyleCNN(rngs=nnx.Rngs(0)), digit_batches(2, T, seed=2)
    graphdef, params, rest = nnx.split(nnx.clone(model), nnx.Param, ...)
    trainer = NnxTrainer(
        model,
        SGD,
        target_batch_size=T,
        loss_fn=nnx_classifier_loss(model, mutable=nnx.BatchStat, train=False),
        has_aux=True,
        micro_batch_size=3,
    )
    for batch in batches:
        trainer.step(batch)

    def eval_loss(p, batch, rng):
        module = nnx.merge(graphdef, p, rest, copy=True)
        module.eval()
        return cross_entropy(module(batch["image"]), batch["label"])

    expected = full_batch_reference(eval_loss, SGD, params, batches)
    assert_trees_close(nnx.state(model, nnx.Param), expected, 1e-5)
    frozen = nnx.state(nnx.merge(graphdef, params, rest), nnx.BatchStat)
    assert_trees_close(nnx.state(model, nnx.BatchStat), frozen, 0)


def test_the_nnx_trainer_updates_the_module_in_place():
    T = 8
    model, batches = TutorialStyleCNN(rngs=nnx.Rngs(0)), digit_batches(3, T, seed=3)
    before = nnx.clone(model)
    trainer = NnxTrainer(model, optax.adam(1e-2), target_batch_size=T, micro_batch_size=4)
    losses = [float(trainer.step(batch)["loss"]) for batch in batches]
    assert int(trainer.state.updates) == 3 and all(np.isfinite(losses))
    assert_trees_close(nnx.state(model, nnx.Param), trainer.state.params, 0)
    assert_trees_close(nnx.state(model, nnx.BatchStat), trainer.state.model_state, 0)
    for kind in (nnx.Param, nnx.BatchStat):
        moved = jax.tree.map(
            lambda a, b: np.abs(a - b).max(), nnx.state(model, kind), nnx.state(before, kind)
        )
        assert min(jax.tree.leaves(moved)) > 1e-5, kind
    model.eval()  # and the module serves as itself
    assert model(batches[0]["image"]).shape == (T, 10)


# ------------------------------------------------- linen, as the Flax MNIST example


def smoothed_cross_entropy(logits, labels):
    """The user's own per-example loss: cross-entropy against smoothed labels."""
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), 0.2)
    return -jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1)


def test_a_model_without_train_and_a_loss_of_its_own_train_exactly():
    """The MNIST example's CNN has no ``train`` argument: it is called without one."""
    from user_model import CNN

    model, T = CNN(num_classes=3), 8
    batches = image_batches(2, T)
    params = model.init(KEY, batches[0]["image"][:1])["params"]
    loss_fn = linen_classifier_loss(model, loss=smoothed_cross_entropy)
    losses, aux = loss_fn(params, batches[0], KEY)
    logits = model.apply({"params": params}, batches[0]["image"])
    np.testing.assert_allclose(losses, smoothed_cross_entropy(logits, batches[0]["label"]))
    np.testing.assert_array_equal(aux["accuracy"], logits.argmax(-1) == batches[0]["label"])
    assert not np.allclose(losses, cross_entropy(logits, batches[0]["label"]))
    trainer = ja.AdaptiveTrainer(
        loss_fn, SGD, target_batch_size=T, micro_batch_size=3, has_aux=True, plan_cache=False
    )
    state = trainer.init(params, batches[0])
    for batch in batches:
        state, _ = trainer.step(state, batch)
    reference = full_batch_reference(
        lambda p, b, r: smoothed_cross_entropy(model.apply({"params": p}, b["image"]), b["label"]),
        SGD, params, batches,
    )  # fmt: skip
    assert_trees_close(state.params, reference, 1e-5)
