import subprocess
import sys

import pytest

from jax_adaptive.train import main, parse_bytes


def test_default_job_runs_and_learns():
    result = subprocess.run(
        [sys.executable, "-m", "jax_adaptive.train", "--updates", "12"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    assert lines[0].startswith("plan: micro-batch 256 x 1 accumulation steps")
    losses = [float(line.split("loss")[1].split()[0]) for line in lines[1:]]
    assert len(losses) == 12
    assert losses[-1] < 0.7 * losses[0], "the loss must visibly fall"


def test_memory_limit_shrinks_the_micro_batch(capsys):
    assert main(["--memory-limit", "4MB", "--updates", "1", "--target-batch-size", "64"]) == 0
    plan = capsys.readouterr().out.splitlines()[0]
    size = int(plan.split("micro-batch ")[1].split()[0])
    assert 1 <= size < 64, plan


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5kB", 1500), ("42", 42), (" 2 mib ", 2**21)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "8 GiBs", "-5MB", "0.1"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(text)


def test_bad_flags_give_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        main(["--memory-limit", "lots"])
    assert "cannot read 'lots' as a memory size" in capsys.readouterr().err
    assert main(["--target-batch-size", "0"]) == 2
    assert "target_batch_size=0 must be positive" in capsys.readouterr().err


def test_a_second_run_takes_its_plan_from_the_cache(tmp_path, capsys):
    flags = ["--target-batch-size", "512", "--memory-limit", "8MB", "--updates", "1"]
    flags += ["--plan-cache", str(tmp_path / "plans.json")]
    plans = []
    for _ in range(2):
        assert main(flags) == 0
        plans.append(capsys.readouterr().out.splitlines()[0])
    assert "from the plan cache" not in plans[0] and not plans[0].split("; ")[1].startswith("0 ")
    assert plans[1].startswith(plans[0].split(";")[0])  # the same micro-batch and steps
    assert "; 0 sizes compiled" in plans[1] and plans[1].endswith("(from the plan cache)")
