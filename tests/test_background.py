"""``background_search=True``: the first call (`AdaptiveStep`) or update (`AdaptiveTrainer`)
runs at the first size found to fit while the search goes on; later ones take the searched
plan; exact throughout.

References: a step or trainer planned in line (the search before the first call, itself
checked against brute force in test_step.py and test_trainer.py), every size's ledger
(brute force), and plain full-batch Adam.
"""

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, donating_step_builder, full_batch_reference

import jax_adaptive as ja
from jax_adaptive.background import INTERIM
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.testing import FaultInjector

T = 24
OPT = optax.adam(1e-2)


def _loss(params, batch, rng):  # per example, as a user writes one
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2, axis=-1)


def _params():
    key1, key2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(key1, (16, 256)) / 4,
        "w2": jax.random.normal(key2, (256, 4)) / 16,
    }


def _batches(n):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(T, 16)).astype(np.float32),
         "y": rng.normal(size=(T, 4)).astype(np.float32)}
        for _ in range(n)
    ]  # fmt: skip


BUILD = donating_step_builder(_loss, OPT)
GATE_TIMEOUT = 20  # seconds: a search that blocks the first call fails the test, late


class Runs:
    """A fault hook that only records the size of each run."""

    def __init__(self):
        self.sizes = []

    def before_execution(self, size, args):
        self.sizes.append(size)

    def before_compile(self, size):
        pass


class OpensOnRun:
    """A fault hook that opens ``gate`` at the first run, then lets ``inner`` act."""

    def __init__(self, gate, inner):
        self.gate, self.inner = gate, inner

    def before_execution(self, size, args):
        self.gate.set()
        self.inner.before_execution(size, args)

    def before_compile(self, size):
        self.inner.before_compile(size)


