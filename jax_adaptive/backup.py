"""Host copies of the arrays a run donates, put back where a failed run deleted them.

A program that donates its arguments and then runs out of memory leaves them deleted;
`backup` copies them to the host first, `put_back` restores the deleted ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["Backup", "backup", "backup_bytes", "deleted_leaves", "donated_backup", "put_back"]

Backup = dict[int, tuple[np.ndarray, Any]]
"""Host copies by leaf index: each leaf's value and its sharding."""


def backup(tree: Any, donated: Sequence[bool] | None = None) -> Backup:
    """Host copies of ``tree``'s device arrays (only those ``donated`` marks, if given).

    Examples:
        >>> import jax.numpy as jnp
        >>> saved = backup({"a": jnp.ones(2), "b": 3}, donated=[True, False])
        >>> list(saved), backup_bytes(saved)
        ([0], 8)
    """
    leaves = jax.tree.leaves(tree)
    marks = [True] * len(leaves) if donated is None else donated
    return {
        i: (jax.device_get(leaf), leaf.sharding)
        for i, (leaf, mark) in enumerate(zip(leaves, marks, strict=True))
        if mark and isinstance(leaf, jax.Array)
    }


def donated_backup(args: tuple[Any, ...], compiled: Any) -> Backup:
    """Host copies of the device arrays among ``args`` that ``compiled`` donates.

    Examples:
        >>> import jax.numpy as jnp
        >>> step = jax.jit(lambda state, x: state + x, donate_argnums=0)
        >>> args = (jnp.ones(2), jnp.ones(2))
        >>> list(donated_backup(args, step.lower(*args).compile()))  # the state's leaf
        [0]
    """
    donated = [info.donated for info in jax.tree.leaves(compiled.args_info[0])]
    return backup(args, donated)


def backup_bytes(saved: Backup) -> int:
    """The bytes ``saved`` holds on the host."""
    return sum(host.nbytes for host, _ in saved.values())


def deleted_leaves(tree: Any) -> list[int]:
    """The indices of ``tree``'s arrays that a run deleted (donated, then failed).

    Examples:
        >>> import jax.numpy as jnp
        >>> tree = [jnp.ones(1), jnp.ones(1)]
        >>> tree[1].delete()
        >>> deleted_leaves(tree)
        [1]
    """
    leaves = jax.tree.leaves(tree)
    return [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.is_deleted()]


def put_back(tree: Any, saved: Backup) -> Any:
    """``tree`` with each deleted array put back from ``saved`` (on its sharding).

    Raises:
        KeyError: a deleted array has no copy in ``saved``.

    Examples:
        >>> import jax.numpy as jnp
        >>> tree = {"w": jnp.ones(2)}
        >>> saved = backup(tree)
        >>> tree["w"].delete()
        >>> put_back(tree, saved)["w"].tolist()
        [1.0, 1.0]
    """
    leaves, treedef = jax.tree.flatten(tree)
    deleted = deleted_leaves(tree)
    if not deleted:
        return tree
    for i in deleted:
        host, sharding = saved[i]
        leaves[i] = jax.device_put(host, sharding)
    return jax.tree.unflatten(treedef, leaves)
