"""The host loop: updates over a stream of batches, with progress and a callback.

Kept apart from the jitted pieces (as the Flax examples keep ``train_step`` apart from
their loop): values come to the host once per update, for the history and the bar,
never per micro-step. `jax_adaptive.AdaptiveTrainer.fit` and
`jax_adaptive.BucketedTrainer.fit` both run it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax

__all__ = ["fit_loop"]

State = TypeVar("State")


def fit_loop(
    step: Callable[[State, Any], tuple[State, dict[str, Any]]],
    state: State,
    batches: Iterable[Any],
    num_updates: int | None = None,
    *,
    progress: bool = False,
    on_update: Callable[[int, dict[str, Any]], None] | None = None,
) -> tuple[State, list[dict[str, Any]]]:
    """Runs ``step`` on each batch until the stream ends or ``num_updates`` are done.

    Args:
        step: ``(state, batch) -> (state, metrics)``; metrics hold ``loss`` and
            ``examples``, and may hold ``micro_batch_size`` and ``accumulation_steps``.
        state: the state to start from.
        batches: the stream.
        num_updates: how many updates to run; None runs until the stream ends.
        progress: show a progress bar (update, loss, examples/s, micro-batch size and
            accumulation steps).
        on_update: called with the update's number (from 1) and metrics after each.

    Returns:
        The state and one metrics dict (host values) per update.

    Example:
        >>> state, history = fit_loop(lambda s, b: (s + b, {"loss": b, "examples": 1}),
        ...                           0, [1, 2, 3], num_updates=2)
        >>> state, [h["loss"] for h in history]
        (3, [1, 2])
    """
    from tqdm.auto import tqdm

    if num_updates is not None and (isinstance(num_updates, bool) or num_updates <= 0):
        raise ValueError(f"num_updates={num_updates} must be a positive int or None.")
    history: list[dict[str, Any]] = []
    bar = tqdm(total=num_updates, disable=not progress, unit="update", leave=False)
    start, examples = time.perf_counter(), 0
    try:
        for batch in batches:
            state, metrics = step(state, batch)
            metrics = jax.device_get(metrics)
            history.append(metrics)
            if on_update is not None:
                on_update(len(history), metrics)
            examples += int(metrics.get("examples", 0))
            bar.set_postfix(
                loss=f"{float(metrics['loss']):.4f}",
                ex_s=f"{examples / (time.perf_counter() - start):,.0f}",
                micro=metrics.get("micro_batch_size"),
                accum=metrics.get("accumulation_steps"),
            )
            bar.update()
            if num_updates is not None and len(history) == num_updates:
                break
    finally:
        bar.close()
    return state, history
