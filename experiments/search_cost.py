"""What finding the largest micro-batch costs: our model-guided search versus the usual recipes.

For four models (MLP, CNN, ResNetTiny, a small GPT) and three memory limits each, compares
the search algorithms below. A limit is set by a fraction ``f`` (0.2, 0.45, 0.8) of the
micro-step's estimated peak bytes: by default of the part that grows with the size,
``base + f * (peak(T) - base)``, ``base`` the larger of ``peak(1)`` and the optimizer
step's need (``--of span``; the largest fitting size is then roughly ``f * T``); or of
the whole peak at the target batch size ``T``, ``f * peak(T)`` (``--of peak``; for a
small model whose parameters and optimizer state dominate its peak, a low ``f`` leaves
room for nothing, not even the optimizer step). It compares:

* ``ours``: ``ja.AdaptiveTrainer(micro_batch_size="auto", memory_limit=limit).init(...)``,
  its chosen size, ``trainer.compiles`` and the seconds its ``search_log`` records, with
  ``--workers`` sizes compiled side by side per round (``JAX_ADAPTIVE_COMPILE_WORKERS``);
  ``ours_serial`` the same one size at a time (``JAX_ADAPTIVE_COMPILE_WORKERS=1``, the
  search before rounds). For both, ``wall_over_one_compile``: the wall seconds of
  ``init`` (the search, traces and compiles) over one compile of the chosen size (the
  probe's measured seconds for it: what a job that knew the size would pay);
* ``halving`` (Composer auto-microbatching, toma): start at ``T``, halve until it fits;
* ``accelerate`` (``find_executable_batch_size``): start at ``T``, ``int(0.9 * s)`` until
  it fits;
* ``pl_power`` (Lightning's batch-size finder, ``mode="power"``): start at ``init_val``
  (Lightning's default 2), double while it fits, keep the last size that fitted;
* ``pl_binsearch`` (``mode="binsearch"``): double until a failure, then bisect between the
  last good and first bad size until ``(bad - good) / good <= margin`` (5%) or they meet;
* ``exact``: the largest fitting size, by plain bisection on the same monotone oracle
  (the reference; ``ours`` must equal it). A linear scan would need ``max + 1`` compiles.

The baselines' oracle is "compile size ``s`` and test its ledger total ``<= limit``", the
trainer's own test. To keep the run short, each model's sizes are compiled once, in a
probe trainer, and the estimate and the measured seconds (trace + compile + estimate) of
each size are shared; every algorithm is still charged separately: its compiles are the
distinct sizes it asked, its seconds the sum of those sizes' measured seconds (as if it
had its own fresh cache). ``ours`` runs for real, in a fresh trainer per limit.

Per zoo case, ``first_updates``: a fresh trainer's first update (``init`` and one step on
a target batch) with the search first (``search_first``), with the plan from a plan
cache (``known_plan``: it compiles the size found and the update's programs alone), and
with ``background_search=True`` (``background``: it waits for one size, an eighth of the
target), one size compiled at a time; ``over_known_plan`` is each over ``known_plan``,
and every plan is the exact largest (asserted).

Then Flax's NNX MNIST step (examples/nnx_mnist.py, converted as its docstring shows;
``nnx_cases``), at batch 512 under a limit per fraction of its span: the seconds of its
first update, the search included (``ours_serial``, ``ours``), against a run that takes
the same plan from a plan cache (``known_plan``: it compiles the size found and the
update alone; ``wall_over_one_compile`` is the ratio of the two) and the step as written
under ``nnx.jit`` at the whole batch; the second calls' seconds beside them; the size
found against the bisection of a probe's ledgers.

    python experiments/search_cost.py          # writes experiments/results/search_cost.{json,png}
    python experiments/search_cost.py --quick  # smaller target batches, for a smoke test
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import load_example, pyplot, save_figure, write_result
from flax import nnx

import jax_adaptive as ja
from jax_adaptive.data import synthetic_images
from jax_adaptive.models import CNN, GPT, MLP, ResNetTiny, gpt_token_loss, linen_classifier_loss
from jax_adaptive.step import make_optimizer_step

ALGORITHMS = ("ours", "ours_serial", "halving", "accelerate", "pl_power", "pl_binsearch", "exact")


@dataclass
class Setup:
    """A model ready for `ja.AdaptiveTrainer`: its loss, parameters and an example batch."""

    name: str
    target: int
    loss_fn: Callable[..., Any]
    params: Any
    example: dict[str, np.ndarray]
    has_aux: bool
    has_state: bool = False
    model_state: Any = ()


def build(name: str, target: int) -> Setup:
    images = {k: np.asarray(v) for k, v in synthetic_images(2).items()}
    if name == "MLP":
        model = MLP(features=(256, 256), num_classes=10)
        params = model.init(jax.random.key(0), jnp.asarray(images["image"]))["params"]
        return Setup(name, target, linen_classifier_loss(model), params, images, True)
    if name == "CNN":
        model = CNN(num_classes=10)
        params = model.init(jax.random.key(0), jnp.asarray(images["image"]))["params"]
        return Setup(name, target, linen_classifier_loss(model), params, images, True)
    if name == "ResNetTiny":
        model = ResNetTiny()
        variables = model.init(jax.random.key(0), jnp.asarray(images["image"]))
        loss_fn = linen_classifier_loss(model, mutable=("batch_stats",))
        state = {"batch_stats": variables["batch_stats"]}
        return Setup(name, target, loss_fn, variables["params"], images, True, True, state)
    if name == "GPT":
        model = GPT(vocab_size=512, max_len=64, width=64, depth=2, heads=4)
        tokens = {"tokens": np.ones((2, 64), np.int32)}
        params = model.init(jax.random.key(0), jnp.asarray(tokens["tokens"]))["params"]
        return Setup(name, target, gpt_token_loss(model), params, tokens, False)
    raise ValueError(f"unknown model {name!r}")


def trainer_for(
    setup: Setup, limit: int | None, objective: str = "max", **options: Any
) -> ja.AdaptiveTrainer:
    """A trainer for the setup; ``objective="max"``: the search's answer is the plan.

    Without the plan cache unless ``options`` give one: a plan a former run stored would
    come without a search (no compiles to count, ``plan_info.largest`` unknown).
    """
    return ja.AdaptiveTrainer(  # type: ignore[misc]
        setup.loss_fn,
        optax.adam(1e-3),
        target_batch_size=setup.target,
        micro_batch_size="auto",
        memory_limit=limit,
        has_aux=setup.has_aux,
        has_state=setup.has_state,
        objective=objective,
        **{"plan_cache": False, **options},
    )


class SharedCompiles:
    """Each size compiled once for a model: its estimated peak and what compiling it cost."""

    def __init__(self, setup: Setup):
        # No limit on a CPU: the search tries T first, it fits, and the log times it.
        self.trainer = trainer_for(setup, None)
        state = self.trainer.init(setup.params, setup.example, model_state=setup.model_state)
        first = self.trainer.search_log[0]
        self.cost: dict[int, tuple[int, float]] = {
            first.size: (first.estimated_bytes, first.seconds)
        }
        # The trainer's optimizer step, updating the state in place (what it falls back to
        # when the state twice does not fit): a limit below its need leaves no size.
        totals = {"loss": np.float32(0), **({"accuracy": np.float32(0)} if setup.has_aux else {})}
        step = make_optimizer_step(optax.adam(1e-3), setup.target)
        step = jax.jit(step, donate_argnums=(0, 1))
        compiled = step.lower(state.params, state.opt_state, totals, np.int32(1)).compile()
        self.optimizer_step_bytes = ja.estimate_peak_bytes(compiled)

    def measure(self, size: int) -> tuple[int, float]:
        """The size's peak bytes (its ledger, what the trainer plans by) and compile seconds."""
        if size not in self.cost:
            start = time.perf_counter()
            peak = self.trainer.ledger(size).total
            self.cost[size] = (peak, time.perf_counter() - start)
        return self.cost[size]


