"""Adapters: a Flax model (linen or NNX) into the per-example loss `AdaptiveTrainer` takes.

They take models as Flax's own examples write them (linen BatchNorm with a ``pmap``
``axis_name``, NNX Dropout that takes ``rngs`` at call time, a train/eval switch). The
guides: docs/flax.md, and docs/batchnorm.md for ghost batches.
"""

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_adaptive.ghost import ghost_batches

Loss = Callable[[jax.Array, jax.Array], jax.Array]
"""``loss(logits, labels) -> losses``, one per example."""


def _classifier_losses(logits, labels, loss: Loss | None):
    if loss is None:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    else:
        losses = loss(logits, labels)
    accuracy = (logits.argmax(-1) == labels).astype(logits.dtype)
    return losses, {"accuracy": accuracy}


def train_kwargs(model: nn.Module, train: bool) -> dict[str, bool]:
    """``{"train": train}`` for a linen module whose ``__call__`` takes ``train``, else ``{}``.

    The Flax examples' models differ: some take a ``train`` switch, the MNIST CNN none.

    Examples:
        >>> from jax_adaptive.models import MLP
        >>> train_kwargs(MLP(features=(8,), num_classes=3), False)
        {'train': False}
        >>> train_kwargs(nn.Dense(3), True)
        {}
    """
    return {"train": train} if _takes(type(model).__call__, "train") else {}


def _takes(call: Callable[..., Any], name: str) -> bool:
    """Whether ``call`` has a parameter named ``name`` (none without a signature)."""
    try:
        return name in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False


def _with_ghost_batches(loss_fn, ghost_batch_size, stateful: bool, train: bool):
    if ghost_batch_size is None:
        return loss_fn
    if not (stateful and train):
        raise ValueError(
            f"{ghost_batch_size=} needs batch statistics to group: name them in mutable "
            f"and train with train=True (got {train=})."
        )
    return ghost_batches(loss_fn, ghost_batch_size)


