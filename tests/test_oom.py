import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp_loss, mlp_params, regression_batches
from jax.experimental import io_callback
from jax.experimental.buffer_callback import buffer_callback

import jax_adaptive as ja
from jax_adaptive.errors import HostOutOfMemory

JOB = pathlib.Path(__file__).with_name("oom_forms_job.py")


@pytest.fixture(scope="module")
def real_errors():
    """Real error objects, raised by XLA:CPU under an address-space limit (a subprocess)."""
    result = subprocess.run(
        [sys.executable, str(JOB)], capture_output=True, text=True, timeout=300, check=True
    )
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {row["form"]: row for row in rows}


@pytest.mark.parametrize(
    ("form", "kind", "text"),
    [
        ("first call, at the call", "jax.errors.JaxRuntimeError", "RESOURCE_EXHAUSTED"),
        ("fast path, at the call", "builtins.ValueError", "RESOURCE_EXHAUSTED"),
        ("at block_until_ready", "jax.errors.JaxRuntimeError", "Out of memory"),
        ("wrapped by a later dispatch", "jax.errors.JaxRuntimeError", "INTERNAL"),
    ],
)
def test_real_out_of_memory_in_each_form(real_errors, form, kind, text):
    row = real_errors[form]
    assert row["type"] == kind and text in row["message"], row
    assert row["is_oom"] is True


@pytest.mark.parametrize(
    "form",
    [
        "not an OOM: a deleted array",
        "not an OOM: a donated buffer on the fast path",
        "not an OOM: shapes",
    ],
)
def test_real_errors_that_are_not_out_of_memory(real_errors, form):
    row = real_errors[form]
    assert row["type"] is not None and row["is_oom"] is False, row


@pytest.mark.parametrize(
    "exc",
    [
        ja.SimulatedOutOfMemory(needed=10, available=5),
        HostOutOfMemory(1000),
        jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes."),
        ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes."),
        jax.errors.JaxRuntimeError(
            "INTERNAL: Failed to allocate workspace: CUBLAS_STATUS_ALLOC_FAILED"
        ),
    ],
)
def test_recognised(exc):
    assert ja.is_oom(exc)


class MyValueError(ValueError):
    pass


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA out of memory"),  # not XLA's type: a user's or another library's
        MyValueError("RESOURCE_EXHAUSTED: out of memory"),  # a subclass is never XLA's
        MemoryError(),
        KeyError("out of memory"),
        jax.errors.JaxRuntimeError("INVALID_ARGUMENT: Buffer has been deleted or donated."),
        ValueError("operands could not be broadcast"),
    ],
)
def test_not_recognised(exc):
    assert not ja.is_oom(exc)


# Real out-of-memory texts, copied from runs (jax 0.10.2 on this CPU under an address-space
# limit; jax 0.11.2 with CUDA on an H200, whose BFC pool was capped with
# XLA_PYTHON_CLIENT_MEM_FRACTION=0.05 or bypassed with XLA_PYTHON_CLIENT_ALLOCATOR=platform).
REAL_OOM_TEXTS = {
    "cpu, first call": (
        jax.errors.JaxRuntimeError,
        "RESOURCE_EXHAUSTED: Out of memory allocating 402653184 bytes.",
    ),
    "cpu, fast path and AOT call": (
        ValueError,
        "RESOURCE_EXHAUSTED: Out of memory allocating 268435456 bytes.",
    ),
    "cpu, device_put and eager jnp.zeros": (
        jax.errors.JaxRuntimeError,
        "RESOURCE_EXHAUSTED: Out of memory allocating 268435456 bytes.",
    ),
    "cpu, a failed output passed to a later dispatch": (
        jax.errors.JaxRuntimeError,
        "INTERNAL: Error dispatching computation: Out of memory allocating 134217728 bytes.",
    ),
    "h200, BFC pool, at block_until_ready": (
        jax.errors.JaxRuntimeError,
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.00GiB with allocator "
        "GPU_0_bfc on device 0. [executable_name='jit__lambda'] "
        "[tf-allocator-allocation-error='']",
    ),
    "h200, device_put": (
        jax.errors.JaxRuntimeError,
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB with allocator "
        "GPU_0_bfc on device 0. [tf-allocator-allocation-error='']",
    ),
    "h200, platform allocator": (
        jax.errors.JaxRuntimeError,
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 200.00GiB with allocator "
        "SE_0_space_0 on device 0. [tf-allocator-allocation-error='']"
        " [executable_name='jit_broadcast_in_dim']",
    ),
}


