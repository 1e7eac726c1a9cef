"""How much of an update the default plan pads, against the largest size that fits.

For the zoo models of ``search_cost.py`` (MLP, CNN, ResNetTiny, a small GPT) at a target
of 4096 and three memory limits each (20, 45 and 70% of the way from the ledger of a
micro-batch of 1 to that of the whole target), one `ja.AdaptiveTrainer.init` with the
default ``objective="least_padding"`` gives both plans: ``plan_info.largest`` is the
largest size that fits (what ``objective="max"`` runs) and ``micro_batch_size`` the
default's. Padding is ``steps * size - T`` examples of the update computed and thrown
away. The goal: the default pads at most 1% of the update's examples.

    python experiments/padding.py          # writes experiments/results/padding.{json,png}
    python experiments/padding.py --quick  # MLP and CNN only
"""

from __future__ import annotations

import argparse
import math
import time

from common import grouped_bars, pyplot, save_figure, write_result
from search_cost import build, trainer_for

GOAL = 0.01
FRACTIONS = (0.2, 0.45, 0.7)


def padding(target: int, size: int) -> int:
    return math.ceil(target / size) * size - target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=4096)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="experiments/results/padding.json")
    args = parser.parse_args()
    names = ("MLP", "CNN") if args.quick else ("MLP", "CNN", "ResNetTiny", "GPT")
    T, cases = args.target, []
    for name in names:
        setup = build(name, T)
        probe = trainer_for(setup, None)
        probe.init(setup.params, setup.example, model_state=setup.model_state)
        low, high = probe.ledger(1).total, probe.ledger(T).total
        for fraction in FRACTIONS:
            limit = int(low + fraction * (high - low))
            start = time.perf_counter()
            trainer = trainer_for(setup, limit, objective="least_padding")
            trainer.init(setup.params, setup.example, model_state=setup.model_state)
            plan = trainer.plan_info
            case = {
                "model": name,
                "memory_limit": limit,
                "largest": plan.largest,
                "max_plan": f"{plan.largest} x {math.ceil(T / plan.largest)}",
                "max_padding": padding(T, plan.largest) / T,
                "default_plan": f"{plan.micro_batch_size} x {plan.accumulation_steps}",
                "default_padding": padding(T, plan.micro_batch_size) / T,
                "init_seconds": time.perf_counter() - start,
            }
            cases.append(case)
            print(
                f"{name:10s} limit {limit / 2**20:7.1f} MiB: max {case['max_plan']:>10s} pads "
                f"{case['max_padding']:6.1%}; default {case['default_plan']:>10s} pads "
                f"{case['default_padding']:6.2%}"
            )
    worst = max(c["default_padding"] for c in cases)
    print(f"worst default padding {worst:.2%} (goal <= {GOAL:.0%})")
    out = write_result(
        args.out,
        {"target_batch_size": T, "goal": GOAL, "worst_default_padding": worst, "cases": cases},
    )
    plot(cases, out.with_suffix(".png"))


def plot(cases: list[dict], path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{c['model']}\n{c['memory_limit'] / 2**20:.0f} MiB" for c in cases]
    fig, ax = plt.subplots(figsize=(10, 4))
    series = {
        "max": [100 * c["max_padding"] for c in cases],
        "least_padding (default)": [100 * c["default_padding"] for c in cases],
    }
    grouped_bars(ax, labels, series)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("padding, % of the update's examples")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
