"""What ghost batches cost, and what they buy: BatchNorm training that ignores the device.

Two BatchNorm ResNets, Adam, a target batch ``T`` (256) of synthetic 16x16 images: the
zoo's `ResNetTiny`, and the ResNet-18 of examples/imagenet_resnet.py (written as Flax's
ImageNet example writes it: ``BatchNorm(axis_name="batch")``, bound by the adapter's
``axis_name``) at 8 filters. Each trained two ways through `linen_classifier_loss`:

- ``plain``: BatchNorm statistics of each micro-batch, the running averages moved once
  per micro-step;
- ``ghost``: ``ghost_batch_size=g`` (32), statistics of each group of ``g`` examples,
  the averages moved once per group in the target batch's order.

Cost, at a micro-batch of ``T`` (one micro-step): ms per update (medians of interleaved
rounds, and the ratio ghost / plain taken round by round), the ledger of that micro-batch
(everything live on the device while it runs) and the seconds `AdaptiveTrainer.init`
spends compiling it. What it buys: the same 3 updates at micro-batches of ``T / 4`` and
of ``T`` (two devices), the largest difference between the two runs' parameters and
``batch_stats`` (ghost: float noise; plain: the plan shows), beside the float-noise
floor: the same plan from parameters scaled by ``1 + 1e-7`` (`ResNetTiny` on 16x16
images turns that into 3e-4 after 3 updates). These updates are SGD with momentum: Adam
divides by the root of tiny gradients, so a parameter whose gradient is float noise
(about 1e-8: a channel's bias the next BatchNorm cancels) moves by about the learning
rate each update whichever way the noise points, and two plans' float noise differs
once the groups share one batch (1.5e-3 after 3 Adam updates of the ImageNet ResNet).

    python experiments/ghost.py          # writes experiments/results/ghost.{json,png}
    python experiments/ghost.py --quick  # fewer rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from common import grouped_bars, pyplot, save_figure, write_result

import jax_adaptive as ja
from jax_adaptive.data import synthetic_images
from jax_adaptive.models import ResNetTiny, linen_classifier_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's examples/
from examples import imagenet_resnet

ADAM, SGD = optax.adam(1e-3), optax.sgd(0.1, momentum=0.9)


def trainer_for(model, axis_name, variables, data, *, micro: int, ghost: int | None, opt=ADAM):
    """The trainer, its initial state and the seconds its init took (compiling the size)."""
    loss_fn = linen_classifier_loss(
        model, mutable=("batch_stats",), axis_name=axis_name, ghost_batch_size=ghost
    )
    trainer = ja.AdaptiveTrainer(
        loss_fn, opt, target_batch_size=len(data["label"]),
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


def measure(model, axis_name, data, g: int, rounds: int) -> dict[str, Any]:
    """Plain against ghost for one model: cost at one micro-step, and two plans compared."""
    T = len(data["label"])
    # train=False: BatchNorm's axis_name is unbound outside the adapter
    variables = model.init(jax.random.key(0), jnp.zeros((1, *data["image"].shape[1:])), train=False)
    cost: dict[str, dict[str, float]] = {}
    updates = {}
    for name, ghost in (("plain", None), ("ghost", g)):
        trainer, state, seconds = trainer_for(
            model, axis_name, variables, data, micro=T, ghost=ghost
        )
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
        trainers = {micro: trainer_for(model, axis_name, variables, data, micro=micro,
                                       ghost=ghost, opt=SGD)[0] for micro in plans}  # fmt: skip

        def three_updates(micro, scale=1.0, trainer=trainers):
            params = jax.tree.map(lambda p: p * scale, variables["params"])
            state = trainer[micro].init(
                params, data, model_state={"batch_stats": variables["batch_stats"]}
            )
            for _ in range(3):
                state, _ = trainer[micro].step(state, data)
            return state.params, state.model_state

        small, large = (three_updates(micro) for micro in plans)
        # the float-noise floor: one plan, from parameters one rounding error apart
        nudged = three_updates(T, 1 + 1e-7)
        differences[name] = {
            "params": largest_difference(small[0], large[0]),
            "batch_stats": largest_difference(small[1], large[1]),
            "params_nudged_1e-7": largest_difference(large[0], nudged[0]),
        }
    return {
        "cost_at_micro_batch_T": cost, "ghost_over_plain_time": ratio,
        "plans_compared": list(plans), "largest_difference_between_plans": differences,
    }  # fmt: skip


MODELS = {
    "ResNetTiny": lambda: (ResNetTiny(num_classes=10), None),
    "ImageNet ResNet-18, 8 filters": lambda: (imagenet_resnet.make(10)[0], "batch"),
}


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
    data = synthetic_images(T)
    results = {}
    for label, build in MODELS.items():
        model, axis_name = build()
        results[label] = result = measure(model, axis_name, data, g, rounds)
        cost, differences = (
            result["cost_at_micro_batch_T"],
            result["largest_difference_between_plans"],
        )
        plans = result["plans_compared"]
        for name in cost:
            c, d = cost[name], differences[name]
            print(
                f"{label}, {name:5s}: {c['ms_per_update']:.1f} ms per update, ledger "
                f"{c['ledger_bytes'] / 1e6:.2f} MB, init {c['init_seconds']:.2f} s; "
                f"micro-batch {plans[0]} against {plans[1]}: largest difference params "
                f"{d['params']:.2e}, batch_stats {d['batch_stats']:.2e} (params from a 1e-7 "
                f"nudge, same plan: {d['params_nudged_1e-7']:.2e})"
            )
        print(f"{label}: ghost / plain time per update (round by round, median): "
              f"{result['ghost_over_plain_time']:.2f}")  # fmt: skip
    out = write_result(
        args.out,
        {
            "optimizer": "adam (cost), sgd with momentum 0.9 (plans compared)",
            "target_batch_size": T, "ghost_batch_size": g,
            "image_side": int(data["image"].shape[1]), "rounds": rounds, "models": results,
        },
    )  # fmt: skip
    plot(results, out.with_suffix(".png"))


def plot(results: dict, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = list(results)
    names = ("plain", "ghost")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    cost = {m: results[m]["cost_at_micro_batch_T"] for m in labels}
    grouped_bars(left, labels, {n: [cost[m][n]["ms_per_update"] for m in labels] for n in names})
    left.set_ylabel("ms per update (micro-batch = T)")
    grouped_bars(
        right, [f"{m.split()[0]}\n{k}" for m in labels for k in ("params", "batch_stats")],
        {n: [max(results[m]["largest_difference_between_plans"][n][k], 1e-12)
             for m in labels for k in ("params", "batch_stats")] for n in names},
    )  # fmt: skip
    right.set_yscale("log")
    right.set_ylabel("largest difference, micro-batch T/4 vs T")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
