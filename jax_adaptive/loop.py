"""The one host loop: updates over a stream of batches, with progress and hooks.

Apart from the jitted pieces, as the Flax examples keep ``train_step`` apart: values come
to the host once per update, never per micro-step. `jax_adaptive.AdaptiveTrainer.fit`,
`jax_adaptive.BucketedTrainer.fit` and the command line run it (its additions are
hooks). What an error part-way keeps: docs/recovery.md.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import jax

from jax_adaptive.errors import FitError, OptimizerStepOutOfMemory
from jax_adaptive.read_ahead import (
    ReadAhead,
    Unread,
    interrupts_deferred,
    interrupts_relayed,
    raise_lost,
)

__all__ = ["Kept", "fit_loop"]

log = logging.getLogger("jax_adaptive")

State = TypeVar("State")


class Kept(Generic[State]):
    """What `fit_loop` has done so far: the last good state and the history, kept whole.

    For a caller that an interrupt may reach after `fit_loop` returned and before it
    stored the result (Python runs signal handlers after a call returns): it reads these.
    """

    def __init__(self, state: State):
        self.state = state
        self.history: list[dict[str, Any]] = []


def _update(
    step: Callable[[State, Any], tuple[State, dict[str, Any]]],
    state: State,
    batch: Any,
    retries: int,
    kept: Kept[State],
) -> tuple[State, dict[str, Any]]:
    """One update, retried from the kept state when the optimizer step runs out of memory.

    ``kept.state`` receives the state an out-of-memory handed back, for the caller's error.
    """
    for attempt in range(retries + 1):
        try:
            return step(state, batch)
        except OptimizerStepOutOfMemory as exc:
            state = kept.state = exc.state  # the update's intact start: the batch runs again
            if attempt == retries:
                raise
            log.warning(
                "the optimizer step ran out of memory; retrying the update (%d)", attempt + 1
            )
            gc.collect()  # buffers held only by reference cycles go back to the device
    raise AssertionError("unreachable")


def _on_host(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics as host values, in the step's order (``device_get`` sorts a dict's keys)."""
    fetched = jax.device_get(metrics)
    return {key: fetched[key] for key in metrics} if isinstance(metrics, dict) else fetched


