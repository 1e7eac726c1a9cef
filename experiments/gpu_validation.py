"""Validates on a real accelerator what DESIGN.md measured on CPU, in under 5 minutes.

Run on a machine with one GPU (an H200 was the target), or on a CPU as a smoke test:

    python experiments/gpu_validation.py            # GPU: experiments/results/gpu_validation.json
    python experiments/gpu_validation.py --smoke    # CPU, tiny shapes, well under a minute
    python experiments/gpu_validation.py --out PATH --only search_vs_brute_force

Without ``--smoke`` on a machine without a GPU it exits with a one-line message. Each
check runs in a child process (this file, run again with a hidden ``--child NAME``), so
that its environment variables are set before JAX starts and a crash or a hang of one
check (a subprocess timeout) is recorded as that check's error while the others go on.
A child prints ``RESULT {json}`` lines (the last one counts; a long check prints its
partial result as it goes, so a timeout keeps what was measured). With ``--smoke`` every
child runs on the CPU (``JAX_PLATFORMS=cpu``) and the out-of-memory errors are made real
with the trick of DESIGN.md: after JAX has started the child limits its address space to
its VmSize plus a margin (``RLIMIT_AS``), with YNNPACK turned off
(``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=``); those children use elementwise
operations only (no matmul: a library's scratch allocation can abort the process).

The JSON file:

* ``mode``: ``"gpu"`` or ``"smoke"``; ``total_seconds``: the whole run;
  ``device``: what a child saw (``backend``, ``device_kind``, ``platform``, ``jax``,
  ``flax``, ``optax``, ``memory_stats``: the device's ``bytes_limit`` and friends, null
  on a CPU).
* ``checks``: one entry per check, each with ``error`` (null when the check ran; else the
  exception, a timeout or a crash with the end of its stderr), ``seconds``, ``env`` (the
  variables set for the child) and ``result``:

  * ``oom_preallocate_false`` (``XLA_PYTHON_CLIENT_PREALLOCATE=false``) and
    ``oom_mem_fraction`` (``XLA_PYTHON_CLIENT_MEM_FRACTION=0.25``): ``limit_bytes``
    (the device's ``bytes_limit``, or on a CPU the address-space margin) and
    ``limit_source``; ``fits_ok`` (an allocation of a quarter of the limit ran);
    ``requested_bytes`` (1.5x the limit); ``attempts``: the first call and a second one
    (the compiled fast path), each with ``caught``, ``is_oom``
    (``jax_adaptive.is_oom`` of the error), ``error_type`` and ``error_head`` (its
    first 200 characters); ``is_oom``: true when every attempt was caught as an OOM.
  * ``search_vs_brute_force``: ``target_batch_size`` T, ``memory_limit`` L (chosen
    between the ledger totals at 1 and T), ``micro_batch_size`` and ``compiles`` of an
    ``AdaptiveTrainer(memory_limit=L, plan_cache=False)``, its ``search_log``,
    ``brute_force`` (the largest size in [1, T] whose ``trainer.ledger(size).total``
    is at most L, every size compiled), ``ledgers`` (those totals by size),
    ``estimates`` (the micro-step's own ``estimate_peak_bytes`` by size, for
    comparison), ``monotone`` (whether the ledgers never decrease), ``equal`` and
    ``loss`` (one update at that size).
  * ``estimate_vs_peak``: ``sizes``, one fresh child per micro-batch size (a peak cannot
    be reset): ``estimate`` (``estimate_peak_bytes`` of the micro-step), ``report``
    (XLA's memory analysis), ``bytes_in_use_before`` (after ``init``, before the step),
    ``peak_bytes_in_use`` (after one ``trainer.step``, micro-step and optimizer step),
    ``peak_increase`` (their difference) and ``estimate_over_peak``; the device
    figures are null where ``memory_stats()`` is None (a CPU), as ``note`` says.
  * ``donation_after_oom``: a jitted function with ``donate_argnums=0`` whose
    intermediate (kept whole by an optimization barrier) exceeds the limit:
    ``control_deleted`` (the donated input is deleted after a run that fits: donation
    is in effect), ``caught``, ``is_oom``, ``error_type``, ``error_head``,
    ``donated_deleted`` (``is_deleted()`` of the input after the failure: a bool),
    ``reuse_ok`` / ``reuse_error`` (the input used again), ``temp_bytes`` (XLA's
    temporary bytes of the failing program).
  * ``resnet50_throughput``: ResNet-50 (``jax_adaptive.models.ResNet50``, bfloat16
    parameters and compute, 224x224; with ``--smoke`` one bottleneck block of 8
    filters at 32x32), a fixed micro-batch per size through ``AdaptiveTrainer`` with
    ``target_batch_size`` the largest size: per size ``init_seconds`` (compiles),
    ``warmup``, ``timed_updates``, ``updates_per_s``, ``micro_steps_per_s``,
    ``images_per_s``, ``estimate`` and ``peak_bytes_in_use``; ``skipped``: the sizes
    the time box (``budget_seconds``) left out.
  * ``adam_ledger``: the plan of ``AdaptiveTrainer(loss, optax.adam(1e-3),
    target_batch_size=T, plan_cache=False)`` for a model whose Adam moments are a large
    share of memory (an embedding of 2^30 float32 parameters on a GPU, with the
    autotuner off: ``--xla_gpu_autotune_level=0``, see ``GPU_XLA_FLAGS``), planned with
    no ``memory_limit`` on a GPU (the device's capacity) and, with ``--smoke``, with
    ``memory_limit`` between the ledgers of T/2 and T/2 + 1 (a CPU gives no capacity),
    then two updates. ``target_batch_size``, ``memory_limit`` (null on a GPU),
    ``capacity`` (``trainer.capacity()``), ``micro_batch_size``, ``accumulation_steps``,
    ``compiles`` (by ``init``), ``init_seconds``, ``search_log`` (rows of size, fits,
    estimated_bytes, decided_by, state_bytes, in_flight_bytes, program_bytes);
    ``ledger`` (the planned size's ``state``, ``in_flight``, ``program`` and ``total``),
    ``next_size`` and ``next_ledger_total`` (one example more: above the capacity when
    the plan is the exact max); ``program_estimate`` and ``next_program_estimate``
    (``estimate_peak_bytes`` of those sizes' micro-steps: the estimate before the
    ledger), ``missed_by_program_estimate`` (ledger total less it) and
    ``old_estimate_takes_next`` (whether that estimate would have let the next size in);
    ``params_bytes``, ``moments_bytes`` (the inner optimizer state: Adam's count, mu
    and nu) and ``state_bytes_live`` (``nbytes`` of every leaf of the live train state;
    the ledger's state part adds the running totals of the metrics). Device figures
    (null on a CPU): ``bytes_limit``, ``bytes_in_use_before`` and ``peak_before_step``
    (after ``init``, before the updates), ``peak_bytes_in_use`` (after them) and
    ``peak_rose_in_step`` (the peak is the process's since it started: it is the
    updates' only where it rose); ``trainer_peak`` (the peak less what arrays other than
    the train state held before the updates: the figure the ledger is comparable with),
    ``ledger_over_trainer_peak`` (at least 1 where the ledger is an upper bound),
    ``ledger_over_peak`` (against the raw peak) and
    ``program_estimate_over_trainer_peak``. Then ``updates``, ``sizes_per_update``,
    ``run_decisions_per_update`` (the ``search_log`` rows decided by a real
    out-of-memory, counted after each update), ``fits_first_run`` (none at the first
    update, which ran at the planned size), ``host_bytes`` and ``loss``.
  * ``speed``: time per update (ms, medians of interleaved rounds; ratios taken round
    by round, ``q1``/``median``/``q3``). ``cases``: dispatch.py's MLPs (T = 1024, Adam;
    micro-batch 8 on a 128-wide, 512 on a 2048-wide; 64 with ``--smoke``): the
    trainer with a host and a device batch, with ``chunk=1``, and ``optax.microbatch``
    given either batch; ``host_batch``, ``device_batch`` and ``chunk1`` are the
    trainer's ratios to the optax step given the same batch, ``chunk`` and ``fused``
    the plan's. ``cnn``: the zoo CNN (T = 1024, micro-batch 128) with ``chunk="auto"``
    against ``chunk=1`` (``auto_over_one``; ``chunk_taken``: a CPU times the chunk and
    drops it when much slower, elsewhere it is taken untimed). ``loader``:
    loader_overlap.py's loop at micro-batch 8: ``fit`` reading ahead and not, and a
    ``trainer.step`` loop reading ahead, each over a hand-written ``optax.microbatch``
    loop on the same loader (``over_optax_loop``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHECKS = (
    "oom_preallocate_false",
    "oom_mem_fraction",
    "search_vs_brute_force",
    "estimate_vs_peak",
    "donation_after_oom",
    "resnet50_throughput",
    "adam_ledger",
    "speed",
)
CHECK_ENV: dict[str, dict[str, str]] = {
    "oom_preallocate_false": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "oom_mem_fraction": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25"},
}
SMOKE_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type="}
# Flags added to XLA_FLAGS on a GPU only. The autotuner runs each candidate GEMM on
# buffers of the real shapes while the train state is live: at adam_ledger's sizes that
# is tens of GB outside any program's memory analysis (it would set the peak, or fail a
# compile), and seconds per compile.
GPU_XLA_FLAGS = {"adam_ledger": "--xla_gpu_autotune_level=0"}
# The subprocess timeouts in seconds, on a GPU and with --smoke.
TIMEOUTS = {"gpu": 150, "smoke": 120}
RESNET_TIMEOUT = {"gpu": 240, "smoke": 150}
MARGIN = 300 * 2**20  # the address space a smoke OOM child may still take, in bytes
PEAK_SIZES = {"gpu": (64, 256, 1024), "smoke": (8,)}
RESNET = {
    "gpu": {"model": "ResNet50", "image": 224, "sizes": (32, 64, 128, 256), "warmup": 2,
            "timed": 10, "timed_seconds": 10.0, "budget_seconds": 90.0},
    "smoke": {"model": "ResNetSmoke", "image": 32, "sizes": (4,), "warmup": 1, "timed": 1,
              "timed_seconds": 10.0, "budget_seconds": 60.0},
}  # fmt: skip
SEARCH = {  # the model of search_vs_brute_force and estimate_vs_peak
    "gpu": {"target": 64, "length": 256, "d_in": 64, "width": 256},
    "smoke": {"target": 10, "length": 32, "d_in": 16, "width": 32},
}
# The model of adam_ledger. On the GPU: an embedding of 2^30 float32 parameters (4 GiB;
# with Adam's mu and nu and the accumulator 16 GiB of resident state), and per example
# L x width activations (about 17 MB measured on a CPU), so that the largest micro-batch
# (near 5,000 on an H200 in the default 75% of its memory) is well below the target
# even if the GPU keeps a quarter of what the CPU does; one matmul of 64 x width per
# position keeps each micro-step at a few TFLOP.
ADAM = {
    "gpu": {"target": 32768, "length": 256, "vocab": 2**24, "embed": 64, "width": 4096},
    "smoke": {"target": 16, "length": 32, "vocab": 4096, "embed": 8, "width": 256},
}
# The speed check: dispatch.py's MLP cases (micro-batch, width; T = 1024), the zoo CNN's
# chunks (its T and micro-batch) and loader_overlap.py's loop (its micro-batch, width).
SPEED = {
    "gpu": {"cases": {"8": (8, 128), "512-wide": (512, 2048)}, "rounds": 11, "per_round": 3,
            "cnn": (1024, 128), "loader": (8, 128), "loader_rounds": 5, "loader_updates": 10},
    "smoke": {"cases": {"64": (64, 128)}, "rounds": 2, "per_round": 1,
              "cnn": (64, 8), "loader": (64, 128), "loader_rounds": 2, "loader_updates": 2},
}  # fmt: skip
LOG_FIELDS = (  # adam_ledger's search_log columns
    "size", "fits", "estimated_bytes", "decided_by", "state_bytes", "in_flight_bytes",
    "program_bytes",
)  # fmt: skip


# --------------------------------------------------------------------- in the child


def _emit(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def _vmsize() -> int:
    """Returns the process's address space in bytes (the base of an RLIMIT_AS limit)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _memory_stats(device: Any) -> dict[str, int] | None:
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError):
        return None
    if not stats:
        return None
    keys = ("bytes_limit", "bytes_in_use", "peak_bytes_in_use", "bytes_reservable_limit")
    return {k: int(stats[k]) for k in keys if k in stats}


