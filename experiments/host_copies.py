"""Bytes the trainer copies from the device to the host, per update, before and after.

Recovery keeps host copies so that a failed micro-step costs one micro-step: these are
counted here by wrapping ``jax.device_get`` (every copy the trainer makes goes through
it), so the same count applies to any checkout. The model: 8 MiB of fp32 parameters
(a 1024 x 2048 matrix) under Adam (a 16 MiB inner state), target batch 16.

* ``first_update_1_step`` / ``first_update_4_steps``: a size's first update (cautious:
  each micro-step's result is kept), at micro-batch 16 and 4;
* ``steady_update_4_steps``: a later update of the same size;
* ``update_after_oom``: an update whose first micro-step runs out of memory (injected,
  as a real one: the donated inputs deleted), then goes on at a smaller size.

    python experiments/host_copies.py                        # this checkout
    python experiments/host_copies.py --baseline /tmp/old    # and a checkout to compare

writes ``experiments/results/host_copies.json`` (MiB per update, and the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

D_IN, D_OUT, T = 1024, 2048, 16
MIB = 2**20


class DeviceGetCounter:
    """Wraps ``jax.device_get`` and adds up the bytes of what it returns."""

    def __init__(self):
        self.bytes = 0
        self._real = jax.device_get

    def __enter__(self) -> DeviceGetCounter:
        def counting(tree: Any) -> Any:
            out = self._real(tree)
            self.bytes += sum(np.asarray(x).nbytes for x in jax.tree.leaves(out))
            return out

        jax.device_get = counting
        return self

    def __exit__(self, *exc: object) -> None:
        jax.device_get = self._real


def loss_fn(params, batch, rng):
    return ((batch["x"] @ params["w"] - batch["y"]) ** 2).mean(axis=1)


def _problem():
    rng = np.random.default_rng(0)
    params = {"w": np.zeros((D_IN, D_OUT), np.float32)}
    batch = {
        "x": rng.normal(size=(T, D_IN)).astype(np.float32),
        "y": rng.normal(size=(T, D_OUT)).astype(np.float32),
    }
    return params, batch


def _updates(micro: int | str, count: int, fail_first: bool = False) -> list[float]:
    """MiB copied by each of ``count`` updates (the last one's first micro-step fails)."""
    import jax_adaptive as ja
    from jax_adaptive import testing

    params, batch = _problem()
    trainer = ja.AdaptiveTrainer(
        loss_fn, optax.adam(1e-3), target_batch_size=T, micro_batch_size=micro, plan_cache=False
    )
    state = trainer.init(params, batch)
    mib = []
    for i in range(count):
        with DeviceGetCounter() as counter:
            if fail_first and i == count - 1:
                with testing.inject_oom(trainer, executions={1}):
                    state, _ = trainer.step(state, batch)
            else:
                state, _ = trainer.step(state, batch)
            jax.block_until_ready(state)
        mib.append(counter.bytes / MIB)
    return mib


def measure() -> dict[str, float]:
    first_1 = _updates(T, 1)
    four = _updates(4, 2)
    after_oom = _updates("auto", 2, fail_first=True)
    return {
        "first_update_1_step": first_1[0],
        "first_update_4_steps": four[0],
        "steady_update_4_steps": four[1],
        "update_after_oom": after_oom[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another checkout's root, measured the same way")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=Path(__file__).parent / "results" / "host_copies.json")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure()))
        return
    result: dict[str, Any] = {"parameters_mib": D_IN * D_OUT * 4 / MIB, "after": measure()}
    if args.baseline:
        env = {**os.environ, "PYTHONPATH": str(Path(args.baseline).absolute())}
        done = subprocess.run(
            [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        result["before"] = json.loads(line.removeprefix("RESULT "))
        rev = ["git", "-C", args.baseline, "rev-parse", "--short", "HEAD"]
        result["baseline"] = subprocess.run(rev, capture_output=True, text=True).stdout.strip()
        result["before_over_after"] = {
            k: (v / result["after"][k] if result["after"][k] else None)
            for k, v in result["before"].items()
        }
    for key, after in result["after"].items():
        before = result.get("before", {}).get(key)
        print(
            f"{key:24s} after {after:7.2f} MiB"
            + (f"  before {before:7.2f} MiB" if before is not None else "")
        )
    from common import write_result

    write_result(args.out, result)


if __name__ == "__main__":
    main()
