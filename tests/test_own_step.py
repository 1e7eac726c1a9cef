"""AdaptiveStep: a user's own step planned against brute force, guarded against OOM."""

import importlib.util
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import donating_step_builder

import jax_adaptive as ja
from jax_adaptive.data import synthetic_images
from jax_adaptive.memory import memory_report, tree_bytes
from jax_adaptive.testing import inject_oom

T = 16
OPT = optax.adam(0.05)


def _loss(params, batch, rng):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    logits = hidden @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


_build = donating_step_builder(_loss, OPT)  # a user's step: donates its state, one Adam update


def _state():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(8, 256)) * 0.3, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(256, 4)) * 0.1, jnp.float32),
    }
    return params, OPT.init(params)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(T, 8)).astype(np.float32),
        "y": rng.integers(0, 4, size=T).astype(np.int32),
    }


def _reference(batches):
    """Plain full-batch optax: one jax.grad of the mean loss and one adam step per batch."""
    params, opt_state = _state()
    for batch in batches:
        grads = jax.grad(lambda p, b=batch: _loss(p, b, None).mean())(params)
        updates, opt_state = OPT.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


@pytest.fixture(scope="module")
def brute_force():
    """Every size's ledger, each size compiled on its own: everything live while it runs."""
    state, batch = _state(), _batch()
    totals = {}
    for m in range(1, T + 1):
        report = memory_report(_build(m).lower(state, batch).compile())
        program = report["output"] - report["alias"] + report["temp"] + report["code"]
        totals[m] = tree_bytes(state) + tree_bytes(batch) + program
    return totals


class _CompileThreads:
    """A fault hook that injects nothing: it notes the thread each compile ran on."""

    def __init__(self):
        self.threads = []

    def before_compile(self, size):
        self.threads.append(threading.current_thread().name)

    def before_execution(self, size, args):
        pass


