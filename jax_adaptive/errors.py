"""Every error the library raises, and the one rule (`is_oom`) for which are out-of-memory.

Out-of-memory: XLA's own, `SimulatedOutOfMemory` (a ``memory_limit``), `HostOutOfMemory`
(a padded micro-batch) and `PeerOutOfMemory` (another process); `catch_oom` catches only
these. What stopped and what was kept: `NothingFitsError`, `FitError`,
`OptimizerStepOutOfMemory`, `StateLostError`. The guide: docs/recovery.md.
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
    "UnboundAxisError",
    "catch_oom",
    "is_oom",
]

T = TypeVar("T")

# XLA's out-of-memory is matched on XLA's own words, as raised by jax 0.10 on a CPU under
# an address-space limit (tests/oom_forms_job.py) and jax 0.11 on an H200. Its status
# counts first, or after XLA's wrapper for an earlier run's failure surfacing at a later
# dispatch ("INTERNAL: Error dispatching computation: Out of memory allocating ..."); the
# status anywhere else (inside a user's text) says nothing about who ran out.
_STATUS_PATTERN = re.compile(r"(?:INTERNAL: Error dispatching computation: )*RESOURCE_EXHAUSTED: ")

# XLA's, PJRT's and the CUDA libraries' words for a failed allocation, each with the size
# ("402653184 bytes", "3.00GiB") or status name they always carry.
_SIZE = r"\d+(?:\.\d+)?\s?(?:bytes|[KMGTP]?i?B)"
_ALLOCATION_FAILURES = (
    rf"Out of memory allocating {_SIZE}",  # XLA:CPU, the PJRT CPU client
    # XLA:GPU: "... 3.00GiB with allocator GPU_0_bfc on device 0." (or SE_0_space_0, the
    # platform allocator); older XLA wrote "... 1073741824 bytes.".
    rf"Out of memory while trying to allocate {_SIZE}",
    rf"Allocator \(\w+\) ran out of memory trying to allocate {_SIZE}",  # the BFC allocator
    # cuBLAS / cuDNN workspaces, the CUDA driver and runtime (the H200's platform allocator).
    r"\bCUBLAS_STATUS_ALLOC_FAILED\b",
    r"\bCUDNN_STATUS_ALLOC_FAILED\b",
    r"\bCUDA_ERROR_OUT_OF_MEMORY\b",
    r"\bcudaErrorMemoryAllocation\b",
)
_ALLOCATION_PATTERN = re.compile("|".join(_ALLOCATION_FAILURES))

# A host callback's Python error (debug.callback, pure_callback, io_callback,
# buffer_callback) reaches the caller as the same types, its traceback inside: "INTERNAL:
# CpuCallback error calling callback: Traceback (most recent call last): ...", "INTERNAL:
# Error when calling buffer callback: Traceback ...". XLA's own errors never carry one.
_CALLBACK_MARKERS = (
    "CpuCallback error",
    "Error when calling buffer callback",
    "Traceback (most recent call last):",
)


class SimulatedOutOfMemory(RuntimeError):
    """The out-of-memory a ``memory_limit`` raises; its message starts ``RESOURCE_EXHAUSTED``.

    Examples:
        >>> import jax_adaptive as ja
        >>> ja.is_oom(ja.SimulatedOutOfMemory(needed=2_000, available=1_000))
        True
    """

    def __init__(self, needed: int, available: int, what: str = "program"):
        self.needed, self.available = int(needed), int(available)
        super().__init__(
            f"RESOURCE_EXHAUSTED: simulated out of memory: the {what} needs {self.needed:,} "
            f"bytes (estimate) but memory_limit allows {self.available:,} bytes."
        )


class HostOutOfMemory(RuntimeError):
    """The host ran out of memory copying a padded micro-batch (on a CPU: the micro-step's)."""

    def __init__(self, nbytes: int):
        super().__init__(
            f"RESOURCE_EXHAUSTED: Out of memory allocating {nbytes:,} bytes on the host for a "
            "padded micro-batch."
        )


class PeerOutOfMemory(RuntimeError):
    """Another process of a ``jax.distributed`` job ran out of memory at this micro-step.

    Raised with the peer's own error, so that all processes shrink together and none waits
    in a collective the others skip.
    """

    def __init__(self, size: int):
        self.size = int(size)
        super().__init__(
            f"RESOURCE_EXHAUSTED: another process ran out of memory at micro-batch {self.size}."
        )


def is_oom(exc: BaseException) -> bool:
    r"""Tells whether an exception is an XLA/JAX out-of-memory error, real or simulated.

    True for the three classes above, and for a ``JaxRuntimeError`` or exact ``ValueError``
    (the compiled fast path) in XLA's words (the patterns above); false for any other
    error: a host callback's, a ``RuntimeError``, a text that merely mentions memory.

    Examples:
        >>> import jax, jax_adaptive as ja
        >>> ja.is_oom(ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 402653184 bytes."))
        True
        >>> ja.is_oom(jax.errors.JaxRuntimeError(
        ...     "INTERNAL: CpuCallback error calling callback: Traceback (most recent call "
        ...     "last):\n  ...\nRuntimeError: CUDA out of memory. failed to allocate 2.00 GiB"))
        False
        >>> ja.is_oom(ValueError("the loss ran out of memory")), ja.is_oom(MemoryError())
        (False, False)
        >>> is_oom(HostOutOfMemory(8)), is_oom(PeerOutOfMemory(size=64))
        (True, True)
    """
    if isinstance(exc, SimulatedOutOfMemory | HostOutOfMemory | PeerOutOfMemory):
        return True
    # XLA raises JaxRuntimeError on a first call and a plain ValueError on the fast path.
    if not (isinstance(exc, jax.errors.JaxRuntimeError) or type(exc) is ValueError):
        return False
    message = str(exc)
    # Callbacks first: no text of the user's ("RESOURCE_EXHAUSTED", ...) makes one count.
    if any(marker in message for marker in _CALLBACK_MARKERS):
        return False
    return bool(_STATUS_PATTERN.match(message) or _ALLOCATION_PATTERN.search(message))


def catch_oom(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """Runs ``fn``; returns ``(result, None)``, or ``(None, error)`` if it ran out of memory.

    Examples:
        >>> def full():
        ...     raise SimulatedOutOfMemory(needed=2, available=1)
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
    """Even the smallest candidate size, ``.smallest``, does not fit (``.trials`` were made).

    Examples:
        >>> import jax_adaptive as ja
        >>> try:
        ...     ja.search_max_size(lambda size: False, hi=8)
        ... except ja.NothingFitsError as error:
        ...     print(error.smallest)
        1
    """

    def __init__(self, smallest: int, trials: list[Any], detail: str = ""):
        self.smallest, self.trials, self.detail = smallest, trials, detail
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
        >>> import jax_adaptive as ja, jax_adaptive.loop
        >>> step = lambda state, batch: (state + 6 // batch, {"loss": batch, "examples": 1})
        >>> try:
        ...     ja.loop.fit_loop(step, 0, [1, 2, 0, 4])
        ... except ja.FitError as error:
        ...     print(error.state, len(error.history), error.batch, repr(error.__cause__))
        9 2 0 ZeroDivisionError('integer division or modulo by zero')
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

    Shrinking cannot help: free device memory, then call ``step(error.state, batch)`` again.

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


class UnboundAxisError(NameError):
    """A model reduces over a named axis (written for ``pmap``) that nothing binds.

    JAX's own `NameError` ("unbound axis name"), said with the argument that binds it.

    Attributes:
        axis_name: the axis, as the model names it (Flax's ImageNet example: ``"batch"``).

    Examples:
        >>> str(UnboundAxisError("batch", "linen_classifier_loss")).split(": ")[-1]
        "pass axis_name='batch' to linen_classifier_loss."
    """

    def __init__(self, axis_name: str, where: str):
        self.axis_name = axis_name
        super().__init__(
            f"the model reduces over the axis {axis_name!r} (BatchNorm(axis_name="
            f"{axis_name!r}), written for pmap) and nothing binds it: pass "
            f"axis_name={axis_name!r} to {where}."
        )

    @classmethod
    def parse(cls, exc: NameError, where: str) -> UnboundAxisError | None:
        """JAX's "unbound axis name: NAME" as this error; None for another `NameError`."""
        found = re.search(r"unbound axis name: (\w+)", str(exc))
        return None if found is None else cls(found.group(1), where)
