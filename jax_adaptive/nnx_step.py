"""Flax NNX's own training step, micro-batched: the step you wrote, at the size that fits.

`micro_batch_value_and_grad` replaces ``nnx.value_and_grad`` inside an NNX step (a
batch-mean loss, call-time ``rngs``, BatchNorm statistics updated in place) and computes
the full batch's loss, aux and gradient ``m`` examples at a time; `AdaptiveNnxStep`
replaces ``@nnx.jit`` and plans ``m`` with the sizing engine. The guide: docs/flax.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.graph import is_graph_node

from jax_adaptive import checks
from jax_adaptive.adaptive_step import AdaptiveStep
from jax_adaptive.data import leading_size
from jax_adaptive.errors import NothingFitsError
from jax_adaptive.ghost import over_groups
from jax_adaptive.sizing import forwarded

__all__ = ["AdaptiveNnxStep", "micro_batch_value_and_grad"]

_PLANNED: contextvars.ContextVar[int | None] = contextvars.ContextVar("micro_batch", default=None)


@contextlib.contextmanager
def _planned(size: int) -> Iterator[None]:
    """While a step of ``size`` traces, `micro_batch_value_and_grad` runs at ``size``."""
    token = _PLANNED.set(size)
    try:
        yield
    finally:
        _PLANNED.reset(token)


def _batch_position(args: tuple[Any, ...], batch_argnum: int | None, what: str) -> int:
    """``batch_argnum``, or the one argument that is not an NNX object."""
    if batch_argnum is not None:
        if not 0 <= batch_argnum < len(args):
            raise ValueError(f"{batch_argnum=} is not one of the {len(args)} arguments of {what}.")
        return batch_argnum
    arrays = [i for i, a in enumerate(args) if not is_graph_node(a)]
    if len(arrays) != 1:
        raise ValueError(
            f"{what} has {len(arrays)} arguments that are not NNX objects (positions "
            f"{arrays}): say which is the batch with batch_argnum."
        )
    return arrays[0]


def _combine(aux: Any, size: int, total: int) -> Any:
    """An aux leaf of one micro-batch: per example (kept), or a scalar (weighted)."""

    def leaf(x: jax.Array) -> jax.Array:
        if jnp.ndim(x) == 0:
            return x * (size / total)
        if jnp.shape(x)[0] != size:
            raise ValueError(
                f"an aux leaf of shape {jnp.shape(x)} is neither a scalar nor per example "
                f"(a leading axis of the micro-batch's {size})."
            )
        return x

    return jax.tree.map(leaf, aux)


def micro_batch_value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int = 0,
    wrt: nnx.filterlib.Filter = nnx.Param,
    micro_batch_size: int | None = None,
    ghost_batch_size: int | None = None,
    batch_argnum: int | None = None,
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of a batch-mean loss, computed ``m`` examples at a time.

    The returned function takes ``loss_fn``'s arguments and returns what
    ``nnx.value_and_grad(loss_fn, argnums, has_aux)`` would on the whole batch: the
    batch's mean loss, each aux leaf per example in order (a scalar leaf: the batch
    mean), and the mean gradient, exactly (a last micro-batch of ``T mod m`` included).
    The NNX objects' other state (BatchNorm statistics, ``nnx.Rngs`` counts) goes
    through the micro-batches in order, and is written back into them.

    Args:
        loss_fn: ``(model, ..., batch, ...) -> loss`` (or ``(loss, aux)``): the mean over
            the batch's examples, as Flax's examples write it.
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        argnums: the argument differentiated (an NNX object).
        wrt: the filter of its variables differentiated.
        micro_batch_size: examples per micro-batch (static); None: the size
            `AdaptiveNnxStep` planned, or the whole batch outside one.
        ghost_batch_size: BatchNorm over consecutive groups of this many examples, in
            order, whatever the micro-batch (the batch and the micro-batch whole groups).
        batch_argnum: the batch's position; None: the one argument not an NNX object.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        >>> def loss_fn(model, batch):
        ...     logits = model(batch["x"])
        ...     losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        ...     return losses.mean(), logits
        >>> batch = {"x": jnp.ones((5, 3)), "y": jnp.zeros(5, jnp.int32)}
        >>> grad_fn = micro_batch_value_and_grad(loss_fn, has_aux=True, micro_batch_size=2)
        >>> (loss, logits), grads = grad_fn(model, batch)  # micro-batches of 2, 2 and 1
        >>> (_, full), full_grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        >>> logits.shape, bool(jnp.allclose(grads["kernel"][...], full_grads["kernel"][...]))
        ((5, 2), True)
    """
    if micro_batch_size is not None:
        checks.positive_int("micro_batch_size", micro_batch_size)
    if ghost_batch_size is not None:
        checks.positive_int("ghost_batch_size", ghost_batch_size)

    def value_and_grad(*args: Any) -> Any:
        b = _batch_position(args, batch_argnum, "the loss")
        if not is_graph_node(args[argnums]) or argnums == b:
            raise ValueError(f"{argnums=} must be an NNX object, not the batch.")
        batch, total = args[b], leading_size(args[b])
        m = min(micro_batch_size or _PLANNED.get() or total, total)
        if ghost_batch_size is not None and (total % ghost_batch_size or m % ghost_batch_size):
            raise ValueError(
                f"a batch of {total} in micro-batches of {m} is not whole ghost batches of "
                f"{ghost_batch_size=}: plan with multiple_of={ghost_batch_size} and a batch "
                f"that is a multiple of {ghost_batch_size}."
            )
        nodes = {i: a for i, a in enumerate(args) if i != b}
        diff = _diff_of(argnums, wrt)
        graphdef, params, rest = nnx.split(nodes, diff, ...)

        def call(params: Any, rest: Any, part: Any) -> tuple[Any, Any]:
            """``loss_fn`` on ``part`` (rows of the batch); its output, the new state."""
            objects = nnx.merge(graphdef, params, rest, copy=True)
            out = loss_fn(*(part if i == b else objects[i] for i in range(len(args))))
            loss, aux = out if has_aux else (out, ())
            return (loss, aux), nnx.split(objects, diff, ...)[2]

        def micro(params: Any, rest: Any, part: Any) -> tuple[Any, Any]:
            """A micro-batch's mean loss, its (aux, state): its ghost batches as in order."""
            size, g = leading_size(part), ghost_batch_size or leading_size(part)
            groups = jax.tree.map(lambda x: x.reshape(size // g, g, *x.shape[1:]), part)
            # ghost_batches' own grouping: side by side where the state's update is proven
            # affine (BatchNorm's running averages), in order otherwise (Dropout's keys)
            (losses, aux), rest = over_groups(
                lambda rest, rows: call(params, rest, rows), rest, groups
            )
            aux = jax.tree.map(lambda x: _flat(x) if x.ndim > 1 else x.mean(), aux)
            return losses.mean(), (aux, rest)

        grad_micro = jax.value_and_grad(micro, has_aux=True)

        def run(carry: Any, part: Any) -> tuple[Any, Any]:
            grads, loss, rest = carry
            size = leading_size(part)
            (part_loss, (aux, rest)), part_grads = grad_micro(params, rest, part)
            w = size / total
            grads = jax.tree.map(lambda a, g: a + w * g, grads, part_grads)
            return (grads, loss + w * part_loss, rest), _combine(aux, size, total)

        zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32), rest)
        (grads, loss, rest), aux = _fold(run, zeros, batch, m)
        nnx.update(nodes, rest)
        return ((loss, aux) if has_aux else loss), grads[argnums]

    return value_and_grad


