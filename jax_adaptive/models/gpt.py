"""A decoder-only causal transformer language model (GPT-2 style)."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_adaptive.models.transformer import Transformer


class GPT(nn.Module):
    """A GPT: token and learned position embeddings, causal pre-norm blocks, logits.

    The defaults are GPT-2 small (124 M parameters, the output layer the token
    embedding's transpose). Pad at the end of a sequence; pair it with `gpt_token_loss`.
    Parameters and logits are float32, ``dtype`` the compute dtype.

    Examples:
        >>> model = GPT(vocab_size=11, max_len=8, width=8, depth=1, heads=2)
        >>> tokens = jnp.zeros((2, 5), jnp.int32)
        >>> jax.eval_shape(model.init_with_output, jax.random.key(0), tokens)[0].shape
        (2, 5, 11)
    """

    vocab_size: int = 50257
    max_len: int = 1024
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: int = 4
    dropout_rate: float = 0.0
    tie_embeddings: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        """Maps int tokens ``[batch, length]`` to next-token logits ``[batch, length, vocab]``."""
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequences of {length=} exceed {self.max_len=}.")
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(self.vocab_size, self.width, dtype=self.dtype, embedding_init=init)
        positions = self.param("pos_embedding", init, (self.max_len, self.width))
        x = embed(tokens) + positions[None, :length].astype(self.dtype)
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        x = Transformer(
            self.depth, self.heads, self.mlp_ratio, self.dropout_rate, self.dtype, name="decoder"
        )(x, mask=nn.make_causal_mask(tokens), train=train)
        if self.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype, name="head")(x)
        return logits.astype(jnp.float32)
