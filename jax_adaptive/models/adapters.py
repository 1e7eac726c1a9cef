"""Adapters: a Flax model (linen or NNX) into the per-example loss `AdaptiveTrainer` takes.

They take models as Flax's examples write them. Guides: docs/flax.md, docs/batchnorm.md.
"""

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_adaptive.errors import UnboundAxisError
from jax_adaptive.ghost import ghost_batches

Loss = Callable[[jax.Array, jax.Array], jax.Array]
"""``loss(logits, labels) -> losses``, one per example."""


def _classifier_losses(logits, labels, loss: Loss | None):
    if loss is None:
        loss = optax.softmax_cross_entropy_with_integer_labels
    return loss(logits, labels), {"accuracy": (logits.argmax(-1) == labels).astype(logits.dtype)}


def train_kwargs(model: nn.Module, train: bool) -> dict[str, bool]:
    """``{"train": train}`` for a linen module whose ``__call__`` takes ``train``, else ``{}``.

    Examples:
        >>> from jax_adaptive.models import MLP
        >>> train_kwargs(MLP(features=(8,), num_classes=3), False), train_kwargs(nn.Dense(3), True)
        ({'train': False}, {})
    """
    return {"train": train} if _takes(type(model).__call__, "train") else {}


def _takes(call: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(call).parameters
    except (TypeError, ValueError):  # no signature: takes none
        return False


def _loss(apply, stateful: bool, ghost_batch_size: int | None, train: bool):
    """``apply(params, model_state, batch, rng) -> (out, model_state)`` as the trainer's loss."""
    if ghost_batch_size is not None and not (stateful and train):
        raise ValueError(
            f"{ghost_batch_size=} needs batch statistics to group: name them in mutable "
            f"and train with train=True (got {train=})."
        )
    if stateful:
        return apply if ghost_batch_size is None else ghost_batches(apply, ghost_batch_size)

    def loss_fn(params, batch, rng):
        return apply(params, {}, batch, rng)[0]

    return loss_fn


def linen_classifier_loss(
    model: nn.Module,
    *,
    mutable: Sequence[str] = (),
    train: bool = True,
    axis_name: str | None = None,
    ghost_batch_size: int | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    image_key: str = "image",
    label_key: str = "label",
    loss: Loss | None = None,
) -> Callable[..., Any]:
    """Per-example softmax cross-entropy of a linen classifier, with accuracy as aux.

    How the model is called, and each option at length: docs/flax.md.

    Args:
        model: a linen module returning logits (called with ``train`` if it takes it).
        mutable: the collections training updates, e.g. ``("batch_stats",)``.
        train: training mode, or evaluation mode (frozen BatchNorm, Dropout off).
        axis_name: the ``pmap`` axis a model reduces BatchNorm over, bound over the
            micro-batch (or ghost batch) by a size-1 ``vmap``.
        ghost_batch_size: BatchNorm over groups of this many examples, side by side
            where proven exact, else in order (`jax_adaptive.ghost_batches`,
            docs/batchnorm.md).
        call_kwargs: more keyword arguments for every call of the model.
        image_key: the batch's input key.
        label_key: the batch's integer label key.
        loss: ``loss(logits, labels) -> losses`` instead of the softmax cross-entropy.

    Returns:
        ``(params, batch, rng) -> (losses, {"accuracy": ...})``, or with ``mutable``
        ``(params, model_state, batch, rng) -> ((losses, aux), model_state)``.

    Raises:
        ValueError: for ``ghost_batch_size`` without ``mutable`` or with ``train=False``.
        jax_adaptive.errors.UnboundAxisError: when called, for a model written for
            ``pmap`` (its BatchNorm reduces over a named axis) without ``axis_name``.

    Examples:
        >>> from jax_adaptive.models import MLP
        >>> model = MLP(features=(8,), num_classes=3)
        >>> params = model.init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
        >>> batch = {"image": jnp.zeros((5, 4)), "label": jnp.zeros(5, jnp.int32)}
        >>> losses, aux = linen_classifier_loss(model)(params, batch, jax.random.key(1))
        >>> losses.shape, aux["accuracy"].shape
        ((5,), (5,))
    """
    kwargs = {**train_kwargs(model, train), **(call_kwargs or {})}
    updates = bool(mutable) and train  # whether the model state changes

    def apply(params, model_state, batch, rng):
        def call(x):
            variables = {"params": params, **model_state}
            mutates = list(mutable) if updates else False
            return model.apply(variables, x, rngs={"dropout": rng}, mutable=mutates, **kwargs)

        if axis_name is None:
            try:
                out = call(batch[image_key])
            except NameError as exc:  # a model written for pmap: name the argument to pass
                unbound = UnboundAxisError.parse(exc, "linen_classifier_loss")
                if unbound is None:
                    raise
                raise unbound from exc
        else:  # bound as pmap would: BatchNorm's mean reduces over this micro-batch
            x = jax.tree.map(lambda a: a[None], batch[image_key])
            out = jax.tree.map(lambda a: a[0], jax.vmap(call, axis_name=axis_name)(x))
        if not updates:
            return _classifier_losses(out, batch[label_key], loss), model_state
        logits, changed = out
        # every collection the state came with, so that its structure never changes
        return _classifier_losses(logits, batch[label_key], loss), {**model_state, **changed}

    return _loss(apply, bool(mutable), ghost_batch_size, train)


def gpt_token_loss(
    model: nn.Module, *, tokens_key: str = "tokens", mask_key: str = "mask"
) -> Callable[..., Any]:
    """Per-example next-token cross-entropy of a causal language model such as `GPT`.

    Example ``i``'s loss sums, over ``t < L - 1`` where ``mask[i, t + 1]`` (pad at the
    end), the cross-entropy of the logits at ``t`` against ``tokens[i, t + 1]``. For a
    mean per token, train through `jax_adaptive.BucketedTrainer` with
    ``count_tokens=lambda b: b["mask"][:, 1:].sum(1)`` (docs/buckets.md). The model is
    called as ``model.apply({"params": params}, tokens, train=True, rngs={"dropout":
    rng})`` and returns logits ``[m, L, vocab]``.

    Args:
        model: a linen causal language model.
        tokens_key: the batch's key of int tokens ``[m, L]``.
        mask_key: the batch's optional key of each token's validity (or weight) ``[m, L]``.

    Returns:
        ``(params, batch, rng) -> losses`` of shape ``[m]``, for ``has_aux=False``.

    Examples:
        >>> from jax_adaptive.models import GPT
        >>> model = GPT(vocab_size=11, max_len=8, width=8, depth=1, heads=2)
        >>> tokens = jnp.ones((3, 6), jnp.int32)
        >>> params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
        >>> jax.eval_shape(gpt_token_loss(model), params, {"tokens": tokens},
        ...                jax.random.key(1)).shape
        (3,)
    """

    def loss_fn(params, batch, rng):
        tokens = batch[tokens_key]
        logits = model.apply({"params": params}, tokens, train=True, rngs={"dropout": rng})
        losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        if mask_key in batch:
            losses = losses * batch[mask_key][:, 1:].astype(losses.dtype)
        return jnp.sum(losses, axis=1)

    return loss_fn


def nnx_classifier_loss(
    model: nnx.Module,
    *,
    mutable: nnx.filterlib.Filter | None = None,
    train: bool = True,
    ghost_batch_size: int | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    image_key: str = "image",
    label_key: str = "label",
    loss: Loss | None = None,
) -> Callable[..., Any]:
    """Per-example softmax cross-entropy of a Flax NNX classifier, with accuracy as aux.

    Its options and what it returns are `linen_classifier_loss`'s; ``mutable`` is a filter
    of the variables training updates (``nnx.BatchStat``). Its parameters are
    ``nnx.state(model, nnx.Param)``, its model state ``nnx.state(model, mutable)``
    (docs/flax.md; `NnxTrainer` does the split). It runs a copy of the model taken now, in
    ``train()`` or ``eval()`` mode, whose other variables are constants; its RNG streams
    are reseeded from the trainer's ``rng`` at each call, and a ``__call__`` that takes
    ``rngs`` gets ``nnx.Rngs(rng)``.

    Raises:
        ValueError: when the model trains BatchNorm statistics and ``mutable`` is None,
            or ``ghost_batch_size`` is given without them.

    Examples:
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> batch = {"image": jnp.zeros((5, 4)), "label": jnp.zeros(5, jnp.int32)}
        >>> loss_fn = nnx_classifier_loss(model)
        >>> losses, aux = loss_fn(nnx.state(model, nnx.Param), batch, jax.random.key(1))
        >>> losses.shape, aux["accuracy"].shape
        ((5,), (5,))
    """
    if mutable is None and train and nnx.state(model, nnx.BatchStat):
        raise ValueError(
            "the model has nnx.BatchStat variables, which training updates: pass "
            "mutable=nnx.BatchStat and use the trainer with has_state=True."
        )
    copy = nnx.clone(model)  # a snapshot: later changes to ``model`` do not leak in
    (copy.train if train else copy.eval)()
    filters = (nnx.Param, ...) if mutable is None else (nnx.Param, mutable, ...)
    graphdef, *_, rest = nnx.split(copy, *filters)
    kwargs = dict(call_kwargs or {})
    call_rngs = _takes(model.__call__, "rngs") and "rngs" not in kwargs

    def apply(params, model_state, batch, rng):
        states = (params, rest) if mutable is None else (params, model_state, rest)
        module = nnx.merge(graphdef, *states, copy=True)
        tags = sorted(
            {s.key.tag for _, s in nnx.iter_graph(module) if isinstance(s, nnx.RngStream)}
        )
        nnx.reseed(module, **{tag: jax.random.fold_in(rng, i) for i, tag in enumerate(tags)})
        extra = {"rngs": nnx.Rngs(rng)} if call_rngs else {}
        logits = module(batch[image_key], **kwargs, **extra)
        out = _classifier_losses(logits, batch[label_key], loss)
        return out, model_state if mutable is None else nnx.state(module, mutable)

    return _loss(apply, mutable is not None, ghost_batch_size, train)
