"""Batch-size schedules: the target batch size as a function of ``state.updates``.

A restored state goes on with the schedule where it left it (docs/schedules.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from jax_adaptive.checks import MAX_TARGET_BATCH_SIZE, check_target_batch_size, is_int

__all__ = [
    "BatchSchedule", "ScheduleCursor", "ScheduleSpec", "batch_schedule", "parse_batch_schedule"
]  # fmt: skip

ScheduleSpec: TypeAlias = "int | Callable[[int], int] | Sequence[tuple[int, int]] | BatchSchedule"


class BatchSchedule:
    """The target batch size of each optimizer update, a positive int below ``2**31``.

    Args:
        spec: an int, a callable ``updates -> int`` (the updates applied so far), or a
            list of ``(update, size)`` steps from update 0 on, the updates increasing.

    Attributes:
        constant: the size when it never changes (an int, or a single step), else None.
        steps: the ``(update, size)`` steps of a list spec, else None.

    Raises:
        TypeError, ValueError: for a bad spec (a callable's size: when called).

    Examples:
        >>> schedule = BatchSchedule([(0, 64), (100, 256), (500, 1024)])
        >>> schedule(0), schedule(99), schedule(100), schedule(10**6)
        (64, 64, 256, 1024)
        >>> BatchSchedule(lambda updates: 32 * (1 + updates // 10))(25)
        96
        >>> BatchSchedule([(0, 64), (0, 128)])
        Traceback (most recent call last):
        ValueError: target_batch_size schedule: step 1 (0, 128) must start after update 0 ...
    """

    def __init__(self, spec: ScheduleSpec):
        self.constant: int | None = None
        self.steps: tuple[tuple[int, int], ...] | None = None
        self._fn: Callable[[int], Any] | None = None
        if isinstance(spec, BatchSchedule):
            self.constant, self.steps, self._fn = spec.constant, spec.steps, spec._fn
        elif is_int(spec) or isinstance(spec, bool):
            self.constant = check_target_batch_size(spec)
        elif callable(spec):
            self._fn = spec
        elif isinstance(spec, list | tuple):
            self.steps = _checked_steps(spec)
            if len(self.steps) == 1:
                self.constant = self.steps[0][1]
        else:
            raise TypeError(
                "target_batch_size must be a positive int, a callable updates -> int or a "
                f"list of (update, size) steps, got {spec!r} ({type(spec).__name__})."
            )
        self._starts = [update for update, _ in self.steps] if self.steps else []

    def __call__(self, updates: int) -> int:
        """The target batch size of the update made after ``updates`` updates."""
        if self.constant is not None:
            return self.constant
        updates = int(updates)
        if self.steps is not None:
            return self.steps[bisect.bisect_right(self._starts, updates) - 1][1]
        size = self._fn(updates)  # type: ignore[misc]
        if not _is_size(size):
            raise ValueError(
                f"target_batch_size({updates}) returned {size!r}; a schedule must give a "
                "positive int below 2**31."
            )
        return int(size)

    @property
    def known_sizes(self) -> list[int]:
        """The sizes it takes, where known before training (none for a function).

        Examples:
            >>> BatchSchedule([(0, 8), (2, 16)]).known_sizes, BatchSchedule(4).known_sizes
            ([8, 16], [4])
        """
        if self.constant is not None:
            return [self.constant]
        return [size for _, size in self.steps or ()]

    def examples_before(self, updates: int) -> int:
        """Examples the updates ``0 .. updates - 1`` take (a data stream's position).

        Examples:
            >>> BatchSchedule([(0, 8), (2, 16)]).examples_before(3)
            32
        """
        if self.constant is not None:
            return self.constant * updates
        return sum(self(u) for u in range(updates))

    def __repr__(self) -> str:
        spec = self.constant if self.constant is not None else self.steps or self._fn
        return f"BatchSchedule({spec!r})"


class ScheduleCursor:
    """Where a trainer is on its schedule: the update its next step makes, and its size.

    ``state.updates`` is read from the device only for a state the trainer did not
    return itself, and never for a constant size. A size below ``shards`` is refused.

    Attributes:
        next_update: the update the next step makes (of the last state seen).
    """

    def __init__(self, schedule: BatchSchedule, shards: int):
        self.schedule, self.shards = schedule, shards
        self.next_update = 0
        self._returned: tuple[Any, int] = (None, 0)  # the updates a step returned, its value

    @property
    def target(self) -> int:
        """The next update's target batch size."""
        return self.size_at(self.next_update)

    def updates_of(self, updates: Any) -> int:
        """``state.updates`` on the host (0 for a constant size: nothing to read)."""
        if self.schedule.constant is not None:
            return 0
        if updates is self._returned[0]:  # the state a step returned: no device read
            return self._returned[1]
        import jax  # here: the command line parses a schedule before JAX starts

        if isinstance(updates, jax.Array) and not updates.is_fully_addressable:
            updates = updates.addressable_data(0)  # replicated: every process has it
        return int(jax.device_get(updates))

    def seen(self, updates: Any) -> int:
        """Notes a state's ``updates`` as the next step's; returns it on the host."""
        self.next_update = self.updates_of(updates)
        return self.next_update

    def stepped(self, updates: Any, done: int) -> None:
        """Notes that a step returned a state whose ``updates`` is ``done``."""
        self.next_update, self._returned = done, (updates, done)

    def size_at(self, updates: int) -> int:
        """The schedule's size at ``updates``, checked against the data shards."""
        T = self.schedule(updates)
        if T < self.shards:
            where = "" if self.schedule.constant is not None else f" at update {updates}"
            raise ValueError(
                f"target_batch_size={T}{where} is smaller than the {self.shards} data shards "
                "of the mesh: every device needs an example."
            )
        return T


def _is_size(size: Any) -> bool:
    return is_int(size) and 1 <= size <= MAX_TARGET_BATCH_SIZE


def _checked_steps(spec: Sequence[Any]) -> tuple[tuple[int, int], ...]:
    if not spec:
        raise ValueError("target_batch_size schedule must hold at least one (update, size) step.")
    steps: list[tuple[int, int]] = []
    for i, step in enumerate(spec):
        where = f"target_batch_size schedule: step {i} {step!r}"
        if not (isinstance(step, list | tuple) and len(step) == 2):
            raise TypeError(f"{where} must be a pair (update, size).")
        update, size = step
        if not is_int(update) or update < 0:
            raise TypeError(f"{where}: its update must be an int >= 0.")
        if not _is_size(size):
            raise ValueError(f"{where}: its size must be a positive int below 2**31.")
        if i == 0 and update != 0:
            raise ValueError(f"{where} must start at update 0 (the size of the first update).")
        if steps and update <= steps[-1][0]:
            raise ValueError(
                f"{where} must start after update {steps[-1][0]} (steps in increasing order)."
            )
        steps.append((int(update), int(size)))
    return tuple(steps)


def batch_schedule(*steps: tuple[int, int]) -> BatchSchedule:
    """A schedule of ``(update, size)`` steps: ``batch_schedule((0, 64), (100, 256))``.

    Examples:
        >>> schedule = batch_schedule((0, 64), (100, 256))
        >>> schedule(99), schedule(100)
        (64, 256)
    """
    return BatchSchedule(list(steps))


def parse_batch_schedule(text: str, flag: str = "--batch-schedule") -> BatchSchedule:
    """Parses ``"0:64,20:256"`` (from update 0 use 64, from 20 use 256); one-line errors.

    Examples:
        >>> parse_batch_schedule("0:64,20:256").steps
        ((0, 64), (20, 256))
        >>> parse_batch_schedule("0:64,x")
        Traceback (most recent call last):
        ValueError: --batch-schedule '0:64,x': 'x' is not UPDATE:SIZE (two ints).
    """
    steps = []
    for part in str(text).split(","):
        update, colon, size = part.strip().partition(":")
        try:
            if not colon:
                raise ValueError
            steps.append((int(update), int(size)))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {part!r} is not UPDATE:SIZE (two ints).") from None
    try:
        return BatchSchedule(steps)
    except (TypeError, ValueError) as exc:
        message = str(exc).replace("target_batch_size schedule: ", "")
        raise ValueError(f"{flag} {text!r}: {message}") from None
