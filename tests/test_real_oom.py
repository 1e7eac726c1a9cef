"""The real path: XLA:CPU raises real out-of-memory errors under an address-space limit.

With ``micro_batch_size="auto"`` and no ``memory_limit``, a CPU gives the trainer no
capacity, so it plans the whole target batch; the real errors must make it find a size
that runs, and the training must still equal the full-batch reference, computed here,
outside the limit.
"""

import json
import pathlib
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


@pytest.fixture(scope="module")
def reference():
    params, batches, optimizer = job.make_problem()
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: jnp.mean(job.loss_fn(p, batch, None)))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
    return params


@pytest.mark.parametrize("margin_mb", [150, 250])
def test_real_ooms_find_a_size_and_stay_exact(tmp_path, reference, margin_mb):
    out = tmp_path / "params.npz"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(margin_mb), str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    report = json.loads(line.removeprefix("RESULT "))
    assert report["planned"] == job.T
    assert all(1 <= size < job.T for size in report["sizes"]), report["sizes"]
    real_ooms = [entry for entry in report["log"] if entry[2] == "run" and not entry[1]]
    assert real_ooms and real_ooms[0][:1] == [job.T], "the planned size must fail for real"
    with np.load(out) as params:
        assert_trees_close(dict(params), reference, 1e-5)
