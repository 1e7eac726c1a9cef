"""Reading a stream ahead in a background thread, so that its host work overlaps training.

The trainer waits for each update (to catch an out-of-memory in it), so a loader read on
demand would add its time to every update. `interrupts_deferred` makes a step that moves
an item from one holder to another whole under an interrupt of any origin: Ctrl-C, or an
exception a signal handler of the user's raises (SIGINT, SIGTERM, SIGALRM...).
"""

from __future__ import annotations

import _signal
import collections
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["ReadAhead", "Unread", "interrupts_deferred", "interrupts_relayed", "raise_lost"]

_POLL = 0.05
"""Seconds between a waiting main thread's looks at a held signal."""

CLOSE_PATIENCE = 2.0
"""Seconds `ReadAhead.close` waits for a read in progress before a Ctrl-C may end the wait.

Past them, a Ctrl-C under Python's default handler (a second one: the first is what
stopped training) stops waiting for a stream that may never return; what that read
gives is lost with the thread, which ends once it returns."""

log = logging.getLogger("jax_adaptive")

_deferring = threading.local()


_SIGNALS = tuple(int(s) for s in signal.valid_signals())
# The C module's getsignal: `signal.getsignal` makes an enum of each answer, which made a
# deferred block cost 150 us (64 signals) where this costs 6.
_getsignal = getattr(_signal, "getsignal", signal.getsignal)


def _python_handled() -> list[int]:
    """The signals whose handler is Python code: the only ones that can raise in the main thread."""
    return [s for s in _SIGNALS if callable(_getsignal(s))]


def deferring() -> bool:
    """Whether this thread is inside `interrupts_deferred` (its signals held)."""
    return getattr(_deferring, "held", None) is not None


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[list[int]]:
    """Holds the signals that arrive inside the block; runs their handlers at its end.

    For a step that must happen whole or not at all (an item taken from one holder and
    kept by the next; a new state kept with the batch it trained on). Python runs a
    signal's handler in the main thread between two bytecodes, so whatever it raises (the
    default SIGINT handler's KeyboardInterrupt, or any exception from a handler of the
    user's for SIGINT, SIGTERM, SIGALRM...) could land anywhere: every signal with a
    Python handler is held, and its handler called once when the block ends (a signal
    that came twice, once, as the system merges them). A blocking wait belongs outside
    the block, or the interrupt would wait too. Only in the main thread (elsewhere no
    handler runs); a block inside another shares the outer one's. Yields the signals
    held: clearing it drops them.

    Examples:
        >>> import os, signal
        >>> with interrupts_deferred() as held:
        ...     os.kill(os.getpid(), signal.SIGINT)  # held, not raised here
        ...     held.clear()  # and dropped
    """
    outer = getattr(_deferring, "held", None)
    if outer is not None or threading.current_thread() is not threading.main_thread():
        yield [] if outer is None else outer
        return
    held: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        held.append(signum)

    # Read before any swap: a handler raising between a swap and a store of what it
    # replaced would leave that signal held for ever (seen: SIGINT, after an alarm).
    previous = {signum: _getsignal(signum) for signum in _python_handled()}
    _deferring.held, _deferring.previous = held, previous
    try:
        for signum in previous:
            # `signal.signal` runs the handlers of signals pending before it swaps: one
            # may raise here (the block not entered); the finally puts back what was swapped.
            signal.signal(signum, hold)
        yield held
    finally:
        _deferring.held = _deferring.previous = None
        errors = _restore(previous, hold)
        _run_handlers(held, previous, errors)


_relayed = threading.local()


@contextlib.contextmanager
def interrupts_relayed() -> Iterator[None]:
    """Keeps what signal handlers raise inside the block, for `raise_lost` to raise again.

    Python runs a signal's handler between two bytecodes of the main thread wherever it
    is: inside a garbage-collector callback or a ``__del__`` too, where what the handler
    raises is printed and dropped (found: a test's Ctrl-C landed in JAX's gc callback,
    ``jax._src.lib._xla_gc_callback``, and ``fit`` trained on for ever; the rare hang of
    issue 37). Each Python handler is wrapped to keep what it raises; `raise_lost`, called
    where an interrupt may land, raises again what was kept and did not reach the caller.
    Only in the main thread; a block inside another shares the outer one's.
    """
    if getattr(_relayed, "raised", None) is not None:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[BaseException] = []

    def wrap(handler: Any) -> Any:
        def relay(signum: int, frame: Any) -> None:
            try:
                handler(signum, frame)
            except BaseException as exc:  # kept, and raised on as it was
                raised.append(exc)
                raise

        relay.wrapped = handler  # type: ignore[attr-defined]
        return relay

    previous = {signum: _getsignal(signum) for signum in _python_handled()}  # before any swap
    relays = {signum: wrap(handler) for signum, handler in previous.items()}
    _relayed.raised = raised
    try:
        for signum, relay in relays.items():
            signal.signal(signum, relay)
        yield
    finally:
        _relayed.raised = None
        errors: list[BaseException] = []
        for signum, handler in previous.items():
            while _getsignal(signum) is relays[signum]:  # not replaced inside the block
                try:
                    signal.signal(signum, handler)
                except BaseException as exc:  # raised below, in order
                    errors.append(exc)
        if errors:
            raise errors[0]


