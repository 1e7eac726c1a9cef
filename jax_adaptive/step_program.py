"""A user's step as the sizing engine sees it: what it is compiled for, and its `Sized`.

`AdaptiveStep` keeps one binding of the engine per `signature_of` its arguments, and
hands the engine `sized_step`: how to trace the step at a size, and the bytes around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_adaptive.data import leading_size
from jax_adaptive.memory import tree_bytes
from jax_adaptive.sizing import Sized

__all__ = ["signature_of", "sized_step"]


def _struct(x: Any, device: jax.Device) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x)
    sharding = x.sharding if isinstance(x, jax.Array) else None
    if sharding is not None and sharding.device_set == {device}:
        # An array on the step's device lowers as it would in a plain call of the step,
        # so the compiled program is the one jit's own cache holds for it.
        sharding = None
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=sharding)


def signature_of(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a compiled step is specific to: the tree, the shapes and dtypes, the shardings.

    A sharding counts where it spans several devices: a user's step may hand back its
    state split otherwise than it came in (XLA chooses the outputs' shardings), and the
    executable compiled for the old ones refuses the new; ``jax.jit`` compiles again, and
    so does this (measured on 8 CPU devices: an SGD step's biases came back split over
    ``data``).
    """
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple(_leaf_signature(x) for x in leaves)


def _leaf_signature(x: Any) -> tuple[Any, ...]:
    shape = (np.shape(x), str(jax.typeof(x).dtype))
    sharding = x.sharding if isinstance(x, jax.Array) else None
    return shape if sharding is None or len(sharding.device_set) == 1 else (*shape, sharding)


def sized_step(
    build: Callable[[int], Callable[..., Any]], args: tuple[Any, ...], *, batch_argnum: int,
    device: jax.Device, key: dict[str, Any], multiple_of: int,
) -> Sized:  # fmt: skip
    """What the engine needs of the step ``build(size)`` for arguments like ``args``.

    The batch is in flight whole, whatever the size; the other arguments are resident.

    Examples:
        >>> import jax.numpy as jnp
        >>> def build(m):  # a step whose memory does not depend on m, for the example
        ...     return lambda params, batch: params - batch.mean(axis=0)
        >>> args = (jnp.zeros(4), jnp.ones((8, 4)))
        >>> sized = sized_step(build, args, batch_argnum=1, device=jax.devices()[0],
        ...                    key={"kind": "example"}, multiple_of=1)
        >>> sized.resident, sized.inputs(2), sized.off_line
        (16, 128, 8)
    """
    structs = tuple(jax.tree.map(lambda x: _struct(x, device), args))
    i = batch_argnum

    def lower(size: int) -> Any:
        step = build(size)  # the user's code traces here
        return (step if hasattr(step, "lower") else jax.jit(step)).lower(*structs)

    batch_bytes = tree_bytes(structs[i])
    return Sized(
        lower=lower,
        resident=tree_bytes(structs[:i] + structs[i + 1 :]),
        inputs=lambda size: batch_bytes,  # the whole batch, whatever the size
        key=lambda: key,
        # At the whole batch a micro-batched step runs no loop (one micro-batch: no
        # accumulator, other fusions), so its peak lies off the line of the looped
        # sizes, above or below it (measured: 30% above for an MLP at T = 1024).
        off_line=leading_size(args[i]),
        fingerprint_at=lambda: multiple_of,
    )
