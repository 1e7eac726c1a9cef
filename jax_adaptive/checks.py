"""The library's argument and batch checks: one-line errors that name and show the value.

Each raises `TypeError` (the wrong kind) or `ValueError` (out of range) at once, never deep
inside a trace or compile, or returns the value normalised (a NumPy int becomes ``int``).
Importing it does not start JAX: the command line checks its flags with it first, so that
``--help`` and a bad flag answer at once (the functions that read arrays import JAX).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax

__all__ = [
    "MAX_TARGET_BATCH_SIZE",
    "background_search",
    "boolean",
    "check_batch",
    "check_buckets",
    "check_chunk",
    "check_device",
    "check_fraction",
    "check_grow",
    "check_limit",
    "check_program",
    "check_target_batch_size",
    "compile_workers",
    "fixed_size",
    "is_int",
    "non_negative_int",
    "on_device",
    "one_of",
    "positive_int",
    "refuse_aux_named_loss",
]

MAX_TARGET_BATCH_SIZE = 2**31 - 1
"""The largest target batch: the micro-step counts examples and offsets in int32."""


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (a NumPy one too), not a bool.

    Examples:
        >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
        (True, True, False, False)
    """
    return not isinstance(value, bool) and isinstance(value, int | np.integer)


def positive_int(name: str, value: Any) -> int:
    """Returns ``value`` as an ``int`` if it is a positive int (not a bool).

    Examples:
        >>> positive_int("in_flight", 0)
        Traceback (most recent call last):
        ValueError: in_flight=0 must be positive.
    """
    if not is_int(value):
        raise TypeError(f"{name} must be a positive int, got {_got(value)}.")
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive.")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    """Returns ``value`` as an ``int`` if it is an int (not a bool) of at least 0.

    Examples:
        >>> non_negative_int("oom_retries", -1)
        Traceback (most recent call last):
        ValueError: oom_retries=-1 must be at least 0.
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int >= 0, got {_got(value)}.")
    if value < 0:
        raise ValueError(f"{name}={value} must be at least 0.")
    return int(value)


def boolean(name: str, value: Any) -> bool:
    """Returns ``value`` if it is a bool (not 0, 1 or a string).

    Examples:
        >>> boolean("background_search", "yes")
        Traceback (most recent call last):
        TypeError: background_search must be True or False, got 'yes' (str).
    """
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be True or False, got {_got(value)}.")
    return bool(value)


def background_search(value: Any, choices: Mapping[Any, Any], what: str) -> bool:
    """``background_search`` (a bool), refused for ``choices`` of several remat policies.

    ``choices``: the policies' ``what`` (one, under None, without `RematChoices`): they
    are planned one after another, which a search in the background cannot be.

    Examples:
        >>> background_search(True, {"none": 1, "full": 2}, "loss")
        Traceback (most recent call last):
        ValueError: background_search=True plans one loss; got RematChoices of ['none', 'full']: their policies are planned one after another.
    """  # noqa: E501
    if boolean("background_search", value) and None not in choices:
        raise ValueError(
            f"background_search=True plans one {what}; got RematChoices of {list(choices)}: "
            "their policies are planned one after another."
        )
    return value


def one_of(name: str, value: Any, choices: Sequence[str]) -> str:
    """Returns ``value`` if it is one of the ``choices`` (strings).

    Examples:
        >>> one_of("objective", "fast", ("least_padding", "max"))
        Traceback (most recent call last):
        ValueError: objective='fast' must be one of 'least_padding', 'max'.
    """
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}={value!r} must be one of {listed}.")
    return value


def check_program(size: Any, chunk: Any, T: int) -> None:
    """A program of ``chunk`` micro-steps of ``size`` within updates of ``T`` examples.

    Examples:
        >>> check_program(4, 2, 8)
        >>> check_program(4, 3, 8)
        Traceback (most recent call last):
        ValueError: a chunk of 3 micro-steps of 4 covers more than target_batch_size=8.
    """
    size = positive_int("size", size)
    if size > T:
        raise ValueError(f"{size=} must be in [1, target_batch_size={T}].")
    if positive_int("chunk", chunk) * size > T + size - 1:
        raise ValueError(
            f"a chunk of {chunk} micro-steps of {size} covers more than target_batch_size={T}."
        )


