"""Reading a stream ahead in a background thread, so that its host work overlaps training.

A training loop that reads its next batch only once an update has finished leaves the
device idle while the loader works (decoding, augmenting, Python code): a hand-written
JAX loop hides that behind asynchronous dispatch, but `jax_adaptive.AdaptiveTrainer`
waits for each update to finish, so that an out-of-memory in it is caught and recovered.
`ReadAhead` reads the next items while the update runs. What it read and nobody took is
handed back by `ReadAhead.close`, in order, with the stream's error if it raised one:
nothing read is lost (`jax_adaptive.Rebatcher` keeps it for the stream's next reader).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["ReadAhead", "Unread"]


class Unread(NamedTuple):
    """What a closed `ReadAhead` had read and nobody took: ``items``, then ``error``.

    ``error`` is the exception the stream raised after those items (None: none).
    """

    items: list[Any]
    error: BaseException | None = None

    def __bool__(self) -> bool:
        """Whether anything was handed back: an item, or the stream's error.

        Examples:
            >>> bool(Unread([])), bool(Unread([1])), bool(Unread([], OSError("gone")))
            (False, True, True)
        """
        return bool(self.items) or self.error is not None


def _read(
    iterator: Iterator[Any],
    slots: threading.Semaphore,
    out: queue.SimpleQueue,
    closing: threading.Event,
) -> None:
    """The thread: reads an item whenever a slot is free, until the end, an error or close."""
    while True:
        slots.acquire()
        if closing.is_set():  # `close` frees a slot to wake it
            return
        try:
            item = next(iterator)
        except StopIteration:
            out.put(("end", None))
            return
        except BaseException as exc:  # the stream's own error, raised where it is taken
            out.put(("error", exc))
            return
        out.put(("item", item))


class ReadAhead:
    """Reads ``iterator`` in a background thread, at most ``depth`` items ahead.

    Iterating it yields the iterator's items in order, then raises what the iterator
    raised (its StopIteration, or its error, with its traceback). The iterator is read
    in the thread only: do not read it elsewhere until `close` returns. Close it to get
    back what it read ahead; a reader dropped unclosed stops, and what it read is lost.

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
        self._closing = threading.Event()
        self._finished = False  # the stream's end or error was taken
        # The thread holds no reference to self: a reader dropped unclosed stops (__del__).
        args = (iterator, self._slots, self._queue, self._closing)
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

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == "item":
            self._slots.release()
            return value
        self._finished = True
        if kind == "end":
            raise StopIteration
        raise value

    def close(self) -> Unread:
        """Stops reading once the read in progress returns; hands back what was not taken.

        Returns:
            The `Unread` items, in the stream's order, and the stream's error if it
            raised one while read ahead (not raised here). A stream that ended stays
            ended: its iterator raises StopIteration again.
        """
        self._stop()
        self._thread.join()
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
        self._finished = True
        return Unread(items, error)
