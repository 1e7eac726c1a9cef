"""Remat as the planner's second lever: per policy, what fits, what it costs, what is chosen.

A causal language model whose layers run under ``lax.scan`` (XLA:CPU's memory analysis
shows what ``jax.checkpoint`` saves only on scanned layers) trains at T examples per
update with Adam under three device sizes, from the probes' ledgers: between the ledger
of one example with ``nothing_saveable`` and without remat (nothing fits without
remat), that of T/2 examples without remat, and that of T without remat. Per limit and
policy, a trainer of that policy alone gives the largest micro-batch, its plan, the
ledger of the update's programs and the median time per update; then one trainer given
every policy as `ja.RematChoices` plans, and its choice is reported; so is the choice
of one with ``objective="throughput"``, which times each policy's plans, and its time
per update against the fastest policy's.

The policies: no remat, ``dots_with_no_batch_dims_saveable``, ``nothing_saveable`` and
``offload_dot_with_no_batch_dims`` (device to pinned host). On a CPU the host is the
device: what offloading takes out of the report still lives in the same memory.

    python experiments/remat.py          # writes experiments/results/remat.{json,png}
    python experiments/remat.py --quick  # a smaller model, two policies
    python experiments/remat.py --replot # the PNG again from the JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import grouped_bars, pyplot, save_figure, timed_updates, write_result

import jax_adaptive as ja
from jax_adaptive.remat import maybe_checkpoint

POLICIES = {
    "none": None,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "offload_dot_with_no_batch_dims": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"
    ),
}


class LM:
    """A causal language model: embeddings, ``layers`` attention + MLP blocks scanned, a head."""

    def __init__(self, vocab: int, length: int, width: int, hidden: int, layers: int):
        self.vocab, self.length, self.width, self.hidden, self.layers = (
            vocab, length, width, hidden, layers,
        )  # fmt: skip

    def params(self, key: jax.Array) -> dict[str, Any]:
        """The parameters, each layer's stacked on a leading axis of ``layers``."""
        keys = jax.random.split(key, 5)
        w, h, n = self.width, self.hidden, self.layers
        return {
            "embed": 0.5 * jax.random.normal(keys[0], (self.vocab, w)),
            "layers": {
                "qkv": w**-0.5 * jax.random.normal(keys[1], (n, w, 3 * w)),
                "up": w**-0.5 * jax.random.normal(keys[2], (n, w, h)),
                "down": h**-0.5 * jax.random.normal(keys[3], (n, h, w)),
            },
            "head": w**-0.5 * jax.random.normal(keys[4], (w, self.vocab)),
        }

    def block(self, x: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        """One layer, as ``lax.scan`` runs it: causal self-attention and an MLP, residual."""
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(self.width)
        causal = jnp.tril(jnp.ones((self.length, self.length), bool))
        scores = jnp.where(causal[None], scores, -1e9)
        x = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)
        return x + jnp.tanh(x @ p["up"]) @ p["down"], None

    def loss(self, policy: Any) -> Any:
        """The per-example mean next-token cross-entropy, the layers under ``policy``."""
        body = maybe_checkpoint(self.block, policy)

        def loss_fn(params, batch, rng):
            x, _ = jax.lax.scan(body, params["embed"][batch[:, :-1]], params["layers"])
            logits = x @ params["head"]
            per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
            return per_token.mean(axis=1)

        return loss_fn

    def batch(self, size: int, seed: int) -> np.ndarray:
        """``size`` random token sequences of ``length + 1`` (inputs and next tokens)."""
        rng = np.random.default_rng(seed)
        return rng.integers(0, self.vocab, (size, self.length + 1)).astype(np.int32)


def trainer(loss: Any, T: int, limit: int | None) -> ja.AdaptiveTrainer:
    return ja.AdaptiveTrainer(
        loss, optax.adam(1e-3), target_batch_size=T, memory_limit=limit, plan_cache=False
    )


def seconds_per_update(t: ja.AdaptiveTrainer, state: Any, batches: list[np.ndarray]) -> float:
    """The median of the updates after the first (which compiles the update's programs)."""
    return statistics.median(timed_updates(t, state, batches)[1])


