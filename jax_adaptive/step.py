"""The jitted pieces of one update: the micro-step and the optimizer step.

An update of ``T`` examples is ``n = ceil(T / m)`` micro-steps and one optimizer step,
all mini-steps of ``optax.MultiSteps(use_grad_mean=False)`` with ``k = n + 1``; the
micro-step adds the gradient of ``sum(weights * losses) / T`` to the accumulator, the
optimizer step applies the inner optimizer to the sum (docs/recovery.md). Under a mesh
`per_device` accumulates each device's rows apart (docs/devices.md). A row of weight 0
is selected out, never multiplied by zero (``0 * nan`` is ``nan``): the loss runs on a
live row's inputs in its place (`live_source`).
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
    "DONATED",
    "Batch",
    "MicroArgs",
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


class MicroArgs(NamedTuple):
    """The micro-step's arguments, in the order its programs take them (`make_micro_step`)."""

    params: Params
    opt_state: optax.MultiStepsState  # with acc_grads=None: the accumulator travels apart
    acc_grads: Params  # the accumulator, alone donated
    model_state: ModelState
    totals: dict  # the running weighted sums of the loss and each aux metric
    batch: Batch
    weights: jax.Array  # per example: 0 on a padding row
    rng: jax.Array
    offset: Any  # the index of the micro-batch's first example in the update
    k: Any  # the MultiSteps period
    target: Any = None  # T, a runtime int32 (one program for every T); None: the built-in


DONATED = ("acc_grads",)
"""The micro-step's donated arguments: a failed run may delete these, never the state."""


def _takes_micro_args(fn: Callable[[MicroArgs], Any]) -> Callable[..., Any]:
    """``fn`` of `MicroArgs`, taking them positionally by name (``jax.jit`` donates by name)."""

    def program(*args: Any) -> Any:
        return fn(MicroArgs(*args))

    program.__signature__ = inspect.signature(MicroArgs)  # type: ignore[attr-defined]
    return program


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
    """Whether ``loss_fn`` declares a keyword parameter ``weights`` (see `call_loss`)."""
    try:
        parameter = inspect.signature(loss_fn).parameters.get("weights")
    except (TypeError, ValueError):  # a callable without a signature takes none
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return parameter is not None and parameter.kind in keyword


def _pair(out: Any, flag: str, what: str) -> tuple[Any, Any]:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"with {flag}=True, loss_fn must return {what}; it returned {type(out).__name__}."
        )
    return out


def call_loss(
    loss_fn, has_aux: bool, has_state: bool, params, model_state, batch, rng, weights=None
):
    """Calls the user's loss in any of its forms; returns (losses, aux, new_model_state).

    ``weights`` goes to the loss as the keyword ``weights`` when given: pass it only to a
    loss that `loss_takes_weights`.

    Examples:
        >>> call_loss(lambda p, b, r: (b * p, {"n": b}), True, False, 2.0, (), 3.0, None)
        (6.0, {'n': 3.0}, ())
    """
    kwargs = {} if weights is None else {"weights": weights}
    if has_state:
        out = loss_fn(params, model_state, batch, rng, **kwargs)
        out, model_state = _pair(out, "has_state", "(output, new_model_state)")
    else:
        out = loss_fn(params, batch, rng, **kwargs)
    aux = {}
    if has_aux:
        what = "(losses, aux) with aux a dict of per-example arrays"
        out, aux = _pair(out, "has_aux", what)
    return out, aux, model_state


def check_per_example(name: str, value: Any, m: int) -> None:
    """Raises a one-line error unless ``value`` is ``m`` floating-point values, one per example."""
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

    A live row is its own source; a row of weight 0 takes the nearest live row before it,
    else the first live row; with no live row, every row is its own. It depends on the
    weights alone, so a plan does not change what a loss sees. NumPy weights give a NumPy
    result (on the host), jax ones a traced one.

    Examples:
        >>> live_source(np.array([0.0, 1.0, 0.0, 2.5, 0.0])).tolist()
        [1, 1, 1, 3, 3]
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

    What a micro-batch contributes, for the micro-step and `micro_batch_grad` alike. The
    ``batch`` rows must be gathered by `live_source`; a row of weight 0 then adds exactly
    0, and a micro-batch with no live row a zero gradient and the model state unchanged.

    Returns:
        The gradient, the weighted float32 sums of the loss and of each aux metric by
        name, and the new model state.
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


