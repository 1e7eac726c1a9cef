"""Is the trainer as fast as a hand-written loop? Time per update against optax.microbatch.

At micro-batch 8, 64 and 512 (T = 1024, Adam), one process, interleaved rounds, medians:

- ``trainer``: `ja.AdaptiveTrainer` with that fixed micro-batch size, ``chunk="auto"``
  (micro-steps scanned in chunks, the last program running the optimizer step too), a
  host (NumPy) batch, as a data loader gives it;
- ``trainer_device``: the same with the batch already on the device;
- ``trainer_chunk1``: one dispatch per micro-step (``chunk=1``), today's design before
  chunks, host batch;
- ``trainer_program``: the trainer's own compiled last program (``trainer.compile(m,
  chunk, with_optimizer_step=True)``: all the update's micro-steps, then the optimizer
  step) called directly, the batch on the device: the trainer without its host work;
- ``optax_microbatch``: a jitted step around ``optax.microbatch`` (optax's in-jit loop
  over micro-batches of a size dividing the batch), the batch on the device;
- ``optax_microbatch_host``: the same step given the host (NumPy) batch, whose call
  transfers it, as ``trainer``'s does: the like-for-like reference of ``trainer``;
- ``optax_microbatch_kept``: ``optax_microbatch`` without donating its state, as the
  trainer's last program must not (an out-of-memory in it then loses nothing): what
  that safety alone costs a hand-written loop;
- ``full_batch``: one jitted full-batch step (no accumulation);
- ``python_after_update``: a fixed pure-Python loop timed right after optax's update
  and again a moment later: on this CPU the program's data evicts the interpreter's
  from the caches, so the trainer's host work between two updates runs several times
  slower after a long program (``host_ms_per_update``: the trainer's time less its
  program's, both on a device batch);
- ``trainer_chunk16`` and ``trainer_device_chunk16`` (micro-batch 8 only): chunks of 16
  micro-steps, shorter than the update as where memory is tight, with a host and a
  device batch: a device batch's chunk is cut in one dispatch, all its leaves together,
  so it should cost about what the host batch's transfer does.

Micro-batches 8 and 64 use an MLP 64 -> 128 -> 64 (dispatch-bound); 512 a 1024-wide and
a 2048-wide MLP (compute-bound, the issue's two). The goal: the trainer /
optax.microbatch at most 1.15 at 8, at most 1.0 when compute-bound, for the same input
(``trainer`` / ``optax_microbatch_host`` for a host batch, ``trainer_device`` /
``optax_microbatch`` for a device batch), taken round by round (each round runs every
variant in turn, so a slow spell of this shared machine weighs on both sides of a ratio)
and reported as the median with its quartiles; each variant's median time is printed and
written beside it.

    python experiments/dispatch.py           # writes experiments/results/dispatch.{json,png}
    python experiments/dispatch.py --quick   # fewer rounds
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
from common import grouped_bars, pyplot, save_figure, write_result

import jax_adaptive as ja

T = 1024
# case -> (micro-batch, hidden width, goal): dispatch-bound, then compute-bound
CASES = {
    "8": (8, 128, 1.15),
    "64": (64, 128, 1.15),
    "512": (512, 1024, 1.0),
    "512-wide": (512, 2048, 1.0),
}
SHORT_CHUNK = 16  # a chunk shorter than the update, as a tight memory gives


def mlp(width: int, classes: int = 64, features: int = 64) -> tuple[Any, Callable]:
    """Parameters and per-example loss of a one-hidden-layer MLP classifier."""
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (features, width)) / np.sqrt(features),
        "b1": jnp.zeros(width),
        "w2": jax.random.normal(k2, (width, classes)) / np.sqrt(width),
        "b2": jnp.zeros(classes),
    }

    def loss(p: Any, batch: dict[str, Any], rng: Any = None) -> jax.Array:
        logits = jnp.tanh(batch["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    return params, loss


def batch_of(features: int = 64, classes: int = 64) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(0)
    return {
        "x": rs.randn(T, features).astype(np.float32),
        "y": rs.randint(0, classes, T).astype(np.int32),
    }


def trainer_update(params, loss, m: int, batch, *, chunk: int | str, on_device: bool):
    trainer = ja.AdaptiveTrainer(
        loss,
        optax.adam(1e-3),
        target_batch_size=T,
        micro_batch_size=m,
        chunk=chunk,
        plan_cache=False,
    )
    state = trainer.init(params, batch)
    data = jax.device_put(batch) if on_device else batch
    box = [state]

    def update() -> None:
        box[0], _ = trainer.step(box[0], data)
        jax.block_until_ready(box[0].params)

    return update, trainer


def against_optax(
    params: Any, loss: Callable, m: int, batch: dict[str, np.ndarray]
) -> tuple[dict[str, Callable[[], None]], ja.AdaptiveTrainer]:
    """The trainer and ``optax.microbatch`` at micro-batch ``m``, as ``variants``.

    The trainer with a host and a device batch and with ``chunk=1``, its last program
    called directly (`program_update`), optax's step given either batch; and the trainer
    of ``"trainer"``. `gpu_validation.py` runs them too.
    """
    update, trainer = trainer_update(params, loss, m, batch, chunk="auto", on_device=False)
    variants = {
        "trainer": update,
        "trainer_device": trainer_update(params, loss, m, batch, chunk="auto", on_device=True)[0],
        "trainer_chunk1": trainer_update(params, loss, m, batch, chunk=1, on_device=False)[0],
        "trainer_program": program_update(trainer, params, batch),
        "optax_microbatch": optax_update(params, loss, m, batch),
        "optax_microbatch_host": optax_update(params, loss, m, batch, on_device=False),
    }
    return variants, trainer


def program_update(trainer, params, batch) -> Callable[[], None]:
    """The trainer's fused program of the whole update, called directly (no host work).

    Its arguments follow `make_micro_step`'s convention; the totals' zeros and the
    scalars are on the device, made once, as the trainer's update keeps them.
    """
    chunk = trainer.accumulation_steps
    program = trainer.compile(trainer.micro_batch_size, chunk, with_optimizer_step=True)
    state = trainer.init(params, batch)
    data, weights = jax.device_put(batch), jax.device_put(np.ones(T, np.float32))
    totals = jax.device_put({"loss": np.zeros((), np.float32)})
    offset, k, target = jax.device_put((np.int32(0), np.int32(chunk + 1), np.int32(T)))
    box = [state]

    def update() -> None:
        s = box[0]
        opt = s.opt_state._replace(acc_grads=None)
        args = (s.params, opt, s.opt_state.acc_grads, s.model_state, totals, data, weights)
        params, opt_state, _, _ = program(*args, s.rng, offset, k, target)
        # The whole update's program leaves the state's accumulator, zeros, unread.
        opt_state = opt_state._replace(acc_grads=s.opt_state.acc_grads)
        box[0] = s._replace(params=params, opt_state=opt_state)
        jax.block_until_ready(params)

    return update


def adam_step(grads_of: Callable, donate: bool = True) -> tuple[Callable, Any]:
    """A jitted Adam step ``(params, opt_state, batch)`` from ``grads_of(params, batch)``.

    The parameters and the optimizer state are donated, as a hand-written loop donates
    them, unless ``donate`` is False. Returns the step and the optimizer.
    """
    optimizer = optax.adam(1e-3)

    def step(p, opt_state, b):
        updates, opt_state = optimizer.update(grads_of(p, b), opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1) if donate else ()), optimizer


def jitted_update(
    params, batch, grads_of: Callable, on_device: bool = True, donate: bool = True
) -> Callable[[], None]:
    """One `adam_step` per call on ``batch``, waited for."""
    step, optimizer = adam_step(grads_of, donate)
    box = [jax.tree.map(jnp.array, params), optimizer.init(params)]
    data = jax.device_put(batch) if on_device else batch

    def update() -> None:
        box[0], box[1] = step(box[0], box[1], data)
        jax.block_until_ready(box[0])

    return update


def microbatch_grads(loss: Callable, m: int) -> Callable:
    """``optax.microbatch``: its in-jit loop over micro-batches of ``m`` (``m`` divides T)."""

    def grads_of(p, b):
        def grad_sum(p, micro):
            return jax.grad(lambda q: loss(q, micro).sum())(p)

        grads = optax.microbatch(grad_sum, argnums=1, microbatch_size=m)(p, b)
        return jax.tree.map(lambda g: g / T, grads)

    return grads_of


def optax_update(params, loss, m: int, batch, on_device: bool = True, donate: bool = True):
    """A jitted step around `microbatch_grads` on ``batch``."""
    return jitted_update(params, batch, microbatch_grads(loss, m), on_device, donate)


def full_update(params, loss, batch):
    """One full-batch step: no accumulation."""
    return jitted_update(params, batch, lambda p, b: jax.grad(lambda q: loss(q, b).mean())(p))


def python_after(update: Callable[[], None], rounds: int = 60) -> dict[str, float]:
    """Microseconds a fixed pure-Python loop takes right after ``update``, and run again.

    What the host's caches cost the trainer's Python between two updates: on a CPU the
    program's own data evicts the interpreter's, so the same lines run slower right after
    a long program than a moment later.
    """
    table = [{"i": i, "value": float(i)} for i in range(200)]

    def python() -> float:
        return sum(row["value"] * row["i"] for row in table)

    after, again = [], []
    for _ in range(rounds):
        update()
        start = time.perf_counter()
        python()
        middle = time.perf_counter()
        python()
        after.append(middle - start)
        again.append(time.perf_counter() - middle)
    return {
        "after_update_us": 1e6 * statistics.median(after),
        "again_us": 1e6 * statistics.median(again),
    }


def measure(
    variants: dict[str, Callable[[], None]], rounds: int, per_round: int
) -> dict[str, list[float]]:
    """Seconds per update of each variant in each of the interleaved, rotated rounds."""
    for update in variants.values():  # warm-up: compiles and first-run copies
        for _ in range(3):
            update()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            for _ in range(per_round):
                variants[name]()
            times[name].append((time.perf_counter() - start) / per_round)
    return times


def paired(times: dict[str, list[float]], name: str, reference: str) -> dict[str, float]:
    """Quartiles of ``name`` / ``reference`` taken round by round.

    Both ran in the same round, seconds apart, so a slow spell of the machine weighs on
    both: the ratio's spread is the comparison's, not the machine's.
    """
    q1, median, q3 = statistics.quantiles(
        [a / b for a, b in zip(times[name], times[reference], strict=True)], n=4
    )
    return {"q1": q1, "median": median, "q3": q3}


def host_ms_per_update(times: dict[str, list[float]]) -> float:
    """The trainer's host work per update: ``trainer_device`` less its program called alone.

    Both run the same compiled program on a device batch, so the difference is the
    trainer's Python and waiting around it.
    """
    return 1e3 * (
        statistics.median(times["trainer_device"]) - statistics.median(times["trainer_program"])
    )


def short_chunk(times: dict[str, list[float]]) -> dict[str, Any]:
    """A device batch against a host batch, both in chunks shorter than the update."""
    device, host = f"trainer_device_chunk{SHORT_CHUNK}", f"trainer_chunk{SHORT_CHUNK}"
    if device not in times:
        return {}
    return {"short_chunk": {"chunk": SHORT_CHUNK, "device_over_host": paired(times, device, host)}}


def quartiles(q: dict[str, float]) -> str:
    return f"{q['median']:.3f} [{q['q1']:.3f}, {q['q3']:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="experiments/results/dispatch.json")
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    results = {}
    for case, (m, width, goal) in CASES.items():
        params, loss = mlp(width)
        batch = batch_of()
        variants, trainer = against_optax(params, loss, m, batch)
        variants |= {
            "optax_microbatch_kept": optax_update(params, loss, m, batch, donate=False),
            "full_batch": full_update(params, loss, batch),
        }
        if T // m > SHORT_CHUNK:
            for name, on_device in (("trainer", False), ("trainer_device", True)):
                variants[f"{name}_chunk{SHORT_CHUNK}"] = trainer_update(
                    params, loss, m, batch, chunk=SHORT_CHUNK, on_device=on_device
                )[0]
        times = measure(variants, rounds, args.per_round)
        seconds = {name: statistics.median(ts) for name, ts in times.items()}
        ratio = seconds["trainer"] / seconds["optax_microbatch"]
        per_round = paired(times, "trainer", "optax_microbatch_host")
        per_round_device = paired(times, "trainer_device", "optax_microbatch")
        per_round_kept = paired(times, "trainer_device", "optax_microbatch_kept")
        results[case] = {
            "micro_batch_size": m,
            "hidden_width": width,
            "micro_steps": T // m,
            "chunk": trainer.plan_info.chunk,  # decided at the first update
            "fused": trainer.plan_info.fused,  # the last program runs the optimizer step
            "ms_per_update": {name: s * 1e3 for name, s in seconds.items()},
            "trainer_over_optax_microbatch": ratio,
            "trainer_device_over_optax_microbatch": seconds["trainer_device"]
            / seconds["optax_microbatch"],
            "chunk1_over_optax_microbatch": seconds["trainer_chunk1"] / seconds["optax_microbatch"],
            "program_over_optax_microbatch": seconds["trainer_program"]
            / seconds["optax_microbatch"],
            "host_ms_per_update": host_ms_per_update(times),
            "trainer_over_full_batch": seconds["trainer"] / seconds["full_batch"],
            "trainer_over_optax_microbatch_host": seconds["trainer"]
            / seconds["optax_microbatch_host"],
            "per_round": {
                "host_batch": per_round,
                "device_batch": per_round_device,
                "device_batch_state_kept": per_round_kept,
            },
            **short_chunk(times),
            "python_after_update": python_after(variants["optax_microbatch"]),
            "goal": goal,
            "meets_goal": max(per_round["median"], per_round_device["median"]) <= goal,
        }
        print(
            f"micro-batch {m:4d}, width {width} (chunk {trainer.plan_info.chunk}): "
            + ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in seconds.items())
            + f"; trainer/optax.microbatch per round (median [quartiles]), host batch "
            f"{quartiles(per_round)}, device batch {quartiles(per_round_device)} "
            f"(goal <= {goal}); against optax's step keeping its state "
            f"{quartiles(per_round_kept)}; the trainer's program alone / optax's "
            f"{results[case]['program_over_optax_microbatch']:.3f}, its host work per update "
            f"{results[case]['host_ms_per_update'] * 1e3:.0f} us"
        )
        cold = results[case]["python_after_update"]
        print(
            f"  a fixed Python loop right after optax's update {cold['after_update_us']:.1f} us, "
            f"run again {cold['again_us']:.1f} us"
        )
        if "short_chunk" in results[case]:
            q = results[case]["short_chunk"]["device_over_host"]
            print(f"  chunks of {SHORT_CHUNK}: device batch / host batch {quartiles(q)}")
    out = write_result(
        args.out,
        {
            "target_batch_size": T,
            "optimizer": "adam",
            "rounds": rounds,
            "updates_per_round": args.per_round,
            "cases": results,
        },
    )
    plot(results, out.with_suffix(".png"))


def plot(results: dict, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [
        "trainer", "trainer_device", "trainer_chunk1", "trainer_program", "optax_microbatch",
        "optax_microbatch_host", "optax_microbatch_kept", "full_batch",
    ]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 4))
    groups = [f"{r['micro_batch_size']} x {r['hidden_width']}" for r in results.values()]
    series = {n: [r["ms_per_update"][n] for r in results.values()] for n in names}
    grouped_bars(ax, groups, series)
    ax.set_xlabel("micro-batch x hidden width")
    ax.set_ylabel("ms per update (T = 1024, Adam)")
    ax.set_yscale("log")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
