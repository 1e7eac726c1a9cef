"""Replicated, ZeRO-1 and FSDP train state on 8 CPU devices, under one memory limit.

A two-layer MLP (``D -> W -> D``, Adam) whose train state dominates a device's memory,
trained at a target batch ``T`` through `AdaptiveTrainer` on a one-axis ``data`` mesh of
8 CPU devices, three ways:

- ``replicated``: every device holds the parameters and the optimizer state;
- ``zero1``: the parameters replicated, the optimizer state split over ``data``
  (``opt_state_sharding``);
- ``fsdp``: the parameters, and with them the optimizer state, split over ``data``
  (``param_sharding``).

For each, under the same ``memory_limit`` (bytes per device): the largest micro-batch the
search finds (and the default plan's size: the fewest micro-steps it allows, with the
least padding), the ledger's bytes per device (the state, and the
plan's peak), the collectives per micro-step and per update the plan states (counted in
its compiled programs) and the median time per update (after a warm-up; CPU devices
share this machine's cores, so the time shows what the collectives and the micro-steps
cost here, not on a GPU).

    python experiments/sharded.py          # writes experiments/results/sharded.{json,png}
    python experiments/sharded.py --quick  # fewer updates
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jax_adaptive as ja

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 8
MODES = {
    "replicated": {},
    "zero1": {"opt_state_sharding": {"w1": P("data", None), "b1": P("data"), "w2": P("data")}},
    "fsdp": {"param_sharding": {"w1": P(None, "data"), "b1": P("data"), "w2": P("data")}},
}


def loss_fn(params: Any, batch: Any, rng: Any) -> jax.Array:
    """Per-example squared error of a tanh MLP applied at each of the ``L`` positions."""
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2, axis=(1, 2))


def problem(d: int, width: int, length: int, target: int, updates: int) -> tuple[Any, list]:
    """The parameters and ``updates`` host batches of ``target`` examples."""
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.normal(size=(d, width)) / np.sqrt(d)).astype(np.float32),
        "b1": np.zeros(width, np.float32),
        "w2": (rng.normal(size=(width, d)) / np.sqrt(width)).astype(np.float32),
    }
    batches = [
        {
            "x": rng.normal(size=(target, length, d)).astype(np.float32),
            "y": rng.normal(size=(target, length, d)).astype(np.float32),
        }
        for _ in range(updates)
    ]
    return params, batches


def run(mode: str, params: Any, batches: list, args: argparse.Namespace) -> dict[str, Any]:
    """One mode's figures: its plan under the limit and its time per update."""
    trainer = ja.AdaptiveTrainer(
        loss_fn, optax.adam(1e-3), target_batch_size=args.target, mesh=ja.data_mesh(),
        memory_limit=args.limit, plan_cache=False, **MODES[mode],
    )  # fmt: skip
    start = time.perf_counter()
    state = trainer.init(params, batches[0])
    plan_seconds = time.perf_counter() - start
    from common import timed_updates

    state, seconds = timed_updates(trainer, state, batches)
    plan = trainer.plan_info
    steps = plan.accumulation_steps
    return {
        "largest_micro_batch": plan.largest,
        "micro_batch": plan.micro_batch_size,
        "micro_steps": steps,
        "state_bytes_per_device": plan.ledger.state,
        "peak_bytes_per_device": plan.ledger.total,
        "collectives_per_micro_step": {k: v for k, v in plan.collectives.micro_step.items() if v},
        "collectives_per_update": plan.collectives.per_update(steps),
        "ms_per_update": 1e3 * statistics.median(seconds),
        "updates_timed": len(seconds),
        "plan_seconds": plan_seconds,
        "plan": str(plan),
    }


def plot(rows: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Micro-batch, MB per device and ms per update, one bar per mode."""
    from common import grouped_bars, pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.2))
    modes = list(rows)
    panels = [
        ("largest micro-batch", [rows[m]["largest_micro_batch"] for m in modes]),
        ("state MB per device", [rows[m]["state_bytes_per_device"] / 1e6 for m in modes]),
        (
            "collectives per update",
            [sum(rows[m]["collectives_per_update"].values()) for m in modes],
        ),
        ("ms per update", [rows[m]["ms_per_update"] for m in modes]),
    ]
    for ax, (title, values) in zip(axes, panels, strict=True):
        grouped_bars(ax, modes, {title: values})
        ax.set_title(title, fontsize=9)
        ax.get_legend().remove()
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--target", type=int, default=1024)
    parser.add_argument("--limit", type=int, default=14_000_000, help="bytes per device")
    parser.add_argument("--updates", type=int, default=6, help="timed, after one warm-up")
    parser.add_argument("--quick", action="store_true", help="2 timed updates")
    parser.add_argument("--out", default=str(ROOT / "experiments/results/sharded.json"))
    args = parser.parse_args()
    if args.quick:
        args.updates = 2
    jax.config.update("jax_num_cpu_devices", DEVICES)  # before the first device is asked for
    sys.path.insert(0, str(Path(__file__).parent))
    from common import write_result

    params, batches = problem(args.d, args.width, args.length, args.target, args.updates + 1)
    rows = {mode: run(mode, params, batches, args) for mode in MODES}
    print(f"{'mode':>10} {'largest':>7} {'micro':>6} {'steps':>5} {'state MB':>9} {'ms':>8}")
    for mode, r in rows.items():
        print(
            f"{mode:>10} {r['largest_micro_batch']:>7} {r['micro_batch']:>6} {r['micro_steps']:>5} "
            f"{r['state_bytes_per_device'] / 1e6:>9.2f} "
            f"{r['ms_per_update']:>8.1f}  {r['collectives_per_micro_step']} per micro-step, "
            f"{r['collectives_per_update']} per update"
        )
    out = Path(args.out)
    model = f"MLP {args.d}->{args.width}->{args.d} x {args.length} positions, Adam"
    write_result(
        out,
        {
            "command": "python experiments/sharded.py " + " ".join(sys.argv[1:]),
            "devices": DEVICES,
            "model": model,
            "target_batch_size": args.target,
            "memory_limit": args.limit,
            "rows": rows,
        },
    )
    plot(rows, out.with_suffix(".png"), f"{DEVICES} CPU devices, {model}, T = {args.target}, "
         f"memory_limit {args.limit / 1e6:g} MB per device")  # fmt: skip


if __name__ == "__main__":
    main()