def check_target_batch_size(value: Any) -> int:
    """The target batch size: a positive int below ``2**31`` (the micro-step's int32).

    Examples:
        >>> check_target_batch_size(2**31)
        Traceback (most recent call last):
        ValueError: target_batch_size=2147483648 must be at most 2**31 - 1 ...
    """
    value = positive_int("target_batch_size", value)
    if value > MAX_TARGET_BATCH_SIZE:
        raise ValueError(
            f"target_batch_size={value} must be at most 2**31 - 1 (the micro-step counts "
            "examples in int32)."
        )
    return value


def check_limit(memory_limit: Any) -> int | None:
    """A memory limit: None (no cap) or a positive int of bytes.

    Examples:
        >>> check_limit(None), check_limit(2**20)
        (None, 1048576)
        >>> check_limit(1.5)
        Traceback (most recent call last):
        TypeError: memory_limit must be a positive int, got 1.5 (float).
    """
    return None if memory_limit is None else positive_int("memory_limit", memory_limit)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def check_fraction(name: str, value: Any) -> float:
    """A share in ``[0, 1)`` (a real number, not a bool nor a string).

    Examples:
        >>> check_fraction("headroom", "x")
        Traceback (most recent call last):
        TypeError: headroom must be a number in [0, 1), got 'x' (str).
    """
    if not _is_number(value):
        raise TypeError(f"{name} must be a number in [0, 1), got {_got(value)}.")
    if not 0.0 <= float(value) < 1.0:  # NaN fails this too
        raise ValueError(f"{name}={value!r} must be in [0, 1).")
    return float(value)


def check_grow(grow: Any) -> str | int:
    """The grow policy: ``"never"``, ``"on_limit_change"`` or a positive int (not a bool).

    Examples:
        >>> check_grow(True)
        Traceback (most recent call last):
        TypeError: grow must be 'never', 'on_limit_change' or a positive int, got True (bool).
    """
    if isinstance(grow, str) and grow in ("never", "on_limit_change"):
        return grow
    if not is_int(grow):
        raise TypeError(
            f"grow must be 'never', 'on_limit_change' or a positive int, got {_got(grow)}."
        )
    return positive_int("grow", grow)


def check_chunk(chunk: Any) -> int | str:
    """Micro-steps per dispatch: ``"auto"`` or a positive int (not a bool).

    Examples:
        >>> check_chunk(0)
        Traceback (most recent call last):
        ValueError: chunk=0 must be 'auto' or a positive int.
    """
    if isinstance(chunk, str) and chunk == "auto":
        return chunk
    if not is_int(chunk) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be 'auto' or a positive int.")
    return int(chunk)


def check_optimizer(optimizer: Any) -> Any:
    """An ``optax.GradientTransformation``: anything with ``init`` and ``update``.

    Examples:
        >>> check_optimizer(0.1)
        Traceback (most recent call last):
        TypeError: optimizer must be an optax.GradientTransformation (with init and ...), got float.
    """
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            "optimizer must be an optax.GradientTransformation (with init and update), "
            f"got {type(optimizer).__name__}."
        )
    return optimizer


def check_normalizer(normalizer: Any) -> Any:
    """None or a function of the batch (its count: tokens, weights).

    Examples:
        >>> check_normalizer(3)
        Traceback (most recent call last):
        TypeError: normalizer must be a function of the batch, got 3.
    """
    if normalizer is not None and not callable(normalizer):
        raise TypeError(f"normalizer must be a function of the batch, got {normalizer!r}.")
    return normalizer


def check_device(device: Any) -> jax.Device | None:
    """A ``jax.Device`` or None (a name such as ``"cpu"`` is not a device).

    Examples:
        >>> check_device("cpu")
        Traceback (most recent call last):
        TypeError: device must be a jax.Device such as jax.devices()[0], or None, got 'cpu' (str).
    """
    import jax

    if device is not None and not isinstance(device, jax.Device):
        raise TypeError(
            f"device must be a jax.Device such as jax.devices()[0], or None, got {_got(device)}."
        )
    return device


