"""The pre-norm transformer encoder that `ViT` and `GPT` share."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``.

    Examples:
        >>> block = TransformerBlock(heads=2, mlp_dim=16)
        >>> x = jnp.zeros((1, 3, 8))
        >>> jax.eval_shape(block.init_with_output, jax.random.key(0), x)[0].shape
        (1, 3, 8)
    """

    heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None = None, train: bool = False
    ) -> jax.Array:
        """Maps ``[batch, length, width]`` to the same shape; ``mask`` as in Flax attention."""
        dropout = nn.Dropout(self.dropout_rate, deterministic=not train)
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dtype=self.dtype, dropout_rate=self.dropout_rate,
            force_fp32_for_softmax=True,
        )(y, mask=mask, deterministic=not train)  # fmt: skip
        x = x + dropout(y)
        y = nn.LayerNorm(dtype=self.dtype)(x)
        y = nn.gelu(nn.Dense(self.mlp_dim, dtype=self.dtype)(y))
        y = nn.Dense(x.shape[-1], dtype=self.dtype)(dropout(y))
        return x + dropout(y)


class Transformer(nn.Module):
    """``depth`` pre-norm `TransformerBlock` s and a final LayerNorm.

    Examples:
        >>> encoder = Transformer(depth=2, heads=2)
        >>> x = jnp.zeros((1, 3, 8))
        >>> jax.eval_shape(encoder.init_with_output, jax.random.key(0), x)[0].shape
        (1, 3, 8)
    """

    depth: int
    heads: int
    mlp_ratio: int = 4
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None = None, train: bool = False
    ) -> jax.Array:
        """Maps ``[batch, length, width]`` to the same shape; ``train`` turns dropout on."""
        mlp_dim = self.mlp_ratio * x.shape[-1]
        for i in range(self.depth):
            block = TransformerBlock(
                self.heads, mlp_dim, self.dropout_rate, self.dtype, name=f"block{i}"
            )
            x = block(x, mask, train)
        return nn.LayerNorm(dtype=self.dtype)(x)
