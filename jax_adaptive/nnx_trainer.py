"""NnxTrainer: an ``nnx.Module`` trained in place at the largest micro-batch that fits."""

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from jax_adaptive.ghost import ghost_batches
from jax_adaptive.models.adapters import nnx_classifier_loss
from jax_adaptive.step import Batch, TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = ["NnxTrainer"]


class NnxTrainer:
    """Trains an ``nnx.Module`` in place with `AdaptiveTrainer`, from an optax optimizer.

    Each `step` runs one exact update and writes the parameters and the ``nnx.BatchStat``
    statistics back into ``model``; the first (or `init`) plans on its batch (docs/flax.md).

    Args:
        loss_fn: a per-example loss, taking the model state when the model has
            ``nnx.BatchStat`` variables; None: `nnx_classifier_loss` in training mode.
        ghost_batch_size: BatchNorm over groups of this many examples, side by side
            where proven exact, else in order (`ghost_batches`, around ``loss_fn`` too);
            the trainer's ``multiple_of`` follows it.
        rng: the trainer's base key; ``key(0)`` if None.
        **trainer_kwargs: `AdaptiveTrainer`'s other options; ``normalizer=fn`` for a loss
            divided by a count the data decides (``loss_fn`` then gives each example's
            sum, e.g. its tokens' losses: docs/flax.md). With a ``mesh`` and no
            ``param_sharding``, the parameters are sharded as the model's annotations say
            (``nnx.with_partitioning``, read by ``nnx.get_partition_spec``: docs/devices.md).

    Attributes:
        trainer: the `AdaptiveTrainer` (its plan, ``search_log``, ``set_memory_limit``).
        state: its ``TrainState`` (None before the first step), for checkpoints.

    Examples:
        >>> import numpy as np, optax
        >>> from flax import nnx
        >>> model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> trainer = NnxTrainer(model, optax.sgd(0.1), target_batch_size=8,
        ...                      micro_batch_size=3)
        >>> batch = {"image": np.ones((8, 4), np.float32), "label": np.zeros(8, np.int32)}
        >>> before = np.asarray(model.kernel[...])
        >>> metrics = trainer.step(batch)
        >>> trainer.trainer.accumulation_steps, bool((model.kernel[...] != before).any())
        (3, True)
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        *,
        target_batch_size: int,
        loss_fn: Callable[..., Any] | None = None,
        ghost_batch_size: int | None = None,
        rng: jax.Array | None = None,
        **trainer_kwargs: Any,
    ):
        self.model = model
        self.has_state = bool(nnx.state(model, nnx.BatchStat))
        if loss_fn is None:
            mutable = nnx.BatchStat if self.has_state else None
            loss_fn = nnx_classifier_loss(model, mutable=mutable, ghost_batch_size=ghost_batch_size)
            trainer_kwargs.setdefault("has_aux", True)
        elif ghost_batch_size is not None:
            if not self.has_state:
                raise ValueError(
                    f"{ghost_batch_size=} needs batch statistics to group, and the model has "
                    "no nnx.BatchStat variables."
                )
            loss_fn = ghost_batches(loss_fn, ghost_batch_size)
        if trainer_kwargs.get("mesh") is not None and trainer_kwargs.get("param_sharding") is None:
            # As the model's author shards it (Flax's sharding guide): its annotations.
            trainer_kwargs["param_sharding"] = nnx.get_partition_spec(nnx.state(model, nnx.Param))
        self.trainer = AdaptiveTrainer(
            loss_fn, optimizer, target_batch_size=target_batch_size, has_state=self.has_state,
            **trainer_kwargs,
        )  # fmt: skip
        self.rng = jax.random.key(0) if rng is None else rng
        self.state: TrainState | None = None

    def init(self, example_batch: Batch) -> TrainState:
        """Plans the micro-batch size from the module's current values; returns the state."""
        model_state = nnx.state(self.model, nnx.BatchStat) if self.has_state else ()
        params = nnx.state(self.model, nnx.Param)
        self.state = self.trainer.init(params, example_batch, rng=self.rng, model_state=model_state)
        return self.state

    def step(self, batch: Batch, *, weights: Any = None) -> dict[str, Any]:
        """One exact update, as `AdaptiveTrainer.step`, written into the module; its metrics."""
        if self.state is None:
            self.init(batch)
        self.state, metrics = self.trainer.step(self.state, batch, weights=weights)
        # The module holds the new state's arrays: a later update may donate them, and
        # this line then replaces them before anyone reads the module again.
        states = (self.state.model_state,) if self.has_state else ()
        nnx.update(self.model, self.state.params, *states)
        return metrics