def ghost_multiple(loss_fn: Any, multiple_of: int, targets: Iterable[int]) -> int:
    """``multiple_of`` with a `jax_adaptive.ghost_batches` loss's groups in it.

    A target batch that is not whole groups is refused: its padding rows would sit in the
    last group's statistics.

    Examples:
        >>> def loss_fn(params, state, batch, rng): ...
        >>> loss_fn.ghost_batch_size = 8
        >>> ghost_multiple(loss_fn, 3, [48, 96])
        24
        >>> ghost_multiple(loss_fn, 1, [64, 100])
        Traceback (most recent call last):
        ValueError: target_batch_size=100 is not whole ghost batches of 8: its last group would normalize over padding rows; choose a target that is a multiple of 8.
    """  # noqa: E501
    ghost = getattr(loss_fn, "ghost_batch_size", None)
    if ghost is None:
        return multiple_of
    for target in targets:
        if target % ghost:
            raise ValueError(
                f"target_batch_size={target} is not whole ghost batches of {ghost}: its last "
                f"group would normalize over padding rows; choose a target that is a "
                f"multiple of {ghost}."
            )
    return math.lcm(multiple_of, ghost)


def fixed_size(micro_batch_size: Any, multiple_of: int, T: int, shards: int) -> int | None:
    """The fixed micro-batch size (None for ``"auto"``), checked against the others.

    Examples:
        >>> fixed_size("auto", 1, 8, 1) is None, fixed_size(4, 1, 8, 1)
        (True, 4)
        >>> fixed_size(16, 1, 8, 1)
        Traceback (most recent call last):
        ValueError: micro_batch_size=16 must not exceed target_batch_size=8.
    """
    if multiple_of > T:
        raise ValueError(f"{multiple_of=} must not exceed target_batch_size={T}.")
    if isinstance(micro_batch_size, str):
        if micro_batch_size == "auto":
            return None
        raise TypeError(
            f"micro_batch_size must be 'auto' or a positive int, got {micro_batch_size!r} (str)."
        )
    size = positive_int("micro_batch_size", micro_batch_size)
    if size > T:
        raise ValueError(f"micro_batch_size={size} must not exceed target_batch_size={T}.")
    if size % shards:
        raise ValueError(f"micro_batch_size={size} must be a multiple of the {shards} data shards.")
    return size


