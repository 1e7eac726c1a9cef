"""A causal language model sharded as Flax's NNX guide shards one, on 8 CPU devices.

The figures come from sharded_lm_job.py, run once in a subprocess (the device count is
fixed when JAX starts): examples/nnx_lm.py's Transformer, its kernels annotated with
``nnx.with_partitioning`` over ``data`` (FSDP), trained by `AdaptiveNnxStep` 5 calls at
T = 47 (prime: no plan divides it) with injected out-of-memory errors, evaluated by
`Evaluator`, trained by `NnxTrainer` from the model's annotations and by a user's own
step under `AdaptiveStep`, each against an independent reference on one device.
"""

from pathlib import Path

import pytest
from helpers import job_result

JOB = Path(__file__).with_name("sharded_lm_job.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return job_result(JOB, tmp_path_factory.mktemp("sharded_lm"), timeout=600)


def test_the_nnx_step_trains_a_sharded_lm_call_after_call_as_one_device(result):
    step = result["step"]
    assert len(step["sizes"]) == 5  # five calls, none refused for its arguments' shardings
    assert all(1 < m < step["T"] and step["T"] % m for m in step["sizes"]), step["sizes"]
    assert step["before"] == step["after"]
    assert step["before"]["up"] == "P(None, None, 'data')"  # the layers' axis, then the kernel's
    assert step["difference_3"] < TOL and step["difference"] < TOL


def test_replicated_state_does_not_fit_the_limit_the_sharded_one_trains_under(result):
    step = result["step"]
    # A batch of 1 (no micro-batch of T needs less) replicated: NothingFitsError.
    assert "the step at micro-batch 1 needs" in step["replicated"], step["replicated"]
    assert step["replicated_needs"] > step["limit"]  # measured 2,167,404 > 1,283,644 bytes
    assert all(plan.startswith("micro-batch 20 ") for plan in step["plans"][:3])  # sharded


def test_an_out_of_memory_mid_update_leaves_the_sharded_state_and_training_exact(result):
    step = result["step"]
    # The gradient's run (retried: the size had run), the update's (raised, then the call
    # again), the gradient's and its retry (the plan shrinks); the update's left every
    # variable of the model and optimizer as it was. Exact throughout (the first test).
    assert step["fired"] == [[1, "gradient"], [2, "update"], [1, "gradient"], [2, "gradient"]]
    assert step["intact"] == 0 and step["intact_specs"] == step["before"]
    assert step["sizes"][:3] == [20] * 3 and step["sizes"][3] == step["sizes"][4] < 20


def test_the_plan_says_the_state_is_sharded(result):
    assert all("state sharded over data" in plan for plan in result["step"]["plans"])


def test_the_evaluator_on_sharded_parameters_equals_one_device(result):
    ev = result["evaluator"]
    assert ev["examples"] == 37
    assert ev["loss"] == pytest.approx(ev["want_loss"], rel=TOL)
    assert ev["tokens"] == pytest.approx(ev["want_tokens"], rel=TOL)


def test_the_nnx_trainer_takes_the_models_annotations_and_trains_as_one_device(result):
    trainer = result["nnx_trainer"]
    # 16 x 3 for T = 47: the last micro-batch padded, within 1e-5 of 3 plain full-batch
    # nnx.jit steps on one device (the NNX step's reference, after its third call).
    assert (trainer["micro_batch_size"], trainer["steps"]) == (16, 3)
    assert trainer["specs"] == {  # sharded as the annotations say
        "up": "P(None, None, 'data')", "query": "P(None, None, None, 'data')",
        "embed": "P('data', None)",
    }  # fmt: skip
    assert "state sharded over data (FSDP)" in trainer["plan"]
    assert trainer["difference"] < TOL


def test_a_users_own_step_on_sharded_parameters_equals_one_device(result):
    own = result["own_step"]
    assert own["up_spec"] == "P(None, None, 'data')"
    assert own["steps"] > 1 and own["difference"] < TOL
