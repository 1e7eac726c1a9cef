"""Every error the library raises, and the one rule (`is_oom`) for which are out-of-memory.

* Out-of-memory: XLA's own, `SimulatedOutOfMemory` (a ``memory_limit``),
  `HostOutOfMemory` (a padded micro-batch) and `PeerOutOfMemory` (another process).
  `catch_oom` catches only these; every other error propagates unchanged.
* What stopped and what was kept: `NothingFitsError`, `FitError`,
  `OptimizerStepOutOfMemory`, `StateLostError`.

XLA's out-of-memory is matched on XLA's own words (the status first, or an allocator's
message with its size), never on any text that merely mentions memory, and never in an
error that carries a host callback's Python traceback (the user's own text). The texts
quoted below are as raised by jax 0.10 on a CPU under an address-space limit and jax
0.11 on an H200 (DESIGN.md, "How OOM surfaces").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import jax

__all__ = [
    "FitError",
    "HostOutOfMemory",
    "NothingFitsError",
    "OptimizerStepOutOfMemory",
    "PeerOutOfMemory",
    "SimulatedOutOfMemory",
    "StateLostError",
    "catch_oom",
    "is_oom",
]

T = TypeVar("T")

# XLA's status first, or after XLA's own wrapper for an earlier run's failure surfacing
# at a later dispatch (XLA:CPU: "RESOURCE_EXHAUSTED: Out of memory allocating 402653184
# bytes.", "INTERNAL: Error dispatching computation: Out of memory allocating ..."); the
# status anywhere else (inside a user's text) says nothing about who ran out.
_STATUS = r"RESOURCE_EXHAUSTED: "
_WRAPPERS = (r"INTERNAL: Error dispatching computation: ",)
_STATUS_PATTERN = re.compile(rf"(?:{'|'.join(_WRAPPERS)})*{_STATUS}")

# XLA's, PJRT's and the CUDA libraries' words for a failed allocation, each with the size
# ("402653184 bytes", "3.00GiB") or status name they always carry.
_SIZE = r"\d+(?:\.\d+)?\s?(?:bytes|[KMGTP]?i?B)"
_ALLOCATION_FAILURES = (
    rf"Out of memory allocating {_SIZE}",  # XLA:CPU, the PJRT CPU client
    # XLA:GPU (H200): "... 3.00GiB with allocator GPU_0_bfc on device 0." (BFC) or
    # "... with allocator SE_0_space_0" (XLA_PYTHON_CLIENT_ALLOCATOR=platform); older XLA
    # wrote "... 1073741824 bytes.".
    rf"Out of memory while trying to allocate {_SIZE}",
    # The BFC allocator's own report: "Allocator (GPU_0_bfc) ran out of memory trying to
    # allocate 3.00GiB (rounded to ...)".
    rf"Allocator \(\w+\) ran out of memory trying to allocate {_SIZE}",
    # cuBLAS / cuDNN workspaces, the CUDA driver and runtime (the H200's platform
    # allocator logged "CUDA_ERROR_OUT_OF_MEMORY: out of memory").
    r"\bCUBLAS_STATUS_ALLOC_FAILED\b",
    r"\bCUDNN_STATUS_ALLOC_FAILED\b",
    r"\bCUDA_ERROR_OUT_OF_MEMORY\b",
    r"\bcudaErrorMemoryAllocation\b",
)
_ALLOCATION_PATTERN = re.compile("|".join(_ALLOCATION_FAILURES))

# An exception raised by Python code in a host callback (debug.callback, pure_callback,
# io_callback, buffer_callback) reaches the caller as the same types as an OOM, its
# traceback inside: "INTERNAL: CpuCallback error calling callback: Traceback (most
# recent call last): ...\nRuntimeError: <the user's text>" (CPU, and the H200, where XLA
# appends " [executable_name='jit_f']"), "INTERNAL: Error when calling buffer callback:
# Traceback ..." (CPU); jaxlib 0.10 also holds "CpuCallback error: ". XLA's own errors
# never carry a Python traceback, so one anywhere marks the error as the user's.
_CALLBACK_MARKERS = (
    "CpuCallback error",
    "Error when calling buffer callback",
    "Traceback (most recent call last):",
)


class SimulatedOutOfMemory(RuntimeError):
    """The out-of-memory a simulated capacity (``memory_limit``) raises.

    Its message starts with ``RESOURCE_EXHAUSTED``, like XLA's own.

    Examples:
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
    """The host ran out of memory building a padded micro-batch (a copy).

    On a CPU the host's memory is the device's: this is the micro-step's out-of-memory.

    Examples:
        >>> import jax_adaptive as ja
        >>> ja.is_oom(HostOutOfMemory(1_000_000))
        True
    """

    def __init__(self, nbytes: int):
        super().__init__(
            f"RESOURCE_EXHAUSTED: Out of memory allocating {nbytes:,} bytes on the host for a "
            "padded micro-batch."
        )


class PeerOutOfMemory(RuntimeError):
    """Another process of a ``jax.distributed`` job ran out of memory at this micro-step.

    Raised with the peer's own error at the same micro-step, so that all processes shrink
    together and none waits in a collective the others skip.

    Examples:
        >>> import jax_adaptive as ja
        >>> ja.is_oom(PeerOutOfMemory(size=64))
        True
    """

    def __init__(self, size: int):
        self.size = int(size)
        super().__init__(
            f"RESOURCE_EXHAUSTED: another process ran out of memory at micro-batch {self.size}."
        )


