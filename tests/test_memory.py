"""The memory model: guesses for the search from measured peaks, never at exactness's cost."""

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_adaptive as ja
from jax_adaptive.memory import MemoryModel


def guided_search(peak, capacity, hi):
    """Runs search_max_size on ``peak(size) <= capacity`` as the trainer does."""
    model = MemoryModel()

    def fits(size):
        model.add(size, peak(size))
        return peak(size) <= capacity

    return ja.search_max_size(fits, hi=hi, propose=model.propose(capacity))


def brute_force(peak, capacity, hi):
    return max(s for s in range(1, hi + 1) if peak(s) <= capacity)


@settings(max_examples=200, deadline=None)
@given(
    base=st.integers(0, 10**9),
    slope=st.integers(1, 10**7),
    hi=st.integers(2, 8192),
    share=st.floats(0.0, 1.0),
)
def test_on_a_linear_peak_the_exact_max_takes_at_most_four_calls(base, slope, hi, share):
    peak = lambda s: base + slope * s  # noqa: E731
    capacity = int(peak(1) + share * (peak(hi) - peak(1)))
    result = guided_search(peak, capacity, hi)
    assert result.size == brute_force(peak, capacity, hi)
    assert result.calls <= 4


@settings(max_examples=200, deadline=None)
@given(
    slope=st.integers(1_000, 10**6),
    curve=st.floats(0.0, 2.0),
    wiggle=st.integers(0, 50_000),
    hi=st.integers(2, 4096),
    share=st.floats(0.05, 1.0),
)
def test_on_curved_or_noisy_peaks_the_answer_is_still_exact(slope, curve, wiggle, hi, share):
    """Monotone but not linear: a quadratic term and a step every 7 sizes."""
    peak = lambda s: slope * s + int(curve * s * s) + wiggle * (s // 7)  # noqa: E731
    capacity = int(share * peak(hi))
    if capacity < peak(1):
        return
    result = guided_search(peak, capacity, hi)
    assert result.size == brute_force(peak, capacity, hi)


def test_median_calls_for_t_4096_on_a_mildly_curved_peak():
    """The issue's goal: the exact largest size in at most 5 compiles (median), T=4096."""
    calls = []
    for i in range(1, 40):
        peak = lambda s, i=i: 50_000_000 + 400_000 * s + 30 * s * s + 7_000 * (s % 3)  # noqa: E731
        capacity = peak(1) + i * (peak(4096) - peak(1)) // 40
        result = guided_search(peak, capacity, 4096)
        assert result.size == brute_force(peak, capacity, 4096)
        calls.append(result.calls)
    assert statistics.median(calls) <= 5, calls


def test_no_line_no_guess():
    assert MemoryModel().largest_within(100) is None
    assert MemoryModel({4: 100, 8: 100}).largest_within(50) is None  # a flat line
    assert MemoryModel({10: 1_000}).largest_within(500) == 5  # through the origin


def test_a_prior_line_guides_until_two_sizes_are_measured():
    model = MemoryModel(prior=(1_000, 10))
    assert model.largest_within(2_000) == 100  # the prior's crossing
    model.add(50, 1_800)  # measured above the prior: through it with the prior's slope
    assert model.largest_within(2_000) == 70
    model.add(70, 2_400)  # two measurements: the prior steps aside
    assert model.largest_within(2_000) == 56
    with pytest.raises(ValueError, match="slope"):
        MemoryModel(prior=(1_000, 0))
