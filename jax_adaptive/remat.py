"""Rematerialisation as a second lever: a plan over (remat policy, micro-batch size).

A model that can run its layers under several ``jax.checkpoint`` policies offers them as
a `RematChoices` (a mapping of names to losses, or `RematChoices.from_factory`). The
planner then finds the largest micro-batch of each policy through the one sizing engine
and takes, by `choose_policy`'s rule, the fewest micro-steps per update, the least
rematerialised policy on a tie: remat costs a recompute of the forward pass, so it is
pulled only when it buys fewer micro-steps, or when nothing fits without it
(docs/memory.md). `plan_policies` runs that plan for any client and remembers the choice
in the plan cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import jax

from jax_adaptive.errors import NothingFitsError
from jax_adaptive.plan_cache import PlanCache, plan_key
from jax_adaptive.timing import KEEP_DEFAULT

__all__ = [
    "DEFAULT_POLICIES",
    "RematChoice",
    "RematChoices",
    "RematPolicy",
    "choose_policy",
    "fastest_policy",
    "maybe_checkpoint",
    "plan_policies",
]

T = TypeVar("T")
RematPolicy = Callable[..., bool] | None
"""A ``jax.checkpoint_policies`` policy, or None for no rematerialisation at all."""

DEFAULT_POLICIES: Mapping[str, RematPolicy] = {
    "none": None,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}
"""From the least rematerialised to the most: none, keep the weights' matmuls, keep nothing."""


def maybe_checkpoint(fn: Callable[..., Any], policy: RematPolicy) -> Callable[..., Any]:
    """``fn`` under ``jax.checkpoint(policy=policy)``, or ``fn`` itself when ``policy`` is None.

    None means no rematerialisation here, unlike ``jax.checkpoint(policy=None)``, which
    saves nothing (`DEFAULT_POLICIES` names that ``nothing_saveable``). Wrap the body a
    ``lax.scan`` runs per layer: that is where XLA can drop what the policy does not save.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> layer = lambda x, w: (jnp.tanh(x @ w), None)
        >>> maybe_checkpoint(layer, None) is layer
        True
        >>> body = maybe_checkpoint(layer, jax.checkpoint_policies.nothing_saveable)
        >>> jax.lax.scan(body, jnp.ones(3), jnp.zeros((4, 3, 3)))[0].tolist()
        [0.0, 0.0, 0.0]
    """
    return fn if policy is None else jax.checkpoint(fn, policy=policy)


class RematChoices(Mapping[str, T], Generic[T]):
    """The ways one model can run, by name, from the least rematerialised to the most.

    Each value is what the entry point takes (for `jax_adaptive.AdaptiveTrainer`, a
    per-example loss); the first is preferred when it needs no more micro-steps.

    Args:
        choices: the named ways, in that order (at least one).

    Examples:
        >>> choices = RematChoices({"none": "plain loss", "full": "checkpointed loss"})
        >>> choices.least, list(choices)
        ('none', ['none', 'full'])
    """

    def __init__(self, choices: Mapping[str, T]):
        if not choices:
            raise ValueError("RematChoices needs at least one choice.")
        for name in choices:
            if not isinstance(name, str):
                raise TypeError(f"remat choices are named by strings, got {name!r}.")
        self._choices = dict(choices)

    def __getitem__(self, name: str) -> T:
        return self._choices[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._choices)

    def __len__(self) -> int:
        return len(self._choices)

    def __repr__(self) -> str:
        return f"RematChoices({list(self._choices)})"

    @classmethod
    def from_factory(
        cls, factory: Callable[[RematPolicy], T], policies: Mapping[str, RematPolicy] | None = None
    ) -> RematChoices[T]:
        """``factory(policy)`` for each named policy (`DEFAULT_POLICIES` by default).

        Args:
            factory: builds the loss (or step, or model) that runs its layers under
                ``policy``, None meaning no remat (`maybe_checkpoint` does exactly that).
            policies: names to policies, the least rematerialised first.

        Examples:
            >>> import jax, jax.numpy as jnp
            >>> def make_loss(policy):
            ...     body = maybe_checkpoint(lambda x, w: (jnp.tanh(x @ w), None), policy)
            ...     return lambda params, batch, rng: jax.lax.scan(body, batch, params)[0].sum(1)
            >>> list(RematChoices.from_factory(make_loss))
            ['none', 'dots_with_no_batch_dims_saveable', 'nothing_saveable']
        """
        policies = DEFAULT_POLICIES if policies is None else policies
        return cls({name: factory(policy) for name, policy in policies.items()})

    @property
    def least(self) -> str:
        """The least rematerialised choice's name (the first)."""
        return next(iter(self._choices))


