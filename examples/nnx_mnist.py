"""Flax's NNX MNIST example, its training step made adaptive by three changed lines.

The model, the loss, the optimizer, the metrics and the loop are written as Flax's
``examples/mnist/train.py`` writes them (since January 2026: NNX). The changes, as a diff
of the step (docs/flax.md)::

    +import jax_adaptive as ja
    -@nnx.jit
    +@ja.AdaptiveNnxStep
     def train_step(model, optimizer, metrics, batch, rngs):
    -  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    +  grad_fn = ja.micro_batch_value_and_grad(loss_fn, has_aux=True)

Run it on random MNIST-shaped data (no download): ``python examples/nnx_mnist.py``;
``--memory-limit 40_000_000`` trains the batch of 512 on a simulated 40 MB device.
"""

import argparse
from functools import partial

import numpy as np
import optax
from flax import nnx

import jax_adaptive as ja


class CNN(nnx.Module):
    """The example's CNN: two convolutions with BatchNorm and Dropout, two dense layers."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs):  # noqa: D102
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def loss_fn(model: CNN, batch, rngs):
    """The batch's mean cross-entropy, and the logits."""
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


@ja.AdaptiveNnxStep
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch, rngs):
    """Train for a single step (the example's, micro-batched where the batch does not fit)."""
    grad_fn = ja.micro_batch_value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    """The example's evaluation step, unchanged."""
    loss, logits = loss_fn(model, batch, None)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def random_batches(num: int, batch_size: int, seed: int = 0):
    """MNIST-shaped batches of noise whose label is the brightest of 10 image bands."""
    rng = np.random.default_rng(seed)
    for _ in range(num):
        image = rng.random((batch_size, 28, 28, 1), dtype=np.float32)
        label = (
            image.reshape(batch_size, -1)[:, :780].reshape(batch_size, 10, 78).mean(-1).argmax(-1)
        )
        yield {"image": image, "label": label.astype(np.int32)}


def main(argv=None) -> dict[str, float]:
    """Trains the example's model for ``--steps`` batches; returns the last metrics."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--memory-limit", type=lambda s: int(s.replace("_", "")), default=None)
    args = parser.parse_args(argv)
    step = train_step
    if args.memory_limit is not None:  # the same step, on a simulated smaller device
        step = ja.AdaptiveNnxStep(train_step.step_fn, memory_limit=args.memory_limit)
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    rngs = nnx.Rngs(0)
    model.train()
    for i, batch in enumerate(random_batches(args.steps, args.batch_size)):
        step(model, optimizer, metrics, batch, rngs)
        print(f"step {i + 1}: {step.plan_info}")
    train_metrics = {name: float(value) for name, value in metrics.compute().items()}
    print(f"train loss {train_metrics['loss']:.4f}, accuracy {train_metrics['accuracy']:.3f}")
    return train_metrics


if __name__ == "__main__":
    main()
