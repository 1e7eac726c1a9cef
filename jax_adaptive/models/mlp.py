"""A multilayer perceptron."""

from collections.abc import Sequence

import flax.linen as nn
import jax


class MLP(nn.Module):
    """Dense layers with ReLU and optional dropout, ending in ``num_classes`` logits.

    Examples:
        >>> import jax.numpy as jnp
        >>> model = MLP(features=(16,), num_classes=3)
        >>> jax.eval_shape(model.init_with_output, jax.random.key(0), jnp.zeros((2, 4)))[0].shape
        (2, 3)
    """

    features: Sequence[int] = (128, 128)
    num_classes: int = 10
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        """Returns the logits of a batch; ``train`` turns dropout on."""
        x = x.reshape((x.shape[0], -1))
        for width in self.features:
            x = nn.relu(nn.Dense(width)(x))
            if self.dropout_rate:
                x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)
