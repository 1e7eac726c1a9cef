"""Batch-size schedules: each update exact for its own size, one compile per micro-batch size.

The reference is plain optax: one jitted full-batch step per update on the mean loss of
that update's batch (`helpers.full_batch_reference`), on the same batches.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, full_batch_reference, mlp_loss, mlp_params

import jax_adaptive as ja
from jax_adaptive.cli.checkpoints import Checkpoints
from jax_adaptive.schedule import batch_schedule
from jax_adaptive.testing import inject_oom

STEPS = [(0, 8), (2, 20), (4, 36)]  # 6 divides none of 8, 20 and 36 evenly but 36
SIZES = [8, 8, 20, 20, 36, 36]
OPT = optax.adam(0.05)


def example_stream(seed=0, d_in=4, length=16):
    """Examples one at a time, each ``{"x": [length, d_in], "y": [length]}``."""
    rng = np.random.default_rng(seed)
    while True:
        yield {
            "x": rng.normal(size=(length, d_in)).astype(np.float32),
            "y": rng.normal(size=(length,)).astype(np.float32),
        }


def batches_of(sizes, seed=0):
    stream = example_stream(seed)
    out = []
    for size in sizes:
        rows = [next(stream) for _ in range(size)]
        out.append({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    return out


def train(trainer, batches, state=None):
    state = trainer.init(mlp_params(), batches[0]) if state is None else state
    history = []
    for batch in batches:
        assert trainer.target_batch_size_for(state) == len(batch["y"])
        state, metrics = trainer.step(state, batch)
        history.append(metrics)
    return state, history


def limit_for(largest):
    """A device that fits micro-batches up to about ``largest`` (the model's ledger)."""
    probe = ja.AdaptiveTrainer(mlp_loss, OPT, target_batch_size=64, micro_batch_size=64)
    probe.init(mlp_params(), batches_of([1])[0])
    return probe.ledger(largest).total


@pytest.mark.parametrize("spec", [STEPS, lambda u: SIZES[min(u, 5)], batch_schedule(*STEPS)])
def test_a_fixed_micro_batch_that_divides_no_size_is_exact_with_one_compile(spec):
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPT, target_batch_size=spec, micro_batch_size=6, plan_cache=False
    )
    batches = batches_of(SIZES)
    state, history = train(trainer, batches)
    assert [h["examples"] for h in history] == SIZES
    assert [h["accumulation_steps"] for h in history] == [2, 2, 4, 4, 6, 6]
    assert_trees_close(
        state.params, full_batch_reference(mlp_loss, OPT, mlp_params(), batches), 1e-5
    )
    assert int(state.updates) == len(SIZES)
    assert trainer.compiles == 1 and dict(trainer.trace_counts) == {6: 1}


def test_auto_under_a_memory_limit_grows_the_size_with_the_target_and_compiles_each_once():
    sizes = [4, 4, 16, 16, 64, 100, 100]
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPT, target_batch_size=lambda u: sizes[min(u, 6)],
        memory_limit=limit_for(40), plan_cache=False,
    )  # fmt: skip
    batches = batches_of(sizes, seed=1)
    state, history = train(trainer, batches)
    micro = [h["micro_batch_size"] for h in history]
    assert micro[:4] == [4, 4, 16, 16], micro  # capped by the target
    assert 16 < micro[4] <= 40 and micro[5] <= 40, micro  # capped by the memory
    assert trainer.plan_info.largest <= 40 and trainer.target_batch_size == 100
    assert_trees_close(
        state.params, full_batch_reference(mlp_loss, OPT, mlp_params(), batches), 1e-5
    )
    assert set(trainer.trace_counts.values()) == {1}  # no size traced twice
    assert trainer.compiles == len(trainer.trace_counts)
    assert trainer.compiles <= 10, trainer.search_log


