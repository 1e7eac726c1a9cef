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
    width: int = 1,
    prepare: Callable[[list[int]], None] | None = None,
    known_good: int | None = None,
) -> SearchResult:
    """Finds the exact largest size in ``[lo, hi]``, a multiple of ``multiple_of``, that fits.

    The largest candidate is tried first (on a large device one call settles it), then
    the bracket between the largest size known to fit and the smallest known not to is
    narrowed: by bisection, at most ``ceil(log2(n)) + 1`` rounds for ``n`` candidates,
    or by ``propose``'s guesses, taken only while bisection could still finish within
    ``2 * ceil(log2(n + 1)) + 2`` rounds (a good guesser needs two or three).

    A round asks up to ``width`` sizes, which ``prepare`` (if given) gets ready side by
    side before they are asked (the sizing engine compiles them in parallel): with a
    guess, its neighbours (the guess fits and the next does not: settled in one round);
    without one, sizes that split the bracket evenly (the first round: the largest and
    the middle, two points for a guesser's line). The largest alone when the guess is
    that it fits. ``width=1`` asks one size a round.

    Args:
        fits: the oracle; if a size fits, every smaller one does.
        lo: the smallest size allowed.
        hi: the largest size allowed.
        multiple_of: every candidate is a multiple of this.
        propose: ``propose(good, bad) -> size or None``, from the largest size known to
            fit and the smallest known not to (each or None); rounded down to a multiple,
            ignored outside the bracket.
        width: the sizes asked per round, at least 1.
        prepare: ``prepare(sizes)``, called with each round's sizes before ``fits``.
        known_good: a candidate already known to fit: the bracket starts above it, and
            it is not asked again.

    Raises:
        NothingFitsError: when the smallest candidate does not fit.
        ValueError: when ``[lo, hi]`` holds no multiple of ``multiple_of``.

    Examples:
        >>> result = search_max_size(lambda s: s * 3 <= 100, lo=1, hi=64)
        >>> result.size, result.calls
        (33, 7)
        >>> search_max_size(lambda s: s <= 37, hi=64, multiple_of=8).size
        32
        >>> rounds = []
        >>> search_max_size(lambda s: s * 3 <= 100, hi=64, width=3, prepare=rounds.append).size
        33
        >>> rounds  # each round's sizes, asked side by side
        [[21, 43, 64], [26, 32, 37], [33, 34, 35]]
        >>> [t.size for t in search_max_size(lambda s: s <= 40, hi=64, known_good=8).trials]
        [36, 50, 43, 39, 41, 40]
    """
    _check_int("lo", lo, 1)
    _check_int("hi", hi, 1)
    _check_int("multiple_of", multiple_of, 1)
    _check_int("width", width, 1)
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
        return None if guess is None else int(guess) // multiple_of

    # Invariant: every k <= good fits (good = first - 1: none known), every k >= bad does
    # not (bad = last + 1: none known). A guess is taken only while the rounds left in
    # the budget could still finish by bisection if it narrowed the bracket by one.
    budget = 2 * (last - first + 1).bit_length() + 2
    good, bad, rounds = first - 1, last + 1, 0
    if known_good is not None:
        _check_int("known_good", known_good, 1)
        if known_good % multiple_of or not first <= known_good // multiple_of <= last:
            raise ValueError(
                f"{known_good=} is not a multiple of {multiple_of=} in [{lo=}, {hi=}]."
            )
        good = known_good // multiple_of
    while bad - good > 1:
        affordable = rounds + 1 + (bad - good - 2).bit_length() <= budget
        k = proposal(good, bad) if affordable and propose is not None else None
        if k is not None and k >= last and bad == last + 1:  # the largest, guessed to fit
            ks = [last]
        else:
            ks = _round(
                k if k is not None and good < k < bad else None, good, bad, first, last, width
            )
        if prepare is not None and width > 1:
            prepare([k * multiple_of for k in ks])
        rounds += 1
        for k in ks:  # ascending: a size that does not fit closes the bracket above it
            if k >= bad:
                break
            if ask(k):
                good = k
            else:
                bad = k
    if good < first:
        raise NothingFitsError(first * multiple_of, trials)
    return SearchResult(good * multiple_of, trials)


def _round(guess: int | None, good: int, bad: int, first: int, last: int, width: int) -> list[int]:
    """One round's candidates, ascending, strictly inside ``(good, bad)``: at most ``width``."""
    if guess is not None:  # the guess, then its neighbours: the one above first
        picks = [guess, guess + 1, guess - 1, guess + 2]
    elif bad == last + 1 and good == first - 1:  # the largest first, then even splits
        picks = [last] + [good + (bad - good) * i // width for i in range(width - 1, 0, -1)]
    else:
        picks = [good + (bad - good) * i // (width + 1) for i in range(width, 0, -1)]
        picks.insert(0, picks.pop(len(picks) // 2))  # the middle first: plain bisection
    ks: list[int] = []
    for k in picks:
        if good < k < bad and k not in ks and len(ks) < width:
            ks.append(k)
    return sorted(ks)
