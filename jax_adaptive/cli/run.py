"""What a command-line run (either path) adds to `jax_adaptive.loop.fit_loop`, the one host loop."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

import jax
import tqdm

from jax_adaptive.cli.config import TrainConfig
from jax_adaptive.cli.workdir import Workdir
from jax_adaptive.errors import FitError
from jax_adaptive.loop import fit_loop
from jax_adaptive.step import TrainState

__all__ = ["READ_AHEAD", "RunHooks", "plan_note", "plural", "run_path", "speed_text"]

READ_AHEAD = 2  # batches read ahead in a background thread while an update runs

Step = Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, an ``s`` added unless it is 1: ``plural(4, "update")``."""
    return f"{count} {noun}{'s' * (count != 1)}"


def _plan(line: Mapping[str, Any]) -> tuple[int, int, int]:
    """An update's (or a plan entry's) micro-batch, accumulation steps and target batch."""
    examples = line["examples"] if "examples" in line else line["examples_per_update"]
    return line["micro_batch_size"], line["accumulation_steps"], examples


def plan_note(
    before: tuple[int, int, int] | None, line: dict[str, Any], compiled: int
) -> str | None:
    """The line that says an update changed the plan from ``before`` (a `_plan`), or None."""
    now = _plan(line)
    if before is None or now == before:
        return None
    if "search_ended" in line:  # --background-search
        why = f"the search beside training ended, {line['search_ended']}"
    elif now[2] != before[2]:
        why = "the batch schedule"
    elif now[0] != before[0]:
        why = "a larger micro-batch fits" if now[0] > before[0] else (
            "a smaller micro-batch after running out of memory")  # fmt: skip
    else:
        why = "re-planned"
    bucket = f" of bucket {line['bucket']}" if "bucket" in line else ""
    return (
        f"plan{bucket} changed at update {line['update']}: micro-batch {now[0]} x {now[1]} = "
        f"target batch {now[2]} (was {before[0]} x {before[1]} = {before[2]}: {why}; "
        f"{plural(compiled, 'size')} compiled)"
    )