class ChargedOracle:
    """One algorithm's view of the oracle: it pays for each distinct size it asks."""

    def __init__(self, shared: SharedCompiles, limit: int):
        self.shared, self.limit = shared, limit
        self.asked: dict[int, bool] = {}  # in the order first asked

    def __call__(self, size: int) -> bool:
        """Whether the size's micro-step fits the limit."""
        if size not in self.asked:
            self.asked[size] = self.shared.measure(size)[0] <= self.limit
        return self.asked[size]

    @property
    def seconds(self) -> float:
        """The measured compile seconds of the distinct sizes asked."""
        return sum(self.shared.cost[s][1] for s in self.asked)


def halving(fits: Callable[[int], bool], target: int) -> int | None:
    size = target
    while size >= 1 and not fits(size):
        size //= 2
    return size or None


def accelerate(fits: Callable[[int], bool], target: int) -> int | None:
    size = target
    while size >= 1 and not fits(size):
        size = int(size * 0.9)
    return size or None


def pl_power(
    fits: Callable[[int], bool], target: int, init: int, max_trials: int = 25
) -> int | None:
    """Lightning's ``_run_power_scaling``: double while it fits, keep the last that fit.

    A failure before any success halves the size; the first failure after a success (or
    a size that cannot grow past ``target``) stops.
    """
    size, last_good = min(init, target), None
    for _ in range(max_trials):
        if fits(size):
            last_good = size
            if size >= target:
                break
            size = min(2 * size, target)
        else:
            if last_good is not None or size == 1:
                break
            size //= 2
    return last_good


