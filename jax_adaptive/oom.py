"""Recognising XLA out-of-memory errors, and the simulated one.

XLA reports an allocation failure in several forms (DESIGN.md, "How OOM surfaces"):

* the first call of a jitted function raises ``jax.errors.JaxRuntimeError``;
* later calls through the C++ fast path raise a plain ``ValueError`` with the same text;
* XLA:CPU may wrap it as ``INTERNAL: Error dispatching computation: ... Out of memory``;
* cuBLAS / cuDNN report a failed workspace allocation in their own words.

Only these count. Every other error must propagate unchanged, so the test is on the
message of the error types XLA raises, never on ``RuntimeError`` as a whole.
"""

from __future__ import annotations

import re

import jax

__all__ = ["HostOutOfMemory", "PeerOutOfMemory", "SimulatedOutOfMemory", "is_oom"]

# Phrases XLA, PJRT, cuBLAS and cuDNN use for a failed device allocation.
_OOM_PATTERN = re.compile(
    r"RESOURCE_EXHAUSTED"
    r"|out of memory"
    r"|failed to allocate"
    r"|CUBLAS_STATUS_ALLOC_FAILED"
    r"|CUDNN_STATUS_ALLOC_FAILED"
    r"|CUDA_ERROR_OUT_OF_MEMORY"
    r"|cudaErrorMemoryAllocation"
    r"|Allocator \(.*\) ran out of memory",
    re.IGNORECASE,
)


class SimulatedOutOfMemory(RuntimeError):
    """The out-of-memory a simulated capacity (``memory_limit``) raises.

    Its message carries ``RESOURCE_EXHAUSTED`` like XLA's own, so code that tells an
    out-of-memory from other errors treats both alike.

    Example:
        >>> import jax_adaptive as ja
        >>> ja.is_oom(ja.SimulatedOutOfMemory(needed=2_000, available=1_000))
        True
    """

    def __init__(self, needed: int, available: int, what: str = "program"):
        self.needed = int(needed)
        self.available = int(available)
        super().__init__(
            f"RESOURCE_EXHAUSTED: simulated out of memory: the {what} needs {self.needed:,} "
            f"bytes (estimate) but memory_limit allows {self.available:,} bytes."
        )


class HostOutOfMemory(RuntimeError):
    """The host ran out of memory building a micro-batch for the device.

    A padded micro-batch is a copy; on a CPU the host's memory is the device's, so
    failing to allocate it is the micro-step's out-of-memory, not the user's error.

    Example:
        >>> import jax_adaptive as ja
        >>> ja.is_oom(ja.HostOutOfMemory(1_000_000))
        True
    """

    def __init__(self, nbytes: int):
        super().__init__(
            f"RESOURCE_EXHAUSTED: Out of memory allocating {nbytes:,} bytes on the host for a "
            "padded micro-batch."
        )


class PeerOutOfMemory(RuntimeError):
    """Another process of a ``jax.distributed`` job ran out of memory at this micro-step.

    Every process raises it (or its own error) at the same micro-step, so that all
    shrink the micro-batch together and none waits in a collective the others skip.

    Example:
        >>> import jax_adaptive as ja
        >>> ja.is_oom(ja.PeerOutOfMemory(size=64))
        True
    """

    def __init__(self, size: int):
        self.size = int(size)
        super().__init__(
            f"RESOURCE_EXHAUSTED: another process ran out of memory at micro-batch {self.size}."
        )


def is_oom(exc: BaseException) -> bool:
    """Tells whether an exception is an XLA/JAX out-of-memory error, real or simulated.

    Args:
        exc: any exception.

    Returns:
        True for the forms XLA reports a failed allocation in (``JaxRuntimeError`` on a
        first call, ``ValueError`` from the compiled fast path, XLA:CPU's wrapped
        ``INTERNAL ... Out of memory``, cuBLAS/cuDNN allocation failures) and for
        `SimulatedOutOfMemory` and `HostOutOfMemory`; False for every other error, including a plain
        ``RuntimeError`` (which XLA never raises) whose text mentions memory.

    Example:
        >>> import jax_adaptive as ja
        >>> ja.is_oom(ValueError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
        True
        >>> ja.is_oom(ValueError("shapes (3,) and (4,) do not match"))
        False
        >>> ja.is_oom(MemoryError())
        False
    """
    if isinstance(exc, SimulatedOutOfMemory | HostOutOfMemory | PeerOutOfMemory):
        return True
    # XLA raises JaxRuntimeError on a first call and a plain ValueError on the compiled
    # fast path; any other type (a user's RuntimeError, a ValueError subclass) is not XLA's.
    if not (isinstance(exc, jax.errors.JaxRuntimeError) or type(exc) is ValueError):
        return False
    return bool(_OOM_PATTERN.search(str(exc)))
