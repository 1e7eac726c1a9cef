"""The command line's image models: the zoo's, or a user's ``package.module:factory``."""

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
from jax_adaptive.cli.config import (
    IMAGE_MODELS,
    TrainConfig,
    check_ghost,
    ghost_batch_size,
    load_factory,
)
from jax_adaptive.errors import UnboundAxisError

__all__ = ["ImageModel", "image_model", "multiple_of"]


@dataclasses.dataclass(frozen=True)
class ImageModel:
    """An image classifier as the image path trains (``loss_fn``) and evaluates (``metric_fn``).

    ``mutable``: the collections training updates; ``init_kwargs``: ``module.init``'s
    besides the images; ``ghost``: the ghost batch of its BatchNorm, or None.
    """

    module: nn.Module
    mutable: tuple[str, ...]
    loss_fn: Callable[..., Any]
    metric_fn: Callable[..., Any]
    init_kwargs: dict[str, Any]
    ghost: int | None = None


def image_model(config: TrainConfig, num_classes: int, example: Any) -> ImageModel:
    """The zoo model ``config.model`` names, or a user's from ``package.module:factory``.

    ``factory(num_classes) -> (module, loss(logits, labels) -> losses [m])`` is checked
    on ``example``: a breach is one line naming ``--model``.

    Examples:
        >>> from jax_adaptive.cli.datasets import SyntheticSource
        >>> model = image_model(TrainConfig(model="mlp"), 10, SyntheticSource(2)[0])
        >>> type(model.module).__name__, model.mutable
        ('MLP', ())
    """
    spec, loss, init_kwargs = config.model, {}, {}
    two = {k: jnp.stack([jnp.asarray(v)] * 2) for k, v in example.items()}
    if ":" in spec:
        module, loss["loss"] = _factory_model(spec, num_classes)
        init_kwargs = models.train_kwargs(module, False)
        variables = _guarded(spec, "model.init", lambda: jax.eval_shape(
            lambda: module.init(jax.random.key(0), two["image"][:1], **init_kwargs)))  # fmt: skip
        mutable = tuple(name for name in variables if name != "params")
        ghost = check_ghost(config, "batch_stats" in mutable)
    else:
        module_type, mutable = IMAGE_MODELS[spec]
        module, ghost = module_type(num_classes=num_classes), ghost_batch_size(config)

    def make_losses(axis_name: str | None = None) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The training loss and the evaluation loss, ``axis_name`` bound."""
        kwargs = {"mutable": mutable, "axis_name": axis_name, **loss}
        return (models.linen_classifier_loss(module, ghost_batch_size=ghost, **kwargs),
                models.linen_classifier_loss(module, train=False, **kwargs))  # fmt: skip

    loss_fn, eval_loss = make_losses()
    if loss:
        params, state = variables["params"], {k: v for k, v in variables.items() if k in mutable}
        args = (params, state, two) if mutable else (params, two)

        def shapes() -> Any:
            nonlocal loss_fn, eval_loss
            try:
                return jax.eval_shape(loss_fn, *args, jax.random.key(0))
            except UnboundAxisError as exc:  # written for pmap: bound over each (ghost) batch
                loss_fn, eval_loss = make_losses(exc.axis_name)
                return jax.eval_shape(loss_fn, *args, jax.random.key(0))

        out = _guarded(spec, "the loss", shapes)
        shape = np.shape(out[0][0] if mutable else out[0])
        if shape != (2,):
            raise ValueError(
                f"--model {spec!r}: the loss must return one value per example, shape (2,) "
                f"for 2 examples; it returned shape {shape} (drop its mean)."
            )

    def metric_fn(params: Any, *state_and_batch: Any) -> dict[str, Any]:
        out = eval_loss(params, *state_and_batch, jax.random.key(0))
        losses, aux = out[0] if mutable else out
        return {"loss": losses, "accuracy": aux["accuracy"]}

    return ImageModel(module, mutable, loss_fn, metric_fn, init_kwargs, ghost)


def _factory_model(spec: str, num_classes: int) -> tuple[nn.Module, Callable[..., Any]]:
    """What ``--model package.module:factory`` makes: a linen module and a loss."""
    made = _guarded(spec, "the factory", lambda: load_factory(spec)(num_classes))
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)
            and callable(made[1])):  # fmt: skip
        kind = f"a tuple of {len(made)}: ({', '.join(type(v).__name__ for v in made)})" if (
            isinstance(made, tuple)) else f"a {type(made).__name__}"  # fmt: skip
        raise ValueError(
            f"--model {spec!r}: the factory must return (a flax.linen Module, "
            f"loss(logits, labels) -> per-example losses); it returned {kind}."
        )
    return made


def _guarded(spec: str, what: str, call: Callable[[], Any]) -> Any:
    """``call()``, any error of it (but a bad flag's own) one line naming ``--model``."""
    try:
        return call()
    except (Exception, SystemExit) as exc:  # an exit is no model either
        if isinstance(exc, ValueError) and str(exc).startswith("--model"):
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"--model {spec!r}: {what} raised {type(exc).__name__}: {first}") from exc


def multiple_of(config: TrainConfig, model: ImageModel) -> int:
    """What every micro-batch size is a multiple of: ``--multiple-of`` and the ghost batch.

    Examples:
        >>> model = image_model(TrainConfig(model="resnet-tiny", target_batch_size=96), 10,
        ...                     {"image": np.zeros((16, 16, 3), np.float32)})
        >>> multiple_of(TrainConfig(multiple_of=3), model)
        96
    """
    return math.lcm(config.multiple_of or 1, model.ghost or 1)
