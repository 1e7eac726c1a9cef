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


@settings(max_examples=300, deadline=None)
@given(
    lo=st.integers(1, 50),
    span=st.integers(0, 5000),
    multiple_of=st.integers(1, 16),
    threshold=st.integers(0, 6000),
)
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