def make_micro_step(
    loss_fn: PerExampleLoss,
    optimizer: optax.GradientTransformation,
    target_batch_size: int | None = None,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    on_trace: Callable[[int], None] | None = None,
) -> Callable[..., Any]:
    """Builds the micro-step, to be jitted with ``donate_argnames=DONATED``.

    It takes `MicroArgs` (positionally) and returns ``(acc_grads, mini_step, model_state,
    totals)``; ``on_trace(m)`` runs at each trace. The totals are not donated: one set of
    device zeros can start every update.

    Examples:
        >>> import optax
        >>> loss = lambda p, b, rng: (b["x"] * p["w"] - b["y"]) ** 2
        >>> step = jax.jit(make_micro_step(loss, optax.sgd(0.1), 4), donate_argnames=DONATED)
        >>> params = {"w": jnp.ones(())}
        >>> opt = multi_steps(optax.sgd(0.1), 3).init(params)
        >>> batch = {"x": jnp.ones(2), "y": jnp.zeros(2)}
        >>> acc, mini, _, totals = step(params, opt._replace(acc_grads=None), opt.acc_grads,
        ...     (), {"loss": jnp.zeros(())}, batch, jnp.ones(2), jax.random.key(0), 0, 3)
        >>> float(acc["w"]), int(mini), float(totals["loss"])  # d/dw sum((w-0)^2)/4 over 2
        (1.0, 1, 2.0)
    """
    takes_weights = loss_takes_weights(loss_fn)  # once, not at every trace

    def micro_step(a: MicroArgs) -> tuple[Any, Any, Any, dict]:
        m = a.weights.shape[0]
        if on_trace is not None:
            on_trace(m)
        with jax.named_scope(f"micro_batch_{m}"):
            key = jax.random.fold_in(jax.random.fold_in(a.rng, a.opt_state.gradient_step), a.offset)
            grads, sums, model_state = weighted_grad(
                loss_fn, has_aux, has_state, takes_weights, a.params, a.model_state, a.batch, key,
                a.weights, _target(target_batch_size, a.target),
            )  # fmt: skip
            _, new_opt = multi_steps(optimizer, a.k).update(
                grads, a.opt_state._replace(acc_grads=a.acc_grads), a.params
            )
            totals = {name: a.totals[name] + sums[name] for name in a.totals}
        return new_opt.acc_grads, new_opt.mini_step, model_state, totals

    return _takes_micro_args(micro_step)


