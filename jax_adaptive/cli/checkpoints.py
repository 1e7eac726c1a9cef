"""Checkpoints of a run with orbax: the train state, the data position and the run's config.

A checkpoint is written atomically (orbax renames a finished temporary directory), so a
process killed mid-save leaves the previous checkpoint as the latest. Each one records
a SHA-256 digest of its arrays, its update and its data position; restoring recomputes
it from what was read. A checkpoint that is damaged (a flipped byte, a missing or empty
directory, a digest that disagrees, a data position that is not its update's) is moved
aside to ``<directory>-damaged/`` with a warning, and the newest intact one is used.
Resuming checks that the checkpoint's config is the one being run.
"""

from __future__ import annotations

import hashlib
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

__all__ = ["Checkpoints", "state_digest"]


def _to_saved(state: TrainState) -> dict[str, Any]:
    leaves = state._replace(rng=jax.random.key_data(state.rng))
    return {"state": jax.tree.map(np.asarray, leaves)}


def state_digest(tree: Any, update: int, position: int) -> str:
    """The SHA-256 of a saved state's arrays (dtype, shape, bytes), its update and position.

    Example:
        >>> a = state_digest({"w": np.ones(2, np.float32)}, update=1, position=8)
        >>> a == state_digest({"w": np.ones(2, np.float32)}, 1, 8), a == state_digest(
        ...     {"w": np.ones(2, np.float32)}, 1, 16)
        (True, False)
    """
    digest = hashlib.sha256(f"update={int(update)} position={int(position)}".encode())
    for leaf in jax.tree.leaves(tree):
        leaf = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{leaf.dtype.str}{leaf.shape}".encode())
        digest.update(leaf.tobytes())
    return digest.hexdigest()


class _Damaged(Exception):
    """A checkpoint that cannot be trusted; the message says why."""


class Checkpoints:
    """The checkpoints of one run in ``directory``; keeps the last ``max_to_keep``.

    Args:
        directory: where the checkpoints go (created when missing).
        run: what the run's result depends on (model, data, seeds, ...); a checkpoint
            written under another ``run`` is refused on restore.
        max_to_keep: how many checkpoints to keep.
        examples_per_update: when given, a checkpoint's data position must be its
            update times this, or, a callable (a batch-size schedule's
            ``examples_before``), what it gives for the update (a stream that read past
            its updates is not resumed).

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, optax
        >>> from jax_adaptive.step import multi_steps
        >>> params = {"w": jnp.ones(2)}
        >>> state = TrainState(params, multi_steps(optax.sgd(1.0), 1).init(params), (),
        ...                    jax.random.key(0))
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     ckpt = Checkpoints(tmp, {"seed": 0})
        ...     ckpt.save(1, state, position=64)
        ...     restored, position = ckpt.restore(state)
        ...     ckpt.close()
        >>> position, restored.params["w"].tolist()
        (64, [1.0, 1.0])
    """

    def __init__(
        self,
        directory: str | Path,
        run: dict[str, Any],
        *,
        max_to_keep: int = 2,
        examples_per_update: int | Callable[[int], int] | None = None,
    ):
        self.run = dict(run)
        self.directory = Path(directory).absolute()
        self.examples_per_update = examples_per_update
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest(self) -> int | None:
        """The update of the latest finished checkpoint, or None."""
        return self._manager.latest_step()

    def save(self, update: int, state: TrainState, position: int) -> None:
        """Saves the state after ``update`` updates and the data stream's ``position``."""
        saved = _to_saved(state)
        meta = {
            "run": self.run,
            "position": int(position),
            "update": int(update),
            "sha256": state_digest(saved, update, position),
        }
        self._manager.save(
            update,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(saved), meta=ocp.args.JsonSave(meta)
            ),
        )

    def restore(self, like: TrainState) -> tuple[TrainState, int] | None:
        """The newest intact state (shaped and placed like ``like``) and data position.

        A damaged checkpoint is moved aside with a warning and the next older one tried.

        Returns:
            ``(state, position)``, or None when there is no checkpoint.

        Raises:
            ValueError: when the checkpoint was written by a run of another config, or
                when checkpoints exist but none is intact.
        """
        self._manager.wait_until_finished()
        steps = sorted(self._manager.all_steps(), reverse=True)
        damaged = []
        for update in steps:
            try:
                return self._restore(update, like)
            except _Damaged as exc:
                damaged.append(update)
                aside = self._move_aside(update)
                warnings.warn(
                    f"checkpoint {update} in {self.directory} is damaged ({exc}); moved it to "
                    f"{aside} and trying the one before it.",
                    stacklevel=2,
                )
        if damaged:
            raise ValueError(
                f"no intact checkpoint in {self.directory} (damaged: {damaged}); "
                "start afresh in a new --workdir."
            )
        return None

    def _restore(self, update: int, like: TrainState) -> tuple[TrainState, int]:
        try:
            meta = self._manager.restore(
                update, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
            run, position = meta["run"], int(meta["position"])
        except Exception as exc:  # orbax raises many types for unreadable data
            raise _Damaged(f"its metadata cannot be read: {type(exc).__name__}") from exc
        if run != self.run:
            diff = {k: (run.get(k), v) for k, v in self.run.items() if run.get(k) != v}
            raise ValueError(
                f"the checkpoint in {self.directory} is of another run (checkpoint vs now: "
                f"{diff}); resume with the same flags or use a new --workdir."
            )
        target = _to_saved(like)
        try:
            restored = self._manager.restore(
                update, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )["state"]["state"]
            arrays = jax.tree.map(np.asarray, jax.tree.leaves(restored))
        except Exception as exc:
            raise _Damaged(f"its arrays cannot be read: {type(exc).__name__}") from exc
        saved = jax.tree.unflatten(jax.tree.structure(target["state"]), arrays)
        if "sha256" in meta and state_digest({"state": saved}, update, position) != meta["sha256"]:
            raise _Damaged("its arrays, update or position differ from what was saved")
        per_update = self.examples_per_update
        if callable(per_update) and position != per_update(update):
            raise _Damaged(
                f"its data position {position} is not the {per_update(update)} examples of "
                f"{update} scheduled updates"
            )
        if isinstance(per_update, int) and position != update * per_update:
            raise _Damaged(
                f"its data position {position} is not {update} updates x {per_update} examples"
            )
        state = saved._replace(rng=jax.random.wrap_key_data(saved.rng))
        where = jax.tree.map(lambda x: x.sharding, like)  # a device, or shardings over a mesh
        return place(state, where), position

    def _move_aside(self, update: int) -> Path:
        """Moves a damaged step out of orbax's directory (a later save may reuse its number)."""
        source = self.directory / str(update)
        target = self.directory.with_name(self.directory.name + "-damaged") / (
            f"{update}-{time.strftime('%Y%m%dT%H%M%S')}"
        )
        if source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(source, target)
        self._manager.reload()
        return target

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
