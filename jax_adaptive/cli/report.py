"""``python -m jax_adaptive.report WORKDIR``: ``search_trace.png`` and ``loss.png`` of a run."""

from __future__ import annotations

import io
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

from jax_adaptive.cli.extras import import_extra
from jax_adaptive.files import write_atomic

__all__ = ["main", "search_figure", "write_report"]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _plans(workdir: Path) -> list[dict[str, Any]]:
    """The plans of every run of the workdir, in order: each a `_Run` number on its plans."""
    plan = json.loads((workdir / "plan.json").read_text())  # malformed: a ValueError
    if not isinstance(plan, dict):
        raise ValueError(f"{workdir / 'plan.json'} is not a JSON object; rerun the training.")
    runs = [r for r in plan.get("earlier_runs") or [] if isinstance(r, dict)] + [plan]
    plans = []
    for number, run in enumerate(runs, 1):
        if isinstance(run.get("plans"), list):
            found = [p for p in run["plans"] if isinstance(p, dict)]
        elif "search_log" in run:  # written before the plans were a list: one image plan
            found = [{**run, "bucket": None}]
        elif run is plan:
            raise ValueError(
                f"{workdir / 'plan.json'} holds no search log (an older --model gpt run); rerun it."
            )
        else:
            continue
        resumed = run.get("resumed_at")
        plans += [{**p, "run": number, "resumed_at": resumed} for p in found]
    return plans


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


def _trials(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The trials of a plan that have a point: a numeric size and estimate.

    One that did not compile, or a hand-edited entry, has none.
    """
    return [
        t
        for t in plan.get("search_log") or []
        if isinstance(t, dict) and _number(t.get("size")) and _number(t.get("estimated_bytes"))
    ]


def _run_words(plan: dict[str, Any]) -> str:
    """How the legend names a run: the first, or resumed at an update."""
    resumed = plan.get("resumed_at")
    if plan["run"] == 1 and not resumed:
        return "the first run"
    return f"run {plan['run']}" + (f", resumed at update {resumed}" if _number(resumed) else "")


def _search_panel(ax: Any, plans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """One bucket's search over every run of the workdir (``plans``, in run order).

    The x axis is logarithmic (a search spans 1 to the target batch); the neighbourhood
    of the largest size that fits, where the last trials crowd, is drawn again zoomed in
    an inset; each point is labelled with the order its size was decided in, labels
    moved apart where they would overlap (`_place_labels`).
    """
    import matplotlib.lines

    numbered, handles, order = [], [], 0
    for plan in plans:
        trials = _trials(plan)
        first = order + 1
        for t in trials:
            order += 1
            numbered.append((order, t))
        compiles = plan.get("compiles")
        words = _run_words(plan) + (
            f" ({_plural(compiles, 'compile')})" if _number(compiles) else ""
        )
        if trials:
            words = f"{first if order == first else f'{first}-{order}'}: {words}"
        else:  # a plan cache's plan of a size never measured has no estimate to draw
            log = [t for t in plan.get("search_log") or [] if isinstance(t, dict)]
            cached = any(t.get("decided_by") == "plan cache" for t in log)
            words += ": the plan cache's plan, no search" if cached else ": no trial to draw"
        handles.append(matplotlib.lines.Line2D([], [], ls="", label=words))
    last = plans[-1]
    capacity = last.get("capacity") / 1e6 if _number(last.get("capacity")) else None
    for target in _axes_of(ax, numbered, capacity):
        for fits, colour, label in ((True, "tab:green", "fits"),
                                    (False, "tab:red", "out of memory")):  # fmt: skip
            points = [t for _, t in numbered if bool(t.get("fits")) == fits]
            target.scatter([t["size"] for t in points],
                           [t["estimated_bytes"] / 1e6 for t in points], c=colour,
                           label=label, marker="o" if fits else "x", zorder=3)  # fmt: skip
        if capacity is not None:
            target.axhline(capacity, color="k", ls="--", label="limit")
    name = "search" if last.get("bucket") is None else f"bucket {last['bucket']}"
    m, k = last.get("micro_batch_size"), last.get("accumulation_steps")
    ax.set(xlabel="micro-batch size (log scale)", ylabel="estimated peak (MB)",
           title=f"{name}: {m} x {k}" if _number(m) and _number(k) else name)  # fmt: skip
    # Beside the panel, where it covers no point nor the limit.
    ax.legend(handles=[*ax.get_legend_handles_labels()[0], *handles], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1), title="trials",
              title_fontsize=7)  # fmt: skip
    return numbered


def _plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, an ``s`` added unless it is 1.

    As `jax_adaptive.cli.run.plural`, whose module imports JAX: the report does without.
    """
    return f"{count} {noun}{'s' * (count != 1)}"


_NEAR = 1.25  # the zoom's neighbourhood of the largest size that fits: a factor either side


def _neighbourhood(numbered: list[tuple[int, dict[str, Any]]]) -> tuple[float, float] | None:
    """The sizes the zoom shows, ``(low, high)``, or None where nothing crowds.

    The trials within `_NEAR` of the largest size that fits, when there are two or more
    sizes there and the whole search spans more than twice that range.
    """
    sizes = [t["size"] for _, t in numbered]
    fitting = [t["size"] for _, t in numbered if t.get("fits")]
    if not fitting:
        return None
    largest = max(fitting)
    near = sorted({s for s in sizes if largest / _NEAR <= s <= largest * _NEAR})
    if len(near) < 2 or max(sizes) / min(sizes) <= 2 * _NEAR**2:
        return None
    pad = max(1.0, 0.2 * (near[-1] - near[0]))
    return near[0] - pad, near[-1] + pad


def _axes_of(ax: Any, numbered: list[tuple[int, dict[str, Any]]],
             capacity: float | None) -> list[Any]:  # fmt: skip
    """The panel's axes: itself (log x), and the zoom inset when the last trials crowd."""
    import matplotlib.ticker

    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.LogFormatter())  # 100, not 10^2
    ax.xaxis.set_minor_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False))
    window = _neighbourhood(numbered)
    if window is None:
        return [ax]
    inset = ax.inset_axes((0.06, 0.5, 0.42, 0.42))
    ys = [t["estimated_bytes"] / 1e6 for _, t in numbered if window[0] <= t["size"] <= window[1]]
    ys += [capacity] if capacity is not None else []
    pad = max(0.15 * (max(ys) - min(ys)), 0.01 * max(ys))
    inset.set(xlim=window, ylim=(min(ys) - pad, max(ys) + pad))
    inset.tick_params(labelsize=6)
    inset.set_title("near the largest that fits", fontsize=7)
    ax.indicate_inset_zoom(inset, edgecolor="0.5")
    return [ax, inset]