def _bind_axis(call: Callable[[Any], Any], axis_name: str | None) -> Callable[[Any], Any]:
    """``call`` under a size-1 ``vmap`` that binds ``axis_name``, as ``pmap`` would.

    A collective over that axis (BatchNorm's mean) then reduces over this micro-batch.
    """
    if axis_name is None:
        return call

    def bound(x):
        out = jax.vmap(call, axis_name=axis_name)(jax.tree.map(lambda a: a[None], x))
        return jax.tree.map(lambda a: a[0], out)

    return bound


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

    The model is called as ``model.apply({"params": params, **model_state}, x,
    train=train, rngs={"dropout": rng}, mutable=mutable, **call_kwargs)``, without
    ``train`` when its ``__call__`` has none. Use the loss with ``has_aux=True``, and
    with ``has_state=True`` when ``mutable`` names collections.

    Args:
        model: a linen module returning logits.
        mutable: the collections training updates, e.g. ``("batch_stats",)``.
        train: training mode (batch statistics and Dropout, which depend on the
            micro-batch) or evaluation mode (frozen BatchNorm, Dropout off: the update
            exact for any micro-batch, the model state returned unchanged).
        axis_name: the axis a model written for ``pmap`` reduces BatchNorm over (the
            Flax ImageNet example's ``"batch"``), bound over the micro-batch (or ghost
            batch) by a size-1 ``vmap``, so the model runs unchanged.
        ghost_batch_size: BatchNorm over groups of this many examples
            (`jax_adaptive.ghost_batches`): train with it as ``multiple_of`` and a
            target batch that is a multiple of it.
        call_kwargs: more keyword arguments for every call of the model.
        image_key: the batch's input key.
        label_key: the batch's integer label key.
        loss: ``loss(logits, labels) -> losses``, one per example, instead of the
            softmax cross-entropy (label smoothing, say); accuracy stays the aux.

    Returns:
        ``(params, batch, rng) -> (losses, {"accuracy": ...})``, or with ``mutable``
        ``(params, model_state, batch, rng) -> ((losses, aux), model_state)`` (with
        ghost batches, also taking the trainer's ``weights`` keyword).

    Raises:
        ValueError: for ``ghost_batch_size`` without ``mutable`` or with ``train=False``.

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
            return model.apply(
                {"params": params, **model_state},
                x,
                rngs={"dropout": rng},
                mutable=list(mutable) if updates else False,
                **kwargs,
            )

        out = _bind_axis(call, axis_name)(batch[image_key])
        if not updates:
            return _classifier_losses(out, batch[label_key], loss), model_state
        logits, changed = out
        # every collection the state came with, so that its structure never changes
        return _classifier_losses(logits, batch[label_key], loss), {**model_state, **changed}

    if mutable:
        return _with_ghost_batches(apply, ghost_batch_size, True, train)
    _with_ghost_batches(None, ghost_batch_size, False, train)  # raises when given

    def loss_fn(params, batch, rng):
        return apply(params, {}, batch, rng)[0]

    return loss_fn


def gpt_token_loss(
    model: nn.Module, *, tokens_key: str = "tokens", mask_key: str = "mask"
) -> Callable[..., Any]:
    """Per-example next-token cross-entropy of a causal language model such as `GPT`.

    Example ``i``'s loss is the sum over ``t < L - 1`` of ``mask[i, t + 1]`` times the
    cross-entropy of the logits at ``t`` against ``tokens[i, t + 1]``: a prediction
    counts when the token it predicts is valid, so pad at the end of a sequence. The
    trainer then minimises the summed token loss per sequence. For the mean per token,
    divide by the ``n`` valid targets every sequence has (``lambda p, b, r: loss_fn(p, b,
    r) / n``) or, with padding of varying length, train through
    `jax_adaptive.BucketedTrainer` with ``count_tokens=lambda b: b["mask"][:, 1:].sum(1)``.

    The model is called as ``model.apply({"params": params}, tokens, train=True,
    rngs={"dropout": rng})`` and must return logits ``[m, L, vocab]``.

    Args:
        model: a linen causal language model.
        tokens_key: the batch's key of int tokens ``[m, L]``.
        mask_key: the batch's optional key of each token's validity (or weight), bool
            or float ``[m, L]``.

    Returns:
        ``(params, batch, rng) -> losses`` of shape ``[m]``, for ``has_aux=False``.

    Examples:
        >>> from jax_adaptive.models import GPT
        >>> model = GPT(vocab_size=11, max_len=8, width=8, depth=1, heads=2)
        >>> tokens = jnp.ones((3, 6), jnp.int32)
        >>> params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
        >>> loss_fn = gpt_token_loss(model)
        >>> jax.eval_shape(loss_fn, params, {"tokens": tokens}, jax.random.key(1)).shape
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

    The trainer's parameters are ``nnx.state(model, nnx.Param)``, its model state
    ``nnx.state(model, mutable)`` (with ``has_state=True``); `NnxTrainer` makes this
    split and puts the trained values back (``nnx.update``). The loss runs a copy of the
    model taken now, in ``train()`` or ``eval()`` mode: ``model`` is not changed, and
    its variables other than the parameters and ``mutable`` are constants of the loss.
    Randomness follows the trainer's ``rng``: the copy's RNG streams are reseeded from
    it at each call, and a ``__call__`` that takes ``rngs`` (Dropout at call time, as
    in the NNX MNIST tutorial) gets ``nnx.Rngs(rng)``.

    Args:
        model: an NNX module mapping a batch of inputs to logits.
        mutable: a filter of the variables training updates, e.g. ``nnx.BatchStat``;
            required when the model trains BatchNorm statistics.
        train: training mode, or evaluation mode (frozen BatchNorm, Dropout off).
        ghost_batch_size: as in `linen_classifier_loss`.
        call_kwargs: as in `linen_classifier_loss`.
        image_key: as in `linen_classifier_loss`.
        label_key: as in `linen_classifier_loss`.
        loss: as in `linen_classifier_loss`.

    Returns:
        ``(params, batch, rng) -> (losses, {"accuracy": ...})``, or with ``mutable``
        ``(params, model_state, batch, rng) -> ((losses, aux), model_state)``.

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
    if train:
        copy.train()
    else:
        copy.eval()
    filters = (nnx.Param, ...) if mutable is None else (nnx.Param, mutable, ...)
    graphdef, *_, rest = nnx.split(copy, *filters)
    kwargs = dict(call_kwargs or {})
    call_rngs = _takes(model.__call__, "rngs") and "rngs" not in kwargs

    def run(params, model_state, batch, rng):
        module = nnx.merge(graphdef, params, *model_state, rest, copy=True)
        tags = sorted(
            {s.key.tag for _, s in nnx.iter_graph(module) if isinstance(s, nnx.RngStream)}
        )
        nnx.reseed(module, **{tag: jax.random.fold_in(rng, i) for i, tag in enumerate(tags)})
        extra = {"rngs": nnx.Rngs(rng)} if call_rngs else {}
        logits = module(batch[image_key], **kwargs, **extra)
        return _classifier_losses(logits, batch[label_key], loss), module

    if mutable is not None:

        def stateful_loss_fn(params, model_state, batch, rng):
            out, module = run(params, (model_state,), batch, rng)
            return out, nnx.state(module, mutable)

        return _with_ghost_batches(stateful_loss_fn, ghost_batch_size, True, train)
    _with_ghost_batches(None, ghost_batch_size, False, train)  # raises when given

    def loss_fn(params, batch, rng):
        return run(params, (), batch, rng)[0]

    return loss_fn
