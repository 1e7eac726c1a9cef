"""Adapters: a Flax model (linen or NNX) into the per-example loss `AdaptiveTrainer` takes.

They take models written as Flax's own examples write them: linen BatchNorm with an
``axis_name`` (written for ``pmap``), NNX modules whose Dropout takes ``rngs`` at call
time, a train/eval switch, and ghost batches (`jax_adaptive.ghost_batches`) that make
BatchNorm training the same whatever micro-batch the device gets.
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

    How the adapters call (and the command line initialises) a user's module: the Flax
    examples' models differ, some take a ``train`` switch, the MNIST CNN takes none.

    Examples:
        >>> import flax.linen as nn
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

    A collective over that axis (BatchNorm's mean with ``axis_name='batch'``) then
    reduces over this one device's micro-batch (or ghost batch) only.
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
    ``train`` when its ``__call__`` has no such parameter (as the Flax MNIST example's
    CNN). Use the loss with ``has_aux=True``, and with ``has_state=True`` when
    ``mutable`` names collections (Flax ``batch_stats``): it then takes and returns the
    model state.

    BatchNorm, three ways:

    * ``train=True`` (the default): statistics of each micro-batch, as in every
      accumulation scheme; the running averages move once per micro-step. Both depend
      on the micro-batch size, and so on the device.
    * ``ghost_batch_size=g``: statistics of each group of ``g`` consecutive examples,
      the running averages moved once per group in order (`jax_adaptive.ghost_batches`):
      the same training whatever the micro-batch. Train with ``multiple_of=g`` and a
      target batch that is a multiple of ``g``.
    * ``train=False``: evaluation mode (frozen BatchNorm: the running averages, left as
      they are; Dropout off). Each example's loss is then its own and the update exact
      for any micro-batch; the model state is returned unchanged.

    Args:
        model: any linen module taking ``(x, train=...)`` and returning logits.
        mutable: the collections the model updates in training, e.g. ``("batch_stats",)``.
        train: training mode (batch statistics, Dropout on) or evaluation mode.
        axis_name: the axis name the model's BatchNorm reduces over, e.g. ``"batch"``
            for a model written for ``pmap`` (``nn.BatchNorm(axis_name="batch")``, as in
            the Flax ImageNet example): the adapter binds it over the micro-batch (or
            ghost batch) with a size-1 ``vmap``, so the model runs unchanged.
        ghost_batch_size: BatchNorm over groups of this many examples (see above).
        call_kwargs: more keyword arguments for every call of the model.
        image_key: the batch's input key.
        label_key: the batch's integer label key.
        loss: ``loss(logits, labels) -> losses``, one per example, instead of the
            softmax cross-entropy (e.g. with label smoothing); accuracy stays the aux.

    Returns:
        ``(params, batch, rng) -> (losses, {"accuracy": ...})``, or with ``mutable``
        ``(params, model_state, batch, rng) -> ((losses, aux), model_state)`` (with
        ghost batches it also takes the trainer's ``weights`` keyword).

    Raises:
        ValueError: when ``ghost_batch_size`` is given without ``mutable`` or with
            ``train=False``.

    Examples:
        >>> import jax, jax.numpy as jnp
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

    Examples:
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
    train: bool = True,
    ghost_batch_size: int | None = None,
    call_kwargs: Mapping[str, Any] | None = None,
    image_key: str = "image",
    label_key: str = "label",
    loss: Loss | None = None,
) -> Callable[..., Any]:
    """Per-example softmax cross-entropy of a Flax NNX classifier, with accuracy as aux.

    The trainer's parameters are the model's ``nnx.Param`` state, and its model state
    the variables that ``mutable`` selects (``nnx.BatchStat`` for BatchNorm; use
    ``has_state=True`` then). `NnxTrainer` does this split and puts the trained values
    back into the module; by hand::

        loss_fn = nnx_classifier_loss(model, mutable=nnx.BatchStat)
        trainer = ja.AdaptiveTrainer(loss_fn, optax.adam(1e-3), target_batch_size=T,
                                     has_aux=True, has_state=True)
        state = trainer.init(nnx.state(model, nnx.Param), batch,
                             model_state=nnx.state(model, nnx.BatchStat))
        ...
        nnx.update(model, state.params, state.model_state)  # the trained values back

    The loss runs a copy of the model taken now, in training mode (``model.train()``:
    ``deterministic=False``, ``use_running_average=False``) or, with ``train=False``,
    in evaluation mode (``model.eval()``: frozen BatchNorm, Dropout off); ``model``
    itself is not changed, and its variables other than the parameters and ``mutable``
    are constants of the loss, as they are now.

    Randomness follows the trainer's ``rng`` (a fresh key per micro-batch), not the
    model's own ``nnx.Rngs``: every RNG stream the copy owns is reseeded from it at each
    call, and a model whose ``__call__`` takes ``rngs`` (the NNX MNIST tutorial's CNN,
    whose Dropout takes them at call time) is called with ``rngs=nnx.Rngs(rng)``.
    ``ghost_batch_size`` computes BatchNorm statistics over groups of that many
    examples whatever the micro-batch (`jax_adaptive.ghost_batches`; see
    `linen_classifier_loss`).

    Args:
        model: an NNX module mapping a batch of inputs to logits.
        mutable: a filter of the variables the model updates in training, e.g.
            ``nnx.BatchStat``; required when the model trains BatchNorm statistics.
        train: training mode or evaluation mode (see above).
        ghost_batch_size: BatchNorm over groups of this many examples.
        call_kwargs: more keyword arguments for every call of the model.
        image_key: the batch's input key.
        label_key: the batch's integer label key.
        loss: ``loss(logits, labels) -> losses``, one per example, instead of the
            softmax cross-entropy (e.g. with label smoothing); accuracy stays the aux.

    Returns:
        ``(params, batch, rng) -> (losses, {"accuracy": ...})``, or with ``mutable``
        ``(params, model_state, batch, rng) -> ((losses, aux), model_state)``.

    Raises:
        ValueError: when the model trains BatchNorm statistics and ``mutable`` is None,
            or ``ghost_batch_size`` is given without them.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
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
