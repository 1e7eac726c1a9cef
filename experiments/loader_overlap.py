"""Does a loader's host work add to the trainer's time per update, as it does not to a plain loop?

A hand-written JAX loop (``for batch in loader: state = step(state, batch)``) overlaps
the loader with the device: the step is dispatched asynchronously, and the next batch
is loaded while it runs. `ja.AdaptiveTrainer` waits for each update to finish (an
out-of-memory in it must be caught inside the update, to recover), so a loader read only
when a batch is asked for adds its time to every update. ``fit`` reads the stream ahead
in a background thread (``read_ahead``, `ja.Rebatcher`) to win that overlap back.

T = 1024, Adam, one process. The loader yields batches of T examples and does host
work for each (a shuffled gather and a few elementwise passes, about a millisecond or
two here, as decoding and augmenting would). Variants, each over the same loader:

- ``optax_loop``: the hand-written loop over ``optax.microbatch`` (its in-jit loop
  over micro-batches), the state donated, no value read per update;
- ``fit_read_ahead``: ``trainer.fit(state, loader)`` (its default ``read_ahead=2``);
- ``fit_no_read_ahead``: the same with ``read_ahead=0``;
- ``step_loop_read_ahead``: a user's own loop over ``trainer.step``, its batches from
  ``ja.Rebatcher(loader, T, read_ahead=2)``;
- ``loader_alone``: the loader's time per batch, nothing else running.

And for sequences of varying length (``buckets`` in the JSON): ``ja.BucketedTrainer.fit``
on the zoo's small GPT (power-of-two buckets to 64, 1024 padded tokens per update) over
a loader of log-normal lengths whose host work per sequence (``--passes`` passes over a
256-wide float embedding of its tokens) stands for tokenizing, reading two updates'
sequences ahead against ``read_ahead=0`` (its default), with the loader's own time
for an update's sequences beside them (its time per sequence, read alone, times the
sequences the fits' updates took on average), for a loader of ``--passes`` and of five
times as many passes (``buckets`` keyed by the passes).

At micro-batch 8 (MLP 64 -> 128 -> 64, dispatch-bound) and 512 (2048 wide,
compute-bound). Interleaved rounds of ``--updates`` updates per variant; ratios to
``optax_loop`` taken round by round, median and quartiles.

    python experiments/loader_overlap.py   # writes experiments/results/loader_overlap.{json,png}
    python experiments/loader_overlap.py --quick
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import grouped_bars, pyplot, save_figure, write_result
from dispatch import T, adam_step, batch_of, microbatch_grads, mlp, paired, quartiles
from dispatch import measure as dispatch_measure

import jax_adaptive as ja
from jax_adaptive.data import synthetic_sequences
from jax_adaptive.models import GPT, gpt_token_loss

CASES = {"8": (8, 128), "512-wide": (512, 2048)}  # micro-batch, hidden width


def loader(base: dict[str, np.ndarray], passes: int, seed: int = 1) -> Iterator[dict]:
    """Endless batches of T examples, each costing the host a shuffle and ``passes`` passes."""
    rs = np.random.RandomState(seed)
    while True:
        idx = rs.permutation(T)
        x = base["x"][idx]
        for _ in range(passes):
            x = np.tanh(x) * np.float32(0.5) + x * np.float32(0.5)
        yield {"x": x.astype(np.float32), "y": base["y"][idx]}


def optax_loop(params: Any, loss: Callable, m: int) -> Callable[[Iterator, int], None]:
    """The hand-written loop: dispatch.py's donating step around ``optax.microbatch``."""
    step, optimizer = adam_step(microbatch_grads(loss, m))
    box = [jax.tree.map(jnp.array, params), optimizer.init(params)]

    def run(batches: Iterator, n: int) -> None:
        for _ in range(n):
            box[0], box[1] = step(box[0], box[1], next(batches))
        jax.block_until_ready(box[0])

    return run


def trainer_runs(params: Any, loss: Callable, m: int) -> dict[str, Callable[[Iterator, int], None]]:
    """``fit`` with and without reading ahead, and a user's loop over ``step``."""
    trainer = ja.AdaptiveTrainer(
        loss, optax.adam(1e-3), target_batch_size=T, micro_batch_size=m, plan_cache=False
    )
    box = [trainer.init(params, batch_of())]

    def fit(read_ahead: int) -> Callable[[Iterator, int], None]:
        def run(batches: Iterator, n: int) -> None:
            box[0], _ = trainer.fit(box[0], batches, n, read_ahead=read_ahead)

        return run

    def step_loop(batches: Iterator, n: int) -> None:
        with ja.Rebatcher(batches, T, read_ahead=2) as stream:
            for _ in range(n):
                box[0], _ = trainer.step(box[0], next(stream))
        jax.block_until_ready(box[0].params)

    return {
        "fit_read_ahead": fit(2),
        "fit_no_read_ahead": fit(0),
        "step_loop_read_ahead": step_loop,
    }


