"""Reading a stream ahead in a background thread, so that its host work overlaps training.

The trainer waits for each update (to catch an out-of-memory in it), so a loader read on
demand would add its time to every update. `interrupts_deferred` makes a step that moves
an item from one holder to another whole under Ctrl-C.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

__all__ = ["ReadAhead", "Unread", "interrupts_deferred"]

CLOSE_GRACE = 0.25
"""Seconds `ReadAhead.close` waits for a read in progress before it returns without it."""

_POLL = 0.05
"""Seconds between a waiting main thread's looks at a held Ctrl-C."""

_deferring = threading.local()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[list[int]]:
    """Holds a Ctrl-C (SIGINT) that arrives inside the block, and raises it at the block's end.

    For a step that must happen whole or not at all (an item taken from one holder and
    kept by the next; a new state kept with the batch it trained on): a blocking wait
    belongs outside it, or the interrupt would wait too. Only in the main thread under
    Python's default SIGINT handler (elsewhere it holds nothing); a block inside another
    shares the outer one's. Yields the signals held: clearing it drops them.

    Examples:
        >>> import os, signal
        >>> with interrupts_deferred() as held:
        ...     os.kill(os.getpid(), signal.SIGINT)  # held, not raised here
        ...     held.clear()  # and dropped
    """
    outer = getattr(_deferring, "held", None)
    main = threading.current_thread() is threading.main_thread()
    if (
        outer is not None
        or not main
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield [] if outer is None else outer
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    _deferring.held = held
    try:
        yield held
    finally:
        _deferring.held = None
        signal.signal(signal.SIGINT, previous)
        if held:
            raise KeyboardInterrupt


class Unread(NamedTuple):
    """What a closed `ReadAhead` had read and nobody took: ``items``, then ``error``.

    ``error``: what the stream raised after those items (None: none). ``rest``: for a
    read in progress at close, waits for it and gives what follows (an `Unread`).
    """

    items: list[Any]
    error: BaseException | None = None
    rest: Callable[[], Unread] | None = None

    def __bool__(self) -> bool:
        """Whether anything was handed back: an item, the stream's error, a read to come."""
        return bool(self.items) or self.error is not None or self.rest is not None


def _read(
    iterator: Iterator[Any],
    slots: threading.Semaphore,
    out: queue.SimpleQueue,
    available: threading.Semaphore,
    closing: threading.Event,
) -> None:
    """The thread: reads an item whenever a slot is free, until the end, an error or close."""
    while True:
        slots.acquire()
        if closing.is_set():  # `close` frees a slot to wake it
            return
        try:
            read = ("item", next(iterator))
        except StopIteration:
            read = ("end", None)
        except BaseException as exc:  # the stream's own error, raised where it is taken
            read = ("error", exc)
        out.put(read)
        available.release()
        if read[0] != "item":
            return


class ReadAhead:
    """Reads ``iterator`` in a background thread, at most ``depth`` items ahead.

    It yields the iterator's items in order, then raises what the iterator raised (its
    StopIteration, or its error). The iterator is read in the thread only, until `close`
    and its `Unread.rest`; a reader dropped unclosed stops, and what it read is lost.

    Args:
        iterator: any iterator (a generator, a loader); read from one thread at a time.
        depth: how many items may be read and not yet taken (at least 1).

    Examples:
        >>> stream = iter(range(5))
        >>> reader = ReadAhead(stream, depth=2)
        >>> next(reader), next(reader)
        (0, 1)
        >>> unread = reader.close()  # the thread stops; what it read comes back
        >>> unread.items + list(stream)
        [2, 3, 4]
    """

    def __init__(self, iterator: Iterator[Any], depth: int):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"{depth=} must be a positive int.")
        self._slots = threading.Semaphore(depth)  # one per item read and not yet taken
        self._queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._available = threading.Semaphore(0)  # one per item (or end) in the queue
        self._ready = False  # `wait` took the permit of the next item in the queue
        self._closing = threading.Event()
        self._finished = False  # the stream's end or error was taken
        # The thread holds no reference to self: a reader dropped unclosed stops (__del__).
        args = (iterator, self._slots, self._queue, self._available, self._closing)
        self._thread = threading.Thread(target=_read, args=args, name="jax_adaptive-read-ahead")
        self._thread.daemon = True  # a stream that never returns cannot hold the exit
        self._thread.start()

    def __del__(self) -> None:
        if hasattr(self, "_thread"):
            self._stop()  # what it read is dropped with it: `close` keeps it

    def _stop(self) -> None:
        self._closing.set()
        self._slots.release()  # wakes a thread waiting for a slot

    def __iter__(self) -> ReadAhead:
        return self

    def wait(self) -> None:
        """Blocks (a Ctrl-C interrupts it) until `next` can return without blocking."""
        # A Ctrl-C raised inside a semaphore's own code could take its permit without
        # `_ready` saying so, or lose the wake-up of the other thread (measured: both
        # threads waiting for ever under load); it is held and raised between polls.
        with interrupts_deferred() as held:
            while not (self._ready or self._finished or held):
                self._ready = self._available.acquire(timeout=_POLL)
                if not self._ready and not self._thread.is_alive():  # nothing can come now
                    self._ready = self._available.acquire(blocking=False)
                    if not self._ready:  # seen once under load: a failure, not a hang
                        raise RuntimeError(
                            "the read-ahead thread ended without handing over an item; "
                            "please report this traceback."
                        )

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        self.wait()
        with interrupts_deferred():  # the item taken and its slot freed, or neither
            self._ready = False
            kind, value = self._queue.get_nowait()
            if kind == "item":
                self._slots.release()
                return value
            self._finished = True
        if kind == "end":
            raise StopIteration
        raise value

    def close(self, grace: float = CLOSE_GRACE) -> Unread:
        """Stops reading; hands back what was read and not taken, after ``grace`` at most.

        Returns:
            The `Unread` items and the stream's error (not raised here). A read still in
            progress after ``grace`` seconds goes on in the thread, which then ends:
            ``rest`` waits for it. A stream that ended stays ended.
        """
        with interrupts_deferred() as held:
            self._stop()
            self._thread.join(grace)
            if isinstance(sys.exc_info()[1], KeyboardInterrupt):
                held.clear()  # a second Ctrl-C while the first unwinds: one is enough
        items, error = [], None
        while not self._finished:
            try:
                kind, value = self._queue.get_nowait()
            except queue.Empty:
                break
            if kind == "item":
                items.append(value)
            else:
                self._finished, error = True, value
        if self._thread.is_alive() and not self._finished:  # a read in progress
            return Unread(items, error, rest=self._rest)
        self._finished = True
        return Unread(items, error)

    def _rest(self) -> Unread:
        """What the read in progress at `close` gave, once its thread has ended."""
        self._thread.join()
        return self.close()
