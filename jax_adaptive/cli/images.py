"""The command line's image path: a zoo or user's image model on synthetic images or TFDS."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TextIO

import jax
import numpy as np

from jax_adaptive import checks
from jax_adaptive.background import INTERIM
from jax_adaptive.cli.config import (
    TrainConfig,
    check_config,
    ghost_batch_size,
    make_optimizer,
    refusal,
)
from jax_adaptive.cli.datasets import ShuffledBatches, load_held_out, load_source, shard_rows
from jax_adaptive.cli.image_models import ImageModel, image_model, multiple_of
from jax_adaptive.cli.run import RunHooks, plural, run_path
from jax_adaptive.cli.workdir import Workdir, plan_entry
from jax_adaptive.distributed import data_mesh
from jax_adaptive.plan_cache import PlanCache, plan_key
from jax_adaptive.schedule import BatchSchedule
from jax_adaptive.step import TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = ["SIMULATED_SHARE", "planning_text", "train_images"]

SIMULATED_SHARE = 4
"""The simulated device holds about ``1 / SIMULATED_SHARE`` of a target batch's activations."""

# What defines the training, besides the schedule and the ghost batch: a resumed
# checkpoint must match them.
_RUN_FIELDS = ("model", "dataset", "target_batch_size", "optimizer", "learning_rate", "seed")


class _Device(NamedTuple):
    """The device a run plans for, and what measuring it cost this run.

    ``limit``: its bytes (None: the device's own); ``words``: what the plan line says of
    it; ``seconds``, ``compiles``: spent measuring a simulated one (0: none was measured).
    """

    limit: int | None
    words: str
    seconds: float = 0.0
    compiles: int = 0


_MEASURE = 1
"""The simulated device's measurement as this code makes it: part of its plan cache key,
raised when `_memory_limit` measures otherwise, so that no earlier run's size is taken."""


def _memory_limit(config: TrainConfig, model: ImageModel, params: Any, model_state: Any,
                  example: Any, out: TextIO) -> _Device:  # fmt: skip
    """``--memory-limit``, or a small device simulated on a CPU (``auto``, no limit).

    It holds the smallest size's ledger and a `SIMULATED_SHARE`-th of the rest of the
    largest target batch's, and at least the state beside the first (the optimizer step).
    A run of the same job (a ``--resume``, a second run) takes the size an earlier one
    measured from the plan cache, compiling nothing (`_simulated_key`).
    """
    cpu = jax.devices()[0].platform == "cpu"
    if config.memory_limit is not None:
        what = "a simulated device" if cpu else "a memory limit"
        limit = config.memory_limit
        return _Device(limit, f"{what} of {limit / 1e6:.2f} MB (--memory-limit)")
    why_not = _not_simulated(config, cpu)
    if why_not is not None:
        return _Device(None, why_not)
    start, T = time.perf_counter(), max(config.target_sizes())
    small = min(T, multiple_of(config, model))
    cache = PlanCache.from_arg(config.plan_cache_arg())
    key = None if cache is None else _simulated_key(config, model, params, model_state,
                                                    example, T, small)  # fmt: skip
    entry = None if cache is None or key is None else cache.get(key)
    cached = None if entry is None else entry.get("simulated_device_bytes")
    about = f"room for about a quarter of the target batch of {T} and the optimizer step; "
    if checks.is_int(cached) and cached >= 1:
        print(
            f"simulating a device of {cached / 1e6:.2f} MB on this CPU ({about}measured by an "
            f"earlier run of this job, from the plan cache {cache.path}), so that the plan "
            "searches and accumulates: --memory-limit BYTES sets the size, "
            "--no-simulated-device trains without a cap",
            file=out,
        )  # fmt: skip
        return _Device(int(cached), f"a simulated device of {cached / 1e6:.2f} MB")
    probe = AdaptiveTrainer(
        model.loss_fn, make_optimizer(config), target_batch_size=T, micro_batch_size=T,
        has_aux=True, has_state=bool(model.mutable), plan_cache=False,
    )  # fmt: skip
    probe.init(params, example, model_state=model_state)
    first = probe.ledger(small)
    whole = probe.ledger(T).total
    limit = max(first.total + (whole - first.total) // SIMULATED_SHARE, first.total + first.state)
    seconds = time.perf_counter() - start
    if cache is not None and key is not None:
        cache.put(key, {"simulated_device_bytes": limit, "target_batch_size": T, "small": small})
    print(
        f"simulating a device of {limit / 1e6:.2f} MB on this CPU ({about}measured in "
        f"{probe.compiles} compiles, {seconds:.1f}s), so that the plan searches and "
        "accumulates: --memory-limit BYTES sets the size, --no-simulated-device trains "
        "without a cap",
        file=out,
    )
    return _Device(limit, f"a simulated device of {limit / 1e6:.2f} MB", seconds, probe.compiles)


def _simulated_key(config: TrainConfig, model: ImageModel, params: Any, model_state: Any,
                   example: Any, T: int, small: int) -> str | None:  # fmt: skip
    """The plan cache's key of the simulated device: all that decides its measurement.

    The training loss's code and shapes (its lowered text at ``small`` examples: a trace,
    no compile), the optimizer, the two sizes measured, the share, the device, JAX and
    `_MEASURE`. None when the loss cannot be lowered alone (the device is then measured).
    """
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((small, *np.shape(x)[1:]), np.asarray(x).dtype), example
    )
    args = (params, model_state, batch) if model.mutable else (params, batch)
    try:
        lowered = jax.jit(model.loss_fn).lower(*args, jax.random.key(config.seed))
    except Exception:  # the probe's own compile raises it, with its traceback
        return None
    device = jax.devices()[0]
    return plan_key(
        what="simulated device", program=hashlib.sha256(lowered.as_text().encode()).hexdigest(),
        optimizer=config.optimizer, target=T, small=small, share=SIMULATED_SHARE,
        platform=device.platform, device_kind=device.device_kind, jax=jax.__version__,
        measure=_MEASURE,
    )  # fmt: skip


