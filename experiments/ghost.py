"""What ghost batches cost, and what they buy: BatchNorm training that ignores the device.

`ResNetTiny` (the zoo's BatchNorm model), Adam, a target batch ``T`` (256) of synthetic
16x16 images, trained two ways through `linen_classifier_loss`:

- ``plain``: BatchNorm statistics of each micro-batch, the running averages moved once
  per micro-step;
- ``ghost``: ``ghost_batch_size=g`` (32), statistics of each group of ``g`` examples,
  the averages moved once per group in the target batch's order.

Cost, at a micro-batch of ``T`` (one micro-step): ms per update (medians of interleaved
rounds, and the ratio ghost / plain taken round by round), the ledger of that micro-batch
(everything live on the device while it runs) and the seconds `AdaptiveTrainer.init`
spends compiling it. What it buys: the same 3 updates at micro-batches of ``T / 4`` and
of ``T`` (two devices), the largest difference between the two runs' parameters and
``batch_stats`` (ghost: float noise; plain: the plan shows).

    python experiments/ghost.py          # writes experiments/results/ghost.{json,png}
    python experiments/ghost.py --quick  # fewer rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from common import grouped_bars, pyplot, save_figure, write_result

import jax_adaptive as ja
from jax_adaptive.data import synthetic_images
from jax_adaptive.models import ResNetTiny, linen_classifier_loss


def trainer_for(model, variables, data, *, micro: int, ghost: int | None) -> tuple[Any, Any, float]:
    """The trainer, its initial state and the seconds its init took (compiling the size)."""
    loss_fn = linen_classifier_loss(model, mutable=("batch_stats",), ghost_batch_size=ghost)
    trainer = ja.AdaptiveTrainer(
        loss_fn, optax.adam(1e-3), target_batch_size=len(data["label"]),
        micro_batch_size=micro, multiple_of=ghost or 1, has_aux=True, has_state=True,
        plan_cache=False,
    )  # fmt: skip
    start = time.perf_counter()
    state = trainer.init(
        variables["params"], data, model_state={"batch_stats": variables["batch_stats"]}
    )
    return trainer, state, time.perf_counter() - start


def largest_difference(a: Any, b: Any) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)


def trained(model, variables, data, micro: int, ghost: int | None, updates: int = 3) -> Any:
    trainer, state, _ = trainer_for(model, variables, data, micro=micro, ghost=ghost)
    for _ in range(updates):
        state, _ = trainer.step(state, data)
    return state.params, state.model_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=256)
    parser.add_argument("--ghost", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="experiments/results/ghost.json")
    args = parser.parse_args()
    T, g = args.target, args.ghost
    rounds = 3 if args.quick else args.rounds
    model = ResNetTiny(num_classes=10)
    data = synthetic_images(T)
    variables = model.init(jax.random.key(0), jnp.zeros((1, *data["image"].shape[1:])))

    cost: dict[str, dict[str, float]] = {}
    updates = {}
    for name, ghost in (("plain", None), ("ghost", g)):
        trainer, state, seconds = trainer_for(model, variables, data, micro=T, ghost=ghost)
        box = [state]

        def update(trainer=trainer, box=box) -> None:
            box[0], metrics = trainer.step(box[0], data)
            jax.block_until_ready(metrics["loss"])

        update()  # its first run
        updates[name] = update
        cost[name] = {"ledger_bytes": trainer.ledger(T).total, "init_seconds": seconds}
    times: dict[str, list[float]] = {name: [] for name in updates}
    for r in range(rounds):
        for name in list(updates)[r % 2 :] + list(updates)[: r % 2]:
            start = time.perf_counter()
            updates[name]()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        cost[name]["ms_per_update"] = statistics.median(ts) * 1e3
    ratio = statistics.median(a / b for a, b in zip(times["ghost"], times["plain"], strict=True))

    plans = (T // 4, T)
    differences = {}
    for name, ghost in (("plain", None), ("ghost", g)):
        small, large = (trained(model, variables, data, micro, ghost) for micro in plans)
        differences[name] = {
            "params": largest_difference(small[0], large[0]),
            "batch_stats": largest_difference(small[1], large[1]),
        }
    for name in cost:
        print(
            f"{name:5s}: {cost[name]['ms_per_update']:.1f} ms per update, ledger "
            f"{cost[name]['ledger_bytes'] / 1e6:.2f} MB, init {cost[name]['init_seconds']:.2f} s; "
            f"micro-batch {plans[0]} against {plans[1]}: largest difference params "
            f"{differences[name]['params']:.2e}, batch_stats {differences[name]['batch_stats']:.2e}"
        )
    print(f"ghost / plain time per update (round by round, median): {ratio:.2f}")
    out = write_result(
        args.out,
        {
            "model": "ResNetTiny", "optimizer": "adam", "target_batch_size": T,
            "ghost_batch_size": g, "rounds": rounds, "cost_at_micro_batch_T": cost,
            "ghost_over_plain_time": ratio, "plans_compared": list(plans),
            "largest_difference_between_plans": differences,
        },
    )  # fmt: skip
    plot(cost, differences, out.with_suffix(".png"))


def plot(cost: dict, differences: dict, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(cost)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(names, [cost[n]["ms_per_update"] for n in names], color=["tab:gray", "tab:blue"])
    left.set_ylabel("ms per update (micro-batch = T)")
    kinds = ("params", "batch_stats")
    grouped_bars(right, names, {k: [max(differences[n][k], 1e-12) for n in names] for k in kinds})
    right.set_yscale("log")
    right.set_ylabel("largest difference, micro-batch T/4 vs T")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
