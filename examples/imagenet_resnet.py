"""A ResNet written as Flax's ImageNet example writes one, for ``--model``.

The features a user's model brings and the command line must take unchanged: a linen
ResNet v1.5 whose BatchNorm reduces over ``axis_name="batch"`` (written for ``pmap``,
"unbound axis name" outside one), ``momentum=0.9``, a ``train`` argument, a zero-scaled
last BatchNorm in each block and a projection when the shape changes. Run it with::

    python -m jax_adaptive.train --model examples.imagenet_resnet:make --image-size 32

``make`` is the factory ``--model`` calls: ``(model, per-example loss)``.
"""

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import optax


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (a 1x1 projection when the shape changes)."""

    filters: int
    conv: Any
    norm: Any
    act: Callable[[Any], Any] = nn.relu
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):  # noqa: D102
        y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        if x.shape != y.shape:
            x = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(x)
            x = self.norm(name="norm_proj")(x)
        return self.act(x + y)


class ResNet(nn.Module):
    """ResNet v1.5 with BatchNorm over the ``"batch"`` axis, as in the ImageNet example."""

    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):  # noqa: D102
        conv = partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="batch",
        )
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(self.stage_sizes):
            for j in range(blocks):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = BasicBlock(self.num_filters * 2**i, conv=conv, norm=norm, strides=strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return jnp.asarray(nn.Dense(self.num_classes, dtype=self.dtype)(x), self.dtype)


ResNet18 = partial(ResNet, stage_sizes=(2, 2, 2, 2))


def make(num_classes: int, num_filters: int = 8):
    """The factory ``--model examples.imagenet_resnet:make`` calls: a narrow ResNet-18."""
    return ResNet18(num_classes=num_classes, num_filters=num_filters), (
        optax.softmax_cross_entropy_with_integer_labels
    )


def make_tiny(num_classes: int):
    """One stage of one block, 4 filters: for tests."""
    model = ResNet(stage_sizes=(1,), num_classes=num_classes, num_filters=4)
    return model, optax.softmax_cross_entropy_with_integer_labels