def choices_of(value: Any, name: str) -> Mapping[str | None, Callable[..., Any]]:
    """An entry point's callable(s) by remat policy: a `RematChoices`, or one under None.

    Raises ``TypeError`` naming the argument when a choice is not callable.

    Examples:
        >>> list(choices_of(print, "loss_fn")), list(choices_of(RematChoices({"a": print}), "f"))
        ([None], ['a'])
    """
    choices = value if isinstance(value, RematChoices) else {None: value}
    for fn in choices.values():
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {fn!r}.")
    return choices


class RematChoice(NamedTuple):
    """The policy a plan runs, and why.

    Attributes:
        policy: the chosen policy's name.
        sizes: ``(name, size)`` of each policy planned, in order: the micro-batch size
            it would run, None where nothing fits; a policy not planned is absent (one
            that could not beat a plan of one micro-step).
        target_batch_size: the examples per update the sizes were planned for.
        source: ``"searched"`` or ``"plan cache"``.

    Examples:
        >>> choice = RematChoice("full", (("none", None), ("full", 16)), 64, "searched")
        >>> print(choice)
        full (micro-batch by policy: none nothing fits, full 16 x 4)
    """

    policy: str
    sizes: tuple[tuple[str, int | None], ...]
    target_batch_size: int
    source: str = "searched"
    seconds: tuple[tuple[str, float], ...] = ()

    def __str__(self) -> str:
        T = self.target_batch_size
        each = ", ".join(
            f"{name} nothing fits" if size is None else f"{name} {size} x {math.ceil(T / size)}"
            for name, size in self.sizes
        )
        timed = ", ".join(f"{name} {s:.3g} s" for name, s in self.seconds)
        timed = timed and f"; timed per update: {timed}"
        return f"{self.policy} (micro-batch by policy: {each}{timed})"


def choose_policy(sizes: Sequence[tuple[str, int | None]], target_batch_size: int) -> str:
    """The rule: the fewest micro-steps per update; on a tie, the earliest (least remat).

    Args:
        sizes: ``(name, micro-batch size or None)``, the least rematerialised first.
        target_batch_size: the examples per update.

    Raises:
        ValueError: when no policy fits (``sizes`` are all None).

    Examples:
        >>> choose_policy([("none", 40), ("full", 64)], 128)  # 4 micro-steps against 2
        'full'
        >>> choose_policy([("none", 43), ("full", 64)], 128)  # 3 against 2
        'full'
        >>> choose_policy([("none", 64), ("full", 100)], 128)  # 2 and 2: no recompute
        'none'
        >>> choose_policy([("none", None), ("full", 8)], 128)  # only remat fits
        'full'
    """
    fitting = [(math.ceil(target_batch_size / s), i, n) for i, (n, s) in enumerate(sizes) if s]
    if not fitting:
        raise ValueError(f"no policy fits: {list(sizes)}.")
    return min(fitting)[2]


def fastest_policy(ruled: str, seconds: Mapping[str, float]) -> str:
    """The policy whose plan's update was timed fastest.

    ``ruled`` (`choose_policy`'s) unless another wins by over
    `jax_adaptive.timing.KEEP_DEFAULT`.

    Examples:
        >>> fastest_policy("full", {"none": 0.30, "full": 0.40})  # fewer steps, but slower
        'none'
        >>> fastest_policy("full", {"none": 0.395, "full": 0.40})  # within 3%: the rule's
        'full'
    """
    best = min(seconds, key=seconds.get)
    return ruled if seconds[ruled] <= seconds[best] * (1 + KEEP_DEFAULT) else best