def pl_binsearch(
    fits: Callable[[int], bool], target: int, init: int, margin: float, max_trials: int = 25
) -> int | None:
    """Lightning's ``_run_binary_scaling``: double until a failure, then bisect.

    Bisection stops once the bracket is within ``margin`` of the last good size, or the
    sizes are one apart.
    """
    size, good, bad = min(init, target), None, None
    for _ in range(max_trials):
        if fits(size):
            good = size
            if bad is None:
                if size >= target:
                    break
                size = min(2 * size, target)
                continue
        else:
            bad = size
        low = good or 0
        if bad - low <= 1 or (good and (bad - good) / good <= margin):
            break
        size = (low + bad) // 2
    return good


def exact(fits: Callable[[int], bool], target: int) -> int | None:
    try:
        return ja.search_max_size(fits, lo=1, hi=target).size
    except ja.NothingFitsError:
        return None


def run_ours(setup: Setup, limit: int, shared: SharedCompiles, workers: int) -> dict[str, Any]:
    os.environ["JAX_ADAPTIVE_COMPILE_WORKERS"] = str(workers)  # read as the trainer is made
    trainer = trainer_for(setup, limit)
    start = time.perf_counter()
    error = None
    try:
        trainer.init(setup.params, setup.example, model_state=setup.model_state)
        size = trainer.micro_batch_size
    except ja.NothingFitsError as exc:
        size, error = None, str(exc)
    wall = time.perf_counter() - start
    trials = [t for t in trainer.search_log if t.reason == "init"]
    # The baselines' oracle and ours must agree on every size both compiled.
    mismatched = [
        t.size
        for t in trials
        if t.size in shared.cost and t.estimated_bytes != shared.cost[t.size][0]
    ]
    one_compile = shared.measure(size)[1] if size is not None else None
    return {
        "size": size,
        "workers": workers,
        "compiles": trainer.compiles,
        "seconds": sum(t.seconds for t in trials),
        "init_seconds": wall,
        "one_compile_seconds": one_compile,
        "wall_over_one_compile": None if one_compile is None else wall / one_compile,
        "sizes_tried": [t.size for t in trials],
        "estimate_mismatches": mismatched,
        "error": error,
    }


def first_update(
    setup: Setup, limit: int, cache: Path | bool, background: bool = False
) -> dict[str, Any]:
    """A fresh trainer's first update under ``limit``: ``init`` and one step, in seconds.

    ``cache``: the plan cache's file (a second run with it knows the plan: no search) or
    False. ``background``: ``background_search``; ``first_size`` is the size the update
    ran, ``size`` the plan once the search has ended.
    """
    os.environ["JAX_ADAPTIVE_COMPILE_WORKERS"] = "1"  # the default: one size at a time
    trainer = trainer_for(setup, limit, plan_cache=cache, background_search=background)
    batch = jax.tree.map(lambda x: np.repeat(x[:1], setup.target, axis=0), setup.example)
    start = time.perf_counter()
    state = trainer.init(setup.params, setup.example, model_state=setup.model_state)
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    trainer.finish_search()  # background: the rest of the search, beside no training here
    return {
        "first_update_seconds": seconds,
        "first_size": int(metrics["micro_batch_size"]),
        "search_left_seconds": time.perf_counter() - start,
        "size": trainer.micro_batch_size,
        "compiles": trainer.compiles,
        "sizes_tried": [t.size for t in trainer.search_log],
    }


