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
from collections import Counter

os.environ["JAX_ADAPTIVE_PLAN_CACHE"] = "off"

# Set before JAX is imported (it reads these at import). The workers inherit the
# controller's directory, so only the process that made it finds it unset here.
_COMPILE_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _COMPILE_CACHE = tempfile.mkdtemp(prefix="jax-adaptive-tests-compile-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # a test's programs are small
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


# XLA:CPU compiling fast for the session and its subprocesses (they inherit the
# environment; the job scripts add their own flags to these): compiling is most of the
# suite's time. The LLVM back end at its lowest optimisation cut it by about a third
# (sharded_lm_job.py: 110 s of CPU against 67 s); the fusions emitted the classic way, not
# by the MLIR fusion emitters, cut each compile by another 2.5-3x (a CNN's NNX step 0.79
# -> 0.27 s, a scanned LM's 1.45 -> 0.48 s) and the suite from 696 to 464 s (`-n 2`, this
# project's 2-core machine). XLA's HLO passes are untouched: the buffers are the same,
# each fusion's scratch a few bytes apart (a CNN's gradient: 15,128,448 against
# 15,128,512 temporary bytes), and every test compares a ledger or an out-of-memory with
# programs compiled under the same flags. Only the machine code differs. Set outside,
# XLA_FLAGS is kept as it is.
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
)
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = _FAST_COMPILE


def pytest_sessionfinish(session):
    """Removes the session's compilation cache once every worker is done with it."""
    if _COMPILE_CACHE is not None and not hasattr(session.config, "workerinput"):
        shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)


# The order xdist's workers take modules in (each module runs on one worker, `--dist
# loadscope`): the longest first, so that the last modules handed out are short ones and
# neither worker idles while the other finishes a long module alone. xdist's own order is
# by test count, most first, which put the modules of a few long tests (subprocesses that
# import JAX and compile: 1 test of 55 s, 3 of 20-32 s) last. With `--no-loadscope-reorder`
# (pyproject) the workers take modules in the order collected, which the hook below makes:
# these first, in this order, then the rest by test count. The command line's tests took
# 581 s of `-n0` time (2 loaded cores), more than any other module: they are two modules of
# about 300 s and 270 s, each on a worker of its own from the start.
_LONG_FIRST = (
    "tests/test_train_cli.py",
    "tests/test_train_cli_resume.py",
    "tests/test_sharded_lm.py",
    "tests/test_hosts.py",
    "tests/test_real_oom.py",
    "tests/test_gpu_validation.py",
    "tests/test_data_parallel.py",
    "tests/test_sharded.py",
    "tests/test_one_reduction.py",
)


def pytest_collection_modifyitems(config, items):
    """Orders modules for the xdist workers (only there: a plain run keeps pytest's order)."""
    if not hasattr(config, "workerinput"):
        return
    module = {id(item): item.nodeid.split("::")[0] for item in items}
    count = Counter(module.values())

    def rank(item):
        name = module[id(item)]
        first = _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)
        return first, -count[name]

    items.sort(key=rank)  # stable: a module's tests keep their order
