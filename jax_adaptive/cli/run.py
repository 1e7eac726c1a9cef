"""The host side of a command-line run: what it adds to the one loop, and its summary.

Both paths (image models, ``--model gpt``) train through `jax_adaptive.loop.fit_loop`,
as ``fit`` does: the next batches read ahead in a background thread, an optimizer step
that ran out of memory retried on the same batch, any other error a
`jax_adaptive.FitError` that holds the last good state. `RunHooks` is what the command
line does after each update, as that loop's hooks: held-out evaluation, a line in
``metrics.jsonl``, ``plan.json`` rewritten, a checkpoint every ``--checkpoint-every``
updates with the data position of the batches trained on, a printed line, and a line
whenever the plan changes. A run stopped by an error or Ctrl-C checkpoints its last
good state first, so nothing it trained is lost. `run_path` runs a path in its workdir
and prints its summary.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, TextIO

import jax
import tqdm

from jax_adaptive.cli.config import TrainConfig
from jax_adaptive.cli.workdir import Workdir
from jax_adaptive.errors import FitError
from jax_adaptive.loop import fit_loop
from jax_adaptive.read_ahead import Unread
from jax_adaptive.step import TrainState

__all__ = ["READ_AHEAD", "RunHooks", "plan_note", "run_path", "speed_text"]

READ_AHEAD = 2
"""Batches read ahead in a background thread while an update runs."""

PlanKey = tuple[int, int, int]  # micro-batch size, accumulation steps, target batch


def plan_note(before: PlanKey | None, line: dict[str, Any], compiled: int) -> str | None:
    """The line that says an update changed the plan, or None when it did not.

    Args:
        before: the plan before the update (micro-batch, accumulation steps, target
            batch), None when it had none (a bucket's first update: its own line says it).
        line: the update's metrics line.
        compiled: the sizes the update compiled.

    Examples:
        >>> line = {"update": 7, "micro_batch_size": 24, "accumulation_steps": 11,
        ...         "examples": 256}
        >>> plan_note((32, 8, 256), line, compiled=2)
        'plan changed at update 7: micro-batch 24 x 11 = target batch 256 (was 32 x 8 = 256: a smaller micro-batch after running out of memory; 2 sizes compiled)'
        >>> plan_note((24, 11, 256), line, compiled=0) is None
        True
    """  # noqa: E501
    now = (line["micro_batch_size"], line["accumulation_steps"], line["examples"])
    if before is None or now == before:
        return None
    if now[2] != before[2]:
        why = "the batch schedule"
    elif now[0] < before[0]:
        why = "a smaller micro-batch after running out of memory"
    elif now[0] > before[0]:
        why = "a larger micro-batch fits"
    else:
        why = "re-planned"
    bucket = f" of bucket {line['bucket']}" if "bucket" in line else ""
    return (
        f"plan{bucket} changed at update {line['update']}: micro-batch {now[0]} x {now[1]} = "
        f"target batch {now[2]} (was {before[0]} x {before[1]} = {before[2]}: {why}; "
        f"{compiled} size{'s' * (compiled != 1)} compiled)"
    )


def _due(update: int, every: int, last: int) -> bool:
    """Whether held-out evaluation runs after ``update`` (every ``every``, and the last)."""
    return every > 0 and (update % every == 0 or update == last)


def _dropped(unread: Unread) -> None:
    """The batches read ahead and not trained on: a resumed run draws them again.

    A checkpoint holds the data position of the batches trained on, and the stream
    starts again from there.
    """


class RunHooks:
    """What a command-line run does around `jax_adaptive.loop.fit_loop`'s updates.

    Args:
        config: ``eval_every``, ``checkpoint_every`` and ``progress`` are read.
        done: the updates done before (a resumed run's).
        updates: the last update.
        describe: the printed line(s) of an update's metrics line.
        plans: the arguments of `Workdir.write_plan`, asked before the first update and
            after each (``plan.json`` is rewritten when they changed).
        workdir: where to log, write the plans and checkpoint, if anywhere.
        position: the data stream's position after the batches trained on, saved with
            each checkpoint (not the reader's, which is ahead).
        out: where the lines go (default stdout).
        evaluate: held-out metrics of a state (``eval_*`` keys), added to the line of
            every ``config.eval_every``-th update and of the last; None: none.
        compiles: the run's compiles before its first update (each update's metrics
            hold ``compiles``, the run's total after it).
        plans_now: the plan of each bucket before the first update (None: the image
            path's one plan), as (micro-batch, accumulation steps, target batch).

    Attributes:
        lines: the metrics line of each update run (``update`` first).
        compiled: the sizes each of those updates compiled.

    Examples:
        >>> import io
        >>> step = lambda s, b: (s + b, {"loss": 1.0 / (s + b), "micro_batch_size": 4,
        ...                              "accumulation_steps": 2, "examples": 8})
        >>> hooks = RunHooks(TrainConfig(progress=False), done=0, updates=2,
        ...                  describe=lambda m: f"update {m['update']}", plans=dict,
        ...                  out=io.StringIO())
        >>> hooks.run(step, 0, iter([1, 1])), [m["loss"] for m in hooks.lines]
        (2, [1.0, 0.5])
    """

    def __init__(
        self,
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
        compiles: int = 0,
        plans_now: Mapping[Hashable, PlanKey] | None = None,
    ):
        self.config, self.done, self.updates = config, done, updates
        self.describe, self.plans, self.workdir = describe, plans, workdir
        self.position, self.out, self.evaluate = position, out or sys.stdout, evaluate
        self.lines: list[dict[str, Any]] = []
        self.compiled: list[int] = []
        self._compiles = compiles
        self._plans: dict[Hashable, PlanKey] = dict(plans_now or {})
        self._logged: tuple[int, int] | None = None  # the last update logged, its position
        self._saved = done  # the update of the latest checkpoint

    def run(self, step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]],
            state: TrainState, batches: Iterable[Any]) -> TrainState:  # fmt: skip
        """Runs updates ``done + 1`` to ``updates`` of ``step`` on ``batches``.

        Args:
            step: one update: the new state and its metrics (host values with at least
                ``loss``, ``examples``, ``micro_batch_size`` and ``accumulation_steps``).
            state: the state after ``done`` updates.
            batches: what each update takes, in order (read ahead in a thread).

        Returns:
            The final state.

        Raises:
            FitError: any error part-way, with the last good state, which is
                checkpointed first when the workdir has checkpoints (as is the state
                a KeyboardInterrupt carries).
        """
        if self.workdir is not None:
            self.workdir.start(self.done)  # the lines of updates about to be redone go
            self.workdir.write_plan(**self.plans())
        if self.done >= self.updates:
            return state
        try:
            state, _ = fit_loop(
                self._finite(step), state, batches, self.updates - self.done,
                progress=self.config.progress,
                after_update=self.after_update, on_update=self.on_update, start=self.done,
                read_ahead=READ_AHEAD, unread=_dropped,
            )  # fmt: skip
        except FitError as exc:
            self._keep(exc.state)
            raise
        except KeyboardInterrupt as exc:
            self._keep(getattr(exc, "state", None))
            raise
        return state

    def _finite(self, step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]):
        """``step``, refusing an update whose loss is not finite (unless allowed).

        The update's state is dropped: the run stops with the last finite one.
        """

        def finite(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
            new, metrics = step(state, batch)
            if not (self.config.allow_nonfinite or math.isfinite(metrics["loss"])):
                raise ValueError(
                    f"the loss of update {self.done + len(self.lines) + 1} is {metrics['loss']}; "
                    "check the model against the data, or lower --learning-rate "
                    "(--allow-nonfinite trains on)."
                )
            return new, metrics

        return finite

    def after_update(
        self, update: int, state: TrainState, metrics: dict[str, Any]
    ) -> dict[str, Any]:
        """Evaluates when due, then logs, writes the plans and checkpoints when due.

        The line is logged before its checkpoint: a run killed between them redoes the
        update, whose line `Workdir.start` drops.
        """
        held_out = {}
        if self.evaluate is not None and _due(update, self.config.eval_every, self.updates):
            held_out = jax.device_get(self.evaluate(state))
        line = {"update": update, **metrics, **held_out}
        self.lines.append(line)
        self.compiled.append(line.get("compiles", self._compiles) - self._compiles)
        self._compiles = line.get("compiles", self._compiles)
        if self.workdir is not None:
            self.workdir.log(line)
            self.workdir.write_plan(**self.plans())
            self._logged = (update, self.position())
            if update % self.config.checkpoint_every == 0 or update == self.updates:
                self.workdir.save(update, state, self._logged[1])
                self._saved = update
        return held_out

    def on_update(self, update: int, metrics: dict[str, Any]) -> None:
        """Prints the update's line, after one that says the plan changed, if it did."""
        line = self.lines[-1]
        key = line.get("bucket")
        now = (line["micro_batch_size"], line["accumulation_steps"], line["examples"])
        note = plan_note(self._plans.get(key), line, self.compiled[-1])
        self._plans[key] = now
        if note is not None:
            tqdm.tqdm.write(note, file=self.out)
        tqdm.tqdm.write(self.describe(line), file=self.out)

    def _keep(self, state: TrainState | None) -> None:
        """Checkpoints the last good state of a stopped run, when its line was logged.

        Its data position is the one logged with that line; a state whose update is not
        the last logged one (its line missing) is not saved, nor is one already saved.
        """
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

    def timing(self, amount: str) -> dict[str, Any]:
        """The run's time split: steady training, and the updates that compiled.

        Steady: the updates after the run's first (which runs each program for the
        first time) that compiled nothing.

        Args:
            amount: the line's key to count per second (``"examples"``, ``"tokens"``).

        Returns:
            ``steady_per_s`` (None without such an update) and ``steady_updates``,
            ``compiling_seconds`` and ``compiling_updates`` (the updates that compiled
            and their seconds), and ``mean_per_s`` over every update.
        """
        seconds = sum(line["seconds"] for line in self.lines)
        steady = [line for i, line in enumerate(self.lines) if i and not self.compiled[i]]
        compiling = [line for i, line in enumerate(self.lines) if self.compiled[i]]
        steady_seconds = sum(line["seconds"] for line in steady)
        return {
            "steady_per_s": sum(line[amount] for line in steady) / steady_seconds
            if steady_seconds
            else None,
            "steady_updates": len(steady),
            "compiling_seconds": sum(line["seconds"] for line in compiling),
            "compiling_updates": len(compiling),
            "mean_per_s": sum(line[amount] for line in self.lines) / seconds if seconds else 0.0,
        }


def speed_text(timing: dict[str, Any], unit: str, updates: int) -> str:
    """A summary's speed: steady, then the mean over every update.

    Examples:
        >>> speed_text({"steady_per_s": 3300.0, "steady_updates": 18, "mean_per_s": 84.0},
        ...            "examples", 20)
        '3300 examples/s steady (18 updates that compiled nothing; 84 over all 20)'
    """
    mean = f"{timing['mean_per_s']:.0f} {unit}/s (mean over {updates} updates)"
    if timing["steady_per_s"] is None:
        return mean
    return (
        f"{timing['steady_per_s']:.0f} {unit}/s steady ({timing['steady_updates']} updates "
        f"that compiled nothing; {timing['mean_per_s']:.0f} over all {updates})"
    )


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

    Examples:
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
