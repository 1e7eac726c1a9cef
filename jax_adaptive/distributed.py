"""Several devices and several processes: the data mesh, sharded micro-batches, agreement.

Data parallelism is JAX's own SPMD: the micro-step is compiled once for a
``NamedSharding`` that splits the micro-batch over the mesh's data axis, and XLA inserts
the gradient reduction. The searched size is per device (XLA's memory analysis of an
SPMD program is per device), so the global micro-batch is a multiple of the number of
data shards.

Under ``jax.distributed`` every process runs the same program and must take the same
decisions at the same moment, else one waits in a collective the others never reach.
The trainer therefore agrees, through the small collectives here, on the planned size
(the minimum any process found) and, before every micro-step runs, on whether any
process is out of memory: then all raise, all shrink together, and all redo the update.
With one process these are free pass-throughs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["data_mesh", "place", "process_any", "process_min"]


def data_mesh(devices: Sequence[jax.Device] | None = None, axis: str = "data") -> Mesh:
    """A one-axis mesh over ``devices`` (all devices of all processes by default).

    Args:
        devices: the devices, in order; ``jax.devices()`` by default.
        axis: the mesh axis' name, the one the micro-batch is split over.

    Returns:
        The ``jax.sharding.Mesh``.

    Example:
        >>> import jax_adaptive as ja
        >>> ja.data_mesh().shape["data"] == jax.device_count()
        True
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("data_mesh needs at least one device.")
    return Mesh(np.array(devices), (axis,))


def place(tree: Any, where: Any) -> Any:
    """Puts a pytree on a device or sharding, the same on every process.

    Like ``jax.device_put``, but also onto a sharding that spans other processes'
    devices (under ``jax.distributed``): each process fills only the shards of its own
    devices from its copy of the values, which must be the same on every process.

    Args:
        tree: a pytree of arrays (host or device, PRNG keys included).
        where: a ``jax.Device`` or ``Sharding``, or a pytree of them matching ``tree``.

    Returns:
        The pytree of ``jax.Array``s.

    Example:
        >>> import jax_adaptive as ja
        >>> sharding = NamedSharding(ja.data_mesh(), PartitionSpec("data"))
        >>> x = ja.place({"x": np.ones((jax.device_count(), 3))}, sharding)["x"]
        >>> x.sharding == sharding
        True
    """
    if isinstance(where, jax.Device | jax.sharding.Sharding):
        where = jax.tree.map(lambda _: where, tree)
    return jax.tree.map(_place_leaf, tree, where)


def _place_leaf(leaf: Any, where: Any) -> jax.Array:
    if isinstance(where, jax.Device) or where.is_fully_addressable:
        return jax.device_put(leaf, where)
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        data = _place_leaf(jax.random.key_data(leaf), where)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
    host = np.asarray(jax.device_get(leaf))
    return jax.make_array_from_callback(host.shape, where, lambda index: host[index])


def _gather(value: int) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(np.int64(value)))


def process_min(value: int) -> int:
    """The smallest ``value`` over all processes (every process must call it).

    Example:
        >>> process_min(7)  # one process
        7
    """
    if jax.process_count() == 1:
        return int(value)
    return int(_gather(int(value)).min())


def process_any(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (every process must call it).

    Example:
        >>> process_any(False)  # one process
        False
    """
    if jax.process_count() == 1:
        return bool(flag)
    return bool(_gather(int(bool(flag))).max())


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that keeps a full copy on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())