def _fold(run: Callable[[Any, Any], tuple[Any, Any]], carry: Any, batch: Any, m: int) -> Any:
    """``run(carry, rows) -> (carry, aux)`` over the batch's micro-batches of ``m`` in order.

    Returns the last carry and the aux of every row in order (scalar leaves summed).
    """
    total = leading_size(batch)
    turns, last = -(-total // m), total - (total - 1) // m * m  # the last turn's rows
    if turns == 1:
        return run(carry, batch)

    # One loop whose last turn takes its rows at a static offset in a branch: a last turn
    # after the loop holds its own temporaries beside the loop's, and a loop without the
    # branch held more (measured, 256 examples: 723 kB at m = 86 with the turn after the
    # loop against 402 kB; 409 kB at m = 64 without the branch against 304 kB), so the
    # peak would not follow m.
    def turn(carry: Any, i: jax.Array) -> tuple[Any, Any]:
        def part(start: Any, size: int) -> tuple[Any, Any]:
            carry_out, aux = run(carry, jax.tree.map(lambda x: _rows(x, start, size), batch))
            return carry_out, jax.tree.map(lambda x: _padded(x, m), aux)

        final = functools.partial(part, total - last, last)
        return jax.lax.cond(i < turns - 1, lambda: part(i * m, m), final)

    carry, aux = jax.lax.scan(turn, carry, jnp.arange(turns))
    return carry, jax.tree.map(lambda x: _flat(x)[:total] if x.ndim > 1 else x.sum(), aux)


def _diff_of(argnums: int, wrt: nnx.filterlib.Filter) -> Callable[..., bool]:
    """The filter of ``wrt``'s variables in argument ``argnums`` (paths start with it)."""
    selected = nnx.filterlib.to_predicate(wrt)
    return lambda path, x: path[0] == argnums and selected(path, x)


def _rows(x: jax.Array, start: Any, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(jnp.asarray(x), start, size)


def _padded(x: jax.Array, size: int) -> jax.Array:
    """A per-example leaf padded with zeros to ``size`` rows; a scalar as it is."""
    return jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)) if x.ndim else x


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(-1, *x.shape[2:])