def first_updates(setup: Setup, limit: int, best: int) -> dict[str, dict[str, Any]]:
    """The first update with the search first, with the plan known, with it in the background.

    ``over_known_plan``: the first update's seconds over those of the run that took the
    plan from the plan cache (it compiles the size found and the update's programs).
    """
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "plans.json"
        ways = {"search_first": first_update(setup, limit, cache)}
        ways["known_plan"] = first_update(setup, limit, cache)
    ways["background"] = first_update(setup, limit, False, background=True)
    assert {r["size"] for r in ways.values()} == {best}, (setup.name, ways, best)
    for r in ways.values():
        r["over_known_plan"] = (
            r["first_update_seconds"] / ways["known_plan"]["first_update_seconds"]
        )
    return ways


def run_case(
    setup: Setup, fraction: float, shared: SharedCompiles, args: argparse.Namespace
) -> dict[str, Any]:
    peak = shared.measure(setup.target)[0]
    floor = max(shared.measure(1)[0], shared.optimizer_step_bytes)
    # "span": the fraction of the way from the peak at 1 to the peak at T (the part that
    # grows with the size); "peak": the fraction of the peak at T itself.
    limit = int(floor + fraction * (peak - floor)) if args.of == "span" else int(fraction * peak)
    results: dict[str, dict[str, Any]] = {}
    baselines: dict[str, Callable[[Callable[[int], bool]], int | None]] = {
        "halving": lambda f: halving(f, setup.target),
        "accelerate": lambda f: accelerate(f, setup.target),
        "pl_power": lambda f: pl_power(f, setup.target, args.lightning_init),
        "pl_binsearch": lambda f: pl_binsearch(
            f, setup.target, args.lightning_init, args.bin_margin
        ),
        "exact": lambda f: exact(f, setup.target),
    }
    results["ours_serial"] = run_ours(setup, limit, shared, 1)
    results["ours"] = run_ours(setup, limit, shared, args.workers)
    for name, algorithm in baselines.items():
        oracle = ChargedOracle(shared, limit)
        size = algorithm(oracle)
        results[name] = {
            "size": size,
            "compiles": len(oracle.asked),
            "seconds": oracle.seconds,
            "sizes_tried": list(oracle.asked),
        }
    best = results["exact"]["size"]
    ours = results["ours"]
    assert results["ours_serial"]["size"] == ours["size"], results
    # The trainer also needs its optimizer step (params and optimizer state, updated in
    # place when twice does not fit) within the limit; the baselines' oracle looks at
    # the micro-step alone. Where the optimizer step does not fit, no size does.
    optimizer_step_too_big = ours["error"] is not None and "optimizer step" in ours["error"]
    if optimizer_step_too_big:
        best = None
    assert ours["size"] == best, (setup.name, fraction, ours, best)
    for r in results.values():
        r["found_over_max"] = None if not best or r["size"] is None else r["size"] / best
    return {
        "model": setup.name,
        "target_batch_size": setup.target,
        "fraction": fraction,
        "limit_of": args.of,
        "peak_bytes_at_target": peak,
        "peak_bytes_at_1": shared.measure(1)[0],
        "optimizer_step_bytes": shared.optimizer_step_bytes,
        "memory_limit": limit,
        "max_fitting_size": best,
        "optimizer_step_does_not_fit": optimizer_step_too_big,
        "linear_scan_compiles": None if best is None else min(best + 1, setup.target),
        "results": results,
        "first_updates": None if best is None else first_updates(setup, limit, best),
    }


def nnx_objects(mnist: Any) -> tuple[Any, ...]:
    """The NNX example's model, optimizer, metrics and rngs, as its ``main`` makes them."""
    model = mnist.CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    model.train()
    return model, optimizer, metrics, nnx.Rngs(0)


def nnx_plain_calls(mnist: Any, batch: dict[str, np.ndarray]) -> list[float]:
    """The first and second calls' seconds of the example's step as written, ``nnx.jit``."""

    @nnx.jit
    def train_step(model, optimizer, metrics, batch, rngs):
        grad_fn = nnx.value_and_grad(mnist.loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch, rngs)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    return timed_calls(train_step, nnx_objects(mnist), batch)


