"""The real path: XLA:CPU raises real out-of-memory errors under an address-space limit.

With ``micro_batch_size="auto"`` and no ``memory_limit``, a CPU gives the trainer no
capacity, so it plans the whole target batch; the real errors must make it find a size
that runs, and the training must still equal the full-batch reference, computed here,
outside the limit.
"""

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import real_oom_job as job
from helpers import assert_trees_close

SCRIPT = pathlib.Path(job.__file__)
_ABORTS = re.compile(r"std::bad_alloc|LLVM ERROR|Unable to allocate section memory")


@pytest.fixture(scope="module")
def reference():
    """The plain full-batch optax step's parameters after each of 12 updates, on the host.

    One trajectory for the module: the jobs' batches cycle the same way, so a job of n
    updates compares with its n-th entry. The step is compiled at XLA's default
    optimisation, not the session's fast-compile level 0: running 256 MiB a batch through
    it is its time, and level 0's code ran it 1.3x slower (7.3 s against 5.4 s).
    """
    params, batches, optimizer = job.make_problem()
    batches, opt_state = jax.device_put(batches), optimizer.init(params)

    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 2})
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: jnp.mean(job.loss_fn(p, batch, None)))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    after = {}
    for update in range(12):
        params, opt_state = step(params, opt_state, batches[update % job.DISTINCT])
        after[update + 1] = jax.device_get(params)
    return after


def run_job(out, margin_mb, updates, what="trainer"):
    """real_oom_job.py's report, under a limit of the process's address space + margin."""
    # The limit counts address space, not memory in use: each malloc arena a new thread
    # opens reserves 64 MiB, and glibc's moving mmap threshold keeps freed blocks mapped
    # (VmSize after an update varied by 120 MiB from one update to the next). Two arenas
    # and a fixed threshold keep the limit about the memory XLA allocates.
    # The job itself must leave the user's plan cache alone: the session's
    # JAX_ADAPTIVE_PLAN_CACHE=off (conftest) is not passed on, the cache dir is a fresh one.
    env = {
        **{k: v for k, v in os.environ.items() if k != "JAX_ADAPTIVE_PLAN_CACHE"},
        "XDG_CACHE_HOME": str(out.parent / "cache"),
        "MALLOC_ARENA_MAX": "2",
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MALLOC_TRIM_THRESHOLD_": "0",
    }
    command = [sys.executable, str(SCRIPT), str(margin_mb), str(updates), str(out), what]
    for _ in range(2):
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        # Where the address space runs out inside XLA:CPU's own C++ (an operator new, LLVM
        # mapping code) the process aborts, which no except can catch (DESIGN.md); it is
        # rare and this machine's, not a GPU's: such a run is tried once more.
        if not (result.returncode < 0 and _ABORTS.search(result.stderr)):
            break
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (out.parent / "cache").exists(), "the job wrote a cache of the user's"
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    report = json.loads(line.removeprefix("RESULT "))
    assert report["planned"] == job.T
    return report, result.stderr


def said(sizes, report, stderr):
    """A failure's whole story, not cut short: the sizes, every trial, the job's lines."""
    trials = "\n".join(json.dumps(entry) for entry in report["log"])
    return f"sizes {sizes}\ntrials:\n{trials}\nthe job's stderr (last lines):\n{stderr[-3000:]}"


# 12 updates at the tighter margin, where unbounded dispatch never settled; 2 at a wider.
@pytest.mark.parametrize(("margin_mb", "updates"), [(150, 12), (250, 2)])
def test_real_ooms_find_a_size_that_settles_and_stay_exact(tmp_path, margin_mb, updates, reference):
    out = tmp_path / "params.npz"
    report, stderr = run_job(out, margin_mb, updates)
    sizes = report["sizes"]
    assert len(sizes) == updates and all(1 <= s < job.T for s in sizes), sizes
    # It settles: a size never grows back, and the last half of the updates run one size.
    # Here it settles at once, the first update's size for all 12 (10 runs alone and 4
    # beside another job kept 64 throughout; issue 32). What used to move it (103, 86, 74,
    # 74, 74, 64: glibc reserving address space for new arenas and keeping freed blocks
    # mapped) is kept out by the job's environment; an address-space limit still counts
    # what the process maps and not only what XLA allocates, so only settling is asserted.
    assert sizes == sorted(sizes, reverse=True), said(sizes, report, stderr)
    assert len(set(sizes[updates // 2 :])) == 1, said(sizes, report, stderr)
    real_ooms = [entry for entry in report["log"] if entry[2] == "run" and not entry[1]]
    assert real_ooms and real_ooms[0][:1] == [job.T], "the planned size must fail for real"
    with np.load(out) as params:
        assert_trees_close(dict(params), reference[updates], 1e-5)


def test_adaptive_step_keeps_a_size_that_ran_after_real_ooms_and_stays_exact(tmp_path, reference):
    """A user's step: each failed attempt's arrays are released before the next (issue 32).

    The whole batch (256 MiB, on the device for the call) does not fit 320 MB above the
    process; the first call shrinks to a size that runs. The failed attempts hold their
    arrays in reference cycles, and the job turns Python's own collector off, so only
    what the library releases is released: before it collected after each failure, the
    previous call's batch was still alive at the next call, four out-of-memory errors
    at size 1 ended in NothingFitsError (59f2e33, 4 runs of 4).

    The size the first call settled on is kept by every later call, as the trainer keeps
    its own (issue 37): before, each call failed at it once and shrank (103, 103, 103, 47,
    1, 1 over six calls; 103, 64, 64, 35 in the issue's re-test).

    And later calls do not race the last call's release: the runtime frees the 256 MiB
    batch it transferred on its own thread after the call returns, and on a loaded CPU
    every call's first run failed (5 retries in 6 calls, 6 jobs of 6 beside 3 busy
    loops), one retry failed again after its wait in 1 of 3 CI runs ([103] * 3 + [47] * 3).
    Once a retry ran, each call waits for the release first: 1 retry in each of 6 jobs.
    """
    out, calls = tmp_path / "params.npz", 6
    report, stderr = run_job(out, 320, calls, "step")
    sizes = report["sizes"]
    assert len(sizes) == calls and 1 <= sizes[0] < job.T, sizes
    assert sizes == [sizes[0]] * calls, said(sizes, report, stderr)
    retries = [entry for entry in report["log"] if entry[3].endswith("ran before")]
    assert len(retries) <= 2, said(
        sizes, report, stderr
    )  # one call may race before the waits begin
    real_ooms = [entry for entry in report["log"] if entry[2] == "run" and not entry[1]]
    assert real_ooms and real_ooms[0][:1] == [job.T], "the planned size must fail for real"
    with np.load(out) as params:
        assert_trees_close(dict(params), reference[calls], 1e-5)