class AdaptiveNnxStep:
    """An NNX training step at the largest micro-batch that fits: ``@nnx.jit``'s stand-in.

    Decorate the step Flax's examples write (``train_step(model, optimizer, metrics,
    batch, rngs)``, updating its NNX objects in place) after replacing its
    ``nnx.value_and_grad`` by `micro_batch_value_and_grad`. Each call plans the
    micro-batch for the step's shapes with `jax_adaptive.AdaptiveStep` (the whole step's
    memory: model, optimizer state, metrics, the batch), runs it, and writes the new state
    into the objects; an out-of-memory re-plans smaller and runs the same call again, the
    objects' state intact. A step already under ``@nnx.jit`` runs as its Python function.

    Args:
        step_fn: the step; its NNX object arguments are updated in place, the others are
            arrays (the batch among them); it returns arrays or nothing.
        batch_argnum: the batch's position; None: the one argument not an NNX object.
        **step_kwargs: `jax_adaptive.AdaptiveStep`'s options (``memory_limit``,
            ``multiple_of``: a ghost batch size, ``plan_cache``, ...).

    Examples:
        >>> import functools, numpy as np, optax
        >>> from flax import nnx
        >>> import jax_adaptive as ja
        >>> model = nnx.Sequential(nnx.Linear(64, 512, rngs=nnx.Rngs(0)), nnx.relu,
        ...                        nnx.Linear(512, 10, rngs=nnx.Rngs(1)))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> def loss_fn(model, batch):
        ...     logits = model(batch["image"])
        ...     return optax.softmax_cross_entropy_with_integer_labels(
        ...         logits, batch["label"]).mean()
        >>> @functools.partial(ja.AdaptiveNnxStep, memory_limit=1_000_000, plan_cache=False)
        ... def train_step(model, optimizer, batch):
        ...     loss, grads = ja.micro_batch_value_and_grad(loss_fn)(model, batch)
        ...     optimizer.update(model, grads)
        ...     return loss
        >>> batch = {"image": np.ones((256, 64), np.float32), "label": np.zeros(256, np.int32)}
        >>> loss = train_step(model, optimizer, batch)
        >>> train_step.micro_batch_size < 256, train_step.plan_info.accumulation_steps > 1
        (True, True)
    """

    def __init__(self, step_fn: Callable[..., Any], *, batch_argnum: int | None = None,
                 **step_kwargs: Any):  # fmt: skip
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {step_fn!r}.")
        self.step_fn = inspect.unwrap(step_fn)
        self.batch_argnum = batch_argnum
        self.step_kwargs = step_kwargs
        self._steps: dict[Any, AdaptiveStep] = {}
        self.step: AdaptiveStep | None = None
        functools.update_wrapper(self, self.step_fn)

    micro_batch_size = forwarded("step.micro_batch_size", "The size in use.")
    plan_info = forwarded("step.plan_info", "The `jax_adaptive.Plan` in use.")
    search_log = forwarded("step.search_log", "Every `jax_adaptive.SizeTrial` of the shapes.")

    def __call__(self, *args: Any) -> Any:
        """Runs the step on ``args``, its NNX objects updated in place; what it returns."""
        b = _batch_position(args, self.batch_argnum, "the step")
        nodes = {i: a for i, a in enumerate(args) if i != b and is_graph_node(a)}
        others = tuple(a for i, a in enumerate(args) if i != b and i not in nodes)
        graphdef, state = nnx.split(nodes)
        if graphdef not in self._steps:
            build = functools.partial(self._build, graphdef, b, len(args))
            self._steps[graphdef] = AdaptiveStep(build, batch_argnum=1, **self.step_kwargs)
        self.step = self._steps[graphdef]
        try:
            state, out = self.step(state, args[b], others)
        except NothingFitsError as exc:
            if getattr(exc, "arguments", None) is not None:  # a failed run's, put back
                nnx.update(nodes, exc.arguments[0])
            raise
        nnx.update(nodes, state)
        return out

    def _build(self, graphdef: Any, b: int, n: int, size: int) -> Callable[..., Any]:
        """The step at ``size`` as a function of its objects' state: ``state -> state``."""

        def step(state: Any, batch: Any, others: tuple[Any, ...]) -> tuple[Any, Any]:
            nodes, rest = nnx.merge(graphdef, state), iter(others)
            args = [batch if i == b else nodes[i] if i in nodes else next(rest) for i in range(n)]
            with _planned(size):
                out = self.step_fn(*args)
            return nnx.state(nodes), out

        return jax.jit(step, donate_argnums=0)
