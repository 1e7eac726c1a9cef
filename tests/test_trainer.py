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
from jax_adaptive.memory import memory_report
from jax_adaptive.models import MLP, linen_classifier_loss
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.testing import inject_oom

T = 12
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
}


def train(trainer, params, batches, **init_kwargs):
    state = trainer.init(params, batches[0], **init_kwargs)
    history = []
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        history.append(metrics)
    return state, history


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("micro", [1, 2, 5, 7, T])  # 5 and 7 do not divide 12
def test_equals_full_batch_step(optimizer, micro):
    batches = regression_batches(3, T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPTIMIZERS[optimizer](), target_batch_size=T, micro_batch_size=micro
    )
    state, history = train(trainer, mlp_params(), batches)
    expected = full_batch_reference(mlp_loss, OPTIMIZERS[optimizer](), mlp_params(), batches)
    assert_trees_close(state.params, expected, 1e-5)
    assert int(state.updates) == 3
    assert history[-1]["accumulation_steps"] == -(-T // micro)
    assert history[-1]["micro_batch_size"] == micro
    assert history[-1]["examples"] == T


def test_reported_loss_is_the_full_batch_mean():
    batch = regression_batches(1, T)[0]
    params = mlp_params()
    trainer = ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), target_batch_size=T, micro_batch_size=5)
    _, (metrics,) = train(trainer, params, [batch])
    np.testing.assert_allclose(metrics["loss"], np.mean(mlp_loss(params, batch, None)), rtol=1e-6)


def test_device_batches_equal_host_batches():
    batches = regression_batches(2, T)
    on_device = [jax.device_put(b) for b in batches]
    results = []
    for data in (batches, on_device):
        trainer = ja.AdaptiveTrainer(
            mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=5
        )
        results.append(train(trainer, mlp_params(), data)[0].params)
    assert_trees_close(*results, 1e-6)


def _dropout_setup():
    model = MLP(features=(16,), num_classes=3, dropout_rate=0.5)
    params = model.init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
    rng = np.random.default_rng(0)
    batches = [
        {
            "image": rng.normal(size=(T, 4)).astype(np.float32),
            "label": rng.integers(0, 3, T).astype(np.int32),
        }
        for _ in range(2)
    ]
    return linen_classifier_loss(model), params, batches


def test_dropout_is_deterministic_given_the_rng():
    loss, params, batches = _dropout_setup()

    def run(seed):
        trainer = ja.AdaptiveTrainer(
            loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=5, has_aux=True
        )
        return train(trainer, params, batches, rng=jax.random.key(seed))

    (a, ma), (b, mb), (c, _) = run(1), run(1), run(2)
    assert_trees_close(a.params, b.params, 0)
    assert float(ma[-1]["loss"]) == float(mb[-1]["loss"])
    assert 0.0 <= float(ma[-1]["accuracy"]) <= 1.0
    differ = jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.any(x != y)), a.params, c.params))
    assert any(differ), "another rng must drop other units"


def test_one_compile_per_size_never_a_retrace():
    traces = []

    def counting_loss(params, batch, rng):
        traces.append(batch["x"].shape[0])
        return mlp_loss(params, batch, rng)

    batches = regression_batches(4, T)
    trainer = ja.AdaptiveTrainer(
        counting_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=5
    )
    state = trainer.init(mlp_params(), batches[0])
    after_init = len(traces)
    state, _ = trainer.step(state, batches[0])
    chunk = trainer.plan_info.chunk
    assert chunk == 3  # 5 + 5 + 2: one dispatch scans all three micro-steps
    # the chunked program traces the loss once (inside its scan), at the first update
    assert traces[after_init:] == [5]
    after_first = len(traces)
    for batch in batches[1:]:
        state, _ = trainer.step(state, batch)
    assert len(traces) == after_first, "a step retraced the loss"
    assert dict(trainer.trace_counts) == {5: 1}
    trainer.compile(3)
    trainer.compile(3)
    assert dict(trainer.trace_counts) == {5: 1, 3: 1}


# ------------------------------------------------------------------ auto and limits


IN_FLIGHT = 1  # the trainer's documented default: micro-steps dispatched ahead


