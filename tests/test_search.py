import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_adaptive import NothingFitsError, search_max_size


def brute_force(threshold, lo, hi, multiple_of):
    fitting = [s for s in range(lo, hi + 1) if s % multiple_of == 0 and s <= threshold]
    return max(fitting) if fitting else None


def bound(lo, hi, multiple_of):
    n = hi // multiple_of - (-(-lo // multiple_of)) + 1
    return 2 * math.ceil(math.log2(n + 1)) + 2


# A bracket [lo, lo + span], multiples of multiple_of, and the largest size that fits.
BRACKETS = {
    "lo": st.integers(1, 50),
    "span": st.integers(0, 5000),
    "multiple_of": st.integers(1, 16),
    "threshold": st.integers(0, 6000),
}


@settings(max_examples=300, deadline=None)
@given(**BRACKETS)
def test_matches_brute_force(lo, span, multiple_of, threshold):
    hi = lo + span
    if brute_force(10**9, lo, hi, multiple_of) is None:
        with pytest.raises(ValueError, match="no multiple"):
            search_max_size(lambda s: True, lo=lo, hi=hi, multiple_of=multiple_of)
        return
    calls = []

    def fits(size):
        calls.append(size)
        assert lo <= size <= hi and size % multiple_of == 0
        return size <= threshold

    expected = brute_force(threshold, lo, hi, multiple_of)
    if expected is None:
        with pytest.raises(NothingFitsError) as info:
            search_max_size(fits, lo=lo, hi=hi, multiple_of=multiple_of)
        assert info.value.smallest == min(calls)
        assert str(info.value.smallest) in str(info.value)
    else:
        result = search_max_size(fits, lo=lo, hi=hi, multiple_of=multiple_of)
        assert result.size == expected
        assert [t.size for t in result.trials] == calls
        assert [t.fits for t in result.trials] == [c <= threshold for c in calls]
    assert len(calls) <= bound(lo, hi, multiple_of)
    assert len(set(calls)) == len(calls), "the same size was asked twice"


@settings(max_examples=200, deadline=None)
@given(**BRACKETS, known=st.integers(0, 10**6), width=st.integers(1, 4))
def test_a_size_known_to_fit_is_not_asked_and_the_answer_stays_exact(
    lo, span, multiple_of, threshold, known, width
):
    """``known_good``: asked before the search (the background search's first size)."""
    hi = lo + span
    expected = brute_force(threshold, lo, hi, multiple_of)
    if expected is None:
        return
    fitting = [s for s in range(lo, expected + 1) if s % multiple_of == 0]
    known_good = fitting[known % len(fitting)]
    calls = []

    def fits(size):
        calls.append(size)
        assert known_good < size <= hi and size % multiple_of == 0
        return size <= threshold

    result = search_max_size(
        fits, lo=lo, hi=hi, multiple_of=multiple_of, known_good=known_good, width=width
    )
    assert result.size == expected
    assert len(set(calls)) == len(calls) <= bound(lo, hi, multiple_of) * width


def test_a_size_known_to_fit_must_be_a_candidate():
    with pytest.raises(ValueError, match="known_good=12 is not a multiple of multiple_of=8"):
        search_max_size(lambda s: True, hi=64, multiple_of=8, known_good=12)
    with pytest.raises(ValueError, match="known_good=72"):
        search_max_size(lambda s: True, hi=64, multiple_of=8, known_good=72)


@settings(max_examples=200, deadline=None)
@given(
    hi=st.integers(1, 5000),
    threshold=st.integers(1, 5000),
    guess_error=st.integers(-3000, 3000),
)
def test_any_proposer_stays_exact_and_bounded(hi, threshold, guess_error):
    """A proposer, good or wildly wrong, never costs exactness or the call bound."""
    calls = []

    def fits(size):
        calls.append(size)
        return size <= threshold

    result = search_max_size(
        fits, hi=hi, propose=lambda good, bad: threshold + guess_error + len(calls)
    )
    assert result.size == min(threshold, hi)
    assert len(calls) <= bound(1, hi, 1)


def test_a_good_proposer_needs_few_calls():
    threshold = 3071
    result = search_max_size(
        lambda s: s <= threshold,
        hi=4096,
        propose=lambda good, bad: threshold if good is None else good + 1,
    )
    assert result.size == threshold
    assert result.calls <= 3  # the largest (fails), the guess, the guess + 1


def test_largest_tried_first():
    result = search_max_size(lambda s: True, hi=4096)
    assert result.size == 4096 and result.calls == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"hi": 0}, ValueError),
        ({"hi": 10, "lo": 0}, ValueError),
        ({"hi": 10, "multiple_of": 0}, ValueError),
        ({"hi": 10.5}, TypeError),
        ({"hi": True}, TypeError),
    ],
)
def test_bad_arguments(kwargs, error):
    with pytest.raises(error):
        search_max_size(lambda s: True, **kwargs)


@settings(max_examples=300, deadline=None)
@given(
    **BRACKETS,
    width=st.integers(2, 6),
    guess_error=st.one_of(st.none(), st.integers(-300, 300)),
)
def test_rounds_of_several_sizes_stay_exact_and_take_fewer_rounds(
    lo, span, multiple_of, threshold, width, guess_error
):
    """Each round's sizes are prepared together, then asked; the answer is brute force's.

    Bounded by the one-size search's bound in rounds, and never more rounds than it needs
    with the same proposer.
    """
    hi = lo + span
    if brute_force(10**9, lo, hi, multiple_of) is None:
        return
    rounds, calls = [], []

    def fits(size):
        assert size in rounds[-1], "a size asked was not prepared in its round"
        calls.append(size)
        return size <= threshold

    def prepare(sizes):
        assert 1 <= len(sizes) <= width and sizes == sorted(set(sizes))
        assert all(lo <= s <= hi and s % multiple_of == 0 for s in sizes)
        rounds.append(sizes)

    def propose(good, bad):
        return None if guess_error is None else threshold + guess_error

    expected = brute_force(threshold, lo, hi, multiple_of)
    search = dict(lo=lo, hi=hi, multiple_of=multiple_of, propose=propose)
    if expected is None:
        with pytest.raises(NothingFitsError):
            search_max_size(fits, width=width, prepare=prepare, **search)
        return
    result = search_max_size(fits, width=width, prepare=prepare, **search)
    assert result.size == expected
    assert len(set(calls)) == len(calls), "the same size was asked twice"
    assert len(rounds) <= bound(lo, hi, multiple_of)
    one_at_a_time = search_max_size(lambda s: s <= threshold, **search)
    assert len(rounds) <= one_at_a_time.calls


def test_a_good_proposer_settles_in_one_round():
    """The guess and the next size side by side: the guess fits, the next does not."""
    rounds = []
    result = search_max_size(
        lambda s: s <= 3071, hi=4096, propose=lambda good, bad: 3071, width=2, prepare=rounds.append
    )
    assert result.size == 3071
    assert rounds == [[3071, 3072]]


def test_without_a_guess_the_first_round_is_the_largest_and_the_middle():
    rounds = []
    result = search_max_size(lambda s: s <= 100, hi=4096, width=2, prepare=rounds.append)
    assert result.size == 100 and rounds[0] == [2048, 4096]
