"""Keep your own loop: the Flax examples' ``train_step``, made adaptive in a few lines.

``train_step`` below is the step of the Flax examples (MNIST), written for the whole
batch at once. ``build_train_step`` is the same step for a micro-batch size: the loss
is per example (no ``.mean()``), `jax_adaptive.micro_batch_grad` takes the place of
``jax.value_and_grad`` and computes the exact full-batch gradient ``m`` examples at a
time, and `jax_adaptive.AdaptiveStep` picks the largest ``m`` that fits the device,
re-planning if it runs out of memory. The loop itself does not change. Run:

    python examples/own_loop.py
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import jax_adaptive as ja
from jax_adaptive.data import synthetic_images


class CNN(nn.Module):
    """The Flax MNIST example's CNN, smaller."""

    @nn.compact
    def __call__(self, x):
        """Logits for a batch of images ``[N, H, W, C]``."""
        x = nn.Conv(features=8, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=32)(x)
        x = nn.relu(x)
        return nn.Dense(features=10)(x)


def create_train_state(rng, learning_rate=3e-3):
    """The Flax examples' train state: parameters, ``apply_fn`` and an optax optimizer."""
    cnn = CNN()
    params = cnn.init(rng, jnp.ones([1, 8, 8, 3]))["params"]
    tx = optax.adam(learning_rate)
    return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


# Before: the whole batch at once.
@jax.jit
def train_step(state, batch):
    """The Flax examples' step: one update on the whole batch."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return state, {"loss": loss, "accuracy": accuracy}


# After: the same update, micro_batch_size examples at a time.
def build_train_step(micro_batch_size):
    """The same step for one micro-batch size; `jax_adaptive.AdaptiveStep` picks it."""

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        def loss_fn(params, batch, rng):
            logits = state.apply_fn({"params": params}, batch["image"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            return loss, {"accuracy": (jnp.argmax(logits, -1) == batch["label"]) * 1.0}

        out = ja.micro_batch_grad(loss_fn, micro_batch_size, has_aux=True)(state.params, batch)
        state = state.apply_gradients(grads=out.grads)
        return state, {"loss": out.loss, "accuracy": out.aux["accuracy"]}

    return train_step


def main(steps: int = 5, batch_size: int = 256, memory_limit: int | None = 10**6) -> float:
    """Trains the CNN on synthetic images with your own loop; returns the last loss."""
    state = create_train_state(jax.random.key(0))
    adaptive_train_step = ja.AdaptiveStep(
        build_train_step, memory_limit=memory_limit, plan_cache=False
    )
    for i in range(steps):
        batch = synthetic_images(batch_size, image_shape=(8, 8, 3), seed=i)
        state, metrics = adaptive_train_step(state, batch)
        plan = adaptive_train_step.plan_info
        print(
            f"step {i}: loss {float(metrics['loss']):.4f}, accuracy "
            f"{float(metrics['accuracy']):.3f} ({plan.micro_batch_size} x "
            f"{plan.accumulation_steps} micro-batches)"
        )
    return float(metrics["loss"])


if __name__ == "__main__":
    main()