def fit_loop(
    step: Callable[[State, Any], tuple[State, dict[str, Any]]],
    state: State,
    batches: Iterable[Any],
    num_updates: int | None = None,
    *,
    progress: bool = False,
    on_update: Callable[[int, dict[str, Any]], None] | None = None,
    retries: int = 3,
    after_update: Callable[[int, State, dict[str, Any]], dict[str, Any] | None] | None = None,
    start: int = 0,
    read_ahead: int = 0,
    unread: Callable[[Unread], None] | None = None,
    taken: Callable[[], None] | None = None,
    kept: Kept[State] | None = None,
) -> tuple[State, list[dict[str, Any]]]:
    """Runs ``step`` on each batch until the stream ends or ``num_updates`` are done.

    Args:
        step: ``(state, batch) -> (state, metrics)``; metrics hold ``loss`` and
            ``examples``, and may hold ``micro_batch_size`` and ``accumulation_steps``.
        state: the state to start from.
        batches: the stream.
        num_updates: how many updates to run; None runs until the stream ends.
        progress: show a progress bar (update, loss, examples/s, micro-batch, steps).
        on_update: called as ``on_update(update, metrics)`` after ``after_update``.
        retries: times in a row one batch's update is retried after its optimizer step's OOM.
        after_update: called with the update's number, new state and metrics (host
            values) after each update; the metrics it returns join that update's.
        start: the updates done before this call (a resumed run's): numbering and the
            bar start at ``start + 1``.
        read_ahead: how many batches a background thread reads ahead
            (`jax_adaptive.read_ahead.ReadAhead`); 0 reads each when needed, in this thread.
            The thread has ended when the loop returns or raises (a read in progress is
            waited for).
        unread: required with ``read_ahead``: given what was read ahead and not trained
            on (an `jax_adaptive.read_ahead.Unread`) when the loop ends, however it ends.
        taken: called when the batch in flight is done with: its update kept (in one
            step with the new state, whole under interrupts), or failed with an error
            (the `jax_adaptive.FitError` holds it); not on a KeyboardInterrupt, which
            leaves it with the stream (a `jax_adaptive.Rebatcher` with ``lend``).
        kept: where the last good state and the history are kept as the loop goes
            (a caller's `Kept`, read when an interrupt reaches it after the return).

    Returns:
        The state and one metrics dict (host values) per update.

    Raises:
        FitError: from any error of the stream, the step or a hook (``retries``
            exhausted, too), with the last good state, the history and the batch in flight.
        KeyboardInterrupt: itself, from wherever it landed (a handler of any signal may
            raise it), with ``.state`` and ``.history`` as `Kept` holds them.

    Examples:
        >>> seen, it, left = [], iter([3, 4, 5]), []  # a resumed run: updates 3 and 4
        >>> state, history = fit_loop(lambda s, b: (s + b, {"loss": b, "examples": 1}),
        ...                           3, it, 2, start=2, on_update=lambda u, m: seen.append(u),
        ...                           read_ahead=1, unread=lambda u: left.extend(u.items))
        >>> state, seen, [h["loss"] for h in history], left + list(it)  # 5: handed back
        (10, [3, 4], [3, 4], [5])
    """
    from tqdm.auto import tqdm

    if num_updates is not None and (isinstance(num_updates, bool) or num_updates <= 0):
        raise ValueError(f"num_updates={num_updates} must be a positive int or None.")
    if read_ahead and unread is None:
        raise ValueError("read_ahead needs unread, which takes what was read and not trained on.")
    kept = Kept(state) if kept is None else kept
    history = kept.history
    total = None if num_updates is None else start + num_updates
    bar = tqdm(total=total, initial=start, disable=not progress, unit="update", leave=False)
    began, examples = time.perf_counter(), 0
    iterator, reader, batch = iter(batches), None, None
    try:
        # What a signal handler raised inside a gc callback (which Python drops) is
        # raised again between updates and in the waits for the stream.
        with interrupts_relayed():
            try:
                if read_ahead:
                    with interrupts_deferred():  # a thread started is a thread closed below
                        reader = ReadAhead(iterator, read_ahead)
                while num_updates is None or len(history) < num_updates:
                    raise_lost()
                    try:
                        if reader is None:  # a Rebatcher with ``lend`` keeps it until `taken`
                            batch = next(iterator)
                        else:
                            reader.wait()  # interruptible; what follows does not block
                            with interrupts_deferred():  # taken from the reader: in flight
                                batch = next(reader)
                    except StopIteration:
                        break
                    new_state, metrics = _update(step, state, batch, retries, kept)
                    metrics = _on_host(metrics)
                    raise_lost()  # before the new state is kept: the batch goes back
                    with interrupts_deferred():  # the new state, its history and the batch taken
                        state, batch = new_state, None  # done: nothing in flight
                        kept.state = state
                        history.append(metrics)
                        if taken is not None:
                            taken()
                    update = start + len(history)
                    if after_update is not None:
                        metrics.update(_on_host(after_update(update, state, dict(metrics)) or {}))
                    if on_update is not None:
                        on_update(update, metrics)
                    examples += int(metrics.get("examples", 0))
                    bar.set_postfix(
                        loss=f"{float(metrics['loss']):.4f}",
                        ex_s=f"{examples / (time.perf_counter() - began):,.0f}",
                        micro=metrics.get("micro_batch_size"),
                        accum=metrics.get("accumulation_steps"),
                    )
                    bar.update()
            except Exception as exc:
                if batch is not None and taken is not None:
                    taken()  # the error holds the batch: the stream moves past it
                raise FitError(kept.state, history, batch, exc) from exc
            finally:
                bar.close()
                if reader is not None:  # its thread ends here, what it read is handed on
                    with interrupts_deferred():
                        unread(reader.close())  # type: ignore[misc]
    except KeyboardInterrupt as exc:  # stays itself, carrying what was done
        exc.state, exc.history = kept.state, history  # type: ignore[attr-defined]
        exc.add_note(f"fit: {len(history)} updates completed; see .state and .history")
        raise
    return kept.state, history
