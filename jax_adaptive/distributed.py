"""Several devices and processes: the data mesh, sharded micro-batches, agreement.

`Placement` puts the state and micro-batches on a device or a mesh; `place` and `host_copy`
move pytrees to and from shardings that may span processes; `process_min` and `agreed` make
every process decide alike (docs/devices.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_adaptive.errors import PeerOutOfMemory, catch_oom
from jax_adaptive.sharding import checked_spec, spec_axes

__all__ = [
    "Agreement",
    "LocalShards",
    "Placement",
    "agreed",
    "data_mesh",
    "first_ready_everywhere",
    "host_copy",
    "local_copy",
    "place",
    "process_any",
    "process_means",
    "process_min",
    "process_sum",
    "while_all",
]

T = TypeVar("T")


def data_mesh(devices: Sequence[jax.Device] | None = None, axis: str = "data") -> Mesh:
    """A one-axis mesh named ``axis`` over ``devices`` (all by default; ValueError if none).

    Examples:
        >>> import jax_adaptive as ja
        >>> ja.data_mesh().shape["data"] == jax.device_count()
        True
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("data_mesh needs at least one device.")
    return Mesh(np.array(devices), (axis,))


def place(tree: Any, where: Any) -> Any:
    """``jax.device_put``, also onto a sharding that spans other processes' devices.

    ``where`` is a device or sharding, or a pytree of them matching ``tree``. Each process
    fills its own shards from its copy of the values or from `host_copy`'s `LocalShards`.

    Examples:
        >>> sharding = NamedSharding(data_mesh(), PartitionSpec("data"))
        >>> x = place({"x": np.ones((jax.device_count(), 3))}, sharding)["x"]
        >>> x.sharding == sharding
        True
    """
    if isinstance(where, jax.Device | jax.sharding.Sharding):
        where = jax.tree.map(lambda _: where, tree, is_leaf=_is_local_shards)
    return jax.tree.map(_place_leaf, tree, where, is_leaf=_is_local_shards)


def _place_leaf(leaf: Any, where: Any) -> jax.Array:
    if isinstance(leaf, LocalShards):
        return jax.make_array_from_callback(leaf.shape, where, leaf.piece)
    if isinstance(where, jax.Device) or where.is_fully_addressable:
        return jax.device_put(leaf, where)
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        data = _place_leaf(jax.random.key_data(leaf), where)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf))
    host = np.asarray(jax.device_get(leaf))
    return jax.make_array_from_callback(host.shape, where, lambda index: host[index])


@jax.tree_util.register_pytree_node_class
class LocalShards:
    """This process's shards of a global array, on the host, keyed by `LocalShards.key`."""

    def __init__(self, shape: tuple[int, ...], pieces: dict[tuple, np.ndarray]):
        self.shape, self.pieces = tuple(shape), pieces

    @staticmethod
    def key(index: tuple[slice, ...]) -> tuple:
        """A hashable key for a shard's index (a tuple of slices)."""
        return tuple((s.start, s.stop, s.step) for s in index)

    def piece(self, index: tuple[slice, ...]) -> np.ndarray:
        """The host copy of the shard at ``index``."""
        return self.pieces[self.key(index)]

    def tree_flatten(self) -> tuple[tuple[np.ndarray, ...], tuple]:
        """The pieces, and the shape and keys to rebuild it (the pytree protocol)."""
        return tuple(self.pieces.values()), (self.shape, tuple(self.pieces))

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: Any) -> LocalShards:
        """Rebuilds it from `tree_flatten`'s parts (the pytree protocol)."""
        return cls(aux[0], dict(zip(aux[1], children, strict=True)))


def _is_local_shards(x: Any) -> bool:
    return isinstance(x, LocalShards)