def timed_calls(step: Callable[..., Any], objects: tuple[Any, ...], batch: Any) -> list[float]:
    """The seconds of ``step``'s first call (compiles included) and of its second."""
    model, optimizer, metrics, rngs = objects
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        step(model, optimizer, metrics, batch, rngs)
        jax.block_until_ready(nnx.state(model))
        seconds.append(time.perf_counter() - start)
    return seconds


def nnx_first_update(
    mnist: Any, batch: dict[str, np.ndarray], limit: int, workers: int, cache: Path | bool,
    background: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The converted step's first update under ``limit``: its seconds, compiles and plan.

    ``cache``: the plan cache's file (a second run with it knows the plan: no search) or
    False. ``background``: ``background_search``; the calls' sizes are the first fit's,
    ``size`` the plan's once the search has ended.
    """
    os.environ["JAX_ADAPTIVE_COMPILE_WORKERS"] = str(workers)  # read as the step is made
    step = ja.AdaptiveNnxStep(
        mnist.train_step.step_fn, memory_limit=limit, objective="max", plan_cache=cache,
        background_search=background,
    )  # fmt: skip
    first, second = timed_calls(step, nnx_objects(mnist), batch)
    first_size = step.micro_batch_size
    start = time.perf_counter()
    step.step.finish_search()  # background: the rest of the search, beside no training here
    return {
        "first_size": first_size,
        "search_left_seconds": time.perf_counter() - start,
        "size": step.micro_batch_size,
        "workers": workers,
        "compiles": step.step.compiles,
        "sizes_tried": [t.size for t in step.search_log],
        "first_update_seconds": first,
        "second_update_seconds": second,
        "plan": str(step.plan_info),
    }


def largest_by_bisection(step: ja.AdaptiveStep, limit: int, T: int) -> int | None:
    """The largest multiple of the step's ``multiple_of`` whose ledger fits: the reference."""
    m = step.multiple_of
    lo, hi = 0, T // m  # in multiples of m; lo fits (0: nothing does)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step.ledger(mid * m).total <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo * m or None


def nnx_cases(mnist: Any, T: int, fractions: list[float], workers: int) -> list[dict[str, Any]]:
    """Flax's NNX MNIST step at batch ``T``, a limit per fraction of its span (as the zoo's).

    Per limit: the first update's seconds and compiles, ours against the plain ``nnx.jit``
    step, and the size found against the bisection of a probe's ledgers (no limit, each
    size compiled once).
    """
    batch = next(mnist.random_batches(1, T))
    probe = ja.AdaptiveNnxStep(mnist.train_step.step_fn, objective="max", plan_cache=False)
    probe(*nnx_objects(mnist)[:3], batch, nnx.Rngs(0))  # plans the whole batch: no limit
    m = probe.step.multiple_of
    floor, peak = probe.step.ledger(m).total, probe.step.ledger(T).total
    cases = []
    for fraction in fractions:
        limit = int(floor + fraction * (peak - floor))
        plain = nnx_plain_calls(mnist, batch)
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp) / "plans.json"
            results = {"ours_serial": nnx_first_update(mnist, batch, limit, 1, cache)}
            known = nnx_first_update(mnist, batch, limit, 1, cache)  # the plan from the cache
        results["ours"] = nnx_first_update(mnist, batch, limit, workers, False)
        results["ours_background"] = nnx_first_update(mnist, batch, limit, 1, False, True)
        exact_size = largest_by_bisection(probe.step, limit, T)
        sizes = {r["size"] for r in (*results.values(), known)}
        assert sizes == {exact_size}, (results, known, exact_size)
        for r in results.values():
            r["wall_over_one_compile"] = r["first_update_seconds"] / known["first_update_seconds"]
        cases.append(
            {
                "model": "NNX MNIST step",
                "target_batch_size": T,
                "fraction": fraction,
                "memory_limit": limit,
                "max_fitting_size": exact_size,
                "multiple_of": m,
                "plain_first_update_seconds": plain[0],
                "plain_second_update_seconds": plain[1],
                "known_plan": known,
                "results": results,
            }
        )
        print_nnx(cases[-1:])
    return cases