def _not_simulated(config: TrainConfig, cpu: bool) -> str | None:
    """Why a run with no ``--memory-limit`` simulates no device, or None when it does.

    Examples:
        >>> _not_simulated(TrainConfig(data_parallel=True), cpu=True)
        "no simulated device (--data-parallel: each device's whole memory)"
        >>> _not_simulated(TrainConfig(), cpu=True) is None
        True
    """
    if not cpu:
        return "the device's own capacity"
    return refusal(
        (not config.simulate_device, "no simulated device (--no-simulated-device)"),
        (config.micro_batch_size != "auto",
         f"no simulated device (--micro-batch-size {config.micro_batch_size} is fixed)"),
        (config.data_parallel, "no simulated device (--data-parallel: each device's whole "
         "memory)"),
    )  # fmt: skip


def _plan_line(
    trainer: AdaptiveTrainer, search: dict[str, Any], done: int, config: TrainConfig,
    ghost: int | None, device: str,
) -> str:  # fmt: skip
    largest, where = trainer.plan_info.largest, search["from_plan_cache"]
    objective, why = config.chosen_objective()
    return (
        f"plan: micro-batch {trainer.micro_batch_size} x {trainer.accumulation_steps} "
        f"accumulation steps = target batch {trainer.target_batch_size}; "
        f"{plural(search['compiles'], 'size')} compiled in {search['search_seconds']:.1f}s"
        + (f" ({search['search_seconds'] / one:.1f}x one compile of {largest})"
           if (one := search.get("one_compile_seconds")) and search["compiles"] > 1 else "")
        + (f"; {trainer.micro_batch_size // trainer.shards} per device on {trainer.shards}"
           if trainer.shards > 1 else "")
        + (f" (largest that fits: {largest})"
           if largest not in (None, trainer.micro_batch_size) else "")
        + (f" ({bound})" if (bound := trainer.plan_info.bound()) else "")
        + (f" (from the plan cache {where}; --no-plan-cache searches again)" if where else "")
        + ("; the search for the largest goes on beside training (--background-search)"
           if search["plan_source"] == INTERIM else "")
        + (f"; objective {objective} ({why})" if why else "")
        + f"; {device}"
        + (f"; batch schedule {config.batch_schedule}" if config.batch_schedule else "")
        + (f"; BatchNorm over ghost batches of {ghost}" if ghost else "")
        + (f"; resumed at update {done}" if done else "")
    )  # fmt: skip


def _image_line(line: dict[str, Any]) -> str:
    text = (
        f"update {line['update']:4d}  loss {line['loss']:.4f}  train_accuracy "
        f"{line['train_accuracy']:.3f}  micro-batch {line['micro_batch_size']}"
    )
    if "target_batch_size" in line:  # a batch-size schedule: the size of each update
        text += f" x {line['accumulation_steps']} of target batch {line['target_batch_size']}"
    if "eval_loss" in line:
        text += (
            f"\nheld-out after update {line['update']}: loss {line['eval_loss']:.4f}  "
            f"accuracy {line['eval_accuracy']:.3f}  ({line['eval_examples']} examples, "
            f"batches of {line['eval_batch_size']})"
        )
    return text


