"""A causal language model in Flax NNX, its token-weighted training step made adaptive.

The model and the step are written as Flax's language-model examples write them (the
gemma example's ``compute_weighted_cross_entropy`` and its step: token weights and an
attention mask from the padding, a loss divided by the batch's real tokens), with the
layers stacked by ``nnx.vmap`` and run by ``nnx.scan``. The step as one writes it for
``@nnx.jit`` closes over its batch::

    @nnx.jit
    def train_step(model, optimizer, metrics, batch):
        inputs, targets = batch["inputs"], batch["targets"]
        weights = jnp.where(targets > PAD_ID, 1, 0).astype(jnp.float32)
        attention_mask = make_causal_attn_mask(inputs > PAD_ID)

        def loss_fn(model):
            logits = model(inputs, attention_mask)
            loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights)
            return loss / weight_sum, logits

        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss)

Converted (docs/flax.md): the decorator; the loss takes the batch as an argument, so the
lines that read the batch move into it; ``nnx.value_and_grad`` becomes
``ja.micro_batch_value_and_grad`` with the loss's denominator as its ``normalizer``, so
that every micro-batch weighs its real tokens and the update is the full batch's at any
plan. Run it on random token sequences (no download): ``python examples/nnx_lm.py``;
``--memory-limit 6_000_000`` trains on a simulated 6 MB device.
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_adaptive as ja

PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's sizes."""

    vocab_size: int = 64
    max_length: int = 32
    features: int = 64
    num_heads: int = 4
    hidden: int = 256
    num_layers: int = 2


def make_causal_attn_mask(input_mask: jax.Array) -> jax.Array:
    """``[B, 1, L, L]``: position ``i`` attends to real positions ``j <= i``."""
    length = input_mask.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    return jnp.logical_and(input_mask[:, None, None, :], causal[None, None])


class Block(nnx.Module):
    """A pre-norm Transformer block: causal self-attention and an MLP."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(config.features, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            config.num_heads, config.features, decode=False, rngs=rngs
        )
        self.mlp_norm = nnx.LayerNorm(config.features, rngs=rngs)
        self.up = nnx.Linear(config.features, config.hidden, rngs=rngs)
        self.down = nnx.Linear(config.hidden, config.features, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:  # noqa: D102
        x = x + self.attention(self.attention_norm(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class TransformerLM(nnx.Module):
    """Token and position embeddings, ``num_layers`` blocks under ``nnx.scan``, a head."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(config.vocab_size, config.features, rngs=rngs)
        self.positions = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (config.max_length, config.features))
        )

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def layers(rngs: nnx.Rngs) -> Block:
            return Block(config, rngs=rngs)

        self.layers = layers(rngs)
        self.final_norm = nnx.LayerNorm(config.features, rngs=rngs)
        self.head = nnx.Linear(config.features, config.vocab_size, rngs=rngs)

    def __call__(self, inputs: jax.Array, attention_mask: jax.Array) -> jax.Array:  # noqa: D102
        x = self.embed(inputs) + self.positions[None, : inputs.shape[1]]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x: jax.Array, layer: Block) -> jax.Array:
            return layer(x, attention_mask)

        return self.head(self.final_norm(forward(x, self.layers)))


def compute_weighted_cross_entropy(logits, targets, weights=None):
    """The summed cross-entropy over weighted positions, and the weights' sum."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def loss_fn(model: TransformerLM, batch):
    """The mean cross-entropy over the batch's real target tokens, and the logits."""
    inputs, targets = batch["inputs"], batch["targets"]
    weights = jnp.where(targets > PAD_ID, 1, 0).astype(jnp.float32)
    attention_mask = make_causal_attn_mask(inputs > PAD_ID)
    logits = model(inputs, attention_mask)
    loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights)
    return loss / weight_sum, logits


def count_tokens(batch) -> jax.Array:
    """What `loss_fn` divides by: the real target tokens."""
    return (batch["targets"] > PAD_ID).sum()


@ja.AdaptiveNnxStep
def train_step(model: TransformerLM, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    """One update on the batch's real tokens, micro-batched where the batch does not fit."""
    grad_fn = ja.micro_batch_value_and_grad(loss_fn, has_aux=True, normalizer=count_tokens)
    (loss, _), grads = grad_fn(model, batch)
    optimizer.update(model, grads)
    metrics.update(loss=loss)


def random_batches(num: int, batch_size: int, config: Config = Config(), seed: int = 0):
    """Sequences of random lengths (some only padding), padded with `PAD_ID` on the right.

    Each token is its predecessor plus one (mod the vocabulary, skipping the pad), so
    there is something to learn.
    """
    rng = np.random.default_rng(seed)
    length = config.max_length
    for _ in range(num):
        start = rng.integers(1, config.vocab_size, size=(batch_size, 1))
        tokens = (start + np.arange(length + 1)) % (config.vocab_size - 1) + 1
        lengths = rng.integers(0, length + 2, size=(batch_size, 1))  # 0 or 1: no target
        tokens = np.where(np.arange(length + 1) < lengths, tokens, PAD_ID).astype(np.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def main(argv=None) -> float:
    """Trains the model for ``--steps`` batches; returns the last loss."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--memory-limit", type=lambda s: int(s.replace("_", "")), default=None)
    args = parser.parse_args(argv)
    step = train_step
    if args.memory_limit is not None:  # the same step, on a simulated smaller device
        step = ja.AdaptiveNnxStep(train_step.step_fn, memory_limit=args.memory_limit)
    model = TransformerLM(Config(), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    loss = float("nan")
    for i, batch in enumerate(random_batches(args.steps, args.batch_size)):
        step(model, optimizer, metrics, batch)
        loss = float(metrics.compute()["loss"])
        print(f"step {i + 1}: loss {loss:.4f}; {step.plan_info}")
        metrics.reset()
    return loss


if __name__ == "__main__":
    main()
