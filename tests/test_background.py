"""``AdaptiveStep(..., background_search=True)``: the first call runs at the first size
found to fit while the search goes on; later calls take the searched plan; exact throughout.

References: a step planned in line (the search before the first call, itself checked
against brute force in test_step.py), every size's ledger (brute force), and plain
full-batch Adam.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, donating_step_builder, full_batch_reference

import jax_adaptive as ja
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
