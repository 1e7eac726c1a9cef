"""Makes XLA:CPU raise its out-of-memory errors in each form, and a few look-alikes.

Run as a script in a subprocess (``python oom_forms_job.py``): it prints one JSON line
per error, ``{"form", "type", "message", "is_oom"}``, with ``is_oom`` from
``jax_adaptive.is_oom`` on the real exception object.
"""

import os

if __name__ == "__main__":  # before JAX starts; never when a test imports this module
    # Its own flags alone, not the test session's fast compile: its time is running 256
    # MiB through XLA's code, not compiling (real_oom_job.py 150 12 took 19 s of CPU at
    # the session's optimisation level 0, 11 s at the default).
    os.environ["XLA_FLAGS"] = "--xla_cpu_experimental_ynn_fusion_type="
    os.environ["JAX_PLATFORMS"] = "cpu"
    # No compilation cache: a hit loads a program without compiling, and XLA makes its
    # compile thread pool at its first compile, which must come before the limit (a
    # pool made under it failed: "Thread tf_xla-cpu-codegen creation via
    # pthread_create() failed", an abort, once in about 15 suite runs).
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import gc
import json
import resource

import jax
import jax.numpy as jnp
from helpers import vmsize

MB = 2**20


def report(form, fn):
    import jax_adaptive as ja

    try:
        out = fn()
        jax.block_until_ready(out)
    except Exception as exc:  # the point: record whatever XLA raised
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        row = {"form": form, "type": kind, "message": str(exc)[:300], "is_oom": ja.is_oom(exc)}
        print(json.dumps(row), flush=True)
        return
    print(json.dumps({"form": form, "type": None, "message": "", "is_oom": None}), flush=True)


def main():
    x = jnp.ones((32768, 1024), jnp.float32)  # 128 MiB
    tile = jax.jit(lambda a: jnp.tile(a, (2, 1))).lower(x).compile()
    double = jax.jit(lambda a: a * 2.0)
    ballast_fn = jax.jit(lambda: jnp.zeros((131072, 1024), jnp.float32)).lower().compile()
    jax.block_until_ready(x)
    resource.setrlimit(resource.RLIMIT_AS, (vmsize() + 600 * MB, resource.RLIM_INFINITY))
    for _ in range(2):  # runs while memory lasts: later calls take the C++ fast path
        jax.block_until_ready(tile(x))
        jax.block_until_ready(double(x))
    gc.collect()
    ballast = ballast_fn()  # 512 MiB: now a 256 MiB output cannot be allocated
    jax.block_until_ready(ballast)

    report("first call, at the call", lambda: jax.jit(lambda a: jnp.tile(a, (2, 1)))(x))
    report("fast path, at the call", lambda: tile(x))
    report("at block_until_ready", lambda: double(x))

    def dispatch_wrapped():
        failed = jax.jit(lambda a: a * 3.0)(x)
        return failed + 1  # using a failed output: XLA:CPU wraps the error as INTERNAL

    report("wrapped by a later dispatch", dispatch_wrapped)
    del ballast
    gc.collect()

    deleted = jnp.ones(3)
    deleted.delete()
    report("not an OOM: a deleted array", lambda: deleted + 1)
    inc = jax.jit(lambda a: a + 1)
    donated = jnp.ones(4)
    jax.block_until_ready(inc(donated))
    donated.delete()
    report("not an OOM: a donated buffer on the fast path", lambda: inc(donated))
    report("not an OOM: shapes", lambda: jnp.ones(3) @ jnp.ones(4))


if __name__ == "__main__":
    main()
