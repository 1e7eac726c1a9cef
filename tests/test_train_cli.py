import collections
import dataclasses
import io
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import traceback

import jax
import numpy as np
import pytest
from helpers import checkpointed_params, cli_command

from jax_adaptive.cli import images
from jax_adaptive.cli.config import check_config
from jax_adaptive.cli.language_model import _stream
from jax_adaptive.cli.main import TrainConfig, main, parse_bytes, train
from jax_adaptive.cli.report import main as report_main
from jax_adaptive.cli.report import search_figure, write_report
from jax_adaptive.cli.run import plan_note
from jax_adaptive.data import synthetic_sequences
from jax_adaptive.errors import OptimizerStepOutOfMemory
from jax_adaptive.testing import FaultInjector


def _compiles(line, before):
    """The number just before ``before`` in a printed line."""
    return int(line.split(before)[0].split()[-1])


def test_default_job_searches_accumulates_evaluates_and_learns(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jax_adaptive.train", "--updates", "12", "--eval-every", "5",
         "--plan-cache", str(tmp_path / "plans.json"), "--workdir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    # A CPU with no --memory-limit simulates a small device, and says how to turn it off.
    assert lines[0].startswith("simulating a device of ") and "--no-simulated-device" in lines[0]
    micro, steps = (int(x) for x in lines[1].split("micro-batch ")[1].split()[:3:2])
    assert lines[1].startswith("plan: ") and steps > 1 and micro * steps >= 256, lines[1]
    said = lines[0].split()[4]  # the plan line says the simulated device too
    assert lines[1].endswith(f"; a simulated device of {said} MB"), lines[1]
    assert "; objective least_padding (auto: 12 updates, fewer than 1000); " in lines[1]
    searched = _compiles(lines[1], " size")
    assert searched >= 2 and "plan cache" not in lines[1]  # a search, not a cached plan
    updates = [line for line in lines if line.startswith("update")]
    losses = [float(line.split("loss")[1].split()[0]) for line in updates]
    assert len(losses) == 12 and "train_accuracy" in updates[0]
    assert losses[-1] < 0.7 * losses[0], "the loss must visibly fall"
    held_out = [line for line in lines if line.startswith("held-out after update")]
    assert [int(line.split()[3].rstrip(":")) for line in held_out] == [5, 10, 12]
    summary = lines[-1]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    compiles = sum(p["compiles"] for p in plan["plans"])  # every compile of the run
    assert compiles >= searched
    assert summary.startswith(f"summary: plan {micro} x {steps}, {compiles} compiles, ")
    assert "held-out loss" in summary and "1024 examples" in summary
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
               if x]  # fmt: skip
    mean = 256 * len(metrics) / sum(m["seconds"] for m in metrics)  # over the run
    steady = [b for a, b in itertools.pairwise(metrics) if a["compiles"] == b["compiles"]]
    rate = 256 * len(steady) / sum(m["seconds"] for m in steady)  # after the first, no compile
    assert f"{rate:.0f} examples/s steady ({len(steady)} updates that compiled nothing; " \
        f"{mean:.0f} over all 12)" in summary  # fmt: skip
    assert summary.endswith(f"held-out loss {metrics[-1]['eval_loss']:.4f} accuracy "
                            f"{metrics[-1]['eval_accuracy']:.3f} (1024 examples)")  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--no-simulated-device", "--no-simulated-device"),
        ("--data-parallel", "--data-parallel: each device's whole memory"),  # issue 40
    ],
)
def test_no_simulated_device_trains_the_whole_batch_at_once_and_says_so(flag, says, capsys):
    assert main([flag, "--updates", "1", "--eval-every", "0", "--target-batch-size", "32",
                 "--no-plan-cache", "--no-progress"]) == 0  # fmt: skip
    plan = capsys.readouterr().out.splitlines()[0]
    assert plan.startswith("plan: micro-batch 32 x 1 ") and f"no simulated device ({says})" in plan


def test_memory_limit_shrinks_the_micro_batch(capsys):
    assert main(["--memory-limit", "4MB", "--updates", "1", "--target-batch-size", "64"]) == 0
    plan = capsys.readouterr().out.splitlines()[0]
    size = int(plan.split("micro-batch ")[1].split()[0])
    assert 1 <= size < 64 and plan.endswith("; a simulated device of 4.00 MB (--memory-limit)")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5kB", 1500), ("42", 42), (" 2 mib ", 2**21)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "8 GiBs", "-5MB", "0.1", "1.5", "1.0001kB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(text)


def test_bad_flags_give_one_line_errors(capsys):
    assert main(["--memory-limit", "lots"]) == 2
    err = capsys.readouterr().err
    assert "argument --memory-limit: cannot read 'lots' as a memory size" in err
    assert err.count("\n") == 1
    assert main(["--target-batch-size", "0"]) == 2
    assert "--target-batch-size 0 must be a positive int" in capsys.readouterr().err
    assert main(["--memory-limit", "1.5"]) == 2  # was 1 byte
    assert "is 1.5 bytes, not a whole number" in capsys.readouterr().err


def test_the_report_skips_trials_without_a_numeric_estimate(tmp_path):
    train(TrainConfig(model="mlp", target_batch_size=8, updates=1, progress=False,
                      plan_cache=False, workdir=str(tmp_path)), out=io.StringIO())  # fmt: skip
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["plans"][0]["search_log"] += [
        {"size": 4, "fits": True, "estimated_bytes": "n/a"},
        {"size": "x", "fits": False, "estimated_bytes": 10},
        "not a trial",
    ]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert [p.name for p in write_report(tmp_path)] == ["search_trace.png", "loss.png"]
    (tmp_path / "plan.json").write_text("[1, 2")
    assert report_main([str(tmp_path)]) == 2  # a damaged plan.json: one line, no traceback