@pytest.mark.parametrize("workers", ["1", "3"])
def test_planned_under_memory_limit_picks_the_brute_force_largest(
    brute_force, workers, monkeypatch
):
    """One size at a time, or rounds of three compiled side by side: the same exact answer."""
    monkeypatch.setenv("JAX_ADAPTIVE_COMPILE_WORKERS", workers)
    # The step of T runs no loop (no accumulator): it needs less than 10 and more than 9.
    limits = [brute_force[3], (brute_force[9] + brute_force[10]) // 2, brute_force[13]]
    for limit in limits:
        largest = max(m for m, total in brute_force.items() if total <= limit)
        step = ja.AdaptiveStep(_build, memory_limit=limit, objective="max", plan_cache=False)
        step.fault_hook = hook = _CompileThreads()
        plan = step.plan(_state(), _batch())
        assert plan.micro_batch_size == plan.largest == largest, (limit, step.search_log)
        assert plan.ledger.total == brute_force[largest] <= limit
        assert step.compiles < T  # guided by the memory model, not every size
        side_by_side = [name for name in hook.threads if name.startswith("jax_adaptive-compile")]
        assert bool(side_by_side) == (workers != "1"), hook.threads
        assert len(hook.threads) == step.compiles  # each compile counted once


@pytest.mark.parametrize("said", ["0", "two", "-1"])
def test_a_bad_number_of_compile_workers_is_refused_with_its_value(said, monkeypatch):
    monkeypatch.setenv("JAX_ADAPTIVE_COMPILE_WORKERS", said)
    with pytest.raises(ValueError, match=f"a positive int, got '{said}'"):
        ja.AdaptiveStep(_build, memory_limit=10**6, plan_cache=False)


def test_the_default_objective_trims_the_largest_to_the_least_padding(brute_force):
    limit = (brute_force[9] + brute_force[10]) // 2  # the largest is 9: 2 micro-batches
    step = ja.AdaptiveStep(_build, memory_limit=limit, plan_cache=False)
    state, _ = step(_state(), _batch())
    assert (step.plan_info.largest, step.micro_batch_size) == (9, 8)
    _close(state[0], _reference([_batch()]))


def test_nothing_fits_below_the_state_and_batch(brute_force):
    step = ja.AdaptiveStep(_build, memory_limit=brute_force[1] - 1, plan_cache=False)
    with pytest.raises(ja.NothingFitsError, match="micro-batch 1 needs"):
        step.plan(_state(), _batch())
    with pytest.raises(ja.NothingFitsError, match="micro-batch 1 needs"):  # asked again
        step(_state(), _batch())
    step.set_memory_limit(brute_force[1])  # room now: the same shapes plan and run
    step(_state(), _batch())
    assert step.micro_batch_size == 1


def test_an_injected_oom_replans_and_gives_the_fault_free_result(brute_force):
    limit = brute_force[8]
    clean = ja.AdaptiveStep(_build, memory_limit=limit, plan_cache=False)
    clean_state, _ = clean(_state(), _batch())
    step = ja.AdaptiveStep(_build, memory_limit=limit, plan_cache=False)
    with inject_oom(step, executions={1}) as faults:
        state, _ = step(_state(), _batch())
    assert faults.injected == [(1, clean.micro_batch_size)]
    assert step.micro_batch_size < clean.micro_batch_size
    assert [t.size for t in step.search_log if t.decided_by == "run"] == [faults.injected[0][1]]
    _close(state, clean_state)
    _close(state[0], _reference([_batch()]))


class _DeletingOOM:
    """A failed run, as XLA leaves it: the donated state deleted, then the OOM error."""

    def __init__(self, executions):
        self.executions, self.seen, self.fired = executions, 0, []

    def before_compile(self, size):
        pass

    def before_execution(self, size, args):
        self.seen += 1
        if self.seen in self.executions:
            self.fired.append((self.seen, size))
            for leaf in jax.tree.leaves(args[0]):
                leaf.delete()
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (injected).")


def test_a_failed_run_that_deleted_the_donated_state_loses_nothing(brute_force):
    step = ja.AdaptiveStep(_build, memory_limit=brute_force[8], plan_cache=False)
    step.fault_hook = _DeletingOOM(executions={1, 2})  # the first size, then the next
    first = step.plan(_state(), _batch()).micro_batch_size
    state, _ = step(_state(), _batch())
    assert step.micro_batch_size < first
    assert step.host_bytes >= 3 * tree_bytes(_state())  # a copy per size's first run
    _close(state[0], _reference([_batch()]))


def test_a_trusted_size_that_loses_its_donated_state_says_so(brute_force):
    step = ja.AdaptiveStep(_build, memory_limit=brute_force[8], plan_cache=False)
    step.fault_hook = _DeletingOOM(executions={2})
    state, _ = step(_state(), _batch(0))
    copies = step.host_bytes
    with pytest.raises(ja.StateLostError, match="host_backup='every_call'"):
        step(state, _batch(1))
    assert step.host_bytes == copies  # a size that ran is trusted: no copy per call


@pytest.mark.parametrize("fails", [1, 2])
def test_every_call_backup_recovers_a_trusted_size_kept_unless_it_fails_twice(brute_force, fails):
    step = ja.AdaptiveStep(
        _build, memory_limit=brute_force[8], host_backup="every_call", plan_cache=False
    )
    step.fault_hook = fault = _DeletingOOM(executions=set(range(2, 2 + fails)))
    state, _ = step(_state(), _batch(0))
    size, copies = step.micro_batch_size, step.host_bytes
    state, _ = step(state, _batch(1))
    # the second call's run of the trusted size failed, its donated state deleted, and
    # the copy made before it put the state back for a second run of the same size (the
    # trainer's rule); failing again, a retry at a smaller size: a copy before each run
    assert fault.fired == [(2 + i, size) for i in range(fails)] and fault.seen == 2 + fails
    assert (step.micro_batch_size == size) == (fails == 1), (step.micro_batch_size, size)
    assert step.host_bytes == (2 + fails) * copies
    failed = [(t.size, t.reason) for t in step.search_log if t.decided_by == "run"]
    assert failed == [(size, "call; ran before"), (size, "call")][:fails]
    _close(state[0], _reference([_batch(0), _batch(1)]))


def test_other_errors_propagate_unchanged():
    class Boom:
        def before_compile(self, size):
            pass

        def before_execution(self, size, args):
            raise ValueError("not an out-of-memory")

    step = ja.AdaptiveStep(_build, plan_cache=False)
    step.fault_hook = Boom()
    state = _state()
    with pytest.raises(ValueError, match="not an out-of-memory"):
        step(state, _batch())
    assert step.micro_batch_size == T and not jax.tree.leaves(state)[0].is_deleted()


def test_a_lower_limit_shrinks_at_the_next_call_and_a_higher_one_grows_back(brute_force):
    high, low = brute_force[8], brute_force[4]
    step = ja.AdaptiveStep(_build, memory_limit=high, objective="max", plan_cache=False)
    state, _ = step(_state(), _batch(0))
    assert step.micro_batch_size == 8
    step.set_memory_limit(low)
    state, _ = step(state, _batch(1))
    assert step.micro_batch_size == 4
    step.set_memory_limit(high)
    state, _ = step(state, _batch(2))
    assert step.micro_batch_size == 8
    _close(state[0], _reference([_batch(0), _batch(1), _batch(2)]))


def test_the_plan_cache_skips_the_search(tmp_path, brute_force):
    cache = tmp_path / "plans.json"
    first = ja.AdaptiveStep(_build, memory_limit=brute_force[7], plan_cache=cache)
    first(_state(), _batch())
    second = ja.AdaptiveStep(_build, memory_limit=brute_force[7], plan_cache=cache)
    state, _ = second(_state(), _batch())
    assert first.compiles > 1 and second.compiles == 1
    assert [t.decided_by for t in second.search_log] == ["plan cache"]
    assert second.micro_batch_size == first.micro_batch_size
    _close(state[0], _reference([_batch()]))


def _sized_batch(n, seed):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, 8)).astype(np.float32),
        "y": rng.integers(0, 4, size=n).astype(np.int32),
    }


