"""The last call's buffers coming back: how much memory is held, and the waits for it.

The runtime returns a call's buffers on its own threads, later on a busy host; a call
run again before they are back fails again (measured under RLIMIT_AS on a loaded CPU).
`ReleaseWatch` keeps the memory held when each program ran, for the sizing engine's
retries and the calls after them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax

from jax_adaptive.memory import device_bytes_in_use

__all__ = ["RELEASE_PATIENCE", "RELEASE_WAIT", "ReleaseWatch", "held_bytes", "wait_for_release"]


def held_bytes(device: jax.Device | None = None) -> int | None:
    """What a release of buffers shrinks, in bytes (None where nothing says).

    The device's bytes in use where it says (a GPU), else this process's address space
    (Linux's ``/proc/self/statm``).

    Examples:
        >>> held_bytes(jax.devices("cpu")[0]) > 0  # a CPU: the process's address space
        True
    """
    in_use = device_bytes_in_use(device)
    if in_use is not None:
        return in_use
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[0]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = 4096 if not hasattr(os, "sysconf") else os.sysconf("SC_PAGE_SIZE")
_SETTLE_POLL = 0.05


def wait_for_release(
    least: float, most: float, target: int | None = None, device: jax.Device | None = None
) -> float:
    """Waits ``least`` seconds, then until `held_bytes` is down to ``target``, up to ``most``.

    The runtime returns released buffers on its own threads, later on a busy host: after
    an out-of-memory, a run tried again before they are back fails again. ``target``: what
    was held when the run last succeeded (None: wait ``least`` only). Returns the seconds
    waited.

    Examples:
        >>> 0.01 <= wait_for_release(0.01, 0.5, target=held_bytes()) < 0.5
        True
        >>> 0.2 <= wait_for_release(0.0, 0.2, target=0)  # never that low: ``most``
        True
    """
    start = time.monotonic()
    time.sleep(least)
    while target is not None and time.monotonic() - start < most:
        held = held_bytes(device)
        if held is None or held <= target:
            break
        time.sleep(_SETTLE_POLL)
    return time.monotonic() - start


RELEASE_WAIT = 0.2
"""Seconds a size that ran waits at least, after a real out-of-memory, before it runs once
more; then on, up to `RELEASE_PATIENCE`, until the memory held (`held_bytes`) is down to
the least it was when that size ran."""

RELEASE_PATIENCE = 2.0


class ReleaseWatch:
    """The memory held when each program ran, and the waits for the last call's release.

    The runtime returns a call's buffers on its own threads, later on a busy host, and
    a call that races them fails (measured under RLIMIT_AS on a loaded CPU: every call,
    once it had). `retry` waits before a size that ran runs once more; once such a retry
    ran (`ran` says so), `start` waits at each call's start too, for up to
    `RELEASE_PATIENCE`; a wait that times out takes what is held then as the new level,
    so memory the user keeps costs one wait, not one per call.

    Examples:
        >>> watch = ReleaseWatch(jax.devices("cpu")[0])
        >>> watch.start(8)
        >>> watch.ran(8, retried=False)  # ran: the memory held then is its level
        False
        >>> watch.retry(8) >= RELEASE_WAIT
        True
    """

    def __init__(self, device: jax.Device):
        self.device = device
        self.settle_first = False  # a retry after the release ran: calls wait for it first
        self._held_at_start: int | None = None  # `held_bytes` when this call began
        self._held_ran: dict[Any, int] = {}  # ... the least at which each program ran

    def start(self, size: int | None) -> None:
        """A call of ``size`` begins: waits for the release first once that was needed."""
        target = self._held_ran.get(size)
        settle = self.settle_first and target is not None
        if settle:
            wait_for_release(0.0, RELEASE_PATIENCE, target, self.device)
        self._held_at_start = held = held_bytes(self.device)  # read once
        if settle and held is not None and held > target:
            self._held_ran[size] = held

    def retry(self, size: int) -> float:
        """Waits before ``size``, which ran before, runs once more; the seconds waited."""
        target = self._held_ran.get(size)
        return wait_for_release(RELEASE_WAIT, RELEASE_PATIENCE, target, self.device)

    def ran(self, what: Any, retried: bool) -> bool:
        """``what`` ran (after a `retry` when ``retried``); True when calls now settle first."""
        if self._held_at_start is not None:
            held = self._held_at_start
            self._held_ran[what] = min(self._held_ran.get(what, held), held)
        if retried and not self.settle_first:
            self.settle_first = True
            return True
        return False
