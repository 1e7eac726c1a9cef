"""A run's orbax checkpoints: the train state, the data position and what defines the run.

Only a checkpoint whose contents fail an integrity check (its SHA-256, a missing or empty
file) is moved aside, to ``<directory>-damaged/``; any other error propagates.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_adaptive.distributed import place
from jax_adaptive.step import TrainState

__all__ = ["Checkpoints", "damage", "state_digest"]

# tensorstore's status for bytes it could not decode, a range or key not in a file, and a
# stream that does not decompress: what a flipped, truncated or deleted file of an orbax
# checkpoint gave (each measured). UNAVAILABLE, UNKNOWN, ... may pass.
_DAMAGE_STATUSES = ("DATA_LOSS:", "OUT_OF_RANGE:", "NOT_FOUND:", "FAILED_PRECONDITION:")


class _Damaged(Exception):
    """A checkpoint that cannot be trusted; the message says why."""


def _to_saved(state: TrainState) -> dict[str, Any]:
    return {"state": jax.tree.map(np.asarray, state._replace(rng=jax.random.key_data(state.rng)))}


def state_digest(tree: Any, update: int, position: int) -> str:
    """The SHA-256 of a saved state's arrays (dtype, shape, bytes), its update and position.

    Examples:
        >>> tree = {"w": np.ones(2, np.float32)}
        >>> state_digest(tree, 1, 8) == state_digest(tree, 1, 8) != state_digest(tree, 1, 16)
        True
    """
    digest = hashlib.sha256(f"update={int(update)} position={int(position)}".encode())
    for leaf in jax.tree.leaves(tree):
        leaf = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{leaf.dtype.str}{leaf.shape}".encode())
        digest.update(leaf.tobytes())
    return digest.hexdigest()


def damage(exc: BaseException) -> str | None:
    """What ``exc``, raised reading a checkpoint, says is wrong with its contents.

    None for an error that may pass (``EIO``, ``MemoryError``, tensorstore's
    ``UNAVAILABLE``, ...): the checkpoint must then stay where it is.

    Examples:
        >>> damage(ValueError("DATA_LOSS: Error decoding manifest: CRC-32C checksum"))
        'tensorstore reports DATA_LOSS'
        >>> damage(FileNotFoundError(2, "No such file")), damage(OSError(5, "I/O error"))
        ('a file is missing', None)
    """
    if isinstance(exc, FileNotFoundError):
        return "a file is missing"
    if isinstance(exc, UnicodeDecodeError | json.JSONDecodeError):
        return f"a file does not decode ({type(exc).__name__})"
    if type(exc) is ValueError and str(exc).startswith(_DAMAGE_STATUSES):
        return f"tensorstore reports {str(exc).split(':')[0]}"
    return None


def _differs(key: str, there: Any, now: Any) -> str:
    return f"--{key.replace('_', '-')} {there} there, {now} now"


class Checkpoints:
    """The checkpoints of one run in ``directory``, the last ``max_to_keep`` kept.

    Args:
        directory: where they go (created when missing).
        run: what defines the training; a checkpoint of another is refused.
        max_to_keep: how many to keep.
        examples_per_update: the data position after an update: times the update, or
            called with it; None: not checked.
    """

    def __init__(
        self,
        directory: str | Path,
        run: dict[str, Any],
        *,
        max_to_keep: int = 2,
        examples_per_update: int | Callable[[int], int] | None = None,
    ):
        self.run, self.directory = dict(run), Path(directory).resolve()
        self.aside_directory = self.directory.with_name(self.directory.name + "-damaged")
        self.examples_per_update = examples_per_update
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest(self) -> int | None:
        """The update of the latest finished checkpoint, or None."""
        return self._manager.latest_step()

    def aside(self) -> list[Path]:
        """The checkpoints moved aside as damaged, by name (update, then when)."""
        return sorted(self.aside_directory.iterdir()) if self.aside_directory.is_dir() else []

    def save(self, update: int, state: TrainState, position: int) -> None:
        """Saves the state after ``update`` updates and the data stream's ``position``."""
        saved = _to_saved(state)
        meta = {"run": self.run, "position": int(position), "update": int(update),
                "sha256": state_digest(saved, update, position)}  # fmt: skip
        args = ocp.args.Composite(state=ocp.args.StandardSave(saved), meta=ocp.args.JsonSave(meta))
        self._manager.save(update, args=args)

    def restore(self, like: TrainState) -> tuple[TrainState, int] | None:
        """The newest intact ``(state, data position)``, placed like ``like``; None: none.

        A damaged checkpoint is moved aside with a warning and the one before tried; one
        of another training or structure, or none intact left, is a one-line `ValueError`.
        """
        self._manager.wait_until_finished()
        for update in sorted(self._manager.all_steps(), reverse=True):
            try:
                return self._restore(update, like)
            except _Damaged as exc:
                aside = self._move_aside(update)
                warnings.warn(
                    f"checkpoint {update} in {self.directory} is damaged ({exc}); moved it to "
                    f"{aside} and trying the one before it.",
                    stacklevel=2,
                )
        self.check_resumable()
        return None

    def check_resumable(self) -> None:
        """Refuses in one line what `restore` would: none intact, or another training."""
        latest = self.latest()
        if latest is None and self.aside():
            raise ValueError(
                f"no intact checkpoint in {self.directory}: the damaged ones are in "
                f"{self.aside_directory} ({', '.join(p.name for p in self.aside())}); move "
                "one back if it is intact, or start afresh in a new --workdir."
            )
        if latest is not None:
            with contextlib.suppress(_Damaged):  # `restore` moves it aside
                self._check_run(self._read(latest, "meta", ocp.args.JsonRestore()))

    def _check_run(self, meta: Any) -> int:
        """A checkpoint's data position, once its run is this one's."""
        try:  # our own record: a structure other than ours is damage
            run, position = dict(meta["run"]), int(meta["position"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _Damaged(f"its metadata is not ours ({type(exc).__name__}: {exc})") from exc
        differ = [k for k in {**run, **self.run} if run.get(k) != self.run.get(k)]
        if differ:
            said = "; ".join(_differs(k, run.get(k), self.run.get(k)) for k in differ)
            raise ValueError(
                f"the checkpoint in {self.directory} is of another training: {said}. Resume with "
                "the flags that wrote it, or use a new --workdir (only the plan may differ: "
                "--memory-limit, --micro-batch-size, --objective, ...)."
            )
        return position

    def _read(self, update: int, item: str, args: Any) -> Any:
        """A checkpoint's item (arrays on the host); an error `damage` names is `_Damaged`."""
        try:
            restored = self._manager.restore(update, args=ocp.args.Composite(**{item: args}))
            return restored[item] if item == "meta" else jax.tree.map(np.asarray, restored[item])
        except Exception as exc:
            reason = damage(exc)
            if reason is None:
                raise  # may pass: the checkpoint stays
            raise _Damaged(f"its {item} cannot be read: {reason}") from exc

    def _restore(self, update: int, like: TrainState) -> tuple[TrainState, int]:
        step = self.directory / str(update)
        for item in ("meta", "state"):  # orbax writes no empty file, nor an empty item
            if not (step / item).is_dir() or not any((step / item).iterdir()):
                raise _Damaged(f"its {item} is missing or empty")
        empty = [p for p in sorted(step.rglob("*")) if p.is_file() and not p.stat().st_size]
        if empty:
            raise _Damaged(f"{empty[0].relative_to(step)} is empty")
        meta = self._read(update, "meta", ocp.args.JsonRestore())
        position, target = self._check_run(meta), _to_saved(like)
        try:
            restored = self._read(update, "state", ocp.args.StandardRestore(target))["state"]
        except ValueError as exc:
            if not str(exc).startswith("pytree structure error"):
                raise
            if not (step / "state" / "_METADATA").is_file():
                raise _Damaged("its state/_METADATA is missing") from exc
            raise ValueError(
                f"checkpoint {update} in {self.directory} holds a state of another structure "
                "than this run's (changed code?); resume with the code that wrote it or use "
                "a new --workdir."
            ) from exc
        saved = jax.tree.unflatten(jax.tree.structure(target["state"]), jax.tree.leaves(restored))
        if "sha256" in meta and state_digest({"state": saved}, update, position) != meta["sha256"]:
            raise _Damaged("its arrays, update or position differ from what was saved")
        per_update = self.examples_per_update
        expected = per_update(update) if callable(per_update) else update * (per_update or 0)
        if per_update is not None and position != expected:
            raise _Damaged(f"its data position {position} is not {expected}, the examples of "
                           f"its {update} updates")  # fmt: skip
        state = saved._replace(rng=jax.random.wrap_key_data(saved.rng))
        return place(state, jax.tree.map(lambda x: x.sharding, like)), position

    def _move_aside(self, update: int) -> Path:
        """Moves a damaged step out of orbax's directory (a later save may reuse its number)."""
        source = self.directory / str(update)
        target = self.aside_directory / f"{update}-{time.strftime('%Y%m%dT%H%M%S')}"
        if source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(source, target)
        self._manager.reload()
        return target

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
