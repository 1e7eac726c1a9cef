"""The session's environment: tests, doctests, the xdist workers and the subprocesses they start.

- No plan cache: a run must never depend on what an earlier one stored; the plan
  cache's own tests give it a file of their own.
- One JAX compilation cache for the session, in a temporary directory made here and
  removed when the session ends: many tests compile the same programs (the CLI's
  default job, the zoo's models, a run and its resume), and XLA:CPU's compile is most
  of their time (the suite took 406 s with it against 608 s without, `-n 2` on this
  project's 2-core machine). A cache hit is the very executable a compile gives: its
  key holds the program, the compile options, the XLA flags and the devices. Nothing
  outlives the session, so no run depends on an earlier one either. A cache directory
  set outside (``JAX_COMPILATION_CACHE_DIR``) is used as it is, and kept.
"""

import os
import shutil
import tempfile

os.environ["JAX_ADAPTIVE_PLAN_CACHE"] = "off"

# Set before JAX is imported (it reads these at import). The workers inherit the
# controller's directory, so only the process that made it finds it unset here.
_COMPILE_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _COMPILE_CACHE = tempfile.mkdtemp(prefix="jax-adaptive-tests-compile-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # a test's programs are small
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_sessionfinish(session):
    """Removes the session's compilation cache once every worker is done with it."""
    if _COMPILE_CACHE is not None and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)
