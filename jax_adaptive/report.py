"""``python -m jax_adaptive.report WORKDIR``: plots of a run from its workdir.

Writes ``search_trace.png`` (each size tried: XLA's estimated bytes against the
micro-batch size, fits or out-of-memory, the limit as a line) and ``loss.png`` (the loss
of each update, from ``metrics.jsonl``). Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["main", "write_report"]


def write_report(workdir: str | Path) -> list[Path]:
    """Writes the run's PNGs into ``workdir``; returns their paths.

    Raises:
        ValueError: when ``workdir`` holds no ``plan.json`` (not a run's workdir).

    Example:
        >>> import io, tempfile
        >>> from jax_adaptive.train import TrainConfig, train
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = train(TrainConfig(target_batch_size=8, updates=2, workdir=tmp,
        ...                           progress=False), out=io.StringIO())
        ...     [p.name for p in write_report(tmp)]
        ['search_trace.png', 'loss.png']
    """
    workdir = Path(workdir)
    if not (workdir / "plan.json").exists():
        raise ValueError(f"{workdir} has no plan.json; pass the --workdir of a training run.")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("the report needs matplotlib: pip install matplotlib") from None
    plan = json.loads((workdir / "plan.json").read_text())
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for fits, colour, label in ((True, "tab:green", "fits"), (False, "tab:red", "out of memory")):
        trials = [t for t in plan["search_log"] if t["fits"] == fits and t["estimated_bytes"]]
        ax.scatter([t["size"] for t in trials], [t["estimated_bytes"] / 1e6 for t in trials],
                   c=colour, label=label, marker="o" if fits else "x")  # fmt: skip
        for i, t in enumerate(trials):
            ax.annotate(str(i + 1), (t["size"], t["estimated_bytes"] / 1e6), fontsize=7)
    if plan.get("capacity"):
        ax.axhline(plan["capacity"] / 1e6, color="k", ls="--", label="limit")
    ax.set(xlabel="micro-batch size", ylabel="estimated peak (MB)",
           title=f"search: {plan['micro_batch_size']} x {plan['accumulation_steps']}, "
           f"{plan['compiles']} compiles")  # fmt: skip
    ax.legend()
    paths.append(workdir / "search_trace.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    lines = (workdir / "metrics.jsonl").read_text().splitlines() if (
        workdir / "metrics.jsonl").exists() else []  # fmt: skip
    metrics = [json.loads(line) for line in lines if line.strip()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([m["update"] for m in metrics], [m["loss"] for m in metrics])
    ax.set(xlabel="update", ylabel="loss", title="training loss")
    paths.append(workdir / "loss.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m jax_adaptive.report WORKDIR", file=sys.stderr)
        return 2
    try:
        for path in write_report(argv[0]):
            print(path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