def print_tables(cases: list[dict[str, Any]]) -> None:
    rows = [(f"{c['model']} {c['fraction']:.2f}", c) for c in cases]
    head = f"{'model  limit':<17}{'max':>6} " + "".join(f"{a:>13}" for a in ALGORITHMS)
    for title, cell in (
        ("found size (compiles)", lambda r: f"{r['size']} ({r['compiles']})"),
        (
            "found / max",
            lambda r: "-" if r["found_over_max"] is None else f"{r['found_over_max']:.3f}",
        ),
        ("search seconds", lambda r: f"{r['seconds']:.2f}"),
    ):
        print(f"\n{title}\n{head}")
        for label, c in rows:
            cells = "".join(f"{cell(c['results'][a]):>13}" for a in ALGORITHMS)
            print(f"{label:<17}{c['max_fitting_size']!s:>6} {cells}")
    print("\nsearch wall seconds / one compile of the chosen size (init, traces included)")
    print(f"{'model  limit':<17}{'serial':>10}{'rounds':>10}")
    for label, c in rows:
        cells = [c["results"][a]["wall_over_one_compile"] for a in ("ours_serial", "ours")]
        print(f"{label:<17}" + "".join("-".rjust(10) if v is None else f"{v:10.2f}" for v in cells))
    print("\nthe first update (init and one step) / the same with the plan known (plan cache)")
    print(f"{'model  limit':<17}{'known s':>9}{'search first':>14}{'background':>12}{'at':>6}")
    for label, c in rows:
        if (f := c["first_updates"]) is not None:
            print(f"{label:<17}{f['known_plan']['first_update_seconds']:9.2f}"
                  f"{f['search_first']['over_known_plan']:14.2f}"
                  f"{f['background']['over_known_plan']:12.2f}"
                  f"{f['background']['first_size']:6d}")  # fmt: skip
    totals = {a: sum(c["results"][a]["compiles"] for c in cases) for a in ALGORITHMS}
    seconds = {a: sum(c["results"][a]["seconds"] for c in cases) for a in ALGORITHMS}
    print("\ntotal compiles:", totals)
    print("total seconds: ", {a: round(s, 1) for a, s in seconds.items()})


NNX_WAYS = ("ours_serial", "ours", "ours_background")  # one at a time, in rounds, beside


def print_nnx(cases: list[dict[str, Any]]) -> None:
    """The NNX step's first update: ours (serial, rounds), the plan known, plain ``nnx.jit``.

    ``wall_over_one_compile`` here: the first update's seconds over those of a run that
    took the plan from the plan cache (it compiles the size found, and the update, alone).
    """
    for c in cases:
        r = c["results"]
        print(
            f"NNX MNIST step T={c['target_batch_size']} f={c['fraction']:.2f} "
            f"({c['memory_limit'] / 2**20:.1f} MiB): max "
            f"{c['max_fitting_size']}; plain nnx.jit {c['plain_first_update_seconds']:.1f} s; "
            f"plan known {c['known_plan']['first_update_seconds']:.1f} s; second calls "
            f"{c['plain_second_update_seconds']:.2f} s plain, "
            f"{c['known_plan']['second_update_seconds']:.2f} s ours; "
            + "; ".join(
                f"{a} {r[a]['first_update_seconds']:.1f} s at {r[a]['first_size']}, "
                f"{r[a]['compiles']} compiles ({r[a]['wall_over_one_compile']:.1f}x)"
                for a in NNX_WAYS
            )
        )


def median_ratio(
    cases: list[dict[str, Any]], ways: tuple[str, ...] = ("ours_serial", "ours")
) -> dict[str, float | None]:
    """The median search wall / one compile over ``cases``, serial and in rounds."""
    out: dict[str, float | None] = {}
    for a in ways:
        ratios = [r for c in cases if (r := c["results"][a]["wall_over_one_compile"])]
        out[a] = float(np.median(ratios)) if ratios else None
    return out


def median_first_update(cases: list[dict[str, Any]]) -> dict[str, float | None]:
    """The zoo's median first update over the plan known: search first, in the background."""
    out: dict[str, float | None] = {}
    for way in ("search_first", "background"):
        ratios = [c["first_updates"][way]["over_known_plan"] for c in cases if c["first_updates"]]
        out[way] = float(np.median(ratios)) if ratios else None
    return out


