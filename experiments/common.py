"""What every benchmark here shares: writing its figures as JSON beside the run's setup."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax


def write_result(path: str | Path, result: dict[str, Any]) -> Path:
    """Writes ``result``, with the backend and JAX version added, as JSON at ``path``.

    Example:
        >>> import tempfile
        >>> out = write_result(Path(tempfile.mkdtemp()) / "r.json", {"ratio": 1.0})
        wrote .../r.json
        >>> json.loads(out.read_text())["backend"]
        'cpu'
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    full = {**result, "backend": jax.default_backend(), "jax": jax.__version__}
    out.write_text(json.dumps(full, indent=2) + "\n")
    print("wrote", out)
    return out


def load_example(name: str) -> Any:
    """``examples/<name>.py`` imported as a module, as a user runs it from the repository.

    Example:
        >>> load_example("nnx_mnist").random_batches.__name__
        'random_batches'
    """
    path = Path(__file__).parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its classes' module, as an import would set it
    spec.loader.exec_module(module)
    return module


def pyplot() -> Any:
    """The ``matplotlib.pyplot`` module, drawing to files only (Agg); None without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[report]'): no plot")
        return None
    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 100) -> None:
    """Lays ``fig`` out, writes it to ``path`` and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print("wrote", path)


def grouped_bars(ax: Any, groups: list[str], series: dict[str, list[float]]) -> None:
    """One bar per series in each group, side by side, the groups named under them."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.legend(fontsize=8)


def timed_updates(trainer: Any, state: Any, batches: list[Any]) -> tuple[Any, list[float]]:
    """The state after ``batches`` and the seconds of each update but the first.

    The first update, on ``batches[0]``, is the warm-up (its first runs: compiles, copies).
    """
    state, _ = trainer.step(state, batches[0])
    seconds = []
    for batch in batches[1:]:
        start = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready((state.params, metrics["loss"]))
        seconds.append(time.perf_counter() - start)
    return state, seconds