def raise_lost() -> None:
    """Raises again what a signal handler raised and Python dropped (`interrupts_relayed`).

    Call it where an interrupt may land, never while an exception propagates: what the
    handlers raised since the last call and did not end the caller's work was dropped.
    """
    raised = getattr(_relayed, "raised", None)
    if raised:
        exc = raised.pop(0)
        raised.clear()
        raise exc


def _ctrl_c_held(held: list[int]) -> bool:
    """Whether a Ctrl-C is held for Python's own SIGINT handler (a person at the keyboard)."""
    handler = (getattr(_deferring, "previous", None) or {}).get(signal.SIGINT)
    handler = getattr(handler, "wrapped", handler)  # under `interrupts_relayed`
    return signal.SIGINT in held and handler is signal.default_int_handler


def _restore(previous: dict[int, Any], hold: Any) -> list[BaseException]:
    """Puts back each handler ``hold`` replaced; returns what handlers raised meanwhile.

    A signal pending at a `signal.signal` call runs its handler first: one already put
    back may raise there, before the swap. The swap is tried again, or a signal would be
    left held for ever (seen: a user's SIGINT handler raised while SIGALRM was being put
    back, and every later alarm went to a dead list).
    """
    errors: list[BaseException] = []
    for signum, handler in previous.items():
        while _getsignal(signum) is hold:  # not replaced inside the block
            try:
                signal.signal(signum, handler)
            except BaseException as exc:  # raised at the block's end, in order
                errors.append(exc)
    return errors


def _run_handlers(held: list[int], handlers: dict[int, Any], errors: list[BaseException]) -> None:
    """Calls each held signal's handler once, in order; raises the first error of all."""
    for signum in dict.fromkeys(held):
        try:
            handlers[signum](signum, None)
        except BaseException as exc:  # raised below, once the others ran
            errors.append(exc)
    if errors:
        raise errors[0]


class Unread(NamedTuple):
    """What a closed `ReadAhead` had read and nobody took: ``items``, then ``error``.

    ``error``: what the stream raised after those items (None: none).
    """

    items: list[Any]
    error: BaseException | None = None

    def __bool__(self) -> bool:
        """Whether anything was handed back: an item or the stream's error."""
        return bool(self.items) or self.error is not None


class _Shared:
    """What the reader thread and its consumer share, changed only under ``lock``.

    The thread appends to ``read`` while fewer than ``depth`` wait there, until the
    stream's end or error, or until ``closing``; ``ended`` once it has returned. The
    consumer pops from ``read``. So the thread ends with nothing handed over only when
    `ReadAhead.close` (or a reader dropped) asked it to: a consumer can never wait for
    a thread that is gone.
    """

    def __init__(self, depth: int):
        self.lock = threading.Condition()  # an RLock: `__del__` may run inside a block
        self.read: collections.deque[tuple[str, Any]] = collections.deque()
        self.depth, self.closing, self.ended = depth, False, False


def _read(iterator: Iterator[Any], shared: _Shared) -> None:
    """The thread: reads an item whenever fewer than ``depth`` wait, until the end or close."""
    lock = shared.lock
    try:
        while True:
            with lock:
                while len(shared.read) >= shared.depth and not shared.closing:
                    lock.wait()
                if shared.closing:
                    return
            try:  # outside the lock: the consumer takes what waits meanwhile
                read = ("item", next(iterator))
            except StopIteration:
                read = ("end", None)
            except BaseException as exc:  # the stream's own error, raised where it is taken
                read = ("error", exc)
            with lock:
                shared.read.append(read)
                lock.notify_all()
            if read[0] != "item":
                return
    finally:
        with lock:
            shared.ended = True
            lock.notify_all()


