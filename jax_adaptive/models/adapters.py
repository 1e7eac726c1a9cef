"""Adapters: a Flax model into the per-example loss `AdaptiveTrainer` takes."""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax


def linen_classifier_loss(
    model: nn.Module, *, image_key: str = "image", label_key: str = "label"
) -> Callable[[Any, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]:
    """Per-example softmax cross-entropy of a linen classifier, with accuracy as aux.

    The model is called as ``model.apply({"params": params}, x, train=True,
    rngs={"dropout": rng})``; use it with ``has_aux=True``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax_adaptive.models import MLP
        >>> model = MLP(features=(8,), num_classes=3)
        >>> params = model.init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
        >>> batch = {"image": jnp.zeros((5, 4)), "label": jnp.zeros(5, jnp.int32)}
        >>> losses, aux = linen_classifier_loss(model)(params, batch, jax.random.key(1))
        >>> losses.shape, aux["accuracy"].shape
        ((5,), (5,))
    """

    def loss_fn(params, batch, rng):
        logits = model.apply(
            {"params": params}, batch[image_key], train=True, rngs={"dropout": rng}
        )
        labels = batch[label_key]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        accuracy = (logits.argmax(-1) == labels).astype(logits.dtype)
        return losses, {"accuracy": accuracy}

    return loss_fn