def _compiled_programs(run):
    """``run()``'s result and the programs XLA compiled meanwhile, by name, as JAX reports
    each compile (its ``backend_compile_duration`` event: one per program compiled, a hit of
    the session's persistent compilation cache included)."""
    names = []

    def listen(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        return run(), collections.Counter(names)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_a_resume_or_a_second_run_compiles_only_the_programs_its_update_runs(tmp_path, capsys):
    flags = ["--model", "mlp", "--target-batch-size", "64", "--eval-every", "0", "--no-progress",
             "--checkpoint-every", "1", "--plan-cache", str(tmp_path / "plans.json")]  # fmt: skip
    first, compiled = _compiled_programs(
        lambda: main([*flags, "--updates", "2", "--workdir", str(tmp_path / "run")])
    )
    out = capsys.readouterr().out.splitlines()
    assert first == 0 and "measured in 2 compiles" in out[0], out[0]  # the simulated device
    searched = _compiles(out[1], " size")
    assert compiled["jit(program)"] == 2 + searched, compiled  # the probe's two, the search's
    runs = {
        "resume": [*flags, "--updates", "3", "--workdir", str(tmp_path / "run"), "--resume"],
        "second run": [*flags, "--updates", "1", "--workdir", str(tmp_path / "again")],
    }
    for name, argv in runs.items():
        status, compiled = _compiled_programs(lambda argv=argv: main(argv))
        out = capsys.readouterr().out.splitlines()
        assert status == 0, name
        # The update's own programs, once each: a micro-step and the optimizer step. The
        # simulated device's two compiles and the search's are not made again.
        assert compiled["jit(program)"] <= 1 and compiled.total() <= 2, (name, compiled)
        assert set(compiled) <= {"jit(program)", "jit(optimizer_step)"}, (name, compiled)
        assert "measured by an earlier run of this job, from the plan cache" in out[0], out[0]
        assert "; 0 sizes compiled in " in out[1], out[1]
        # The summary counts what happened: the plan cache's plan, no search.
        assert re.search(r", 1 compile \(the plan from the plan cache\), [0-9.]+s planning "
                         r"\([0-9.]+s the plan from the plan cache, no search; [0-9.]+s in 1 "
                         r"update that compiled\), ", out[-1]), out[-1]  # fmt: skip


def test_the_report_after_a_resume_shows_the_first_runs_search_readably(tmp_path):
    import matplotlib.pyplot as plt

    flags = ["--model", "mlp", "--target-batch-size", "512", "--memory-limit", "3.5MB",
             "--multiple-of", "32", "--eval-every", "0", "--no-progress", "--workdir",
             str(tmp_path)]  # fmt: skip
    assert main([*flags, "--updates", "1"]) == 0
    first = json.loads((tmp_path / "plan.json").read_text())["plans"][0]
    tried = {(t["size"], t["estimated_bytes"]) for t in first["search_log"]}
    assert len(tried) >= 3 and any(not t["fits"] for t in first["search_log"]), first
    assert main([*flags, "--updates", "2", "--resume"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    # The resume searched nothing (the workdir's plan cache): its log is one cached trial.
    resumed = plan["plans"][0]["search_log"]
    assert [t["decided_by"] for t in resumed] == ["plan cache"], resumed
    assert [p["search_log"] for r in plan["earlier_runs"] for p in r["plans"]] == [
        first["search_log"]
    ]
    assert [p.name for p in write_report(tmp_path)] == ["search_trace.png", "loss.png"]
    figure = search_figure(tmp_path)
    try:
        (panel,), zoom = figure.axes, figure.axes[0].child_axes
        assert panel.get_xscale() == "log"
        drawn = {(round(x), round(y * 1e6)) for c in panel.collections for x, y in c.get_offsets()}
        assert drawn == tried  # the resume's cached plan (of a size never measured): no point
        said = [t.get_text() for t in panel.get_legend().get_texts()]
        assert f"1-{len(first['search_log'])}: the first run ({first['compiles']} compiles)" in said
        assert "run 2, resumed at update 1 (1 compile): the plan cache's plan, no search" in said
        assert not zoom  # 288 to 512: nothing crowds
        _assert_labels_apart(figure, len(tried))
    finally:
        plt.close(figure)


def _assert_labels_apart(figure, points):
    """Each point has a label, and no label overlaps another or covers the zoom inset."""
    renderer = figure.canvas.get_renderer()
    (panel,), zoom = figure.axes, figure.axes[0].child_axes
    boxes = [t.get_window_extent(renderer) for ax in (panel, *zoom) for t in ax.texts]
    assert len(boxes) == points
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    for inset in zoom:
        inset = inset.get_tightbbox(renderer)
        assert not any(t.get_window_extent(renderer).overlaps(inset) for t in panel.texts)


def test_the_report_zooms_on_crowded_sizes_with_labels_apart(tmp_path):
    import matplotlib.pyplot as plt

    # docs/cli.md's example (512 under 8 MB), its estimates as measured: 108, 109 and 116
    # lay on one another at the bottom left of a linear axis.
    sizes = ((512, 35253116), (116, 8478876), (108, 7937948), (109, 8005540))
    log = [{"size": s, "fits": s == 108, "estimated_bytes": b, "decided_by": "estimate"}
           for s, b in sizes]  # fmt: skip
    plan = {"bucket": None, "micro_batch_size": 103, "accumulation_steps": 5, "compiles": 5,
            "capacity": 8_000_000, "search_log": log}  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps({"plans": [plan], "search_seconds": 1.0}))
    figure = search_figure(tmp_path)
    try:
        (panel,), (zoom,) = figure.axes, figure.axes[0].child_axes
        assert panel.get_xscale() == "log"
        low, high = zoom.get_xlim()
        assert low < 108 and 116 < high < 512  # the neighbourhood of 108, not 512
        labelled = sorted(t.get_text() for t in zoom.texts)
        assert labelled == ["2", "3", "4"] and [t.get_text() for t in panel.texts] == ["1"]
        _assert_labels_apart(figure, 4)
    finally:
        plt.close(figure)


def test_the_reports_labels_of_points_on_one_another_are_moved_apart(tmp_path):
    import matplotlib.pyplot as plt

    # Only size 1 fits (nothing to zoom on); 200 to 202 lie on one another on a log axis.
    sizes = ((1, 1_000_000), (200, 9_000_000), (201, 9_010_000), (202, 9_020_000))
    log = [{"size": s, "fits": s == 1, "estimated_bytes": b} for s, b in sizes]
    (tmp_path / "plan.json").write_text(json.dumps({"plans": [{"search_log": log}]}))
    figure = search_figure(tmp_path)
    try:
        assert not figure.axes[0].child_axes
        _assert_labels_apart(figure, 4)
    finally:
        plt.close(figure)


_MOCKED = """
import sys
import tensorflow_datasets as tfds
from jax_adaptive.cli.main import main
with tfds.testing.mock_data(num_examples=96, policy=tfds.testing.MockPolicy.USE_CODE):
    sys.exit(main(sys.argv[1:]))
"""


def test_a_mocked_tfds_dataset_trains_from_thecli_command(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", _MOCKED, "--dataset", "tfds:mnist", "--model", "mlp",
         "--target-batch-size", "32", "--epochs", "2", "--no-progress",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 6  # 2 epochs of 96 examples in batches of 32
    assert all(np.isfinite(m["loss"]) for m in metrics)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--dataset", "imagenet"],
            "unknown dataset 'imagenet'; use 'synthetic', 'synthetic:N' or",
        ),
        (["--dataset", "tfds:mnist", "--data-dir", "/nonexistent"], "tfds build mnist"),
        (["--resume"], "--resume needs --workdir"),
        (["--target-tokens", "512"], "--target-tokens is for --model gpt"),
        (["--model", "gpt", "--dataset", "tfds:mnist"], "use --dataset synthetic"),
    ],
)
def test_bad_input_is_one_line_with_the_fix(flags, message, capsys):
    assert main([*flags, "--updates", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_workdir_of_another_run_is_refused(tmp_path, capsys):
    flags = [
        "--target-batch-size",
        "8",
        "--updates",
        "1",
        "--no-progress",
        "--workdir",
        str(tmp_path),
    ]
    assert main(flags) == 0
    assert main(flags) == 2
    assert "already holds checkpoints; pass --resume" in capsys.readouterr().err
    assert main([*flags, "--resume", "--seed", "1"]) == 2
    assert "of another training: --seed 0 there, 1 now. Resume" in capsys.readouterr().err


def test_a_gpt_checkpoint_of_another_stream_is_refused():
    sequences = synthetic_sequences(vocab_size=64, max_length=64, seed=0)
    sizes = {16: 32, 32: 16, 64: 8}
    with pytest.raises(ValueError, match="saved after 5 sequences of the stream, but drawing"):
        _stream(sequences, sizes, done=2, position=5)


def _losses(stdout):
    return [float(line.split("loss")[1].split()[0]) for line in stdout.splitlines()
            if line.startswith("update")]  # fmt: skip


def test_background_search_trains_from_an_eighth_as_the_search_first_and_stores_its_plan(
    tmp_path, capsys
):
    flags = ["--target-batch-size", "128", "--updates", "6", "--eval-every", "0",
             "--no-progress", "--seed", "3"]  # fmt: skip
    cache = str(tmp_path / "plans.json")
    assert main([*flags, "--workdir", str(tmp_path / "first"), "--no-plan-cache"]) == 0
    capsys.readouterr()
    assert main([*flags, "--workdir", str(tmp_path / "behind"), "--plan-cache", cache,
                 "--background-search"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    plan = next(line for line in lines if line.startswith("plan: "))
    assert plan.startswith(
        "plan: micro-batch 16 x 8 accumulation steps = target batch 128; 1 size compiled in "
    )  # an eighth: fits the simulated device
    assert "; the search for the largest goes on beside training (--background-search)" in plan
    first, behind = (_metrics(tmp_path / run) for run in ("first", "behind"))
    assert behind[0]["micro_batch_size"] == 16 and first[0]["micro_batch_size"] > 16
    # Every plan trains the same: the losses of the run that searched first.
    np.testing.assert_allclose([m["loss"] for m in behind], [m["loss"] for m in first], 1e-5)
    # Its end is told once: the update that took its plan, or after the last update.
    ended = [m["search_ended"] for m in behind if "search_ended" in m]
    after = [line for line in lines if line.startswith("the search beside training ended")]
    assert len(ended) + len(after) == 1, (ended, after)
    assert all(text.startswith("search ") and "compiles" in text for text in ended)
    assert main([*flags, "--plan-cache", cache, "--background-search"]) == 0
    plan = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plan"))
    size = first[0]["micro_batch_size"]
    assert plan.startswith(f"plan: micro-batch {size} x ") and "from the plan cache" in plan


def test_data_parallel_plans_per_device_resumes_and_trains_as_one_device(tmp_path, capsys):
    flags = ["--target-batch-size", "256", "--memory-limit", "1.6MB", "--objective", "max"]
    flags += ["--eval-every", "0"]
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
    }
    workdir = ["--data-parallel", "--workdir", tmp_path, "--checkpoint-every", "2"]
    workdir += ["--plan-cache", tmp_path / "plans.json"]  # the resumed run searches no more
    workdir += ["--compilation-cache", tmp_path / "xla"]  # nor compiles again
    runs = [
        subprocess.run(cli_command(*flags, *workdir, *more), env=env, capture_output=True,
                       text=True, timeout=300, check=True).stdout
        for more in (["--updates", "2"], ["--updates", "3", "--resume"])
    ]  # fmt: skip
    assert main([*flags, "--updates", "3", "--no-progress", "--no-plan-cache"]) == 0
    single = capsys.readouterr().out
    one = int(single.splitlines()[0].split("micro-batch ")[1].split()[0])
    plan = runs[0].splitlines()[0]
    per_device = int(re.search(r"; (\d+) per device on 8", plan).group(1))
    # The same cap, per device: never more than one device fits, nearly as much (the
    # per-device program has temporaries of its own: 57 KB more at 14 for this CNN).
    assert 0.9 * one <= per_device <= one
    assert plan.endswith("; a simulated device of 1.60 MB (--memory-limit)"), plan
    assert plan.startswith(f"plan: micro-batch {8 * per_device} x "), (plan, one)
    assert "resumed at update 2" in runs[1].splitlines()[0]
    np.testing.assert_allclose(_losses(runs[0]) + _losses(runs[1]), _losses(single), rtol=1e-4)


def test_both_paths_write_one_plan_shape_that_the_report_reads(tmp_path):
    runs = {
        "image": TrainConfig(target_batch_size=8, updates=2),
        "gpt": TrainConfig(model="gpt", max_length=16, target_tokens=64, updates=2),
    }
    plans = {}
    for name, config in runs.items():
        workdir = tmp_path / name
        config = dataclasses.replace(config, progress=False, plan_cache=False,
                                     workdir=str(workdir))  # fmt: skip
        train(config, out=io.StringIO())
        assert [p.name for p in write_report(workdir)] == ["search_trace.png", "loss.png"]
        plans[name] = json.loads((workdir / "plan.json").read_text())
        metrics = (workdir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(m)["update"] for m in metrics] == [1, 2]
    image, gpt = plans["image"], plans["gpt"]
    assert image.keys() == gpt.keys() == {"config", "plans", "search_seconds"}
    assert image["config"]["model"] == "cnn" and gpt["config"]["model"] == "gpt"
    assert [p["bucket"] for p in image["plans"]] == [None]
    assert [p["bucket"] for p in gpt["plans"]] == [16]
    for plan in image["plans"] + gpt["plans"]:
        assert plan.keys() == image["plans"][0].keys()
        assert plan["search_log"] and plan["search_log"][0].keys() >= {"size", "fits"}
        assert plan["accumulation_steps"] == -(-plan["examples_per_update"] //
                                                plan["micro_batch_size"])  # fmt: skip
    assert image["plans"][0]["micro_batch_size"] == 8


def test_held_out_split_of_a_mocked_tfds_dataset_is_evaluated(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", _MOCKED, "--dataset", "tfds:mnist", "--model", "mlp",
         "--target-batch-size", "32", "--updates", "5", "--eval-every", "2", "--no-progress",
         "--no-plan-cache", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = [m for m in metrics if "eval_loss" in m]
    assert [m["update"] for m in evaluated] == [2, 4, 5]  # every 2 updates and the last
    for m in evaluated:  # the mocked test split: its 96 examples, each counted once
        assert m["eval_examples"] == 96 and np.isfinite(m["eval_loss"])
        assert 0.0 <= m["eval_accuracy"] <= 1.0 and 1 <= m["eval_batch_size"] <= 96
    assert all("train_accuracy" in m and "accuracy" not in m for m in metrics)
    summary = result.stdout.splitlines()[-1]
    assert f"held-out loss {evaluated[-1]['eval_loss']:.4f}" in summary


def test_a_users_own_model_trains_and_evaluates_from_thecli_command(tmp_path, capsys):
    # tests/user_model.py: a linen CNN written as the Flax examples write one, and a
    # per-example cross-entropy (the tests folder is on sys.path, as a user's package is)
    flags = ["--model", "user_model:make_model", "--updates", "8", "--eval-every", "4"]
    flags += ["--target-batch-size", "128", "--multiple-of", "8", "--no-progress"]
    assert main([*flags, "--no-plan-cache", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    micro, steps = (int(x) for x in out[1].split("micro-batch ")[1].split()[:3:2])
    assert micro % 8 == 0 and steps > 1, out[1]  # --multiple-of, on the simulated device
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["update"] for m in metrics if "eval_loss" in m] == [4, 8]
    assert metrics[-1]["eval_loss"] < 0.8 * metrics[3]["eval_loss"], "held-out loss must fall"
    assert json.loads((tmp_path / "plan.json").read_text())["config"]["model"] == flags[1]


def test_a_users_nnx_model_trains_evaluates_and_checkpoints_from_thecli_command(tmp_path, capsys):
    """Issue 40: --model took linen modules only. tests/user_model.py's NnxCNN is written as
    the Flax NNX MNIST tutorial writes one: BatchNorm, and a Dropout taking rngs at call."""
    flags = ["--model", "user_model:make_nnx_model", "--target-batch-size", "64"]
    flags += ["--updates", "2", "--eval-every", "2", "--no-progress", "--no-plan-cache"]
    assert main([*flags, "--workdir", str(tmp_path)]) == 0
    plan = capsys.readouterr().out.splitlines()[1]
    # BatchNorm statistics over ghost batches of 32 on the simulated device: 32 x 2.
    assert plan.startswith("plan: micro-batch 32 x 2 accumulation steps = target batch 64; ")
    assert "; BatchNorm over ghost batches of 32" in plan, plan
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["update"] for m in metrics] == [1, 2] and np.isfinite(metrics[1]["eval_loss"])
    assert (tmp_path / "checkpoints" / "2").is_dir()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("user_model:mean_loss_model", "the loss must return one value per example"),
        ("user_model:not_a_pair", "the factory must return (a flax.linen or flax.nnx Module, "),
        ("user_model:nothing", "user_model has no callable 'nothing'"),
        ("no_such_module:make", "cannot import no_such_module (ModuleNotFoundError"),
        ("user_model:", "must be a zoo model or package.module:factory"),
        ("lenet", "is neither a zoo model"),
        (
            "user_model:make_model --ghost-batch-size 8",
            "models with BatchNorm statistics; --model user_model:make_model has none",
        ),
    ],
)
def test_a_users_model_that_breaks_the_contract_is_one_line_naming_the_flag(spec, message,
                                                                            capsys):  # fmt: skip
    spec, *more = spec.split()
    argv = ["--model", spec, *more, "--updates", "1", "--no-progress", "--no-plan-cache"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert message in err and (more or err.startswith(f"error: --model {spec!r}")), err


def test_a_users_failing_factory_is_one_line_that_keeps_its_traceback():
    config = TrainConfig(model="user_model:failing_model", updates=1, progress=False)
    with pytest.raises(ValueError, match="the factory raised ZeroDivisionError") as info:
        train(dataclasses.replace(config, plan_cache=False), out=io.StringIO())
    cause = info.value.__cause__  # the user's own error, where it was raised
    assert isinstance(cause, ZeroDivisionError), repr(cause)
    assert traceback.extract_tb(cause.__traceback__)[-1].name == "failing_model"
    with pytest.raises(ValueError, match="cannot import no_such_module") as info:
        check_config(TrainConfig(model="no_such_module:make"))
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--multiple-of", "0"], "--multiple-of 0 must be a positive int"),
        (["--eval-every", "-1"], "--eval-every -1 must be an int, 0 or more"),
        (["--objective", "fastest"], "argument --objective: invalid choice"),
        (["--background-search", "--model", "gpt"], "--background-search is for image models"),
        (["--background-search", "--micro-batch-size", "8"], "it needs --micro-batch-size auto"),
    ],
)
def test_new_flags_are_checked_before_training(flags, message, capsys):
    assert main([*flags, "--updates", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-schedule", "0:32,0:128"], "must start after update 0"),
        (["--batch-schedule", "1:32"], "must start at update 0"),
        (["--batch-schedule", "0:32,3:0"], "its size must be a positive int"),
        (["--batch-schedule", "0:32,4:x"], "'4:x' is not UPDATE:SIZE"),
        (["--batch-schedule", "0:8", "--model", "gpt"], "--batch-schedule is for image models"),
        (["--batch-schedule", "0:8,2:16", "--micro-batch-size", "32"], "schedule 16"),
    ],
)
def test_a_bad_batch_schedule_is_one_line_naming_the_flag_before_training(flags, message, capsys):
    assert main([*flags, "--updates", "1", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and err.count("\n") == 1, (out, err)
    assert "--batch-schedule" in err, err


def test_a_batch_schedule_grows_the_target_and_resumes_mid_schedule(tmp_path, capsys):
    flags = ["--batch-schedule", "0:16,2:64", "--eval-every", "0", "--no-progress",
             "--no-plan-cache", "--workdir", str(tmp_path), "--checkpoint-every", "3"]  # fmt: skip
    assert main([*flags, "--updates", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("plan: ") and "batch schedule 0:16,2:64" in out[1], out[1]
    updates = [line for line in out if line.startswith("update")]
    assert [line.split("of target batch ")[1] for line in updates] == ["16", "16", "64"]
    assert "target batch 16 -> 64" in out[-1], out[-1]
    assert main([*flags, "--updates", "4", "--resume"]) == 0  # from the checkpoint of update 3
    assert "resumed at update 3" in capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["update"], m["target_batch_size"]) for m in lines] == [
        (1, 16), (2, 16), (3, 64), (4, 64)
    ]  # fmt: skip
    assert all(m["micro_batch_size"] * m["accumulation_steps"] >= m["examples"] for m in lines)


@pytest.mark.parametrize(
    ("module", "argv", "extra"),
    [
        ("tensorflow_datasets", ["--dataset", "tfds:mnist", "--no-progress"], "tfds"),
        ("matplotlib", None, "report"),  # python -m jax_adaptive.report WORKDIR
        (
            "tensorboardX",
            ["--tensorboard", "--workdir", "never-made", "--no-progress"],
            "tensorboard",
        ),
    ],
    ids=["tfds", "report", "tensorboard"],
)
def test_a_missing_extra_is_one_line_saying_what_to_install(module, argv, extra, tmp_path,
                                                            monkeypatch, capsys):  # fmt: skip
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    if argv is None:
        (tmp_path / "plan.json").write_text('{"plans": []}')  # a run's workdir
        assert report_main([str(tmp_path)]) == 2
    else:
        monkeypatch.chdir(tmp_path)
        assert main(argv) == 2
        assert not list(tmp_path.iterdir())  # refused before anything was made
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"pip install 'jax_adaptive[{extra}]'" in err, err


def _metrics(workdir):
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_and_its_resume_in_one_process_and_one_second_write_two_event_files(tmp_path):
    """``train`` called twice in one process (as the test below does): with the process id
    alone in the name, the resume's file replaced the run's when both began in the same
    second, and TensorBoard read back the resumed updates alone (1 suite run in 6)."""
    from jax_adaptive.cli.scalars import ScalarWriter

    for start in (0, 2):  # microseconds apart: the same second, nearly always
        with ScalarWriter(tmp_path, learning_rate=0.1, start=start) as writer:
            writer.write({"update": start + 1, "loss": 1.0})
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2


def test_tensorboard_writes_the_scalars_of_flax_examples_that_tensorboard_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = ["--model", "mlp", "--target-batch-size", "64", "--learning-rate", "0.01",
             "--eval-every", "2", "--checkpoint-every", "2", "--no-progress", "--tensorboard",
             "--workdir", str(tmp_path)]  # fmt: skip
    assert main([*flags, "--updates", "3"]) == 0
    # Resumed from update 2 (as after a kill before update 3's checkpoint): update 3 is
    # trained again, and its first values (an evaluation at the last update) must go.
    shutil.rmtree(tmp_path / "checkpoints" / "3")
    assert main([*flags, "--updates", "4", "--resume"]) == 0
    lines = _metrics(tmp_path)  # the reference: metrics.jsonl
    assert [line["update"] for line in lines] == [1, 2, 3, 4]
    events = EventAccumulator(str(tmp_path))  # TensorBoard's own reader
    events.Reload()

    def read(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    def expected(key, value=None):
        return [(line["update"], pytest.approx(line[key] if value is None else value, rel=1e-6))
                for line in lines if key in line]  # fmt: skip

    assert set(events.Tags()["scalars"]) == {
        "train_loss", "train_accuracy", "train_learning_rate", "eval_loss", "eval_accuracy",
        "micro_batch_size", "accumulation_steps", "examples_per_update", "steps_per_second",
        "examples_per_second",
    }  # fmt: skip
    assert read("train_loss") == expected("loss")
    assert read("train_accuracy") == expected("train_accuracy")
    assert read("train_learning_rate") == expected("loss", 0.01)
    assert read("micro_batch_size") == expected("micro_batch_size")
    assert read("eval_loss") == expected("eval_loss") and [s for s, _ in read("eval_loss")] == [
        2,
        4,
    ]
    assert read("eval_accuracy") == expected("eval_accuracy")
    assert read("steps_per_second") == [(x["update"], pytest.approx(1 / x["seconds"], rel=1e-6))
                                        for x in lines]  # fmt: skip


def test_a_scheduled_run_counts_every_compile_says_its_steady_speed_and_each_plan_change(
    tmp_path, capsys
):
    flags = ["--batch-schedule", "0:16,3:64", "--updates", "6", "--eval-every", "0"]
    assert main([*flags, "--no-progress", "--no-plan-cache", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    searched = _compiles(out[1], " size")  # the plan line: the first search's
    metrics = _metrics(tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    compiles = sum(p["compiles"] for p in plan["plans"])
    assert compiles == metrics[-1]["compiles"] > searched  # the schedule's search counts too
    summary = out[-1]
    assert f", {compiles} compiles, " in summary, summary
    # A line says the plan changed, before the update that changed it.
    changed = metrics[3]["compiles"] - metrics[2]["compiles"]
    was = f"{metrics[2]['micro_batch_size']} x {metrics[2]['accumulation_steps']} = 16"
    note = (f"plan changed at update 4: micro-batch {metrics[3]['micro_batch_size']} x "
            f"{metrics[3]['accumulation_steps']} = target batch 64 (was {was}: the batch "
            f"schedule; {changed} size{'s' * (changed != 1)} compiled)")  # fmt: skip
    assert out[out.index(note) + 1].startswith("update    4 "), out
    assert [x for x in out if x.startswith("plan changed")] == [note]
    # Steady: the updates after the first that compiled nothing, apart from the others.
    steady = [b for a, b in itertools.pairwise(metrics) if a["compiles"] == b["compiles"]]
    assert changed and len(steady) == 4, metrics
    rate = sum(m["examples"] for m in steady) / sum(m["seconds"] for m in steady)
    mean = sum(m["examples"] for m in metrics) / sum(m["seconds"] for m in metrics)
    says = f"{rate:.0f} examples/s steady (4 updates that compiled nothing; {mean:.0f} over all 6)"
    assert says in summary, summary  # (no timing asserted: a compile of 0.1 s is noise)


def _trainer_that(monkeypatch, update, do):
    """Makes the image path's trainer call ``do(trainer, state)`` before its ``update``-th step."""
    calls = [0]

    class Trainer(images.AdaptiveTrainer):
        def step(self, state, batch, **kwargs):
            calls[0] += 1
            if calls[0] == update:
                do(self, state)
            return super().step(state, batch, **kwargs)

    monkeypatch.setattr(images, "AdaptiveTrainer", Trainer)
    return calls


def test_a_plan_that_shrinks_after_running_out_of_memory_says_so(monkeypatch, capsys):
    def fail_twice(trainer, state):  # the fused last program, then the size itself
        trainer.fault_hook = FaultInjector(executions={1, 2})

    _trainer_that(monkeypatch, 3, fail_twice)
    flags = ["--target-batch-size", "32", "--no-simulated-device", "--updates", "4"]
    assert main([*flags, "--eval-every", "0", "--no-progress", "--no-plan-cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    (note,) = [line for line in out if line.startswith("plan changed")]
    said = re.fullmatch(
        r"plan changed at update 3: micro-batch (\d+) x (\d+) = target batch 32 \(was 32 x 1 = "
        r"32: a smaller micro-batch after running out of memory; \d+ sizes? compiled\)", note
    )  # fmt: skip
    assert said, note
    micro, steps = int(said[1]), int(said[2])
    assert micro < 32 <= micro * steps
    assert out[out.index(note) + 1].startswith("update    3 "), out
    assert out[out.index(note) + 1].endswith(f"micro-batch {micro}"), out


@pytest.mark.parametrize(
    ("before", "line", "says"),
    [
        (
            (8, 4, 32),
            {"micro_batch_size": 8, "accumulation_steps": 8, "examples": 64},
            "(was 8 x 4 = 32: the batch schedule; 1 size compiled)",
        ),
        (
            (8, 4, 32),
            {"micro_batch_size": 4, "accumulation_steps": 8, "examples": 32},
            "(was 8 x 4 = 32: a smaller micro-batch after running out of memory; 1 size compiled)",
        ),
        (
            (8, 4, 32),
            {"micro_batch_size": 16, "accumulation_steps": 2, "examples": 32},
            "(was 8 x 4 = 32: a larger micro-batch fits; 1 size compiled)",
        ),
        ((8, 4, 32), {"micro_batch_size": 8, "accumulation_steps": 4, "examples": 32}, None),
        (None, {"micro_batch_size": 8, "accumulation_steps": 4, "examples": 32}, None),
        (
            (4, 8, 32),
            {
                "micro_batch_size": 16,
                "accumulation_steps": 2,
                "examples": 32,
                "search_ended": "search 1.2 s, 4 compiles (2.1x one compile of 16)",
            },
            "(was 4 x 8 = 32: the search beside training ended, search 1.2 s, 4 compiles (2.1x "
            "one compile of 16); 1 size compiled)",
        ),
    ],
    ids=["schedule", "shrink", "grow", "same", "first", "background search"],
)
def test_plan_note_says_why_the_plan_changed(before, line, says):
    note = plan_note(before, {"update": 5, **line}, compiled=1)
    assert note == says if says is None else note.endswith(says), note


def test_an_optimizer_step_out_of_memory_is_retried_and_the_run_goes_on(tmp_path, monkeypatch,
                                                                        capsys):  # fmt: skip
    flags = ["--model", "mlp", "--target-batch-size", "8", "--updates", "5", "--eval-every", "0"]
    flags += ["--no-progress", "--no-plan-cache"]
    assert main([*flags, "--workdir", str(tmp_path / "whole")]) == 0

    def out_of_memory(trainer, state):
        raise OptimizerStepOutOfMemory(state)  # its state: the update's intact start

    calls = _trainer_that(monkeypatch, 3, out_of_memory)
    assert main([*flags, "--workdir", str(tmp_path / "retried")]) == 0
    assert calls[0] == 6  # update 3 ran twice
    whole, retried = _metrics(tmp_path / "whole"), _metrics(tmp_path / "retried")
    assert [m["update"] for m in retried] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in retried] == pytest.approx([m["loss"] for m in whole], rel=1e-6)


@pytest.mark.parametrize(
    ("error", "status", "says"),
    [
        (
            ValueError("a batch the trainer refuses"),
            2,
            "error: training stopped by ValueError: a batch the trainer refuses",
        ),
        (KeyboardInterrupt(), 130, "interrupted"),
    ],
    ids=["error", "ctrl-c"],
)
def test_a_stopped_run_checkpoints_its_last_update_and_resumes_as_if_uninterrupted(
    tmp_path, monkeypatch, capsys, error, status, says
):
    flags = ["--model", "mlp", "--target-batch-size", "8", "--eval-every", "0"]
    flags += ["--no-progress", "--no-plan-cache", "--checkpoint-every", "10"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert main([*flags, "--updates", "6", "--workdir", str(whole)]) == 0

    def stop(trainer, state):
        raise error

    with monkeypatch.context() as patch:
        _trainer_that(patch, 4, stop)
        capsys.readouterr()
        assert main([*flags, "--updates", "6", "--workdir", str(stopped)]) == status
    out, err = capsys.readouterr()
    assert "stopped after update 3: checkpointed it; --resume goes on from there" in out, out
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["3"]
    assert err == says + "\n", err
    assert main([*flags, "--updates", "6", "--workdir", str(stopped), "--resume"]) == 0
    assert "resumed at update 3" in capsys.readouterr().out
    assert [m["update"] for m in _metrics(stopped)] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(jax.tree.leaves(checkpointed_params(whole, 6)),
                    jax.tree.leaves(checkpointed_params(stopped, 6)), strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_micro_batch_without_whole_ghost_batches_is_refused(capsys):
    """Issue 29: the ghost batch is the run's; a plan that would change it is refused (the
    same training at two plans: the next test, through a user's ResNet)."""
    flags = ["--model", "resnet-tiny", "--target-batch-size", "64", "--updates", "2"]
    assert main([*flags, "--micro-batch-size", "16"]) == 2  # the default ghost batch: 32
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert "--micro-batch-size 16 holds no whole number of BatchNorm's ghost batches of 32" in err


def test_a_users_batch_norm_model_written_for_pmap_trains_the_same_at_every_plan(
    tmp_path, capsys, monkeypatch
):
    """Issue 29: a ResNet as Flax's ImageNet example writes one (BatchNorm(axis_name=
    "batch"), examples/imagenet_resnet.py) runs unchanged, with ghost batches by default."""
    monkeypatch.syspath_prepend(
        str(pathlib.Path(__file__).parents[1])
    )  # as `python -m` from the repo
    flags = ["--model", "examples.imagenet_resnet:make_tiny", "--target-batch-size", "128",
             "--updates", "2", "--eval-every", "0", "--no-progress", "--no-plan-cache"]  # fmt: skip
    losses = {}
    for micro in (32, 128):
        workdir = tmp_path / str(micro)
        assert main([*flags, "--micro-batch-size", str(micro), "--workdir", str(workdir)]) == 0
        assert "BatchNorm over ghost batches of 32" in capsys.readouterr().out
        losses[micro] = [m["loss"] for m in _metrics(workdir)]
    np.testing.assert_allclose(losses[32], losses[128], rtol=1e-5, atol=1e-6)
    assert main([*flags, "--micro-batch-size", "48"]) == 2  # no whole ghost batches: refused
    assert "or --ghost-batch-size 0 (statistics per micro-batch" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spec", "more", "status", "says"),
    [
        ("user_model:three_classes", [], 2, "the loss of update 1 is nan"),
        ("mlp", ["--optimizer", "sgd", "--learning-rate", "1e30"], 2, "the loss of update 2 is"),
        ("user_model:three_classes", ["--allow-nonfinite"], 0, None),
        ("user_model:exits", [], 2, "the factory raised SystemExit: 0"),
    ],
    ids=["nan", "diverges", "nan-allowed", "sys.exit"],
)
def test_a_run_that_did_not_train_is_an_error(spec, more, status, says, tmp_path, capsys):
    """Issue 32, fault 13: a non-finite loss, or a factory's exit, is not a run that trained."""
    flags = ["--model", spec, "--target-batch-size", "32", "--updates", "3", "--eval-every", "0"]
    flags += ["--no-progress", "--no-plan-cache", "--workdir", str(tmp_path), *more]
    assert main(flags) == status
    out, err = capsys.readouterr()
    if says is None:
        assert len(_metrics(tmp_path)) == 3
        return
    assert err.count("\n") == 1 and says in err, err
    # Logged: the updates before it; checkpointed: nothing (--checkpoint-every 10).
    assert all(np.isfinite(m["loss"]) for m in _metrics(tmp_path))
    assert len(_metrics(tmp_path)) == (spec == "mlp")
    assert not any((tmp_path / "checkpoints").iterdir()) and "checkpoint" not in out, out


def test_a_workdir_through_a_missing_directory_creates_nothing_else(tmp_path, monkeypatch):
    """Issue 32: ``--workdir sub/../../wd`` made an empty ``sub/`` outside the workdir."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    flags = ["--model", "mlp", "--target-batch-size", "8", "--updates", "1", "--eval-every", "0"]
    assert main([*flags, "--no-progress", "--workdir", "sub/../../wd"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "wd"]
    assert not any((tmp_path / "cwd").iterdir())
    assert (tmp_path / "wd" / "plan.json").exists() and (tmp_path / "wd" / "plans.json").exists()


_SMALL = ["--model", "mlp", "--target-batch-size", "8", "--no-progress", "--no-plan-cache"]
_SMALL += ["--eval-every", "0"]


def test_a_held_workdir_is_refused_at_once_while_the_run_holding_it_completes(tmp_path, capsys):
    workdir = tmp_path / "run"
    holder = subprocess.Popen(
        cli_command(*_SMALL, "--updates", "40", "--workdir", workdir),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (workdir / ".lock").exists() and holder.poll() is None:
            assert time.time() < deadline, "the first run never took the workdir"
            time.sleep(0.01)
        assert main([*_SMALL, "--updates", "2", "--workdir", str(workdir)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is in use by process {holder.pid} on host " in err, err
        _, err = holder.communicate(timeout=240)
    finally:
        holder.kill()
        holder.communicate()  # its pipes closed, whatever happened
    assert holder.returncode == 0, err
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [line["update"] for line in lines] == list(range(1, 41))
    assert not (workdir / ".lock").exists()  # released


def _dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(
    ("host", "pid", "says"),
    [
        ("here", "alive", "wait for that run to end, or use another --workdir."),
        ("elsewhere.invalid", "dead", "(if it has ended, remove "),
        ("here", None, "(if it has ended, remove "),  # half written: its writer was killed
    ],
)
def test_a_workdir_held_by_a_live_or_unknown_run_is_refused_before_anything_is_written(
    host, pid, says, tmp_path, capsys
):
    import socket

    holder = {"pid": os.getpid() if pid == "alive" else _dead_pid(), "since": "then",
              "host": socket.gethostname() if host == "here" else host}  # fmt: skip
    (tmp_path / ".lock").write_text(json.dumps(holder) if pid else "")
    assert main([*_SMALL, "--updates", "1", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # nothing written


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, capsys):
    import socket

    holder = {"pid": _dead_pid(), "host": socket.gethostname(), "since": "then"}
    (tmp_path / ".lock").write_text(json.dumps(holder))
    with pytest.warns(UserWarning, match=f"from process {holder['pid']}, which no longer runs"):
        assert main([*_SMALL, "--updates", "1", "--workdir", str(tmp_path)]) == 0
    assert not (tmp_path / ".lock").exists()
    assert (tmp_path / "plan.json").exists() and not list(tmp_path.glob(".*.tmp"))


_REPORTS_JAX = """
import runpy, sys
try:
    runpy.run_module("jax_adaptive.train", run_name="__main__", alter_sys=True)
finally:
    print("jax imported:", "jax" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--help"], "(default: 256)"),
        (["--target-batch-size", "-5"], "error: --target-batch-size -5 must be a positive int"),
        (["--model", "no_such_module:factory"], "cannot import no_such_module"),
        (["--workdir", "FILE"], "is a file; it must name a directory"),
        (["--tensorboard"], "--tensorboard writes its event files into --workdir"),
    ],
)
def test_help_and_a_bad_flag_answer_before_jax_is_imported(flags, says, tmp_path):
    """Issue 40: --help took 7.2 s, a bad flag 12-18 s: JAX and the models came first."""
    (tmp_path / "FILE").touch()
    result = subprocess.run([sys.executable, "-c", _REPORTS_JAX, *flags], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == (0 if flags == ["--help"] else 2), result.stderr
    assert says in result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == "jax imported: False", result.stderr
    assert len(result.stderr.splitlines()) == (1 if flags == ["--help"] else 2)


def test_help_shows_every_flags_default():
    from jax_adaptive.cli.main import _parser

    parser = _parser()
    for action in parser._actions:
        if action.option_strings and action.nargs != 0:  # a switch's default is its absence
            help_text = parser._get_formatter()._get_help_string(action)
            assert "default" in help_text, action.option_strings[0]


def test_objective_auto_times_the_plans_of_a_long_run_only():
    assert TrainConfig(updates=999).chosen_objective() == (
        "least_padding", "auto: 999 updates, fewer than 1000"
    )  # fmt: skip
    assert TrainConfig(updates=1000).chosen_objective()[0] == "throughput"
    assert TrainConfig(updates=5000, epochs=2).chosen_objective()[0] == "least_padding"
    assert TrainConfig(updates=5000, objective="max").chosen_objective() == ("max", None)
