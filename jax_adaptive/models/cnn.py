"""A small convolutional network for images."""

import flax.linen as nn
import jax


class CNN(nn.Module):
    """Two convolutions with pooling, then a dense layer: the CLI's default model.

    Examples:
        >>> import jax.numpy as jnp
        >>> images = jnp.zeros((2, 16, 16, 3))
        >>> jax.eval_shape(CNN().init_with_output, jax.random.key(0), images)[0].shape
        (2, 10)
    """

    num_classes: int = 10
    channels: int = 16

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits of a batch; ``train`` is accepted and unused (no dropout)."""
        for i in range(2):
            x = nn.relu(nn.Conv(self.channels * 2**i, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(self.num_classes)(x)
