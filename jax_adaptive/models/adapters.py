"""Adapters: a Flax model (linen or NNX) into the per-example loss `AdaptiveTrainer` takes."""

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx


def _classifier_losses(logits, labels):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    accuracy = (logits.argmax(-1) == labels).astype(logits.dtype)
    return losses, {"accuracy": accuracy}


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
    if mutable:

        def stateful_loss_fn(params, model_state, batch, rng):
            logits, new_state = model.apply(
                {"params": params, **model_state},
                batch[image_key],
                train=True,
                rngs={"dropout": rng},
                mutable=list(mutable),
            )
            return _classifier_losses(logits, batch[label_key]), new_state

        return stateful_loss_fn

    def loss_fn(params, batch, rng):
        logits = model.apply(
            {"params": params}, batch[image_key], train=True, rngs={"dropout": rng}
        )
        return _classifier_losses(logits, batch[label_key])

    return loss_fn


def gpt_token_loss(
    model: nn.Module, *, tokens_key: str = "tokens", mask_key: str = "mask"
) -> Callable[..., Any]:
    """Per-example next-token cross-entropy of a causal language model such as `GPT`.

    The batch holds ``tokens``, int ``[m, L]``, and optionally ``mask``, bool or float
    ``[m, L]``: the validity (or weight) of each token. Example ``i``'s loss is the sum,
    over positions ``t < L - 1``, of ``mask[i, t + 1]`` times the cross-entropy of the
    logits at ``t`` against ``tokens[i, t + 1]``: a prediction counts when the token it
    predicts is valid. Pad at the end of a sequence (the model is causal, so padding
    there never changes a valid prediction).

    The trainer minimises the sum of these losses over the target batch divided by
    its size ``T``: the summed token loss per sequence. For the mean per token when
    every sequence has the same number ``n`` of valid targets (``L - 1`` unpadded),
    divide by it: ``lambda p, b, r: loss_fn(p, b, r) / n``. With padding of varying
    length, train through `jax_adaptive.BucketedTrainer` (``count_tokens=lambda b:
    b["mask"][:, 1:].sum(1)``): it weights each sequence so that the update is the mean
    over the target batch's real tokens.

    The model is called as ``model.apply({"params": params}, tokens, train=True,
    rngs={"dropout": rng})`` and must return logits ``[m, L, vocab]``.

    Args:
        model: a linen causal language model.
        tokens_key: the batch's token key.
        mask_key: the batch's optional token-validity key.

    Returns:
        ``(params, batch, rng) -> losses``, of shape ``[m]``; use it with ``has_aux=False``.

    Example:
        >>> import jax, jax.numpy as jnp
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
    image_key: str = "image",
    label_key: str = "label",
) -> Callable[..., Any]:
    """Per-example softmax cross-entropy of a Flax NNX classifier, with accuracy as aux.

    The trainer's parameters are the model's ``nnx.Param`` state, and its model state
    the variables that ``mutable`` selects (``nnx.BatchStat`` for BatchNorm; use
    ``has_state=True`` then)::

        loss_fn = nnx_classifier_loss(model, mutable=nnx.BatchStat)
        trainer = ja.AdaptiveTrainer(loss_fn, optax.adam(1e-3), target_batch_size=T,
                                     has_aux=True, has_state=True)
        state = trainer.init(nnx.state(model, nnx.Param), batch,
                             model_state=nnx.state(model, nnx.BatchStat))
        ...
        nnx.update(model, state.params, state.model_state)  # the trained values back

    The loss runs a copy of the model taken now, in training mode (``model.train()``:
    ``deterministic=False``, ``use_running_average=False``); ``model`` itself is not
    changed, and its variables other than the parameters and ``mutable`` are constants
    of the loss, as they are now.
    Dropout is on: every RNG stream of the copy is reseeded from the trainer's ``rng``
    at each call, so the masks follow the trainer's keys (a fresh key per micro-batch),
    not the model's own ``nnx.Rngs``.

    Args:
        model: an NNX module mapping a batch of inputs to logits.
        mutable: a filter of the variables the model updates in training, e.g.
            ``nnx.BatchStat``; required when the model has ``nnx.BatchStat`` variables.
        image_key: the batch's input key.
        label_key: the batch's integer label key.

    Returns:
        ``(params, batch, rng) -> (losses, {"accuracy": ...})``, or with ``mutable``
        ``(params, model_state, batch, rng) -> ((losses, aux), model_state)``.

    Raises:
        ValueError: when the model has BatchNorm statistics and ``mutable`` is None.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> batch = {"image": jnp.zeros((5, 4)), "label": jnp.zeros(5, jnp.int32)}
        >>> loss_fn = nnx_classifier_loss(model)
        >>> losses, aux = loss_fn(nnx.state(model, nnx.Param), batch, jax.random.key(1))
        >>> losses.shape, aux["accuracy"].shape
        ((5,), (5,))
    """
    if mutable is None and nnx.state(model, nnx.BatchStat):
        raise ValueError(
            "the model has nnx.BatchStat variables, which training updates: pass "
            "mutable=nnx.BatchStat and use the trainer with has_state=True."
        )
    train_copy = nnx.clone(model)  # a snapshot: later changes to ``model`` do not leak in
    train_copy.train()
    filters = (nnx.Param, ...) if mutable is None else (nnx.Param, mutable, ...)
    graphdef, *_, rest = nnx.split(train_copy, *filters)

    def run(params, model_state, batch, rng):
        module = nnx.merge(graphdef, params, *model_state, rest, copy=True)
        tags = sorted(
            {s.key.tag for _, s in nnx.iter_graph(module) if isinstance(s, nnx.RngStream)}
        )
        nnx.reseed(module, **{tag: jax.random.fold_in(rng, i) for i, tag in enumerate(tags)})
        return _classifier_losses(module(batch[image_key]), batch[label_key]), module

    if mutable is not None:

        def stateful_loss_fn(params, model_state, batch, rng):
            out, module = run(params, (model_state,), batch, rng)
            return out, nnx.state(module, mutable)

        return stateful_loss_fn

    def loss_fn(params, batch, rng):
        return run(params, (), batch, rng)[0]

    return loss_fn