@pytest.mark.parametrize("form", sorted(REAL_OOM_TEXTS))
def test_real_out_of_memory_texts(form):
    kind, text = REAL_OOM_TEXTS[form]
    assert ja.is_oom(kind(text))


def test_real_texts_of_this_jax_rebuilt_are_recognised(real_errors):
    """The subprocess's texts, as objects of the recorded type, are recognised here too."""
    kinds = {
        "jax.errors.JaxRuntimeError": jax.errors.JaxRuntimeError,
        "builtins.ValueError": ValueError,
    }
    ooms = [row for form, row in real_errors.items() if not form.startswith("not an OOM")]
    assert len(ooms) == 4, real_errors
    for row in ooms:
        assert ja.is_oom(kinds[row["type"]](row["message"])), row


@pytest.mark.parametrize(
    "exc",
    [
        # XLA's words without XLA's byte count or status: a user's, not an allocator's.
        jax.errors.JaxRuntimeError("INTERNAL: the loss ran out of memory"),
        ValueError("failed to allocate the embedding table"),
        # The status code in the middle of someone else's text is not the error's status.
        ValueError("bad config: expected RESOURCE_EXHAUSTED or OK, got 'oops'"),
        jax.errors.JaxRuntimeError("INTERNAL: user check failed: RESOURCE_EXHAUSTED: quota"),
    ],
)
def test_memory_words_alone_are_not_recognised(exc):
    assert not ja.is_oom(exc)


# What users raise in a host callback: a PyTorch-style message, and XLA's own texts.
USER_TEXTS = [
    "CUDA out of memory. failed to allocate 2.00 GiB",
    "RESOURCE_EXHAUSTED: Out of memory allocating 5 bytes.",
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.00GiB with allocator "
    "GPU_0_bfc on device 0.",
    "INTERNAL: Failed to allocate workspace: CUBLAS_STATUS_ALLOC_FAILED",
]


class _Armed:
    """A host callback that raises the user's error once armed (never while compiling)."""

    def __init__(self, text):
        self.text = text
        self.on = False

    def check(self, *args):
        if self.on:
            raise RuntimeError(self.text)

    def identity(self, x):
        self.check()
        return np.asarray(x)


