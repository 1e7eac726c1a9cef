"""Ghost batches (Hoffer et al. 2017): BatchNorm statistics over fixed groups of examples.

Normalising over groups of ``g`` examples, whatever the micro-batch, every device trains
the same model; the price is `GHOST_TRADE_OFF`. The guide: docs/batchnorm.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jax_adaptive.data import leading_size

__all__ = ["GHOST_TRADE_OFF", "ghost_batches", "over_groups"]

GHOST_TRADE_OFF = (
    "Ghost batches normalise over groups of g examples whatever the micro-batch, so "
    "training is the same on every device; the price: statistics over g examples are "
    "noisier than over a large micro-batch, and the running averages move T/g times per "
    "update (choose their momentum for batches of g). A micro-batch's groups run side "
    "by side, as one batch, only when the traced program proves it exact: outputs that "
    "do not read the state, and every state leaf left as it was or updated elementwise "
    "as m * old + f(group), m independent of the state (BatchNorm's running averages, "
    "linen's and NNX's, in training). Anything else (outputs that read the state, a "
    "running max or min, a clipped average, a momentum that depends on the state, an "
    "integer counter, Dropout's NNX key counts) runs the groups one after another, "
    "each layer on batches of g: the same result, about 2.5 times the time."
)

StatefulLoss = Callable[..., Any]
"""``(params, model_state, batch, rng) -> (output, new_model_state)``, the output a
pytree of per-example arrays (losses, or ``(losses, aux)``)."""

GroupFn = Callable[[Any, Any], tuple[Any, Any]]
"""``(state, x) -> (output, new_state)``: one group's run, ``x`` its slice of ``xs``."""


