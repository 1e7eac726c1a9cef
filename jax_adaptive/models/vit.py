"""The Vision Transformer (Dosovitskiy et al. 2021)."""

from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_adaptive.models.transformer import Transformer


class ViT(nn.Module):
    """A ViT classifier; the defaults are ViT-B/16.

    Strided-convolution patches, a learned position embedding (its length fixed at
    init), a pre-norm `Transformer`, a head on a class token (``pool="cls"``) or the
    patches' mean (``"mean"``). Parameters and logits float32, ``dtype`` the compute's.

    Examples:
        >>> model = ViT(patch_size=4, width=8, depth=1, heads=2, num_classes=3)
        >>> images = jnp.zeros((2, 8, 8, 3))
        >>> jax.eval_shape(model.init_with_output, jax.random.key(0), images)[0].shape
        (2, 3)
    """

    num_classes: int = 1000
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: int = 4
    dropout_rate: float = 0.0
    pool: Literal["cls", "mean"] = "cls"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits of images ``[batch, height, width, c]``; ``train``: dropout on."""
        if self.pool not in ("cls", "mean"):
            raise ValueError(f"{self.pool=} must be 'cls' or 'mean'.")
        p = self.patch_size
        x = nn.Conv(self.width, (p, p), p, padding="VALID", dtype=self.dtype, name="embed")(x)
        x = x.reshape((x.shape[0], -1, self.width))
        if self.pool == "cls":
            cls = self.param("cls", nn.initializers.zeros, (1, 1, self.width))
            x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, self.width)), x], axis=1)
        init = nn.initializers.normal(0.02)
        x = x + self.param("pos_embedding", init, (1, *x.shape[1:]))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x.astype(self.dtype))
        x = Transformer(
            self.depth, self.heads, self.mlp_ratio, self.dropout_rate, self.dtype, name="encoder"
        )(x, train=train)
        x = x[:, 0] if self.pool == "cls" else jnp.mean(x, axis=1)
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)


class ViTTiny(ViT):
    """ViT-Ti/16 (DeiT-Tiny): width 192, depth 12, 3 heads, about 5.7 M parameters.

    Examples:
        >>> ViTTiny().patch_size, ViTTiny().width, ViTTiny().depth, ViTTiny().heads
        (16, 192, 12, 3)
    """

    patch_size: int = 16
    width: int = 192
    depth: int = 12
    heads: int = 3


class ViTMicro(ViT):
    """A ViT small enough for CPU tests: patches of 4 (16 on a 16x16 image), width 32.

    Examples:
        >>> images = jnp.zeros((2, 16, 16, 3))
        >>> jax.eval_shape(ViTMicro().init_with_output, jax.random.key(0), images)[0].shape
        (2, 10)
    """

    num_classes: int = 10
    patch_size: int = 4
    width: int = 32
    depth: int = 2
    heads: int = 2
