"""Strict JAX for every test: rank promotion raises, warnings are errors (pyproject)."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _strict_jax():
    with jax.numpy_rank_promotion("raise"):
        yield