def independent_peak(trainer, state, example_bytes, size):
    """What a device holds while micro-steps of ``size`` run, from the live arrays.

    The whole state as it is on the device (Adam's moments too, which the micro-step
    never reads, so XLA prunes them from its arguments), the running loss total, then
    each micro-step in flight (its rows, weights, offset, k and target, its new outputs
    and its temporaries, from XLA's memory analysis), and the program's code.
    """
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) + 4
    r = memory_report(trainer.compile(size))
    inputs = size * example_bytes + 4 * size + 12
    in_flight = IN_FLIGHT * (inputs + r["output"] - r["alias"] + r["temp"])
    return state_bytes + in_flight + r["code"]


@pytest.fixture(scope="module")
def estimates():
    """Brute force: the peak of every size, 1..T, each from its own compile."""
    batches = regression_batches(1, T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=1
    )
    state = trainer.init(mlp_params(), batches[0])
    example_bytes = sum(leaf[0].nbytes for leaf in jax.tree.leaves(batches[0]))
    return {s: independent_peak(trainer, state, example_bytes, s) for s in range(1, T + 1)}


def test_an_adam_ledger_counts_the_moments_the_micro_step_never_reads(estimates):
    params = mlp_params()
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=4
    )
    batch = regression_batches(1, T)[0]
    state = trainer.init(params, batch)
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    inputs = (
        4 * sum(leaf[0].nbytes for leaf in jax.tree.leaves(batch)) + 4 * 4 + 12
    )  # weights; offset, k, target
    ledger = trainer.ledger(4)
    program = memory_report(trainer.compile(4))
    # Adam's two moments are resident, though pruned from the program's arguments.
    assert ledger.state + inputs - program["argument"] >= 2 * param_bytes
    assert ledger.state == sum(leaf.nbytes for leaf in jax.tree.leaves(state)) + 4
    assert ledger.total == estimates[4]


def brute_force_max(estimates, limit):
    fitting = [s for s, e in estimates.items() if e <= limit]
    return max(fitting) if fitting else None


def test_estimates_grow_with_size(estimates):
    assert estimates[T] > estimates[T // 2] > estimates[2]


@pytest.mark.parametrize("size", [4, 7, 11])
def test_auto_picks_the_largest_size_whose_estimate_fits(estimates, size):
    batches = regression_batches(2, T)
    for limit in (estimates[size], estimates[size + 1] - 1):
        expected = brute_force_max(estimates, limit)
        trainer = ja.AdaptiveTrainer(
            mlp_loss, optax.adam(1e-2), target_batch_size=T, memory_limit=limit, objective="max"
        )
        state, history = train(trainer, mlp_params(), batches)
        assert trainer.micro_batch_size == expected
        assert history[-1]["micro_batch_size"] == expected
        assert trainer.accumulation_steps == -(-T // expected)
        chosen = [t for t in trainer.search_log if t.size == expected][-1]
        assert chosen.fits and chosen.estimated_bytes == estimates[expected]
        assert all(t.estimated_bytes <= limit for t in trainer.search_log if t.fits)
        assert all(t.estimated_bytes > limit for t in trainer.search_log if not t.fits)
        reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
        assert_trees_close(state.params, reference, 1e-5)


def test_auto_without_limit_takes_the_whole_batch_on_cpu():
    trainer = ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), target_batch_size=T)
    trainer.init(mlp_params(), regression_batches(1, T)[0])
    assert trainer.micro_batch_size == T and trainer.compiles == 1


def test_below_every_size_raises_with_the_bytes(estimates):
    limit = min(estimates.values()) - 1
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, memory_limit=limit
    )
    with pytest.raises(ja.NothingFitsError, match=f"{limit:,} bytes are available"):
        trainer.init(mlp_params(), regression_batches(1, T)[0])


def test_lowering_the_limit_shrinks_at_the_next_step_and_stays_exact(estimates):
    batches = regression_batches(4, T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, memory_limit=estimates[T], objective="max"
    )
    state = trainer.init(mlp_params(), batches[0])
    sizes = []
    for i, batch in enumerate(batches):
        if i == 2:
            trainer.set_memory_limit(estimates[5])
        state, metrics = trainer.step(state, batch)
        sizes.append(metrics["micro_batch_size"])
    assert sizes == [T, T, 5, 5]
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
    assert_trees_close(state.params, reference, 1e-5)


