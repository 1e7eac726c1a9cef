"""A run's directory: ``plan.json``, ``metrics.jsonl`` and the checkpoints.

``plan.json`` has one shape for both paths of the command line: ``{"config": {...},
"plans": [...], "search_seconds": s}``, a `plan_entry` per trainer: the image path's one
with ``"bucket": null``, the GPT's one per bucket planned so far. ``metrics.jsonl`` holds
one line per update, however often a resumed run redid it; the checkpoints are
`jax_adaptive.cli.checkpoints.Checkpoints`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any, TextIO

from jax_adaptive.cli.checkpoints import Checkpoints
from jax_adaptive.cli.config import TrainConfig
from jax_adaptive.step import TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = ["Workdir", "plan_entry"]


def plan_entry(trainer: AdaptiveTrainer, bucket: Hashable | None = None) -> dict[str, Any]:
    """One trainer's plan as ``plan.json`` holds it (every `SizeTrial` field passes through).

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax
        >>> trainer = AdaptiveTrainer(lambda p, b, r: (b * p) ** 2, optax.sgd(0.1),
        ...                           target_batch_size=8, micro_batch_size=4)
        >>> _ = trainer.init(jnp.ones(()), np.ones(8, np.float32))
        >>> entry = plan_entry(trainer)
        >>> entry["bucket"], entry["micro_batch_size"], entry["accumulation_steps"]
        (None, 4, 2)
    """
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
    """A run's directory: ``plan.json``, ``metrics.jsonl`` and, for ``run``, checkpoints.

    Args:
        path: the directory (created when missing).
        config: the run's config, written into ``plan.json``.
        run: what a checkpoint must agree on to be resumed; None: no checkpoints.
        examples_per_update: what a checkpoint's data position must be after its
            updates (`jax_adaptive.cli.checkpoints.Checkpoints`); None: the path checks the
            position itself.

    Raises:
        ValueError: when the directory holds checkpoints and ``config.resume`` is off, or
            when it resumes and every checkpoint was moved aside as damaged.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp, Workdir(tmp, TrainConfig()) as work:
        ...     work.write_plan([], search_seconds=0.0)
        ...     work.log({"update": 1, "loss": 0.5})
        ...     sorted(p.name for p in work.path.iterdir())
        ['metrics.jsonl', 'plan.json']
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
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"--workdir {str(path)!r} is a file; it must name a directory.")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "metrics.jsonl").touch()
        except OSError as exc:
            raise ValueError(
                f"--workdir {str(path)!r} cannot be used: {exc.strerror or exc}."
            ) from exc
        self.checkpoints = None
        if run is not None:
            self.checkpoints = Checkpoints(
                self.path / "checkpoints", run, examples_per_update=examples_per_update
            )
        # Checkpoints moved aside as damaged count: a run that does not resume would
        # start afresh over them.
        held = self.checkpoints is not None and bool(
            self.checkpoints.latest() is not None or self.checkpoints.aside()
        )
        try:
            if held and not config.resume:
                raise ValueError(
                    f"{self.path} already holds checkpoints; pass --resume to go on, or "
                    "another --workdir."
                )
            if held:
                self.checkpoints.check_resumable()  # before anything is built
        except ValueError:
            self.checkpoints.close()
            raise
        self._metrics: TextIO | None = None
        self._plan: Any = None

    @classmethod
    def of(
        cls,
        config: TrainConfig,
        run: Mapping[str, Any] | None = None,
        *,
        examples_per_update: int | Callable[[int], int] | None = None,
    ) -> contextlib.AbstractContextManager[Workdir | None]:
        """The config's workdir as a context (None without ``config.workdir``); args as above.

        Examples:
            >>> with Workdir.of(TrainConfig()) as work:
            ...     print(work)
            None
        """
        if config.workdir is None:
            return contextlib.nullcontext()
        return cls(config.workdir, config, run, examples_per_update=examples_per_update)

    def write_plan(self, plans: list[dict[str, Any]], *, search_seconds: float) -> None:
        """(Re)writes ``plan.json`` when the plans or the search time changed."""
        plan = {"plans": plans, "search_seconds": search_seconds}
        if plan != self._plan:
            text = {"config": dataclasses.asdict(self.config), **plan}
            (self.path / "plan.json").write_text(json.dumps(text, indent=1, default=str))
            self._plan = plan

    def start(self, done: int) -> None:
        """Keeps only the lines of updates ``1..done`` in ``metrics.jsonl``.

        A run that goes on after ``done`` updates (a resumed one) writes the later ones
        again: one line per update, however often they were redone.

        Examples:
            >>> import tempfile
            >>> with tempfile.TemporaryDirectory() as tmp, Workdir(tmp, TrainConfig()) as work:
            ...     for update in (1, 2, 3):
            ...         work.log({"update": update})
            ...     work.start(1)
            ...     work.log({"update": 2})
            ...     (work.path / "metrics.jsonl").read_text().split()
            ['{"update":', '1}', '{"update":', '2}']
        """
        if self._metrics is not None:
            self._metrics.close()
        path = self.path / "metrics.jsonl"
        kept = []
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
        if self._metrics is None:
            self._metrics = open(self.path / "metrics.jsonl", "a")
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()

    def resume(self, state: TrainState) -> tuple[TrainState, int, int]:
        """Where the run goes on from: ``(state, data position, updates done)``.

        The latest intact checkpoint's with ``--resume`` (placed like ``state``), else
        ``state`` itself at position 0 after 0 updates.

        Examples:
            >>> import tempfile, jax, jax.numpy as jnp, optax
            >>> from jax_adaptive.step import multi_steps
            >>> params = {"w": jnp.ones(2)}
            >>> opt = multi_steps(optax.sgd(1.0), 1).init(params)
            >>> state = TrainState(params, opt._replace(gradient_step=jnp.int32(3)), (),
            ...                    jax.random.key(0))  # after 3 updates
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     with Workdir(tmp, TrainConfig(), {"seed": 0}) as work:
            ...         work.save(3, state, position=96)
            ...     with Workdir(tmp, TrainConfig(resume=True), {"seed": 0}) as work:
            ...         _, position, done = work.resume(state)
            >>> position, done
            (96, 3)
        """
        if self.config.resume and self.checkpoints is not None:
            restored = self.checkpoints.restore(state)
            if restored is not None:
                state, position = restored
                return state, position, int(state.updates)
        return state, 0, 0

    def save(self, update: int, state: TrainState, position: int) -> None:
        """Checkpoints after ``update`` updates (nothing without checkpoints)."""
        if self.checkpoints is not None:
            self.checkpoints.save(update, state, position)

    def close(self) -> None:
        """Closes the metrics file and waits for the checkpoints."""
        if self._metrics is not None:
            self._metrics.close()
        if self.checkpoints is not None:
            self.checkpoints.close()

    def __exit__(self, *exc: object) -> None:
        self.close()
