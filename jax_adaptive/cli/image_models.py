"""The command line's image models: the zoo's, or a user's ``package.module:factory``.

`image_model` builds either as an `ImageModel`: the linen module, the trainer's
per-example loss and the held-out metrics. A zoo model with BatchNorm computes its
statistics over ghost batches of a fixed size, so that its training is the same on any
device; `multiple_of` is what every micro-batch size is then a multiple of.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_adaptive import models
from jax_adaptive.cli.config import IMAGE_MODELS, TrainConfig, load_factory

__all__ = ["GHOST_BATCH_SIZE", "ImageModel", "ghost_batch_size", "image_model", "multiple_of"]


GHOST_BATCH_SIZE = 32
"""The examples each BatchNorm statistic of the ResNets is computed over, by default."""


def ghost_batch_size(config: TrainConfig) -> int | None:
    """The ghost batch of a zoo model with BatchNorm: the same training on any device.

    The largest divisor of `GHOST_BATCH_SIZE` that divides the target batch (every size
    of a schedule, and a fixed micro-batch), at least 8. None (per-micro-batch
    statistics) for a model without BatchNorm or a user's, when no such divisor
    exists, or in a data-parallel run (each group would sit on one device).

    Examples:
        >>> ghost_batch_size(TrainConfig(model="resnet-tiny", target_batch_size=96))
        32
        >>> ghost_batch_size(TrainConfig(model="resnet-tiny", micro_batch_size=8))
        8
        >>> ghost_batch_size(TrainConfig(model="resnet-tiny", target_batch_size=100)) is None
        True
    """
    if not IMAGE_MODELS.get(config.model, (None, ()))[1] or config.data_parallel:
        return None
    fixed = config.micro_batch_size if isinstance(config.micro_batch_size, int) else 0
    size = math.gcd(GHOST_BATCH_SIZE, *config.target_sizes(), fixed)
    return size if size >= 8 else None


@dataclasses.dataclass(frozen=True)
class ImageModel:
    """An image classifier as the image path trains and evaluates it.

    Attributes:
        module: the Flax linen module (images ``[m, H, W, C]`` to logits).
        mutable: the collections training updates (Flax ``batch_stats``), or ``()``.
        loss_fn: the trainer's per-example loss, with accuracy as aux (``has_aux``;
            ``has_state`` when ``mutable``).
        metric_fn: held-out per-example ``loss`` and ``accuracy`` in evaluation mode, as
            `jax_adaptive.AdaptiveTrainer.evaluate` takes it.
        init_kwargs: keyword arguments of ``module.init`` besides the images.
        ghost: the ghost batch of its BatchNorm, or None.
    """

    module: nn.Module
    mutable: tuple[str, ...]
    loss_fn: Callable[..., Any]
    metric_fn: Callable[..., Any]
    init_kwargs: dict[str, Any]
    ghost: int | None = None


def _metric_fn(eval_loss: Callable[..., Any], stateful: bool) -> Callable[..., Any]:
    """Held-out ``{"loss", "accuracy"}`` per example from an evaluation-mode loss."""
    if stateful:

        def with_state(params: Any, model_state: Any, batch: Any) -> dict[str, Any]:
            (losses, aux), _ = eval_loss(params, model_state, batch, jax.random.key(0))
            return {"loss": losses, "accuracy": aux["accuracy"]}

        return with_state

    def metric_fn(params: Any, batch: Any) -> dict[str, Any]:
        losses, aux = eval_loss(params, batch, jax.random.key(0))
        return {"loss": losses, "accuracy": aux["accuracy"]}

    return metric_fn


def _zoo_model(config: TrainConfig, num_classes: int) -> ImageModel:
    module_type, mutable = IMAGE_MODELS[config.model]
    module = module_type(num_classes=num_classes)
    ghost = ghost_batch_size(config)
    loss_fn = models.linen_classifier_loss(module, mutable=mutable, ghost_batch_size=ghost)
    eval_loss = models.linen_classifier_loss(module, mutable=mutable, train=False)
    return ImageModel(module, mutable, loss_fn, _metric_fn(eval_loss, bool(mutable)), {}, ghost)


def _user_model(config: TrainConfig, num_classes: int, example: Any) -> ImageModel:
    """The model of ``--model package.module:factory``, checked on ``example`` (one-line errors)."""
    spec = config.model
    made = _guarded(spec, "the factory", lambda: load_factory(spec)(num_classes))
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)
            and callable(made[1])):  # fmt: skip
        raise ValueError(
            f"--model {spec!r}: the factory must return (a flax.linen Module, "
            f"loss(logits, labels) -> per-example losses); it returned {_kind(made)}."
        )
    module, loss = made
    init_kwargs = models.train_kwargs(module, False)
    images = jnp.asarray(example["image"][:1])
    variables = _guarded(  # shapes only: `_start` initialises the model it trains
        spec,
        "model.init",
        lambda: jax.eval_shape(lambda: module.init(jax.random.key(0), images, **init_kwargs)),
    )
    mutable = tuple(name for name in variables if name != "params")
    loss_fn = models.linen_classifier_loss(module, mutable=mutable, loss=loss)
    two = {k: jnp.concatenate([jnp.asarray(v[:1])] * 2) for k, v in example.items()}
    state = {k: v for k, v in variables.items() if k != "params"}
    key = jax.random.key(0)
    args = (variables["params"], state, two, key) if mutable else (variables["params"], two, key)
    out = _guarded(spec, "the loss", lambda: jax.eval_shape(loss_fn, *args))
    losses = out[0][0] if mutable else out[0]
    if np.shape(losses) != (2,):
        raise ValueError(
            f"--model {spec!r}: the loss must return one value per example, shape (2,) for "
            f"2 examples; it returned shape {np.shape(losses)} (drop its mean)."
        )
    eval_loss = models.linen_classifier_loss(module, mutable=mutable, train=False, loss=loss)
    metric_fn = _metric_fn(eval_loss, bool(mutable))
    return ImageModel(module, mutable, loss_fn, metric_fn, init_kwargs)


def _guarded(spec: str, what: str, call: Callable[[], Any]) -> Any:
    """``call()``, its error (any but a bad flag's own) one line naming ``--model``."""
    try:
        return call()
    except ValueError as exc:
        if str(exc).startswith("--model"):
            raise
        error: Exception = exc
    except (Exception, SystemExit) as exc:  # an exit is no model either
        error = exc
    first = str(error).splitlines()[0] if str(error) else ""
    raise ValueError(f"--model {spec!r}: {what} raised {type(error).__name__}: {first}") from error


def _kind(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def image_model(config: TrainConfig, num_classes: int, example: Any) -> ImageModel:
    """The zoo model ``config.model`` names, or the user's from ``package.module:factory``.

    A factory is called with the number of classes and returns ``(module, loss)``: a
    Flax linen module from images ``[m, H, W, C]`` to logits ``[m, classes]`` (given
    ``train=`` when its ``__call__`` takes it; collections besides ``params``, such as
    ``batch_stats``, are updated in training) and ``loss(logits, labels)``, one loss per
    example.

    Raises:
        ValueError: one line naming ``--model`` when the factory, its module or its loss
            does not keep that contract.

    Examples:
        >>> from jax_adaptive.cli.datasets import SyntheticSource
        >>> model = image_model(TrainConfig(model="mlp"), 10, SyntheticSource(2)[0])
        >>> type(model.module).__name__, model.mutable
        ('MLP', ())
    """
    if ":" in config.model:
        return _user_model(
            config, num_classes, {k: np.asarray(v)[None] for k, v in example.items()}
        )
    return _zoo_model(config, num_classes)


def multiple_of(config: TrainConfig, model: ImageModel) -> int:
    """What every micro-batch size is a multiple of: ``--multiple-of`` and the ghost batch.

    Examples:
        >>> model = image_model(TrainConfig(model="resnet-tiny", target_batch_size=96), 10,
        ...                     {"image": np.zeros((16, 16, 3), np.float32)})
        >>> multiple_of(TrainConfig(multiple_of=3), model)
        96
    """
    return math.lcm(config.multiple_of or 1, model.ghost or 1)