@pytest.fixture(scope="module")
def in_line():
    """The search before the first call, under a limit where 9 is the largest size.

    In line it asks 24, 12, 11, 9 (fits: the plan 8 x 3) and 10. In the background it
    first asks an eighth of the batch, 3: the calls at 3 are seen.
    """
    probe = ja.AdaptiveStep(BUILD, memory_limit=10**9, plan_cache=False)
    state = (_params(), OPT.init(_params()))
    probe.plan(state, _batches(1)[0])
    ledgers = {s: probe.ledger(s).total for s in range(1, T + 1)}  # brute force
    limit = (ledgers[9] + ledgers[10]) // 2
    step = ja.AdaptiveStep(BUILD, memory_limit=limit, plan_cache=False)
    step.plan(state, _batches(1)[0])
    return {"limit": limit, "ledgers": ledgers, "plan": step.plan_info, "first_fit": T // 8}


def _gated(in_line, gate, fail_once=None):
    """The builder: the sizes but the first fit wait for ``gate`` (and one fails once).

    The search cannot go past its first fit before the test opens the gate: the first
    call runs while it goes on, whatever the machine's load.
    """

    def build(m):
        if m != in_line["first_fit"]:
            gate.wait(timeout=GATE_TIMEOUT)  # a search in line must not hang the test
        if fail_once is not None and m == fail_once[0] and not fail_once[1]:
            fail_once[1] = True
            raise ValueError(f"the user's step fails to trace at {m}")
        return BUILD(m)

    return build


def test_the_first_call_runs_at_the_first_fit_then_the_plan_and_trains_exactly(in_line):
    first, plan = in_line["first_fit"], in_line["plan"]
    assert first != plan.micro_batch_size
    runs, gate = Runs(), threading.Event()
    step = ja.AdaptiveStep(
        _gated(in_line, gate), memory_limit=in_line["limit"], plan_cache=False,
        background_search=True,
    )  # fmt: skip
    step.fault_hook = runs
    batches = _batches(4)
    state = (_params(), OPT.init(_params()))
    state, _ = step(state, batches[0])  # the search waits at the gate: not over
    assert runs.sizes == [first], runs.sizes
    assert "while the search goes on" in str(step.plan_info)
    gate.set()
    # plan() waits for the search: the plan made in line, the largest by brute force.
    final = step.plan(state, batches[1])
    fitting = [s for s, total in in_line["ledgers"].items() if total <= step.capacity()]
    assert final.largest == max(fitting) == 9 and final.micro_batch_size == plan.micro_batch_size
    assert final.source == "searched"
    for batch in batches[1:]:
        state, _ = step(state, batch)
    assert runs.sizes[1:] == [plan.micro_batch_size] * 3
    reference = full_batch_reference(_loss, OPT, _params(), batches)
    assert_trees_close(state[0], reference, 2e-5)


def test_an_out_of_memory_at_the_first_fit_waits_for_the_search_then_shrinks(in_line):
    first = in_line["first_fit"]
    gate, faults = threading.Event(), FaultInjector(executions={1})  # the first fit's run
    step = ja.AdaptiveStep(
        _gated(in_line, gate), memory_limit=in_line["limit"], plan_cache=False,
        background_search=True,
    )  # fmt: skip
    step.fault_hook = OpensOnRun(gate, faults)  # the search goes on once it has failed
    batches = _batches(3)
    state = (_params(), OPT.init(_params()))
    for batch in batches:
        state, _ = step(state, batch)
    assert faults.injected == [(1, first)]
    assert step.largest < first and step.micro_batch_size <= step.largest  # learned below
    reference = full_batch_reference(_loss, OPT, _params(), batches)
    assert_trees_close(state[0], reference, 2e-5)


def test_an_error_on_the_search_s_thread_is_raised_and_the_next_call_plans_again(in_line):
    failing = [10, False]  # asked by every exact search: 9 fits, 10 does not
    gate = threading.Event()
    step = ja.AdaptiveStep(
        _gated(in_line, gate, failing), memory_limit=in_line["limit"], plan_cache=False,
        background_search=True,
    )  # fmt: skip
    state = (_params(), OPT.init(_params()))
    batches = _batches(2)
    state, _ = step(state, batches[0])  # at the first fit
    gate.set()
    with pytest.raises(ValueError, match="fails to trace at"):
        step.plan(state, batches[1])
    state, _ = step(state, batches[1])  # plans again, in the background
    assert step.plan(state, batches[1]).micro_batch_size == in_line["plan"].micro_batch_size
    reference = full_batch_reference(_loss, OPT, _params(), batches)
    assert_trees_close(state[0], reference, 2e-5)


def test_several_processes_and_a_plan_cache_search_in_line(in_line, monkeypatch, tmp_path):
    state, batch = (_params(), OPT.init(_params())), _batches(1)[0]
    cache = PlanCache(tmp_path / "plans.json")
    with monkeypatch.context() as patch:  # each process could run another interim size
        patch.setattr(jax, "process_count", lambda: 2)
        step = ja.AdaptiveStep(
            BUILD, memory_limit=in_line["limit"], plan_cache=cache, background_search=True
        )
        runs = Runs()
        step.fault_hook = runs
        state, _ = step(state, batch)
        assert runs.sizes == [in_line["plan"].micro_batch_size] and step.largest == 9
    again = ja.AdaptiveStep(
        BUILD, memory_limit=in_line["limit"], plan_cache=cache, background_search=True
    )
    runs = Runs()
    again.fault_hook = runs
    state, _ = again(state, batch)
    assert runs.sizes == [in_line["plan"].micro_batch_size]
    assert [trial.decided_by for trial in again.search_log] == ["plan cache"]


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="background_search must be True or False, got 'yes'"):
        ja.AdaptiveStep(BUILD, background_search="yes")
    choices = ja.RematChoices({"none": BUILD, "full": BUILD})
    with pytest.raises(ValueError, match="background_search=True plans one StepBuilder"):
        ja.AdaptiveStep(choices, background_search=True)


