"""Shared test fixtures: a small model, data, and the independent full-batch reference."""

import functools
import importlib.util
import json
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax


def mlp_params(seed=0, d_in=4, width=8):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (d_in, width)) / 2,
        "b1": jnp.zeros(width),
        "w2": jax.random.normal(k2, (width,)) / 3,
    }


def mlp_loss(params, batch, rng):
    """Per-example mean squared error of a tanh network applied to each of L positions.

    The positions make the activations, not the parameters, dominate the memory, as in
    the models the trainer is for.
    """
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, None, :])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2, axis=1)


def regression_batches(num, size, seed=0, d_in=4, length=16):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(size, length, d_in)).astype(np.float32),
            "y": rng.normal(size=(size, length)).astype(np.float32),
        }
        for _ in range(num)
    ]


def donating_step_builder(loss_fn, optimizer):
    """``m -> step``: a user's own jitted step at micro-batch ``m``, as `AdaptiveStep` takes.

    The step donates its ``(params, opt_state)``, takes `micro_batch_grad` of the
    per-example loss and one optimizer update; it returns the new state and the loss. One
    jitted function per size (cached): JAX reuses its compiles across tests.
    """
    import jax_adaptive as ja

    @functools.cache
    def build(m):
        @functools.partial(jax.jit, donate_argnums=0)
        def train_step(state, batch):
            params, opt_state = state
            out = ja.micro_batch_grad(loss_fn, m)(params, batch)
            updates, opt_state = optimizer.update(out.grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), out.loss

        return train_step

    return build


def full_batch_reference(loss_fn, optimizer, params, batches, rng=None):
    """Plain optax: one jitted full-batch step per batch on the mean loss."""
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: jnp.mean(loss_fn(p, batch, rng)))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
    return params


def assert_trees_close(a, b, tol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=tol, atol=tol), a, b)


def vmsize() -> int:
    """The process's address space in bytes (the base of an RLIMIT_AS limit)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def free_port() -> int:
    """A TCP port free on localhost now (a jax.distributed coordinator's)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def load_example(name):
    """``examples/<name>.py`` imported as a module, as a user runs it from the repository."""
    path = pathlib.Path(__file__).parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its classes' module, as an import would set it
    spec.loader.exec_module(module)
    return module


def cli_command(*flags):
    """``python -m jax_adaptive.train`` with ``flags``, no progress bar."""
    return [sys.executable, "-m", "jax_adaptive.train", "--no-progress", *map(str, flags)]


def checkpointed_params(workdir, update):
    """The parameters the command line checkpointed in ``workdir`` after ``update``."""
    import orbax.checkpoint as ocp

    restored = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(update) / "state")
    return restored["state"]["params"]


class FailedRuns:
    """An `AdaptiveNnxStep`'s fault hook: an out-of-memory at the chosen runs (counted from
    install), as XLA leaves a failed run: what it donates deleted. ``fired``: (run, size),
    size 0 for the update's run."""

    def __init__(self, step, runs):
        self.step, self.runs, self.seen, self.fired = step, runs, 0, []

    def before_compile(self, size):
        pass

    def before_execution(self, size, args):
        self.seen += 1
        if self.seen not in self.runs:
            return
        donated = getattr(args, "donated", None)
        if donated is None:  # the gradient's run: what its compiled program donates
            infos = jax.tree.leaves(self.step.step.compile(size).args_info[0])
            donated = [x for x, i in zip(jax.tree.leaves(args), infos, strict=True) if i.donated]
        for leaf in donated:
            if isinstance(leaf, jax.Array):
                leaf.delete()
        self.fired.append((self.seen, size))
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (injected).")


def job_result(job, directory, timeout):
    """Runs ``python JOB OUT.json`` (a job script beside the tests) and reads what it wrote.

    A job fixes the device count before JAX starts, so it runs in its own process; a
    failure shows the end of its output.
    """
    out = pathlib.Path(directory) / "result.json"
    proc = subprocess.run(
        [sys.executable, str(job), str(out)], cwd=pathlib.Path(job).parent,
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(out.read_text())
