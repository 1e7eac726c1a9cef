"""A small Flax model zoo (the tiny ones sized for CPU tests) and its adapters (docs/flax.md)."""

from jax_adaptive.models.adapters import (
    gpt_token_loss,
    linen_classifier_loss,
    nnx_classifier_loss,
    train_kwargs,
)
from jax_adaptive.models.cnn import CNN
from jax_adaptive.models.gpt import GPT
from jax_adaptive.models.mlp import MLP
from jax_adaptive.models.resnet import ResNet, ResNet18, ResNet50, ResNetBlock, ResNetTiny
from jax_adaptive.models.transformer import Transformer, TransformerBlock
from jax_adaptive.models.vit import ViT, ViTMicro, ViTTiny

__all__ = [
    "CNN", "GPT", "MLP", "ResNet", "ResNet18", "ResNet50", "ResNetBlock", "ResNetTiny",
    "Transformer", "TransformerBlock", "ViT", "ViTMicro", "ViTTiny", "gpt_token_loss",
    "linen_classifier_loss", "nnx_classifier_loss", "train_kwargs",
]  # fmt: skip