def test_an_out_of_memory_after_the_batch_grew_loses_nothing():
    sizes = [8, 8, 32, 32, 32]
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPT, target_batch_size=[(0, 8), (2, 32)], memory_limit=limit_for(64),
        plan_cache=False, chunk=1,
    )  # fmt: skip
    batches = batches_of(sizes, seed=2)
    state = trainer.init(mlp_params(), batches[0])
    state, _ = train(trainer, batches[:3], state)  # update 2 ran at 32 x 1
    assert trainer.micro_batch_size == 32
    # 1: 32 with the optimizer step in its program (then apart), 2: 32 alone (shrinks).
    with inject_oom(trainer, executions={1, 2}) as faults:
        state, history = train(trainer, batches[3:], state)
    assert faults.injected == [(1, 32), (2, 32)]
    assert history[0]["micro_batch_size"] < 32 and history[0]["examples"] == 32
    assert_trees_close(
        state.params, full_batch_reference(mlp_loss, OPT, mlp_params(), batches), 1e-5
    )


def test_compile_and_ledger_take_sizes_up_to_the_next_update_s_target():
    """Once the schedule has moved the target (8 -> 20), sizes up to 20 are the trainer's.

    The reference is a trainer made for 20 from the start.
    """
    batches = batches_of(SIZES[:2])
    trainer = ja.AdaptiveTrainer(mlp_loss, OPT, target_batch_size=STEPS, plan_cache=False)
    train(trainer, batches)  # two updates of 8: the next takes 20
    fresh = ja.AdaptiveTrainer(mlp_loss, OPT, target_batch_size=20, plan_cache=False)
    fresh.init(mlp_params(), batches[0])
    assert trainer.ledger(20) == fresh.ledger(20)  # checked against 20, not against 8
    assert trainer.ledger(10, 2) == fresh.ledger(10, 2)
    assert ja.estimate_peak_bytes(trainer.compile(20)) == ja.estimate_peak_bytes(fresh.compile(20))


def test_fit_draws_each_update_s_size_from_a_stream_of_any_chunks():
    sizes = SIZES
    batches = batches_of(sizes, seed=3)
    examples = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    cuts = np.arange(7, len(examples["y"]), 7)  # chunks of 7 examples
    chunks = [
        {"x": x, "y": y}
        for x, y in zip(np.split(examples["x"], cuts), np.split(examples["y"], cuts), strict=True)
    ]
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPT, target_batch_size=STEPS, micro_batch_size=6, plan_cache=False
    )
    state = trainer.init(mlp_params(), batches[0])
    stream = iter(chunks)
    state, history = trainer.fit(state, stream, num_updates=4)
    state, more = trainer.fit(state, stream)  # a second fit goes on with the schedule
    assert [h["examples"] for h in history + more] == sizes
    assert_trees_close(
        state.params, full_batch_reference(mlp_loss, OPT, mlp_params(), batches), 1e-5
    )


def test_a_restored_checkpoint_goes_on_with_the_schedule(tmp_path):
    batches = batches_of(SIZES, seed=4)

    def trainer():
        return ja.AdaptiveTrainer(
            mlp_loss, OPT, target_batch_size=STEPS, micro_batch_size=6, plan_cache=False
        )

    first = trainer()
    state, _ = train(first, batches[:3])  # stops inside the second step of the schedule
    ckpt = Checkpoints(tmp_path / "ckpt", {"run": 1})
    ckpt.save(3, state, position=sum(SIZES[:3]))
    ckpt.close()
    second = trainer()
    like = second.init(mlp_params(), batches[0])
    restored, position = Checkpoints(tmp_path / "ckpt", {"run": 1}).restore(like)
    second.plan(restored, batches[0])
    assert position == 36 and second.target_batch_size == 20
    state, history = train(second, batches[3:], restored)
    assert [h["examples"] for h in history] == SIZES[3:]
    assert_trees_close(
        state.params, full_batch_reference(mlp_loss, OPT, mlp_params(), batches), 1e-5
    )


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ([(0, 8), (4, 16), (4, 32)], "must start after update 4"),
        ([(0, 8), (4, 0)], "its size must be a positive int"),
        ([(0, 8), (4, 16.0)], "its size must be a positive int"),
        ([(0, 8), (2.5, 16)], "its update must be an int"),
        ([(1, 8)], "must start at update 0"),
        ([], "at least one"),
        ("64", "must be a positive int, a callable"),
        (0, "target_batch_size=0"),
    ],
)
def test_bad_schedules_are_one_line_errors_naming_the_argument(spec, words):
    with pytest.raises((TypeError, ValueError)) as error:
        ja.AdaptiveTrainer(mlp_loss, OPT, target_batch_size=spec)
    message = str(error.value)
    assert words in message and "target_batch_size" in message and "\n" not in message