def _oom_limit() -> tuple[int, str]:
    """Returns the bytes an allocation must exceed to fail, and where the limit comes from.

    On a GPU this is the device's ``bytes_limit``. On a CPU JAX is started and the
    process's address space is then limited to its VmSize plus `MARGIN` (DESIGN.md), so
    an allocation above the margin is a real out-of-memory error of XLA:CPU.
    """
    import gc
    import resource

    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    # JAX has started: its threads and pools exist. XLA makes its compile thread pool at
    # its first compile, not at a compilation cache's hit, so a smoke child has no cache
    # (spawn): a pool made under the limit aborted the process ("Thread
    # tf_xla-cpu-codegen creation via pthread_create() failed").
    jnp.zeros(8).block_until_ready()
    stats = _memory_stats(device)
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"], "memory_stats()['bytes_limit']"
    gc.collect()
    resource.setrlimit(resource.RLIMIT_AS, (_vmsize() + MARGIN, resource.RLIM_INFINITY))
    return MARGIN, "RLIMIT_AS: VmSize after JAX started + margin"


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Runs ``fn`` (which blocks on its result) and describes the error it raised, if any."""
    import jax_adaptive as ja

    try:
        fn()
    except Exception as exc:
        return {
            "caught": True,
            "is_oom": ja.is_oom(exc),
            "error_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "error_head": str(exc)[:200],
        }
    return {"caught": False, "is_oom": False, "error_type": None, "error_head": None}


def child_oom(smoke: bool, size: int | None) -> dict[str, Any]:
    """An allocation of 1.5x the limit: caught, and recognised by ``is_oom``."""
    import jax
    import jax.numpy as jnp

    limit, source = _oom_limit()
    row = 2**24  # float32 elements a row: 64 MiB
    fill = jax.jit(lambda v, rows: jnp.broadcast_to(v, (rows, row)) * 2.0, static_argnums=1)
    small_rows = max(1, limit // 4 // (4 * row))
    fits = _attempt(lambda: fill(jnp.float32(1.0), small_rows).block_until_ready())
    rows = -(-3 * limit // 2 // (4 * row))
    big = jnp.float32(1.0)
    attempts = [_attempt(lambda: fill(big, rows).block_until_ready()) for _ in range(2)]
    return {
        "limit_bytes": limit,
        "limit_source": source,
        "fits_ok": not fits["caught"],
        "fits_bytes": small_rows * row * 4,
        "requested_bytes": rows * row * 4,
        "attempts": attempts,
        "is_oom": all(a["caught"] and a["is_oom"] for a in attempts),
        "memory_stats": _memory_stats(jax.devices()[0]),
    }


def _position_mlp(smoke: bool, size: int) -> tuple[Any, Any, dict[str, Any]]:
    """A linen MLP applied at each of L positions, then pooled: activations dominate.

    Its memory grows with the micro-batch much faster than its parameters and optimizer
    state weigh, as in the models the trainer is for, so that a memory limit between
    the estimates at 1 and T leaves the optimizer step room and the search real work.

    Returns:
        ``(loss_fn, params, batch)``: the per-example loss (with accuracy as aux), the
        parameters and a batch of ``size`` examples.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_adaptive.models import linen_classifier_loss

    cfg = SEARCH["smoke" if smoke else "gpu"]

    class PositionMLP(nn.Module):
        width: int

        @nn.compact
        def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
            x = nn.relu(nn.Dense(self.width)(x))
            x = nn.relu(nn.Dense(self.width)(x))
            return nn.Dense(10)(jnp.mean(x, axis=1))

    model = PositionMLP(cfg["width"])
    shape = (cfg["length"], cfg["d_in"])
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, *shape)))["params"]
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.normal(size=(size, *shape)).astype(np.float32),
        "label": rng.integers(0, 10, size).astype(np.int32),
    }
    return linen_classifier_loss(model), params, batch


