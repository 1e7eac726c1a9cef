"""The fastest plan, measured: objective="throughput" against every fixed size, by hand.

Three models, each a user's own jitted step (`ja.micro_batch_grad` and an Adam update,
donating its state) under `ja.AdaptiveStep`, at two simulated device sizes: an MLP at
T = 2048, the zoo's CNN on MNIST-shaped images at T = 256 and a causal language model
with scanned layers at T = 64. Per case:

* the largest micro-batch that fits (a search, ``objective="max"``);
* every fixed size of a grid that fits, timed by hand on the same jitted step in
  interleaved rounds (the median of each): the least-padding size of every step count
  from the fewest to four times as many, every power of two, and the candidates;
* ``objective="throughput"``: an `AdaptiveStep` trains on until its timing calls are done
  (they train too); its choice, what it timed and what the timing cost (seconds, and as
  a share of a 1,000-update run at the chosen plan's speed);
* the ratio of the chosen plan's time per update to the fastest fixed size's (the goal:
  at most 1.03), and the default plan's (``least_padding``) for comparison.

    python experiments/plan_speed.py          # writes experiments/results/plan_speed.{json,png}
    python experiments/plan_speed.py --quick  # one limit per model, fewer rounds
    python experiments/plan_speed.py --replot # the PNG again from the JSON
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import grouped_bars, pyplot, save_figure, write_result
from remat import LM

import jax_adaptive as ja
from jax_adaptive.models.adapters import linen_classifier_loss
from jax_adaptive.models.cnn import CNN
from jax_adaptive.plan import least_padding_size
from jax_adaptive.timing import candidate_sizes

RESULTS = Path(__file__).parent / "results"
OPT = optax.adam(1e-3)


class Case:
    """A model as a user brings it: a per-example loss, its parameters, its batches."""

    def __init__(self, name: str, T: int, loss: Callable[..., Any], params: Any,
                 batch: Callable[[int], Any], has_aux: bool = False):  # fmt: skip
        self.name, self.T, self.loss, self.params, self.batch = name, T, loss, params, batch
        self.has_aux = has_aux

    @functools.cached_property
    def build(self) -> Callable[[int], Any]:
        """``m -> the user's jitted step at micro-batch m`` (one jit per size)."""

        @functools.cache
        def build(m: int) -> Any:
            @functools.partial(jax.jit, donate_argnums=0)
            def train_step(state, batch):
                params, opt_state = state
                grad = ja.micro_batch_grad(self.loss, m, has_aux=self.has_aux)
                out = grad(params, batch, jax.random.key(0))
                updates, opt_state = OPT.update(out.grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), out.loss

            return train_step

        return build

    def state(self) -> Any:
        """A fresh ``(params, opt_state)`` (the steps donate theirs)."""
        params = jax.tree.map(jnp.copy, self.params)
        return params, OPT.init(params)


def mlp_case() -> Case:
    rng = np.random.default_rng(0)
    d, h = 256, 1024
    params = {"w1": jnp.asarray(rng.normal(size=(d, h)) / 16, jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(h, h)) / 32, jnp.float32),
              "w3": jnp.asarray(rng.normal(size=(h,)) / 32, jnp.float32)}  # fmt: skip

    def loss(params, batch, rng=None):
        x = jax.nn.relu(batch["x"] @ params["w1"])
        x = jax.nn.relu(x @ params["w2"])
        return (x @ params["w3"] - batch["y"]) ** 2

    def batch(seed: int) -> Any:
        r = np.random.default_rng(seed)
        return {"x": r.normal(size=(2048, d)).astype(np.float32),
                "y": r.normal(size=2048).astype(np.float32)}  # fmt: skip

    return Case("MLP", 2048, loss, params, batch)


def cnn_case() -> Case:
    model = CNN()
    params = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))["params"]

    def batch(seed: int) -> Any:
        r = np.random.default_rng(seed)
        return {"image": r.normal(size=(256, 28, 28, 1)).astype(np.float32),
                "label": r.integers(0, 10, 256).astype(np.int32)}  # fmt: skip

    return Case("CNN", 256, linen_classifier_loss(model), params, batch, has_aux=True)


def lm_case() -> Case:
    lm = LM(vocab=256, length=64, width=128, hidden=512, layers=4)
    return Case("scanned LM", 64, lm.loss(None), lm.params(jax.random.key(0)),
                lambda seed: lm.batch(64, seed))  # fmt: skip