def test_a_callable_s_bad_size_and_a_batch_of_the_wrong_size_name_the_update():
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPT, target_batch_size=lambda u: 8 if u == 0 else 0, micro_batch_size=4
    )
    batches = batches_of([8, 8])
    state = trainer.init(mlp_params(), batches[0])
    with pytest.raises(ValueError, match=r"^target_batch_size\(1\) returned 0; a schedule"):
        trainer.step(trainer.step(state, batches[0])[0], batches[1])
    grown = ja.AdaptiveTrainer(mlp_loss, OPT, target_batch_size=[(0, 8), (1, 16)])
    state = grown.init(mlp_params(), batches[0])
    state, _ = grown.step(state, batches[0])
    with pytest.raises(ValueError, match="gives target_batch_size=16 at update 1"):
        grown.step(state, batches[1])


DATA_PARALLEL = """
import optax, jax_adaptive as ja
from helpers import assert_trees_close, full_batch_reference, mlp_loss, mlp_params
from helpers import regression_batches
sizes = [8, 8, 24, 40]
batches = [regression_batches(1, n, seed=i)[0] for i, n in enumerate(sizes)]
trainer = ja.AdaptiveTrainer(mlp_loss, optax.adam(0.05), target_batch_size=[(0, 8), (2, 24),
    (3, 40)], micro_batch_size=8, mesh=ja.data_mesh(), plan_cache=False)
state = trainer.init(mlp_params(), batches[0])
for batch in batches:
    state, metrics = trainer.step(state, batch)
reference = full_batch_reference(mlp_loss, optax.adam(0.05), mlp_params(), batches)
assert_trees_close(state.params, reference, 1e-5)
assert trainer.compiles == 1 and trainer.shards == 4, (trainer.compiles, trainer.shards)
print("ok")
"""


def test_data_parallel_accumulation_follows_the_schedule_exactly():
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
    }
    tests = Path(__file__).parent
    env["PYTHONPATH"] = os.pathsep.join([str(tests), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", DATA_PARALLEL], env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_scheduled_step_on_the_state_it_returned_reads_nothing_from_the_device(monkeypatch):
    """The trainer knows the updates of the state it returned; any other state is read."""
    reads = []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(x) or device_get(x))
    sizes = [8, 8, 8, 8]
    batches = batches_of(sizes, seed=4)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, OPT, target_batch_size=lambda u: 8, micro_batch_size=4, plan_cache=False
    )
    state = trainer.init(mlp_params(), batches[0])
    state, _ = trainer.step(state, batches[0])  # the first run of its program
    reads.clear()
    for batch in batches[1:3]:
        state, _ = trainer.step(state, batch)
    assert reads == []
    copied = jax.tree.map(jnp.copy, state)  # as restored from a checkpoint: read once
    state, _ = trainer.step(copied, batches[3])
    assert len(reads) == 1
    assert int(state.updates) == 4
    assert_trees_close(
        state.params, full_batch_reference(mlp_loss, OPT, mlp_params(), batches), 1e-5
    )
