"""ResNets (He et al. 2016) with BatchNorm, at ImageNet sizes and at small ones."""

import functools
from collections.abc import Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp


def _conv(features: int, kernel: int, strides: int, dtype: Any, **kwargs: Any) -> nn.Conv:
    return nn.Conv(features, (kernel, kernel), strides, use_bias=False, dtype=dtype, **kwargs)


def _norm(train: bool, dtype: Any, **kwargs: Any) -> nn.BatchNorm:
    return nn.BatchNorm(
        use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=dtype, **kwargs
    )


class ResNetBlock(nn.Module):
    """A residual block: two 3x3 convolutions (basic) or 1x1-3x3-1x1 (bottleneck).

    Examples:
        >>> block = ResNetBlock(filters=4, strides=2)
        >>> x = jnp.zeros((1, 8, 8, 3))
        >>> jax.eval_shape(block.init_with_output, jax.random.key(0), x)[0].shape
        (1, 4, 4, 4)
    """

    filters: int
    strides: int = 1
    bottleneck: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the block's output; ``train`` makes BatchNorm use batch statistics."""
        conv = functools.partial(_conv, dtype=self.dtype)
        norm = functools.partial(_norm, train, self.dtype)
        if self.bottleneck:
            y = nn.relu(norm()(conv(self.filters, 1, 1)(x)))
            y = nn.relu(norm()(conv(self.filters, 3, self.strides)(y)))
            y = norm()(conv(4 * self.filters, 1, 1)(y))
        else:
            y = nn.relu(norm()(conv(self.filters, 3, self.strides)(x)))
            y = norm()(conv(self.filters, 3, 1)(y))
        if x.shape != y.shape:
            x = norm(name="proj_norm")(conv(y.shape[-1], 1, self.strides, name="proj_conv")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A ResNet classifier of images ``[m, H, W, C]``; the defaults are ResNet-18 for ImageNet.

    The side shrinks by 32 (any size works). Parameters and logits are float32,
    ``dtype`` the compute dtype. With ``train``, BatchNorm uses batch statistics: apply
    with ``mutable=["batch_stats"]`` (`linen_classifier_loss`).

    Examples:
        >>> model = ResNet(stage_sizes=(1, 1), num_filters=4, num_classes=3)
        >>> images = jnp.zeros((2, 16, 16, 3))
        >>> logits, variables = jax.eval_shape(model.init_with_output, jax.random.key(0), images)
        >>> logits.shape, sorted(variables)
        ((2, 3), ['batch_stats', 'params'])
    """

    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    block: Literal["basic", "bottleneck"] = "basic"
    num_filters: int = 64
    num_classes: int = 1000
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the float32 logits of a batch of images."""
        if self.block not in ("basic", "bottleneck"):
            raise ValueError(f"{self.block=} must be 'basic' or 'bottleneck'.")
        x = _conv(self.num_filters, 7, 2, self.dtype, padding=[(3, 3)] * 2, name="stem_conv")(x)
        x = _norm(train, self.dtype, name="stem_norm")(x)
        x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                x = ResNetBlock(
                    self.num_filters * 2**i, 2 if i > 0 and j == 0 else 1,
                    self.block == "bottleneck", self.dtype, name=f"stage{i}_block{j}",
                )(x, train)  # fmt: skip
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)


class ResNet18(ResNet):
    """ResNet-18: basic blocks, stages (2, 2, 2, 2).

    Examples:
        >>> ResNet18(num_classes=10).stage_sizes
        (2, 2, 2, 2)
    """

    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    block: Literal["basic", "bottleneck"] = "basic"


class ResNet50(ResNet):
    """ResNet-50: bottleneck blocks, stages (3, 4, 6, 3), about 25.6 M parameters.

    Examples:
        >>> ResNet50().stage_sizes, ResNet50().block
        ((3, 4, 6, 3), 'bottleneck')
    """

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    block: Literal["basic", "bottleneck"] = "bottleneck"


class ResNetTiny(ResNet):
    """A ResNet small enough for CPU tests and benchmarks: one basic block a stage, 8 filters.

    Examples:
        >>> images = jnp.zeros((2, 16, 16, 3))
        >>> jax.eval_shape(ResNetTiny().init_with_output, jax.random.key(0), images)[0].shape
        (2, 10)
    """

    stage_sizes: Sequence[int] = (1, 1, 1, 1)
    num_filters: int = 8
    num_classes: int = 10