def refuse_aux_named_loss(
    loss_fn: Callable[..., Any], has_aux: bool, has_state: bool
) -> Callable[..., Any]:
    """``loss_fn``, refusing (when traced) an aux metric ``"loss"``: it would replace the loss.

    It runs at ``init``'s trace; output of another form passes untouched (the trainer's error).
    """
    if not has_aux:
        return loss_fn

    @functools.wraps(loss_fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = loss_fn(*args, **kwargs)
        inner = out[0] if has_state and isinstance(out, tuple) and len(out) == 2 else out
        aux = inner[1] if isinstance(inner, tuple) and len(inner) == 2 else None
        if isinstance(aux, dict) and "loss" in aux:
            raise ValueError(
                "loss_fn's aux has a metric named 'loss', which would replace the reported "
                "loss; rename it (e.g. 'aux_loss')."
            )
        return out

    return checked


def _takes_all(leaves: list, got: Any, specs: list, want: Any, T: int) -> bool:
    """Whether the batch's leaves are ``T`` examples of exactly the specs' shapes and dtypes."""
    if got != want:
        return False
    for x, spec in zip(leaves, specs, strict=True):  # a loop: this runs at every step
        shape = getattr(x, "shape", None)
        if shape is None or shape != (T, *spec.shape) or getattr(x, "dtype", None) != spec.dtype:
            return False
    return True


def check_batch(batch: Any, weights: Any, example: Any, T: int, update: int | None = None) -> None:
    """Raises a one-line error for a batch (or weights) the compiled programs would not take.

    ``example`` is one example's ``ShapeDtypeStruct``s, as planned; ``update`` (with a
    batch-size schedule) the updates so far, named in the error.

    Examples:
        >>> import jax
        >>> example = {"x": jax.ShapeDtypeStruct((3,), np.float32)}
        >>> check_batch({"x": np.zeros((8, 3), np.float32)}, None, example, 8)
        >>> check_batch({"x": np.zeros((8, 3), np.int32)}, None, example, 8)
        Traceback (most recent call last):
        ValueError: the batch leaf ['x'] has dtype int32, but example_batch had float32; ...
    """
    import jax

    from jax_adaptive.data import leading_size

    (leaves, got), (specs, want) = jax.tree.flatten(batch), jax.tree.flatten(example)
    if _takes_all(leaves, got, specs, want, T) and (weights is None or np.shape(weights) == (T,)):
        return  # what every step of a training loop passes: no more to check
    size = leading_size(batch)
    if size != T:
        rule = (
            f"each step takes exactly target_batch_size={T} examples."
            if update is None
            else f"the batch-size schedule gives target_batch_size={T} at update {update} "
            f"(state.updates): pass {T} examples."
        )
        raise ValueError(f"the batch has leading size {size}, but {rule}")
    if got != want:
        raise ValueError(f"the batch's structure {got} differs from example_batch's {want}.")
    for i, (x, spec) in enumerate(zip(leaves, specs, strict=True)):
        shape, dtype = np.shape(x), (x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        have, need = jax.dtypes.canonicalize_dtype(dtype), jax.dtypes.canonicalize_dtype(spec.dtype)
        if shape[1:] == spec.shape and have == need:
            continue  # a dtype JAX casts to the example's (NumPy's float64, x64 off)
        where = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(batch)[0][i][0])
        if shape[1:] != spec.shape:
            raise ValueError(
                f"the batch leaf {where} has per-example shape {shape[1:]}, but "
                f"example_batch had {spec.shape}."
            )
        raise ValueError(
            f"the batch leaf {where} has dtype {have}, but example_batch had {need}; "
            f"cast it (x.astype({need.name!r}))."
        )
    if weights is not None and np.shape(weights) != (T,):
        raise ValueError(f"weights must have shape ({T},), got {np.shape(weights)}.")


def on_device(batch: Any, device: jax.Device | None) -> Any:
    """The batch with each ``jax.Array`` on another device moved to ``device``.

    Host arrays pass as they are (each micro-step's call transfers its rows); so does
    everything when ``device`` is None (a mesh places its micro-batches itself).

    Examples:
        >>> import jax
        >>> device = jax.devices()[0]
        >>> moved = on_device({"x": jax.device_put(np.ones(2), device)}, device)
        >>> moved["x"].devices() == {device}
        True
    """
    import jax

    if device is None or not any(isinstance(x, jax.Array) for x in jax.tree.leaves(batch)):
        return batch  # host arrays: nothing to move

    def move(x: Any) -> Any:
        moved = isinstance(x, jax.Array) and x.devices() != {device}
        return jax.device_put(x, device) if moved else x

    return jax.tree.map(move, batch)


def check_buckets(buckets: Any) -> tuple[Any, ...]:
    """Bucket lengths or shapes, as a tuple (a string is not one: ``"16"`` is no bucket).

    Examples:
        >>> check_buckets([16, 32]), check_buckets({(8, 8)})
        ((16, 32), ((8, 8),))
        >>> check_buckets("16")
        Traceback (most recent call last):
        TypeError: buckets must be lengths or shapes such as (16, 32) ... got '16' (str).
    """

    def is_bucket(b: Any) -> bool:
        shape = isinstance(b, Sequence) and not isinstance(b, str | bytes) and len(b) > 0
        return is_int(b) or (shape and all(is_int(d) for d in b))

    ok = isinstance(buckets, Iterable) and not isinstance(buckets, str | bytes)
    listed = tuple(buckets) if ok else ()
    if not ok or not all(is_bucket(b) for b in listed):
        raise TypeError(
            "buckets must be lengths or shapes such as (16, 32) or ((32, 32), (64, 64)), "
            f"got {_got(buckets)}."
        )
    return listed


def compile_workers() -> int:
    """The sizes a search round compiles side by side: ``JAX_ADAPTIVE_COMPILE_WORKERS``, or 1.

    One by default: on a 2-core CPU two compiles side by side took 0.74 s against 0.80 s
    one after the other (XLA:CPU's compiler already uses the cores), and rounds of two
    compiled more sizes (62 against 48 over `experiments/search_cost.py`)
    for a longer search. A host whose compiles leave cores idle (a GPU host's, compiling
    kernels) may set more; `experiments/gpu_validation.py` measures it there.
    """
    said = os.environ.get("JAX_ADAPTIVE_COMPILE_WORKERS", "").strip()
    if not said:
        return 1
    if not said.isdigit() or int(said) < 1:
        raise ValueError(f"JAX_ADAPTIVE_COMPILE_WORKERS must be a positive int, got {said!r}.")
    return int(said)