def _nnx_loss(model, batch):  # a mean loss, as the NNX guides write one
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _nnx_objects():
    from flax import nnx

    model = nnx.Sequential(
        nnx.Linear(16, 256, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(256, 4, rngs=nnx.Rngs(1))
    )
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_the_nnx_step_trains_as_nnx_jit_with_the_search_in_the_background():
    from flax import nnx

    def train_step(model, optimizer, batch):  # Flax's step, its gradient converted
        loss, grads = ja.micro_batch_value_and_grad(_nnx_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def plain_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_nnx_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    batches = _batches(3)
    probe = ja.AdaptiveNnxStep(train_step, plan_cache=False)
    probe(*_nnx_objects(), batches[0])
    ledgers = {s: probe.step.ledger(s).total for s in range(1, T + 1)}  # brute force
    limit = (ledgers[15] + ledgers[16]) // 2  # flat from 2 to 13 (XLA's padded buffers)
    step = ja.AdaptiveNnxStep(
        train_step, memory_limit=limit, plan_cache=False, background_search=True
    )
    model, optimizer = _nnx_objects()
    want_model, want_optimizer = _nnx_objects()
    for batch in batches:
        step(model, optimizer, batch)
        plain_step(want_model, want_optimizer, batch)
    step.step.finish_search()
    assert step.step.largest == max(s for s, total in ledgers.items() if total <= limit) == 15
    for got, want in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(want_model)), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


# ---------------------------------------------------------------- AdaptiveTrainer


class _Mlp(nn.Module):  # a Flax linen model over 32 positions, as a user writes one
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(64)(x)))[..., 0]


_MLP = _Mlp()


def _mlp_loss(params, batch, rng):  # per example: the activations dominate the memory
    prediction = _MLP.apply({"params": params}, batch["x"])
    return jnp.mean((prediction - batch["y"]) ** 2, axis=1)


def _mlp_params():
    return _MLP.init(jax.random.key(0), jnp.ones((1, 32, 8)))["params"]


