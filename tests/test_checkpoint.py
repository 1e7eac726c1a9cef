"""Checkpoints: damage is detected and the newest intact checkpoint is used, with a warning;
any other error while restoring propagates and moves nothing.

The reference for a restored state is the host copy of the state that was saved.
"""

import errno
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jax_adaptive.cli import checkpoints
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
    with pytest.warns(
        UserWarning, match="data position 35 is not 32, the examples of its 4 updates"
    ):
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


def saved_with_a_wrong_checksum(tmp_path, monkeypatch):
    """Checkpoints 2 (intact) and 4, whose record holds another digest than its arrays'."""
    ckpt = saved(tmp_path, updates=(2,))
    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "state_digest", lambda *args: "0" * 64)
        ckpt.save(4, state_at(4), PER_UPDATE * 4)
        ckpt.close()
    return Checkpoints(tmp_path / "ckpt", RUN, examples_per_update=PER_UPDATE)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EIO, "Input/output error"),  # a network filesystem's hiccup
        MemoryError("host memory"),
        TypeError("an orbax upgrade's signature"),
        ValueError("UNAVAILABLE: the storage service did not answer"),  # tensorstore's
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_transient_error_while_restoring_propagates_a_checksum_mismatch_moves_it_aside(
    tmp_path, monkeypatch, error
):
    ckpt = saved_with_a_wrong_checksum(tmp_path, monkeypatch)
    real = ocp.CheckpointManager.restore

    def failing(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(ocp.CheckpointManager, "restore", failing)
    with pytest.raises(type(error)) as info:
        ckpt.restore(state_at(0))
    assert info.value is error  # the error itself, with its traceback
    assert ckpt.latest() == 4 and not ckpt.aside()  # both left in place
    monkeypatch.setattr(ocp.CheckpointManager, "restore", real)  # the error passed
    with pytest.warns(UserWarning, match="checkpoint 4 .* is damaged .*differ from what was saved"):
        assert_restored(ckpt, 2)
    assert ckpt.latest() == 2 and [p.name[:2] for p in ckpt.aside()] == ["4-"]
    ckpt.close()


def _mlp_flags(workdir, updates, *more):
    flags = ["--model", "mlp", "--target-batch-size", "8", "--checkpoint-every", "2"]
    flags += ["--no-progress", "--no-plan-cache", "--eval-every", "0"]
    return [*flags, "--updates", str(updates), "--workdir", str(workdir), *more]


def test_restores_failing_twice_with_eio_then_working_move_nothing_and_resume(
    tmp_path, monkeypatch, capsys
):
    """Issue 32, fault 2: two transient read errors cost no checkpoint and no update."""
    assert main(_mlp_flags(tmp_path, 4)) == 0
    real, failures = ocp.CheckpointManager.restore, [0]

    def flaky(self, *args, **kwargs):
        if failures[0] < 2:
            failures[0] += 1
            raise OSError(errno.EIO, "Input/output error")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", flaky)
    for _ in range(2):  # the same command, as a user retries it
        with pytest.raises(OSError, match="Input/output error"):
            main(_mlp_flags(tmp_path, 6, "--resume"))
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4"]
        assert not (tmp_path / "checkpoints-damaged").exists()
    capsys.readouterr()
    assert main(_mlp_flags(tmp_path, 6, "--resume")) == 0
    assert "resumed at update 4" in capsys.readouterr().out
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["update"] for line in lines] == [1, 2, 3, 4, 5, 6]


@ORBAX_LATE_CALLBACK
def test_resume_with_every_checkpoint_moved_aside_refuses_and_never_starts_afresh(tmp_path, capsys):
    assert main(_mlp_flags(tmp_path, 2)) == 0
    before = (tmp_path / "metrics.jsonl").read_text()
    flip_bytes(tmp_path / "checkpoints" / "2")
    with pytest.warns(UserWarning, match="checkpoint 2 .* is damaged"):
        assert main(_mlp_flags(tmp_path, 4, "--resume")) == 2
    for flags, message in [  # one line each, before anything is built
        (_mlp_flags(tmp_path, 4, "--resume"), "no intact checkpoint"),  # the same again
        (_mlp_flags(tmp_path, 4), "already holds checkpoints"),  # afresh over them
    ]:
        capsys.readouterr()
        assert main(flags) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and message in err, (out, err)
    assert (tmp_path / "metrics.jsonl").read_text() == before  # nothing started afresh