def throughput_choice(model: LM, policies: dict[str, Any], params: Any, batches: list[Any],
                      T: int, limit: int, fastest: float) -> dict[str, Any]:  # fmt: skip
    """What ``objective="throughput"`` chooses over every policy, and its time per update."""
    choices = ja.RematChoices({n: model.loss(p) for n, p in policies.items()})
    chooser = ja.AdaptiveTrainer(
        choices,
        optax.adam(1e-3),
        target_batch_size=T,
        memory_limit=limit,
        plan_cache=False,
        objective="throughput",
    )
    start = time.perf_counter()
    state = chooser.init(params, batches[0])
    choice_seconds = time.perf_counter() - start
    plan = chooser.plan_info
    return {
        "throughput_chosen": chooser.remat.policy,
        "throughput_plan": f"{plan.micro_batch_size} x {plan.accumulation_steps}",
        "throughput_timed": dict(chooser.remat.seconds),
        "throughput_choice_seconds": choice_seconds,
        "throughput_over_fastest": seconds_per_update(chooser, state, batches) / fastest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=32)
    parser.add_argument("--updates", type=int, default=4, help="timed updates (after one)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="experiments/results/remat.json")
    parser.add_argument("--replot", action="store_true", help="only draw --out's PNG again")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return
    logging.getLogger("jax_adaptive").setLevel(logging.WARNING)
    T = args.target
    if args.quick:
        model = LM(vocab=16, length=32, width=16, hidden=64, layers=6)
        policies = {name: POLICIES[name] for name in ("none", "nothing_saveable")}
    else:
        # Long sequences for a small model: one example's activations outweigh the state
        # and Adam's step (at length 64, width 64, Adam's step alone needed more than a
        # micro-step of 1 without remat, and nothing fit that remat would have rescued).
        model = LM(vocab=64, length=128, width=32, hidden=128, layers=8)
        policies = POLICIES
    params = model.params(jax.random.key(0))
    batches = [model.batch(T, seed) for seed in range(args.updates + 1)]

    probes = {}  # the ledgers of 1, T/2 and T examples per policy, no limit
    for name, policy in policies.items():
        probe = trainer(model.loss(policy), T, None)
        probe.init(params, batches[0])
        probes[name] = {m: probe.ledger(m).total for m in (1, T // 2, T)}
        print(f"{name}: ledger of 1, {T // 2}, {T} examples: {probes[name]}")
    least = min(p[1] for p in probes.values())
    limits = {
        "nothing fits without remat": (least + probes["none"][1]) // 2,
        f"{T // 2} fit without remat": probes["none"][T // 2],
        f"{T} fit without remat": probes["none"][T],
    }

    cases = []
    for label, limit in limits.items():
        rows = {}
        for name, policy in policies.items():
            t = trainer(model.loss(policy), T, limit)
            start = time.perf_counter()
            try:
                state = t.init(params, batches[0])
            except ja.NothingFitsError:
                rows[name] = {"largest": None, "init_seconds": time.perf_counter() - start}
                print(f"{label} ({limit:,} bytes), {name}: nothing fits")
                continue
            init_seconds = time.perf_counter() - start
            seconds = seconds_per_update(t, state, batches)
            plan = t.plan_info
            rows[name] = {
                "largest": plan.largest,
                "plan": f"{plan.micro_batch_size} x {plan.accumulation_steps}",
                "ledger": plan.ledger._asdict() | {"total": plan.ledger.total},
                "seconds_per_update": seconds,
                "init_seconds": init_seconds,
            }
            print(f"{label} ({limit:,} bytes), {name}: largest {plan.largest}, plan "
                  f"{rows[name]['plan']}, peak {plan.ledger.total:,} bytes, "
                  f"{seconds * 1e3:.1f} ms per update")  # fmt: skip
        chooser = trainer(ja.RematChoices({n: model.loss(p) for n, p in policies.items()}), T,
                          limit)  # fmt: skip
        start = time.perf_counter()
        try:
            chooser.init(params, batches[0])
        except ja.NothingFitsError as exc:
            cases.append({"limit": label, "memory_limit": limit, "policies": rows,
                          "chosen": None, "error": str(exc)})  # fmt: skip
            print(f"{label}: {exc}")
            continue
        plan = chooser.plan_info
        chosen = plan.remat.split(" ", 1)[0]
        timed = {n: r["seconds_per_update"] for n, r in rows.items() if r["largest"]}
        fastest = min(timed, key=timed.get)
        case = {
            "limit": label,
            "memory_limit": limit,
            "policies": rows,
            "chosen": chosen,
            "chosen_plan": f"{plan.micro_batch_size} x {plan.accumulation_steps}",
            "plan_text": str(plan),
            "choice_seconds": time.perf_counter() - start,
            "fastest": fastest,
            "chosen_over_fastest": timed[chosen] / timed[fastest],
            **throughput_choice(model, policies, params, batches, T, limit, timed[fastest]),
        }
        cases.append(case)
        print(f"{label}: chose {chosen} at {case['chosen_plan']} in "
              f"{case['choice_seconds']:.1f} s; the fastest was {fastest} "
              f"({case['chosen_over_fastest']:.2f} of its time); objective='throughput' chose "
              f"{case['throughput_chosen']} at {case['throughput_plan']} in "
              f"{case['throughput_choice_seconds']:.1f} s "
              f"({case['throughput_over_fastest']:.2f} of the fastest's time)")  # fmt: skip

    config = vars(model) | {"target_batch_size": T, "optimizer": "adam"}
    out = write_result(args.out, {"model": config, "probes": probes, "cases": cases})
    plot(json.loads(out.read_text()), out.with_suffix(".png"))


def plot(result: dict[str, Any], path: Path) -> None:
    """Largest micro-batch and time per update, per policy and limit (``--replot``)."""
    plt = pyplot()
    if plt is None:
        return
    cases, T = result["cases"], result["model"]["target_batch_size"]
    policies = list(cases[0]["policies"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    groups = [case["limit"] for case in cases]
    short = {n: n.replace("_with_no_batch_dims", "").replace("_saveable", "") for n in policies}
    grouped_bars(left, groups, {
        short[n]: [case["policies"][n]["largest"] or 0 for case in cases] for n in policies
    })  # fmt: skip
    left.set_ylabel(f"largest micro-batch (T = {T}; 0: nothing fits)")
    grouped_bars(right, groups, {
        short[n]: [1e3 * case["policies"][n].get("seconds_per_update", math.nan) for case in cases]
        for n in policies
    })  # fmt: skip
    right.set_ylabel("ms per update")
    right.set_title("chosen: " + ", ".join(short.get(c["chosen"], "-") for c in cases), fontsize=9)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