def plot(cases: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{c['model']}\n{c['fraction']:.2f}" for c in cases]
    x = np.arange(len(cases))
    width = 0.8 / len(ALGORITHMS)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(10, 1.1 * len(cases)), 8), sharex=True)
    for i, name in enumerate(ALGORITHMS):
        offset = x + (i - (len(ALGORITHMS) - 1) / 2) * width
        compiles = [c["results"][name]["compiles"] for c in cases]
        ratio = [c["results"][name]["found_over_max"] or 0.0 for c in cases]
        top.bar(offset, compiles, width, label=name)
        bottom.bar(offset, ratio, width, label=name)
    top.set_ylabel("micro-step compiles")
    top.set_title(f"Search cost per model x memory limit (fraction of the {cases[0]['limit_of']})")
    top.legend(ncol=len(ALGORITHMS), fontsize="small")
    bottom.set_ylabel("found size / largest fitting size")
    bottom.set_ylim(0, 1.05)
    bottom.axhline(1.0, color="k", lw=0.5)
    bottom.set_xticks(x, labels, fontsize="small")
    save_figure(fig, path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["MLP", "CNN", "ResNetTiny", "GPT"])
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.2, 0.45, 0.8])
    parser.add_argument(
        "--of",
        choices=["span", "peak"],
        default="span",
        help="limit = base + f * (peak(T) - base), base = max(peak(1), optimizer step) (span), "
        "or f * peak(T) (peak)",
    )
    parser.add_argument("--target-small", type=int, default=4096, help="T for MLP and CNN")
    parser.add_argument("--target-resnet", type=int, default=128, help="T for ResNetTiny")
    parser.add_argument("--target-gpt", type=int, default=256, help="T for GPT")
    parser.add_argument("--nnx-batch", type=int, default=512, help="the NNX MNIST step's batch")
    parser.add_argument(
        "--no-nnx", dest="nnx", action="store_false", help="skip the NNX MNIST step"
    )
    parser.add_argument("--lightning-init", type=int, default=2, help="Lightning's init_val")
    parser.add_argument("--bin-margin", type=float, default=0.05, help="binsearch stop margin")
    parser.add_argument("--workers", type=int, default=2, help="sizes compiled side by side")
    parser.add_argument("--quick", action="store_true", help="T of 512/512/32/32: a smoke test")
    parser.add_argument("--out", default="experiments/results/search_cost.json")
    args = parser.parse_args()
    targets = {
        "MLP": args.target_small,
        "CNN": args.target_small,
        "ResNetTiny": args.target_resnet,
        "GPT": args.target_gpt,
    }
    if args.quick:
        targets = {"MLP": 512, "CNN": 512, "ResNetTiny": 32, "GPT": 32}
        args.nnx_batch = 128

    start = time.perf_counter()
    cases = []
    for name in args.models:
        setup = build(name, targets[name])
        shared = SharedCompiles(setup)
        for fraction in args.fractions:
            case = run_case(setup, fraction, shared, args)
            cases.append(case)
            r = case["results"]
            print(
                f"{name} T={setup.target} limit f={fraction:.2f} of {args.of} "
                f"({case['memory_limit'] / 2**20:.1f} MiB): max={case['max_fitting_size']} "
                f"ours={r['ours']['size']} in {r['ours']['compiles']} compiles",
                flush=True,
            )
        print(f"  {name}: {len(shared.cost)} distinct sizes compiled in all", flush=True)
    if cases:
        print_tables(cases)
    mnist = load_example("nnx_mnist") if args.nnx else None
    nnx_results = (
        [] if mnist is None else nnx_cases(mnist, args.nnx_batch, args.fractions, args.workers)
    )
    result = {
        "description": __doc__.splitlines()[0],
        "algorithms": ALGORITHMS,
        "lightning_init_val": args.lightning_init,
        "binsearch_margin": args.bin_margin,
        "quick": args.quick,
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
        "median_wall_over_one_compile": median_ratio(cases),
        "nnx_median_wall_over_one_compile": median_ratio(nnx_results, NNX_WAYS),
        "median_first_update_over_known_plan": median_first_update(cases),
        "cases": cases,
        "nnx_cases": nnx_results,
        "total_seconds": time.perf_counter() - start,
    }
    out = write_result(args.out, result)
    if cases:
        plot(cases, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
