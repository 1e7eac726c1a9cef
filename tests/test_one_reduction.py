"""One gradient reduction per update under a mesh, exact against one device.

Each device accumulates the gradient of its own rows (`jax_adaptive.step.per_device`):
the compiled micro-step and chunk hold no collective, the optimizer step one reduction.
Before this design the micro-step all-reduced the gradient (1 all-reduce per micro-step,
5 per update here) and a chunk all-gathered the whole micro-batches onto every device
(3 all-gathers). The figures come from one_reduction_job.py on 8 CPU devices.
"""

from pathlib import Path

import numpy as np
import pytest
from helpers import job_result

JOB = Path(__file__).with_name("one_reduction_job.py")
TOL = 2e-5


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return job_result(JOB, tmp_path_factory.mktemp("one_reduction"), timeout=300)


def _assert_close(params, reference, tol=TOL):
    assert params.keys() == reference.keys()
    for name in params:
        np.testing.assert_allclose(params[name], reference[name], rtol=tol, atol=tol)


def _assert_metrics(metrics, reference):
    for got, want in zip(metrics, reference, strict=True):
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=TOL, atol=TOL)


def test_the_micro_step_and_the_chunk_run_no_collective(result):
    counts = result["counts"]
    assert counts["per_device"]
    assert sum(counts["micro"].values()) == 0, counts["micro"]
    assert sum(counts["chunk"].values()) == 0, counts["chunk"]


def test_one_gradient_reduction_per_update(result):
    counts = result["counts"]
    for donating, ops in counts["optimizer"].items():
        assert ops["all-reduce"] == 1, (donating, ops)  # the gradient and totals, at once
        assert sum(ops.values()) == 1, (donating, ops)
    per_update = counts["micro_steps_per_update"] * sum(counts["micro"].values()) + sum(
        counts["optimizer"]["False"].values()
    )
    assert per_update == 1


def test_the_last_program_with_the_optimizer_step_reduces_once(result):
    # The micro-steps in it reduce nothing; the optimizer step in it, once.
    for chunk, ops in result["counts"]["final"].items():
        assert ops["all-reduce"] == 1 and sum(ops.values()) == 1, (chunk, ops)


def test_a_loss_with_model_state_keeps_the_spmd_micro_step(result):
    # Its statistics span the whole micro-batch, as before: the micro-step reduces.
    counts = result["counts"]
    assert not counts["stateful_per_device"]
    assert counts["stateful_micro"]["all-reduce"] >= 1


def test_the_ledger_counts_one_accumulator_per_device(result):
    counts = result["counts"]
    # A device holds one row of the [8, ...] accumulator: the state it holds is the
    # state of a single-device trainer, not 8 accumulators.
    assert counts["state_bytes"] == counts["single_device_state_bytes"]
    assert counts["ledger_state"] == counts["state_bytes"]
    assert counts["state_bytes"] >= 4 * counts["params_bytes"]  # params, mu, nu, acc


@pytest.mark.parametrize("chunk", ["1", "2", "auto"])
def test_padding_weights_and_aux_equal_one_full_batch_step(result, chunk):
    run = result["weighted"][chunk]
    # chunks hold no collective: under a mesh "auto" scans micro-steps as on one device
    assert run["chunk"] == (5 if chunk == "auto" else int(chunk))  # auto: all 5 at once
    assert run["fused"]  # the last program reduced the devices' sums and stepped
    _assert_close(run["params"], result["reference"])
    _assert_metrics(run["metrics"], result["reference_metrics"])
    assert run["sizes"] == [24] * 3
    # The state keeps the parameters' shape for its accumulator between updates.
    assert run["acc_shapes"] == [[16], [8, 16], [16]]


def test_a_devices_rows_draw_what_a_micro_batch_of_them_draws_on_one_device(result):
    noisy = result["noisy"]
    _assert_close(noisy["mesh"]["params"], noisy["one_device"]["params"])
    np.testing.assert_allclose(
        [m["loss"] for m in noisy["mesh"]["metrics"]],
        [m["loss"] for m in noisy["one_device"]["metrics"]],
        rtol=TOL,
    )


def test_out_of_memory_in_micro_steps_loses_nothing(result):
    run = result["recovery"]
    assert len(run["injected"]) == 2, run["injected"]  # a first update's, and a later one's
    assert run["sizes"][-1] < 80
    _assert_close(run["params"], result["reference"])
    _assert_metrics(run["metrics"], result["reference_metrics"])


def test_out_of_memory_in_a_chunk_loses_nothing(result):
    run = result["recovery_chunk"]
    assert run["injected"], "the injected out-of-memory did not happen"
    _assert_close(run["params"], result["reference"])
    _assert_metrics(run["metrics"], result["reference_metrics"])
