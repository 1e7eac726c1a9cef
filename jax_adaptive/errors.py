"""Every error the library raises, and the one rule for which of them are out-of-memory.

Out-of-memory errors come from XLA (real ones), from a simulated capacity
(`SimulatedOutOfMemory`), from the host building a padded micro-batch
(`HostOutOfMemory`) or from another process (`PeerOutOfMemory`); `is_oom` tells them
from every other error, which propagates unchanged. The rest say what stopped and what
was kept: `NothingFitsError` (not even the smallest size fits), `FitError` (``fit``
stopped part-way, with the state), `OptimizerStepOutOfMemory` (with the update's
intact start state) and `StateLostError` (a donating run failed and no copy was kept).

XLA reports a failed allocation in these forms (DESIGN.md, "How OOM surfaces"; texts as
raised by jax 0.10 on a CPU under an address-space limit and jax 0.11 on an H200):

* on a CPU the first call of a jitted function raises ``jax.errors.JaxRuntimeError``,
  later calls through the C++ fast path a plain ``ValueError``, both with XLA's status
  first: ``RESOURCE_EXHAUSTED: Out of memory allocating 402653184 bytes.``;
* an error that surfaces at a later dispatch comes wrapped, without the status:
  ``INTERNAL: Error dispatching computation: Out of memory allocating 134217728 bytes.``;
* on a GPU, a ``JaxRuntimeError`` at ``block_until_ready``: ``RESOURCE_EXHAUSTED: Out of
  memory while trying to allocate 3.00GiB with allocator GPU_0_bfc on device 0. ...``;
  the BFC allocator's own ``Allocator (GPU_0_bfc) ran out of memory trying to allocate
  3.00GiB``, and cuBLAS / cuDNN / the CUDA driver name their status
  (``CUBLAS_STATUS_ALLOC_FAILED``, ...).

Only these count, matched on XLA's own words (the status code first, or an allocator's
message with its size), never on any text that mentions memory. An exception raised by
Python code inside ``jax.debug.callback``, ``jax.pure_callback``, ``io_callback`` or a
buffer callback reaches the caller as the same types (``ValueError`` from
``pure_callback``'s fast path), as ``INTERNAL: CpuCallback error calling callback:
Traceback (most recent call last): ...`` ending in the user's own text, on a CPU and a
GPU alike; such an error never counts, whatever that text says, and propagates unchanged.
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

# XLA's status code for a failed allocation, first in the message as absl::Status
# writes it: "RESOURCE_EXHAUSTED: Out of memory allocating 402653184 bytes." (XLA:CPU,
# jax 0.10, first call and fast path alike).
_STATUS = r"RESOURCE_EXHAUSTED: "

# What jaxlib puts before XLA's message when an earlier run's failure surfaces at a later
# dispatch: "INTERNAL: Error dispatching computation: Out of memory allocating 134217728
# bytes." (XLA:CPU, jax 0.10, a failed run's output passed to the next jitted call).
_WRAPPERS = (r"INTERNAL: Error dispatching computation: ",)

# The status code, at the start of the message or after XLA's own wrappers only: the
# word anywhere else (inside a user's text) says nothing about who ran out.
_STATUS_PATTERN = re.compile(rf"(?:{'|'.join(_WRAPPERS)})*{_STATUS}")

# A size as XLA's allocators write it: "402653184 bytes", "3.00GiB", "1.2GiB".
_SIZE = r"\d+(?:\.\d+)?\s?(?:bytes|[KMGTP]?i?B)"

# XLA's, PJRT's and the CUDA libraries' own words for a failed allocation, each with the
# size or status name they always carry.
_ALLOCATION_FAILURES = (
    # XLA:CPU / the PJRT CPU client: "Out of memory allocating 402653184 bytes." (jax 0.10).
    rf"Out of memory allocating {_SIZE}",
    # XLA:GPU's allocators (jax 0.11, CUDA, H200): "Out of memory while trying to allocate
    # 3.00GiB with allocator GPU_0_bfc on device 0." (BFC) or "... 200.00GiB with
    # allocator SE_0_space_0 ..." (XLA_PYTHON_CLIENT_ALLOCATOR=platform); older XLA wrote
    # "... 1073741824 bytes.".
    rf"Out of memory while trying to allocate {_SIZE}",
    # The BFC allocator's own report (logged on the H200, and in some statuses):
    # "Allocator (GPU_0_bfc) ran out of memory trying to allocate 3.00GiB (rounded to ...)".
    rf"Allocator \(\w+\) ran out of memory trying to allocate {_SIZE}",
    # cuBLAS and cuDNN workspace allocations, and the CUDA driver's and runtime's statuses
    # (the H200's platform allocator logged "CUDA_ERROR_OUT_OF_MEMORY: out of memory").
    r"\bCUBLAS_STATUS_ALLOC_FAILED\b",
    r"\bCUDNN_STATUS_ALLOC_FAILED\b",
    r"\bCUDA_ERROR_OUT_OF_MEMORY\b",
    r"\bcudaErrorMemoryAllocation\b",
)
_ALLOCATION_PATTERN = re.compile("|".join(_ALLOCATION_FAILURES))

# How an exception raised by Python code in a host callback reaches the caller: jaxlib
# puts the callback's Python traceback into an XLA error of the same types as an OOM.
# A RuntimeError raised in the callback, every call path (first call, fast path, AOT):
#   "INTERNAL: CpuCallback error calling callback: Traceback (most recent call last):\n
#    ...\nRuntimeError: <the user's text>"   (debug.callback, pure_callback, io_callback;
#    jax 0.10 on a CPU, and jax 0.11 on an H200, where jaxlib's GPU handler uses the same
#    words and XLA appends " [executable_name='jit_f']")
#   "INTERNAL: Error when calling buffer callback: Traceback (most recent call last): ..."
#    (jax.experimental.buffer_callback, jax 0.10, CPU)
# jaxlib 0.10 holds one more such text, "CpuCallback error: ". XLA's own errors never
# carry a Python traceback, so one anywhere in the text marks the error as the user's.
_CALLBACK_MARKERS = (
    "CpuCallback error",
    "Error when calling buffer callback",
    "Traceback (most recent call last):",
)


class SimulatedOutOfMemory(RuntimeError):
    """The out-of-memory a simulated capacity (``memory_limit``) raises.

    Its message carries ``RESOURCE_EXHAUSTED`` like XLA's own, so code that tells an
    out-of-memory from other errors treats both alike.

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
    """The host ran out of memory building a micro-batch for the device.

    A padded micro-batch is a copy; on a CPU the host's memory is the device's, so
    failing to allocate it is the micro-step's out-of-memory, not the user's error.

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

    Every process raises it (or its own error) at the same micro-step, so that all
    shrink the micro-batch together and none waits in a collective the others skip.

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

    Args:
        exc: any exception.

    Returns:
        True for `SimulatedOutOfMemory`, `HostOutOfMemory` and `PeerOutOfMemory`, and for
        an error of a type XLA raises (``JaxRuntimeError``, or exactly ``ValueError`` from
        the compiled fast path) whose text is XLA's: the status ``RESOURCE_EXHAUSTED``
        first (or after ``INTERNAL: Error dispatching computation:``), or an allocator's
        message with its byte count or a CUDA library's allocation-failure status. False
        for every other error: one that came through a host callback (its text carries
        the callback's Python traceback), a plain ``RuntimeError`` (which XLA never
        raises) and any text that merely mentions memory.

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

    Any other error propagates unchanged, with its traceback: the one place the rule
    "only out-of-memory is caught" is written.

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
    """Raised when even the smallest candidate size does not fit.

    Attributes:
        smallest: the smallest candidate, which did not fit.
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
    """``fit`` stopped part-way; what it did is here, the error that stopped it is ``__cause__``.

    Attributes:
        state: the state after the last update that completed (the state ``fit`` was
            given when none did): go on from it, or save it.
        history: the metrics of the updates this call completed.
        batch: the batch in flight, whose update did not complete; the stream has
            moved past it (None when no update was in flight: the error came from the
            stream, from ``after_update`` or from ``on_update``).

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

    The optimizer step needs the same memory whatever the micro-batch size, so shrinking
    cannot help: free device memory, then call ``step(error.state, batch)`` again.

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

    Raised only where no host copy was kept (a size trusted after it ran once): restore
    the state from a checkpoint.

    Examples:
        >>> issubclass(StateLostError, RuntimeError)
        True
    """