def host_copy(tree: Any) -> Any:
    """A host copy that `place` puts back: NumPy, keys, or `LocalShards` of a global array.

    Examples:
        >>> host_copy({"x": jax.numpy.ones(2)})["x"].tolist()
        [1.0, 1.0]
    """

    def one(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
            return jax.device_get(leaf)
        if leaf.is_fully_replicated:
            return np.asarray(leaf.addressable_shards[0].data)
        pieces = {LocalShards.key(s.index): np.asarray(s.data) for s in leaf.addressable_shards}
        return LocalShards(leaf.shape, pieces)

    return jax.tree.map(one, tree)


def local_copy(tree: Any, device: jax.Device) -> Any:
    """``tree`` on ``device``, arrays replicated over other processes' devices included.

    Examples:
        >>> local_copy({"w": jax.numpy.ones(2)}, jax.devices()[0])["w"].devices()
        {CpuDevice(id=0)}
    """

    def one(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            if not leaf.is_fully_replicated:
                raise ValueError(
                    f"an array of shape {leaf.shape} sharded over several processes has no "
                    "whole copy on this one; evaluate with replicated parameters."
                )
            leaf = leaf.addressable_shards[0].data  # this process's whole copy
        return jax.device_put(leaf, device)

    return jax.tree.map(one, tree)


def _gather(value: int) -> np.ndarray:
    if jax.process_count() == 1:
        return np.array([value])
    return np.asarray(multihost_utils.process_allgather(np.int64(value)))


def process_min(value: int) -> int:
    """The smallest ``value`` over all processes (every process must call it).

    Examples:
        >>> process_min(7)  # one process
        7
    """
    return int(_gather(int(value)).min())


class Agreement:
    """The size every process plans from: the smallest any found (every process must call it).

    Attributes:
        found: what each process found at the last call, in process order, when they
            differ; else None.

    Examples:
        >>> agree = Agreement()
        >>> agree(48), agree.found  # one process
        (48, None)
    """

    def __init__(self) -> None:
        self.found: tuple[int, ...] | None = None

    def __call__(self, size: int) -> int:
        """The smallest ``size`` over the processes; each one's is kept in `found`."""
        found = tuple(int(s) for s in _gather(int(size)))
        self.found = found if len(set(found)) > 1 else None
        return min(found)


def process_means(metrics: dict[str, Any]) -> dict[str, Any]:
    """`jax_adaptive.Evaluator.evaluate`'s means over every process's examples together.

    Each process passes its own ``{name: mean, ..., "examples": n}`` (every one must call it).

    Examples:
        >>> process_means({"loss": 0.5, "examples": 4})  # one process
        {'loss': 0.5, 'examples': 4}
    """
    if jax.process_count() == 1:
        return metrics
    count = metrics["examples"]
    sums = {k: np.asarray(v, np.float32) * count for k, v in metrics.items() if k != "examples"}
    sums, counts = multihost_utils.process_allgather((sums, np.int32(count)))
    total = int(np.sum(counts))
    means = {k: np.sum(v, axis=0) / total for k, v in sums.items()}
    return {**{k: float(m) if np.ndim(m) == 0 else m for k, m in means.items()}, "examples": total}


def process_sum(value: int) -> int:
    """The sum of ``value`` over all processes (every process must call it).

    Examples:
        >>> process_sum(7)  # one process
        7
    """
    return int(_gather(int(value)).sum())


def first_ready_everywhere(ready: Sequence[bool], done: bool) -> tuple[int | None, bool]:
    """The first index ``ready`` on every process (None: none is), and whether all are ``done``.

    Every process must call it, with as many flags.

    Examples:
        >>> first_ready_everywhere([False, True, True], False)  # one process
        (1, False)
    """
    flags = np.array([*ready, done], np.int32)
    if jax.process_count() > 1:
        flags = np.asarray(multihost_utils.process_allgather(flags))
    flags = flags.reshape(-1, len(ready) + 1)
    common = flags[:, :-1].all(axis=0)
    return (int(np.argmax(common)) if common.any() else None), bool(flags[:, -1].all())


def process_any(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (every process must call it).

    Examples:
        >>> process_any(False)  # one process
        False
    """
    return bool(_gather(int(bool(flag))).max())


def while_all(items: Iterable[T]) -> Iterator[T]:
    """Yields ``items`` while every process has a next one (every process must iterate).

    A stream that ends on one process ends on all, none waiting in a collective.

    Examples:
        >>> list(while_all(iter([1, 2])))  # one process
        [1, 2]
    """
    iterator, end = iter(items), object()
    while True:
        item = next(iterator, end)
        if process_any(item is end):
            return
        yield item  # type: ignore[misc]


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that keeps a full copy on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def agreed(fn: Callable[[], T], size: int) -> T:
    """Runs ``fn``, raising on every process if it ran out of memory on any.

    That process raises its own error, the others `PeerOutOfMemory(size)`.

    Examples:
        >>> agreed(lambda: 3, size=8)
        3
    """
    if jax.process_count() == 1:
        return fn()
    out, error = catch_oom(fn)
    if process_any(error is not None):
        raise error or PeerOutOfMemory(size)
    return out


class Placement:
    """Where the train state and the micro-batches live: ``device``, or ``mesh``.

    With a mesh, each micro-batch is split over ``data_axis`` and ``param_sharding`` gives
    ``PartitionSpec`` s for (a prefix of) the parameters, over any mesh axes, the data axis
    included (FSDP); the optimizer state follows them, or ``opt_state_sharding``'s specs
    (ZeRO-1: the optimizer state split over the data axis, the parameters replicated).
    A spec that cannot hold (an axis not in the mesh, a dimension that does not divide)
    raises a one-line ``ValueError``. ``device`` becomes this process's
    first device, ``shards`` the number of data shards, ``everywhere`` the replicated
    sharding and ``data`` the micro-batch's (None without a mesh). ``processes`` counts
    those among which the data shards are split, each holding a block of them: each
    passes its own share of every batch, unless ``global_batches`` (every process passes
    the whole batch; ``processes`` is then 1).

    Examples:
        >>> Placement().shards, Placement(mesh=data_mesh()).shards == jax.device_count()
        (1, True)
        >>> Placement(mesh=data_mesh()).share(64)  # one process passes the whole batch
        64
    """

    def __init__(
        self,
        device: jax.Device | None = None,
        mesh: Mesh | None = None,
        data_axis: str = "data",
        param_sharding: Any = None,
        global_batches: bool = False,
        opt_state_sharding: Any = None,
    ):
        self.mesh, self.data_axis, self.param_sharding = mesh, data_axis, param_sharding
        self.opt_state_sharding = opt_state_sharding
        self.shards = self._check(device)
        self.processes = 1
        if mesh is not None and not global_batches:  # the blocks of rows the processes hold
            axis, own = mesh.axis_names.index(data_axis), jax.process_index()
            rows = {i[axis] for i, d in np.ndenumerate(mesh.devices) if d.process_index == own}
            if len(rows) != max(rows, default=-1) - min(rows, default=0) + 1:
                raise ValueError(
                    f"this process's devices hold data shards {sorted(rows)} of the mesh: "
                    "they must be consecutive, or pass global_batches=True."
                )
            self.processes = self.shards // max(len(rows), 1)
        if mesh is None:
            self.device = device or jax.local_devices()[0]
            self.everywhere: jax.sharding.Sharding = jax.sharding.SingleDeviceSharding(self.device)
            self.data: NamedSharding | None = None
        else:
            own = jax.process_index()
            self.device = next(d for d in mesh.devices.flat if d.process_index == own)
            self.everywhere = replicated(mesh)
            self.data = NamedSharding(mesh, PartitionSpec(data_axis))

    def _check(self, device: jax.Device | None) -> int:
        if self.mesh is None:
            for name in ("param_sharding", "opt_state_sharding"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs a mesh (mesh=ja.data_mesh(), ...).")
            return 1
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}.")
        if device is not None:
            raise ValueError("pass either device or mesh, not both.")
        if self.data_axis not in self.mesh.shape:
            raise ValueError(
                f"data_axis={self.data_axis!r} is not an axis of the mesh {dict(self.mesh.shape)}."
            )
        return int(self.mesh.shape[self.data_axis])

    def state(self, state: Any, optimizer: optax.GradientTransformation) -> Any:
        """A train state's shardings; ``optimizer``'s state follows its parameters.

        With ``opt_state_sharding``, the optimizer state's parameter-shaped leaves take
        those specs instead, all but the gradient accumulator (``acc_grads``, which
        stays with the parameters: each device accumulates what its micro-steps compute).
        """
        full = self.everywhere
        if self.mesh is None:
            return full
        params = self._named("param_sharding", state.params)
        opt = optax.tree_map_params(
            optimizer, lambda _, s: s, state.opt_state, params, transform_non_params=lambda _: full
        )
        if self.opt_state_sharding is not None:
            moments = self._named("opt_state_sharding", state.params)
            inner = optax.tree_map_params(
                optimizer, lambda _, s: s, state.opt_state, moments,
                transform_non_params=lambda _: full,
            )  # fmt: skip
            opt = inner._replace(acc_grads=opt.acc_grads)
        model_state = jax.tree.map(lambda _: full, state.model_state)
        return type(state)(params, opt, model_state, full)

    def _named(self, name: str, params: Any) -> Any:
        """The parameters' shardings from the specs ``name`` holds (None: replicated)."""
        specs = getattr(self, name)
        if specs is None:
            return jax.tree.map(lambda _: self.everywhere, params)

        def one(path: Any, spec: Any, leaf: Any) -> NamedSharding:
            where = f"{name}{jax.tree_util.keystr(path)}"
            return NamedSharding(self.mesh, checked_spec(spec, np.shape(leaf), self.mesh, where))

        return jax.tree_util.tree_map_with_path(
            lambda prefix, spec, subtree: jax.tree_util.tree_map_with_path(
                lambda path, leaf: one((*prefix, *path), spec, leaf), subtree
            ),
            specs,
            params,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def describe(self) -> str | None:
        """The sharding of the train state, in a few words (a plan's); None without a mesh.

        Examples:
            >>> mesh = data_mesh()
            >>> Placement(mesh=mesh, param_sharding={"w": PartitionSpec("data")}).describe()
            'state sharded over data (FSDP)'
            >>> Placement(mesh=mesh, opt_state_sharding={"w": PartitionSpec("data")}).describe()
            'optimizer state sharded over data (ZeRO-1)'
        """
        if self.mesh is None:
            return None
        params, moments = spec_axes(self.param_sharding), spec_axes(self.opt_state_sharding)
        if not params and not moments:
            return f"state replicated over {self.mesh.size} devices"
        if params and moments:
            return f"parameters sharded over {', '.join(params)}, optimizer state over " + (
                ", ".join(moments)
            )
        axes = params or moments
        named = "state" if params else "optimizer state"
        label = ("FSDP" if params else "ZeRO-1") if self.data_axis in axes else None
        return f"{named} sharded over {', '.join(axes)}" + (f" ({label})" if label else "")

    def share(self, T: int) -> int:
        """The rows of a batch of ``T`` this process passes: ``T / processes``."""
        if T % self.processes:
            raise ValueError(
                f"target_batch_size={T} must divide over the {self.processes} processes, "
                "each passing an equal share of every batch."
            )
        return T // self.processes

    def check_share(self, size: int, T: int) -> int:
        """This process's `share` of ``T``; raises on every process unless each passed it.

        Every process must call it.
        """
        share = self.share(T)
        if self.processes == 1:
            return share
        counts = _gather(size).tolist()
        if any(count != share for count in counts):
            raise ValueError(
                f"each of the {self.processes} processes passes target_batch_size / processes "
                f"= {T} / {self.processes} = {share} examples, but they passed {counts} "
                "(in process order)."
            )
        return share

    def micro_batch(self, tree: Any, split: int = 1) -> Any:
        """A micro-batch split over the data axis, or a chunk of ``split`` as ``[split, m, ...]``.

        With several `processes`, ``tree`` holds this process's rows only and the global
        array is assembled from every process's. Without a mesh, host arrays go as they
        are: the program's call transfers them faster.
        """
        if self.data is None:
            return tree
        sharding, axis = self.data, 0
        if split > 1:
            sharding, axis = NamedSharding(self.mesh, PartitionSpec(None, self.data_axis)), 1
            tree = jax.tree.map(lambda x: x.reshape(split, -1, *x.shape[1:]), tree)
        if self.processes == 1:
            return place(tree, sharding)

        def assembled(rows: Any) -> jax.Array:
            shape = list(np.shape(rows))
            shape[axis] *= self.processes
            return jax.make_array_from_process_local_data(sharding, np.asarray(rows), tuple(shape))

        return jax.tree.map(assembled, tree)