def sequence_loader(passes: int, seed: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Endless sequences of log-normal lengths to 64, each costing the host ``passes`` passes."""
    for sequence in synthetic_sequences(max_length=64, seed=seed):
        x = np.repeat(sequence["tokens"][:, None].astype(np.float32), 256, axis=1)
        for _ in range(passes):
            x = np.tanh(x) * np.float32(0.5) + x * np.float32(0.5)
        yield sequence


def bucket_case(passes: int, rounds: int, n: int) -> dict[str, Any]:
    """``BucketedTrainer.fit`` over `sequence_loader`, reading ahead and not."""
    model = GPT(vocab_size=64, max_len=64, width=64, depth=2, heads=4)
    trainer = ja.BucketedTrainer(
        gpt_token_loss(model), optax.adam(1e-3), buckets=ja.pow2_buckets(64),
        target_tokens=1024, plan_cache=False,
    )  # fmt: skip
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    sequences = sequence_loader(passes)
    box = [trainer.init(params, next(sequences))]

    taken = []  # the sequences of each update the fits ran

    def fit(read_ahead: int) -> Callable[[Iterator, int], None]:
        def run(stream: Iterator, n: int) -> None:
            box[0], history = trainer.fit(box[0], stream, n, read_ahead=read_ahead)
            taken.extend(h["examples"] for h in history)

        return run

    ahead = 2 * max(trainer.examples_per_update(b) for b in trainer.buckets)
    runs = {"fit_read_ahead": fit(ahead), "fit_no_read_ahead": fit(0), "loader": loader_alone}
    times = measure(runs, sequences, rounds, n)  # the loader's: per sequence
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    per_sequence = ms.pop("loader")
    ms["loader"] = per_sequence * statistics.mean(taken)
    return {
        "ms_per_update": ms,
        "loader_ms_per_sequence": per_sequence,
        "sequences_per_update": statistics.mean(taken),
        "read_ahead_over_none": paired(times, "fit_read_ahead", "fit_no_read_ahead"),
    }


def loader_alone(batches: Iterator, n: int) -> None:
    for _ in range(n):
        next(batches)


def measure(runs: dict[str, Callable], batches: Iterator, rounds: int, n: int) -> dict[str, list]:
    """Seconds per update of each variant in each of `dispatch.measure`'s rounds of ``n``."""
    calls = {name: functools.partial(run, batches, n) for name, run in runs.items()}
    return {name: [t / n for t in ts] for name, ts in dispatch_measure(calls, rounds, 1).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--updates", type=int, default=10, help="updates per variant a round")
    parser.add_argument("--passes", type=int, default=20, help="the loader's host passes")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="experiments/results/loader_overlap.json")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    results = {}
    for case, (m, width) in CASES.items():
        params, loss = mlp(width)
        batches = loader(batch_of(), args.passes)
        runs = {"optax_loop": optax_loop(params, loss, m), **trainer_runs(params, loss, m)}
        runs["loader_alone"] = loader_alone
        times = measure(runs, batches, rounds, args.updates)
        ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        ratios = {
            name: paired(times, name, "optax_loop")
            for name in runs
            if name not in ("optax_loop", "loader_alone")
        }
        results[case] = {"micro_batch_size": m, "hidden_width": width, "ms_per_update": ms,
                         "over_optax_loop": ratios}  # fmt: skip
        print(
            f"micro-batch {m}, width {width}: "
            + ", ".join(f"{n} {v:.2f} ms" for n, v in ms.items())
            + "; over optax_loop per round (median [quartiles]): "
            + ", ".join(f"{n} {quartiles(q)}" for n, q in ratios.items())
        )
    buckets = {}
    for passes in (args.passes, 5 * args.passes):
        case = buckets[str(passes)] = bucket_case(passes, rounds, args.updates)
        print(
            f"buckets, loader of {passes} passes: "
            + ", ".join(f"{n} {v:.2f} ms" for n, v in case["ms_per_update"].items())
            + f"; read ahead / not, per round: {quartiles(case['read_ahead_over_none'])}"
        )
    out = write_result(
        args.out,
        {"target_batch_size": T, "optimizer": "adam", "rounds": rounds,
         "updates_per_round": args.updates, "loader_passes": args.passes, "cases": results,
         "buckets": buckets},
    )  # fmt: skip
    plot(results, out.with_suffix(".png"))


def plot(results: dict, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(next(iter(results.values()))["over_optax_loop"])
    grouped_bars(
        ax,
        [f"micro-batch {r['micro_batch_size']}" for r in results.values()],
        {n: [r["over_optax_loop"][n]["median"] for r in results.values()] for n in names},
    )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("time per update / hand-written optax loop")
    ax.set_title("A loader's host work in the loop (T = 1024, CPU)")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
