"""The jitted pieces of one update: the micro-step and the optimizer step.

An update of ``T`` examples is ``n = ceil(T / m)`` micro-steps and one optimizer step,
all through ``optax.MultiSteps`` with ``use_grad_mean=False`` and ``k = n + 1``:

* the **micro-step** (one compile per micro-batch size ``m``, whatever ``T``: ``T`` is a
  runtime argument, so a batch-size schedule compiles nothing new) computes the gradient
  of ``sum(weights * losses) / T`` on one micro-batch (a weight of 0 masks a padding row)
  and adds it to the accumulator with ``MultiSteps.update``. It donates only the
  accumulator; the parameters, the inner optimizer state and the
  model state are read, never donated, so a micro-step that fails (an out-of-memory)
  leaves them alive (DESIGN.md: a failed donating call deletes its donated inputs). It
  returns only what changes in a micro-step, so XLA drops the inner optimizer's work
  there.
* the **optimizer step** (one compile in all: it does not depend on ``m``) is the
  ``n + 1``-th mini-step of ``MultiSteps``, with a zero gradient: it emits, applies the
  inner optimizer to the accumulated sum and resets the accumulator. Its memory is the
  state twice, whatever ``m``; it runs after the micro-batch's activations are freed.

Under a mesh, `per_device` runs the micro-step (or a chunk) on each device's rows with
no collective, into a per-device accumulator that the optimizer step sums once.

The sum of per-example gradients divided by ``T`` is the full-batch mean gradient
whatever the micro-batch sizes (padding is masked), so the update is exact. Per-example
weights other than 0 and 1 give weighted means the same way (a token count per sequence).

A row of weight 0 (padding, a user's mask) is selected out, never multiplied by zero:
the backward pass would multiply its zero cotangent by its partial derivatives, and
``0 * nan`` is ``nan`` (the "double where" problem). Its inputs are replaced by a live
row's (`live_source`) before any micro-step sees them, once per update on the host
(only for a batch that has such a row: nothing is copied otherwise), and
`weighted_grad` selects out the gradient of a micro-batch with no live row.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "Batch",
    "Params",
    "PerExampleLoss",
    "TrainState",
    "call_loss",
    "check_per_example",
    "live_source",
    "loss_takes_weights",
    "make_micro_step",
    "make_optimizer_step",
    "multi_steps",
    "per_device",
    "weighted_grad",
    "with_optimizer_step",
]

Params: TypeAlias = Any
Batch: TypeAlias = Any
ModelState: TypeAlias = Any
PerExampleLoss: TypeAlias = Callable[..., Any]
"""``(params, batch, rng) -> losses[m]``; with ``has_aux``, ``(losses, aux)``; with
``has_state``, ``(params, model_state, batch, rng) -> (that, new_model_state)``."""


class TrainState(NamedTuple):
    """Everything training carries from one update to the next.

    Attributes:
        params: the model parameters.
        opt_state: the ``optax.MultiStepsState`` around the user's optimizer.
        model_state: mutable model collections (Flax ``batch_stats``), or ``()``.
        rng: the base key; each micro-batch folds in the update and its first example.
    """

    params: Params
    opt_state: optax.MultiStepsState
    model_state: ModelState
    rng: jax.Array

    @property
    def updates(self) -> jax.Array:
        """Optimizer updates applied so far (not micro-steps)."""
        return self.opt_state.gradient_step


def multi_steps(optimizer: optax.GradientTransformation, k: Any) -> optax.MultiSteps:
    """Wraps ``optimizer`` to sum gradients over ``k - 1`` mini-steps and emit on the k-th.

    ``k`` may be traced: one compiled program then serves every accumulation count.

    Examples:
        >>> import optax
        >>> multi_steps(optax.sgd(0.1), 4).init({"w": jnp.zeros(2)}).mini_step
        Array(0, dtype=int32)
    """
    return optax.MultiSteps(optimizer, every_k_schedule=lambda _: k, use_grad_mean=False)


def loss_takes_weights(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` declares a keyword parameter ``weights`` (see `call_loss`).

    Examples:
        >>> loss_takes_weights(lambda p, b, r, *, weights: b), loss_takes_weights(max)
        (True, False)
    """
    try:
        parameter = inspect.signature(loss_fn).parameters.get("weights")
    except (TypeError, ValueError):  # a callable without a signature takes none
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return parameter is not None and parameter.kind in keyword


