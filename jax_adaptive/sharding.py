"""Sharded state in words and in checks: specs checked against their arrays and mesh.

What a state's shardings say (`describe_sharding`, `spec_axes`) and the collectives a
compiled program holds (`collective_counts`): what sharded state costs (docs/devices.md).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["COLLECTIVES", "checked_spec", "collective_counts", "describe_sharding", "spec_axes"]


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
"""The collective ops `collective_counts` counts, as XLA's HLO names them."""


def collective_counts(compiled: Any) -> dict[str, int]:
    """The collective ops in a compiled program's HLO, by kind (`COLLECTIVES`; 0 if none).

    ``compiled`` is a ``jax.stages.Compiled`` or its ``as_text()``. The count is of ops in
    the program's text: one inside a loop (a scanned model's layers) counts once, however
    many times the loop runs it; an asynchronous op's ``-start`` counts, its ``-done`` not.

    Examples:
        >>> collective_counts("%ag = f32[64]{0} all-gather(f32[8]{0} %p), dimensions={0}")
        {'all-reduce': 0, 'all-gather': 1, 'reduce-scatter': 0, 'collective-permute': 0, \
'all-to-all': 0}
        >>> collective_counts(jax.jit(lambda x: x * 2).lower(np.ones(3)).compile())["all-reduce"]
        0
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    return {op: len(re.findall(rf"= [^\n]*? {op}(?:-start)?\(", text)) for op in COLLECTIVES}


def spec_axes(specs: Any) -> list[str]:
    """The mesh axes a pytree of ``PartitionSpec`` s splits over, in the order first named.

    Examples:
        >>> spec_axes({"w": PartitionSpec(None, "data"), "b": PartitionSpec(("data", "model"))})
        ['data', 'model']
    """
    axes: dict[str, None] = {}
    for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)):
        for entry in spec if isinstance(spec, PartitionSpec) else ():
            for axis in entry if isinstance(entry, tuple) else (entry,):
                if isinstance(axis, str):
                    axes[axis] = None
    return list(axes)


def describe_sharding(tree: Any) -> str | None:
    """How the arrays of ``tree`` (a step's state) lie over devices, in a few words.

    ``"state sharded over data"`` when some split over the mesh axis ``data``, ``"state
    replicated over 8 devices"`` when each lies whole on every device; None when they all
    lie on one device.

    Examples:
        >>> describe_sharding({"b": jax.numpy.zeros(2)}) is None
        True
    """
    shardings = [x.sharding for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    spread = [s for s in shardings if len(s.device_set) > 1]
    if not spread:
        return None
    axes = spec_axes([s.spec for s in spread if isinstance(s, NamedSharding)])
    if axes and not all(s.is_fully_replicated for s in spread):
        return f"state sharded over {', '.join(axes)}"
    return f"state replicated over {len(spread[0].device_set)} devices"


def checked_spec(spec: Any, shape: tuple[int, ...], mesh: Mesh, where: str = "spec") -> Any:
    """``spec`` as a ``PartitionSpec``, if it can split an array of ``shape`` over ``mesh``.

    Raises a one-line ``ValueError`` naming ``where`` when it cannot: a spec longer than the
    array's rank, an axis not in the mesh or named twice, a dimension that does not divide
    over its axes' devices.

    Examples:
        >>> from jax_adaptive.distributed import data_mesh
        >>> mesh = data_mesh()
        >>> checked_spec(PartitionSpec(None, "data"), (3, 8 * jax.device_count()), mesh)
        P(None, 'data')
        >>> checked_spec(PartitionSpec("model"), (8,), mesh, "w")
        Traceback (most recent call last):
        ...
        ValueError: w: P('model',) names axis 'model', not in the mesh {'data': ...}.
    """
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{where}: expected a jax.sharding.PartitionSpec, got {spec!r}.")
    if len(spec) > len(shape):
        raise ValueError(f"{where}: {spec} has {len(spec)} entries for an array of shape {shape}.")
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        for axis in axes:
            if axis not in mesh.shape:
                raise ValueError(
                    f"{where}: {spec} names axis {axis!r}, not in the mesh {dict(mesh.shape)}."
                )
            if axis in seen:
                raise ValueError(f"{where}: {spec} names axis {axis!r} twice.")
            seen.add(axis)
        devices = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
        if shape[dim] % devices:
            raise ValueError(
                f"{where}: {spec} splits dimension {dim} of shape {shape}, of size "
                f"{shape[dim]}, over {devices} devices ({' x '.join(axes)}): it must divide."
            )
    return spec