def ghost_batches(
    loss_fn: StatefulLoss, group_size: int, *, sequential: bool = False
) -> StatefulLoss:
    """Runs a stateful per-example loss over consecutive groups of ``group_size`` examples.

    Group ``i`` gets the key ``fold_in(rng, i)``, its own statistics, and moves the state
    as if the groups ran in order, each with the state group ``i - 1`` returned (never
    differentiated); a group whose ``weights`` are all 0 (padding) leaves the state as it
    was. With ``weights``, a batch must be one group or whole groups (train with
    ``multiple_of=group_size``); without (evaluation), it may end with a shorter group.

    The groups run side by side, one ``vmap``ped batch through every layer, only where
    the loss's traced program proves that exact (`over_groups`): outputs that do not read
    the state, every leaf kept or updated elementwise as ``m * old + f(group)``, as
    BatchNorm's running averages in training (linen, NNX, ``stop_gradient`` or not).
    Anything else (batch renormalisation's outputs, ``max(old, x)``, a clipped average,
    an integer leaf) runs them one after another in a ``lax.scan``, as
    ``sequential=True`` always does.

    Args:
        loss_fn: ``(params, model_state, batch, rng) -> (output, new_model_state)``,
            every leaf of ``output`` per-example.
        group_size: the examples each BatchNorm statistic is computed over.
        sequential: run the groups one after another whatever the state.

    Returns:
        ``(params, model_state, batch, rng, *, weights=None) -> (output,
        new_model_state)``, to use with ``has_state=True``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def loss_fn(params, state, batch, rng):  # a running mean of batch means
        ...     mean = jnp.mean(batch["x"])
        ...     return (batch["x"] - mean) ** 2, {"mean": 0.5 * state["mean"] + 0.5 * mean}
        >>> ghost = ghost_batches(loss_fn, group_size=2)  # groups side by side
        >>> batch = {"x": jnp.array([0.0, 2.0, 4.0, 4.0])}
        >>> losses, state = ghost(None, {"mean": 0.0}, batch, jax.random.key(0),
        ...                       weights=jnp.ones(4))
        >>> losses.tolist(), float(state["mean"])  # groups [0, 2] and [4, 4], in order
        ([1.0, 1.0, 0.0, 0.0], 2.25)
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"{group_size=} must be a positive int.")

    def ghost_loss(params, model_state, batch, rng, *, weights=None):
        m = leading_size(batch)
        if weights is not None and m > group_size and m % group_size:
            raise ValueError(
                f"a micro-batch of {m} examples is not a whole number of ghost batches of "
                f"{group_size=}: train with multiple_of={group_size} and a micro-batch "
                f"size that is a multiple of {group_size}."
            )
        state = jax.tree.map(jnp.asarray, model_state)  # a Python float has no dtype
        groups, full = m // group_size, m - m % group_size
        # whole groups as [groups, group_size, ...], then a shorter last group (or a
        # micro-batch smaller than one) as one group [1, m - full, ...]
        spans = ([(0, full, groups)] if groups else []) + ([(full, m, 1)] if full < m else [])

        def group(state, x):
            rows, key = x
            return loss_fn(params, state, rows, key)

        outs = []
        for start, stop, n in spans:

            def cut(x, start=start, stop=stop, n=n):
                return x[start:stop].reshape(n, -1, *x.shape[1:])

            first = start // group_size
            keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, first + jnp.arange(n))
            keep = None if weights is None else jnp.any(cut(weights) != 0, axis=1)
            out, state = over_groups(
                group, state, (jax.tree.map(cut, batch), keys), keep=keep, sequential=sequential
            )
            outs.append(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out))
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs), state

    ghost_loss.ghost_batch_size = group_size  # what a trainer's multiple_of follows
    return ghost_loss


def over_groups(
    fn: GroupFn, state: Any, xs: Any, *, keep: jax.Array | None = None, sequential: bool = False
) -> tuple[Any, Any]:
    """``fn`` over the groups ``xs`` (a leading axis of ``n``), the state threaded in order.

    The one implementation of ghost groups (`ghost_batches`, and the NNX step's
    ``ghost_batch_size``): what ``lax.scan`` of ``fn`` over ``xs`` returns, the state
    never differentiated and left as it was by a group whose ``keep`` is False. It runs
    the groups side by side (one ``vmap``, each layer on all groups at once) when the
    traced program of ``fn`` in the state proves that exact, and in a ``lax.scan``
    otherwise (and with ``sequential=True``): see ``_update_kinds``.

    Args:
        fn: ``(state, x) -> (output, new_state)``, ``x`` one group's slice of ``xs``; the
            output any pytree (per example, or a scalar per group).
        state: the state before the first group, a pytree of arrays.
        xs: the groups, every leaf with the leading axis ``n``.
        keep: ``[n]`` booleans, False for a padding group; None: every group counts.
        sequential: run the groups in a ``lax.scan`` whatever ``fn`` is.

    Returns:
        ``(outputs, state)``: every output leaf with a leading axis of ``n``, and the
        state after the last group.

    Examples:
        >>> import jax.numpy as jnp
        >>> def fn(state, x):  # a running mean (side by side) ...
        ...     return x.sum(), {"mean": 0.5 * state["mean"] + 0.5 * x.mean()}
        >>> xs = jnp.array([[0.0, 2.0], [4.0, 4.0]])
        >>> out, state = over_groups(fn, {"mean": jnp.float32(0)}, xs)
        >>> out.tolist(), float(state["mean"])
        ([2.0, 8.0], 2.25)
        >>> def peak(state, x):  # ... and a running max (in order)
        ...     return x.sum(), {"max": jax.lax.stop_gradient(jnp.maximum(state["max"], x.max()))}
        >>> float(over_groups(peak, {"max": jnp.float32(3)}, xs)[1]["max"])
        4.0
    """
    n = leading_size(xs, "xs")

    def step(state, x, kept):
        out, new = fn(state, x)
        # The state is never differentiated (a trainer returns it as grad's aux); without
        # this, the backward pass would run through every group's statistics.
        new = jax.lax.stop_gradient(new)
        if kept is not None:
            new = jax.tree.map(lambda new, old: jnp.where(kept, new, old), new, state)
        return out, new

    if n == 1:  # one group: nothing to compose
        out, state = step(
            state, jax.tree.map(lambda x: x[0], xs), None if keep is None else keep[0]
        )
        return jax.tree.map(lambda x: x[None], out), state
    first = jax.tree.map(lambda x: x[0], xs)
    kinds = None if sequential else _update_kinds(fn, state, first)
    if kinds is None:

        def body(state, x_kept):
            out, state = step(state, *x_kept)
            return state, out

        state, out = jax.lax.scan(body, state, (xs, keep))
        return out, state
    return _side_by_side(fn, state, xs, keep, kinds)


def _side_by_side(fn: GroupFn, state: Any, xs: Any, keep: Any, kinds: Sequence[str]) -> Any:
    """The groups at once; each ``"affine"`` leaf moved as the groups in order would move it.

    ``_update_kinds`` proved each such leaf's update ``new = m * old + f`` elementwise,
    ``m`` and ``f`` independent of the state; they are read, for every group, from the
    update at two states, 0 and a power of two large enough that ``m`` comes out to float
    precision (the model runs once: only the state's own arithmetic sees both states).
    After ``n`` groups: ``m_(n-1) ... m_0 * old + sum_i m_(n-1) ... m_(i+1) * f_i``.
    """
    leaves, treedef = jax.tree.flatten(state)
    if "affine" not in kinds:  # the state comes out as it went in
        return jax.vmap(lambda x: fn(state, x)[0])(xs), state
    axes = jax.tree.unflatten(treedef, [0 if k == "affine" else None for k in kinds])

    def two(x, kind):
        if kind != "affine":
            return x  # kept as it was: passed once, unbatched
        big = 2.0 ** (jnp.finfo(x.dtype).maxexp // 2)
        return jnp.stack([jnp.zeros_like(x), jnp.full_like(x, big)])

    probes = jax.tree.unflatten(treedef, [two(x, k) for x, k in zip(leaves, kinds, strict=True)])

    def read(x):
        out, new = jax.vmap(fn, in_axes=(axes, None), out_axes=(None, 0))(probes, x)
        news, ats = treedef.flatten_up_to(new), treedef.flatten_up_to(probes)
        fm = [
            (new[0], (new[1] - new[0]) / at[1]) if kind == "affine" else None
            for new, at, kind in zip(news, ats, kinds, strict=True)
        ]
        return out, jax.lax.stop_gradient(fm)

    out, fm = jax.vmap(read)(xs)

    def compose(old, fm, kind):
        if kind != "affine":
            return old
        f, m = fm
        if keep is not None:  # a padding group is m = 1, f = 0
            k = keep.reshape(-1, *[1] * old.ndim)
            f, m = jnp.where(k, f, 0), jnp.where(k, m, 1)
        after = jnp.cumprod(m[::-1], axis=0)[::-1]  # after[i] = m_i * ... * m_(n-1)
        later = jnp.concatenate([after[1:], jnp.ones_like(m[:1])])
        return (after[0] * old + jnp.sum(later * f, axis=0)).astype(old.dtype)

    new = [compose(*a) for a in zip(leaves, fm, kinds, strict=True)]
    return out, jax.tree.unflatten(treedef, new)


# ------------------------------------------------------------------ the proof of affinity
#
# Why a proof on the jaxpr, not a numerical test or a derivative: the update of a state
# written through ``stop_gradient`` (NNX's BatchNorm writes its running averages so) has a
# zero derivative whatever it computes, and no finite set of sample states proves a
# function affine (``max(old, x)`` is affine on either side of x). The traced program is
# the function itself: an abstract interpretation over its equations, decided once when
# the loss is traced (no run-time cost, no second program), is sound by induction on the
# equations. Each value is one of: independent of the state (None); a `_Leaf`: equal,
# elementwise, to ``a * old[k].flat[at] + b`` with ``a``, ``b`` independent of the state
# and ``at`` known when traced (which element of leaf ``k`` each element reads: moved by
# reshapes, broadcasts, slices, as a pmap axis bound by a size-1 vmap moves them);
# ``_BAD``: anything else. Only the primitives below keep that form; any other primitive
# that reads the state (max, min, clamp, exp, a dot), a choice or a loop on the state,
# ``old * old``, or two leaves (or two elements) mixed gives _BAD. A new leaf whose
# ``at`` is every element in place is ``m * old + f`` elementwise: floating rounding
# aside, the side-by-side composition is then the in-order result.


@dataclasses.dataclass(eq=False, frozen=True)
class _Leaf:
    """``a * old[k].flat[at] + b`` (``at`` None: each element in place; ``same``: a = 1, b = 0)."""

    k: int
    same: bool = False
    at: np.ndarray | None = None


_BAD = "depends on the state in a way not proven affine"
_KEEP = {  # each output its input
    "stop_gradient", "copy", "copy_p", "optimization_barrier", "sharding_constraint",
}  # fmt: skip
_CALLS = {
    "jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
    "custom_vjp_call", "custom_vjp_call_jaxpr", "named_call",
}  # fmt: skip
_LINEAR = {"neg", "add", "sub", "add_any", "mul", "div", "select_n"}
_MOVES = 1 << 22  # elements of a leaf whose moves are followed (an index each, when traced)


def _update_kinds(fn: GroupFn, state: Any, x: Any) -> tuple[str, ...] | None:
    """Per state leaf ``"same"`` or ``"affine"``, where the groups may run side by side.

    None (in order) unless the program of ``fn(state, x)`` in ``state`` proves (see the
    comment above) that the output does not read the state and that each new leaf is
    the old one (``"same"``, any dtype) or, floating, ``m * old + f`` elementwise with
    ``m``, ``f`` independent of the state (``"affine"``). Traced, not run.
    """
    leaves = jax.tree.leaves(state)
    closed, shapes = jax.make_jaxpr(lambda s: fn(s, x), return_shape=True)(state)
    out_shapes, new_shapes = shapes
    if jax.tree.structure(new_shapes) != jax.tree.structure(state):
        return None  # the scan says what differs
    avals = [jax.typeof(leaf) for leaf in leaves]
    classes = _propagate(closed.jaxpr, [_Leaf(k, True) for k in range(len(leaves))], avals)
    n_out = len(jax.tree.leaves(out_shapes))
    if any(c is not None for c in classes[:n_out]):
        return None  # the outputs read the state (batch renormalisation, Dropout's key count)
    kinds = []
    for k, (c, aval) in enumerate(zip(classes[n_out:], avals, strict=True)):
        in_place = isinstance(c, _Leaf) and c.k == k and _in_place(c, aval.shape, avals)
        if in_place and c.same:
            kinds.append("same")
        elif jnp.issubdtype(aval.dtype, jnp.floating) and (c is None or in_place):
            kinds.append("affine")
        else:
            return None
    return tuple(kinds)


def _propagate(jaxpr: jex.Jaxpr, inputs: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    """The class of each output of ``jaxpr`` from its inputs' (constants: None)."""
    env: dict[Any, Any] = dict(zip(jaxpr.invars, inputs, strict=True))

    def read(v: Any) -> Any:
        return None if isinstance(v, jex.Literal) else env.get(v)

    for eqn in jaxpr.eqns:
        outs = _rule(eqn, [read(v) for v in eqn.invars], avals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _rule(eqn: jex.JaxprEqn, ins: list[Any], avals: Sequence[Any]) -> list[Any]:
    """The classes of ``eqn``'s outputs, given its inputs'."""
    n = len(eqn.outvars)
    if all(c is None for c in ins):
        return [None] * n
    if any(c is _BAD for c in ins):
        return [_BAD] * n
    name = eqn.primitive.name
    if name in _CALLS and (sub := _call_jaxpr(eqn)) is not None:
        return _propagate(sub, ins, avals)
    if name in _KEEP and n == len(ins):
        return list(ins)
    reads = [c for c in ins if c is not None]
    if n != 1 or any(c.k != reads[0].k for c in reads):
        return [_BAD] * n  # two leaves mixed, or an operation not below
    out = eqn.outvars[0].aval
    first = ins[0]
    if name == "convert_element_type":
        old, leaf = eqn.invars[0].aval.dtype, avals[first.k].dtype
        if out.dtype == old:
            return [first]
        return [_Leaf(first.k, False, first.at) if _wide_float(old, out.dtype, leaf) else _BAD]
    if name in _MOVE_RULES:
        if first is None or len(reads) > 1 or avals[first.k].size > _MOVES:
            return [_BAD]
        at = _MOVE_RULES[name](_positions(first, avals), **eqn.params)
        return [_Leaf(first.k, first.same, at)]
    if name not in _LINEAR or not jnp.issubdtype(out.dtype, jnp.floating):
        return [_BAD]
    operands = [(c, v.aval.shape) for c, v in zip(ins, eqn.invars, strict=True) if c is not None]
    if any(shape != out.shape for _, shape in operands):
        return [_BAD]  # the state broadcast by the operation itself
    if len(reads) > 1 and not all(_same_at(c, reads[0], avals) for c in reads[1:]):
        return [_BAD]  # two elements of a leaf mixed
    if name == "mul" and len(reads) > 1:  # old * old
        return [_BAD]
    if name == "div" and ins[1] is not None:  # f / old
        return [_BAD]
    if name == "select_n" and ins[0] is not None:  # a choice by the state (max or clip as where)
        return [_BAD]
    return [_Leaf(reads[0].k, False, reads[0].at)]


def _positions(c: _Leaf, avals: Sequence[Any]) -> np.ndarray:
    """The flat index in leaf ``c.k`` each element of ``c`` reads."""
    if c.at is not None:
        return c.at
    shape = avals[c.k].shape
    return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)


def _in_place(c: _Leaf, shape: tuple[int, ...], avals: Sequence[Any]) -> bool:
    """Whether every element of ``c`` reads its own place in a leaf of ``shape``."""
    if c.at is None:
        return avals[c.k].shape == shape
    return c.at.shape == shape and np.array_equal(c.at.ravel(), np.arange(c.at.size))


def _same_at(a: _Leaf, b: _Leaf, avals: Sequence[Any]) -> bool:
    if a.at is None and b.at is None:
        return True
    return np.array_equal(_positions(a, avals), _positions(b, avals))


def _broadcast(at: np.ndarray, *, shape: Sequence[int], broadcast_dimensions: Sequence[int],
               **_: Any) -> np.ndarray:  # fmt: skip
    kept = [1] * len(shape)
    for axis, size in zip(broadcast_dimensions, at.shape, strict=True):
        kept[axis] = size
    return np.broadcast_to(at.reshape(kept), tuple(shape))


def _reshape(at: np.ndarray, *, new_sizes: Sequence[int], dimensions: Any, **_: Any) -> np.ndarray:
    if dimensions is not None:
        at = at.transpose(dimensions)
    return at.reshape(tuple(new_sizes))


def _slice(at: np.ndarray, *, start_indices: Sequence[int], limit_indices: Sequence[int],
           strides: Sequence[int] | None, **_: Any) -> np.ndarray:  # fmt: skip
    strides = strides or [1] * at.ndim
    return at[tuple(map(slice, start_indices, limit_indices, strides))]


# Primitives that only move elements: each output element reads one input element.
_MOVE_RULES: dict[str, Callable[..., np.ndarray]] = {
    "broadcast_in_dim": _broadcast,
    "reshape": _reshape,
    "squeeze": lambda at, *, dimensions, **_: at.squeeze(tuple(dimensions)),
    "transpose": lambda at, *, permutation, **_: at.transpose(tuple(permutation)),
    "slice": _slice,
    "rev": lambda at, *, dimensions, **_: np.flip(at, tuple(dimensions)),
}


def _wide_float(old: Any, new: Any, leaf: Any) -> bool:
    """A float to float conversion that keeps the probe's large state finite."""
    floats = all(jnp.issubdtype(d, jnp.floating) for d in (old, new, leaf))
    return floats and jnp.finfo(new).maxexp >= jnp.finfo(leaf).maxexp


def _call_jaxpr(eqn: jex.JaxprEqn) -> jex.Jaxpr | None:
    """The program a call-like equation runs on its inputs, one to one; None if unclear."""
    for value in eqn.params.values():
        jaxpr = value.jaxpr if isinstance(value, jex.ClosedJaxpr) else value
        if (
            isinstance(jaxpr, jex.Jaxpr)
            and len(jaxpr.invars) == len(eqn.invars)
            and len(jaxpr.outvars) == len(eqn.outvars)
        ):
            return jaxpr
    return None