def is_oom(exc: BaseException) -> bool:
    r"""Tells whether an exception is an XLA/JAX out-of-memory error, real or simulated.

    Returns:
        True for `SimulatedOutOfMemory`, `HostOutOfMemory`, `PeerOutOfMemory`, and a
        ``JaxRuntimeError`` or exact ``ValueError`` (the compiled fast path) whose text is
        XLA's: ``RESOURCE_EXHAUSTED`` first (or after ``INTERNAL: Error dispatching
        computation:``), an allocator's message with its size, or a CUDA library's
        allocation-failure status. False for every other error: one from a host callback
        (its text carries a Python traceback), a ``RuntimeError`` (XLA never raises one),
        a text that merely mentions memory.

    Examples:
        >>> import jax, jax_adaptive as ja
        >>> ja.is_oom(ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 402653184 bytes."))
        True
        >>> ja.is_oom(jax.errors.JaxRuntimeError(
        ...     "INTERNAL: Error dispatching computation: Out of memory allocating 8 bytes."))
        True
        >>> ja.is_oom(jax.errors.JaxRuntimeError(
        ...     "INTERNAL: CpuCallback error calling callback: Traceback (most recent call "
        ...     "last):\n  ...\nRuntimeError: CUDA out of memory. failed to allocate 2.00 GiB"))
        False
        >>> ja.is_oom(ValueError("the loss ran out of memory"))
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
    message = str(exc)
    # A host callback's error has the types above and the user's text inside: checked
    # first, so that no text of theirs ("RESOURCE_EXHAUSTED", "Out of memory allocating
    # 5 bytes") can make it count.
    if any(marker in message for marker in _CALLBACK_MARKERS):
        return False
    return bool(_STATUS_PATTERN.match(message) or _ALLOCATION_PATTERN.search(message))


def catch_oom(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """Runs ``fn``; returns ``(result, None)``, or ``(None, error)`` if it ran out of memory.

    The one place the rule "only out-of-memory is caught" is written: any other error
    propagates unchanged.

    Examples:
        >>> import jax_adaptive as ja
        >>> def full():
        ...     raise ja.SimulatedOutOfMemory(needed=2, available=1)
        >>> catch_oom(lambda: 3), catch_oom(full)[0]
        ((3, None), None)
    """
    try:
        return fn(), None
    except Exception as exc:
        if not is_oom(exc):
            raise
        return None, exc


class NothingFitsError(RuntimeError):
    """Even the smallest candidate size does not fit.

    Attributes:
        smallest: the smallest candidate.
        trials: the trials made before giving up.

    Examples:
        >>> import jax_adaptive as ja
        >>> try:
        ...     ja.search_max_size(lambda size: False, hi=8)
        ... except ja.NothingFitsError as error:
        ...     print(error.smallest)
        1
    """

    def __init__(self, smallest: int, trials: list[Any], detail: str = ""):
        self.smallest = smallest
        self.trials = trials
        super().__init__(
            f"no size fits: even the smallest candidate, {smallest}, does not fit"
            f"{': ' + detail if detail else ''} (sizes tried: {[t.size for t in trials]})."
        )


class FitError(RuntimeError):
    """``fit`` stopped part-way: what it did is here, the error that stopped it ``__cause__``.

    Attributes:
        state: the state after the last completed update (``fit``'s input if none was).
        history: the metrics of the updates this call completed.
        batch: the batch whose update did not complete, which the stream has moved past;
            None when the error came from the stream, ``after_update`` or ``on_update``.

    Examples:
        >>> from jax_adaptive.loop import fit_loop
        >>> def step(state, batch):
        ...     if batch < 0:
        ...         raise ValueError(f"bad batch {batch}")
        ...     return state + batch, {"loss": batch, "examples": 1}
        >>> try:
        ...     fit_loop(step, 0, [1, 2, -3, 4])
        ... except FitError as error:
        ...     print(error.state, len(error.history), error.batch, repr(error.__cause__))
        3 2 -3 ValueError('bad batch -3')
    """

    def __init__(self, state: Any, history: list[dict[str, Any]], batch: Any, cause: BaseException):
        self.state, self.history, self.batch = state, history, batch
        first = str(cause).splitlines()[0] if str(cause) else ""
        super().__init__(
            f"fit stopped at update {len(history) + 1} by {type(cause).__name__}: {first} "
            f"(the state after the {len(history)} updates it completed is in error.state, "
            "their metrics in error.history)"
        )


class OptimizerStepOutOfMemory(RuntimeError):
    """The optimizer step ran out of memory; ``.state`` is the update's intact start state.

    Its need does not depend on the micro-batch size, so shrinking cannot help: free
    device memory, then call ``step(error.state, batch)`` again.

    Examples:
        >>> error = OptimizerStepOutOfMemory(state="the update's start state")
        >>> error.state
        "the update's start state"
    """

    def __init__(self, state: Any):
        self.state = state
        super().__init__(
            "the optimizer step ran out of memory (its need does not depend on the "
            "micro-batch size); the state at the start of the update is in error.state."
        )


class StateLostError(RuntimeError):
    """A donating call failed after its first run and XLA deleted the train state.

    No host copy was kept (a size trusted after it ran once): restore from a checkpoint.

    Examples:
        >>> issubclass(StateLostError, RuntimeError)
        True
    """