def test_raising_the_limit_grows_back(estimates):
    batches = regression_batches(3, T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, memory_limit=estimates[3], objective="max"
    )
    state = trainer.init(mlp_params(), batches[0])
    state, m0 = trainer.step(state, batches[0])
    trainer.set_memory_limit(estimates[9])
    state, m1 = trainer.step(state, batches[1])
    assert (m0["micro_batch_size"], m1["micro_batch_size"]) == (3, 9)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"target_batch_size": 0}, ValueError, "target_batch_size=0 must be positive"),
        ({"target_batch_size": -4}, ValueError, "must be positive"),
        ({"target_batch_size": 2.5}, TypeError, "must be a positive int"),
        ({"target_batch_size": "8"}, TypeError, "must be a positive int"),
        ({"target_batch_size": True}, TypeError, "must be a positive int"),
        ({"target_batch_size": 8, "micro_batch_size": 0}, ValueError, "must be positive"),
        ({"target_batch_size": 8, "micro_batch_size": 1.5}, TypeError, "positive int"),
        ({"target_batch_size": 8, "micro_batch_size": "big"}, TypeError, "positive int"),
        ({"target_batch_size": 8, "micro_batch_size": 9}, ValueError, "must not exceed"),
        ({"target_batch_size": 8, "memory_limit": -1}, ValueError, "memory_limit"),
    ],
)
def test_bad_sizes(kwargs, error, match):
    with pytest.raises(error, match=match):
        ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), **kwargs)


def test_bad_optimizer_and_loss():
    with pytest.raises(TypeError, match="GradientTransformation"):
        ja.AdaptiveTrainer(mlp_loss, "adam", target_batch_size=8)
    with pytest.raises(TypeError, match="callable"):
        ja.AdaptiveTrainer(None, optax.sgd(0.1), target_batch_size=8)


def test_bad_batches():
    trainer = ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), target_batch_size=T, micro_batch_size=4)
    good = regression_batches(1, T)[0]
    state = trainer.init(mlp_params(), good)
    with pytest.raises(ValueError, match=f"leading size 8.*target_batch_size={T}"):
        trainer.step(state, regression_batches(1, 8)[0])
    with pytest.raises(ValueError, match="disagree in leading size"):
        trainer.step(state, {"x": good["x"], "y": good["y"][:5]})
    with pytest.raises(ValueError, match="per-example shape"):
        trainer.step(state, {"x": np.zeros((T, 16, 5), np.float32), "y": good["y"]})
    with pytest.raises(ValueError, match="structure"):
        trainer.step(state, {"x": good["x"]})


@pytest.mark.parametrize(
    "bad_loss",
    [
        lambda p, b, r: jnp.mean(mlp_loss(p, b, r)),  # a mean, not per-example
        lambda p, b, r: mlp_loss(p, b, r)[:, None],  # [m, 1]
    ],
)
def test_loss_must_be_per_example(bad_loss):
    trainer = ja.AdaptiveTrainer(bad_loss, optax.sgd(0.1), target_batch_size=T)
    with pytest.raises(ValueError, match=r"per-example, of shape \(1,\)"):
        trainer.init(mlp_params(), regression_batches(1, T)[0])


class UserError(Exception):
    pass


@pytest.mark.parametrize("micro", ["auto", 4])
def test_errors_in_the_loss_propagate_as_themselves(micro):
    def broken(params, batch, rng):
        raise UserError("mine")

    trainer = ja.AdaptiveTrainer(
        broken, optax.sgd(0.1), target_batch_size=T, micro_batch_size=micro
    )
    with pytest.raises(UserError, match="mine"):
        trainer.init(mlp_params(), regression_batches(1, T)[0])


def test_a_user_value_error_mentioning_memory_is_not_an_oom():
    def broken(params, batch, rng):
        raise ValueError("RESOURCE_EXHAUSTED: out of memory (but from the user's code)")

    trainer = ja.AdaptiveTrainer(broken, optax.sgd(0.1), target_batch_size=T)
    with pytest.raises(ValueError, match="from the user's code"):
        trainer.init(mlp_params(), regression_batches(1, T)[0])


def test_use_before_init():
    trainer = ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), target_batch_size=T)
    with pytest.raises(RuntimeError, match="init"):
        trainer.compile(4)
    with pytest.raises(RuntimeError, match="init"):
        _ = trainer.micro_batch_size


def test_an_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="objective"):
        ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), target_batch_size=T, objective="fast")


