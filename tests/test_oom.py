import json
import pathlib
import subprocess
import sys

import jax
import pytest

import jax_adaptive as ja

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
        ja.HostOutOfMemory(1000),
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
