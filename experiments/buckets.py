"""Variable lengths: the compiles each new shape bucket costs, and the padding it saves.

A small GPT (the zoo's, 2 layers of width 64, vocabulary 64) trains on synthetic
sequences of log-normal lengths (median 64, log-space deviation 0.9, clipped to
[4, 512]: many short sequences and a long tail) through ``ja.BucketedTrainer`` with
power-of-two buckets 32..512, ``target_tokens`` padded tokens per update and a
``memory_limit`` that makes every bucket's micro-batch smaller than its update.

* **Compiles per new bucket**, in the order the buckets are first used: with the
  cross-bucket prediction (``predict=True``, the default: a new bucket's search starts
  from the line fitted to the buckets seen) and without it (each bucket searched alone,
  from its update size down), on the same stream. Every plan is checked to be the
  exact largest: its size fits and the next does not.
* **Padding waste**, the share of masked tokens among those computed: with the buckets,
  against padding every sequence to the longest (one shape, no bucket), and against
  batches of the stream padded to their own longest sequence (``dynamic``; a new shape,
  and a new compile, for almost every batch).

    python experiments/buckets.py           # writes experiments/results/buckets.{json,png}
    python experiments/buckets.py --quick   # fewer sequences and buckets, a smoke test
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import pyplot, save_figure, write_result

import jax_adaptive as ja
from jax_adaptive.buckets import bucket_for
from jax_adaptive.data import synthetic_sequences
from jax_adaptive.models import GPT, gpt_token_loss

RESULTS = Path(__file__).parent / "results"


def _trainer(model: GPT, args: argparse.Namespace, predict: bool) -> ja.BucketedTrainer:
    return ja.BucketedTrainer(
        gpt_token_loss(model),
        optax.adam(1e-3),
        buckets=ja.pow2_buckets(args.max_length, args.min_bucket),
        target_tokens=args.target_tokens,
        count_tokens=lambda b: b["mask"][:, 1:].sum(axis=1),
        memory_limit=args.memory_limit,
        plan_cache=False,
        predict=predict,
    )


def _exact(trainer: ja.BucketedTrainer) -> dict[int, bool]:
    """Each bucket's plan is the largest that fits: it fits and the next size does not."""
    out = {}
    for length, bucket in trainer.trainers.items():
        m, cap = bucket.micro_batch_size, bucket.capacity()
        fits = bucket.ledger(m).total <= cap
        nxt = m == bucket.target_batch_size or bucket.ledger(m + 1).total > cap
        out[length] = bool(fits and nxt)
    return out


def _padding(lengths: np.ndarray, args: argparse.Namespace, trained: float) -> dict[str, float]:
    """Masked shares of the positions computed, from the lengths (every sequence counted)."""
    tokens = lengths.sum()
    buckets = ja.pow2_buckets(args.max_length, args.min_bucket)
    padded = sum(bucket_for(int(n), buckets) for n in lengths)
    rng = np.random.default_rng(0)
    per_batch = max(1, args.target_tokens // int(np.median(lengths)))
    order = rng.permutation(len(lengths))
    batches = [lengths[order[i : i + per_batch]] for i in range(0, len(order), per_batch)]
    dynamic = sum(len(b) * b.max() for b in batches)
    return {
        "buckets": float(1 - tokens / padded),
        # What training measured: next-token targets (one fewer per sequence) over the
        # positions of the updates it ran (sequences left waiting in a bucket excluded).
        "buckets_trained_targets": trained,
        "pad_to_max_length": float(1 - tokens / (len(lengths) * args.max_length)),
        "dynamic_per_batch": float(1 - tokens / dynamic),
        "dynamic_distinct_shapes": len({int(b.max()) for b in batches}),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = GPT(vocab_size=64, max_len=args.max_length, width=64, depth=2, heads=4)
    sequences = list(
        synthetic_sequences(
            args.sequences, max_length=args.max_length, median_length=64, sigma=0.9, seed=0
        )
    )
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    runs = {}
    for predict in (True, False):
        trainer = _trainer(model, args, predict)
        state = trainer.init(params, sequences[0])
        start = time.perf_counter()
        state, history = trainer.fit(state, sequences)
        seconds = time.perf_counter() - start
        runs["predicted" if predict else "independent"] = {
            "buckets": trainer.bucket_log,
            "exact": _exact(trainer),
            "updates": len(history),
            "seconds": seconds,
            "losses": [float(h["loss"]) for h in history],
            "tokens": int(sum(h["tokens"] for h in history)),
            "padded_tokens": int(sum(h["padded_tokens"] for h in history)),
        }
        print(
            f"{'predicted' if predict else 'independent':>11}: "
            + ", ".join(f"L={b['bucket']}: {b['compiles']}" for b in trainer.bucket_log)
            + f" compiles; {len(history)} updates in {seconds:.0f}s"
        )
    ours = runs["predicted"]
    lengths = np.array([len(s["tokens"]) for s in sequences])
    new = [b["compiles"] for b in ours["buckets"][2:]]
    result = {
        "setup": {**vars(args), "median_length": 64, "sigma": 0.9},
        "runs": runs,
        "compiles_per_new_bucket_after_two": {
            "predicted": new,
            "independent": [b["compiles"] for b in runs["independent"]["buckets"][2:]],
        },
        "padding_waste": _padding(lengths, args, 1 - ours["tokens"] / ours["padded_tokens"]),
    }
    waste = result["padding_waste"]
    print(
        f"compiles per bucket after the first two: predicted {new}, independent "
        f"{result['compiles_per_new_bucket_after_two']['independent']}"
    )
    print(
        f"padding waste: buckets {waste['buckets']:.1%}, pad to {args.max_length} "
        f"{waste['pad_to_max_length']:.1%}, per batch {waste['dynamic_per_batch']:.1%} "
        f"({waste['dynamic_distinct_shapes']} shapes)"
    )
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for offset, (name, run) in zip((-0.2, 0.2), result["runs"].items(), strict=True):
        labels = [str(b["bucket"]) for b in run["buckets"]]
        xs = np.arange(len(labels)) + offset
        left.bar(xs, [b["compiles"] for b in run["buckets"]], width=0.4, label=name)
    left.set_xticks(range(len(labels)), labels)
    left.set_xlabel("bucket length, in order of first use")
    left.set_ylabel("micro-step compiles to plan it")
    left.legend()
    waste = result["padding_waste"]
    names = ["buckets", "pad_to_max_length", "dynamic_per_batch"]
    right.bar(range(3), [100 * waste[n] for n in names])
    right.set_xticks(range(3), ["buckets", "pad to max", "per batch"])
    right.set_ylabel("masked tokens, % of computed")
    fig.suptitle("log-normal lengths: compiles per new bucket, padding waste")
    save_figure(fig, path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test")
    parser.add_argument("--out", type=Path, default=RESULTS / "buckets.json")
    args = parser.parse_args()
    args.sequences, args.max_length, args.min_bucket = 3000, 512, 32
    args.target_tokens, args.memory_limit = 8192, 40_000_000
    if args.quick:
        args.sequences, args.max_length, args.target_tokens = 600, 128, 2048
        args.memory_limit = 12_000_000
    out = args.out
    del args.quick, args.out
    result = run(args)
    write_result(out, result)
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