def _label_points(ax: Any, numbered: list[tuple[int, dict[str, Any]]]) -> None:
    """Labels each point with its trial numbers (one label per point, ``"3, 5"``).

    A point in the zoom is labelled there, the others on the panel.
    """
    inset = ax.child_axes[0] if ax.child_axes else None  # `_axes_of`'s zoom
    window = inset.get_xlim() if inset is not None else None
    points: dict[tuple[float, float], list[int]] = {}
    for order, t in numbered:
        points.setdefault((t["size"], t["estimated_bytes"] / 1e6), []).append(order)
    labels: dict[Any, list[tuple[float, float, str]]] = {ax: []}
    if inset is not None:
        labels[inset] = []
    for (x, y), orders in sorted(points.items()):
        where = inset if window is not None and window[0] <= x <= window[1] else ax
        labels[where].append((x, y, ", ".join(map(str, orders))))
    obstacles = [] if inset is None else [inset]
    for where, texts in labels.items():
        _place_labels(where, texts, obstacles if where is ax else [])


def _place_labels(ax: Any, texts: list[tuple[float, float, str]], obstacles: list[Any]) -> None:
    """Annotates ``(x, y, text)`` points, each label moved up until it overlaps none placed.

    Overlaps are measured on the drawn figure (the saved PNG scales it whole, so labels
    apart here stay apart); ``obstacles`` are axes no label may cover (the zoom inset).
    """
    figure = ax.figure
    renderer = figure.canvas.get_renderer()
    taken = [o.get_tightbbox(renderer) for o in obstacles]
    for x, y, text in texts:
        label = ax.annotate(text, (x, y), xytext=(4, 3), textcoords="offset points", fontsize=7)
        for _ in range(40):
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in taken):
                break
            dx, dy = label.get_position()
            label.set_position((dx, dy + box.height * 72 / figure.dpi + 1))
        taken.append(label.get_window_extent(renderer))


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


def search_figure(workdir: str | Path) -> Any:
    """The search trace of a run's ``workdir``: a panel per bucket, every run's trials of it.

    A resumed run's ``plan.json`` keeps the runs before it (``earlier_runs``): their trials
    come first, numbered on in the order the sizes were decided, the legend saying which
    run tried which. Needs matplotlib (the ``report`` extra).

    Examples:
        >>> import tempfile
        >>> workdir = Path(tempfile.mkdtemp())
        >>> trial = {"size": 8, "fits": True, "estimated_bytes": 1e6}
        >>> _ = (workdir / "plan.json").write_text(json.dumps({"plans": [{"search_log": [trial]}]}))
        >>> figure = search_figure(workdir)
        >>> figure.axes[0].get_xscale(), figure.axes[0].texts[0].get_text()
        ('log', '1')
        >>> import matplotlib.pyplot as plt; plt.close(figure)
    """
    import_extra("matplotlib", "report", "the report").use("Agg")
    import matplotlib.pyplot as plt

    buckets: dict[str, list[dict[str, Any]]] = {}
    for plan in _plans(Path(workdir)):  # a bucket's plans of every run, in run order
        buckets.setdefault(json.dumps(plan.get("bucket")), []).append(plan)
    columns = min(len(buckets), 3) or 1
    rows = -(-len(buckets) // columns) or 1
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.5 * rows), squeeze=False)
    figure.set_layout_engine("none")
    panels = []
    for ax, bucket in itertools.zip_longest(axes.flat, buckets.values()):
        if bucket is None:
            ax.set_axis_off()
        else:
            panels.append((ax, _search_panel(ax, bucket)))
    # Labels last, their places measured on the figure as drawn: a point's place on the
    # canvas is known once every artist is in and the axes have their final limits.
    figure.canvas.draw()
    for ax, numbered in panels:
        for shown in (ax, *ax.child_axes):
            shown.set(xlim=shown.get_xlim(), ylim=shown.get_ylim())  # labels move nothing
        _label_points(ax, numbered)
    return figure


def write_report(workdir: str | Path) -> list[Path]:
    """Writes the run's PNGs into ``workdir``; returns their paths.

    Raises:
        ValueError: ``workdir`` holds no ``plan.json``, or matplotlib is missing.
    """
    workdir = Path(workdir)
    if not (workdir / "plan.json").exists():
        raise ValueError(f"{workdir} has no plan.json; pass the --workdir of a training run.")
    search = search_figure(workdir)
    import matplotlib.pyplot as plt

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
