"""The command line's runs that resume or repeat, and its language-model path.

Split from test_train_cli.py (issue 40): with ``--dist loadscope`` a module runs on one
worker, and that module alone took 581 s of the suite's time; these tests are about half.
"""

import json
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import pytest
from helpers import checkpointed_params, cli_command

from jax_adaptive.cli.main import main


def test_metrics_hold_one_line_per_update_after_a_resume(tmp_path):
    flags = ["--model", "mlp", "--target-batch-size", "8", "--checkpoint-every", "2"]
    flags += ["--no-progress", "--no-plan-cache", "--eval-every", "0", "--workdir", str(tmp_path)]
    assert main([*flags, "--updates", "5"]) == 0
    # Killed after update 5's line but before its checkpoint: the resumed run redoes 5.
    shutil.rmtree(tmp_path / "checkpoints" / "5")
    with open(tmp_path / "metrics.jsonl", "a") as metrics:
        metrics.write('{"update": 6, "lo')  # and half a line of a later one
    assert main([*flags, "--updates", "7", "--resume"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["update"] for line in lines] == [1, 2, 3, 4, 5, 6, 7]


def test_a_second_run_takes_its_plan_from_the_cache(tmp_path, capsys):
    flags = ["--target-batch-size", "512", "--memory-limit", "8MB", "--updates", "1"]
    flags += ["--plan-cache", str(tmp_path / "plans.json"), "--eval-every", "0"]
    plans = []
    for _ in range(2):
        assert main(flags) == 0
        plans.append(capsys.readouterr().out.splitlines()[0])
    assert "from the plan cache" not in plans[0] and not plans[0].split("; ")[1].startswith("0 ")
    assert plans[1].startswith(plans[0].split(";")[0])  # the same micro-batch and steps
    assert "; 0 sizes compiled" in plans[1]
    assert f"(from the plan cache {tmp_path / 'plans.json'}; " in plans[1]  # where it came from


def test_sigkill_then_resume_gives_the_uninterrupted_parameters(tmp_path):
    flags = ["--target-batch-size", "64", "--memory-limit", "3MB", "--updates", "12"]
    flags += ["--checkpoint-every", "2", "--eval-every", "0"]
    # The three runs share a plan cache and a compilation cache, as runs of one job on
    # one machine do: the later two start in seconds.
    flags += ["--plan-cache", tmp_path / "plans.json", "--compilation-cache", tmp_path / "xla"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(cli_command(*flags, "--workdir", whole), check=True, timeout=300,
                   capture_output=True)  # fmt: skip
    proc = subprocess.Popen(cli_command(*flags, "--workdir", killed), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        steps = [p.name for p in (killed / "checkpoints").glob("*") if p.name.isdigit()]
        if any(int(s) >= 4 for s in steps):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run must be killed mid-way"
    done = (killed / "metrics.jsonl").read_text().splitlines()
    assert 4 <= len(done) < 12
    resumed = subprocess.run(cli_command(*flags, "--workdir", killed, "--resume"), check=True,
                             timeout=300, capture_output=True, text=True)  # fmt: skip
    assert "resumed at update" in resumed.stdout.splitlines()[0]
    a, b = checkpointed_params(whole, 12), checkpointed_params(killed, 12)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    (plan,) = json.loads((killed / "plan.json").read_text())["plans"]
    assert 1 <= plan["micro_batch_size"] < 64


def test_the_gpt_trains_on_mixed_lengths_with_a_token_budget(tmp_path, capsys):
    flags = ["--model", "gpt", "--max-length", "64", "--target-tokens", "512", "--updates", "10"]
    flags += ["--memory-limit", "4MB", "--learning-rate", "1e-2", "--no-plan-cache"]
    assert main([*flags, "--no-progress", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    planned = [line for line in out if line.startswith("bucket ")]
    assert len(planned) >= 2, out  # several buckets, each planned on its first use
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 10 and len({m["bucket"] for m in metrics}) >= 2
    for m in metrics:  # a budget of padded tokens, of which the real ones are most
        assert m["padded_tokens"] == 512 and 0 < m["tokens"] < 512
        assert m["micro_batch_size"] < 512 // m["bucket"]  # 4MB makes every bucket shrink
    assert metrics[-1]["loss"] < 0.85 * metrics[0]["loss"], "the loss must visibly fall"
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert {b["bucket"] for b in plan["plans"]} == {m["bucket"] for m in metrics}
    assert out[-1].startswith("summary: ") and "padding" in out[-1]


def test_a_resumed_gpt_run_trains_on_the_batches_of_an_uninterrupted_one(tmp_path, capsys):
    flags = ["--model", "gpt", "--max-length", "64", "--target-tokens", "512"]
    flags += ["--no-simulated-device", "--checkpoint-every", "2", "--no-progress"]
    flags += ["--no-plan-cache", "--learning-rate", "1e-2"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main([*flags, "--updates", "5", "--workdir", str(whole)]) == 0
    assert main([*flags, "--updates", "3", "--workdir", str(part)]) == 0
    # Killed after update 3's line but before its checkpoint: the resumed run redoes 3.
    shutil.rmtree(part / "checkpoints" / "3")
    capsys.readouterr()
    assert main([*flags, "--updates", "5", "--workdir", str(part), "--resume"]) == 0
    resumed = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resumed"))
    read = int(resumed.split("(")[1].split()[0])
    lines = {}
    for run in (whole, part):
        lines[run] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # Sequences waited in partly filled buckets at the checkpoint (read, not trained on),
    # and a bucket first filled after it trains on some of them.
    assert resumed.startswith("resumed at update 2 ") and read > 2 * 512 // 64, resumed
    first_two = {m["bucket"] for m in lines[whole][:2]}
    assert {m["bucket"] for m in lines[whole][2:]} - first_two, lines[whole]
    assert [m["update"] for m in lines[part]] == [1, 2, 3, 4, 5]
    for a, b in zip(lines[whole], lines[part], strict=True):
        assert (a["bucket"], a["tokens"]) == (b["bucket"], b["tokens"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    a, b = checkpointed_params(whole, 5), checkpointed_params(part, 5)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_resume_refuses_another_training_and_takes_another_plan(tmp_path, capsys):
    """Issue 32, fault 12: the ghost batch is the run's; a plan may differ."""
    flags = ["--model", "resnet-tiny", "--target-batch-size", "64", "--eval-every", "0",
             "--no-progress", "--no-plan-cache", "--workdir", str(tmp_path)]  # fmt: skip
    assert main([*flags, "--updates", "1", "--micro-batch-size", "32"]) == 0  # ghost 32
    capsys.readouterr()
    assert main([*flags, "--updates", "2", "--resume", "--ghost-batch-size", "16"]) == 2
    out, err = capsys.readouterr()  # another ghost batch: refused before anything is built
    assert out == "" and err.count("\n") == 1, (out, err)
    assert "--ghost-batch-size 32 there, 16 now" in err, err
    assert main([*flags, "--updates", "2", "--resume", "--learning-rate", "0.1"]) == 2
    assert "--learning-rate 0.003 there, 0.1 now" in capsys.readouterr().err
    # Auto, another objective, no simulated device: another plan, the same ghost batch.
    more = ["--resume", "--objective", "max", "--no-simulated-device"]
    assert main([*flags, "--updates", "2", *more]) == 0
    assert "resumed at update 1" in capsys.readouterr().out