def plan_policies(
    plan: Callable[[str], int],
    policies: Sequence[str],
    target_batch_size: int,
    *,
    cache: PlanCache | None = None,
    keys: Callable[[], Sequence[str]] | None = None,
    log: Callable[[str], None] | None = None,
    seconds: Callable[[str], float | None] | None = None,
) -> RematChoice:
    """Plans each policy through ``plan`` and chooses one.

    The choice is `choose_policy`'s, or by measured speed where ``seconds`` has every
    fitting policy's (`fastest_policy`).

    Policies are planned in order; once one runs the whole target batch in one
    micro-step no later one is planned (it could only tie and recompute more). With a
    ``cache``, a choice stored for the same policies' keys plans its policy alone (whose
    own plan the client finds in the cache: a second run compiles nothing to choose); a
    new choice is stored.

    Args:
        plan: ``plan(name)`` plans that policy and returns its micro-batch size, or
            raises `jax_adaptive.NothingFitsError` where nothing fits; the client keeps
            each policy's plan and runs the chosen one's.
        policies: the names, the least rematerialised first.
        target_batch_size: the examples per update.
        cache: the plan cache, or None.
        keys: ``() -> [str]``: each policy's plan cache key (its program, the device,
            the limits, what else decides its plan), whose list keys the choice.
        log: called with the choice in words.
        seconds: ``seconds(name)``: the time per update of that policy's plan, measured
            (``objective="throughput"``), or None; when every policy that fits has one,
            the fastest is chosen (`fastest_policy`).

    Returns:
        The `RematChoice`.

    Raises:
        NothingFitsError: when no policy fits, the most rematerialised one's error.

    Examples:
        >>> largest = {"none": 0, "full": 24}  # what fits the device, by policy
        >>> def plan(name):
        ...     if not largest[name]:
        ...         raise NothingFitsError(1, [])
        ...     return largest[name]
        >>> print(plan_policies(plan, ["none", "full"], 64))
        full (micro-batch by policy: none nothing fits, full 24 x 3)
    """
    if not policies:
        raise ValueError("plan_policies needs at least one policy.")
    key = None if cache is None or keys is None else plan_key(remat_choice=list(keys()))
    stored = None if key is None else cache.plan(key, target_batch_size)
    if stored is not None and stored.get("remat_policy") in policies:
        name = stored["remat_policy"]
        plan(name)
        sizes = tuple((n, s) for n, s in stored.get("remat_sizes", [[name, None]]))
        timed = tuple((n, s) for n, s in stored.get("remat_seconds", []))
        choice = RematChoice(name, sizes, target_batch_size, "plan cache", timed)
    else:
        choice = _planned(plan, policies, target_batch_size)
        choice = choice if seconds is None else _timed(choice, seconds)
        if key is not None:
            size = dict(choice.sizes)[choice.policy]
            cache.put(key, {"micro_batch_size": size, "remat_policy": choice.policy,
                            "remat_sizes": [list(pair) for pair in choice.sizes],
                            "remat_seconds": [list(pair) for pair in choice.seconds]})  # fmt: skip
    if log is not None:
        log(f"remat policy {choice}")
    return choice


def _planned(plan: Callable[[str], int], policies: Sequence[str], T: int) -> RematChoice:
    """Plans the policies in order (until one needs one micro-step) and chooses."""
    sizes: list[tuple[str, int | None]] = []
    error: NothingFitsError | None = None
    for name in policies:
        try:
            size = plan(name)
        except NothingFitsError as exc:
            sizes.append((name, None))
            error = exc
            continue
        sizes.append((name, size))
        if size >= T:
            break
    if error is not None and all(size is None for _, size in sizes):
        detail = f"not under any remat policy ({', '.join(policies)}); under {policies[-1]}"
        raise NothingFitsError(
            error.smallest, error.trials, detail=f"{detail}, {error.detail or 'none either'}"
        ) from error
    return RematChoice(choose_policy(sizes, T), tuple(sizes), T)


def _timed(choice: RematChoice, seconds: Callable[[str], float | None]) -> RematChoice:
    """``choice`` by measured speed, when every policy that fits was timed."""
    fitting = [name for name, size in choice.sizes if size is not None]
    timed = {name: seconds(name) for name in fitting}
    if len(timed) < 2 or None in timed.values():
        return choice
    policy = fastest_policy(choice.policy, timed)
    return choice._replace(policy=policy, seconds=tuple(timed.items()))