def call_loss(
    loss_fn, has_aux: bool, has_state: bool, params, model_state, batch, rng, weights=None
):
    """Calls the user's loss in any of its forms; returns (losses, aux, new_model_state).

    ``weights`` (the micro-batch's per-example weights, 0 for padding) goes to the loss
    as the keyword ``weights`` when given: pass it only to a loss that `loss_takes_weights`
    (ghost batches use it to keep padding out of BatchNorm's running averages).

    Examples:
        >>> call_loss(lambda p, b, r: (b * p, {"n": b}), True, False, 2.0, (), 3.0, None)
        (6.0, {'n': 3.0}, ())
    """
    kwargs = {} if weights is None else {"weights": weights}
    out = (
        loss_fn(params, model_state, batch, rng, **kwargs)
        if has_state
        else loss_fn(params, batch, rng, **kwargs)
    )
    new_model_state = model_state
    if has_state:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "with has_state=True, loss_fn must return (output, new_model_state); "
                f"it returned {type(out).__name__}."
            )
        out, new_model_state = out
    aux = {}
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "with has_aux=True, loss_fn must return (losses, aux) with aux a dict of "
                f"per-example arrays; it returned {type(out).__name__}."
            )
        out, aux = out
    return out, aux, new_model_state


def check_per_example(name: str, value: Any, m: int) -> None:
    """Raises a one-line error unless ``value`` is ``m`` floating-point values, one per example.

    Examples:
        >>> check_per_example("loss", jnp.ones(3), 4)
        Traceback (most recent call last):
        ValueError: loss must be per-example, of shape (4,) for a micro-batch of 4; ...
    """
    shape = getattr(value, "shape", None)
    if shape != (m,):
        raise ValueError(
            f"{name} must be per-example, of shape ({m},) for a micro-batch of {m}; "
            f"got shape {shape}. Return one loss per example, not their mean."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating point, got dtype {value.dtype}.")


def live_source(weights: Any) -> Any:
    """For each row, the row whose inputs the loss runs on: a live one (weight ``!= 0``).

    A live row is its own source; a row of weight 0 takes the nearest live row before
    it, or the first live row when none is before it; with no live row at all, every
    row is its own. Loss inputs gathered by it (``x[source]``) hold no masked row's
    values, so a masked row's loss is a live row's, finite where that one is: in the
    backward pass its zero cotangent then meets finite partial derivatives (``0 * nan``
    is ``nan``). The rule depends on the weights alone, not on the micro-batches, so a
    plan does not change what a loss sees; a padded micro-batch that repeats its real
    rows (`jax_adaptive.data.micro_batches`) repeats live rows. On the host for NumPy
    weights (`jax_adaptive.update.Updater` does it once per update, copying a batch
    only when it has a row of weight 0), traced for jax ones (`micro_batch_grad`).

    Examples:
        >>> live_source(np.array([0.0, 1.0, 0.0, 2.5, 0.0])).tolist()
        [1, 1, 1, 3, 3]
        >>> live_source(jnp.array([1.0, 0.0, 1.0])).tolist()
        [0, 0, 2]
    """
    xp, cummax = (np, np.maximum.accumulate) if isinstance(weights, np.ndarray) else (jnp, None)
    live = weights != 0
    rows = xp.arange(weights.shape[0], dtype=np.int32)
    marked = xp.where(live, rows, -1)
    before = cummax(marked) if cummax is not None else jax.lax.cummax(marked)
    return xp.where(before >= 0, before, xp.where(live.any(), xp.argmax(live), rows))


def weighted_grad(
    loss_fn: PerExampleLoss,
    has_aux: bool,
    has_state: bool,
    takes_weights: bool,
    params: Params,
    model_state: Any,
    batch: Batch,
    key: Any,
    weights: jax.Array,
    divisor: Any,
) -> tuple[Params, dict[str, jax.Array], Any]:
    """The gradient of ``sum(weights * losses) / divisor`` on one micro-batch, and its sums.

    The one place that defines what a micro-batch contributes, for the trainer's
    micro-step and for `jax_adaptive.micro_batch_grad`. A row of weight 0 (padding, a
    user's mask) contributes exactly 0 to the sums and never reaches the gradient, even
    where its own loss would be inf or NaN: its inputs must be a live row's (the callers
    gather them by `live_source`), and a micro-batch with no live row contributes a
    gradient of exactly 0 and leaves the model state as it was (as padding leaves
    BatchNorm's running averages in `jax_adaptive.ghost_batches`).

    Returns:
        The gradient, the weighted float32 sums of the loss and of each aux metric by
        name, and the new model state.

    Examples:
        >>> loss = lambda p, b, r: jnp.log(b) * p  # NaN at a negative row
        >>> x, weights = jnp.array([2.0, -1.0]), jnp.array([1.0, 0.0])
        >>> grads, sums, _ = weighted_grad(
        ...     loss, False, False, False, 1.0, (), x[live_source(weights)], None, weights, 1.0
        ... )  # fmt: skip
        >>> round(float(grads), 4), round(float(sums["loss"]), 4)  # log 2: the NaN row is out
        (0.6931, 0.6931)
    """
    m = weights.shape[0]
    live = weights != 0

    def objective(p: Params) -> tuple[jax.Array, Any]:
        losses, aux, new_state = call_loss(
            loss_fn, has_aux, has_state, p, model_state, batch, key,
            weights if takes_weights else None,
        )  # fmt: skip
        check_per_example("loss_fn's losses", losses, m)
        for name, value in aux.items():
            check_per_example(f"aux[{name!r}]", value, m)
        # where, not a product alone: with no live row, the loss ran on masked rows.
        weighted = {n: jnp.where(live, weights * v, 0) for n, v in {"loss": losses, **aux}.items()}
        sums = {name: jnp.sum(v.astype(jnp.float32)) for name, v in weighted.items()}
        total = jnp.sum(weighted["loss"])
        return total / jnp.asarray(divisor).astype(total.dtype), (sums, new_state)

    grads, (sums, new_state) = jax.grad(objective, has_aux=True)(params)
    # A select, not a product, for the same reason.
    any_live = jnp.any(live)
    grads = jax.tree.map(lambda g: jnp.where(any_live, g, jnp.zeros_like(g)), grads)
    if has_state:
        new_state = jax.tree.map(
            lambda new, old: jnp.where(any_live, new, old).astype(jnp.result_type(new)),
            new_state,
            model_state,
        )
    return grads, sums, new_state


def _target(target_batch_size: int | None, target: Any) -> Any:
    """``T``: the runtime ``target`` or else the built-in ``target_batch_size``."""
    if target is None:
        if target_batch_size is None:
            raise TypeError("the step needs target=T (it was made without target_batch_size).")
        target = target_batch_size
    return target


def _scale(total: Any, target_batch_size: int | None, target: Any) -> Any:
    """``total / T`` (`_target`), in ``total``'s dtype."""
    return total / jnp.asarray(_target(target_batch_size, target)).astype(total.dtype)


def make_micro_step(
    loss_fn: PerExampleLoss,
    optimizer: optax.GradientTransformation,
    target_batch_size: int | None = None,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    on_trace: Callable[[int], None] | None = None,
) -> Callable[..., Any]:
    """Builds the micro-step, to be jitted with ``donate_argnames="acc_grads"``.

    Its arguments are ``(params, opt_state, acc_grads, model_state, totals, batch, weights,
    rng, offset, k, target=None)``, where ``opt_state`` is the ``MultiStepsState`` with
    ``acc_grads=None`` (the accumulator travels apart, so that it alone is donated),
    ``totals`` the running weighted sums of the loss and the aux metrics, ``weights``
    each example's weight (0 for a padding row, 1 for a plain mean), ``offset`` the
    index of the micro-batch's first example in the target batch and ``k`` the
    ``MultiSteps`` period; ``target`` is the update's target batch size ``T`` (a traced
    int: one compiled program serves every ``T``), by default ``target_batch_size``.
    It returns ``(acc_grads, mini_step, model_state, totals)``. The totals are a few
    scalars: not donated, one set of device zeros can start every update.

    Examples:
        >>> import optax
        >>> loss = lambda p, b, rng: (b["x"] * p["w"] - b["y"]) ** 2
        >>> step = jax.jit(make_micro_step(loss, optax.sgd(0.1), 4),
        ...                donate_argnames="acc_grads")
        >>> params = {"w": jnp.ones(())}
        >>> opt = multi_steps(optax.sgd(0.1), 3).init(params)
        >>> batch = {"x": jnp.ones(2), "y": jnp.zeros(2)}
        >>> acc, mini, _, totals = step(params, opt._replace(acc_grads=None), opt.acc_grads,
        ...     (), {"loss": jnp.zeros(())}, batch, jnp.ones(2), jax.random.key(0), 0, 3)
        >>> float(acc["w"]), int(mini), float(totals["loss"])  # d/dw sum((w-0)^2)/4 over 2
        (1.0, 1, 2.0)
    """
    takes_weights = loss_takes_weights(loss_fn)  # once, not at every trace

    def micro_step(
        params, opt_state, acc_grads, model_state, totals, batch, weights, rng, offset, k,
        target=None,
    ):  # fmt: skip
        m = weights.shape[0]
        if on_trace is not None:
            on_trace(m)
        with jax.named_scope(f"micro_batch_{m}"):
            key = jax.random.fold_in(jax.random.fold_in(rng, opt_state.gradient_step), offset)

            grads, sums, new_model_state = weighted_grad(
                loss_fn, has_aux, has_state, takes_weights, params, model_state, batch, key,
                weights, _target(target_batch_size, target),
            )  # fmt: skip
            _, new_opt = multi_steps(optimizer, k).update(
                grads, opt_state._replace(acc_grads=acc_grads), params
            )
            new_totals = {name: totals[name] + sums[name] for name in totals}
        return new_opt.acc_grads, new_opt.mini_step, new_model_state, new_totals

    return micro_step


def make_optimizer_step(
    optimizer: optax.GradientTransformation,
    target_batch_size: int | None = None,
    *,
    per_device: bool = False,
) -> Callable[..., Any]:
    """Builds the optimizer step: the emitting mini-step of ``MultiSteps``.

    Its arguments are ``(params, opt_state, totals, k, target=None)`` with
    ``opt_state.mini_step == k - 1``; it returns ``(params, opt_state, means)`` where
    ``means`` divides the totals by the target batch size (``target``, a traced int, or
    by default ``target_batch_size``). Jit it without donation: a failure then leaves the state
    alive, and its peak (the state twice) does not depend on the micro-batch size.

    With ``per_device`` the accumulator and the totals carry a leading device axis (see
    `per_device`): the step first sums them over it, the update's one reduction across
    devices, and returns the accumulator reset in the parameters' own shape.

    Examples:
        >>> import optax
        >>> params = {"w": jnp.ones(())}
        >>> opt = multi_steps(optax.sgd(0.5), 2).init(params)
        >>> opt = opt._replace(mini_step=jnp.int32(1), acc_grads={"w": jnp.float32(2.0)})
        >>> new_params, new_opt, means = make_optimizer_step(optax.sgd(0.5), 4)(
        ...     params, opt, {"loss": jnp.float32(8.0)}, 2)
        >>> float(new_params["w"]), int(new_opt.gradient_step), float(means["loss"])
        (0.0, 1, 2.0)
    """

    def optimizer_step(params, opt_state, totals, k, target=None):
        if per_device:
            opt_state, totals = _sum_over_devices(opt_state, totals)
        zeros = jax.tree.map(jnp.zeros_like, params)
        updates, new_opt = multi_steps(optimizer, k).update(zeros, opt_state, params)
        means = {name: _scale(total, target_batch_size, target) for name, total in totals.items()}
        return optax.apply_updates(params, updates), new_opt, means

    return optimizer_step


def with_optimizer_step(
    program: Callable[..., Any], optimizer_step: Callable[..., Any], *, whole: bool = False
) -> Callable[..., Any]:
    """An update's last program: ``program``'s micro-steps, then the optimizer step.

    One dispatch and one wait fewer per update than running the two apart. ``program``
    is a micro-step or a chunk of them (`scan_micro_steps`, `per_device`) and
    ``optimizer_step`` from `make_optimizer_step`; the result takes the micro-step's
    arguments (`make_micro_step`) and returns ``(params, opt_state, model_state,
    means)``. Jit it donating the micro-step's donated arguments only: the parameters
    and the optimizer state stay intact whatever happens, so a failure loses nothing
    (the new state is then allocated beside the old one: the state twice, as the
    optimizer step alone needs).

    With ``whole``, ``program``'s micro-steps are the whole update (``mini_step`` 0,
    ``offset`` 0): they start from a zero accumulator made in the program, never
    reading ``acc_grads`` (its shape alone), and the result's ``opt_state`` has
    ``acc_grads=None``: between updates the state's accumulator is zeros (what
    ``MultiSteps`` leaves), so the caller keeps it as the new state's, and no
    state-sized tree of zeros is written per update. Jit it donating nothing.

    Examples:
        >>> import optax
        >>> loss = lambda p, b, rng: (b["x"] * p["w"] - b["y"]) ** 2
        >>> last = jax.jit(with_optimizer_step(
        ...     make_micro_step(loss, optax.sgd(0.5), 2), make_optimizer_step(optax.sgd(0.5), 2)))
        >>> params = {"w": jnp.ones(())}
        >>> opt = multi_steps(optax.sgd(0.5), 2).init(params)
        >>> batch = {"x": jnp.ones(2), "y": jnp.zeros(2)}
        >>> new, new_opt, _, means = last(params, opt._replace(acc_grads=None), opt.acc_grads,
        ...     (), {"loss": jnp.zeros(())}, batch, jnp.ones(2), jax.random.key(0), 0, 2)
        >>> float(new["w"]), int(new_opt.gradient_step), float(means["loss"])
        (0.0, 1, 1.0)
    """

    def last(
        params, opt_state, acc_grads, model_state, totals, batch, weights, rng, offset, k,
        target=None,
    ):  # fmt: skip
        start = jax.tree.map(jnp.zeros_like, acc_grads) if whole else acc_grads
        acc, mini_step, model_state, totals = program(
            params, opt_state, start, model_state, totals, batch, weights, rng, offset, k,
            target,
        )  # fmt: skip
        opt_state = opt_state._replace(acc_grads=acc, mini_step=mini_step)
        params, opt_state, means = optimizer_step(params, opt_state, totals, k, target)
        if whole:  # the caller's accumulator, zeros, is the new state's: not written again
            opt_state = opt_state._replace(acc_grads=None)
        return params, opt_state, model_state, means

    return last


def _sum_over_devices(opt_state: optax.MultiStepsState, totals: dict) -> tuple[Any, dict]:
    """The accumulator and totals summed over their leading device axis."""
    acc = jax.tree.map(lambda a: jnp.sum(a, axis=0), opt_state.acc_grads)
    return opt_state._replace(acc_grads=acc), {n: jnp.sum(t, axis=0) for n, t in totals.items()}


def scan_micro_steps(
    micro_step: Callable[..., Any], size: int, *, split: bool = True
) -> Callable[..., Any]:
    """Runs consecutive micro-steps of ``size`` in one program: a chunk, one dispatch.

    The returned function takes the micro-step's arguments with ``c * size`` examples
    (``c`` micro-batches, in order, ``offset`` the first one's) and returns what the
    last of the ``c`` micro-steps returns. Each micro-step sees the same arguments it
    would see dispatched alone (its micro-batch, its offset, the running accumulator,
    mini-step, model state and totals), so a chunk equals its micro-steps one by one;
    only the host's work per micro-step is gone. With ``split=False`` the examples come
    already split, ``[c, rows, ...]`` (a device's rows of each micro-batch, see
    `per_device`); the offsets still step by ``size``.

    Examples:
        >>> import optax
        >>> loss = lambda p, b, rng: (b["x"] * p["w"] - b["y"]) ** 2
        >>> micro = make_micro_step(loss, optax.sgd(0.1), 4)
        >>> chunk = jax.jit(scan_micro_steps(micro, 2))
        >>> params = {"w": jnp.ones(())}
        >>> opt = multi_steps(optax.sgd(0.1), 3).init(params)
        >>> batch = {"x": jnp.ones(4), "y": jnp.zeros(4)}
        >>> acc, mini, _, totals = chunk(params, opt._replace(acc_grads=None), opt.acc_grads,
        ...     (), {"loss": jnp.zeros(())}, batch, jnp.ones(4), jax.random.key(0), 0, 3)
        >>> float(acc["w"]), int(mini), float(totals["loss"])  # two micro-steps of 2
        (2.0, 2, 4.0)
    """

    def chunk_step(
        params, opt_state, acc_grads, model_state, totals, batch, weights, rng, offset, k,
        target=None,
    ):  # fmt: skip
        c = weights.shape[0] // size if split else weights.shape[0]

        def cut(x):
            return x.reshape(c, size, *x.shape[1:]) if split else x

        def body(carry, xs):
            acc, mini_step, state, sums = carry
            micro_batch, micro_weights, i = xs
            opt = opt_state._replace(mini_step=mini_step)
            out = micro_step(
                params, opt, acc, state, sums, micro_batch, micro_weights, rng, offset + i * size,
                k, target,
            )  # fmt: skip
            return out, None

        carry = (acc_grads, opt_state.mini_step, model_state, totals)
        xs = (jax.tree.map(cut, batch), cut(weights), jnp.arange(c, dtype=jnp.int32))
        return jax.lax.scan(body, carry, xs)[0]

    return chunk_step


def per_device(
    micro_step: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis: str,
    *,
    chunk_size: int | None = None,
) -> Callable[..., Any]:
    """The micro-step (or a chunk of them) run on each device's own rows, with no collective.

    Under ``jax.shard_map`` over the mesh's ``axis`` (the other axes stay automatic),
    each device computes the gradient of its rows of the micro-batch and adds it to its
    own accumulator, as PyTorch DDP's ``no_sync`` does: the accumulator and the totals
    carry a leading device axis split over ``axis`` (``[D, ...]``, one row per device,
    the bytes of one accumulator on each device, as when it is replicated), and their sum
    over devices is the optimizer step's (`make_optimizer_step` with ``per_device``),
    once per update. Each device's rows are a micro-batch of their own for the loss: the
    key folds in their first example's index (``offset + device * rows``), as for a
    micro-batch of that size on one device.

    Args:
        micro_step: from `make_micro_step` (a loss without model state: its statistics
            would be the device's rows' alone).
        mesh: the mesh; the micro-batch is split over ``axis``, the parameters are not.
        axis: the data axis.
        chunk_size: None for one micro-step; else the global size of each micro-step of
            a chunk, whose examples come as ``[c, size, ...]`` split over ``axis`` on
            their second dimension (each device holds its rows of every micro-batch).

    Returns:
        A function of the micro-step's arguments and results (`make_micro_step`), with
        ``acc_grads`` and ``totals`` of a leading device axis; jit it as the micro-step.

    Examples:
        >>> import optax
        >>> from jax.sharding import Mesh
        >>> loss = lambda p, b, rng: (b["x"] * p["w"] - b["y"]) ** 2
        >>> mesh = Mesh(jax.devices()[:1], ("data",))
        >>> step = jax.jit(per_device(make_micro_step(loss, optax.sgd(0.1), 4), mesh, "data"))
        >>> params = {"w": jnp.ones(())}
        >>> opt = multi_steps(optax.sgd(0.1), 3).init(params)
        >>> acc = {"w": jnp.zeros((1,))}
        >>> batch = {"x": jnp.ones(2), "y": jnp.zeros(2)}
        >>> acc, mini, _, totals = step(params, opt._replace(acc_grads=None), acc, (),
        ...     {"loss": jnp.zeros((1,))}, batch, jnp.ones(2), jax.random.key(0), 0, 3)
        >>> acc["w"].tolist(), int(mini), totals["loss"].tolist()
        ([1.0], 1, [2.0])
    """

    def on_device(
        params, opt_state, acc_grads, model_state, totals, batch, weights, rng, offset, k,
        target,
    ):  # fmt: skip
        first_row = jax.lax.axis_index(axis) * weights.shape[-1]

        def step(p, opt, acc, state, sums, rows, w, key, at, k_, t=None):
            return micro_step(p, opt, acc, state, sums, rows, w, key, at + first_row, k_, t)

        run = step if chunk_size is None else scan_micro_steps(step, chunk_size, split=False)
        acc, totals = jax.tree.map(lambda x: x[0], (acc_grads, totals))
        acc, mini_step, model_state, totals = run(
            params, opt_state, acc, model_state, totals, batch, weights, rng, offset, k, target
        )
        return _with_device_axis(acc), mini_step, model_state, _with_device_axis(totals)

    own, every = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()
    rows = own if chunk_size is None else jax.sharding.PartitionSpec(None, axis)
    mapped = jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(every, every, own, every, own, rows, rows, every, every, every, every),
        out_specs=(own, every, every, own),
        axis_names={axis},
        # Unchecked: the gradient of the replicated parameters is then each device's
        # own (a checked map would sum it over the devices in every micro-step), and the
        # mini-step, computed from replicated values alone, is the same on every device.
        check_vma=False,
    )

    def with_target(
        params, opt_state, acc_grads, model_state, totals, batch, weights, rng, offset, k,
        target=None,
    ):  # fmt: skip
        return mapped(
            params, opt_state, acc_grads, model_state, totals, batch, weights, rng, offset, k,
            target,
        )  # fmt: skip

    return with_target


def _with_device_axis(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[None], tree)
