"""An Equinox model through the trainer: the per-example loss is all the trainer needs.

Equinox keeps parameters inside the model; `eqx.partition` splits the arrays out, the
trainer trains them, and `eqx.combine` puts them back for each call. Run:

    pip install equinox && python examples/equinox_model.py
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jax_adaptive as ja
from jax_adaptive.data import synthetic_images


def equinox_classifier_loss(model: eqx.Module):
    """Returns ``(params, losses_fn)``: the model's arrays and its per-example loss."""
    params, static = eqx.partition(model, eqx.is_array)

    def loss_fn(params, batch, rng):
        net = eqx.combine(params, static)
        x = batch["image"].reshape(batch["image"].shape[0], -1)
        logits = jax.vmap(net)(x)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
        return losses, {"accuracy": (logits.argmax(-1) == batch["label"]).astype(jnp.float32)}

    return params, loss_fn


def main(updates: int = 10, target: int = 256, memory_limit: int | None = 2 * 10**6) -> float:
    """Trains an Equinox MLP on synthetic images; returns the last loss."""
    model = eqx.nn.MLP(16 * 16 * 3, 10, width_size=64, depth=2, key=jax.random.key(0))
    params, loss_fn = equinox_classifier_loss(model)
    trainer = ja.AdaptiveTrainer(
        loss_fn, optax.adam(3e-3), target_batch_size=target, memory_limit=memory_limit,
        has_aux=True, plan_cache=False,
    )  # fmt: skip
    state = trainer.init(params, synthetic_images(target))
    print(f"plan: {trainer.micro_batch_size} x {trainer.accumulation_steps}")
    for update in range(updates):
        state, metrics = trainer.step(state, synthetic_images(target, seed=update + 1))
        print(f"update {update + 1}: loss {float(metrics['loss']):.4f}")
    return float(metrics["loss"])


if __name__ == "__main__":
    main()