@pytest.mark.parametrize("limited", [False, True])
def test_alternating_shapes_compile_each_shape_once(brute_force, limited):
    """An epoch's last partial batch, or two batch sizes interleaved: a plan per shape."""
    shapes = [T, 10] * 4  # 16, 10, 16, 10, ...
    step = ja.AdaptiveStep(
        _build, memory_limit=brute_force[7] if limited else None, plan_cache=False
    )
    state, compiles = _state(), []
    for i, n in enumerate(shapes):
        state, _ = step(state, _sized_batch(n, i))
        compiles.append(step.compiles)
    if not limited:  # no capacity on a CPU: the whole batch, one compile per shape
        assert compiles == [1, 2, 2, 2, 2, 2, 2, 2]
    assert compiles[2:] == [compiles[1]] * 6  # the shapes' second visits compile nothing
    assert step.search_log[-1].reason == "init"  # nothing searched after the first visits
    _close(state[0], _reference([_sized_batch(n, i) for i, n in enumerate(shapes)]))


_EXAMPLE = Path(__file__).parents[1] / "examples" / "own_loop.py"
_spec = importlib.util.spec_from_file_location("own_loop", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def test_the_examples_step_at_a_size_that_does_not_divide_gives_the_flax_step_update():
    batch = synthetic_images(256, image_shape=(8, 8, 3))
    before, before_metrics = example.train_step(
        example.create_train_state(jax.random.key(0)), batch
    )
    after_step = example.build_train_step(100)  # 100 + 100 + 56
    after, after_metrics = after_step(example.create_train_state(jax.random.key(0)), batch)
    for got, want in zip(
        jax.tree.leaves(after.params), jax.tree.leaves(before.params), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(after_metrics[name], before_metrics[name], rtol=1e-5)
    assert int(after.step) == 1  # one optimizer update for the whole batch


def test_the_example_runs_its_own_loop(capsys):
    assert example.main(steps=2, memory_limit=None) < 2.5
    assert "256 x 1 micro-batches" in capsys.readouterr().out
