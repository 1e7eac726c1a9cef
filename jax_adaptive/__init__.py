"""jax_adaptive: the batch size you ask for, on whatever accelerator you get.

Example:
    >>> import jax_adaptive as ja
    >>> ja.search_max_size(lambda size: size <= 40, hi=100).size
    40
"""

from jax_adaptive import testing
from jax_adaptive.adaptive_step import AdaptiveStep
from jax_adaptive.buckets import (
    Bucket,
    BucketBatch,
    BucketedTrainer,
    bucket_batches,
    bucket_for,
    pad_to_bucket,
    pow2_buckets,
    predict_line,
)
from jax_adaptive.data import (
    MicroBatch,
    Rebatcher,
    leading_size,
    micro_batches,
    synthetic_images,
    synthetic_sequences,
)
from jax_adaptive.distributed import data_mesh, place, process_any, process_min
from jax_adaptive.evaluate import Evaluator
from jax_adaptive.ghost import ghost_batches
from jax_adaptive.loop import FitError
from jax_adaptive.memory import (
    Ledger,
    MemoryModel,
    device_bytes_in_use,
    device_capacity,
    estimate_peak_bytes,
    memory_report,
    tree_bytes,
)
from jax_adaptive.microbatch import MicroBatchGrad, micro_batch_grad, micro_batch_sum
from jax_adaptive.oom import HostOutOfMemory, PeerOutOfMemory, SimulatedOutOfMemory, is_oom
from jax_adaptive.plan import Plan, chunk_length, least_padding_size
from jax_adaptive.plan_cache import PlanCache, enable_compilation_cache, plan_key
from jax_adaptive.schedule import BatchSchedule, batch_schedule
from jax_adaptive.search import NothingFitsError, SearchResult, SearchTrial, search_max_size
from jax_adaptive.step import TrainState, make_micro_step, make_optimizer_step, multi_steps
from jax_adaptive.trainer import (
    AdaptiveTrainer,
    OptimizerStepOutOfMemory,
    SizeTrial,
    StateLostError,
)

__all__ = [
    "AdaptiveStep",
    "AdaptiveTrainer",
    "BatchSchedule",
    "Bucket",
    "BucketBatch",
    "BucketedTrainer",
    "Evaluator",
    "FitError",
    "HostOutOfMemory",
    "Ledger",
    "MemoryModel",
    "MicroBatch",
    "MicroBatchGrad",
    "NothingFitsError",
    "OptimizerStepOutOfMemory",
    "PeerOutOfMemory",
    "Plan",
    "PlanCache",
    "Rebatcher",
    "SearchResult",
    "SearchTrial",
    "SimulatedOutOfMemory",
    "SizeTrial",
    "StateLostError",
    "TrainState",
    "batch_schedule",
    "bucket_batches",
    "bucket_for",
    "chunk_length",
    "data_mesh",
    "device_bytes_in_use",
    "device_capacity",
    "enable_compilation_cache",
    "estimate_peak_bytes",
    "ghost_batches",
    "is_oom",
    "leading_size",
    "least_padding_size",
    "make_micro_step",
    "make_optimizer_step",
    "memory_report",
    "micro_batch_grad",
    "micro_batch_sum",
    "micro_batches",
    "multi_steps",
    "pad_to_bucket",
    "place",
    "plan_key",
    "pow2_buckets",
    "predict_line",
    "process_any",
    "process_min",
    "search_max_size",
    "synthetic_images",
    "synthetic_sequences",
    "testing",
    "tree_bytes",
]
