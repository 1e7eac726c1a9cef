"""Adapters: a Flax model into the per-example loss `AdaptiveTrainer` takes."""

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import optax


def linen_classifier_loss(
    model: nn.Module,
    *,
    mutable: Sequence[str] = (),
    image_key: str = "image",
    label_key: str = "label",
) -> Callable[..., Any]:
    """Per-example softmax cross-entropy of a linen classifier, with accuracy as aux.

    The model is called as ``model.apply({"params": params, **model_state}, x,
    train=True, rngs={"dropout": rng}, mutable=mutable)``. Use the loss with
    ``has_aux=True``, and with ``has_state=True`` when ``mutable`` names collections
    (Flax ``batch_stats``): it then takes and returns the model state, and BatchNorm
    statistics are those of each micro-batch, as in every accumulation scheme.

    Args:
        model: any linen module taking ``(x, train=...)`` and returning logits.
        mutable: the collections the model updates in training, e.g. ``("batch_stats",)``.
        image_key: the batch's input key.
        label_key: the batch's integer label key.

    Returns:
        ``(params, batch, rng) -> (losses, {"accuracy": ...})``, or with ``mutable``
        ``(params, model_state, batch, rng) -> ((losses, aux), model_state)``.

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

    def losses_of(logits, labels):
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        accuracy = (logits.argmax(-1) == labels).astype(logits.dtype)
        return losses, {"accuracy": accuracy}

    if mutable:

        def stateful_loss_fn(params, model_state, batch, rng):
            logits, new_state = model.apply(
                {"params": params, **model_state},
                batch[image_key],
                train=True,
                rngs={"dropout": rng},
                mutable=list(mutable),
            )
            return losses_of(logits, batch[label_key]), new_state

        return stateful_loss_fn

    def loss_fn(params, batch, rng):
        logits = model.apply(
            {"params": params}, batch[image_key], train=True, rngs={"dropout": rng}
        )
        return losses_of(logits, batch[label_key])

    return loss_fn
