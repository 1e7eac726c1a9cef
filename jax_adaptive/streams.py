"""What a reader of a stream's iterator left in it, for the iterator's next reader.

A reader that groups a stream (`jax_adaptive.Rebatcher`, `jax_adaptive.bucket_batches`)
reads examples it has not yet yielded. They belong to the stream: another ``fit`` on the
same iterator must start with them, or they would be skipped.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from jax_adaptive.read_ahead import ReadAhead, Unread, interrupts_deferred

__all__ = ["Feed", "Left"]

T = TypeVar("T")


class Left(Generic[T]):
    """Per source iterator, what its readers left in it (one kind of reader each).

    Kept weakly for an iterator that takes weak references (a generator: forgotten with
    it); for one that does not (a list's, a ``map``), held while anything waits in it,
    the last ``held_max`` such iterators only.

    Args:
        make: makes an empty one (what a reader of a new iterator starts with); its
            truth value says whether anything waits in it.
        held_max: how many iterators without weak references to hold at once.
    """

    def __init__(self, make: Callable[[], T], held_max: int = 8):
        self.make, self.held_max = make, held_max
        self._weak: weakref.WeakKeyDictionary[Any, T] = weakref.WeakKeyDictionary()
        self._held: collections.OrderedDict[int, tuple[Any, T]] = collections.OrderedDict()

    def reader(self, source: Iterable[Any]) -> tuple[Iterator[Any], T, Callable[[], None]]:
        """``iter(source)``, what waits in it, and what to call after each change to that.

        Only an iterator (``iter(source) is source``) keeps what waits for its next reader;
        another iterable (a list) is read afresh, from an empty `make()`.
        """
        iterator = iter(source)
        if iterator is not source:
            return iterator, self.make(), lambda: None
        waiting = self.of(iterator)
        return iterator, waiting, lambda: self.keep(iterator, waiting)

    def of(self, iterator: Any) -> T:
        """What waits in ``iterator`` (an empty `make()` if new): `keep` it after a change."""
        try:
            return self._weak.setdefault(iterator, self.make())
        except TypeError:  # no weak reference (or not hashable): by identity, held
            held = self._held.get(id(iterator))
            return held[1] if held is not None else self.make()

    def keep(self, iterator: Any, waiting: T) -> None:
        """Keeps ``waiting`` with ``iterator`` from now on (see the class)."""
        try:
            if iterator in self._weak:
                return
        except TypeError:  # no weak reference, or not hashable
            pass
        key = id(iterator)
        self._held.pop(key, None)
        if waiting:
            self._held[key] = (iterator, waiting)
            while len(self._held) > self.held_max:
                self._held.popitem(last=False)


class _HandsBack(Protocol):
    """What a reader leaves in a stream, with the items read ahead and handed back."""

    unread: Unread


class Feed:
    """A reader's items from a stream: those handed back first, then the iterator's.

    The `Unread` items an earlier reader handed back come first, then the stream's error
    if it raised one while read ahead (raised here once), then the iterator, read ahead
    in a background thread when ``read_ahead``. `close` stops the thread (a read in progress
    ends first) and hands back what it read and nobody took, into ``left.unread``.

    Args:
        iterator: the stream's iterator (read in the thread only, once read ahead).
        left: what the reader leaves in the stream (`Left`'s per-iterator object).
        read_ahead: how many items to read ahead (0: none).
    """

    def __init__(self, iterator: Iterator[Any], left: _HandsBack, read_ahead: int):
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"{read_ahead=} must be an int >= 0.")
        self._iterator, self._left, self.read_ahead = iterator, left, read_ahead
        self._reader: ReadAhead | None = None

    def __iter__(self) -> Feed:
        return self

    def wait(self) -> None:
        """Blocks (an interrupt interrupts it) until `next` can take an item without waiting.

        Without ``read_ahead`` the read itself happens in `next`.
        """
        if not self._left.unread and self.read_ahead:
            if self._reader is None:  # started once what was handed back is taken
                with interrupts_deferred():  # a thread started is a reader `close` stops
                    self._reader = ReadAhead(self._iterator, self.read_ahead)
            self._reader.wait()

    def __next__(self) -> Any:
        self.wait()
        unread = self._left.unread
        if unread.items:
            return unread.items.pop(0)
        if unread.error is not None:
            self._left.unread = Unread([])
            raise unread.error
        return next(self._reader if self.read_ahead else self._iterator)

    def close(self) -> None:
        """Stops reading ahead (a read in progress ends first); hands back what was not taken."""
        with interrupts_deferred():  # the reader dropped is the reader closed
            if self._reader is not None:
                reader, self._reader = self._reader, None
                self._left.unread = reader.close()  # it started with nothing handed back
