"""The host side of a command-line run: its loop, its lines, its workdir around it.

`host_loop` runs the updates of either path (image models, ``--model gpt``), logging,
checkpointing and printing each; `run_path` runs a path in its workdir and prints its
summary.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

import tqdm

from jax_adaptive.cli.config import TrainConfig
from jax_adaptive.cli.workdir import Workdir
from jax_adaptive.read_ahead import ReadAhead
from jax_adaptive.step import TrainState

__all__ = ["host_loop", "run_path"]


def _postfix(line: dict[str, Any]) -> dict[str, str]:
    shown = {"loss": f"{line['loss']:.3f}"}
    if "examples_per_s" in line:
        shown["ex_s"] = f"{line['examples_per_s']:.0f}"
    if "bucket" in line:
        shown["bucket"] = str(line["bucket"])
    return shown | {"micro": f"{line['micro_batch_size']}x{line['accumulation_steps']}"}


def _due(update: int, every: int, last: int) -> bool:
    """Whether held-out evaluation runs after ``update`` (every ``every``, and the last)."""
    return every > 0 and (update % every == 0 or update == last)


def host_loop(
    step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]],
    state: TrainState,
    batches: Iterator[Any],
    config: TrainConfig,
    *,
    done: int,
    updates: int,
    describe: Callable[[dict[str, Any]], str],
    plans: Callable[[], dict[str, Any]],
    workdir: Workdir | None = None,
    position: Callable[[], int] = lambda: 0,
    out: TextIO | None = None,
    evaluate: Callable[[TrainState], dict[str, Any]] | None = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Runs updates ``done + 1`` to ``updates``, logging, checkpointing and printing each.

    The next batches are read ahead in a background thread while an update runs
    (`jax_adaptive.read_ahead.ReadAhead`, two at most), so that drawing them (reading,
    decoding each example) does not add to the update's time.

    Args:
        step: one update from a state and the next item of ``batches``: the new state
            and its metrics line (host values with at least ``loss``,
            ``micro_batch_size`` and ``accumulation_steps``).
        state: the state after ``done`` updates.
        batches: what each update takes, in order (read in that thread only).
        config: ``progress`` and ``checkpoint_every`` are read.
        done: updates already done (a resumed run's).
        updates: the last update.
        describe: the printed line of an update's metrics line.
        plans: the arguments of `Workdir.write_plan`, asked before the first update and
            after each (``plan.json`` is rewritten when they changed).
        workdir: where to log, checkpoint and write the plans, if anywhere.
        position: the data stream's position after the batches trained on, saved with
            each checkpoint (not the reader's, which is ahead).
        out: where the lines go (default stdout).
        evaluate: held-out metrics of a state (``eval_*`` keys), added to the line of
            every ``config.eval_every``-th update and of the last, before it is
            logged, checkpointed and described; None: no evaluation.

    Returns:
        The final state and the metrics line of each update run (``update`` first).

    Example:
        >>> import io
        >>> step = lambda s, b: (s + b, {"loss": 1.0 / (s + b), "micro_batch_size": 4,
        ...                              "accumulation_steps": 2})
        >>> state, lines = host_loop(step, 0, iter([1, 1]), TrainConfig(progress=False),
        ...                          done=0, updates=2, describe=lambda m: f"update {m['update']}",
        ...                          plans=dict, out=io.StringIO())
        >>> state, [m["loss"] for m in lines]
        (2, [1.0, 0.5])
    """
    out = out or sys.stdout
    lines: list[dict[str, Any]] = []
    bar = tqdm.tqdm(total=updates, initial=done, disable=not config.progress, unit="update")
    ahead = ReadAhead(batches, depth=2)
    try:
        if workdir is not None:
            workdir.start(done)  # the lines of updates about to be redone go
            workdir.write_plan(**plans())
        for update in range(done + 1, updates + 1):
            state, metrics = step(state, next(ahead))
            lines.append({"update": update, **metrics})
            if evaluate is not None and _due(update, config.eval_every, updates):
                lines[-1].update(evaluate(state))
            if workdir is not None:
                workdir.log(lines[-1])
                workdir.write_plan(**plans())
                if update % config.checkpoint_every == 0 or update == updates:
                    workdir.save(update, state, position())
            bar.set_postfix(_postfix(lines[-1]))
            bar.update()
            tqdm.tqdm.write(describe(lines[-1]), file=out)
    finally:
        ahead.close()  # a resumed run draws the batches read ahead again, from the position
        bar.close()
    return state, lines


def run_path(
    config: TrainConfig,
    train: Callable[[TrainConfig, Workdir | None, TextIO], dict[str, Any]],
    summarize: Callable[[dict[str, Any]], str],
    *,
    out: TextIO | None = None,
    run: Mapping[str, Any] | None = None,
    examples_per_update: int | Callable[[int], int] | None = None,
) -> dict[str, Any]:
    """Runs one path of the command line: its training in its workdir, then its summary.

    Args:
        config: the run, already checked.
        train: ``(config, workdir or None, out) -> summary``.
        summarize: the summary's one line.
        out: where to print (standard output by default).
        run: what a resumed checkpoint must match (see `Workdir`).
        examples_per_update: what a checkpoint's data position must be (see `Workdir`).

    Returns:
        The summary.

    Example:
        >>> import io
        >>> run_path(TrainConfig(), lambda c, w, o: {"losses": []}, lambda s: "done",
        ...          out=io.StringIO())
        {'losses': []}
    """
    out = out or sys.stdout
    with Workdir.of(config, run, examples_per_update=examples_per_update) as workdir:
        summary = train(config, workdir, out)
    print(summarize(summary), file=out)
    return summary
