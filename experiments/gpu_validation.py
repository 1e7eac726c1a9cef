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
    between the estimates at 1 and T), ``micro_batch_size`` and ``compiles`` of an
    ``AdaptiveTrainer(memory_limit=L, plan_cache=False)``, its ``search_log``,
    ``brute_force`` (the largest size in [1, T] whose ``estimate_peak_bytes`` is at
    most L, every size compiled), ``estimates`` (by size), ``monotone`` (whether the
    estimates never decrease), ``equal`` and ``loss`` (one update at that size).
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
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
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
)
CHECK_ENV: dict[str, dict[str, str]] = {
    "oom_preallocate_false": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "oom_mem_fraction": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25"},
}
SMOKE_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type="}
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
    jnp.zeros(8).block_until_ready()  # JAX has started: its threads and pools exist
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
    kwargs = {"target_batch_size": target, "has_aux": True, "plan_cache": False}
    probe = ja.AdaptiveTrainer(loss_fn, optax.adam(1e-3), micro_batch_size=1, **kwargs)
    probe.init(params, batch)
    low = max(ja.estimate_peak_bytes(probe.compile(s)) for s in (1, 2))
    high = ja.estimate_peak_bytes(probe.compile(target))
    limit = low + (high - low) * 3 // 5  # the answer lies well inside [1, T]
    trainer = ja.AdaptiveTrainer(loss_fn, optax.adam(1e-3), memory_limit=limit, **kwargs)
    state = trainer.init(params, batch)
    searched, compiles = trainer.micro_batch_size, trainer.compiles
    log = [[t.size, t.fits, t.estimated_bytes, t.decided_by] for t in trainer.search_log]
    _, metrics = trainer.step(state, batch)
    estimates = {s: ja.estimate_peak_bytes(trainer.compile(s)) for s in range(1, target + 1)}
    fitting = [s for s, e in estimates.items() if e <= limit]
    brute = max(fitting) if fitting else None
    values = list(estimates.values())
    return {
        "target_batch_size": target,
        "memory_limit": limit,
        "micro_batch_size": searched,
        "compiles": compiles,
        "search_log": log,
        "brute_force": brute,
        "equal": searched == brute,
        "monotone": all(a <= b for a, b in itertools.pairwise(values)),
        "estimates": estimates,
        "loss": float(metrics["loss"]),
    }


def child_peak(smoke: bool, size: int | None) -> dict[str, Any]:
    """One micro-batch size's estimate against the device's peak bytes in use."""
    import jax
    import optax

    import jax_adaptive as ja

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
        "report": ja.memory_report(compiled),
        "bytes_in_use_before": in_use,
        "peak_bytes_in_use": peak,
        "peak_increase": None if peak is None or in_use is None else peak - in_use,
        "estimate_over_peak": None if not peak else estimate / peak,
        "loss": float(metrics["loss"]),
    }


def child_donation(smoke: bool, size: int | None) -> dict[str, Any]:
    """Whether a donated input survives a real out-of-memory error of the donating call."""
    import warnings

    import jax
    import jax.numpy as jnp

    import jax_adaptive as ja

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
    temp = ja.memory_report(f.lower(x, rows).compile())["temp"]
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
    env = {**os.environ, **env_set}
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
    checks = run_checks(names, args.smoke, args.jobs or (2 if args.smoke else 1))
    mode = "smoke" if args.smoke else "gpu"
    default = f"gpu_validation{'_smoke' if args.smoke else ''}.json"
    out = Path(args.out or REPO / "experiments" / "results" / default)
    full = {
        "mode": mode,
        "total_seconds": round(time.perf_counter() - began, 2),
        "device": device,
        "checks": checks,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(full, indent=2) + "\n")
    print(f"gpu_validation ({mode}, {device.get('device_kind')}), {full['total_seconds']} s:")
    for name, record in checks.items():
        print("  " + _summary_line(name, record))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