def limits_for(case: Case, largest: list[int]) -> list[int]:
    """Memory limits under which each of ``largest`` is the largest looped size that fits."""
    probe = ja.AdaptiveStep(case.build, memory_limit=10**12, plan_cache=False)
    probe.plan(case.state(), case.batch(0))
    return [(probe.ledger(m).total + probe.ledger(m + 1).total) // 2 for m in largest]


def grid(T: int, largest: int) -> list[int]:
    """The fixed sizes timed by hand (see the module's docstring)."""
    k = math.ceil(T / largest)
    sizes = {least_padding_size(T, min(largest, math.ceil(T / n))) for n in range(k, 4 * k + 1)}
    sizes |= {2**j for j in range(largest.bit_length()) if 2**j <= largest}
    return sorted(sizes | set(candidate_sizes(T, largest)), reverse=True)


def time_fixed(case: Case, sizes: list[int], rounds: int) -> dict[int, float]:
    """The median seconds per update of each size's step, over interleaved rounds."""
    state, batch = case.state(), case.batch(1)  # a host batch, as the timed calls get
    runs: dict[int, list[float]] = {m: [] for m in sizes}
    for m in sizes:  # compile and warm up
        state, _ = jax.block_until_ready(case.build(m)(state, batch))
    for _ in range(rounds):
        for m in sizes:
            start = time.perf_counter()
            state, _ = jax.block_until_ready(case.build(m)(state, batch))
            runs[m].append(time.perf_counter() - start)
    return {m: statistics.median(t) for m, t in runs.items()}


def chosen_plan(case: Case, limit: int) -> tuple[ja.AdaptiveStep, int]:
    """An `AdaptiveStep` of ``objective="throughput"`` trained until its timing is done."""
    step = ja.AdaptiveStep(case.build, memory_limit=limit, objective="throughput",
                           plan_cache=False)  # fmt: skip
    state, calls = case.state(), 0
    while calls == 0 or "the next calls time" in str(step.plan_info):
        state, _ = step(state, case.batch(calls % 4))
        calls += 1
    return step, calls


def run_case(case: Case, limit: int, rounds: int) -> dict[str, Any]:
    largest = (
        ja.AdaptiveStep(case.build, memory_limit=limit, objective="max", plan_cache=False)
        .plan(case.state(), case.batch(0))
        .micro_batch_size
    )
    start = time.perf_counter()
    step, calls = chosen_plan(case, limit)
    chosen_wall = time.perf_counter() - start
    timed = step.timed
    default = least_padding_size(case.T, largest)
    sizes = sorted(set(grid(case.T, largest)) | {step.micro_batch_size}, reverse=True)
    fixed = time_fixed(case, sizes, rounds)
    fastest = min(fixed, key=fixed.get)
    chosen = step.micro_batch_size
    result = {
        "model": case.name, "T": case.T, "memory_limit": limit, "largest": largest,
        "default": default, "chosen": chosen, "fastest_fixed": fastest,
        "chosen_over_fastest": fixed[chosen] / fixed[fastest],
        "default_over_fastest": fixed[default] / fixed[fastest],
        "seconds_per_update": {str(m): t for m, t in fixed.items()},
        "timed": None if timed is None else [list(p) for p in timed.seconds],
        "timing_calls": calls, "timing_cost_seconds": None if timed is None else timed.cost,
        "timing_cost_share_of_1000_updates": None if timed is None
        else timed.cost / (1000 * fixed[chosen]),
        "wall_until_decided_seconds": chosen_wall,
        "plan": str(step.plan_info),
    }  # fmt: skip
    print(f"{case.name} under {limit:,} bytes: largest {largest}, default {default}, chosen "
          f"{chosen}, fastest fixed {fastest}: chosen/fastest "
          f"{result['chosen_over_fastest']:.3f}, default/fastest "
          f"{result['default_over_fastest']:.3f}; timing cost {result['timing_cost_seconds']}"
          f" s ({calls} calls)")  # fmt: skip
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    cases = result["cases"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    groups = [f"{c['model']}\n{c['memory_limit'] / 1e6:.1f} MB" for c in cases]
    grouped_bars(left, groups, {
        "throughput (chosen)": [c["chosen_over_fastest"] for c in cases],
        "least_padding (default)": [c["default_over_fastest"] for c in cases],
    })  # fmt: skip
    left.tick_params(axis="x", labelsize=8)
    left.axhline(1.03, color="k", ls="--", lw=0.8)
    left.set_ylabel("time per update / fastest fixed size's")
    left.set_title("plan speed against every fixed size timed by hand")
    for c in cases:
        sizes = sorted(int(m) for m in c["seconds_per_update"])
        t = [c["seconds_per_update"][str(m)] / c["seconds_per_update"][str(c["fastest_fixed"])]
             for m in sizes]  # fmt: skip
        line = right.plot(
            sizes, t, marker=".", label=f"{c['model']} {c['memory_limit'] / 1e6:.1f} MB"
        )
        right.plot([c["chosen"]], [c["chosen_over_fastest"]], "o", mfc="none", ms=10,
                   color=line[0].get_color())  # fmt: skip
    right.set_xscale("log")
    right.set_xlabel("micro-batch size (circled: chosen)")
    right.set_ylabel("time per update / fastest")
    right.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replot", action="store_true")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=str(RESULTS / "plan_speed.json"))
    parser.add_argument(
        "--only",
        choices=["MLP", "CNN", "scanned LM"],
        help="run this model's cases alone; keep the others from --out",
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.replot:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return
    logging.basicConfig(level=logging.WARNING)
    shapes = [(mlp_case, [700, 200]), (cnn_case, [100, 24]), (lm_case, [24, 6])]
    kept = json.loads(out.read_text())["cases"] if args.only else []
    cases = [c for c in kept if c["model"] != args.only]
    for make, largest in shapes:
        case = make()
        if args.only not in (None, case.name):
            continue
        largest = largest[:1] if args.quick else largest
        for limit in limits_for(case, largest):
            cases.append(run_case(case, limit, 3 if args.quick else args.rounds))
    ratios = [c["chosen_over_fastest"] for c in cases]
    result = {"cases": cases, "worst_chosen_over_fastest": max(ratios),
              "goal": 1.03, "cpu_count": len(jax.devices("cpu"))}  # fmt: skip
    print(f"worst chosen/fastest: {max(ratios):.3f} (goal 1.03)")
    write_result(out, result)
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
