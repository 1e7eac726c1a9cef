"""Host bytes read per process per update: process-local batches against global ones.

Under ``jax.distributed`` each process passes the trainer only its share of every target
batch (the default), or, with ``global_batches=True`` (the form before issue 30), the
whole batch, keeping its rows. This runs both forms as 1, 2 and 4 processes on
localhost (gloo) over the same 4 CPU devices (4, 2 and 1 per process), each process
reading its examples from a file on disk with ``os.pread``: the bytes are those the
reads returned, counted, not computed. The two forms' parameters after the same updates
are compared too.

    python experiments/hosts.py  # writes experiments/results/hosts.json
    python experiments/hosts.py --updates 2 --target 128  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 4  # over all processes
SHAPE = (32, 32, 3)  # one example's image, float32: 12,288 bytes, and an int32 label
CLASSES = 10


def example_bytes() -> int:
    """The bytes of one example in the data file: its image and its label."""
    return int(np.prod(SHAPE)) * 4 + 4


# ------------------------------------------------------------------ a worker process


class FileRows:
    """Reads rows of the data file with ``os.pread``, counting the bytes it read."""

    def __init__(self, path: str):
        self.fd, self.bytes_read = os.open(path, os.O_RDONLY), 0

    def rows(self, start: int, count: int) -> dict[str, np.ndarray]:
        """Examples ``start`` to ``start + count``, one read."""
        size = example_bytes()
        raw = os.pread(self.fd, count * size, start * size)
        self.bytes_read += len(raw)
        records = np.frombuffer(raw, np.uint8).reshape(count, size)
        images = records[:, :-4].copy().view(np.float32).reshape(count, *SHAPE)
        return {"image": images, "label": records[:, -4:].copy().view(np.int32)[:, 0]}


def loss_fn(params: Any, batch: Any, rng: Any) -> Any:
    """Per-example cross-entropy of a linear classifier on the flattened image."""
    import jax
    import jax.numpy as jnp

    logits = batch["image"].reshape(batch["image"].shape[0], -1) @ params["w"] + params["b"]
    log_p = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(log_p, batch["label"][:, None], axis=1)[:, 0]


def worker(args: argparse.Namespace) -> None:
    """One process: trains both forms on the same examples, writes its figures as JSON."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES // args.processes}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import optax

    import jax_adaptive as ja

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"localhost:{args.port}", num_processes=args.processes, process_id=args.index
        )
    T, P, p = args.target, args.processes, args.index
    features = int(np.prod(SHAPE))
    params = {"w": np.zeros((features, CLASSES), np.float32), "b": np.zeros(CLASSES, np.float32)}
    figures: dict[str, Any] = {}
    for form in ("process-local", "global"):
        whole = form == "global"
        reader = FileRows(args.data)

        def batches(reader: FileRows = reader, whole: bool = whole) -> Any:
            for update in range(args.updates + 1):  # the first: compiles, not timed
                yield (
                    reader.rows(update * T, T)
                    if whole
                    else reader.rows(update * T + p * T // P, T // P)
                )

        trainer = ja.AdaptiveTrainer(
            loss_fn, optax.adam(1e-3), target_batch_size=T, micro_batch_size=args.micro,
            mesh=ja.data_mesh(), global_batches=whole, plan_cache=False,
        )  # fmt: skip
        state = trainer.init(params, reader.rows(0, 1))
        reader.bytes_read = 0
        stream = batches()
        state, _ = trainer.fit(state, stream, num_updates=1, read_ahead=0)
        jax.block_until_ready(state.params)
        start, read_before = time.perf_counter(), reader.bytes_read
        state, _ = trainer.fit(state, stream, num_updates=args.updates, read_ahead=0)
        jax.block_until_ready(state.params)
        seconds = time.perf_counter() - start
        figures[form] = {
            "bytes_read_per_update": (reader.bytes_read - read_before) / args.updates,
            "seconds_per_update": seconds / args.updates,
            "micro_batch_size": trainer.micro_batch_size,
            "params": {
                k: np.asarray(v.addressable_shards[0].data) for k, v in state.params.items()
            },
        }
    difference = max(
        float(
            np.max(np.abs(figures["process-local"]["params"][k] - figures["global"]["params"][k]))
        )
        for k in params
    )
    for form in figures:
        del figures[form]["params"]
    figures["max_parameter_difference"] = difference
    Path(args.out).write_text(json.dumps(figures))
    if args.processes > 1:
        jax.distributed.shutdown()


# ------------------------------------------------------------------ the driver


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run(processes: int, data: Path, tmp: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs ``processes`` workers on localhost; each one's figures."""
    port, outs = free_port(), [tmp / f"{processes}-{i}.json" for i in range(processes)]
    common = ["--worker", "--processes", processes, "--port", port, "--data", data]
    common += ["--target", args.target, "--updates", args.updates, "--micro", args.micro]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *map(str, common), "--index", str(i), "--out", str(out)],
            cwd=ROOT,
        )
        for i, out in enumerate(outs)
    ]
    for proc in procs:
        if proc.wait(timeout=600):
            raise SystemExit(f"a worker of {processes} processes failed ({proc.returncode})")
    return [json.loads(out.read_text()) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=512, help="target batch size T")
    parser.add_argument("--updates", type=int, default=4, help="timed updates per form")
    parser.add_argument("--micro", type=int, default=96, help="the micro-batch size")
    parser.add_argument("--out", default=str(ROOT / "experiments/results/hosts.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("processes", "port", "index"):
        parser.add_argument(f"--{name}", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    with tempfile.TemporaryDirectory() as tmp:
        examples = (args.updates + 1) * args.target
        rng = np.random.default_rng(0)
        images = rng.normal(size=(examples, int(np.prod(SHAPE)))).astype(np.float32)
        labels = rng.integers(0, CLASSES, size=(examples, 1)).astype(np.int32)
        data = Path(tmp) / "examples.bin"
        data.write_bytes(
            np.concatenate([images.view(np.uint8), labels.view(np.uint8)], 1).tobytes()
        )
        rows = []
        for processes in (1, 2, 4):
            figures = run(processes, data, Path(tmp), args)
            for form in ("process-local", "global"):
                each = [f[form] for f in figures]
                rows.append({
                    "processes": processes, "form": form,
                    "bytes_read_per_process_per_update": max(
                        f["bytes_read_per_update"] for f in each),
                    "seconds_per_update": max(f["seconds_per_update"] for f in each),
                    "micro_batch_size": each[0]["micro_batch_size"],
                    "max_parameter_difference_between_forms": max(
                        f["max_parameter_difference"] for f in figures),
                })  # fmt: skip
    print(f"T = {args.target}, {DEVICES} CPU devices in all, {example_bytes():,} bytes an example")
    print(f"{'processes':>9}  {'form':<13}  {'MB read/process/update':>22}  {'s/update':>8}")
    for row in rows:
        mb = row["bytes_read_per_process_per_update"] / 1e6
        print(f"{row['processes']:>9}  {row['form']:<13}  {mb:>22.2f}  "
              f"{row['seconds_per_update']:>8.3f}")  # fmt: skip
    sys.path.insert(0, str(ROOT / "experiments"))
    from common import write_result

    write_result(args.out, {"target_batch_size": args.target, "devices": DEVICES,
                            "example_bytes": example_bytes(), "updates": args.updates,
                            "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
