"""Collectives and time per update on 8 CPU devices: per-device accumulation against SPMD.

The new design (this checkout) accumulates each device's gradient on the device and
reduces once per update, in the optimizer step; the old one (``--baseline``, the commit
before it, read with ``git archive``) let XLA all-reduce the gradient in every
micro-step. Each design runs in its own subprocess (the device count is fixed when JAX
starts, and the two packages share a name), alternately, round after round; each round
times ``--updates`` updates after a warm-up. The collectives are counted in the compiled
programs' HLO (``compiled.as_text()``): all-reduce, reduce-scatter, all-gather,
collective-permute and all-to-all ops.

    python experiments/collectives.py  # writes experiments/results/collectives.json
    python experiments/collectives.py --rounds 1 --updates 3  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and sys.argv[1:2] != ["--child"]:
    sys.path.insert(0, str(ROOT))  # the parent counts with this checkout's package
BASELINE = "ecaed96"  # the last commit whose micro-step all-reduces the gradient
DEVICES = 8


# ------------------------------------------------------------------ the child process


def mlp_loss(params: Any, batch: Any, rng: Any) -> Any:
    """Per-example squared error of a two-layer tanh network."""
    import jax.numpy as jnp

    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2, axis=-1)


def problem(width: int, target: int, updates: int) -> tuple[Any, list[Any]]:
    """Parameters (``width`` x ``width`` twice) and ``updates`` host batches."""
    import numpy as np

    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(width, width)).astype(np.float32) / np.sqrt(width),
        "b1": np.zeros(width, np.float32),
        "w2": rng.normal(size=(width, width)).astype(np.float32) / np.sqrt(width),
    }
    batches = [
        {
            "x": rng.normal(size=(target, width)).astype(np.float32),
            "y": rng.normal(size=(target, width)).astype(np.float32),
        }
        for _ in range(updates)
    ]
    return params, batches


def program_texts(params: Any, batch: Any, target: int, micro: int) -> dict[str, str]:
    """The HLO of the micro-step, a chunk of 2 and the optimizer step (the parent counts)."""
    import jax
    import optax

    import jax_adaptive as ja
    from jax_adaptive.distributed import Placement, place
    from jax_adaptive.executables import Executables
    from jax_adaptive.sizing import Sizing
    from jax_adaptive.step import TrainState, multi_steps

    placement = Placement(mesh=ja.data_mesh())
    steps = multi_steps(optax.adam(1e-3), 1)
    state = TrainState(params, steps.init(params), (), jax.random.key(0))
    state = place(state, placement.state(state, steps))
    ex = Executables(
        mlp_loss, optax.adam(1e-3), Sizing("micro-step of"), key=dict,
        everywhere=placement.everywhere, data=placement.data,
    )  # fmt: skip
    ex.bind(state, batch)
    return {
        "micro_step": ex.micro(micro).compiled.as_text(),
        "chunk_of_2": ex.micro(micro, 2).compiled.as_text(),
        "optimizer_step": ex.optimizer_step(False).compiled.as_text(),
    }


def child(width: int, target: int, micro: int, updates: int) -> dict[str, Any]:
    """One design's figures for one micro-batch size (run under 8 CPU devices)."""
    import optax

    import jax_adaptive as ja

    params, batches = problem(width, target, updates + 1)
    programs = program_texts(params, batches[0], target, micro)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-3), target_batch_size=target, micro_batch_size=micro,
        chunk=1, mesh=ja.data_mesh(), plan_cache=False,
    )  # fmt: skip
    from common import timed_updates

    _, seconds = timed_updates(trainer, trainer.init(params, batches[0]), batches)
    steps = trainer.accumulation_steps
    return {"programs": programs, "micro_steps": steps, "seconds": seconds}


# ------------------------------------------------------------------ the parent


def baseline_tree(commit: str, into: Path) -> Path:
    """The package as of ``commit`` (``git archive``, read-only), extracted ``into``."""
    archive = into / "baseline.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", commit, "jax_adaptive"], cwd=ROOT, stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def run_child(path: Path, width: int, target: int, micro: int, updates: int) -> dict[str, Any]:
    """Runs `child` in a subprocess that imports ``jax_adaptive`` from ``path``."""
    from jax_adaptive.sharding import collective_counts

    env = {
        **os.environ,
        "PYTHONPATH": str(path),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
        "JAX_PLATFORMS": "cpu",
    }
    args = [sys.executable, __file__, "--child", str(width), str(target), str(micro), str(updates)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Counted here, by this checkout's package: the old design's has no counter of its own.
    counts = {k: sum(collective_counts(t).values()) for k, t in out.pop("programs").items()}
    per_update = out["micro_steps"] * counts["micro_step"] + counts["optimizer_step"]
    return {**out, **counts, "per_update": per_update}


def compare(args: argparse.Namespace, old_path: Path) -> list[dict[str, Any]]:
    """Both designs at each micro-batch size, alternately, ``args.rounds`` rounds."""
    rows = []
    for micro in args.micro:
        runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
        for _ in range(args.rounds):
            for design, path in (("old", old_path), ("new", ROOT)):
                runs[design].append(run_child(path, args.width, args.target, micro, args.updates))
        row: dict[str, Any] = {"micro_batch": micro, "micro_steps": runs["new"][0]["micro_steps"]}
        for design, results in runs.items():
            seconds = [s for r in results for s in r["seconds"]]
            first = results[0]
            row[design] = {
                key: first[key]
                for key in ("micro_step", "chunk_of_2", "optimizer_step", "per_update")
            } | {"median_ms": 1e3 * statistics.median(seconds), "updates_timed": len(seconds)}
        row["time_ratio_new_over_old"] = row["new"]["median_ms"] / row["old"]["median_ms"]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a fixed-width table."""
    head = (
        f"{'micro':>6} {'steps':>5} | {'design':>6} {'micro-step':>10} {'chunk(2)':>8} "
        f"{'opt step':>8} {'per update':>10} {'ms/update':>9}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        for design in ("old", "new"):
            d = row[design]
            lines.append(
                f"{row['micro_batch']:>6} {row['micro_steps']:>5} | {design:>6} "
                f"{d['micro_step']:>10} {d['chunk_of_2']:>8} {d['optimizer_step']:>8} "
                f"{d['per_update']:>10} {d['median_ms']:>9.2f}"
            )
        lines.append(f"{'':>12} new / old time: {row['time_ratio_new_over_old']:.3f}")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        width, target, micro, updates = map(int, sys.argv[2:6])
        print(json.dumps(child(width, target, micro, updates)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="the old design's commit")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--target", type=int, default=512)
    parser.add_argument("--micro", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "experiments/results/collectives.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = compare(args, baseline_tree(args.baseline, Path(tmp)))
    print(table(rows))
    sys.path.insert(0, str(Path(__file__).parent))
    from common import write_result

    from jax_adaptive.sharding import COLLECTIVES

    write_result(
        args.out,
        {
            "command": "python experiments/collectives.py " + " ".join(sys.argv[1:]),
            "devices": DEVICES,
            "baseline": args.baseline,
            "width": args.width,
            "target_batch_size": args.target,
            "collectives_counted": list(COLLECTIVES),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
