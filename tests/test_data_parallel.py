"""Data parallel over 8 CPU devices, and two jax.distributed processes, against one device.

The processes pass global batches (``global_batches=True``), or each only its own rows.

Both run in subprocesses (the device count is fixed when JAX starts; see
data_parallel_job.py) and compare with plain optax, one full-batch step per update, on
a single device.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import free_port

JOB = Path(__file__).with_name("data_parallel_job.py")
TOL = 2e-5


def _run(*args, timeout=240):
    return subprocess.Popen(
        [sys.executable, str(JOB), *map(str, args)],
        cwd=JOB.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ), timeout


def _wait(proc_timeout):
    proc, timeout = proc_timeout
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the job did not finish in {timeout} s (a deadlock?):\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]


def _assert_equal(params, reference, tol=TOL):
    assert params.keys() == reference.keys()
    for name in params:
        np.testing.assert_allclose(params[name], reference[name], rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def mesh_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh") / "result.json"
    _wait(_run("mesh", out))
    return json.loads(out.read_text())


def test_data_parallel_equals_one_device(mesh_result):
    _assert_equal(mesh_result["single"]["params"], mesh_result["reference"])
    _assert_equal(mesh_result["data"]["params"], mesh_result["reference"])


def test_the_searched_size_is_per_device_and_a_multiple_of_the_devices(mesh_result):
    data, single = mesh_result["data"], mesh_result["single"]
    assert data["planned"] % 8 == 0
    assert data["planned"] == data["brute_force"]  # the exact max over multiples of 8
    # Under the same per-device cap, 8 devices hold about 8 times the single micro-batch.
    assert data["planned"] >= 6 * single["planned"]
    assert set(data["shardings"].values()) == {"P()"}  # replicated by default


def test_user_sharded_parameters_and_their_optimizer_state(mesh_result):
    sharded = mesh_result["sharded"]
    want = {"w1": "P(None, 'model')", "b1": "P('model',)", "w2": "P('model',)"}
    assert sharded["shardings"] == want
    assert sharded["mu_shardings"] == want  # Adam's moments follow their parameters
    assert sharded["injected"], "the injected out-of-memory did not happen"
    assert all(s % 4 == 0 for s in sharded["sizes"])  # 4 data shards on the 4x2 mesh
    assert sharded["sizes"][-1] < sharded["planned"]
    _assert_equal(sharded["params"], mesh_result["reference"])


def _two_processes(job, tmp_path):
    """Runs ``job`` as two jax.distributed processes on localhost; their JSON results."""
    port = free_port()
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    procs = [_run(job, i, port, out, timeout=180) for i, out in enumerate(outs)]
    try:
        for proc in procs:
            _wait(proc)
    finally:  # one that timed out must not leave its peer running into later tests
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [json.loads(out.read_text()) for out in outs]


def test_two_processes_agree_and_shrink_together(tmp_path):
    first, second = _two_processes("process", tmp_path)
    assert first["devices"] == second["devices"] == 4
    # Different capacities: each found its own size, and both use the smaller.
    assert first["searched"] > second["searched"]
    assert first["planned"] == second["planned"] == second["searched"]
    # Only the first process ran out of memory, inside a micro-step's run; the second
    # ran that micro-step to its end (no collective in it waits for the first), then
    # both shrank at the same micro-step.
    assert first["injected"] and not second["injected"]
    assert first["per_device"] and second["per_device"]
    # The optimizer step's reduction keeps a program of its own: a micro-step failing on
    # one process must leave no other waiting in it.
    assert first["fused"] is second["fused"] is False
    assert second["runs"] == first["runs"] + 1
    assert first["sizes"] == second["sizes"]
    assert first["sizes"][-1] < first["planned"]
    _assert_equal(first["params"], first["reference"])
    _assert_equal(second["params"], first["params"])


def test_each_process_reads_only_its_own_rows(tmp_path):
    first, second = _two_processes("local", tmp_path)
    assert first["devices"] == second["devices"] == 8
    share = 50  # T = 100 over 2 processes
    assert first["process_batch_size"] == second["process_batch_size"] == share
    # Each loader yielded only its process's rows: T / 2 per update, 3 updates.
    assert first["read"] == second["read"] == 3 * share
    assert first["examples"] == second["examples"] == [100] * 3
    # The processes found different sizes and use the smaller; neither divides the share.
    assert first["planned"] == second["planned"]
    (own, peer), planned = first["found"], first["planned"]  # process 0's device is smaller
    assert planned == own < peer and first["found"] == second["found"]
    said = f"process 0 bound it at {own}; the others could have gone to {peer} (process 1, "
    assert f"{said}+{peer - own})" in first["plan"] and f"{said}+{peer - own})" in second["plan"]
    assert (first["planned"] // 2) and share % (first["planned"] // 2)
    # Only process 0 ran out of memory, inside a running micro-step; process 1 ran that
    # micro-step to its end, then both shrank at the same micro-step.
    assert first["injected"] and not second["injected"]
    assert second["runs"] == first["runs"] + 1
    assert first["sizes"] == second["sizes"]
    assert first["sizes"][0] < first["planned"] and all(s % 8 == 0 for s in first["sizes"])
    assert all(share % (s // 2) for s in first["sizes"])
    # Exact against one device on the concatenation of the processes' rows.
    _assert_equal(first["params"], first["reference"], tol=1e-5)
    _assert_equal(second["params"], first["params"], tol=1e-5)
    # Different counts are refused in one line on both; a stream ending on one ends both.
    assert first["errors"] == second["errors"]
    assert first["errors"][0].endswith("but they passed [50, 40] (in process order).")
    assert first["updates_after_end"] == second["updates_after_end"] == 0
    # A data axis of 2 shards, one per process, splits the rows; one of 4 whose every
    # shard has a device on each process does not: each passes the whole batch.
    assert first["splits"] == second["splits"] == [2, 1]
    # FSDP over both processes' devices, each passing its own rows: exact too.
    for run in (first, second):
        sharded = run["sharded"]
        want = {"w1": "P(None, 'data')", "b1": "P('data',)", "w2": "P('data',)"}
        assert sharded["specs"] == sharded["mu_specs"] == want
        assert sharded["w1_local"] * 2 == sharded["w1_size"]  # each process holds half
        assert sharded["process_batch_size"] == share and sharded["steps"] == 5  # 24 x 5
        assert "state sharded over data (FSDP)" in sharded["plan"]
        _assert_equal(sharded["params"], first["reference"], tol=1e-5)
    # Process 0 evaluated 10 held-out rows, process 1 the other 20: the mean is over 30.
    for run in (first, second):
        assert run["evaluated"]["examples"] == 30
        np.testing.assert_allclose(run["evaluated"]["loss"], first["evaluated_reference"], 1e-5)


def test_each_process_buckets_its_own_sequences(tmp_path):
    first, second = _two_processes("buckets", tmp_path)
    # The same bucket at every update on both, each process passing half of its examples
    # (96 tokens: 24 sequences of bucket 4, 12 of bucket 8), until no bucket fills on both.
    assert first["buckets"] == second["buckets"] and len(set(first["buckets"])) == 2
    assert first["rows"] == second["rows"] == [96 // b // 2 for b in first["buckets"]]
    assert first["tokens"] == second["tokens"]  # real tokens over both processes
    # Each update equals one device's on both processes' rows: a token weighs the same.
    assert first["difference"] < 1e-6 and second["difference"] < 1e-6
