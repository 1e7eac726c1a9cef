"""Checkpoints of a run with orbax: the train state, the data position and the run's config.

A checkpoint is written atomically (orbax renames a finished temporary directory), so a
process killed mid-save leaves the previous checkpoint as the latest. Resuming checks
that the checkpoint's config is the one being run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_adaptive.distributed import place
from jax_adaptive.step import TrainState

__all__ = ["Checkpoints"]


def _to_saved(state: TrainState) -> dict[str, Any]:
    leaves = state._replace(rng=jax.random.key_data(state.rng))
    return {"state": jax.tree.map(np.asarray, leaves)}


class Checkpoints:
    """The checkpoints of one run in ``directory``; keeps the last ``max_to_keep``.

    Args:
        directory: where the checkpoints go (created when missing).
        run: what the run's result depends on (model, data, seeds, ...); a checkpoint
            written under another ``run`` is refused on restore.
        max_to_keep: how many checkpoints to keep.

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

    def __init__(self, directory: str | Path, run: dict[str, Any], *, max_to_keep: int = 2):
        self.run = dict(run)
        self._manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest(self) -> int | None:
        """The update of the latest finished checkpoint, or None."""
        return self._manager.latest_step()

    def save(self, update: int, state: TrainState, position: int) -> None:
        """Saves the state after ``update`` updates and the data stream's ``position``."""
        meta = {"run": self.run, "position": int(position), "update": int(update)}
        self._manager.save(
            update,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_to_saved(state)), meta=ocp.args.JsonSave(meta)
            ),
        )

    def restore(self, like: TrainState) -> tuple[TrainState, int] | None:
        """The latest state (shaped and placed like ``like``) and data position, or None.

        Raises:
            ValueError: when the checkpoint was written by a run of another config.
        """
        update = self.latest()
        if update is None:
            return None
        meta = self._manager.restore(update, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        if meta["meta"]["run"] != self.run:
            theirs, ours = meta["meta"]["run"], self.run
            diff = {k: (theirs.get(k), ours.get(k)) for k in ours if theirs.get(k) != ours.get(k)}
            raise ValueError(
                f"the checkpoint in {self._manager.directory} is of another run "
                f"(checkpoint vs now: {diff}); resume with the same flags or use a new --workdir."
            )
        target = _to_saved(like)
        restored = self._manager.restore(
            update, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )["state"]["state"]
        saved = jax.tree.unflatten(jax.tree.structure(target["state"]),
                                   jax.tree.leaves(restored))  # fmt: skip
        state = saved._replace(rng=jax.random.wrap_key_data(saved.rng))
        where = jax.tree.map(lambda x: x.sharding, like)  # a device, or shardings over a mesh
        return place(state, where), int(meta["meta"]["position"])

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
