"""A run's directory: ``plan.json``, ``metrics.jsonl`` (one line per update) and checkpoints.

``plan.json`` is ``{"config", "plans", "search_seconds"}``, a `plan_entry` per trainer.
Under ``jax.distributed`` process 0 alone writes these; every process saves checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any, TextIO

import jax

from jax_adaptive.cli.checkpoints import Checkpoints
from jax_adaptive.cli.config import TrainConfig
from jax_adaptive.step import TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = ["Workdir", "plan_entry"]


def plan_entry(trainer: AdaptiveTrainer, bucket: Hashable | None = None) -> dict[str, Any]:
    """One trainer's plan as ``plan.json`` holds it, with every size it tried."""
    return {
        "bucket": bucket,
        "micro_batch_size": trainer.micro_batch_size,
        "accumulation_steps": trainer.accumulation_steps,
        "examples_per_update": trainer.target_batch_size,  # the next update's
        "compiles": trainer.compiles,
        "capacity": trainer.capacity(),
        "memory_limit": trainer.memory_limit,
        "search_log": [trial._asdict() for trial in trainer.search_log],
    }


class Workdir(contextlib.AbstractContextManager):
    """A run's directory, created when missing.

    Args:
        path: the directory (resolved: nothing is created outside it).
        config: the run's config, written into ``plan.json``.
        run, examples_per_update: `Checkpoints`'s; no checkpoints when ``run`` is None.

    Raises:
        ValueError: a directory that cannot be used, or holds checkpoints that are not
            to be resumed or cannot be (`Checkpoints.check_resumable`).
    """

    def __init__(
        self,
        path: str | Path,
        config: TrainConfig,
        run: Mapping[str, Any] | None = None,
        *,
        examples_per_update: int | Callable[[int], int] | None = None,
    ):
        self.path, self.config = Path(path).resolve(), config
        self._metrics: TextIO | None = None
        self._plan: Any = None
        self.primary = jax.process_index() == 0  # the one process writing plans and lines
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"--workdir {str(path)!r} is a file; it must name a directory.")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if self.primary:
                (self.path / "metrics.jsonl").touch()
        except OSError as exc:
            raise ValueError(
                f"--workdir {str(path)!r} cannot be used: {exc.strerror or exc}."
            ) from exc
        self.checkpoints = None
        if run is None:
            return
        self.checkpoints = Checkpoints(
            self.path / "checkpoints", dict(run), examples_per_update=examples_per_update
        )
        try:  # checkpoints moved aside count: a run that does not resume starts over them
            if self.checkpoints.latest() is not None or self.checkpoints.aside():
                if not config.resume:
                    raise ValueError(
                        f"{self.path} already holds checkpoints; pass --resume to go on, or "
                        "another --workdir."
                    )
                self.checkpoints.check_resumable()  # before anything is built
        except ValueError:
            self.checkpoints.close()
            raise

    def write_plan(self, plans: list[dict[str, Any]], *, search_seconds: float) -> None:
        """(Re)writes ``plan.json`` when the plans or the search time changed."""
        plan = {"plans": plans, "search_seconds": search_seconds}
        if plan != self._plan and self.primary:
            text = {"config": dataclasses.asdict(self.config), **plan}
            (self.path / "plan.json").write_text(json.dumps(text, indent=1, default=str))
            self._plan = plan

    def start(self, done: int) -> None:
        """Keeps only the lines of updates ``1..done``: a resumed run writes the rest again."""
        if not self.primary:
            return
        if self._metrics is not None:
            self._metrics.close()
        path, kept = self.path / "metrics.jsonl", []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:  # a killed run may leave half a line
                if int(json.loads(line)["update"]) <= done:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
        tmp = path.with_name(f".metrics-{os.getpid()}.jsonl")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        self._metrics = open(path, "a")

    def log(self, line: dict[str, Any]) -> None:
        """Appends one update's metrics as a JSON line (flushed: a killed run keeps it)."""
        if not self.primary:
            return
        if self._metrics is None:
            self._metrics = open(self.path / "metrics.jsonl", "a")
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()

    def resume(self, state: TrainState) -> tuple[TrainState, int, int]:
        """``(state, data position, updates done)``: the latest checkpoint's with ``--resume``."""
        if self.config.resume and self.checkpoints is not None:
            restored = self.checkpoints.restore(state)
            if restored is not None:
                return restored[0], restored[1], int(restored[0].updates)
        return state, 0, 0

    def save(self, update: int, state: TrainState, position: int) -> None:
        """Checkpoints after ``update`` updates (nothing without checkpoints)."""
        if self.checkpoints is not None:
            self.checkpoints.save(update, state, position)

    def __exit__(self, *exc: object) -> None:
        """Closes the metrics file and waits for the checkpoints."""
        if self._metrics is not None:
            self._metrics.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
