"""What a second run of the same job costs: search compiles and seconds, with the plan cache.

Runs the CLI's job (the CNN under a simulated memory limit) in fresh processes: a first
run that searches; a second with the plan cache it left; and, with JAX's persistent
compilation cache also on, a warm-up run and a run after it (XLA compiles skipped too).

    python experiments/plan_cache.py  # writes experiments/results/plan_cache.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from common import write_result

JOB = """
import json, sys
from jax_adaptive.cli.main import TrainConfig, train
config = TrainConfig(**json.loads(sys.argv[1]))
summary = train(config, out=open("/dev/null", "w"))
print(json.dumps({k: summary[k] for k in
                  ("micro_batch_size", "compiles", "search_seconds", "from_plan_cache")}))
"""


def run(config: dict) -> dict:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", JOB, json.dumps(config)],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )
    return {
        **json.loads(done.stdout.splitlines()[-1]),
        "process_seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=4096)
    parser.add_argument("--memory-limit", type=int, default=30 * 10**6)
    parser.add_argument("--out", default="experiments/results/plan_cache.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = {"target_batch_size": args.target, "memory_limit": args.memory_limit, "updates": 1}
        plans = {**base, "plan_cache": f"{tmp}/plans.json"}
        both = {**base, "plan_cache": f"{tmp}/plans2.json", "compilation_cache": f"{tmp}/xla"}
        runs = {
            "first run (search)": run(plans),
            "second run (plan cache)": run(plans),
            "first run (search, compilation cache filling)": run(both),
            "second run (plan cache + compilation cache)": run(both),
        }
    for name, r in runs.items():
        print(
            f"{name:48s} micro-batch {r['micro_batch_size']:5d}  search compiles "
            f"{0 if r['from_plan_cache'] else r['compiles']:2d}  "
            f"init {r['search_seconds']:5.2f}s"
            f"  process {r['process_seconds']:5.2f}s"
        )
    first, second = runs["first run (search)"], runs["second run (plan cache)"]
    result = {
        "job": "python -m jax_adaptive.train (CNN, synthetic images)",
        "target_batch_size": args.target,
        "memory_limit": args.memory_limit,
        "runs": runs,
        "init_seconds_ratio_second_over_first": second["search_seconds"] / first["search_seconds"],
    }
    write_result(args.out, result)
    print(f"init time, second run / first: {result['init_seconds_ratio_second_over_first']:.2f}")


if __name__ == "__main__":
    main()
