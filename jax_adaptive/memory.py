"""Memory: the estimated peak of a compiled program, and the capacity of a device.

The estimate is read from XLA's own buffer assignment (``compiled.memory_analysis()``),
which needs nothing allocated: a program lowered from ``jax.ShapeDtypeStruct``s is
enough. It counts what the program holds at once: its arguments, its outputs (less the
ones aliased to donated arguments), its temporaries and its generated code.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["device_capacity", "estimate_peak_bytes", "memory_report"]


def memory_report(compiled: Any) -> dict[str, int]:
    """Returns the fields of ``compiled.memory_analysis()`` as a dict of ints.

    Args:
        compiled: a ``jax.stages.Compiled``.

    Returns:
        ``argument``, ``output``, ``alias``, ``temp``, ``code`` and, where XLA gives it,
        ``peak`` (``peak_memory_in_bytes``), all in bytes.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> c = jax.jit(jnp.sin).lower(jax.ShapeDtypeStruct((256,), jnp.float32)).compile()
        >>> memory_report(c)["argument"]
        1024
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise ValueError("this backend gives no memory_analysis() for the compiled program.")
    report = {
        "argument": int(analysis.argument_size_in_bytes),
        "output": int(analysis.output_size_in_bytes),
        "alias": int(analysis.alias_size_in_bytes),
        "temp": int(analysis.temp_size_in_bytes),
        "code": int(getattr(analysis, "generated_code_size_in_bytes", 0) or 0),
    }
    peak = getattr(analysis, "peak_memory_in_bytes", None)
    if peak is not None:
        report["peak"] = int(peak)
    return report


def estimate_peak_bytes(compiled: Any) -> int:
    """Estimates the bytes a compiled program holds at its peak.

    ``argument + output - alias + temp + generated code``, from XLA's memory analysis.

    Args:
        compiled: a ``jax.stages.Compiled``.

    Returns:
        The estimate in bytes.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jax.ShapeDtypeStruct((1024,), jnp.float32)
        >>> compiled = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
        >>> estimate_peak_bytes(compiled) >= 4096  # the donated output aliases its input
        True
    """
    r = memory_report(compiled)
    return r["argument"] + r["output"] - r["alias"] + r["temp"] + r["code"]


def device_capacity(device: jax.Device | None = None) -> int | None:
    """Returns the bytes the device lets XLA allocate, or None where it does not say.

    On a GPU this is ``memory_stats()["bytes_limit"]``; a CPU gives no memory stats.

    Args:
        device: the device; the first local device by default.

    Returns:
        The capacity in bytes, or None (a CPU).

    Example:
        >>> import jax
        >>> device_capacity(jax.devices("cpu")[0]) is None
        True
    """
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError):
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"])
