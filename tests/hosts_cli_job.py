"""One of two ``jax.distributed`` processes of the command line, run as a script.

``python hosts_cli_job.py ID PORT OUT.json KILL_AT FLAGS...`` runs
``python -m jax_adaptive.train --distributed localhost:PORT,2,ID FLAGS...`` on 4 CPU
devices, recording which examples of the synthetic source this process's data stream
read (index and epoch); with KILL_AT > 0 the process kills itself (SIGKILL) once the
checkpoint of that update is written, as a machine that fails would (``KILL_AT@ID``: only
process ID does, its peer survives).
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import json
import signal

from jax_adaptive.cli import checkpoints, datasets
from jax_adaptive.cli.main import main

READ: list[tuple[int, int]] = []  # (epoch, example index) of each example the stream read


class _Recorded:
    """A source that records each example read through it (the real one answers)."""

    def __init__(self, source, epoch):
        self.source, self.epoch, self.num_classes = source, epoch, source.num_classes

    def __len__(self):
        return len(self.source)

    def __getitem__(self, index):
        READ.append((self.epoch, int(index)))
        return self.source[index]


def _recording(next_batch):
    def spied(batches):
        source = batches.source
        batches.source = _Recorded(source, batches.position // len(source))
        try:
            return next_batch(batches)
        finally:
            batches.source = source

    return spied


def _killing(save, at):
    def spied(self, update, state, position):
        save(self, update, state, position)
        if update == at:
            self.close()  # the checkpoint is written, on every process
            os.kill(os.getpid(), signal.SIGKILL)

    return spied


if __name__ == "__main__":
    process_id, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    kill_at, _, who = sys.argv[4].partition("@")
    datasets.ShuffledBatches.__next__ = _recording(datasets.ShuffledBatches.__next__)
    if who in ("", str(process_id)):
        checkpoints.Checkpoints.save = _killing(checkpoints.Checkpoints.save, int(kill_at))
    status = main(["--distributed", f"localhost:{port},2,{process_id}", *sys.argv[5:]])
    with open(out, "w") as f:
        json.dump({"status": status, "read": READ}, f)
    sys.exit(status)