class ReadAhead:
    """Reads ``iterator`` in a background thread, at most ``depth`` items ahead.

    It yields the iterator's items in order, then raises what the iterator raised (its
    StopIteration, or its error). The iterator is read in the thread only, until `close`,
    which waits for a read in progress, so that no thread outlives it. A reader dropped
    unclosed stops, and what it read is lost. To take an item whole under interrupts,
    `wait` first (interruptible), then take it with `next` inside `interrupts_deferred`
    together with whatever keeps it.

    Args:
        iterator: any iterator (a generator, a loader); read from one thread at a time.
        depth: how many items may be read and not yet taken (at least 1).

    Examples:
        >>> stream = iter(range(5))
        >>> reader = ReadAhead(stream, depth=2)
        >>> next(reader), next(reader)
        (0, 1)
        >>> unread = reader.close()  # the thread has ended; what it read comes back
        >>> unread.items + list(stream)
        [2, 3, 4]
    """

    def __init__(self, iterator: Iterator[Any], depth: int):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"{depth=} must be a positive int.")
        self._shared = _Shared(depth)
        self._finished = False  # the stream's end or error was taken, or the reader closed
        # The thread holds no reference to self: a reader dropped unclosed stops (__del__).
        self._thread = threading.Thread(
            target=_read, args=(iterator, self._shared), name="jax_adaptive-read-ahead"
        )
        self._thread.daemon = True  # a stream that never returns cannot hold the exit
        self._thread.start()

    def __del__(self) -> None:
        if hasattr(self, "_thread"):
            self._stop()  # what it read is dropped with it: `close` keeps it

    def _stop(self) -> None:
        with self._shared.lock:
            self._shared.closing = True
            self._shared.lock.notify_all()  # wakes a thread waiting for room

    def __iter__(self) -> ReadAhead:
        return self

    def wait(self) -> None:
        """Blocks (an interrupt interrupts it) until `next` can return without blocking.

        Inside `interrupts_deferred` it waits with the signals held (it should not have
        to: `wait` first).
        """
        shared = self._shared
        while not self._finished:
            nested = deferring()
            if not nested:
                raise_lost()  # an interrupt a gc callback dropped lands here
            with interrupts_deferred() as held, shared.lock:
                # Held here, a signal cannot land inside the condition's own code (where
                # it could take a wake-up and lose it); its handler runs at the block's end.
                while not shared.read and not shared.ended and (nested or not held):
                    shared.lock.wait(_POLL)
                if shared.read:
                    return
                if shared.ended:  # only `close` ends it with nothing handed over
                    raise RuntimeError("ReadAhead.wait on a reader that was closed.")
            # the held signals' handlers ran without raising: wait on

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        self.wait()
        shared = self._shared
        with interrupts_deferred(), shared.lock:  # taken and its room freed, or neither
            kind, value = shared.read.popleft()
            if kind == "item":
                shared.lock.notify_all()
            else:
                self._finished = True
        if kind == "item":
            return value
        if kind == "end":
            raise StopIteration
        raise value

    def close(self) -> Unread:
        """Stops reading; waits for a read in progress; hands back what was not taken.

        Returns:
            The `Unread` items and the stream's error (not raised here). The thread has
            ended, but after a Ctrl-C past `CLOSE_PATIENCE` seconds of waiting. A stream
            that ended stays ended; the reader reads no more.
        """
        with interrupts_deferred() as held:  # the thread stopped and what it read handed back
            self._stop()
            began = time.monotonic()
            while self._thread.is_alive():  # a read in progress: its item is kept
                # Signals held: CPython 3.11's Thread.join, interrupted, marks a live
                # thread stopped (threading._wait_for_tstate_lock, bpo-45274's handler).
                self._thread.join(_POLL)
                waited = time.monotonic() - began
                if self._thread.is_alive() and waited > CLOSE_PATIENCE and _ctrl_c_held(held):
                    log.warning(
                        "Ctrl-C: stopped waiting after %.1f s for a read of the stream in "
                        "progress; what it reads is lost, and its thread ends when it returns",
                        waited,
                    )
                    break
            items, error = [], None
            shared = self._shared
            while shared.read and not self._finished:
                kind, value = shared.read.popleft()
                if kind == "item":
                    items.append(value)
                else:
                    self._finished, error = True, value
            shared.read.clear()
            self._finished = True
            return Unread(items, error)
