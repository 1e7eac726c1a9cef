"""jax_adaptive: the batch size you ask for, on whatever accelerator you get.

The top level holds the entry points, what they return and what they raise; everything
else is importable from its module (``jax_adaptive.memory.tree_bytes``, ...).

Which entry point:

* a per-example loss and an optax optimizer: `AdaptiveTrainer`;
* a Flax NNX training step (``@nnx.jit``): `AdaptiveNnxStep` around it,
  `micro_batch_value_and_grad` inside it;
* a Flax NNX module and an optax optimizer: `NnxTrainer`;
* your own jitted training step: `AdaptiveStep` around it, `micro_batch_grad` inside it;
* inputs of varying shape (sequences): `BucketedTrainer`, `bucket_batches`;
* evaluation and prediction: `Evaluator` (or `AdaptiveTrainer.evaluate`);
* no code: ``python -m jax_adaptive.train``.

Examples:
    >>> import jax_adaptive as ja
    >>> ja.search_max_size(lambda size: size <= 40, hi=100).size
    40
"""

from jax_adaptive.adaptive_step import AdaptiveStep
from jax_adaptive.buckets import BucketBatch, BucketedTrainer, bucket_batches, pow2_buckets
from jax_adaptive.data import Rebatcher
from jax_adaptive.distributed import data_mesh
from jax_adaptive.errors import (
    FitError,
    NothingFitsError,
    OptimizerStepOutOfMemory,
    SimulatedOutOfMemory,
    StateLostError,
    is_oom,
)
from jax_adaptive.evaluate import Evaluator
from jax_adaptive.ghost import ghost_batches
from jax_adaptive.memory import Ledger, estimate_peak_bytes
from jax_adaptive.microbatch import MicroBatchGrad, micro_batch_grad
from jax_adaptive.nnx_step import AdaptiveNnxStep, micro_batch_value_and_grad
from jax_adaptive.nnx_trainer import NnxTrainer
from jax_adaptive.plan import Plan, SizeTrial
from jax_adaptive.plan_cache import PlanCache
from jax_adaptive.search import SearchResult, search_max_size
from jax_adaptive.step import TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = [
    "AdaptiveNnxStep",
    "AdaptiveStep",
    "AdaptiveTrainer",
    "BucketBatch",
    "BucketedTrainer",
    "Evaluator",
    "FitError",
    "Ledger",
    "MicroBatchGrad",
    "NnxTrainer",
    "NothingFitsError",
    "OptimizerStepOutOfMemory",
    "Plan",
    "PlanCache",
    "Rebatcher",
    "SearchResult",
    "SimulatedOutOfMemory",
    "SizeTrial",
    "StateLostError",
    "TrainState",
    "bucket_batches",
    "data_mesh",
    "estimate_peak_bytes",
    "ghost_batches",
    "is_oom",
    "micro_batch_grad",
    "micro_batch_value_and_grad",
    "pow2_buckets",
    "search_max_size",
]
