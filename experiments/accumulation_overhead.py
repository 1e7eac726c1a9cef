"""What gradient accumulation costs: k micro-steps of T/k versus one full-batch step of T.

Through `ja.AdaptiveTrainer` with a fixed ``micro_batch_size = T // k`` for each k in
{1, 2, 4, 8} (k = 1 is the single full-batch step), the same CNN, optimizer and data, all
timed in one process: after warm-up (compiles, a size's first-run host copies), rounds
interleave the k's in a rotating order, and each k's time per example is the median over
rounds. The ratio time(k) / time(1) is the overhead; the goal is at most 1.05. A plain
jitted full-batch step (value_and_grad + adam, no trainer) is timed alongside for reference.

    python experiments/accumulation_overhead.py          # writes experiments/results/...json
    python experiments/accumulation_overhead.py --quick  # T=256, fewer rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import write_result

import jax_adaptive as ja
from jax_adaptive.data import synthetic_images
from jax_adaptive.models import CNN, linen_classifier_loss

GOAL = 1.05


def plain_full_batch(model: CNN, optimizer: optax.GradientTransformation, params: Any):
    """One jitted, donating full-batch step with no accumulation and no trainer."""

    def loss(p: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": p}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    def step(p: Any, opt_state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    step = jax.jit(step, donate_argnums=(0, 1))
    return step, (jax.tree.map(jnp.array, params), optimizer.init(params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=1024)
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--updates", type=int, default=3, help="updates per timed round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates per variant")
    parser.add_argument("--quick", action="store_true", help="T=256, 5 rounds of 2 updates")
    parser.add_argument("--out", default="experiments/results/accumulation_overhead.json")
    args = parser.parse_args()
    if args.quick:
        args.target, args.rounds, args.updates = 256, 5, 2
    if any(args.target % k for k in args.ks) or 1 not in args.ks:
        parser.error("every k must divide --target, and k = 1 (the baseline) must be among them")

    model = CNN(num_classes=10)
    data = {k: np.asarray(v) for k, v in synthetic_images(args.target).items()}
    params = model.init(jax.random.key(0), jnp.zeros((1, *data["image"].shape[1:])))["params"]
    optimizer = optax.adam(1e-3)
    device_data = jax.device_put(data)

    runs: dict[str, Callable[[], None]] = {}
    trainers: dict[int, ja.AdaptiveTrainer] = {}
    for k in args.ks:
        trainer = ja.AdaptiveTrainer(
            linen_classifier_loss(model),
            optimizer,
            target_batch_size=args.target,
            micro_batch_size=args.target // k,
            has_aux=True,
        )
        box = [trainer.init(params, data, rng=jax.random.key(0))]
        trainers[k] = trainer

        def run(trainer: ja.AdaptiveTrainer = trainer, box: list[Any] = box) -> None:
            for _ in range(args.updates):
                box[0], metrics = trainer.step(box[0], device_data)
            jax.block_until_ready((box[0].params, metrics["loss"]))

        runs[f"k={k}"] = run

    step, plain_state = plain_full_batch(model, optimizer, params)
    plain_box = [plain_state]

    def run_plain() -> None:
        p, o = plain_box[0]
        for _ in range(args.updates):
            p, o, value = step(p, o, device_data)
        jax.block_until_ready((p, value))
        plain_box[0] = (p, o)

    runs["plain full batch"] = run_plain

    for _ in range(max(1, -(-args.warmup // args.updates))):
        for run in runs.values():
            run()
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[:: -1 if r % 2 else 1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - start) / (args.updates * args.target))

    per_example = {name: statistics.median(ts) for name, ts in times.items()}
    base = per_example["k=1"]
    rows = []
    print(f"CNN, T={args.target}, {args.rounds} rounds of {args.updates} updates, medians")
    print(f"{'variant':<18}{'micro':>7}{'us/example':>12}{'ratio':>8}  goal<={GOAL}")
    for name in names:
        k = int(name[2:]) if name.startswith("k=") else None
        ratio = per_example[name] / base
        row = {
            "variant": name,
            "k": k,
            "micro_batch_size": args.target // k if k else args.target,
            "seconds_per_example": per_example[name],
            "seconds_per_example_rounds": times[name],
            "ratio_to_k1": ratio,
            "meets_goal": ratio <= GOAL if k else None,
        }
        if k:
            assert trainers[k].accumulation_steps == k
        rows.append(row)
        mark = "" if k is None else ("yes" if ratio <= GOAL else "NO")
        print(
            f"{name:<18}{row['micro_batch_size']:>7}{1e6 * per_example[name]:>12.2f}"
            f"{ratio:>8.3f}  {mark}"
        )
    result = {
        "description": __doc__.splitlines()[0],
        "model": "CNN (jax_adaptive.models.CNN), adam, synthetic 16x16x3 images",
        "target_batch_size": args.target,
        "rounds": args.rounds,
        "updates_per_round": args.updates,
        "goal_ratio": GOAL,
        "rows": rows,
        "all_meet_goal": all(r["meets_goal"] for r in rows if r["k"]),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
