"""The command line on two jax.distributed processes (localhost, gloo, 4 CPU devices each).

Each process runs hosts_cli_job.py, which records the examples its data stream read; in
one pair of runs process 1 is killed (SIGKILL) after a checkpoint, process 0 stops with one
line, and both are resumed.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import free_port

JOB = Path(__file__).with_name("hosts_cli_job.py")
EXAMPLES, T = 256, 64  # an epoch: 4 updates


def _two_processes(tmp_path, name, *flags, kill_at=0):
    """Runs the command line as two processes: each one's exit status, stdout, stderr, reads.

    ``kill_at``: hosts_cli_job.py's KILL_AT (``"2@1"``: process 1 after checkpoint 2).
    """
    port, outs = free_port(), [tmp_path / f"{name}{i}.json" for i in range(2)]
    args = [[sys.executable, JOB, i, port, out, kill_at, *flags] for i, out in enumerate(outs)]
    procs = [
        subprocess.Popen(
            [str(a) for a in command],
            cwd=JOB.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in args
    ]
    try:
        texts, errs = zip(*(proc.communicate(timeout=240) for proc in procs), strict=True)
    except subprocess.TimeoutExpired:
        pytest.fail("the processes did not finish in 240 s (a deadlock?)")
    finally:  # one that hung must not leave its peer running into later tests
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    results = [json.loads(out.read_text()) if out.exists() else None for out in outs]
    return [proc.returncode for proc in procs], list(texts), list(errs), results


def _params(workdir, update):
    restored = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(update) / "state")
    return restored["state"]["params"]


def test_two_processes_read_an_epoch_once_and_resume_after_a_kill(tmp_path):
    flags = ["--model", "mlp", "--dataset", f"synthetic:{EXAMPLES}", "--target-batch-size", T]
    flags += ["--epochs", 1, "--data-parallel", "--micro-batch-size", 24, "--no-progress"]
    flags += ["--checkpoint-every", 2, "--compilation-cache", tmp_path / "xla"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    status, texts, errs, results = _two_processes(
        tmp_path, "whole", *flags, "--eval-every", 2, "--workdir", whole
    )
    assert status == [0, 0], errs
    # Every example of the epoch read exactly once, across both processes.
    firsts = [[i for epoch, i in r["read"] if epoch == 0] for r in results]
    assert len(firsts[0]) == len(firsts[1]) == EXAMPLES // 2
    assert sorted(firsts[0] + firsts[1]) == list(range(EXAMPLES))
    # Process 0 alone prints and writes the lines; micro-batches of 24 (12 rows of each
    # process's 32) on the 8 devices.
    lines = [line for line in texts[0].splitlines() if line.startswith(("plan:", "update"))]
    assert lines[0].startswith("plan: micro-batch 24 x 3 accumulation steps = target batch 64")
    assert lines[0].endswith("; no simulated device (--micro-batch-size 24 is fixed)"), lines[0]
    assert len(lines) == 5 and texts[1] == "", texts[1]  # process 1 prints nothing
    assert "[Gloo]" not in texts[0] and "[Gloo]" in errs[0]  # gloo's lines: stderr
    assert "jax_adaptive: " in errs[0] and "jax_adaptive: " not in errs[1]  # the search's log
    metrics = [json.loads(m) for m in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [m["update"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[1]["eval_examples"] == 1024  # each process evaluated its 512
    # Process 1 killed (SIGKILL) once checkpoint 2 is written: process 0's next collective
    # fails and it stops at once with one line; then both are resumed.
    flags += ["--eval-every", 0, "--workdir", killed]
    start = time.monotonic()
    status, _, errs, _ = _two_processes(tmp_path, "killed", *flags, kill_at="2@1")
    assert status == [2, -9] and time.monotonic() - start < 120, errs
    # One line of ours, the last, and no traceback. What else stderr holds is Gloo's and
    # the search's log, and Gloo's threads print over each other, splitting its lines
    # anywhere ("[Gloo] Rank [Gloo] Rank 1 is connected ...", "0 is connected to ...").
    lines = errs[0].splitlines()
    said = [line for line in lines if line.startswith("error:")]
    assert len(said) == 1 and lines[-1] == said[0] and "Traceback" not in errs[0], errs[0]
    assert said[0].startswith("error: a process of the jax.distributed job is gone: "), said
    status, texts, errs, _ = _two_processes(tmp_path, "resumed", *flags, "--resume")
    assert status == [0, 0], errs
    assert "resumed at update 2" in texts[0]
    a, b = _params(whole, 4), _params(killed, 4)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    resumed = [json.loads(m) for m in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)


def test_the_coordinator_killed_ends_the_other_at_once_with_one_line(tmp_path):
    # Process 0 (jax.distributed's service) killed after checkpoint 2: without the watched
    # connections, jaxlib aborts process 1 (status 134 after a C++ "Terminating process"
    # trace) or its collective fails, whichever comes first. jaxlib may still print its
    # lines (it sees the service gone as the watch does), but process 1 leaves first.
    flags = ["--model", "mlp", "--dataset", f"synthetic:{EXAMPLES}", "--target-batch-size", T]
    flags += ["--epochs", 1, "--data-parallel", "--micro-batch-size", 24, "--no-progress"]
    flags += ["--checkpoint-every", 2, "--eval-every", 0, "--workdir", tmp_path / "w"]
    start = time.monotonic()
    status, _, errs, _ = _two_processes(tmp_path, "coordinator", *flags, kill_at="2@0")
    assert status == [-9, 2] and time.monotonic() - start < 120, errs
    said = [line for line in errs[1].splitlines() if line.startswith("error:")]
    assert said == [
        "error: a process of the jax.distributed job is gone: process 0 ended before the job "
        "did (see its own output); this one stops too: resume every process with --resume"
    ], errs[1]
    assert errs[1].splitlines()[-1] == said[0], errs[1]  # the last word is ours


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--distributed"], "--distributed trains an image model over every process's devices"),
        (["--distributed", "localhost:1,2,2", "--data-parallel"], "with 0 <= ID < PROCESSES"),
        (["--distributed", "--data-parallel", "--model", "gpt"], "--model gpt runs on one"),
        (["--dataset", "synthetic:0"], "synthetic:N takes a positive count N"),
    ],
)
def test_bad_distributed_flags_are_one_line(flags, said, capsys):
    from jax_adaptive.cli.main import main

    assert main([*flags, "--updates", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("localhost:notaport,2,0", "the port 'notaport' is not a number from 1 to 65535"),
        ("localhost:{port},1,0,7", "it has 4 comma-separated fields, not 3"),
        ("nohost.invalid:{port},2,0", "the coordinator's host 'nohost.invalid' does not resolve"),
        ("localhost:{port},2,0", "processes 1 of 2 did not join at localhost:{port} within 2s"),
        ("localhost:{port},2,1", "process 1 found no process 0 at localhost:{port} within 2s"),
    ],
)
def test_a_bad_address_or_a_peer_that_never_starts_is_one_line_before_jax_starts(
    spec, said, capsys
):
    """Issue 37: a segfault, an extra field accepted, silence until killed."""
    from jax_adaptive.cli.main import main

    port = free_port()
    start = time.monotonic()
    flags = ["--distributed", spec.format(port=port), "--distributed-timeout", "2"]
    assert main([*flags, "--data-parallel", "--updates", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - start < 30
    assert err.startswith("error: --distributed") and len(err.splitlines()) == 1, err
    assert said.format(port=port) in err, err
    assert not jax.distributed.is_initialized()