def _train_images(config: TrainConfig, workdir: Workdir | None, out: TextIO) -> dict[str, Any]:
    source = load_source(config.dataset, data_dir=config.data_dir, seed=config.seed)
    example = jax.tree.map(lambda x: np.asarray(x)[None], source[0])  # its shapes
    model = image_model(config, source.num_classes, source[0])
    params, model_state = model.variables(jax.random.key(config.seed), example["image"])
    device = _memory_limit(config, model, params, model_state, example, out)
    limit = device.limit
    trainer = AdaptiveTrainer(
        model.loss_fn, make_optimizer(config), target_batch_size=config.schedule(),
        micro_batch_size=config.micro_batch_size, memory_limit=limit,
        multiple_of=multiple_of(config, model), has_aux=True, has_state=bool(model.mutable),
        objective=config.chosen_objective()[0], timing_budget=config.timing_budget(),
        plan_cache=config.plan_cache_arg(),
        mesh=data_mesh() if config.data_parallel else None,
        background_search=config.background_search,
    )  # fmt: skip
    start = time.perf_counter()
    state = trainer.init(params, example, rng=jax.random.key(config.seed), model_state=model_state)
    cached = any(t.decided_by == "plan cache" for t in trainer.search_log)
    found = trainer.plan_info.largest
    search = {
        "compiles": trainer.compiles,
        "search_seconds": time.perf_counter() - start,
        "one_compile_seconds": next(  # of the size found: what knowing it would have cost
            (
                t.seconds
                for t in trainer.search_log
                if t.size == found and t.decided_by == "estimate"
            ),
            None,
        ),
        "from_plan_cache": str(trainer.plan_cache.path) if cached else None,
        "plan_source": trainer.plan_info.source,  # searched, plan cache or fixed
        "memory_limit": limit,
        "device_seconds": device.seconds,  # measuring the simulated device (0: none, cached)
        "device_compiles": device.compiles,
    }
    held_out = None
    if config.eval_every:
        held_out = load_held_out(config.dataset, data_dir=config.data_dir, seed=config.seed)
        own = shard_rows(len(held_out["label"]), (jax.process_index(), jax.process_count()))
        held_out = {k: v[own] for k, v in held_out.items()}  # this process's share
    state, position, done = (state, 0, 0) if workdir is None else workdir.resume(state)
    if done:
        trainer.plan(state, example)  # the schedule goes on
    print(_plan_line(trainer, search, done, config, model.ghost, device.words), file=out)

    def evaluate(state: TrainState) -> dict[str, Any]:
        metrics = trainer.evaluate(state, held_out, model.metric_fn)
        return {
            "eval_loss": metrics["loss"], "eval_accuracy": metrics["accuracy"],
            "eval_examples": metrics["examples"],
            "eval_batch_size": trainer.evaluator(model.metric_fn).batch_size,
        }  # fmt: skip

    searching = [search["plan_source"] == INTERIM]  # --background-search, until its plan runs

    def step(state: TrainState, batch: dict[str, np.ndarray]) -> tuple[TrainState, dict]:
        T = trainer.target_batch_size  # of the state it returned last
        state, metrics = trainer.step(state, batch)
        scheduled = {} if config.batch_schedule is None else {"target_batch_size": T}
        ended = {}
        if searching[0] and trainer.plan_info.source != INTERIM:  # this update ran its plan
            searching[0] = False
            ended = {"search_ended": trainer.plan_info.search or "it ended"}
        return state, {
            "loss": float(metrics["loss"]), "train_accuracy": float(metrics["accuracy"]),
            "micro_batch_size": int(metrics["micro_batch_size"]),
            "accumulation_steps": int(metrics["accumulation_steps"]), **scheduled,
            "examples": T, **ended,
        }  # fmt: skip

    def plans() -> dict[str, Any]:
        return {"plans": [plan_entry(trainer)], "search_seconds": search["search_seconds"]}

    updates = config.updates
    if config.epochs is not None:
        updates = _updates_in(config.epochs * len(source), config.schedule())
    hooks = RunHooks(
        config, done=done, updates=updates, describe=_image_line, plans=plans,
        compiles=lambda: trainer.compiles, workdir=workdir, out=out,
        evaluate=evaluate if held_out is not None else None,
    )  # fmt: skip
    batches = ShuffledBatches(
        source, trainer.target_batch_size, seed=config.seed, start=position,
        shard=(jax.process_index(), jax.process_count()),
    )  # fmt: skip
    hooks.run(step, state, _scheduled(batches, trainer.schedule, done))
    if searching[0]:  # a run shorter than the search: its plan goes to the plan cache
        trainer.finish_search()
        print(f"the search beside training ended after the last update: "
              f"{trainer.plan_info.search}; the next run starts from its plan "
              f"{trainer.micro_batch_size} x {trainer.accumulation_steps}", file=out)  # fmt: skip
        if workdir is not None:
            workdir.write_plan(**plans())
    lines, evaluated = hooks.lines, [line for line in hooks.lines if "eval_loss" in line]
    return {
        "micro_batch_size": trainer.micro_batch_size,
        "accumulation_steps": trainer.accumulation_steps,
        **search,
        "from_plan_cache": search["from_plan_cache"] is not None,
        "compiles_total": trainer.compiles,  # plan.json's: the search's and every re-plan's
        **hooks.timing(),
        "target_batch_sizes": [line["examples"] for line in lines],
        "losses": [line["loss"] for line in lines],
        "train_accuracy": lines[-1]["train_accuracy"] if lines else None,
        "held_out": {k[5:]: v for k, v in evaluated[-1].items() if k.startswith("eval_")}
        if evaluated
        else None,
    }


