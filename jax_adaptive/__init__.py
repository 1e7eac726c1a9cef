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
* a model that can rematerialise its layers: `RematChoices` of its losses, one per policy;
* evaluation and prediction: `Evaluator` (or `AdaptiveTrainer.evaluate`);
* no code: ``python -m jax_adaptive.train``.

Examples:
    >>> import jax_adaptive as ja
    >>> ja.search_max_size(lambda size: size <= 40, hi=100).size
    40
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for readers and type checkers
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
    from jax_adaptive.nnx_grad import micro_batch_value_and_grad
    from jax_adaptive.nnx_step import AdaptiveNnxStep
    from jax_adaptive.nnx_trainer import NnxTrainer
    from jax_adaptive.plan import Plan, SizeTrial
    from jax_adaptive.plan_cache import PlanCache
    from jax_adaptive.remat import RematChoices
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
    "RematChoices",
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

# Each name's module. They are imported at first use (PEP 562), so that importing a module
# of the package, as ``python -m jax_adaptive.train`` does, does not start JAX: the command
# line answers --help and a bad flag at once.
_MODULES = {
    "AdaptiveNnxStep": "nnx_step",
    "AdaptiveStep": "adaptive_step",
    "AdaptiveTrainer": "trainer",
    "BucketBatch": "buckets",
    "BucketedTrainer": "buckets",
    "Evaluator": "evaluate",
    "FitError": "errors",
    "Ledger": "memory",
    "MicroBatchGrad": "microbatch",
    "NnxTrainer": "nnx_trainer",
    "NothingFitsError": "errors",
    "OptimizerStepOutOfMemory": "errors",
    "Plan": "plan",
    "PlanCache": "plan_cache",
    "Rebatcher": "data",
    "RematChoices": "remat",
    "SearchResult": "search",
    "SimulatedOutOfMemory": "errors",
    "SizeTrial": "plan",
    "StateLostError": "errors",
    "TrainState": "step",
    "bucket_batches": "buckets",
    "data_mesh": "distributed",
    "estimate_peak_bytes": "memory",
    "ghost_batches": "ghost",
    "is_oom": "errors",
    "micro_batch_grad": "microbatch",
    "micro_batch_value_and_grad": "nnx_grad",
    "pow2_buckets": "buckets",
    "search_max_size": "search",
}


def __getattr__(name: str) -> Any:
    """A public name or a module of the package (``ja.loop``), imported at first use."""
    if name in _MODULES:
        value = getattr(importlib.import_module(f"jax_adaptive.{_MODULES[name]}"), name)
        globals()[name] = value
        return value
    try:  # as the eager imports made every module an attribute
        return importlib.import_module(f"jax_adaptive.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"jax_adaptive.{name}":
            raise
    raise AttributeError(f"module 'jax_adaptive' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names with the module's own."""
    return sorted({*globals(), *__all__})
