"""A small Flax model zoo and the adapters that turn a model into a per-example loss."""

from jax_adaptive.models.adapters import linen_classifier_loss
from jax_adaptive.models.cnn import CNN
from jax_adaptive.models.mlp import MLP

__all__ = ["CNN", "MLP", "linen_classifier_loss"]