def test_the_throughput_objective_times_only_multiples_of_multiple_of(estimates):
    # largest even size under the limit: 6 (k = 2); candidates 6 x 2, 4 x 3 and 2 x 6 (12
    # micro-steps of 1 round up to 2): an odd size would break ghost batches of 2.
    trainer = ja.AdaptiveTrainer(
        mlp_loss,
        optax.adam(1e-2),
        target_batch_size=T,
        memory_limit=estimates[7],
        multiple_of=2,
        objective="throughput",
    )
    trainer.init(mlp_params(), regression_batches(1, T)[0])
    timed = {entry["size"] for entry in trainer.throughput_log}
    assert 6 in timed and timed <= {6, 4, 2}
    assert trainer.micro_batch_size in timed


def test_planning_again_for_another_shape_drops_the_old_shapes_programs():
    def loss(params, batch, rng):
        return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2, axis=1)

    rng = np.random.default_rng(0)
    short, long = (
        [
            {
                "x": rng.normal(size=(T, length)).astype(np.float32),
                "y": rng.normal(size=(T, length)).astype(np.float32),
            }
        ]
        for length in (4, 16)
    )
    trainer = ja.AdaptiveTrainer(loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=5)
    state = trainer.init({"w": jnp.ones(())}, short[0])
    state, _ = trainer.step(state, short[0])
    trainer.plan(state, long[0])
    state, metrics = trainer.step(state, long[0])
    assert metrics["micro_batch_size"] == 5
    reference = full_batch_reference(loss, optax.adam(1e-2), {"w": jnp.ones(())}, short + long)
    assert_trees_close(state.params, reference, 1e-5)


def test_sizes_no_longer_in_use_release_their_programs(estimates):
    batches = regression_batches(2, T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, memory_limit=estimates[7], objective="max"
    )
    state = trainer.init(mlp_params(), batches[0])
    assert len({t.size for t in trainer.search_log}) > 1  # the search compiled several
    assert trainer.compiled_sizes == [7]
    trainer.set_memory_limit(estimates[4])
    state, metrics = trainer.step(state, batches[0])
    assert metrics["micro_batch_size"] == 4 and trainer.compiled_sizes == [4]


def test_planning_another_shape_searches_it_afresh(estimates):
    def loss(params, batch, rng):
        return jnp.mean(jnp.tanh(batch["x"] * params["w"]) ** 2, axis=1)

    def batch_of(length):
        return {"x": np.random.default_rng(length).normal(size=(T, length)).astype(np.float32)}

    def trainer():
        return ja.AdaptiveTrainer(loss, optax.adam(1e-2), target_batch_size=T, memory_limit=limit)

    # A limit that fits the long shape's 6 exactly, and more of the short one.
    probe = ja.AdaptiveTrainer(loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=1)
    probe.init({"w": jnp.ones(())}, batch_of(4096))
    limit = probe.ledger(6).total
    fresh = trainer()
    fresh.init({"w": jnp.ones(())}, batch_of(4096))  # the reference: a search of its own
    again = trainer()
    state = again.init({"w": jnp.ones(())}, batch_of(64))
    short, seen = again.micro_batch_size, len(again.search_log)
    again.plan(state, batch_of(4096))
    assert short > again.micro_batch_size == fresh.micro_batch_size == 6
    # Each size of the new shape is measured anew, none taken from the old shape's.
    assert "cache" not in {t.decided_by for t in again.search_log[seen:]}
    state, metrics = again.step(state, batch_of(4096))
    assert metrics["micro_batch_size"] == 6


def test_planning_the_same_shapes_again_keeps_the_plan_and_follows_the_schedule():
    """A restored state (its shapes already planned) costs no search and no compile."""
    example = {"x": np.ones((1, 3), np.float32)}
    trainer = ja.AdaptiveTrainer(
        lambda p, b, r: b["x"] @ p, optax.sgd(0.1),
        target_batch_size=[(0, 4), (2, 12)], memory_limit=None, plan_cache=False,
    )  # fmt: skip
    state = trainer.init(jnp.zeros(3), example)
    for _ in range(2):
        state, _ = trainer.step(state, {"x": np.ones((4, 3), np.float32)})
    restored = jax.tree.map(jnp.copy, state)  # a checkpoint of update 2, read back
    assert trainer.micro_batch_size == 12  # planned for update 2's target already
    trials, traces = len(trainer.search_log), dict(trainer.trace_counts)
    trainer.plan(restored, example)
    assert len(trainer.search_log) == trials and dict(trainer.trace_counts) == traces
    assert trainer.target_batch_size == 12  # the schedule's at update 2
    restored, metrics = trainer.step(restored, {"x": np.ones((12, 3), np.float32)})
    assert metrics["examples"] == 12
    np.testing.assert_allclose(restored.params, -0.1 * 3 * np.ones(3))  # 3 updates of 1s


