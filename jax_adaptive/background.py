"""A search on a thread of its own, and the largest size it has found to fit so far.

The first update of a new job shape need not wait for the whole search: once one size
is known to fit, its program is compiled and measured, and every plan trains the same,
so the first calls can run it while the search goes on (`AdaptiveStep`'s
``background_search``). On a GPU host the compiles run on idle CPU cores while the
device trains; the search's wall time is then hidden behind training, not added to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["INTERIM", "BackgroundSearch", "Fit", "first_size"]

INTERIM = "the largest size found to fit so far, while the search goes on"
"""A `jax_adaptive.Plan`'s ``source`` while a search goes on in the background."""


def first_size(T: int, multiple_of: int) -> int:
    """The size a search in the background asks first: an eighth of ``T``, which fits most limits.

    A multiple of ``multiple_of`` (at least one of it). Measured on the NNX MNIST step:
    without it the search's guesses come from above and its first fit was its last trial.

    Examples:
        >>> first_size(512, 1), first_size(100, 8), first_size(4, 2)
        (64, 8, 2)
    """
    return max(multiple_of, T // 8 // multiple_of * multiple_of)


class Fit(NamedTuple):
    """A size the search found to fit, and its compiled program."""

    size: int
    compiled: Any


class BackgroundSearch:
    """Runs ``search(found)`` on a thread; ``found(size, compiled)`` reports each fit.

    The caller's thread waits only for the first fit (`first_fit`) and takes the search's
    result, or its error, once it has ended (`finish`).

    Args:
        search: runs the search and returns its result; calls ``found(size, compiled)``
            for each size that fits, on its own thread.

    Examples:
        >>> import time
        >>> def search(found):
        ...     found(4, "program at 4")  # the first size found to fit
        ...     time.sleep(0.05)  # the search goes on
        ...     found(6, "program at 6")
        ...     return 6
        >>> background = BackgroundSearch(search)
        >>> background.first_fit().size  # waits for the first fit only
        4
        >>> background.finish()  # waits for the end (raises the search's error)
        6
        >>> background.first_fit() is None  # ended: no interim size
        True
    """

    def __init__(self, search: Callable[[Callable[[int, Any], None]], Any]):
        self._fit: Fit | None = None
        self._result: Any = None
        self._ended = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        # Not a daemon: a process that ends while the search compiles waits for it; a
        # daemon thread killed inside XLA's compiler aborts the process (measured: "terminate
        # called after throwing an instance of ''", status 134).
        self._thread = threading.Thread(
            target=self._run, args=(search,), name="jax_adaptive-search", daemon=False
        )
        self._thread.start()

    def first_fit(self) -> Fit | None:
        """The largest size found to fit so far, after waiting for the first; None once ended."""
        with self._changed:
            self._changed.wait_for(lambda: self._fit is not None or self._ended)
            return None if self._ended else self._fit

    def finish(self) -> Any:
        """Waits for the search to end and returns its result; raises its error, if any."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def _found(self, size: int, compiled: Any) -> None:
        with self._changed:
            if self._fit is None or size > self._fit.size:
                self._fit = Fit(size, compiled)
            self._changed.notify_all()

    def _run(self, search: Callable[[Callable[[int, Any], None]], Any]) -> None:
        try:
            self._result = search(self._found)
        except BaseException as exc:  # raised on the caller's thread by `finish`
            self._error = exc
        finally:
            with self._changed:
                self._ended = True
                self._changed.notify_all()
