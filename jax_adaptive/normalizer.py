"""Ratio losses: a batch mean divided by a count the data decides, exact in micro-batches.

Language-model code divides its loss by the batch's real tokens, ``sum(l * w) / sum(w)``.
Cut into micro-batches, micro-batch ``k`` divides by its own count ``d_k`` and the batch by
``D = sum_k d_k``, so the batch's loss is ``sum_k (d_k / D) L_k`` whatever the plan;
weighting micro-batches by their examples instead gives another loss on every device (and
``0 / 0`` for a micro-batch of padding only). A ``normalizer`` names the count: ``fn(batch)``
is what the loss divides by. The guide: docs/flax.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Normalizer",
    "denominator",
    "host_count",
    "host_denominator",
    "normalizer_problem",
]

Normalizer = Callable[[Any], Any]
"""``fn(batch) -> scalar``: the number a batch-mean loss divides by (its real tokens,
``lambda b: b["weights"].sum()``); None means the batch's examples."""


def denominator(normalizer: Normalizer, batch: Any) -> jax.Array:
    """``normalizer(batch)`` as a float32 scalar, inside a trace; a non-scalar is one line.

    Examples:
        >>> import jax.numpy as jnp
        >>> float(denominator(lambda b: b["w"].sum(), {"w": jnp.array([1.0, 0.0, 1.0])}))
        2.0
        >>> denominator(lambda b: b["w"], {"w": jnp.ones(3)})
        Traceback (most recent call last):
        ...
        ValueError: normalizer returned shape (3,), not a scalar: ...
    """
    value = normalizer(batch)
    if jnp.shape(value) != ():
        raise ValueError(
            f"normalizer returned shape {jnp.shape(value)}, not a scalar: it must give the one "
            'number the loss divides by (e.g. lambda batch: batch["weights"].sum()).'
        )
    return jnp.asarray(value, jnp.float32)


def normalizer_problem(value: float) -> str | None:
    """What is wrong with a normalizer's value (negative, not finite), or None.

    Examples:
        >>> normalizer_problem(12.0) is None, normalizer_problem(0.0) is None
        (True, True)
        >>> normalizer_problem(float("nan"))
        'normalizer returned nan: it must be finite and at least 0 (a count of tokens or examples).'
    """
    if math.isfinite(value) and value >= 0:
        return None
    return (
        f"normalizer returned {value}: it must be finite and at least 0 (a count of tokens "
        "or examples)."
    )


def host_count(normalizer: Normalizer, batch: Any) -> float:
    """``normalizer(batch)`` on the host: finite and at least 0 (0: padding only), or one line.

    Examples:
        >>> import numpy as np
        >>> host_count(lambda b: b["w"].sum(), {"w": np.zeros(2)})
        0.0
    """
    value = np.asarray(normalizer(batch))
    if value.shape != ():
        denominator(lambda _: value, None)  # raises, naming the shape
    count = float(value)
    problem = normalizer_problem(count)
    if problem is not None:
        raise ValueError(problem)
    return count


def host_denominator(normalizer: Normalizer, batch: Any) -> float:
    """``normalizer(batch)`` on the host, checked: a positive finite number, or one line.

    Examples:
        >>> import numpy as np
        >>> host_denominator(lambda b: b["w"].sum(), {"w": np.array([1.0, 3.0])})
        4.0
        >>> host_denominator(lambda b: b["w"].sum(), {"w": np.zeros(2)})
        Traceback (most recent call last):
        ...
        ValueError: normalizer returned 0.0 for the whole batch: nothing in it counts ...
    """
    total = host_count(normalizer, batch)
    if total == 0:
        raise ValueError(
            "normalizer returned 0.0 for the whole batch: nothing in it counts (all padding?)."
        )
    return total