def _with_callback(kind, armed):
    """A function of x that calls ``armed`` through the given kind of host callback."""

    def debug(x):
        jax.debug.callback(armed.check, x)
        return x * 2.0

    def pure(x):
        return jax.pure_callback(armed.identity, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2.0

    def io(x):
        io_callback(armed.check, None, x)
        return x * 2.0

    def grad(x):
        return jax.grad(lambda p: jnp.sum(debug(p) ** 2))(x)

    return {
        "debug.callback": debug,
        "pure_callback": pure,
        "io_callback": io,
        "grad through debug.callback": grad,
    }[kind]


def _raise_real_callback_error(kind, path, text):
    """Raises, for real, the error of a host callback that raised ``RuntimeError(text)``."""
    armed = _Armed(text)
    fn = _with_callback(kind, armed)
    x = jnp.ones(4)
    jitted = jax.jit(fn)
    compiled = jax.jit(fn).lower(x).compile()
    jax.block_until_ready((jitted(x), compiled(x)))  # fast path installed, runs fine
    armed.on = True
    calls = {
        "first call": lambda: jax.jit(lambda a: fn(a) + 0.0)(x),
        "fast path": lambda: jitted(x),
        "AOT compiled": lambda: compiled(x),
    }
    with pytest.raises((jax.errors.JaxRuntimeError, ValueError)) as info:
        out = calls[path]()
        out.block_until_ready()  # where an asynchronous error surfaces (a GPU's case)
    return info.value


@pytest.mark.parametrize("text", USER_TEXTS)
@pytest.mark.parametrize("path", ["first call", "fast path", "AOT compiled"])
@pytest.mark.parametrize(
    "kind", ["debug.callback", "pure_callback", "io_callback", "grad through debug.callback"]
)
def test_an_error_raised_in_a_host_callback_is_not_an_oom(kind, path, text):
    exc = _raise_real_callback_error(kind, path, text)
    # It comes as XLA's own types (JaxRuntimeError; ValueError from pure_callback's fast
    # path), carrying the user's text: only where it came from tells it apart.
    assert type(exc) in (jax.errors.JaxRuntimeError, ValueError), repr(exc)
    assert "CpuCallback error calling callback" in str(exc) and text in str(exc)
    assert not ja.is_oom(exc)


def test_pure_callback_on_the_fast_path_raises_a_plain_value_error():
    """The form that is hardest to tell from an OOM: the type of XLA's fast-path OOM."""
    exc = _raise_real_callback_error("pure_callback", "fast path", USER_TEXTS[1])
    assert type(exc) is ValueError
    assert not ja.is_oom(exc)


def test_an_error_raised_in_a_buffer_callback_is_not_an_oom():
    armed = _Armed(USER_TEXTS[1])
    armed.on = True

    def fill(ctx, out, x):
        armed.check()

    f = jax.jit(buffer_callback(fill, jax.ShapeDtypeStruct((4,), jnp.float32)))
    with pytest.raises(jax.errors.JaxRuntimeError, match="buffer callback") as info:
        f(jnp.ones(4)).block_until_ready()
    assert USER_TEXTS[1] in str(info.value) and not ja.is_oom(info.value)


@pytest.mark.parametrize("kind", ["debug.callback", "pure_callback"])
@pytest.mark.parametrize("armed_at", ["first step", "later step"])
def test_trainer_lets_a_callback_error_in_the_loss_propagate(kind, armed_at):
    """A user's "out of memory" from a host callback in the loss is not the trainer's to catch."""
    text = "CUDA out of memory. failed to allocate 2.00 GiB"
    armed = _Armed(text)

    def loss_fn(params, batch, rng):
        losses = mlp_loss(params, batch, rng)
        if kind == "debug.callback":
            jax.debug.callback(armed.check, losses)
            return losses
        # Pure callbacks have no JVP: this one sees the losses' values, outside the gradient
        # (its output is used, else XLA drops it).
        seen = jax.lax.stop_gradient(losses)
        shape = jax.ShapeDtypeStruct(seen.shape, seen.dtype)
        return losses + 0.0 * jax.pure_callback(
            armed.identity, shape, seen, vmap_method="sequential"
        )

    batches = regression_batches(2, 16)
    trainer = ja.AdaptiveTrainer(loss_fn, optax.sgd(0.1), target_batch_size=16)
    state = trainer.init(mlp_params(), batches[0])
    assert trainer.micro_batch_size == 16
    if armed_at == "later step":
        state, _ = trainer.step(state, batches[0])
    log = list(trainer.search_log)
    armed.on = True
    with pytest.raises(Exception, match=re.escape(text)) as info:
        trainer.step(state, batches[1])
    # XLA's own error, not one of the trainer's: it was not caught and wrapped.
    assert type(info.value) in (jax.errors.JaxRuntimeError, ValueError), repr(info.value)
    assert "CpuCallback error calling callback" in str(info.value)
    assert trainer.micro_batch_size == 16
    assert not [trial for trial in trainer.search_log if trial.reason == "step"]
    assert trainer.search_log == log  # no search ran