def make_optimizer_step(
    optimizer: optax.GradientTransformation,
    target_batch_size: int | None = None,
    *,
    per_device: bool = False,
) -> Callable[..., Any]:
    """Builds the optimizer step: the emitting mini-step of ``MultiSteps``.

    It takes ``(params, opt_state, totals, k, target=None)`` with ``opt_state.mini_step ==
    k - 1`` and returns ``(params, opt_state, means)``, the totals divided by ``T``. Jit it
    without donation: a failure leaves the state alive. With ``per_device`` the
    accumulator and totals carry a leading device axis (`per_device`), summed first.

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
        if per_device:  # the update's one reduction across devices
            acc = jax.tree.map(lambda a: jnp.sum(a, axis=0), opt_state.acc_grads)
            opt_state = opt_state._replace(acc_grads=acc)
            totals = {n: jnp.sum(t, axis=0) for n, t in totals.items()}
        zeros = jax.tree.map(jnp.zeros_like, params)
        updates, new_opt = multi_steps(optimizer, k).update(zeros, opt_state, params)
        T = _target(target_batch_size, target)
        means = {name: total / jnp.asarray(T).astype(total.dtype) for name, total in totals.items()}
        return optax.apply_updates(params, updates), new_opt, means

    return optimizer_step


def with_optimizer_step(
    program: Callable[..., Any], optimizer_step: Callable[..., Any], *, whole: bool = False
) -> Callable[..., Any]:
    """An update's last program: ``program``'s micro-steps, then the optimizer step.

    ``program`` takes `MicroArgs` (a micro-step or a chunk); the result takes them too and
    returns ``(params, opt_state, model_state, means)``. Jit it donating `DONATED`: the
    state stays intact whatever happens. With ``whole``, ``program`` is the whole update:
    it starts from zeros made in the program (``acc_grads`` is read for its shape alone),
    the result's ``opt_state`` has ``acc_grads=None`` (the caller keeps its zeros as the
    new state's) and nothing is donated.
    """

    def last(a: MicroArgs) -> tuple[Any, Any, Any, dict]:
        if whole:
            a = a._replace(acc_grads=jax.tree.map(jnp.zeros_like, a.acc_grads))
        acc, mini_step, model_state, totals = program(*a)
        opt_state = a.opt_state._replace(acc_grads=acc, mini_step=mini_step)
        params, opt_state, means = optimizer_step(a.params, opt_state, totals, a.k, a.target)
        if whole:  # the caller's accumulator, zeros, is the new state's: not written again
            opt_state = opt_state._replace(acc_grads=None)
        return params, opt_state, model_state, means

    return _takes_micro_args(last)


def scan_micro_steps(
    micro_step: Callable[..., Any], size: int, *, split: bool = True
) -> Callable[..., Any]:
    """Runs consecutive micro-steps of ``size`` in one program: a chunk, one dispatch.

    The result takes `MicroArgs` of ``c * size`` examples (``offset`` the first's) and
    returns what the last micro-step returns; each micro-step sees what it would see
    dispatched alone. With ``split=False`` the examples come already as ``[c, rows, ...]``
    (a device's rows of each micro-batch, `per_device`).
    """

    def chunk_step(a: MicroArgs) -> Any:
        c = a.weights.shape[0] // size if split else a.weights.shape[0]

        def cut(x):
            return x.reshape(c, size, *x.shape[1:]) if split else x

        def body(carry, xs):
            acc, mini_step, state, sums = carry
            batch, weights, i = xs
            out = micro_step(*a._replace(
                opt_state=a.opt_state._replace(mini_step=mini_step), acc_grads=acc,
                model_state=state, totals=sums, batch=batch, weights=weights,
                offset=a.offset + i * size,
            ))  # fmt: skip
            return out, None

        carry = (a.acc_grads, a.opt_state.mini_step, a.model_state, a.totals)
        xs = (jax.tree.map(cut, a.batch), cut(a.weights), jnp.arange(c, dtype=jnp.int32))
        return jax.lax.scan(body, carry, xs)[0]

    return _takes_micro_args(chunk_step)


def per_device(
    micro_step: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis: str,
    *,
    chunk_size: int | None = None,
) -> Callable[..., Any]:
    """The micro-step (or a chunk) run on each device's own rows, with no collective.

    Under ``jax.shard_map`` over ``axis``, each device adds the gradient of its rows to its
    own accumulator (PyTorch DDP's ``no_sync``): ``acc_grads`` and ``totals`` carry a
    leading device axis split over ``axis``, summed once per update by the optimizer step
    (`make_optimizer_step` with ``per_device``). A device's rows fold in their first
    example's index as a micro-batch of their own would.

    Args:
        micro_step: from `make_micro_step`, for a loss without model state.
        mesh: the mesh; the micro-batch is split over ``axis``, the parameters are not.
        axis: the data axis.
        chunk_size: None for one micro-step; else a chunk's micro-batch size, its examples
            as ``[c, size, ...]`` split over ``axis`` on their second dimension.

    Examples:
        >>> import optax
        >>> from jax.sharding import Mesh
        >>> loss = lambda p, b, rng: (b["x"] * p["w"] - b["y"]) ** 2
        >>> mesh = Mesh(jax.devices()[:1], ("data",))
        >>> step = jax.jit(per_device(make_micro_step(loss, optax.sgd(0.1), 4), mesh, "data"))
        >>> params = {"w": jnp.ones(())}
        >>> opt = multi_steps(optax.sgd(0.1), 3).init(params)
        >>> batch = {"x": jnp.ones(2), "y": jnp.zeros(2)}
        >>> acc, mini, _, totals = step(params, opt._replace(acc_grads=None), {"w": jnp.zeros(1)},
        ...     (), {"loss": jnp.zeros(1)}, batch, jnp.ones(2), jax.random.key(0), 0, 3)
        >>> acc["w"].tolist(), int(mini), totals["loss"].tolist()
        ([1.0], 1, [2.0])
    """

    def on_device(*args: Any) -> tuple[Any, Any, Any, dict]:
        a = MicroArgs(*args)
        first_row = jax.lax.axis_index(axis) * a.weights.shape[-1]
        step = _takes_micro_args(lambda b: micro_step(*b._replace(offset=b.offset + first_row)))
        run = step if chunk_size is None else scan_micro_steps(step, chunk_size, split=False)
        acc, totals = jax.tree.map(lambda x: x[0], (a.acc_grads, a.totals))
        acc, mini_step, model_state, totals = run(*a._replace(acc_grads=acc, totals=totals))
        acc, totals = jax.tree.map(lambda x: x[None], (acc, totals))
        return acc, mini_step, model_state, totals

    own, every = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()
    rows = own if chunk_size is None else jax.sharding.PartitionSpec(None, axis)
    specs = MicroArgs(*[every] * len(MicroArgs._fields))
    mapped = jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=tuple(specs._replace(acc_grads=own, totals=own, batch=rows, weights=rows)),
        out_specs=(own, every, every, own),
        axis_names={axis},
        # Unchecked: the gradient of the replicated parameters is then each device's
        # own (a checked map would sum it over the devices in every micro-step), and the
        # mini-step, computed from replicated values alone, is the same on every device.
        check_vma=False,
    )
    return _takes_micro_args(lambda a: mapped(*a))