def child_search(smoke: bool, size: int | None) -> dict[str, Any]:
    """The trainer's searched size against a scan of every size's estimate."""
    import optax

    import jax_adaptive as ja

    target = SEARCH["smoke" if smoke else "gpu"]["target"]
    loss_fn, params, batch = _position_mlp(smoke, target)
    # objective="max": the plan is the largest size that fits, what is checked here.
    kwargs = {"target_batch_size": target, "has_aux": True, "plan_cache": False, "objective": "max"}
    probe = ja.AdaptiveTrainer(loss_fn, optax.adam(1e-3), micro_batch_size=1, **kwargs)
    probe.init(params, batch)
    # The trainer compares each size's ledger (the whole train state too) with the
    # limit, so the brute force scans ledgers.
    low = max(probe.ledger(s).total for s in (1, 2))
    high = probe.ledger(target).total
    limit = low + (high - low) * 3 // 5  # the answer lies well inside [1, T]
    # The search with rounds of 4 sizes compiled side by side, then one at a time (the
    # default): the same size, and the wall time of each (JAX_ADAPTIVE_COMPILE_WORKERS).
    rounds = {}
    for workers in (4, 1):
        os.environ["JAX_ADAPTIVE_COMPILE_WORKERS"] = str(workers)
        trainer = ja.AdaptiveTrainer(loss_fn, optax.adam(1e-3), memory_limit=limit, **kwargs)
        began = time.perf_counter()
        state = trainer.init(params, batch)
        rounds[workers] = {
            "init_seconds": time.perf_counter() - began,
            "compiles": trainer.compiles,
            "micro_batch_size": trainer.micro_batch_size,
        }
    searched, compiles = trainer.micro_batch_size, trainer.compiles
    log = [[t.size, t.fits, t.estimated_bytes, t.decided_by] for t in trainer.search_log]
    _, metrics = trainer.step(state, batch)
    sizes = range(1, target + 1)
    ledgers = {s: trainer.ledger(s).total for s in sizes}
    estimates = {s: ja.estimate_peak_bytes(trainer.compile(s)) for s in sizes}
    fitting = [s for s, total in ledgers.items() if total <= limit]
    brute = max(fitting) if fitting else None
    values = list(ledgers.values())
    return {
        "target_batch_size": target,
        "memory_limit": limit,
        "micro_batch_size": searched,
        "compiles": compiles,
        "rounds_of_4": rounds[4],
        "rounds_of_4_over_serial": rounds[4]["init_seconds"] / rounds[1]["init_seconds"],
        "search_log": log,
        "brute_force": brute,
        "equal": searched == brute,
        "monotone": all(a <= b for a, b in itertools.pairwise(values)),
        "ledgers": ledgers,
        "estimates": estimates,
        "loss": float(metrics["loss"]),
    }