def _mlp_batches(n, size=T):
    rng = np.random.default_rng(1)
    return [
        {"x": rng.normal(size=(size, 32, 8)).astype(np.float32),
         "y": rng.normal(size=(size, 32)).astype(np.float32)}
        for _ in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trainer_in_line():
    """The trainer's search before the first update, under a limit where 9 is the largest."""
    probe = ja.AdaptiveTrainer(
        _mlp_loss, OPT, target_batch_size=T, memory_limit=10**9, plan_cache=False
    )
    probe.init(_mlp_params(), _mlp_batches(1)[0])
    ledgers = {s: probe.ledger(s).total for s in range(1, T + 1)}  # brute force
    limit = (ledgers[9] + ledgers[10]) // 2
    trainer = ja.AdaptiveTrainer(
        _mlp_loss, OPT, target_batch_size=T, memory_limit=limit, plan_cache=False
    )
    trainer.init(_mlp_params(), _mlp_batches(1)[0])
    return {"limit": limit, "ledgers": ledgers, "plan": trainer.plan_info, "first_fit": T // 8}


def _gated_loss(first, gate, fail_at=None):
    """The loss, whose tracing above ``first`` waits for ``gate`` (and fails once at one size).

    The trainer traces it on the search's thread: the search cannot go past its first fit
    before the test opens the gate, whatever the machine's load.
    """
    failing = [fail_at]

    def loss(params, batch, rng):
        size = batch["x"].shape[0]
        if size > first:
            gate.wait(timeout=GATE_TIMEOUT)  # a search in line must not hang the test
        if size == failing[0]:
            failing[0] = None
            raise ValueError(f"the user's loss fails to trace at {size}")
        return _mlp_loss(params, batch, rng)

    return loss


def _background_trainer(trainer_in_line, loss, **options):
    return ja.AdaptiveTrainer(
        loss, OPT, target_batch_size=options.pop("target_batch_size", T),
        memory_limit=trainer_in_line["limit"], background_search=True,
        plan_cache=options.pop("plan_cache", False), **options,
    )  # fmt: skip


def test_the_trainer_s_first_update_runs_at_the_first_fit_then_the_plan(trainer_in_line):
    first, plan = trainer_in_line["first_fit"], trainer_in_line["plan"]
    gate, runs = threading.Event(), Runs()
    trainer = _background_trainer(trainer_in_line, _gated_loss(first, gate))
    trainer.fault_hook = runs
    batches = _mlp_batches(4)
    state = trainer.init(_mlp_params(), batches[0])  # waits for the first fit only
    interim = trainer.plan_info
    assert (interim.micro_batch_size, interim.source) == (first, INTERIM)
    assert (interim.chunk, interim.fused) == (1, False)
    assert interim.ledger.total == trainer_in_line["ledgers"][first]
    state, metrics = trainer.step(state, batches[0])  # the search waits at the gate
    assert runs.sizes == [first] * (T // first) and metrics["micro_batch_size"] == first
    gate.set()
    trainer.finish_search()
    final = trainer.plan_info
    fitting = [s for s, total in trainer_in_line["ledgers"].items() if total <= trainer.capacity()]
    assert final.largest == max(fitting) == 9 == plan.largest
    assert (final.micro_batch_size, final.source) == (plan.micro_batch_size, "searched")
    assert first not in [t.size for t in trainer.search_log[1:]], "the first fit asked again"
    for batch in batches[1:]:
        state, metrics = trainer.step(state, batch)
        assert metrics["micro_batch_size"] == plan.micro_batch_size
    reference = full_batch_reference(_mlp_loss, OPT, _mlp_params(), batches)
    assert_trees_close(state.params, reference, 2e-5)


def test_the_trainer_s_out_of_memory_at_the_first_fit_ends_the_search_then_shrinks(
    trainer_in_line,
):
    first = trainer_in_line["first_fit"]
    gate, faults = threading.Event(), FaultInjector(executions={2})  # the first fit's second
    trainer = _background_trainer(trainer_in_line, _gated_loss(first, gate))
    trainer.fault_hook = OpensOnRun(gate, faults)  # the search goes on once it runs
    batches = _mlp_batches(3)
    state = trainer.init(_mlp_params(), batches[0])
    for batch in batches:
        state, _ = trainer.step(state, batch)
    assert faults.injected == [(2, first)]
    assert trainer.plan_info.largest < first and trainer.plan_info.source != INTERIM
    reference = full_batch_reference(_mlp_loss, OPT, _mlp_params(), batches)
    assert_trees_close(state.params, reference, 2e-5)


def test_the_trainer_raises_the_search_s_error_and_plans_again(trainer_in_line):
    first, gate = trainer_in_line["first_fit"], threading.Event()
    trainer = _background_trainer(trainer_in_line, _gated_loss(first, gate, fail_at=10))
    batches = _mlp_batches(3)
    state = trainer.init(_mlp_params(), batches[0])
    state, _ = trainer.step(state, batches[0])  # at the first fit
    gate.set()
    with pytest.raises(ValueError, match="fails to trace at 10"):
        trainer.finish_search()
    with pytest.raises(RuntimeError, match=r"call trainer\.init"):  # nothing is planned
        trainer.step(state, batches[1])
    trainer.plan(state, batches[1])  # in the background again: 10 traces now
    for batch in batches[1:]:
        state, _ = trainer.step(state, batch)
    trainer.finish_search()
    assert trainer.micro_batch_size == trainer_in_line["plan"].micro_batch_size
    reference = full_batch_reference(_mlp_loss, OPT, _mlp_params(), batches)
    assert_trees_close(state.params, reference, 2e-5)


def test_the_trainer_s_plan_cache_and_schedule_and_timing_with_the_search_behind(
    trainer_in_line, tmp_path
):
    """The timing follows the search; a new target keeps 9; a cached plan runs at once."""
    first, plan, gate = trainer_in_line["first_fit"], trainer_in_line["plan"], threading.Event()
    cache = PlanCache(tmp_path / "plans.json")
    trainer = _background_trainer(
        trainer_in_line, _gated_loss(first, gate), target_batch_size=[(0, T), (2, 2 * T)],
        plan_cache=cache, objective="throughput",
    )  # fmt: skip
    batches = _mlp_batches(2) + _mlp_batches(1, 2 * T)
    state = trainer.init(_mlp_params(), batches[0])
    state, metrics = trainer.step(state, batches[0])
    assert metrics["micro_batch_size"] == first
    gate.set()
    trainer.finish_search()  # no state at hand: the next update's start times the plans
    assert trainer.plan_info.timed is None
    state, metrics = trainer.step(state, batches[1])
    chosen, timed = metrics["micro_batch_size"], {row["size"] for row in trainer.throughput_log}
    assert plan.micro_batch_size in timed and metrics["micro_batch_size"] in timed
    assert max(timed) <= 9
    state, metrics = trainer.step(state, batches[2])  # a target above 9: 9 (10 did not fit)
    assert metrics["examples"] == 2 * T and metrics["micro_batch_size"] <= 9
    reference = full_batch_reference(_mlp_loss, OPT, _mlp_params(), batches)
    assert_trees_close(state.params, reference, 2e-5)
    again = _background_trainer(
        trainer_in_line, _mlp_loss, plan_cache=cache, objective="throughput"
    )
    runs = Runs()
    again.fault_hook = runs
    state = again.init(_mlp_params(), batches[0])
    assert again.plan_info.source == "plan cache" and again.plan_info.largest is None
    assert [trial.decided_by for trial in again.search_log] == ["plan cache"]
    state, metrics = again.step(state, batches[0])
    assert metrics["micro_batch_size"] == chosen and set(runs.sizes) == {chosen}


def test_a_fit_shorter_than_the_search_waits_for_it_and_the_plan_cache_gets_its_plan(
    trainer_in_line, tmp_path, caplog
):
    first, plan, gate = trainer_in_line["first_fit"], trainer_in_line["plan"], threading.Event()
    cache = PlanCache(tmp_path / "plans.json")
    trainer = _background_trainer(trainer_in_line, _gated_loss(first, gate), plan_cache=cache)
    batches = _mlp_batches(2)
    state = trainer.init(_mlp_params(), batches[0])
    sizes = []

    def on_update(update, metrics):
        sizes.append(metrics["micro_batch_size"])
        if len(sizes) == len(batches):  # the last update ran: only now may the search go on
            gate.set()

    with caplog.at_level("INFO", logger="jax_adaptive"):
        state, history = trainer.fit(state, iter(batches), on_update=on_update)
    assert sizes == [first, first] and len(history) == 2  # every update ran the interim size
    after = trainer.plan_info  # fit waited: without it, the interim and no plan cached
    assert (after.source, after.micro_batch_size, after.largest) == (
        "searched", plan.micro_batch_size, 9
    )  # fmt: skip
    ended = [r.getMessage() for r in caplog.records if "ended after the last update" in r.message]
    assert ended and f"runs its plan {plan.micro_batch_size} x " in ended[0], ended
    assert_trees_close(
        state.params, full_batch_reference(_mlp_loss, OPT, _mlp_params(), batches), 2e-5
    )
    again = _background_trainer(trainer_in_line, _mlp_loss, plan_cache=cache)
    again.init(_mlp_params(), batches[0])
    assert [trial.decided_by for trial in again.search_log] == ["plan cache"]
    assert again.micro_batch_size == plan.micro_batch_size


def test_a_new_target_waits_for_the_trainer_s_search(trainer_in_line):
    first, gate = trainer_in_line["first_fit"], threading.Event()
    trainer = _background_trainer(
        trainer_in_line, _gated_loss(first, gate), target_batch_size=[(0, T), (1, 2 * T)]
    )
    batches = _mlp_batches(1) + _mlp_batches(1, 2 * T)
    state = trainer.init(_mlp_params(), batches[0])
    state, metrics = trainer.step(state, batches[0])
    assert metrics["micro_batch_size"] == first
    gate.set()  # the search goes on: the next update's target, 48, waits for its end
    state, metrics = trainer.step(state, batches[1])
    plan = trainer.plan_info
    assert plan.source != INTERIM and plan.largest == 9  # 10 did not fit: no search up
    assert {t.reason for t in trainer.search_log} == {"init"}, "a second search, for 48"
    assert metrics["examples"] == 2 * T and metrics["micro_batch_size"] == plan.micro_batch_size
    reference = full_batch_reference(_mlp_loss, OPT, _mlp_params(), batches)
    assert_trees_close(state.params, reference, 2e-5)


def test_the_trainer_refuses_bad_arguments():
    with pytest.raises(TypeError, match="background_search must be True or False, got 1"):
        ja.AdaptiveTrainer(_mlp_loss, OPT, target_batch_size=T, background_search=1)
    choices = ja.RematChoices({"none": _mlp_loss, "full": _mlp_loss})
    with pytest.raises(ValueError, match="background_search=True plans one loss"):
        ja.AdaptiveTrainer(choices, OPT, target_batch_size=T, background_search=True)
    with pytest.raises(ValueError, match="background_search=True is for one AdaptiveTrainer"):
        ja.BucketedTrainer(_mlp_loss, OPT, buckets=(4,), target_tokens=16, background_search=True)