class RunHooks:
    """The command line's side of each update: evaluation, lines, plans and checkpoints.

    Args:
        config: the run's flags.
        done: the updates done before (a resumed run's); updates: the last one.
        describe: the printed line(s) of an update's metrics line.
        plans: `Workdir.write_plan`'s arguments (also the plans before the first update).
        compiles: the run's compiles so far.
        unit: what an update counts per second (``examples``, ``tokens``).
        workdir: where to log, write the plans and checkpoint, if anywhere.
        out: where the lines go (default stdout).
        evaluate: a state's held-out ``eval_*`` metrics, when ``eval_every`` says.

    Attributes:
        lines: each update's metrics line; compiled: the sizes each update compiled.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        done: int,
        updates: int,
        describe: Callable[[dict[str, Any]], str],
        plans: Callable[[], dict[str, Any]],
        compiles: Callable[[], int],
        unit: str = "examples",
        workdir: Workdir | None = None,
        out: TextIO | None = None,
        evaluate: Callable[[TrainState], dict[str, Any]] | None = None,
    ):
        self.config, self.done, self.updates = config, done, updates
        self.describe, self.plans, self.compiles, self.unit = describe, plans, compiles, unit
        self.workdir, self.out, self.evaluate = workdir, out or sys.stdout, evaluate
        self.lines: list[dict[str, Any]] = []
        self.compiled: list[int] = []
        self._before = {p["bucket"]: _plan(p) for p in plans()["plans"]}
        self._compiles = compiles()
        self._read = 0  # the stream's position after the last batch trained on
        self._logged: tuple[int, int] | None = None  # the last update logged, its position
        self._saved = done  # the update of the latest checkpoint

    def run(self, step: Step, state: TrainState, drawn: Iterable[tuple[Any, int]]) -> TrainState:
        """Runs updates ``done + 1`` to ``updates`` on ``drawn``: (batch, position after it).

        ``step(state, batch)`` gives the new state and host metrics. A `FitError` or
        KeyboardInterrupt checkpoints the last update logged before it propagates.
        """
        if self.workdir is not None:
            self.workdir.start(self.done)  # the lines of updates about to be redone go
            self.workdir.write_plan(**self.plans())
        if self.done >= self.updates:
            return state
        try:
            state, _ = fit_loop(
                lambda state, drawn: self._step(step, state, *drawn), state, drawn,
                self.updates - self.done, progress=self.config.progress,
                after_update=self.after_update, on_update=self.on_update, start=self.done,
                # A checkpoint's position is that of the batches trained on: those read
                # ahead are drawn again by a resumed run.
                read_ahead=READ_AHEAD, unread=lambda unread: None,
            )  # fmt: skip
        except (FitError, KeyboardInterrupt) as exc:
            self._keep(getattr(exc, "state", None))
            raise
        return state

    def _step(
        self, step: Step, state: TrainState, batch: Any, read: int
    ) -> tuple[TrainState, dict[str, Any]]:
        """One update, timed, and the stream's position after its batch."""
        tick = time.perf_counter()
        new, metrics = step(state, batch)  # host values: the update is done
        seconds = time.perf_counter() - tick
        self._read = read
        per_s = {f"{self.unit}_per_s": metrics[self.unit] / seconds}
        return new, {**metrics, **per_s, "seconds": seconds, "compiles": self.compiles()}

    def after_update(self, update: int, state: TrainState, metrics: dict[str, Any]) -> dict:
        """Evaluates when due, then logs the line, writes the plans and checkpoints when due.

        A non-finite loss stops the run first (unless allowed). The line is logged before
        its checkpoint: a run killed between them redoes the update (`Workdir.start`).
        """
        if not (self.config.allow_nonfinite or math.isfinite(metrics["loss"])):
            raise ValueError(
                f"the loss of update {update} is {metrics['loss']}; check the model against "
                "the data, or lower --learning-rate (--allow-nonfinite trains on)."
            )
        every, held_out = self.config.eval_every, {}
        if self.evaluate and every and (update % every == 0 or update == self.updates):
            held_out = jax.device_get(self.evaluate(state))
        line = {"update": update, **metrics, **held_out}
        self.lines.append(line)
        self.compiled.append(line["compiles"] - self._compiles)
        self._compiles = line["compiles"]
        if self.workdir is not None:
            self.workdir.log(line)
            self.workdir.write_plan(**self.plans())
            self._logged = (update, self._read)
            if update % self.config.checkpoint_every == 0 or update == self.updates:
                self.workdir.save(update, state, self._read)
                self._saved = update
        return held_out

    def on_update(self, update: int, metrics: dict[str, Any]) -> None:
        """Prints the update's line, after one that says the plan changed, if it did."""
        line = self.lines[-1]
        note = plan_note(self._before.get(line.get("bucket")), line, self.compiled[-1])
        self._before[line.get("bucket")] = _plan(line)
        for text in (note, self.describe(line)):
            if text is not None:
                tqdm.tqdm.write(text, file=self.out)

    def _keep(self, state: TrainState | None) -> None:
        """Checkpoints a stopped run's last good state, if it is the last update logged."""
        if self.workdir is None or self._logged is None or state is None:
            return
        update, position = self._logged
        try:
            if update <= self._saved or int(jax.device_get(state.updates)) != update:
                return
            self.workdir.save(update, state, position)
        except Exception as exc:  # the error that stopped the run is the one to raise
            tqdm.tqdm.write(f"could not checkpoint update {update}: {exc!r}", file=self.out)
            return
        self._saved = update
        tqdm.tqdm.write(
            f"stopped after update {update}: checkpointed it; --resume goes on from there",
            file=self.out,
        )

    def timing(self) -> dict[str, Any]:
        """``steady_per_s`` (None if no later update compiled nothing), the mean, ``speed``."""

        def rate(lines: list[dict[str, Any]]) -> float | None:
            seconds = sum(line["seconds"] for line in lines)
            return sum(line[self.unit] for line in lines) / seconds if seconds else None

        steady = [line for i, line in enumerate(self.lines) if i and not self.compiled[i]]
        compiling = [line for line, c in zip(self.lines, self.compiled, strict=True) if c]
        timing = {
            "steady_per_s": rate(steady), "steady_updates": len(steady),
            "compiling_seconds": sum(line["seconds"] for line in compiling),
            "compiling_updates": len(compiling), "mean_per_s": rate(self.lines) or 0.0,
        }  # fmt: skip
        return {**timing, "speed": speed_text(timing, self.unit, len(self.lines))}


def speed_text(timing: dict[str, Any], unit: str, updates: int) -> str:
    """A summary's speed: steady, then the mean over every update (docs/cli.md quotes it)."""
    mean, steady = timing["mean_per_s"], timing["steady_per_s"]
    if steady is None:
        return f"{mean:.0f} {unit}/s (mean over {plural(updates, 'update')})"
    return (f"{steady:.0f} {unit}/s steady ({plural(timing['steady_updates'], 'update')} that "
            f"compiled nothing; {mean:.0f} over all {updates})")  # fmt: skip


def run_path(
    config: TrainConfig,
    train: Callable[[TrainConfig, Workdir | None, TextIO], dict[str, Any]],
    summarize: Callable[[dict[str, Any]], str],
    *,
    out: TextIO | None = None,
    run: Mapping[str, Any] | None = None,
    examples_per_update: int | Callable[[int], int] | None = None,
) -> dict[str, Any]:
    """Runs ``train(config, workdir or None, out)`` and prints its summary line.

    ``run`` and ``examples_per_update`` are what a checkpoint must match (`Workdir`).
    """
    out = out or sys.stdout
    workdir = contextlib.nullcontext() if config.workdir is None else Workdir(
        config.workdir, config, run, examples_per_update=examples_per_update)  # fmt: skip
    with workdir as opened:
        summary = train(config, opened, out)
    print(summarize(summary), file=out)
    return summary