def child_peak(smoke: bool, size: int | None) -> dict[str, Any]:
    """One micro-batch size's estimate against the device's peak bytes in use."""
    import jax
    import optax

    import jax_adaptive as ja
    from jax_adaptive.memory import memory_report

    assert size is not None, "estimate_vs_peak needs --size"
    loss_fn, params, batch = _position_mlp(smoke, size)
    trainer = ja.AdaptiveTrainer(
        loss_fn,
        optax.adam(1e-3),
        target_batch_size=size,
        micro_batch_size=size,
        has_aux=True,
        plan_cache=False,
    )
    state = trainer.init(params, batch)
    compiled = trainer.compile(size)
    estimate = ja.estimate_peak_bytes(compiled)
    device = jax.devices()[0]
    before = _memory_stats(device)
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready((state, metrics))
    after = _memory_stats(device)
    peak = after.get("peak_bytes_in_use") if after else None
    in_use = before.get("bytes_in_use") if before else None
    return {
        "size": size,
        "estimate": estimate,
        "report": memory_report(compiled),
        "bytes_in_use_before": in_use,
        "peak_bytes_in_use": peak,
        "peak_increase": None if peak is None or in_use is None else peak - in_use,
        "estimate_over_peak": None if not peak else estimate / peak,
        "loss": float(metrics["loss"]),
    }


