"""Evaluation at the largest batch that fits: the numbers of one full pass, at any size."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_close,
    full_batch_reference,
    mlp_loss,
    mlp_params,
    regression_batches,
)

import jax_adaptive as ja
from jax_adaptive.plan import least_padding_size
from jax_adaptive.testing import inject_oom

N = 40  # examples in the dataset


def metric_fn(params, batch):
    """Per-example metrics of every kind: a float, one with a trailing axis, an int count."""
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, None, :])
    prediction = hidden @ params["w2"]
    error = (prediction - batch["y"]) ** 2
    return {
        "loss": jnp.mean(error, axis=1),
        "per_position": error,
        "positive": jnp.sum(prediction > 0, axis=1),
    }


def predict_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, None, :])
    return {"prediction": hidden @ params["w2"], "hidden": hidden}


@pytest.fixture(scope="module")
def data():
    return regression_batches(1, N, seed=3)[0]


@pytest.fixture(scope="module")
def params():
    return mlp_params(seed=1)


def full_pass(fn, params, data):
    """The reference: one jitted call on every example at once, then plain means."""
    return jax.device_get(jax.jit(fn)(params, data))


def reference_means(params, data):
    out = full_pass(metric_fn, params, data)
    return {name: np.mean(np.asarray(value, np.float64), axis=0) for name, value in out.items()}


def assert_same_metrics(metrics, params, data, examples=N):
    expected = reference_means(params, data)
    assert metrics["examples"] == examples
    assert set(metrics) == {*expected, "examples"}
    for name, value in expected.items():
        np.testing.assert_allclose(metrics[name], value, rtol=2e-6, atol=1e-7, err_msg=name)


def evaluator(**kwargs):
    return ja.Evaluator(metric_fn, plan_cache=kwargs.pop("plan_cache", False), **kwargs)


def stream_of(data, sizes):
    """The same examples as a stream of batches of the given sizes, in order."""
    assert sum(sizes) == N
    edges = np.cumsum([0, *sizes])
    return [{k: v[a:b] for k, v in data.items()} for a, b in itertools.pairwise(edges)]


# 7 and 13 do not divide 40: the last batch is padded, and without the mask its repeated
# rows would count twice. Each runs at the least-padded size for its number of batches.
@pytest.mark.parametrize(("most", "size"), [(1, 1), (2, 2), (5, 5), (7, 7), (13, 10), (N, N)])
def test_metrics_equal_one_full_pass_at_any_size(params, data, most, size):
    ev = evaluator(max_batch_size=most)
    metrics = ev.evaluate(params, data)
    assert ev.batch_size == size
    assert_same_metrics(metrics, params, data)


@pytest.mark.parametrize("sizes", [[3, 17, 1, 19], [40], [1] * 40])
def test_a_stream_of_batches_of_any_sizes_gives_the_same_numbers(params, data, sizes):
    ev = evaluator(max_batch_size=7)
    assert_same_metrics(ev.evaluate(params, iter(stream_of(data, sizes))), params, data)
    per_example = ev.predict(params, stream_of(data, sizes))  # the same function, unreduced
    expected = full_pass(metric_fn, params, data)
    for name in expected:
        np.testing.assert_allclose(per_example[name], expected[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("most", [3, 7, N])
def test_predictions_are_the_full_pass_outputs_without_padding(params, data, most):
    ev = ja.Evaluator(predict_fn, max_batch_size=most, plan_cache=False)
    predictions = ev.predict(params, stream_of(data, [3, 17, 1, 19]))
    expected = full_pass(predict_fn, params, data)
    assert predictions["prediction"].shape == (N, 16)
    for name in expected:
        np.testing.assert_allclose(predictions[name], expected[name], rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def ledgers(params, data):
    """Brute force: the ledger of every size from its own compile, with no limit."""
    ev = evaluator()
    ev.evaluate(params, data)
    return {size: ev.ledger(size) for size in range(1, N + 1)}


def test_the_ledger_counts_the_live_arrays_the_batch_and_the_program(params, data, ledgers):
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    example_bytes = sum(x[0].nbytes for x in data.values()) + 1  # and the mask's byte
    for size in (1, 9, N):
        assert ledgers[size].state == params_bytes
        assert ledgers[size].in_flight >= size * example_bytes
        assert ledgers[size].program > 0
    # Memory grows with the size; the search needs that (monotone) to find the exact max.
    totals = [ledgers[s].total for s in range(4, N + 1)]
    assert totals == sorted(totals)


@pytest.mark.parametrize("between", [6, 17, 29])
def test_the_planned_size_is_the_brute_force_largest_under_memory_limit(
    params, data, ledgers, between
):
    limit = (ledgers[between].total + ledgers[between + 1].total) // 2
    largest = max(s for s, ledger in ledgers.items() if ledger.total <= limit)
    ev = evaluator(memory_limit=limit)
    metrics = ev.evaluate(params, data)
    assert ev.largest == largest == between
    assert ev.batch_size == least_padding_size(N, largest)
    assert ev.compiles < 12  # a guided search, then the least-padded size
    assert not [t for t in ev.search_log if t.fits and t.estimated_bytes > limit]
    assert_same_metrics(metrics, params, data)


def test_resident_arrays_count_once_and_shrink_the_plan(params, data, ledgers):
    state = {"params": params, "moments": jax.tree.map(jnp.zeros_like, params)}
    extra = sum(x.nbytes for x in jax.tree.leaves(state["moments"]))
    limit = ledgers[20].total
    alone, beside = evaluator(memory_limit=limit), evaluator(memory_limit=limit)
    alone.evaluate(params, data)
    metrics = beside.evaluate(params, data, resident=state)  # params in both: counted once
    assert beside.ledger(5).state == ledgers[5].state + extra
    largest = max(s for s, ledger in ledgers.items() if ledger.total + extra <= limit)
    assert alone.largest == 20 and beside.largest == largest < 20
    assert_same_metrics(metrics, params, data)


def test_multiples_of_are_preferred(params, data, ledgers):
    limit = ledgers[29].total
    ev = evaluator(memory_limit=limit, multiple_of=8)
    metrics = ev.evaluate(params, data)
    assert ev.largest == 24 and ev.batch_size == 24  # 2 batches: 24 and 16 + 8 padded
    assert_same_metrics(metrics, params, data)


@pytest.mark.parametrize("execution", [1, 2, 3])
@pytest.mark.parametrize("limited", [True, False])
def test_an_evaluation_oom_after_the_plan_shrinks_and_counts_every_example_once(
    params, data, ledgers, execution, limited
):
    # Both plan 16 (3 batches of 14, the last padded): under a limit that the ledger
    # decides; without one (a CPU), the real out-of-memory's peak teaches a capacity.
    ev = evaluator(memory_limit=ledgers[16].total) if limited else evaluator(max_batch_size=16)
    with inject_oom(ev, executions={execution}) as faults:
        metrics = ev.evaluate(params, data)
    assert faults.injected == [(execution, least_padding_size(N, 16))]
    assert "run" in [t.decided_by for t in ev.search_log if not t.fits]
    assert ev.batch_size < 16
    assert_same_metrics(metrics, params, data)


def test_an_oom_while_predicting_loses_no_row(params, data, ledgers):
    ev = ja.Evaluator(predict_fn, max_batch_size=12, plan_cache=False)
    with inject_oom(ev, executions={2, 3}) as faults:
        predictions = ev.predict(params, iter(stream_of(data, [3, 17, 1, 19])))
    assert len(faults.injected) == 2 and ev.batch_size < 12
    expected = full_pass(predict_fn, params, data)
    np.testing.assert_allclose(predictions["prediction"], expected["prediction"], rtol=1e-6)


def test_a_limit_changed_between_runs_plans_the_largest_under_the_new_one(params, data, ledgers):
    ev = evaluator(memory_limit=ledgers[30].total)
    ev.evaluate(params, data)
    ev.memory_limit = ledgers[12].total  # another job took memory: the plan no longer fits
    metrics = ev.evaluate(params, data)
    failed = [t for t in ev.search_log if not t.fits and t.decided_by == "estimate"]
    assert failed and ev.largest == 12
    assert_same_metrics(metrics, params, data)
    ev.memory_limit = ledgers[36].total  # it gave the memory back: the batch grows again
    metrics = ev.evaluate(params, data)
    assert ev.largest == max(s for s, g in ledgers.items() if g.total <= ledgers[36].total)
    assert_same_metrics(metrics, params, data)


def test_only_out_of_memory_is_caught(params, data):
    def broken(params, batch):
        raise KeyError("not an out-of-memory")

    with pytest.raises(KeyError, match="not an out-of-memory"):
        ja.Evaluator(broken, plan_cache=False).evaluate(params, data)

    def failing_callback(x):
        raise RuntimeError("RESOURCE_EXHAUSTED: the user's own words")

    def calls_back(params, batch):
        jax.debug.callback(failing_callback, batch["x"][0, 0, 0])
        return metric_fn(params, batch)

    with pytest.raises(Exception, match="the user's own words") as caught:
        ja.Evaluator(calls_back, plan_cache=False).evaluate(params, data)
    assert not ja.is_oom(caught.value)


def test_nothing_fits_is_one_clear_error(params, data, ledgers):
    with pytest.raises(ja.NothingFitsError, match="evaluation batch of 1 needs"):
        evaluator(memory_limit=ledgers[1].total - 1).evaluate(params, data)


def test_bad_outputs_and_datasets_are_one_line_errors(params, data):
    with pytest.raises(ValueError, match="leading axis of"):
        ja.Evaluator(lambda p, b: {"mean": jnp.mean(b["y"])}, plan_cache=False).evaluate(
            params, data
        )
    with pytest.raises(TypeError, match="dict of per-example metrics"):
        ja.Evaluator(lambda p, b: b["y"], plan_cache=False).evaluate(params, data)
    with pytest.raises(ValueError, match="a name reserved"):
        ja.Evaluator(lambda p, b: {"examples": b["y"]}, plan_cache=False).evaluate(params, data)
    with pytest.raises(ValueError, match="structure"):
        evaluator().evaluate(params, [data, {"x": data["x"]}])
    with pytest.raises(ValueError, match="no examples"):
        evaluator().evaluate(params, [])
    with pytest.raises(ValueError, match="must be positive"):
        evaluator(max_batch_size=0)


@pytest.mark.parametrize("most", [N, 7])
def test_integer_metrics_are_summed_exactly_in_64_bits(params, data, most):
    """An int32 sum of 40 values of 2**30 wraps (to 0); a uint32 one of 3e9 too."""

    def counts(params, batch):
        n = batch["y"].shape[0]
        return {
            "big": jnp.full(n, 2**30, jnp.int32),
            "unsigned": jnp.full(n, 3_000_000_000, jnp.uint32),
            "negative": jnp.full(n, -(2**30), jnp.int32),
        }

    ev = ja.Evaluator(counts, max_batch_size=most, plan_cache=False)
    metrics = ev.evaluate(params, data)
    assert metrics["examples"] == N
    assert (metrics["big"], metrics["unsigned"], metrics["negative"]) == (2**30, 3e9, -(2**30))


def test_the_plan_cache_keeps_its_own_key(tmp_path, params, data, ledgers):
    path = tmp_path / "plans.json"
    limit = ledgers[23].total
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.sgd(0.1), target_batch_size=8, memory_limit=limit, plan_cache=path
    )
    trainer.init(params, data)
    first = evaluator(memory_limit=limit, plan_cache=path)
    first.evaluate(params, data)
    assert "plan cache" not in [t.decided_by for t in first.search_log]  # not training's
    second = evaluator(memory_limit=limit, plan_cache=path)
    metrics = second.evaluate(params, data)
    assert [t.decided_by for t in second.search_log] == ["plan cache"]
    assert second.largest == first.largest == 23 and second.compiles == 1
    assert_same_metrics(metrics, params, data)
    assert len(json.loads(path.read_text())) == 2  # training's plan and evaluation's


class _Runs:
    """A fault hook that faults nothing: it counts the compiles and the runs."""

    def __init__(self):
        self.compiles, self.runs = 0, 0

    def before_compile(self, size):
        self.compiles += 1

    def before_execution(self, size, args):
        self.runs += 1


def test_progress_bar_is_off_by_default_and_cheap_when_on(params, data, capsys, monkeypatch):
    """Cheap: the bar adds no compile and no device run, and one host update per batch."""
    import tqdm.auto

    updates = []

    class CountingBar(tqdm.auto.tqdm):
        def update(self, n=1):
            updates.append(n)
            return super().update(n)

    monkeypatch.setattr(tqdm.auto, "tqdm", CountingBar)
    cost = {}
    for progress in (False, True):
        ev = evaluator(max_batch_size=8, progress=progress)
        ev.fault_hook = hook = _Runs()
        updates.clear()
        assert_same_metrics(ev.evaluate(params, data), params, data)
        cost[progress] = (hook.compiles, hook.runs, list(updates))
        shown = capsys.readouterr().err
        assert ("example" in shown) if progress else shown == ""
    assert cost[True] == cost[False]
    _, runs, bar_updates = cost[True]
    assert runs == -(-N // 8) and bar_updates == [8] * runs  # one update per batch of 8


def test_evaluating_between_updates_leaves_training_exact(params, data):
    """The wiring a trainer method would have: the train state resident, sizes apart."""
    T, limit = 16, 20_000  # training plans 8 x 2; evaluation 14, then less after its OOM
    batches = regression_batches(2, T, seed=5)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, memory_limit=limit, plan_cache=False
    )
    state = trainer.init(params, batches[0])
    state, _ = trainer.step(state, batches[0])
    micro = trainer.micro_batch_size
    assert micro < T
    ev = evaluator(memory_limit=limit)
    with inject_oom(ev, executions={1}):
        metrics = ev.evaluate(state.params, data, resident=state)
    assert ev.ledger(1).state > sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert_same_metrics(metrics, state.params, data)
    state, _ = trainer.step(state, batches[1])
    assert trainer.micro_batch_size == micro  # an evaluation out-of-memory shrank evaluation
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), params, batches)
    assert_trees_close(state.params, reference, 1e-5)


def test_a_batch_norm_model_evaluates_with_its_statistics_as_one_full_pass():
    """Issue 29: a linen model with BatchNorm, written as Flax's examples write it."""
    import flax.linen as nn

    from jax_adaptive.data import synthetic_images

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Conv(16, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            return nn.Dense(10)(nn.relu(x).mean(axis=(1, 2)))

    model, data = Net(), synthetic_images(4096, seed=1)
    variables = model.init(jax.random.key(0), data["image"][:1], train=False)
    _, stats = model.apply(variables, data["image"][:256], train=True, mutable=["batch_stats"])
    variables = {**variables, **stats}  # statistics other than the initial ones

    def bn_metric_fn(variables, batch):
        logits = model.apply(variables, batch["image"], train=False)
        labels = batch["label"]
        return {
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels),
            "correct": (logits.argmax(-1) == labels).astype(jnp.int32),
        }

    evaluator = ja.Evaluator(bn_metric_fn, memory_limit=30 * 10**6, plan_cache=False)
    metrics = evaluator.evaluate(variables, data)
    assert evaluator.batch_size < 4096 and 4096 % evaluator.batch_size  # padded, masked
    full = jax.jit(bn_metric_fn)(variables, data)  # one plain full pass
    assert metrics["loss"] == pytest.approx(float(full["loss"].mean()), abs=1e-5)
    assert metrics["correct"] == pytest.approx(float(full["correct"].mean()), abs=1e-9)
    initial = model.init(jax.random.key(0), data["image"][:1], train=False)
    other = jax.jit(bn_metric_fn)(initial, data)["loss"].mean()
    assert abs(float(other) - float(full["loss"].mean())) > 1e-3  # the statistics matter
