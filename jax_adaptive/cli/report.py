"""``python -m jax_adaptive.report WORKDIR``: ``search_trace.png`` and ``loss.png`` of a run."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from typing import Any

from jax_adaptive.cli.extras import import_extra
from jax_adaptive.files import write_atomic

__all__ = ["main", "write_report"]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _plans(workdir: Path) -> list[dict[str, Any]]:
    plan = json.loads((workdir / "plan.json").read_text())  # malformed: a ValueError
    if not isinstance(plan, dict):
        raise ValueError(f"{workdir / 'plan.json'} is not a JSON object; rerun the training.")
    if isinstance(plan.get("plans"), list):
        return [p for p in plan["plans"] if isinstance(p, dict)]
    if "search_log" in plan:  # written before the plans were a list: one image plan
        return [{**plan, "bucket": None}]
    raise ValueError(
        f"{workdir / 'plan.json'} holds no search log (an older --model gpt run); rerun it."
    )


def _metrics(workdir: Path) -> list[dict[str, Any]]:
    """The lines of ``metrics.jsonl`` with a numeric update and loss."""
    path, metrics = workdir / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:  # a killed run may leave half a line
            m = json.loads(line)
        except ValueError:
            continue
        if isinstance(m, dict) and _number(m.get("update")) and _number(m.get("loss")):
            metrics.append(m)
    return metrics


def _search_panel(ax: Any, plan: dict[str, Any]) -> None:
    # A trial without a numeric size and estimate (one that did not compile, a
    # hand-edited entry) has no point to plot.
    log = [
        (i + 1, t)
        for i, t in enumerate(plan.get("search_log") or [])
        if isinstance(t, dict) and _number(t.get("size")) and _number(t.get("estimated_bytes"))
    ]
    for fits, colour, label in ((True, "tab:green", "fits"), (False, "tab:red", "out of memory")):
        trials = [t for _, t in log if t["fits"] == fits]
        ax.scatter([t["size"] for t in trials], [t["estimated_bytes"] / 1e6 for t in trials],
                   c=colour, label=label, marker="o" if fits else "x")  # fmt: skip
    for order, t in log:  # the order the sizes were decided in
        ax.annotate(str(order), (t["size"], t["estimated_bytes"] / 1e6), fontsize=7)
    if _number(plan.get("capacity")):
        ax.axhline(plan["capacity"] / 1e6, color="k", ls="--", label="limit")
    name = "search" if plan.get("bucket") is None else f"bucket {plan['bucket']}"
    ax.set(xlabel="micro-batch size", ylabel="estimated peak (MB)",
           title=f"{name}: {plan.get('micro_batch_size')} x {plan.get('accumulation_steps')}, "
           f"{plan.get('compiles')} compiles")  # fmt: skip
    ax.legend(fontsize=7)


def _loss_panel(ax: Any, metrics: list[dict[str, Any]]) -> None:
    series: dict[str | None, list[dict[str, Any]]] = {}
    for m in metrics:  # a --model gpt run: one series per bucket (a loss per real token)
        series.setdefault(str(m["bucket"]) if "bucket" in m else None, []).append(m)
    for bucket, ms in series.items():
        ax.plot([m["update"] for m in ms], [m["loss"] for m in ms], marker="." if bucket else "",
                label=None if bucket is None else f"bucket {bucket}")  # fmt: skip
    held_out = [m for m in metrics if _number(m.get("eval_loss"))]
    if held_out:  # the image models' held-out evaluations (--eval-every)
        ax.plot([m["update"] for m in held_out], [m["eval_loss"] for m in held_out],
                marker="o", ls="--", label="held-out")  # fmt: skip
    if held_out or any(bucket is not None for bucket in series):
        ax.legend(fontsize=7)
    ax.set(xlabel="update", ylabel="loss", title="loss")


def write_report(workdir: str | Path) -> list[Path]:
    """Writes the run's PNGs into ``workdir``; returns their paths.

    Raises:
        ValueError: ``workdir`` holds no ``plan.json``, or matplotlib is missing.
    """
    workdir = Path(workdir)
    if not (workdir / "plan.json").exists():
        raise ValueError(f"{workdir} has no plan.json; pass the --workdir of a training run.")
    import_extra("matplotlib", "report", "the report").use("Agg")
    import matplotlib.pyplot as plt

    plans = _plans(workdir)
    columns = min(len(plans), 3) or 1
    rows = -(-len(plans) // columns) or 1
    search, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(plans):
            _search_panel(ax, plans[i])
        else:
            ax.set_axis_off()
    loss, ax = plt.subplots(figsize=(6, 4))
    _loss_panel(ax, _metrics(workdir))
    paths = [workdir / "search_trace.png", workdir / "loss.png"]
    for figure, path in zip((search, loss), paths, strict=True):
        png = io.BytesIO()
        figure.savefig(png, format="png", dpi=120, bbox_inches="tight")
        plt.close(figure)
        write_atomic(path, png.getvalue())  # a report run again replaces it whole
    return paths


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 with a one-line error).

    Examples:
        >>> main(["--help"])
        2
    """
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
