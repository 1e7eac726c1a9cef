"""A run's directory: ``plan.json``, ``metrics.jsonl`` (one line per update) and checkpoints.

``plan.json`` is ``{"config", "plans", "search_seconds"}``, a `plan_entry` per trainer; a
resumed run adds ``resumed_at`` (the updates done before it) and ``earlier_runs``: the
``plans``, ``search_seconds`` and ``resumed_at`` of each run before it in the workdir, in
order, so that the whole run's search history stays (`python -m jax_adaptive.report`).
Under ``jax.distributed`` process 0 alone writes these; every process saves checkpoints.
One run holds a workdir at a time (`WorkdirLock`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import time
import warnings
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any, TextIO

import jax

from jax_adaptive.cli.checkpoints import Checkpoints
from jax_adaptive.cli.config import TrainConfig
from jax_adaptive.cli.scalars import ScalarWriter
from jax_adaptive.files import write_atomic
from jax_adaptive.step import TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = ["Workdir", "WorkdirLock", "earlier_runs", "plan_entry"]


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


def earlier_runs(path: Path) -> list[dict[str, Any]]:
    """The runs a resumed run's ``plan.json`` keeps: those of the one at ``path``, then it.

    Each is ``{"plans", "search_seconds", "resumed_at"}``; none from a ``plan.json`` that
    is missing or unreadable (a run killed before it wrote one).

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "plan.json"
        >>> _ = path.write_text(json.dumps({"config": {}, "plans": [], "search_seconds": 1.5}))
        >>> earlier_runs(path)
        [{'plans': [], 'search_seconds': 1.5, 'resumed_at': 0}]
    """
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(plan, dict) or not isinstance(plan.get("plans"), list):
        return []
    before = [r for r in plan.get("earlier_runs") or [] if isinstance(r, dict)]
    run = {k: plan.get(k) for k in ("plans", "search_seconds")}
    return [*before, {**run, "resumed_at": plan.get("resumed_at", 0)}]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkdirLock:
    """The lock file ``<directory>/.lock`` of the run that holds a workdir: its pid and host.

    It is created exclusively and whole (never through a symbolic link). A lock left by a
    process that no longer runs on this host is taken over with a warning; any other is a
    one-line `ValueError` naming its holder. Under ``jax.distributed`` each process holds
    its own (``.lock``, ``.lock-1``, ...), so a second job is refused on every process.

    Args:
        directory: the workdir (it exists).
        process: this process's index in a ``jax.distributed`` job.

    Examples:
        >>> import tempfile
        >>> directory = Path(tempfile.mkdtemp())
        >>> lock = WorkdirLock(directory)
        >>> WorkdirLock(directory)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --workdir ... is in use by process ... on host ... (since ...); wait ...
        >>> lock.release(); WorkdirLock(directory).release()
    """

    def __init__(self, directory: str | Path, process: int = 0):
        self.path = Path(directory) / (".lock" if not process else f".lock-{process}")
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
        if self._create():
            return
        # Takeovers of a stale lock are serialised (a flock of the directory: no file is
        # written): two runs that both find it stale must not both remove it, the second
        # would remove the first's new lock.
        guard = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)  # released when the descriptor closes
            if self._create():
                return
            held = self._read()
            here = held.get("host") == self.holder["host"]
            pid = held.get("pid")
            if not (here and isinstance(pid, int) and pid > 0 and not _alive(pid)):
                gone = "." if here and pid else f" (if it has ended, remove {self.path})."
                raise ValueError(
                    f"--workdir {str(self.path.parent)!r} is in use by process {pid} on host "
                    f"{held.get('host')} (since {held.get('since')}); wait for that run to end, "
                    f"or use another --workdir{gone}"
                )
            self.path.unlink()
            if not self._create():  # a run that takes no takeover guard: none of ours
                raise ValueError(f"--workdir {str(self.path.parent)!r} was taken meanwhile.")
        finally:
            os.close(guard)
        warnings.warn(
            f"took over {self.path} from process {pid}, which no longer runs on this host "
            f"(a run that was killed?); held since {held.get('since')}.",
            stacklevel=2,
        )

    def _create(self) -> bool:
        """Creates the lock file with this process as holder; False if there is one.

        It appears whole: written to a file of this process's own, then hard-linked into
        place, which fails if the lock exists (as ``O_EXCL`` would). Created empty and
        then written, a second run that read it in between named "process None" (1 CI-like
        run in 4).
        """
        if self.path.is_symlink():
            raise ValueError(f"{self.path} is a symbolic link; remove it.")
        mine = self.path.with_name(f"{self.path.name}.{os.getpid()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        self._write(os.open(mine, flags, 0o666))
        try:
            os.link(mine, self.path)
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: created, then written
            return self._create_then_write()
        finally:
            mine.unlink(missing_ok=True)
        return True

    def _create_then_write(self) -> bool:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o666)
        except FileExistsError:
            return False
        self._write(fd)
        return True

    def _write(self, fd: int) -> None:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.holder))
            f.flush()
            os.fsync(f.fileno())

    def _read(self) -> dict[str, Any]:
        """The holder a lock file names; {} for one written half (its writer was killed)."""
        try:
            held = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return held if isinstance(held, dict) else {}

    def release(self) -> None:
        """Removes the lock file if this process still holds it."""
        if self._read() == self.holder:
            self.path.unlink(missing_ok=True)


class Workdir(contextlib.AbstractContextManager):
    """A run's directory, created when missing.

    Args:
        path: the directory (resolved: nothing is created outside it).
        config: the run's config, written into ``plan.json``.
        run, examples_per_update: `Checkpoints`'s; no checkpoints when ``run`` is None.

    Raises:
        ValueError: a directory that cannot be used, is held by another run
            (`WorkdirLock`, checked before anything is written), or holds checkpoints
            that are not to be resumed or cannot be (`Checkpoints.check_resumable`).
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
        self._earlier: list[dict[str, Any]] = []  # the runs before this one (a resume)
        self._resumed_at = 0
        self._scalars: ScalarWriter | None = None  # --tensorboard's event file
        self.primary = jax.process_index() == 0  # the one process writing plans and lines
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"--workdir {str(path)!r} is a file; it must name a directory.")
        self.checkpoints = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock = WorkdirLock(self.path, jax.process_index())  # before any write
        except OSError as exc:
            raise ValueError(
                f"--workdir {str(path)!r} cannot be used: {exc.strerror or exc}."
            ) from exc
        try:
            if self.primary:
                (self.path / "metrics.jsonl").touch()
            if run is None:
                return
            self.checkpoints = Checkpoints(
                self.path / "checkpoints", dict(run), examples_per_update=examples_per_update
            )
            # checkpoints moved aside count: a run that does not resume starts over them
            if self.checkpoints.latest() is not None or self.checkpoints.aside():
                if not config.resume:
                    raise ValueError(
                        f"{self.path} already holds checkpoints; pass --resume to go on, or "
                        "another --workdir."
                    )
                self.checkpoints.check_resumable()  # before anything is built
            if config.resume and self.primary:
                self._earlier = earlier_runs(self.path / "plan.json")
        except BaseException:
            self.__exit__()
            raise

    def write_plan(self, plans: list[dict[str, Any]], *, search_seconds: float) -> None:
        """(Re)writes ``plan.json`` when the plans or the search time changed."""
        plan: dict[str, Any] = {"plans": plans, "search_seconds": search_seconds}
        if self._resumed_at:
            plan["resumed_at"] = self._resumed_at
        if self._earlier:
            plan["earlier_runs"] = self._earlier
        if plan != self._plan and self.primary:
            text = {"config": dataclasses.asdict(self.config), **plan}
            write_atomic(self.path / "plan.json", json.dumps(text, indent=1, default=str))
            self._plan = plan

    def start(self, done: int) -> None:
        """Keeps only the lines of updates ``1..done``: a resumed run writes the rest again."""
        self._resumed_at = done
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
        write_atomic(path, "".join(kept))
        self._metrics = open(path, "a")
        if self.config.tensorboard:
            if self._scalars is not None:
                self._scalars.close()
            self._scalars = ScalarWriter(self.path, self.config.learning_rate, start=done)

    def log(self, line: dict[str, Any]) -> None:
        """Appends one update's metrics as a JSON line (flushed: a killed run keeps it).

        With ``--tensorboard``, also its scalars to the event file (`ScalarWriter`).
        """
        if not self.primary:
            return
        if self._metrics is None:
            self._metrics = open(self.path / "metrics.jsonl", "a")
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()
        if self._scalars is not None:
            self._scalars.write(line)

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
        """Closes the metrics file, waits for the checkpoints and releases the workdir."""
        try:
            if self._metrics is not None:
                self._metrics.close()
            if self._scalars is not None:
                self._scalars.close()
            if self.checkpoints is not None:
                self.checkpoints.close()
        finally:
            self.lock.release()
