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
from flax import nnx

from jax_adaptive import models
from jax_adaptive.cli.config import (
    IMAGE_MODELS,
    TrainConfig,
    check_ghost,
    ghost_batch_size,
    load_factory,
)
from jax_adaptive.errors import UnboundAxisError

__all__ = ["ImageModel", "image_model", "multiple_of", "nnx_model"]


@dataclasses.dataclass(frozen=True)
class ImageModel:
    """An image classifier as the image path trains (``loss_fn``) and evaluates (``metric_fn``).

    ``module``: a linen module, or a Flax NNX one (built by its factory, its variables
    already made); ``mutable``: the collections training updates (``BatchStat`` for an
    NNX model's); ``init_kwargs``: a linen ``module.init``'s besides the images;
    ``ghost``: the ghost batch of its BatchNorm, or None.
    """

    module: nn.Module | nnx.Module
    mutable: tuple[str, ...]
    loss_fn: Callable[..., Any]
    metric_fn: Callable[..., Any]
    init_kwargs: dict[str, Any]
    ghost: int | None = None

    def variables(self, rng: jax.Array, images: Any) -> tuple[Any, Any]:
        """``(params, model_state)`` to train from: a linen module's initialised from ``rng``
        on ``images``, an NNX module's own (its factory initialised it).
        """  # noqa: D205
        if isinstance(self.module, nnx.Module):
            state = nnx.state(self.module, nnx.BatchStat) if self.mutable else ()
            return nnx.state(self.module, nnx.Param), state
        variables = self.module.init(rng, jnp.asarray(images), **self.init_kwargs)
        return variables.pop("params"), dict(variables) if self.mutable else ()


def image_model(config: TrainConfig, num_classes: int, example: Any) -> ImageModel:
    """The zoo model ``config.model`` names, or a user's from ``package.module:factory``.

    ``factory(num_classes) -> (module, loss(logits, labels) -> losses [m])``, the module
    a linen one or a Flax NNX one (`nnx_model`), is checked on ``example``: a breach is one
    line naming ``--model``.

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
        if isinstance(module, nnx.Module):
            return nnx_model(config, module, loss["loss"], two)
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

        _check_losses(spec, _guarded(spec, "the loss", shapes), bool(mutable))

    def metric_fn(params: Any, *state_and_batch: Any) -> dict[str, Any]:
        out = eval_loss(params, *state_and_batch, jax.random.key(0))
        losses, aux = out[0] if mutable else out
        return {"loss": losses, "accuracy": aux["accuracy"]}

    return ImageModel(module, mutable, loss_fn, metric_fn, init_kwargs, ghost)


def nnx_model(
    config: TrainConfig, module: nnx.Module, loss: Callable[..., Any], example: Any
) -> ImageModel:
    """A user's Flax NNX classifier (``--model package.module:factory``) as the image path's.

    Its ``nnx.Param`` s train, its ``nnx.BatchStat`` s (if any) are the model state,
    over ghost batches as a linen model's; it is checked on ``example`` (two examples).

    Examples:
        >>> import optax
        >>> loss = optax.softmax_cross_entropy_with_integer_labels
        >>> two = {"image": jnp.zeros((2, 3)), "label": jnp.zeros(2, jnp.int32)}
        >>> model = nnx.Linear(3, 10, rngs=nnx.Rngs(0))
        >>> made = nnx_model(TrainConfig(model="my:factory"), model, loss, two)
        >>> made.mutable, made.variables(None, None)[1]
        ((), ())
    """
    spec = config.model
    has_stats = bool(_guarded(spec, "nnx.state", lambda: nnx.state(module, nnx.BatchStat)))
    ghost = check_ghost(config, has_stats)
    mutable, kwargs = ("BatchStat",) if has_stats else (), {"loss": loss}
    if has_stats:
        kwargs["mutable"] = nnx.BatchStat
    loss_fn = _guarded(spec, "nnx_classifier_loss", lambda: models.nnx_classifier_loss(
        module, ghost_batch_size=ghost, **kwargs))  # fmt: skip
    eval_loss = models.nnx_classifier_loss(module, train=False, **kwargs)
    params = nnx.state(module, nnx.Param)
    args = (params, nnx.state(module, nnx.BatchStat), example) if has_stats else (params, example)
    out = _guarded(spec, "the loss", lambda: jax.eval_shape(loss_fn, *args, jax.random.key(0)))
    _check_losses(spec, out, has_stats)

    def metric_fn(params: Any, *state_and_batch: Any) -> dict[str, Any]:
        out = eval_loss(params, *state_and_batch, jax.random.key(0))
        losses, aux = out[0] if has_stats else out
        return {"loss": losses, "accuracy": aux["accuracy"]}

    return ImageModel(module, mutable, loss_fn, metric_fn, {}, ghost)


def _check_losses(spec: str, out: Any, stateful: bool) -> None:
    """A one-line `ValueError` unless the loss gave one value for each of the 2 examples."""
    shape = np.shape(out[0][0] if stateful else out[0])
    if shape != (2,):
        raise ValueError(
            f"--model {spec!r}: the loss must return one value per example, shape (2,) "
            f"for 2 examples; it returned shape {shape} (drop its mean)."
        )


def _factory_model(
    spec: str, num_classes: int
) -> tuple[nn.Module | nnx.Module, Callable[..., Any]]:
    """What ``--model package.module:factory`` makes: a linen or NNX module and a loss."""
    made = _guarded(spec, "the factory", lambda: load_factory(spec)(num_classes))
    if not (isinstance(made, tuple) and len(made) == 2
            and isinstance(made[0], nn.Module | nnx.Module) and callable(made[1])):  # fmt: skip
        kind = f"a tuple of {len(made)}: ({', '.join(type(v).__name__ for v in made)})" if (
            isinstance(made, tuple)) else f"a {type(made).__name__}"  # fmt: skip
        raise ValueError(
            f"--model {spec!r}: the factory must return (a flax.linen or flax.nnx Module, "
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
