"""Timed candidates (objective="throughput"): the choice against brute force, exact, cached.

`fastest` is checked on cost curves given in numbers, against the argmin over every
candidate; `AdaptiveStep` and the trainer time a real step, and whatever they choose must
train exactly as plain full-batch optax does and leave the caller's arguments whole.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_close,
    donating_step_builder,
    full_batch_reference,
    mlp_loss,
    mlp_params,
)
from helpers import regression_batches as batches_of
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_adaptive as ja
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.timing import KEEP_DEFAULT, Timing, candidate_sizes, fastest

T = 24
OPT = optax.adam(0.05)


def _loss(params, batch, rng):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return (hidden @ params["w2"] - batch["y"]) ** 2


_build = donating_step_builder(_loss, OPT)  # a user's step: donates its state, one Adam update


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(8, 128)) * 0.3, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(128,)) * 0.1, jnp.float32),
    }


def _batch(seed):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(T, 8)).astype(np.float32),
        "y": rng.normal(size=(T,)).astype(np.float32),
    }


# ------------------------------------------------------------ the candidates and the rule


@given(T=st.integers(1, 5000), fraction=st.floats(0.0, 1.0), multiple=st.sampled_from([1, 2, 8]))
@settings(max_examples=300, deadline=None)
def test_candidates_fit_decrease_and_start_at_the_default_plan(T, fraction, multiple):
    if T < multiple:
        return
    largest = max(multiple, int(fraction * T) // multiple * multiple)
    sizes = candidate_sizes(T, largest, multiple)
    # the default plan: the fewest micro-steps largest allows, with the least padding
    steps = math.ceil(T / largest)
    default = min(s for s in range(multiple, largest + 1, multiple) if math.ceil(T / s) == steps)
    assert sizes[0] == default
    assert all(s % multiple == 0 and multiple <= s <= largest for s in sizes)
    assert sizes == sorted(set(sizes), reverse=True) and len(sizes) <= 12


@given(valley=st.floats(1.0, 2048.0), slope=st.floats(0.05, 2.0), T=st.sampled_from([64, 2048]))
@settings(max_examples=200, deadline=None)
def test_fastest_finds_the_valley_of_a_curve_that_falls_then_rises(valley, slope, T):
    """Without noise, the choice is the brute-force best of every candidate and of the
    sizes it timed (or the default plan, within KEEP_DEFAULT)."""
    largest = T * 3 // 4

    def seconds(size):  # per update, least at ``valley`` examples
        return 1.0 + slope * abs(math.log(size / valley))

    timed = fastest(candidate_sizes(T, largest), seconds, T)
    asked = dict(timed.seconds)
    best = min(seconds(s) for s in [*candidate_sizes(T, largest), *asked])
    assert seconds(timed.chosen) <= best * (1 + KEEP_DEFAULT)
    assert all(asked[s] == seconds(s) for s in asked)


def test_fastest_leaves_out_a_size_that_runs_out_of_memory():
    def time_once(size):
        if size == 256:
            raise ja.SimulatedOutOfMemory(10, 5)
        return {683: 0.5, 512: 0.45, 128: 0.6, 64: 0.7}.get(size, 0.55)  # 342 between

    timed = fastest([683, 512, 256, 128, 64], time_once, 2048)
    assert timed.chosen == 512 and 256 not in dict(timed.seconds)
    assert "1.11x the speed of 683 x 3" in str(timed)
    nothing = fastest([683, 512], lambda size: time_once(256), 2048)
    assert nothing.chosen == 683 and "not timed" in str(nothing)


def test_other_errors_propagate():
    def time_once(size):
        raise ZeroDivisionError("the user's bug")

    with pytest.raises(ZeroDivisionError):
        fastest([683, 512], time_once, 2048)


# ------------------------------------------------------------ a real step


def _reference(batches):
    params, opt_state = _params(), OPT.init(_params())
    for batch in batches:
        grads = jax.grad(lambda p, b=batch: _loss(p, b, None).mean())(params)
        updates, opt_state = OPT.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def _limit_for_largest(largest):
    """A memory limit under which ``largest`` is the largest looped size that fits."""
    state, batch = (_params(), OPT.init(_params())), _batch(0)
    step = ja.AdaptiveStep(_build, memory_limit=10**9, plan_cache=False)
    step.plan(state, batch)
    return (step.ledger(largest).total + step.ledger(largest + 1).total) // 2


def test_adaptive_step_times_candidates_in_its_first_calls_and_trains_exactly(tmp_path):
    limit = _limit_for_largest(10)  # 10 fits: 3 micro-steps; candidates 8, 6, 4, 2, 1
    cache = PlanCache(tmp_path / "plans.json")
    step = ja.AdaptiveStep(_build, memory_limit=limit, objective="throughput", plan_cache=cache)
    state, batches = (_params(), OPT.init(_params())), [_batch(i % 5) for i in range(100)]
    plan = step.plan(state, batches[0])
    assert plan.largest == 10 and plan.micro_batch_size == 8 and "time [8, 6, 4, 2, 1]" in str(plan)
    calls = 0
    while calls == 0 or "the next calls time" in str(step.plan_info):  # they train too
        state, _ = step(state, batches[calls])
        calls += 1
    plan, timed = step.plan_info, step.timed
    # The candidates, then the step counts halfway to the best's neighbours (5 x 5 beside
    # 6 x 4 and 4 x 6, in one CI run): the choice is one of the sizes timed, all fitting.
    sizes = [size for size, _ in timed.seconds]
    assert sizes[0] == 8 and max(sizes) <= 10, sizes  # the default plan first
    assert plan.micro_batch_size == timed.chosen and timed.chosen in sizes
    assert "timed fastest of 8 x 3" in plan.timed
    assert 6 <= calls <= 10 * len(sizes)  # screening (3 runs each), then 7 rounds at most
    state, _ = step(state, batches[calls])
    want = _reference(batches[: calls + 1])
    got = state[0]
    assert_trees_close(got, want, 2e-5)
    # A second run of the same job: the plan cache's choice, nothing searched nor timed.
    again = ja.AdaptiveStep(_build, memory_limit=limit, objective="throughput", plan_cache=cache)
    replan = again.plan((_params(), OPT.init(_params())), batches[0])
    assert replan.micro_batch_size == plan.micro_batch_size
    assert [trial.decided_by for trial in again.search_log] == ["plan cache"]
    assert again.compiles == 0 and "plan cache" in replan.timed
    assert plan.search.startswith("search ") and replan.search is None  # nothing searched


def test_trainer_throughput_times_the_candidates_and_stays_exact():
    # The MLP's ledgers grow with the size; under the limit between 5 and 6, 5 fits.
    T12 = 12
    probe = ja.AdaptiveTrainer(mlp_loss, optax.adam(1e-2), target_batch_size=T12)
    probe.init(mlp_params(), batches_of(1, T12)[0])
    limit = (probe.ledger(5).total + probe.ledger(6).total) // 2
    batches = batches_of(2, T12)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T12, memory_limit=limit,
        objective="throughput", plan_cache=False,
    )  # fmt: skip
    state = trainer.init(mlp_params(), batches[0])
    timed = {entry["size"] for entry in trainer.throughput_log}
    assert 4 in timed and timed <= set(candidate_sizes(T12, 5)) == {4, 3, 2, 1}
    assert trainer.micro_batch_size in timed and "timed fastest" in str(trainer.plan_info)
    for batch in batches:
        state, _ = trainer.step(state, batch)
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
    assert_trees_close(state.params, reference, 1e-5)


def test_several_processes_plan_by_the_least_padding_untimed(monkeypatch):
    """Each process would time its own runs: they could run different sizes in one call."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    limit = _limit_for_largest(10)
    step = ja.AdaptiveStep(_build, memory_limit=limit, objective="throughput", plan_cache=False)
    state = (_params(), OPT.init(_params()))
    plan = step.plan(state, _batch(0))
    assert plan.micro_batch_size == 8 and "the next calls time" not in str(plan)
    state, _ = step(state, _batch(0))
    assert step.timed is None and step.micro_batch_size == 8


def test_a_budget_stops_the_timing_once_it_has_cost_that_many_updates():
    seconds = {683: 0.5, 512: 0.45, 256: 0.4, 128: 0.35, 64: 0.3}  # falling: all worth trying

    def timed(budget):
        timing = Timing(list(seconds), 2048, budget=budget)
        while timing.size is not None:  # each run costs its own seconds (offline)
            t = seconds.get(timing.size, 0.3)  # a size between two candidates
            timing.record(timing.size, t, spent=t)
        return timing.result

    assert len(timed(None).seconds) > 5 and dict(timed(None).seconds)[64] == 0.3
    # 5 updates at the default's 0.5 s: its 3 runs (1.5 s) fit, 512's (1.35 s more) pass it
    bounded = timed(5)
    assert dict(bounded.seconds) == {683: 0.5, 512: 0.45} and bounded.chosen == 512
    assert bounded.cost == pytest.approx(1.5 + 1.35)
    assert timed(0).chosen == 683 and len(timed(0).seconds) == 1  # the default alone
    with pytest.raises(ValueError, match="budget"):
        Timing(list(seconds), 2048, budget=-1)