def _squared_error(params, batch):
    """Per-example metrics for `AdaptiveTrainer.evaluate`: a float and an int count."""
    error = mlp_loss(params, batch, None)
    return {"error": error, "small": (error < 1.0).astype(jnp.int32)}


def _plain_means(params, data):
    """The reference: one jitted call over every example, means in float64 on the host."""
    error = np.asarray(jax.jit(mlp_loss)(params, data, None), np.float64)
    return {"error": error.mean(), "small": (error < 1.0).mean()}


def mlp_loss_per_example(params, batch):
    return mlp_loss(params, batch, None)


def test_evaluate_equals_a_full_pass_and_its_oom_shrinks_only_evaluation():
    batches, held_out = regression_batches(2, 16, seed=5), regression_batches(1, 40, seed=6)[0]
    trainer = ja.AdaptiveTrainer(mlp_loss, optax.adam(1e-2), target_batch_size=16,
                                 memory_limit=20_000, plan_cache=False)  # fmt: skip
    state = trainer.init(mlp_params(), batches[0])
    state, _ = trainer.step(state, batches[0])
    micro = trainer.micro_batch_size
    assert micro < 16  # training accumulates under this device
    evaluator = trainer.evaluator(_squared_error)
    with inject_oom(evaluator, executions={1}) as faults:
        metrics = trainer.evaluate(state, held_out, _squared_error)
    (_, failed), expected = faults.injected[0], _plain_means(state.params, held_out)
    assert metrics["examples"] == 40 and evaluator.batch_size < failed
    assert evaluator.largest > micro  # no gradients: a larger batch than training's
    np.testing.assert_allclose(metrics["error"], expected["error"], rtol=1e-6)
    assert metrics["small"] == expected["small"]
    assert evaluator.ledger(1).state >= sum(x.nbytes for x in jax.tree.leaves(state))
    state, _ = trainer.step(state, batches[1])
    assert trainer.micro_batch_size == micro  # training's plan is untouched
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
    assert_trees_close(state.params, reference, 1e-5)
    predicted = trainer.evaluate(state, held_out, mlp_loss_per_example, predict=True)
    np.testing.assert_allclose(predicted, jax.jit(mlp_loss)(state.params, held_out, None),
                               rtol=1e-6)  # fmt: skip


def test_evaluate_passes_the_model_state_with_has_state():
    def loss_fn(params, model_state, batch, rng):
        return mlp_loss(params, batch, rng) * model_state["scale"], model_state

    def metric_fn(params, model_state, batch):
        return {"scaled": mlp_loss(params, batch, None) * model_state["scale"]}

    data = regression_batches(1, 12, seed=2)[0]
    trainer = ja.AdaptiveTrainer(loss_fn, optax.sgd(0.1), target_batch_size=12, has_state=True,
                                 plan_cache=False)  # fmt: skip
    state = trainer.init(mlp_params(), data, model_state={"scale": jnp.float32(3.0)})
    metrics = trainer.evaluate(state, [data], metric_fn)
    expected = 3.0 * np.mean(np.asarray(jax.jit(mlp_loss)(state.params, data, None), np.float64))
    np.testing.assert_allclose(metrics["scaled"], expected, rtol=1e-6)


def test_the_plan_says_what_the_search_cost_and_a_cached_plan_searched_nothing(estimates, tmp_path):
    cache = PlanCache(tmp_path / "plans.json")

    def planned():
        trainer = ja.AdaptiveTrainer(
            mlp_loss, optax.adam(1e-2), target_batch_size=T, memory_limit=estimates[5],
            plan_cache=cache,
        )  # fmt: skip
        trainer.init(mlp_params(), regression_batches(1, T)[0])
        return trainer

    first = planned()
    compiled = {t.size: t.seconds for t in first.search_log if t.decided_by == "estimate"}
    search = first.plan_info.search
    assert search.startswith("search ") and f", {len(compiled)} compiles" in search, search
    ratio = float(search.split("(")[1].split("x")[0])
    seconds = float(search.split()[1])
    # 5: the largest found; the words round the seconds to 0.1 s and the ratio to 0.1
    assert abs(ratio * compiled[5] - seconds) <= 0.05 + 0.05 * compiled[5], (search, compiled)
    assert search in str(first.plan_info)
    assert planned().plan_info.search is None  # from the plan cache: no search ran
