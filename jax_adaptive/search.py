"""A pure search for the largest size a monotone oracle ``fits(size) -> bool`` accepts.

It knows nothing of memory or XLA: the sizing engine gives it the oracle and the guesses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from jax_adaptive.errors import NothingFitsError

__all__ = ["SearchResult", "SearchTrial", "search_max_size"]


class SearchTrial(NamedTuple):
    """One call of the oracle: the size asked, its answer and what it cost."""

    size: int
    fits: bool
    seconds: float


class SearchResult(NamedTuple):
    """The largest fitting size and the trials that found it, in the order made."""

    size: int
    trials: list[SearchTrial]

    @property
    def calls(self) -> int:
        """The number of oracle calls made."""
        return len(self.trials)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}.")
    return value


def search_max_size(
    fits: Callable[[int], bool],
    *,
    lo: int = 1,
    hi: int,
    multiple_of: int = 1,
    propose: Callable[[int | None, int | None], int | None] | None = None,
) -> SearchResult:
    """Finds the exact largest size in ``[lo, hi]``, a multiple of ``multiple_of``, that fits.

    The largest candidate is tried first (on a large device one call settles it), then
    the bracket between the largest size known to fit and the smallest known not to is
    narrowed: by bisection, at most ``ceil(log2(n)) + 1`` calls for ``n`` candidates,
    or by ``propose``'s guesses, taken only while bisection could still finish within
    ``2 * ceil(log2(n + 1)) + 2`` calls (a good guesser needs two or three).

    Args:
        fits: the oracle; if a size fits, every smaller one does.
        lo: the smallest size allowed.
        hi: the largest size allowed.
        multiple_of: every candidate is a multiple of this.
        propose: ``propose(good, bad) -> size or None``, from the largest size known to
            fit and the smallest known not to (each or None); rounded down to a multiple,
            ignored outside the bracket.

    Raises:
        NothingFitsError: when the smallest candidate does not fit.
        ValueError: when ``[lo, hi]`` holds no multiple of ``multiple_of``.

    Examples:
        >>> result = search_max_size(lambda s: s * 3 <= 100, lo=1, hi=64)
        >>> result.size, result.calls
        (33, 7)
        >>> search_max_size(lambda s: s <= 37, hi=64, multiple_of=8).size
        32
    """
    _check_int("lo", lo, 1)
    _check_int("hi", hi, 1)
    _check_int("multiple_of", multiple_of, 1)
    first = -(-lo // multiple_of)  # candidates are k * multiple_of for k in [first, last]
    last = hi // multiple_of
    if first > last:
        raise ValueError(f"no multiple of {multiple_of=} lies in [{lo=}, {hi=}].")

    trials: list[SearchTrial] = []

    def ask(k: int) -> bool:
        size = k * multiple_of
        start = time.perf_counter()
        ok = bool(fits(size))
        trials.append(SearchTrial(size, ok, time.perf_counter() - start))
        return ok

    def proposal(good: int, bad: int) -> int | None:
        guess = propose(  # type: ignore[misc]
            good * multiple_of if good >= first else None,
            bad * multiple_of if bad <= last else None,
        )
        if guess is None:
            return None
        k = int(guess) // multiple_of
        return k if good < k < bad else None

    # Invariant: every k <= good fits (good = first - 1: none known), every k >= bad does
    # not (bad = last + 1: none known). A guess is taken only while the calls left in
    # the budget could still finish by bisection if it narrowed the bracket by one.
    budget = 2 * (last - first + 1).bit_length() + 2
    good, bad = first - 1, last + 1
    while bad - good > 1:
        affordable = len(trials) + 1 + (bad - good - 2).bit_length() <= budget
        k = proposal(good, bad) if affordable and propose is not None else None
        if k is None:
            # With no guess, try the largest candidate first, then bisect.
            k = last if bad == last + 1 and good == first - 1 else (good + bad) // 2
        if ask(k):
            good = k
        else:
            bad = k
    if good < first:
        raise NothingFitsError(first * multiple_of, trials)
    return SearchResult(good * multiple_of, trials)
