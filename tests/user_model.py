"""A user's own model for ``python -m jax_adaptive.train --model user_model:make_model``.

Written the way the official Flax examples write a model (the MNIST example's CNN: a
linen Module with ``nn.compact``), smaller, with a per-example cross-entropy: the
factory returns the model and its loss, one value per example, no mean.
"""

import flax.linen as nn
import optax
from flax import nnx


class CNN(nn.Module):
    """A simple CNN model, as in the Flax MNIST example: narrower by default, the
    example's own with ``features=(32, 64), dense=256``."""

    num_classes: int = 10
    features: tuple[int, ...] = (8,)
    dense: int = 32

    @nn.compact
    def __call__(self, x):
        for features in self.features:
            x = nn.Conv(features=features, kernel_size=(3, 3))(x)
            x = nn.relu(x)
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=self.dense)(x)
        x = nn.relu(x)
        x = nn.Dense(features=self.num_classes)(x)
        return x


def cross_entropy(logits, labels):
    """Per-example softmax cross-entropy: shape [m]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def make_model(num_classes):
    """The factory ``--model`` calls: (model, per-example loss)."""
    return CNN(num_classes=num_classes), cross_entropy


def mean_loss_model(num_classes):
    """A mistake the command line must name: the loss is a mean, not per example."""
    return CNN(num_classes=num_classes), lambda logits, labels: cross_entropy(logits, labels).mean()


def not_a_pair(num_classes):
    """Another: the factory returns the model alone."""
    return CNN(num_classes=num_classes)


def failing_model(num_classes):
    """A factory whose own code fails: its traceback must reach the user."""
    return CNN(num_classes=num_classes // 0), cross_entropy


def three_classes(num_classes):
    """Outputs 3 classes whatever the data has: its loss on 10-class labels is NaN."""
    return CNN(num_classes=3), cross_entropy


def exits(num_classes):
    """A factory that ends the process: the run must not pass for one that trained."""
    import sys

    sys.exit(0)


class NnxCNN(nnx.Module):
    """The same CNN as the Flax NNX MNIST tutorial writes one (BatchNorm, and a Dropout that
    takes ``rngs`` at call time), smaller."""

    def __init__(self, num_classes: int, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(rate=0.1)
        self.linear1 = nnx.Linear(8 * 8 * 8, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, num_classes, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = nnx.avg_pool(nnx.relu(self.batch_norm(self.conv(x))), (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(self.dropout(nnx.relu(self.linear1(x)), rngs=rngs))


def make_nnx_model(num_classes):
    """An NNX factory for ``--model``: (model, per-example loss)."""
    return NnxCNN(num_classes, rngs=nnx.Rngs(0)), cross_entropy