def _scheduled(
    batches: ShuffledBatches, schedule: Callable[[int], int], done: int
) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """From update ``done`` on: each update's batch and the stream's position after it."""
    for updates in itertools.count(done):
        batches.batch_size = schedule(updates)
        yield next(batches), batches.position


def _updates_in(examples: float, schedule: BatchSchedule) -> int:
    """The updates whose target batches add up to ``examples`` (at least one).

    Examples:
        >>> _updates_in(100, BatchSchedule([(0, 8), (2, 32)]))  # 8 + 8 + 32 + 32 = 80
        4
    """
    if schedule.constant is not None:
        return max(1, int(examples / schedule.constant))
    updates, total = 0, 0
    while total + schedule(updates) <= examples:
        total += schedule(updates)
        updates += 1
    return max(1, updates)


def train_images(config: TrainConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """Trains an image model as configured (`jax_adaptive.cli.main.train`): a summary."""
    check_config(config)
    run = {f: getattr(config, f) for f in _RUN_FIELDS}  # what a resumed checkpoint must match
    if config.batch_schedule is not None:
        run["batch_schedule"] = config.batch_schedule
    # BatchNorm's statistics are the training's (a user's model: if it has BatchNorm)
    if (ghost := ghost_batch_size(config, ":" in config.model or None)) is not None:
        run["ghost_batch_size"] = ghost
    # The stream's position after an update: the examples of the updates so far.
    per_update = config.target_batch_size if config.batch_schedule is None else (
        config.schedule().examples_before)  # fmt: skip
    return run_path(
        config, _train_images, _summary_line, out=out, run=run, examples_per_update=per_update
    )


def _summary_line(summary: dict[str, Any]) -> str:
    losses, held_out, sizes = summary["losses"], summary["held_out"], summary["target_batch_sizes"]
    changes = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    compiles = summary["compiles_total"]
    return (
        f"summary: plan {summary['micro_batch_size']} x {summary['accumulation_steps']}, "
        + (f"target batch {' -> '.join(map(str, changes))}, " if len(changes) > 1 else "")
        + f"{compiles} compile{'s' * (compiles != 1)}"
        + (" (the plan from the plan cache)" if summary["from_plan_cache"] else "")
        + f", {planning_text(summary)}, {summary['speed']}, final "
        + (f"loss {losses[-1]:.4f} train_accuracy {summary['train_accuracy']:.3f}" if losses
           else "loss n/a")
        + (f", held-out loss {held_out['loss']:.4f} accuracy {held_out['accuracy']:.3f} "
           f"({held_out['examples']} examples)" if held_out else "")
    )  # fmt: skip


_INIT = {  # what the seconds of init went to, by how the plan was decided
    "searched": "the search",
    INTERIM: "the first size found to fit, the search going on beside training",
    "plan cache": "the plan from the plan cache, no search",
    "fixed": "the fixed micro-batch, no search",
}


def planning_text(summary: dict[str, Any]) -> str:
    """The summary's planning seconds and what they went to: only what this run did.

    Examples:
        >>> print(planning_text({"device_seconds": 0.0, "search_seconds": 1.04,
        ...                      "plan_source": "plan cache", "compiling_seconds": 0.9,
        ...                      "compiling_updates": 1}))
        1.9s planning (1.0s the plan from the plan cache, no search; 0.9s in 1 update that compiled)
    """
    parts, total = [], 0.0
    if summary.get("device_seconds"):
        seconds = summary["device_seconds"]
        count = summary.get("device_compiles", 0)
        parts.append(f"{seconds:.1f}s measuring the simulated device in {plural(count, 'compile')}")
        total += seconds
    init = _INIT.get(summary.get("plan_source") or "searched", "the plan")
    parts.append(f"{summary['search_seconds']:.1f}s {init}")
    total += summary["search_seconds"]
    if summary["compiling_updates"]:
        parts.append(f"{summary['compiling_seconds']:.1f}s in "
                     f"{plural(summary['compiling_updates'], 'update')} that compiled")  # fmt: skip
        total += summary["compiling_seconds"]
    return f"{total:.1f}s planning ({'; '.join(parts)})"