def _embedding_classifier(smoke: bool) -> tuple[Any, Any, dict[str, Any]]:
    """A linen embedding, one wide layer per position, then pooled: Adam's state is big.

    The embedding's parameters, their gradient accumulator and Adam's two moments are
    most of the resident state, and the micro-step reads none of the moments (XLA
    prunes them from its memory analysis); the activations grow with the micro-batch.

    Returns:
        ``(loss_fn, params, batch)``: the per-example loss (with accuracy as aux), the
        parameters and a host batch of ``target`` examples.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_adaptive.models import linen_classifier_loss

    cfg = ADAM["smoke" if smoke else "gpu"]

    class EmbeddingClassifier(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
            x = nn.Embed(cfg["vocab"], cfg["embed"])(tokens)
            x = nn.relu(nn.Dense(cfg["width"])(x))
            return nn.Dense(10)(jnp.mean(x, axis=1))

    model = EmbeddingClassifier()
    tokens = jnp.zeros((1, cfg["length"]), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    rng = np.random.default_rng(0)
    target = cfg["target"]
    batch = {  # on the host: the trainer moves one micro-batch at a time
        "tokens": rng.integers(0, cfg["vocab"], (target, cfg["length"]), dtype=np.int32),
        "label": rng.integers(0, 10, target).astype(np.int32),
    }
    return linen_classifier_loss(model, image_key="tokens"), params, batch


def child_adam_ledger(smoke: bool, size: int | None) -> dict[str, Any]:
    """An Adam plan whose moments are a large share of memory, against the device's peak."""
    import jax
    import optax

    import jax_adaptive as ja

    target = ADAM["smoke" if smoke else "gpu"]["target"]
    loss_fn, params, batch = _embedding_classifier(smoke)
    # objective="max": the plan is the largest size that fits, what is checked here.
    kwargs = {"target_batch_size": target, "has_aux": True, "plan_cache": False, "objective": "max"}
    limit = None
    if smoke:  # a CPU gives no capacity: a limit between the ledgers of T/2 and T/2 + 1
        probe = ja.AdaptiveTrainer(loss_fn, optax.adam(1e-3), micro_batch_size=1, **kwargs)
        probe.init(params, batch)
        half = target // 2
        limit = (probe.ledger(half).total + probe.ledger(half + 1).total) // 2
        del probe
    device = jax.devices()[0]
    trainer = ja.AdaptiveTrainer(loss_fn, optax.adam(1e-3), memory_limit=limit, **kwargs)
    began = time.perf_counter()
    state = trainer.init(params, batch)
    # The caller's parameters would stay live beside the state's copy after the first
    # update (the optimizer step replaces them): drop them, as a training script does.
    del params
    init_seconds, compiles = time.perf_counter() - began, trainer.compiles
    plan = trainer.plan_info
    micro = plan.micro_batch_size
    ledger = trainer.ledger(micro)
    estimate = ja.estimate_peak_bytes(trainer.compile(micro))
    above = micro + 1 if micro < target else None
    next_ledger = None if above is None else trainer.ledger(above).total
    next_estimate = None if above is None else ja.estimate_peak_bytes(trainer.compile(above))
    live = sum(x.nbytes for x in jax.tree.leaves(state))
    moments = sum(x.nbytes for x in jax.tree.leaves(state.opt_state.inner_opt_state))
    capacity = trainer.capacity()
    result: dict[str, Any] = {
        "target_batch_size": target,
        "memory_limit": limit,
        "capacity": capacity,
        "micro_batch_size": micro,
        "accumulation_steps": plan.accumulation_steps,
        "compiles": compiles,
        "init_seconds": round(init_seconds, 2),
        "search_log": [[getattr(t, f) for f in LOG_FIELDS] for t in trainer.search_log],
        "ledger": {**ledger._asdict(), "total": ledger.total},
        "next_size": above,
        "next_ledger_total": next_ledger,
        "program_estimate": estimate,
        "next_program_estimate": next_estimate,
        "missed_by_program_estimate": ledger.total - estimate,
        "old_estimate_takes_next": (
            None if capacity is None or next_estimate is None else next_estimate <= capacity
        ),
        "params_bytes": sum(x.nbytes for x in jax.tree.leaves(state.params)),
        "moments_bytes": moments,
        "state_bytes_live": live,
    }
    _emit(result)  # a timeout in the steps keeps the plan
    before = _memory_stats(device) or {}
    in_use = before.get("bytes_in_use")
    sizes, runs = [], []
    for _ in range(2):
        state, metrics = trainer.step(state, batch)
        sizes.append(int(metrics["micro_batch_size"]))  # blocks on the update
        runs.append(sum(t.decided_by == "run" for t in trainer.search_log))
    after = _memory_stats(device) or {}
    peak, peak_before = after.get("peak_bytes_in_use"), before.get("peak_bytes_in_use")
    # The ledger counts the trainer's state and what its micro-steps add, not the
    # arrays others hold: compare it with the peak less those (in use before the step
    # less the live state). The peak is the process's since it started, so it is the
    # step's only where it rose above its value before the step.
    others = None if in_use is None else in_use - live
    trainer_peak = None if peak is None or others is None else peak - others
    result |= {
        "bytes_limit": before.get("bytes_limit"),
        "bytes_in_use_before": in_use,
        "peak_before_step": peak_before,
        "peak_bytes_in_use": peak,
        "peak_rose_in_step": None if peak is None or peak_before is None else peak > peak_before,
        "trainer_peak": trainer_peak,
        "ledger_over_peak": None if not peak else ledger.total / peak,
        "ledger_over_trainer_peak": None if not trainer_peak else ledger.total / trainer_peak,
        "program_estimate_over_trainer_peak": (
            None if not trainer_peak else estimate / trainer_peak
        ),
        "updates": int(state.updates),
        "sizes_per_update": sizes,
        "run_decisions_per_update": runs,
        "fits_first_run": runs[0] == 0 and sizes[0] == micro,
        "host_bytes": trainer.host_bytes,
        "loss": float(metrics["loss"]),
    }
    return result


