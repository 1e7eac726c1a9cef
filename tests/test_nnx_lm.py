"""A causal language model's token-weighted step, converted, against its original.

The model, loss and step are examples/nnx_lm.py's, written as Flax's language-model
examples write them. The reference is the step as one writes it for ``@nnx.jit``
(below, verbatim: it closes over the batch and divides by the batch's real tokens); it
never calls jax_adaptive.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import load_example

import jax_adaptive as ja

lm = load_example("nnx_lm")

CONFIG = lm.Config(vocab_size=32, max_length=12, features=32, num_heads=2, hidden=64)
T = 12


def batches():
    """Three batches of 12; rows 5 to 9 of the first are padding only."""
    out = list(lm.random_batches(3, T, CONFIG, seed=1))
    out[0] = {key: value.copy() for key, value in out[0].items()}
    for value in out[0].values():
        value[5:10] = lm.PAD_ID
    return out


BATCHES = batches()


@nnx.jit
def original_train_step(model, optimizer, metrics, batch):
    inputs, targets = batch["inputs"], batch["targets"]
    weights = jnp.where(targets > lm.PAD_ID, 1, 0).astype(jnp.float32)
    attention_mask = lm.make_causal_attn_mask(inputs > lm.PAD_ID)

    def loss_fn(model):
        logits = model(inputs, attention_mask)
        loss, weight_sum = lm.compute_weighted_cross_entropy(logits, targets, weights)
        return loss / weight_sum, logits

    (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)


def objects():
    model = lm.TransformerLM(CONFIG, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.3, momentum=0.9), wrt=nnx.Param)
    return model, optimizer, nnx.MultiMetric(loss=nnx.metrics.Average("loss"))


def train(step):
    """Three updates; each update's loss, and the objects."""
    model, optimizer, metrics = objects()
    losses = []
    for batch in BATCHES:
        step(model, optimizer, metrics, batch)
        losses.append(float(metrics.compute()["loss"]))
        metrics.reset()
    return (model, optimizer), losses


@pytest.fixture(scope="module")
def reference():
    return train(original_train_step)


def limit_at(size):
    """A device that holds the converted step at ``size`` and nothing larger."""
    probe = ja.AdaptiveNnxStep(lm.train_step.step_fn, plan_cache=False)
    probe(*objects(), BATCHES[0])  # plans the whole batch
    return probe.step.ledger(size).total


def test_the_first_batch_has_a_micro_batch_of_padding_only():
    assert int(lm.count_tokens(BATCHES[0])) > 0
    assert int(lm.count_tokens({k: v[5:10] for k, v in BATCHES[0].items()})) == 0


@pytest.mark.parametrize("size", [5, 7])  # 5: micro-batch 2 is padding only
def test_the_converted_step_equals_the_original_at_plans_that_do_not_divide(size, reference):
    step = ja.AdaptiveNnxStep(
        lm.train_step.step_fn, memory_limit=limit_at(size), objective="max", plan_cache=False
    )
    (model, optimizer), losses = train(step)
    assert step.micro_batch_size == size and T % size
    (want_model, want_optimizer), want_losses = reference
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    for filt, got, want in [
        (nnx.Param, model, want_model),
        (nnx.OptState, optimizer, want_optimizer),
    ]:
        got, want = jax.tree.leaves(nnx.state(got, filt)), jax.tree.leaves(nnx.state(want, filt))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _gradients(**kwargs):
    model = objects()[0]
    grad_fn = ja.micro_batch_value_and_grad(lm.loss_fn, has_aux=True, micro_batch_size=5, **kwargs)
    (loss, logits), grads = nnx.jit(grad_fn)(model, BATCHES[0])
    return loss, logits, nnx.to_pure_dict(grads)


def test_the_gradient_with_a_micro_batch_of_padding_only_is_the_full_batchs():
    model, batch = objects()[0], BATCHES[0]
    inputs, targets = batch["inputs"], batch["targets"]
    weights = jnp.where(targets > lm.PAD_ID, 1, 0).astype(jnp.float32)
    mask = lm.make_causal_attn_mask(inputs > lm.PAD_ID)

    def loss_fn(model):  # the original's, closing over the batch
        logits = model(inputs, mask)
        loss, weight_sum = lm.compute_weighted_cross_entropy(logits, targets, weights)
        return loss / weight_sum, logits

    (want_loss, want_logits), want = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    loss, logits, grads = _gradients(normalizer=lm.count_tokens)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(nnx.to_pure_dict(want)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Weighted by examples instead, the micro-batch of padding is 0 / 0: the bug the
    # normalizer fixes.
    assert np.isnan(_gradients()[0])


@dataclasses.dataclass
class _Bad:
    value: float

    def __call__(self, batch):
        return jnp.asarray(self.value) + 0 * batch["x"].sum()


@pytest.mark.parametrize(
    ("normalizer", "match"),
    [
        (lambda batch: batch["x"].sum(axis=1), r"normalizer returned shape \(8,\), not a scalar"),
        (_Bad(-3.0), "normalizer returned -3.0: it must be finite and at least 0"),
        (_Bad(float("inf")), "normalizer returned inf: it must be finite"),
    ],
)
def test_a_bad_normalizer_is_one_line_and_nothing_is_applied(normalizer, match):
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = np.asarray(model.kernel[...])

    def loss_fn(model, batch):
        return (model(batch["x"]) ** 2).sum() / normalizer(batch)

    @ja.AdaptiveNnxStep
    def step(model, optimizer, batch):
        grad_fn = ja.micro_batch_value_and_grad(loss_fn, normalizer=normalizer)
        _, grads = grad_fn(model, batch)
        optimizer.update(model, grads)

    with pytest.raises(ValueError, match=match) as error:
        step(model, optimizer, {"x": np.ones((8, 3), np.float32)})
    assert "\n" not in str(error.value)
    np.testing.assert_array_equal(model.kernel[...], before)


def test_nnx_trainer_with_a_normalizer_equals_the_original(reference):
    model = objects()[0]
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def per_sequence_loss(params, batch, rng):  # each sequence's summed token losses
        model = nnx.merge(graphdef, params, rest)
        inputs, targets = batch["inputs"], batch["targets"]
        weights = jnp.where(targets > lm.PAD_ID, 1, 0).astype(jnp.float32)
        logits = model(inputs, lm.make_causal_attn_mask(inputs > lm.PAD_ID))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return (losses * weights).sum(axis=1)

    trainer = ja.NnxTrainer(
        model, optax.sgd(0.3, momentum=0.9), target_batch_size=T, loss_fn=per_sequence_loss,
        micro_batch_size=5, normalizer=lm.count_tokens, plan_cache=False,
    )  # fmt: skip
    losses = [float(trainer.step(batch)["loss"]) for batch in BATCHES]
    (want_model, _), want_losses = reference
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    got, want = nnx.state(model, nnx.Param), nnx.state(want_model, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
