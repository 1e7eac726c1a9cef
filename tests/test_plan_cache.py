"""The plan cache: a second run of the same job searches nothing; bad entries are not trusted."""

import json
import os
import stat
import subprocess
import sys
import time

import optax
import pytest
from helpers import assert_trees_close, full_batch_reference, mlp_loss, mlp_params
from helpers import regression_batches as batches_of

import jax_adaptive as ja

T = 32


@pytest.fixture(scope="module")
def estimates():
    """Brute force: the peak of every size from its own compile (no cache), for Adam."""
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=1
    )
    trainer.init(mlp_params(), batches_of(1, T)[0])
    return {s: trainer.ledger(s).total for s in range(1, T + 1)}


def brute_force_max(estimates, limit):
    return max(s for s, e in estimates.items() if e <= limit)


def run(path, limit, optimizer=None, d_in=4, steps=2, loss=mlp_loss):
    trainer = ja.AdaptiveTrainer(
        loss,
        optimizer or optax.adam(1e-2),
        target_batch_size=T,
        memory_limit=limit,
        plan_cache=path,
        objective="max",  # the brute-force max is the reference
    )
    batches = batches_of(steps, T, d_in=d_in)
    state = trainer.init(mlp_params(d_in=d_in), batches[0])
    search_compiles = trainer.compiles
    for batch in batches:
        state, _ = trainer.step(state, batch)
    return trainer, state, search_compiles


def test_a_second_run_of_the_same_job_compiles_no_candidate(tmp_path, estimates):
    limit = (estimates[23] + estimates[24]) // 2
    first, _, first_compiles = run(tmp_path / "plans.json", limit)
    second, state, second_compiles = run(tmp_path / "plans.json", limit)
    assert first.micro_batch_size == second.micro_batch_size == brute_force_max(estimates, limit)
    assert first_compiles >= 2 and second_compiles == 0
    assert second.compiles == 1  # the cached size itself, at its first step
    assert [t.decided_by for t in second.search_log] == ["plan cache"]
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches_of(2, T))
    assert_trees_close(state.params, reference, 1e-5)


def test_what_decides_the_plan_is_in_the_key(tmp_path, estimates):
    path = tmp_path / "plans.json"
    run(path, estimates[12])
    for other in (
        {"limit": estimates[28]},  # another capacity
        {"limit": estimates[12], "d_in": 6},  # another model shape
        {"limit": estimates[12], "loss": lambda p, b, r: mlp_loss(p, b, r) ** 2},  # another loss
    ):
        trainer, _, compiles = run(path, steps=1, **other)
        assert compiles >= 1 and "plan cache" not in {t.decided_by for t in trainer.search_log}
    assert len(json.loads(path.read_text())) == 4


def test_a_corrupt_file_is_ignored_with_a_warning_and_rewritten(tmp_path, estimates):
    path = tmp_path / "plans.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        trainer, _, compiles = run(path, estimates[20], steps=1)
    assert compiles >= 1 and trainer.micro_batch_size == 20
    assert json.loads(path.read_text())  # valid again


def test_a_stale_entry_is_ignored_or_corrected_by_the_guarded_first_run(tmp_path, estimates):
    path = tmp_path / "plans.json"
    limit = estimates[20]
    run(path, limit, steps=1)
    (key,) = json.loads(path.read_text())
    for wrong, warns in ((T + 5, True), ("many", True), (30, False)):
        ja.PlanCache(path).put(key, {"micro_batch_size": wrong})
        if warns:
            with pytest.warns(UserWarning, match="stale plan"):
                trainer, state, _ = run(path, limit)
        else:  # in range but too large now: the guarded first step shrinks it, exactly
            trainer, state, _ = run(path, limit)
            assert next(t.size for t in trainer.search_log if not t.fits) == 30
        assert trainer.micro_batch_size == 20
        reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches_of(2, T))
        assert_trees_close(state.params, reference, 1e-5)


def test_an_entry_of_a_wrong_type_is_ignored_with_a_warning(tmp_path, estimates):
    path = tmp_path / "plans.json"
    limit = estimates[20]
    run(path, limit, steps=1)
    (key,) = json.loads(path.read_text())
    for wrong in ("lots", [1, 2], {"bytes": 3}, -1, True):
        ja.PlanCache(path).put(key, {"micro_batch_size": 30, "estimated_bytes": wrong})
        with pytest.warns(UserWarning, match=r"malformed plan .*estimated_bytes="):
            trainer, state, compiles = run(path, limit)
        assert compiles >= 1 and "plan cache" not in {t.decided_by for t in trainer.search_log}
        assert trainer.micro_batch_size == 20
        reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches_of(2, T))
        assert_trees_close(state.params, reference, 1e-5)
    ja.PlanCache(path).put(key, {"micro_batch_size": 20, "estimated_bytes": None})
    assert run(path, limit, steps=1)[0].search_log[0].decided_by == "plan cache"  # null is fine


def test_off_means_off(tmp_path, monkeypatch):
    assert ja.PlanCache.from_arg(False) is None
    assert ja.PlanCache.from_arg(None) is None  # conftest: JAX_ADAPTIVE_PLAN_CACHE=off
    monkeypatch.setenv("JAX_ADAPTIVE_PLAN_CACHE", str(tmp_path / "p.json"))
    assert ja.PlanCache.from_arg(None).path == tmp_path / "p.json"
    with pytest.raises(TypeError, match="plan_cache"):
        ja.PlanCache.from_arg(3)