def child_donation(smoke: bool, size: int | None) -> dict[str, Any]:
    """Whether a donated input survives a real out-of-memory error of the donating call."""
    import warnings

    import jax
    import jax.numpy as jnp

    from jax_adaptive.memory import memory_report

    warnings.simplefilter("ignore")  # "donated buffers were not usable", if any
    n = 2**20 if smoke else 2**24

    def run(x: Any, rows: int) -> Any:
        y = jax.lax.optimization_barrier(jnp.broadcast_to(x, (rows, n)) * 2.0)
        return x + 1.0, jnp.sum(y, axis=0)

    limit, source = _oom_limit()
    f = jax.jit(run, donate_argnums=0, static_argnums=1)
    control = jnp.ones(n)
    jax.block_until_ready(f(control, 2))
    rows = -(-3 * limit // 2 // (4 * n))
    x = jnp.ones(n)
    x.block_until_ready()
    temp = memory_report(f.lower(x, rows).compile())["temp"]
    outcome = _attempt(lambda: jax.block_until_ready(f(x, rows)))
    deleted = bool(x.is_deleted())
    reuse = _attempt(lambda: (x + 0.0).block_until_ready())
    return {
        "limit_bytes": limit,
        "limit_source": source,
        "control_deleted": bool(control.is_deleted()),
        "temp_bytes": temp,
        **outcome,
        "donated_deleted": deleted,
        "reuse_ok": not reuse["caught"],
        "reuse_error": reuse["error_head"],
    }


def child_resnet(smoke: bool, size: int | None) -> dict[str, Any]:
    """Updates, micro-steps and images per second of a ResNet at a few micro-batch sizes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jax_adaptive as ja
    from jax_adaptive import models

    cfg = RESNET["smoke" if smoke else "gpu"]
    start = time.perf_counter()
    if cfg["model"] == "ResNet50":
        model = models.ResNet50(num_classes=1000, dtype=jnp.bfloat16)
    else:  # the same bottleneck blocks, fewer: compiling ResNet-50 takes a CPU 20 s
        model = models.ResNet(
            stage_sizes=(1,), block="bottleneck", num_filters=8, num_classes=1000,
            dtype=jnp.bfloat16,
        )  # fmt: skip
    side, target = cfg["image"], max(cfg["sizes"])
    image = jnp.zeros((1, side, side, 3), jnp.bfloat16)
    variables = jax.jit(model.init)(jax.random.key(0), image)
    to_bf16 = jax.jit(lambda tree: jax.tree.map(lambda p: p.astype(jnp.bfloat16), tree))
    params = to_bf16(variables["params"])
    model_state = {"batch_stats": variables["batch_stats"]}
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    batch = jax.device_put(
        {
            "image": jnp.asarray(rng.normal(size=(target, side, side, 3)), jnp.bfloat16),
            "label": jnp.asarray(rng.integers(0, 1000, target), jnp.int32),
        },
        device,
    )
    loss_fn = models.linen_classifier_loss(model, mutable=("batch_stats",))
    result: dict[str, Any] = {
        "model": cfg["model"],
        "image": side,
        "dtype": "bfloat16",
        "target_batch_size": target,
        "budget_seconds": cfg["budget_seconds"],
        "sizes": [],
        "skipped": [],
    }
    last = 0.0
    for micro in cfg["sizes"]:
        elapsed = time.perf_counter() - start
        if result["sizes"] and elapsed + last > cfg["budget_seconds"]:
            result["skipped"].append(micro)
            continue
        began = time.perf_counter()
        trainer = ja.AdaptiveTrainer(
            loss_fn,
            optax.sgd(0.1, momentum=0.9),
            target_batch_size=target,
            micro_batch_size=micro,
            has_aux=True,
            has_state=True,
            plan_cache=False,
        )
        state = trainer.init(params, batch, model_state=model_state)
        init_seconds = time.perf_counter() - began
        for _ in range(cfg["warmup"]):
            state, metrics = trainer.step(state, batch)
        jax.block_until_ready(state)
        timed, t0 = 0, time.perf_counter()
        while timed < cfg["timed"] and (
            timed == 0 or time.perf_counter() - t0 < cfg["timed_seconds"]
        ):
            state, metrics = trainer.step(state, batch)
            timed += 1
        jax.block_until_ready((state, metrics))
        seconds = time.perf_counter() - t0
        stats = _memory_stats(device)
        result["sizes"].append(
            {
                "micro_batch_size": micro,
                "accumulation_steps": trainer.accumulation_steps,
                "init_seconds": round(init_seconds, 2),
                "warmup": cfg["warmup"],
                "timed_updates": timed,
                "seconds": round(seconds, 4),
                "updates_per_s": timed / seconds,
                "micro_steps_per_s": timed * trainer.accumulation_steps / seconds,
                "images_per_s": timed * target / seconds,
                "estimate": ja.estimate_peak_bytes(trainer.compile(micro)),
                "peak_bytes_in_use": stats.get("peak_bytes_in_use") if stats else None,
                "loss": float(metrics["loss"]),
            }
        )
        last = time.perf_counter() - began
        _emit(result)  # a timeout keeps the sizes measured so far
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def _speed_cases(cfg: dict[str, Any], result: dict[str, Any]) -> None:
    """The trainer against ``optax.microbatch`` on dispatch.py's MLPs, into ``result``."""
    import dispatch

    for case, (m, width) in cfg["cases"].items():
        params, loss = dispatch.mlp(width)
        variants, trainer = dispatch.against_optax(params, loss, m, dispatch.batch_of())
        times = dispatch.measure(variants, cfg["rounds"], cfg["per_round"])
        result["cases"][case] = {
            "micro_batch_size": m,
            "hidden_width": width,
            "chunk": trainer.plan_info.chunk,
            "fused": trainer.plan_info.fused,
            "ms_per_update": {n: 1e3 * statistics.median(t) for n, t in times.items()},
            "host_batch": dispatch.paired(times, "trainer", "optax_microbatch_host"),
            "device_batch": dispatch.paired(times, "trainer_device", "optax_microbatch"),
            "chunk1": dispatch.paired(times, "trainer_chunk1", "optax_microbatch_host"),
            "program": dispatch.paired(times, "trainer_program", "optax_microbatch"),
            "host_ms_per_update": dispatch.host_ms_per_update(times),
        }
        _emit(result)  # a timeout keeps the cases measured so far


def _speed_cnn(cfg: dict[str, Any], result: dict[str, Any]) -> None:
    """The zoo CNN's update with ``chunk="auto"`` against ``chunk=1``, into ``result``."""
    import dispatch
    import jax
    import optax

    import jax_adaptive as ja
    from jax_adaptive import models
    from jax_adaptive.data import synthetic_images

    target, micro = cfg["cnn"]
    model = models.CNN(num_classes=10)
    data = jax.device_put(synthetic_images(target))
    params = model.init(jax.random.key(0), data["image"][:1])["params"]
    variants, trainers = {}, {}
    for chunk in ("auto", 1):
        trainer = ja.AdaptiveTrainer(
            models.linen_classifier_loss(model), optax.adam(1e-3), target_batch_size=target,
            micro_batch_size=micro, chunk=chunk, has_aux=True, plan_cache=False,
        )  # fmt: skip
        box = [trainer.init(params, data, rng=jax.random.key(0))]

        def update(trainer: ja.AdaptiveTrainer = trainer, box: list[Any] = box) -> None:
            box[0], _ = trainer.step(box[0], data)
            jax.block_until_ready(box[0].params)

        variants[f"chunk_{chunk}"], trainers[chunk] = update, trainer
    times = dispatch.measure(variants, cfg["rounds"], cfg["per_round"])
    result["cnn"] = {
        "target_batch_size": target,
        "micro_batch_size": micro,
        "chunk_taken": trainers["auto"].plan_info.chunk,  # a CPU times it (update.py)
        "ms_per_update": {n: 1e3 * statistics.median(t) for n, t in times.items()},
        "auto_over_one": dispatch.paired(times, "chunk_auto", "chunk_1"),
    }
    _emit(result)


def _speed_loader(cfg: dict[str, Any], result: dict[str, Any]) -> None:
    """``fit`` reading ahead, and not, against a plain loop over one loader, into ``result``."""
    import dispatch
    import loader_overlap

    m, width = cfg["loader"]
    params, loss = dispatch.mlp(width)
    batches = loader_overlap.loader(dispatch.batch_of(), passes=20)
    runs = {
        "optax_loop": loader_overlap.optax_loop(params, loss, m),
        **loader_overlap.trainer_runs(params, loss, m),
    }
    times = loader_overlap.measure(runs, batches, cfg["loader_rounds"], cfg["loader_updates"])
    result["loader"] = {
        "micro_batch_size": m,
        "hidden_width": width,
        "ms_per_update": {n: 1e3 * statistics.median(t) for n, t in times.items()},
        "over_optax_loop": {
            n: dispatch.paired(times, n, "optax_loop") for n in runs if n != "optax_loop"
        },
    }


def child_speed(smoke: bool, size: int | None) -> dict[str, Any]:
    """Time per update: the trainer against a hand-written loop, chunks, reading ahead."""
    sys.path.insert(0, str(REPO / "experiments"))
    cfg = SPEED["smoke" if smoke else "gpu"]
    start = time.perf_counter()
    result: dict[str, Any] = {"target_batch_size": 1024, "cases": {}}
    _speed_cases(cfg, result)
    _speed_cnn(cfg, result)
    _speed_loader(cfg, result)
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def child_probe(smoke: bool, size: int | None) -> dict[str, Any]:
    """What the children run on: backend, device kind, versions, memory stats."""
    import flax
    import jax
    import optax

    device = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "memory_stats": _memory_stats(device),
    }


