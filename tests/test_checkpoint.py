"""Checkpoints: damage is detected and the newest intact checkpoint is used, with a warning.

The reference for a restored state is the host copy of the state that was saved.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jax_adaptive.cli.checkpoints import Checkpoints
from jax_adaptive.cli.main import main
from jax_adaptive.step import TrainState, multi_steps

RUN = {"seed": 0}
PER_UPDATE = 8


def state_at(update):
    params = {"w": jnp.arange(4096, dtype=jnp.float32) * (update + 1)}
    return TrainState(params, multi_steps(optax.sgd(1.0), 1).init(params), (), jax.random.key(0))


def saved(tmp_path, updates=(2, 4), max_to_keep=3, position=None):
    ckpt = Checkpoints(tmp_path / "ckpt", RUN, max_to_keep=max_to_keep,
                       examples_per_update=PER_UPDATE)  # fmt: skip
    for update in updates:
        ckpt.save(update, state_at(update), PER_UPDATE * update if position is None else position)
    ckpt.close()
    return Checkpoints(tmp_path / "ckpt", RUN, examples_per_update=PER_UPDATE)


def flip_bytes(step_dir, count=64):
    """Flips ``count`` bytes in the middle of the largest file of a step (its arrays)."""
    largest = max(
        (p for p in Path(step_dir).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    largest.write_bytes(bytes(data))


# Reading flipped bytes fails inside orbax's asyncio reader, whose thread may then call
# back into its loop after the loop closed: Python reports that "Exception ignored"
# after the test, whatever the library does. The tests assert what happens to the run.
ORBAX_LATE_CALLBACK = pytest.mark.filterwarnings(
    "ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning"
)


def assert_restored(ckpt, update):
    restored, position = ckpt.restore(state_at(0))
    assert position == PER_UPDATE * update
    np.testing.assert_array_equal(restored.params["w"], np.asarray(state_at(update).params["w"]))


def test_an_intact_checkpoint_restores_its_state_without_a_warning(tmp_path):
    ckpt = saved(tmp_path)
    assert_restored(ckpt, 4)
    ckpt.close()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(
            lambda step: flip_bytes(step), id="64 bytes flipped", marks=ORBAX_LATE_CALLBACK
        ),
        pytest.param(lambda step: shutil.rmtree(step / "state"), id="state missing"),
        pytest.param(lambda step: (shutil.rmtree(step), step.mkdir()), id="empty directory"),
        pytest.param(lambda step: (step / "meta" / "metadata").write_text("{"), id="bad metadata"),
    ],
)
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, damage):
    ckpt = saved(tmp_path)
    damage(tmp_path / "ckpt" / "4")
    with pytest.warns(UserWarning, match="checkpoint 4 .* is damaged"):
        assert_restored(ckpt, 2)
    assert ckpt.latest() == 2  # moved aside: a later save of update 4 is possible
    ckpt.save(4, state_at(4), PER_UPDATE * 4)
    ckpt.close()
    assert list((tmp_path / "ckpt-damaged").iterdir())


def test_a_data_position_that_is_not_the_updates_is_refused(tmp_path):
    ckpt = saved(tmp_path, updates=(2,))
    ckpt.save(4, state_at(4), position=PER_UPDATE * 4 + 3)  # read past its updates
    ckpt.close()
    ckpt = Checkpoints(tmp_path / "ckpt", RUN, examples_per_update=PER_UPDATE)
    with pytest.warns(UserWarning, match="data position 35 is not 4 updates x 8 examples"):
        assert_restored(ckpt, 2)
    ckpt.close()


@ORBAX_LATE_CALLBACK
def test_when_no_checkpoint_is_intact_resuming_is_refused(tmp_path):
    ckpt = saved(tmp_path, updates=(2,))
    flip_bytes(tmp_path / "ckpt" / "2")
    with pytest.warns(UserWarning, match="damaged"), pytest.raises(ValueError, match="no intact"):
        ckpt.restore(state_at(0))
    ckpt.close()


def _final_params(workdir, update):
    restored = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(update) / "state")
    return restored["state"]["params"]


@ORBAX_LATE_CALLBACK
def test_resume_from_a_damaged_checkpoint_ends_as_an_uninterrupted_run(tmp_path, capsys):
    flags = ["--model", "mlp", "--target-batch-size", "8", "--checkpoint-every", "2"]
    flags += ["--no-progress", "--no-plan-cache", "--eval-every", "0"]
    whole, damaged = tmp_path / "whole", tmp_path / "damaged"
    assert main([*flags, "--updates", "6", "--workdir", str(whole)]) == 0
    assert main([*flags, "--updates", "4", "--workdir", str(damaged)]) == 0
    flip_bytes(damaged / "checkpoints" / "4")
    with pytest.warns(UserWarning, match="checkpoint 4 .* is damaged"):
        assert main([*flags, "--updates", "6", "--workdir", str(damaged), "--resume"]) == 0
    assert "resumed at update 2" in capsys.readouterr().out
    for a, b in zip(jax.tree.leaves(_final_params(whole, 6)),
                    jax.tree.leaves(_final_params(damaged, 6)), strict=True):  # fmt: skip
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    lines = [json.loads(x) for x in (damaged / "metrics.jsonl").read_text().splitlines()]
    assert [line["update"] for line in lines] == [1, 2, 3, 4, 5, 6]  # 3 and 4 redone, once each
