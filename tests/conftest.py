"""Strict JAX for every test: rank promotion raises, warnings are errors (pyproject).

No test writes outside its temporary directories: the plan cache is off for the whole
session (doctests and the subprocesses tests start inherit it); a test that needs one
names a file under its ``tmp_path``.
"""

import logging
import os
import signal

import jax
import pytest

# Set at import, before any test is collected or run, so that a default `PlanCache` never
# reaches the user's ~/.cache/jax_adaptive/plans.json.
os.environ["JAX_ADAPTIVE_PLAN_CACHE"] = "off"

jax.config.update("jax_numpy_rank_promotion", "raise")

# Ctrl-C is a KeyboardInterrupt in every test, as at a terminal: a process started as a
# shell's background job (`.ci/run &`, nohup) inherits SIGINT ignored, and Python then
# never raises it (the Ctrl-C tests of test_fit.py hung for ever: issue 37's rare hang).
# The tests' subprocesses inherit Python's handler as the default disposition.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _strict_jax():
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(autouse=True)
def _library_log_as_found():
    """The ``jax_adaptive`` logger's level as each test found it: a guide's block silences
    it (docs/trainer.md), and a test after it on the same worker expects its INFO lines."""
    log = logging.getLogger("jax_adaptive")
    level = log.level
    yield
    log.setLevel(level)