def test_the_key_follows_the_live_limit_through_shrink_and_grow(tmp_path, estimates):
    path = tmp_path / "plans.json"
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, memory_limit=estimates[24],
        plan_cache=path, objective="max",
    )  # fmt: skip
    batches = batches_of(3, T)
    state = trainer.init(mlp_params(), batches[0])
    planned = trainer.micro_batch_size
    trainer.set_memory_limit(estimates[12])  # another job took memory: shrink
    state, m0 = trainer.step(state, batches[0])
    trainer.set_memory_limit(estimates[20])  # some came back: grow
    state, m1 = trainer.step(state, batches[1])
    assert (planned, m0["micro_batch_size"], m1["micro_batch_size"]) == (24, 12, 20)
    # Each plan is stored under the limit it was made for: a later run of the same job
    # under each limit plans from the cache what a fresh search finds.
    for size in (24, 12, 20):
        again, _, compiles = run(path, estimates[size], steps=1)
        assert again.micro_batch_size == size == brute_force_max(estimates, estimates[size])
        assert compiles == 0 and again.search_log[0].decided_by == "plan cache"


def _plan_cache_warnings(record):
    return [w for w in record if "plan cache" in str(w.message)]


def test_a_deeply_nested_file_warns_once_and_the_search_goes_on(tmp_path, estimates):
    path = tmp_path / "plans.json"
    path.write_text("[" * 100_000 + "]" * 100_000)  # json.loads: RecursionError
    with pytest.warns(UserWarning, match="unreadable") as record:
        trainer, _, compiles = run(path, estimates[20], steps=1)
    assert len(_plan_cache_warnings(record)) == 1
    assert compiles >= 1 and trainer.micro_batch_size == brute_force_max(estimates, estimates[20])
    assert len(json.loads(path.read_text())) == 1  # rewritten with the plan found


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_an_unwritable_cache_warns_once_and_training_goes_on(tmp_path, estimates, where):
    if where == "a directory":
        path = tmp_path / "plans.json"
        path.mkdir()
    else:
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "plans.json"
    with pytest.warns(UserWarning, match="ignoring the plan cache") as record:
        trainer, state, _ = run(path, estimates[20])
    assert len(_plan_cache_warnings(record)) == 1
    assert trainer.micro_batch_size == brute_force_max(estimates, estimates[20])
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches_of(2, T))
    assert_trees_close(state.params, reference, 1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) in (
        ["plans.json", "plans.json.lock"],
        ["file"],
    )  # no temporary file left


_WRITER = """
import sys, time
from pathlib import Path
from jax_adaptive.plan_cache import PlanCache
path, name, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
while not go.exists():
    time.sleep(0.001)
cache = PlanCache(path)
for i in range(count):
    cache.put(f"{name}-{i}", {"micro_batch_size": i + 1})
"""


def test_concurrent_writers_lose_nothing_and_leave_a_normal_file(tmp_path):
    path, go = tmp_path / "plans.json", tmp_path / "go"
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name, "300", str(go)])
        for name in ("a", "b")
    ]
    time.sleep(3)  # both importing, then waiting: they start writing together
    go.touch()
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    entries = json.loads(path.read_text())
    assert len(entries) == 600
    assert {entries[f"{n}-{i}"]["micro_batch_size"] for n in "ab" for i in range(300)} == set(
        range(1, 301)
    )
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "plans.json", "plans.json.lock"]


def test_a_symlink_planted_beside_the_cache_is_never_written_through(tmp_path):
    """A shared cache directory: another user's links must not redirect our writes."""
    path, victim = tmp_path / "plans.json", tmp_path / "victim"
    victim.write_text("precious")
    for guess in range(os.getpid() - 50, os.getpid() + 50):
        (tmp_path / f".plans.json.{guess}.tmp").symlink_to(victim)  # the old, guessable names
    ja.PlanCache(path).put("k", {"micro_batch_size": 4})
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and json.loads(path.read_text())["k"]["micro_batch_size"] == 4
    assert ja.PlanCache(path).get("k")["micro_batch_size"] == 4


@pytest.mark.parametrize("link", ["plans.json", "plans.json.lock"])
def test_a_cache_or_lock_that_is_a_symlink_is_refused_with_one_warning(tmp_path, link):
    path, victim = tmp_path / "plans.json", tmp_path / "elsewhere"
    (tmp_path / link).symlink_to(victim)  # dangling: following it would create the target
    cache = ja.PlanCache(path)
    with pytest.warns(UserWarning, match=f"{link} is a symbolic link") as record:
        cache.put("k", {"micro_batch_size": 4})
        assert cache.get("k") is None
    assert len(_plan_cache_warnings(record)) == 1
    assert not victim.exists()  # nothing created or written through the link
    assert (tmp_path / link).is_symlink()  # nor the link replaced
    victim.write_text(json.dumps({"k": {"micro_batch_size": 4}}))  # a target with plans
    ja.PlanCache(path).put("other", {"micro_batch_size": 8})  # (warned once per file)
    assert ja.PlanCache(path).plan("k", 32) is None  # not read through either
    assert json.loads(victim.read_text()) == {"k": {"micro_batch_size": 4}}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
