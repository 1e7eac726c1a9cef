"""What OOM recovery costs once the micro-batch size is settled: time and device memory.

Compares ``AdaptiveTrainer.step`` (recovery on: host copies only on a size's first
update, deleted-buffer checks, a block per update) with the loop a user writes without
it: one jitted, donating micro-step with ``optax.MultiSteps`` per micro-batch, the same
model, optimizer, micro-batch size and data. Both are timed in the same process,
interleaved round by round, after warm-up; the ratio of medians is the overhead.

    python experiments/recovery_overhead.py  # writes experiments/results/...json
    python experiments/recovery_overhead.py --rounds 3 --updates 3  # quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import write_result

import jax_adaptive as ja
from jax_adaptive.data import synthetic_images
from jax_adaptive.models import CNN, linen_classifier_loss


def plain_loop(model, optimizer, micro: int, target: int):
    """The accumulation loop without recovery: jit + donate + MultiSteps, nothing else."""
    k = -(-target // micro)
    opt = optax.MultiSteps(optimizer, every_k_schedule=k)

    def loss(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    def micro_step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    micro_step = jax.jit(micro_step, donate_argnums=(0, 1))

    def update(params, opt_state, data):
        for start in range(0, target, micro):
            chunk = jax.tree.map(lambda x, s=start: x[s : s + micro], data)
            params, opt_state = micro_step(params, opt_state, chunk)
        jax.block_until_ready(params)
        return params, opt_state

    return opt, micro_step, update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=256)
    parser.add_argument("--micro", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--updates", type=int, default=5, help="updates per timed round")
    parser.add_argument("--out", default="experiments/results/recovery_overhead.json")
    args = parser.parse_args()
    if args.target % args.micro:
        parser.error("--micro must divide --target so both loops run the same micro-steps")

    model = CNN(num_classes=10)
    data = {k: np.asarray(v) for k, v in synthetic_images(args.target).items()}
    params = model.init(jax.random.key(0), jnp.zeros((1, *data["image"].shape[1:])))["params"]
    optimizer = optax.adam(1e-3)

    trainer = ja.AdaptiveTrainer(
        linen_classifier_loss(model),
        optimizer,
        target_batch_size=args.target,
        micro_batch_size=args.micro,
        has_aux=True,
    )
    state = trainer.init(params, data, rng=jax.random.key(0))
    opt, micro_step, update = plain_loop(model, optimizer, args.micro, args.target)
    plain = (jax.tree.map(jnp.array, params), opt.init(params))
    device_data = jax.device_put(data)

    def ours() -> None:
        nonlocal state
        for _ in range(args.updates):
            state, metrics = trainer.step(state, device_data)
        jax.block_until_ready(metrics["loss"])

    def theirs() -> None:
        nonlocal plain
        for _ in range(args.updates):
            plain = update(*plain, device_data)

    ours(), theirs()  # warm-up: compiles, and the trainer's first-run host copies
    # Count the host copies the trainer takes once settled (it takes them with
    # jax.device_get; the plain loop never calls it).
    copies, device_get = [0], jax.device_get

    def counting_device_get(tree):
        copies[0] += 1
        return device_get(tree)

    jax.device_get = counting_device_get
    times: dict[str, list[float]] = {"trainer": [], "plain": []}
    for r in range(args.rounds):
        for name, fn in (("trainer", ours), ("plain", theirs))[:: 1 if r % 2 else -1]:
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) / args.updates)

    jax.device_get = device_get
    ours_s, plain_s = statistics.median(times["trainer"]), statistics.median(times["plain"])
    chunk = jax.tree.map(lambda x: jax.ShapeDtypeStruct((args.micro, *x.shape[1:]), x.dtype), data)
    plain_bytes = ja.estimate_peak_bytes(micro_step.lower(*plain, chunk).compile())
    ours_bytes = ja.estimate_peak_bytes(trainer.compile(args.micro))
    result = {
        "model": "CNN (jax_adaptive.models.CNN), adam, synthetic 16x16x3 images",
        "target_batch_size": args.target,
        "micro_batch_size": args.micro,
        "accumulation_steps": args.target // args.micro,
        "rounds": args.rounds,
        "updates_per_round": args.updates,
        "seconds_per_update": {"trainer": ours_s, "plain": plain_s},
        "time_ratio": ours_s / plain_s,
        "estimated_peak_bytes": {"trainer_micro_step": ours_bytes, "plain_micro_step": plain_bytes},
        "memory_ratio": ours_bytes / plain_bytes,
        "host_copies_in_steady_state": copies[0],
    }
    print(json.dumps(result, indent=2))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
