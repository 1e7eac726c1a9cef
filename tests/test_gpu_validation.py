"""The GPU validation script's smoke run on a CPU: every check runs and says what it should.

`experiments/gpu_validation.py --smoke` makes the out-of-memory errors real on a CPU
(an address-space limit in each child), so this checks the script end to end: a check
that errors, an OOM that is not recognised, a search that misses the brute-force answer
a donation outcome that is not a bool, or an Adam plan whose ledger leaves out the
moments or runs out of memory at its first run fails the test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "experiments" / "gpu_validation.py"
CHECKS = {
    "oom_preallocate_false",
    "oom_mem_fraction",
    "search_vs_brute_force",
    "estimate_vs_peak",
    "donation_after_oom",
    "resnet50_throughput",
    "adam_ledger",
    "speed",
}


def test_smoke_run_validates_every_check(tmp_path):
    out = tmp_path / "gpu_validation.json"
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "smoke"
    assert report["device"]["backend"] == "cpu"
    checks = report["checks"]
    assert set(checks) == CHECKS
    for name, record in checks.items():
        assert record["error"] is None, f"{name}: {record['error']}"
        assert record["result"] is not None, name

    for name in ("oom_preallocate_false", "oom_mem_fraction"):
        result = checks[name]["result"]
        assert result["fits_ok"], name  # below the limit an allocation runs
        assert result["requested_bytes"] > result["limit_bytes"]
        assert result["is_oom"] is True, result["attempts"]
        assert all(a["caught"] and a["is_oom"] for a in result["attempts"])
    assert checks["oom_mem_fraction"]["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.25"
    assert checks["oom_preallocate_false"]["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"

    search = checks["search_vs_brute_force"]["result"]
    target = search["target_batch_size"]
    assert 1 < search["brute_force"] < target  # the limit leaves the search real work
    assert search["micro_batch_size"] == search["brute_force"]
    assert search["rounds_of_4"]["micro_batch_size"] == search["brute_force"]  # side by side
    assert search["equal"] is True
    assert 0 < search["compiles"] < target
    assert sorted(int(s) for s in search["ledgers"]) == list(range(1, target + 1))
    assert search["ledgers"][str(search["brute_force"])] <= search["memory_limit"]

    peak = checks["estimate_vs_peak"]["result"]
    assert peak["sizes"] and peak["memory_stats_available"] is False
    for row in peak["sizes"]:
        assert row["error"] is None and row["estimate"] > 0
        assert row["peak_bytes_in_use"] is None  # a CPU gives no memory_stats()

    donation = checks["donation_after_oom"]["result"]
    assert donation["caught"] is True and donation["is_oom"] is True
    assert isinstance(donation["donated_deleted"], bool)
    assert donation["control_deleted"] is True  # donation was in effect
    assert donation["temp_bytes"] > donation["limit_bytes"]

    resnet = checks["resnet50_throughput"]["result"]
    assert resnet["sizes"], resnet
    for row in resnet["sizes"]:
        assert row["timed_updates"] >= 1 and row["images_per_s"] > 0

    adam = checks["adam_ledger"]["result"]
    limit, ledger, size = adam["memory_limit"], adam["ledger"], adam["micro_batch_size"]
    assert adam["capacity"] == limit  # a CPU gives no capacity of its own
    assert 1 < size < adam["target_batch_size"]  # the limit leaves the search real work
    assert adam["next_size"] == size + 1
    assert ledger["total"] <= limit < adam["next_ledger_total"]  # the exact max
    assert ledger["total"] == ledger["state"] + ledger["in_flight"] + ledger["program"]
    # The whole live state (every Adam leaf, read or not) plus the float32 running
    # totals of the loss and the accuracy.
    assert ledger["state"] == adam["state_bytes_live"] + 2 * 4
    assert adam["moments_bytes"] > 0
    assert adam["missed_by_program_estimate"] >= adam["moments_bytes"]  # the old gap
    assert adam["old_estimate_takes_next"] is True  # it would have overcommitted
    assert adam["run_decisions_per_update"] == [0, 0]
    assert adam["fits_first_run"] is True
    assert adam["updates"] == 2 and adam["sizes_per_update"] == [size, size]
    assert adam["peak_bytes_in_use"] is None and adam["ledger_over_trainer_peak"] is None

    speed = checks["speed"]["result"]
    variants = {"trainer", "trainer_device", "trainer_chunk1", "trainer_program",
                "optax_microbatch", "optax_microbatch_host"}  # fmt: skip
    for case in speed["cases"].values():
        assert set(case["ms_per_update"]) == variants
        assert all(ms > 0 for ms in case["ms_per_update"].values())
        # The capacity allows the whole update on a CPU; a CPU also times the chunk and
        # takes one micro-step per dispatch where it ran over 2x slower (chunking.settle):
        # CI's loaded 2 cores, with the suite's unoptimised machine code, once did.
        assert case["chunk"] in (1, 1024 // case["micro_batch_size"])
        for ratio in ("host_batch", "device_batch", "chunk1", "program"):
            assert case[ratio]["q1"] <= case[ratio]["median"] <= case[ratio]["q3"]
        ms = case["ms_per_update"]
        assert case["host_ms_per_update"] == pytest.approx(
            ms["trainer_device"] - ms["trainer_program"]
        )
    cnn = speed["cnn"]
    assert set(cnn["ms_per_update"]) == {"chunk_auto", "chunk_1"}
    assert 1 <= cnn["chunk_taken"] <= cnn["target_batch_size"] // cnn["micro_batch_size"]
    loader = speed["loader"]["over_optax_loop"]
    assert set(loader) == {"fit_read_ahead", "fit_no_read_ahead", "step_loop_read_ahead"}
    assert all(q["median"] > 0 for q in loader.values())
