import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, full_batch_reference

import jax_adaptive as ja
from jax_adaptive.models import (
    GPT,
    ResNet,
    ResNet50,
    ResNetTiny,
    ViTMicro,
    gpt_token_loss,
    linen_classifier_loss,
    nnx_classifier_loss,
)

KEY = jax.random.key(0)
SMALL_RESNET = {"stage_sizes": (1, 1), "num_filters": 4, "num_classes": 3}
SMALL_GPT = {"vocab_size": 13, "max_len": 16, "width": 16, "depth": 2, "heads": 2}


def images(n, side=16, seed=0):
    return np.random.default_rng(seed).normal(size=(n, side, side, 3)).astype(np.float32)


def tokens(n, length, seed=0):
    return np.random.default_rng(seed).integers(0, 13, (n, length)).astype(np.int32)


def init(model, x):
    # an RBG key: XLA:CPU compiles a threefry initialisation of a ResNet in 5-8 s, this in 1
    return jax.jit(model.init)(jax.random.key(0, impl="rbg"), x)


def manual_cross_entropy(logits, labels):
    """Independent of optax: -log softmax at the label."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize(
    ("model", "x", "out"),
    [
        (ResNetTiny(), images(2), (2, 10)),
        (ResNet(stage_sizes=(1, 2), block="bottleneck", num_filters=4, num_classes=5),
         images(2, side=9), (2, 5)),
        (ResNetTiny(num_classes=7), images(3, side=32), (3, 7)),
        (ResNet50(dtype=jnp.bfloat16), np.zeros((1, 224, 224, 3), np.float32), (1, 1000)),
        (ViTMicro(), images(2), (2, 10)),
        (ViTMicro(pool="mean", num_classes=4), images(3, side=8), (3, 4)),
        (GPT(**SMALL_GPT), tokens(2, 5), (2, 5, 13)),
        (GPT(**SMALL_GPT, tie_embeddings=False), tokens(3, 16), (3, 16, 13)),
    ],
)  # fmt: skip
def test_output_shapes(model, x, out):
    logits, variables = jax.eval_shape(model.init_with_output, KEY, x)
    assert logits.shape == out and logits.dtype == jnp.float32
    assert {p.dtype for p in jax.tree.leaves(variables["params"])} == {jnp.dtype(jnp.float32)}


def test_untied_gpt_has_its_own_output_layer():
    tied = jax.eval_shape(GPT(**SMALL_GPT).init, KEY, tokens(1, 4))["params"]
    untied = jax.eval_shape(GPT(**SMALL_GPT, tie_embeddings=False).init, KEY, tokens(1, 4))
    assert "head" not in tied and untied["params"]["head"]["kernel"].shape == (16, 13)


@pytest.mark.parametrize("model", [ResNetTiny(dtype=jnp.bfloat16), ViTMicro(dtype=jnp.bfloat16)])
def test_dtype_is_the_compute_dtype(model):
    variables = jax.eval_shape(model.init, KEY, images(1))
    _, inter = jax.eval_shape(
        lambda v: model.apply(v, images(2), capture_intermediates=True, mutable=["intermediates"]),
        variables,
    )
    dtypes = {x.dtype for x in jax.tree.leaves(inter)}
    assert jnp.dtype(jnp.bfloat16) in dtypes


def test_configuration_errors():
    with pytest.raises(ValueError, match="block="):
        jax.eval_shape(ResNet(block="wide").init, KEY, images(1))
    with pytest.raises(ValueError, match="length=17"):
        jax.eval_shape(GPT(**SMALL_GPT).init, KEY, tokens(1, 17))


# ------------------------------------------------------------------ ResNet BatchNorm


def test_resnet_batch_stats_update_in_training_and_serve_evaluation():
    model, x = ResNet(**SMALL_RESNET), images(4)
    variables = init(model, x)
    train = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))
    evaluate = jax.jit(model.apply)
    _, updated = train(variables, x)
    old, new = variables["batch_stats"], updated["batch_stats"]
    assert jax.tree.structure(old) == jax.tree.structure(new)
    moved = jax.tree.map(lambda a, b: not np.allclose(a, b), old, new)
    assert all(jax.tree.leaves(moved)), moved
    trained = {"params": variables["params"], **updated}
    # evaluation reads the running statistics, so it changes with them ...
    assert not np.allclose(evaluate(variables, x), evaluate(trained, x), atol=1e-4)
    # ... and each example's logits are its own, unlike training's batch statistics
    others = x.copy()
    others[1:] *= 3
    np.testing.assert_allclose(evaluate(trained, x)[0], evaluate(trained, others)[0], atol=1e-5)
    assert not np.allclose(train(trained, x)[0][0], train(trained, others)[0][0], atol=1e-4)


def bn_reference(model, variables, batches, micro, optimizer):
    """Plain optax, BatchNorm state threaded through micro-batches of ``micro``."""
    params, stats = variables["params"], variables["batch_stats"]
    opt_state = optimizer.init(params)

    @jax.jit
    def grad(params, stats, x, y, total):
        def loss(p):
            logits, new = model.apply(
                {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return jnp.sum(manual_cross_entropy(logits, y)) / total, new["batch_stats"]

        return jax.grad(loss, has_aux=True)(params)

    for batch in batches:
        total = len(batch["label"])
        grads = jax.tree.map(jnp.zeros_like, params)
        for start in range(0, total, micro):
            part = slice(start, start + micro)
            g, stats = grad(params, stats, batch["image"][part], batch["label"][part], total)
            grads = jax.tree.map(jnp.add, grads, g)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats


@pytest.mark.parametrize("micro", [8, 4])
def test_resnet_with_batch_norm_trains_exactly(micro):
    model = ResNet(**SMALL_RESNET)
    rng = np.random.default_rng(0)
    batches = [
        {"image": images(8, seed=i), "label": rng.integers(0, 3, 8).astype(np.int32)}
        for i in range(2)
    ]
    variables = init(model, batches[0]["image"])
    trainer = ja.AdaptiveTrainer(
        linen_classifier_loss(model, mutable=("batch_stats",)),
        optax.sgd(0.1),
        target_batch_size=8,
        micro_batch_size=micro,
        has_aux=True,
        has_state=True,
    )
    state = trainer.init(
        variables["params"], batches[0], model_state={"batch_stats": variables["batch_stats"]}
    )
    for batch in batches:
        state, _ = trainer.step(state, batch)
    params, stats = bn_reference(model, variables, batches, micro, optax.sgd(0.1))
    assert_trees_close(state.model_state["batch_stats"], stats, 1e-5)
    assert_trees_close(state.params, params, 1e-5)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), params, variables["params"])
    assert min(jax.tree.leaves(moved)) > 1e-4  # every parameter trained


# ------------------------------------------------------------------ GPT


def test_gpt_is_causal():
    model = GPT(**SMALL_GPT)
    x = tokens(2, 10)
    params = init(model, x)
    apply = jax.jit(model.apply)
    changed = x.copy()
    changed[:, 6] = (changed[:, 6] + 1) % 13
    before, after = apply(params, x), apply(params, changed)
    np.testing.assert_allclose(before[:, :6], after[:, :6], atol=1e-6)
    assert not np.allclose(before[:, 6:], after[:, 6:], atol=1e-4)


def test_gpt_token_loss_is_the_masked_sum_of_next_token_losses():
    model = GPT(**SMALL_GPT, dropout_rate=0.1)
    x = tokens(3, 8)
    mask = np.ones((3, 8), bool)
    mask[0, 5:] = mask[2, 2:] = False  # right padding
    params = init(model, x)["params"]
    loss_fn = jax.jit(gpt_token_loss(model))
    losses = loss_fn(params, {"tokens": x, "mask": mask}, KEY)
    assert losses.shape == (3,)

    # against an independent reference, dropout off; with no mask every prediction counts
    no_dropout = GPT(**SMALL_GPT)
    logits = jax.jit(no_dropout.apply)({"params": params}, x)
    per_token = manual_cross_entropy(logits[:, :-1], x[:, 1:])
    eval_loss = jax.jit(gpt_token_loss(no_dropout))
    for batch, weights in [({"tokens": x, "mask": mask}, mask[:, 1:]), ({"tokens": x}, 1)]:
        expected = jnp.sum(per_token * weights, axis=1)
        np.testing.assert_allclose(eval_loss(params, batch, KEY), expected, rtol=1e-5)

    # padded tokens do not contribute, whatever their values
    padded = np.where(mask, x, (x + 5) % 13)
    np.testing.assert_allclose(
        loss_fn(params, {"tokens": padded, "mask": mask}, KEY), losses, rtol=1e-6
    )
    # dropout follows the rng
    other = loss_fn(params, {"tokens": x, "mask": mask}, jax.random.key(1))
    assert not np.allclose(other, losses)


# ------------------------------------------------------------------ NNX


class NnxNet(nnx.Module):
    def __init__(self, *, dropout=0.0, batch_norm=False, rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs) if batch_norm else None
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        x = self.hidden(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.out(self.dropout(nnx.relu(x)))


def classification_batch(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "image": rng.normal(size=(n, 4)).astype(np.float32),
        "label": rng.integers(0, 3, n).astype(np.int32),
    }


def test_nnx_adapter_equals_calling_the_module():
    model, batch = NnxNet(rngs=nnx.Rngs(0)), classification_batch()
    losses, aux = nnx_classifier_loss(model)(nnx.state(model, nnx.Param), batch, KEY)
    logits = model(batch["image"])
    np.testing.assert_allclose(losses, manual_cross_entropy(logits, batch["label"]), rtol=1e-6)
    np.testing.assert_array_equal(aux["accuracy"], logits.argmax(-1) == batch["label"])


def test_nnx_dropout_follows_the_trainers_rng_and_leaves_the_model_alone():
    model, batch = NnxNet(dropout=0.5, rngs=nnx.Rngs(0)), classification_batch()
    model.eval()
    loss_fn = jax.jit(nnx_classifier_loss(model))
    params = nnx.state(model, nnx.Param)
    first, _ = loss_fn(params, batch, KEY)
    np.testing.assert_array_equal(loss_fn(params, batch, KEY)[0], first)
    assert not np.allclose(loss_fn(params, batch, jax.random.key(1))[0], first)
    assert model.dropout.deterministic  # still in evaluation mode
    eval_losses = manual_cross_entropy(model(batch["image"]), batch["label"])
    assert not np.allclose(first, eval_losses)


def test_nnx_batch_stats_are_model_state():
    model, batch = NnxNet(batch_norm=True, rngs=nnx.Rngs(0)), classification_batch()
    with pytest.raises(ValueError, match=r"mutable=nnx\.BatchStat"):
        nnx_classifier_loss(model)
    loss_fn = nnx_classifier_loss(model, mutable=nnx.BatchStat)
    (losses, _), stats = loss_fn(
        nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat), batch, KEY
    )
    reference = nnx.clone(model)
    reference.train()
    logits = reference(batch["image"])
    np.testing.assert_allclose(losses, manual_cross_entropy(logits, batch["label"]), rtol=1e-6)
    assert_trees_close(stats, nnx.state(reference, nnx.BatchStat), 1e-6)
    assert not np.allclose(stats["norm"]["mean"], nnx.state(model, nnx.BatchStat)["norm"]["mean"])


def test_nnx_model_trains_exactly_in_the_trainer():
    model = NnxNet(rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batches = [classification_batch(8, seed=i) for i in range(2)]
    trainer = ja.AdaptiveTrainer(
        nnx_classifier_loss(model),
        optax.adam(1e-2),
        target_batch_size=8,
        micro_batch_size=3,
        has_aux=True,
    )
    state = trainer.init(params, batches[0])
    for batch in batches:
        state, _ = trainer.step(state, batch)

    def direct_loss(p, batch, rng):
        return manual_cross_entropy(nnx.merge(graphdef, p, rest)(batch["image"]), batch["label"])

    expected = full_batch_reference(direct_loss, optax.adam(1e-2), params, batches)
    assert_trees_close(state.params, expected, 1e-5)
    nnx.update(model, state.params)
    assert_trees_close(nnx.state(model, nnx.Param), state.params, 0)