CHILDREN: dict[str, Callable[[bool, int | None], dict[str, Any]]] = {
    "probe": child_probe,
    "oom_preallocate_false": child_oom,
    "oom_mem_fraction": child_oom,
    "search_vs_brute_force": child_search,
    "estimate_vs_peak": child_peak,
    "donation_after_oom": child_donation,
    "resnet50_throughput": child_resnet,
    "adam_ledger": child_adam_ledger,
    "speed": child_speed,
}


def run_child(name: str, smoke: bool, size: int | None) -> int:
    """Runs one check in this process and prints its ``RESULT`` line (an error's too)."""
    try:
        _emit(CHILDREN[name](smoke, size))
    except Exception as exc:
        _emit({"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()})
        return 1
    return 0


# -------------------------------------------------------------------- in the parent


def spawn(name: str, smoke: bool, timeout: float, size: int | None = None) -> dict[str, Any]:
    """Runs ``--child name`` in a subprocess and returns its record; never raises.

    Args:
        name: the check.
        smoke: run it on the CPU with tiny shapes.
        timeout: seconds before the child is killed.
        size: the micro-batch size, for the checks run once per size.

    Returns:
        ``{"error", "seconds", "env", "result"}``: ``result`` the child's last ``RESULT``
        (or None), ``error`` None when the child reported one without an error.
    """
    env_set = {**(SMOKE_ENV if smoke else {}), **CHECK_ENV.get(name, {})}
    added = env_set.get("XLA_FLAGS", GPU_XLA_FLAGS.get(name, "") if not smoke else "")
    flags = (os.environ.get("XLA_FLAGS", ""), added)  # added to the caller's flags
    env_set["XLA_FLAGS"] = " ".join(f for f in flags if f)
    env = {**os.environ, **env_set}
    if smoke:  # a hit loads a program without compiling: see _limit
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name]
    cmd += ["--smoke"] if smoke else []
    cmd += [] if size is None else ["--size", str(size)]
    began = time.perf_counter()
    error = None
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, code = _text(exc.stdout), _text(exc.stderr), None
        error = f"timeout: killed after {timeout:.0f} s"
    results = [line[7:] for line in stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(results[-1]) if results else None
    if isinstance(result, dict) and "error" in result:
        error = error or result.pop("error")
    elif error is None and (result is None or code != 0):
        error = f"child exited with {code} and {'a' if result else 'no'} RESULT line: "
        error += stderr.strip()[-1500:]
    return {
        "error": error,
        "seconds": round(time.perf_counter() - began, 2),
        "env": env_set,
        "result": result,
    }


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def run_checks(names: list[str], smoke: bool, jobs: int) -> dict[str, dict[str, Any]]:
    """Runs the checks' children (``jobs`` at a time) and gathers one record per check."""
    mode = "smoke" if smoke else "gpu"
    tasks: list[tuple[str, int | None, float]] = []
    for name in names:
        if name == "estimate_vs_peak":
            tasks += [(name, s, TIMEOUTS[mode]) for s in PEAK_SIZES[mode]]
        elif name == "resnet50_throughput":
            tasks.append((name, None, RESNET_TIMEOUT[mode]))
        else:
            tasks.append((name, None, TIMEOUTS[mode]))
    if jobs > 1:  # the longest first, so that none is left running alone at the end
        long = ("resnet50_throughput", "search_vs_brute_force")
        tasks.sort(key=lambda task: task[0] not in long)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [(n, s, pool.submit(spawn, n, smoke, t, s)) for n, s, t in tasks]
        records = [(n, s, f.result()) for n, s, f in futures]
    checks: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [(s, r) for n, s, r in records if n == name]
        if name != "estimate_vs_peak":
            checks[name] = mine[0][1]
            continue
        rows = [r["result"] or {"size": s} for s, r in mine]
        errors = [f"size {s}: {r['error']}" for s, r in mine if r["error"]]
        for (_, r), row in zip(mine, rows, strict=True):
            row["error"] = r["error"]
        stats = any(row.get("peak_bytes_in_use") is not None for row in rows)
        note = (
            "one fresh child per size; peak_bytes_in_use after one trainer.step"
            if stats
            else "memory_stats() is None on this backend: device figures are null"
        )
        checks[name] = {
            "error": "; ".join(errors) or None,
            "seconds": round(sum(r["seconds"] for _, r in mine), 2),
            "env": mine[0][1]["env"],
            "result": {"memory_stats_available": stats, "note": note, "sizes": rows},
        }
    return checks


def _summary_line(name: str, record: dict[str, Any]) -> str:
    r = record["result"] or {}
    head = f"{name:24s} {record['seconds']:7.1f}s  "
    if record["error"]:
        return head + "ERROR " + record["error"].splitlines()[0][:120]
    if name.startswith("oom_"):
        first = r["attempts"][0]
        return head + f"is_oom={r['is_oom']} limit={r['limit_bytes']:,} {first['error_type']}"
    if name == "search_vs_brute_force":
        return head + (
            f"searched={r['micro_batch_size']} brute={r['brute_force']} equal={r['equal']} "
            f"compiles={r['compiles']} monotone={r['monotone']}"
        )
    if name == "estimate_vs_peak":
        cells = [
            f"{row.get('size')}: est {row.get('estimate')} peak {row.get('peak_bytes_in_use')}"
            for row in r["sizes"]
        ]
        return head + "; ".join(cells)
    if name == "donation_after_oom":
        return head + (
            f"is_oom={r['is_oom']} donated_deleted={r['donated_deleted']} "
            f"control_deleted={r['control_deleted']}"
        )
    if name == "adam_ledger":
        ratio = r["ledger_over_trainer_peak"]
        return head + (
            f"size={r['micro_batch_size']}/{r['target_batch_size']} "
            f"ledger={r['ledger']['total']:,} capacity={r['capacity'] or 0:,} "
            f"program_estimate={r['program_estimate']:,} moments={r['moments_bytes']:,} "
            f"ledger/trainer_peak={'n/a' if ratio is None else f'{ratio:.3f}'} "
            f"sizes={r['sizes_per_update']} fits_first_run={r['fits_first_run']}"
        )
    if name == "speed":
        cases = [
            f"m={c['micro_batch_size']}: {c['host_batch']['median']:.3f}/"
            f"{c['device_batch']['median']:.3f}"
            for c in r["cases"].values()
        ]
        loader = r["loader"]["over_optax_loop"]
        return head + (
            "trainer/optax host/device " + ", ".join(cases)
            + f"; cnn chunk {r['cnn']['chunk_taken']} auto/1 "
            f"{r['cnn']['auto_over_one']['median']:.2f}; loader fit "
            f"{loader['fit_read_ahead']['median']:.2f} (read ahead) "
            f"{loader['fit_no_read_ahead']['median']:.2f} (not)"
        )  # fmt: skip
    cells = [f"{row['micro_batch_size']}: {row['images_per_s']:.0f} img/s" for row in r["sizes"]]
    return head + f"{r['model']} {r['image']}px " + "; ".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, < 1 minute")
    parser.add_argument("--out", help="the JSON file (default experiments/results/...)")
    parser.add_argument("--only", nargs="+", choices=CHECKS, help="run only these checks")
    parser.add_argument("--jobs", type=int, help="children at a time (GPU 1, smoke 2)")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_child(args.child, args.smoke, args.size)

    began = time.perf_counter()
    probe = spawn("probe", args.smoke, TIMEOUTS["gpu"])
    device = probe["result"] or {}
    if probe["error"]:
        print(f"gpu_validation: JAX did not start: {probe['error']}", file=sys.stderr)
        return 1
    if not args.smoke and device.get("backend") != "gpu":
        print(
            f"gpu_validation: needs a GPU (JAX sees {device.get('backend')!r}); "
            "run with --smoke to check the script on a CPU.",
            file=sys.stderr,
        )
        return 2
    names = list(args.only or CHECKS)
    jobs = args.jobs or (2 if args.smoke else 1)
    mode = "smoke" if args.smoke else "gpu"
    default = f"gpu_validation{'_smoke' if args.smoke else ''}.json"
    out = Path(args.out or REPO / "experiments" / "results" / default)
    print(f"gpu_validation ({mode}, {device.get('device_kind')}):", flush=True)
    checks: dict[str, dict[str, Any]] = {}
    # One check at a time (the GPU's way), each written as soon as it ends: a session
    # whose time runs out keeps every figure measured before (one lost them all).
    for group in [names] if jobs > 1 else [[name] for name in names]:
        for name, record in run_checks(group, args.smoke, jobs).items():
            checks[name] = record
            print("  " + _summary_line(name, record), flush=True)
        _write(out, mode, time.perf_counter() - began, device, checks)
    print(f"{time.perf_counter() - began:.1f} s; wrote {out}")
    return 0


def _write(out: Path, mode: str, seconds: float, device: dict, checks: dict) -> None:
    full = {"mode": mode, "total_seconds": round(seconds, 2), "device": device, "checks": checks}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(full, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
