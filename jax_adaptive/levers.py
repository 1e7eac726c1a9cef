"""`AdaptiveTrainer`'s levers: one loss's programs, plan and update per remat policy.

Without `jax_adaptive.RematChoices` there is one lever (under None); with them, `Levers.plan`
plans every policy through `jax_adaptive.remat.plan_policies` and keeps the chosen one's
programs, releasing the others'.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

from jax_adaptive.executables import Executables
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.planner import Planner
from jax_adaptive.remat import RematChoice, plan_policies
from jax_adaptive.step import Batch, TrainState
from jax_adaptive.update import Updater

__all__ = ["Lever", "Levers"]

log = logging.getLogger("jax_adaptive")


class Lever(NamedTuple):
    """One loss's (one remat policy's) compiled programs, plan and update."""

    executables: Executables
    planner: Planner
    updater: Updater


class Levers:
    """Each remat policy's `Lever`, and the one in use (the first until a plan chooses).

    Args:
        levers: by policy name, the least rematerialised first (one, under None, when
            the trainer was given a single loss).
    """

    def __init__(self, levers: Mapping[str | None, Lever]):
        self._levers = dict(levers)
        self.in_use: Lever = next(iter(self._levers.values()))
        self.choice: RematChoice | None = None  # None: one loss, no choice

    def plan(
        self, state: TrainState, example_batch: Batch, T: int, cache: PlanCache | None
    ) -> Lever:
        """Plans ``T`` examples per update for ``example_batch``'s shapes: the lever to run.

        Shapes already planned keep their plan (nothing compiles); new shapes are planned
        for every policy, and the chosen one's lever runs from now on. Raises
        `jax_adaptive.NothingFitsError` when no policy fits.
        """
        fresh = [lever.executables.bind(state, example_batch) for lever in self._levers.values()]
        if not any(fresh) and self.in_use.planner.size is not None:
            self.in_use.planner.set_target(T)  # the shapes it is planned for: the plan holds
        elif len(self._levers) == 1:
            self.in_use.planner.plan_for(state, T)
        else:
            self._choose(state, T, cache)
        return self.in_use

    def _choose(self, state: TrainState, T: int, cache: PlanCache | None) -> None:
        """Plans every policy (`jax_adaptive.remat.plan_policies`) and keeps the chosen."""
        levers = self._levers
        self.choice = plan_policies(
            lambda name: levers[name].planner.plan_for(state, T), list(levers), T, cache=cache,
            keys=lambda: [lever.executables.program.key() for lever in levers.values()],
            log=log.info, seconds=self._timed_seconds,
        )  # fmt: skip
        self.in_use = levers[self.choice.policy]
        for lever in levers.values():
            if lever is not self.in_use:
                lever.executables.release(keep=())  # the programs of the policies not chosen

    def _timed_seconds(self, policy: Any) -> float | None:
        """A policy's time per update at its plan (``objective="throughput"``), or None."""
        timed = self._levers[policy].planner.program.timed
        return None if timed is None else timed.chosen_seconds
