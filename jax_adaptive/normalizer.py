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

from jax_adaptive.data import leading_size

__all__ = [
    "Normalizer",
    "denominator",
    "example_weights",
    "host_count",
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


def example_weights(
    normalizer: Normalizer,
    batch: Any,
    weights: Any,
    T: int,
    add_up: Callable[[int], Any] | None = None,
) -> np.ndarray:
    """Each example's weight in an update that divides its summed losses by ``T``.

    ``weights`` (1 each if None) times ``T / count``: the update then divides by the
    batch's count, ``normalizer(batch)`` checked (`host_count`). With ``add_up`` (several
    processes: ``jax_adaptive.distributed.process_sum``) the count is every process's,
    added up, so that a token weighs the same on each; it must then be an integer.

    Raises:
        ValueError: a count that is not a finite number at least 0, one that is not an
            integer under ``add_up``, or a batch whose count is 0 (nothing in it counts).

    Examples:
        >>> import numpy as np
        >>> batch = {"w": np.array([2.0, 0.0, 2.0, 4.0])}
        >>> example_weights(lambda b: b["w"].sum(), batch, None, T=4)
        array([0.5, 0.5, 0.5, 0.5], dtype=float32)
        >>> example_weights(lambda b: b["w"].sum(), {"w": np.zeros(2)}, None, T=2)
        Traceback (most recent call last):
        ...
        ValueError: normalizer returned 0 for the whole batch: nothing in it counts (all padding?).
    """
    count = host_count(normalizer, batch)
    if add_up is not None:
        if count != int(count):
            raise ValueError(
                f"normalizer returned {count}: under several processes it must count "
                "(an integer), so that the processes can add their counts up."
            )
        count = float(add_up(int(count)))
    if count == 0:
        raise ValueError(
            "normalizer returned 0 for the whole batch: nothing in it counts (all padding?)."
        )
    ones = np.ones(leading_size(batch), np.float32) if weights is None else weights
    return np.asarray(ones, np.float32) * np.float32(T / count)
