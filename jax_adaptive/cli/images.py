"""The command line's image path: a zoo or user's image model on synthetic images or TFDS.

`train_images` builds the model (`jax_adaptive.cli.image_models.image_model`) and an
`AdaptiveTrainer` from a `jax_adaptive.cli.config.TrainConfig`, simulates a small device
on a CPU with no memory limit, plans, resumes from the workdir's latest checkpoint when
asked, and trains through the one loop with the command line's hooks
(`jax_adaptive.cli.run.RunHooks`), evaluating the held-out split
(`jax_adaptive.cli.datasets.load_held_out`) every ``eval_every`` updates.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jax_adaptive.cli.config import TrainConfig, check_config, make_optimizer
from jax_adaptive.cli.datasets import (
    ShuffledBatches,
    Source,
    all_examples,
    load_held_out,
    load_source,
)
from jax_adaptive.cli.image_models import ImageModel, ghost_batch_size, image_model, multiple_of
from jax_adaptive.cli.run import RunHooks, run_path, speed_text
from jax_adaptive.cli.workdir import Workdir, plan_entry
from jax_adaptive.distributed import data_mesh
from jax_adaptive.step import TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = ["train_images"]


_RUN_FIELDS = ("model", "dataset", "target_batch_size", "optimizer", "learning_rate", "seed")


def _image_trainer(
    config: TrainConfig, model: ImageModel, memory_limit: int | None
) -> AdaptiveTrainer:
    return AdaptiveTrainer(
        model.loss_fn,
        make_optimizer(config),
        target_batch_size=config.schedule(),
        micro_batch_size=config.micro_batch_size,
        memory_limit=memory_limit,
        multiple_of=multiple_of(config, model),
        has_aux=True,
        has_state=bool(model.mutable),
        objective=config.objective,
        plan_cache=config.plan_cache_arg(),
        mesh=data_mesh() if config.data_parallel else None,
    )


SIMULATED_SHARE = 4
"""The simulated device holds about ``1 / SIMULATED_SHARE`` of a target batch's activations."""


def _simulates(config: TrainConfig) -> bool:
    """Whether the run simulates a small device: a CPU, ``auto``, no ``--memory-limit``."""
    return (
        config.simulate_device
        and config.memory_limit is None
        and config.micro_batch_size == "auto"
        and not config.data_parallel
        and jax.devices()[0].platform == "cpu"
    )


def _simulated_limit(config: TrainConfig, model: ImageModel, params: Any, state: Any,
                     example: Any) -> tuple[int, int, float]:  # fmt: skip
    """A small device for this model: its bytes, and the probe's compiles and seconds.

    A probe (no plan cache) measures the ledger of the smallest micro-batch the plan
    allows and of the whole target batch. The device holds the first and a
    `SIMULATED_SHARE`-th of the difference (about a quarter of the target batch), and
    at least the train state beside the smallest micro-step's ledger (the optimizer step
    holds the state twice).
    """
    start, T = time.perf_counter(), max(config.target_sizes())  # a schedule's largest
    probe = AdaptiveTrainer(
        model.loss_fn, make_optimizer(config), target_batch_size=T, micro_batch_size=T,
        has_aux=True, has_state=bool(model.mutable), plan_cache=False,
    )  # fmt: skip
    probe.init(params, example, model_state=state)
    small = probe.ledger(min(T, multiple_of(config, model)))
    whole = probe.ledger(T).total
    limit = max(small.total + (whole - small.total) // SIMULATED_SHARE, small.total + small.state)
    return limit, probe.compiles, time.perf_counter() - start


def _simulation_line(limit: int, compiles: int, seconds: float, T: int) -> str:
    return (
        f"simulating a device of {limit / 1e6:.2f} MB on this CPU (room for about a quarter "
        f"of the target batch of {T} and the optimizer step; measured in {compiles} "
        f"compiles, {seconds:.1f}s), so that the plan searches and accumulates: "
        "--memory-limit BYTES sets the size, --no-simulated-device trains without a cap"
    )


def _plan_line(
    trainer: AdaptiveTrainer, search: dict[str, Any], done: int, schedule: str | None = None
) -> str:
    per_device = trainer.micro_batch_size // trainer.shards
    largest = trainer.plan_info.largest
    where = search["from_plan_cache"]
    return (
        f"plan: micro-batch {trainer.micro_batch_size} x {trainer.accumulation_steps} "
        f"accumulation steps = target batch {trainer.target_batch_size}; "
        f"{search['compiles']} sizes compiled in {search['search_seconds']:.1f}s"
        + (f"; {per_device} per device on {trainer.shards}" if trainer.shards > 1 else "")
        + (
            f" (largest that fits: {largest})"
            if largest not in (None, trainer.micro_batch_size)
            else ""
        )
        + (f" (from the plan cache {where}; --no-plan-cache searches again)" if where else "")
        + (f"; batch schedule {schedule}" if schedule else "")
        + (f"; resumed at update {done}" if done else "")
    )


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


def _start(
    config: TrainConfig, source: Source, out: TextIO
) -> tuple[ImageModel, AdaptiveTrainer, TrainState, dict[str, Any]]:
    """The model, its trainer and state, planned (on a simulated device where it applies)."""
    example = next(ShuffledBatches(source, 1))
    model = image_model(config, source.num_classes, source[0])
    variables = model.module.init(
        jax.random.key(config.seed), jnp.asarray(example["image"]), **model.init_kwargs
    )
    params, model_state = variables.pop("params"), dict(variables)
    model_state = model_state if model.mutable else ()
    limit = config.memory_limit
    if _simulates(config):
        limit, compiles, seconds = _simulated_limit(config, model, params, model_state, example)
        largest = max(config.target_sizes())
        print(_simulation_line(limit, compiles, seconds, largest), file=out)
    trainer = _image_trainer(config, model, limit)
    start = time.perf_counter()
    state = trainer.init(params, example, rng=jax.random.key(config.seed), model_state=model_state)
    cached = any(t.decided_by == "plan cache" for t in trainer.search_log)
    search = {
        "compiles": trainer.compiles,
        "search_seconds": time.perf_counter() - start,
        "from_plan_cache": str(trainer.plan_cache.path) if cached else None,
        "memory_limit": limit,
    }
    return model, trainer, state, search


def _evaluation(
    config: TrainConfig, trainer: AdaptiveTrainer, model: ImageModel
) -> Callable[[TrainState], dict[str, Any]] | None:
    """The held-out evaluation of a state, as ``eval_*`` metrics (None: ``--eval-every 0``)."""
    if not config.eval_every:
        return None
    held_out = all_examples(
        load_held_out(config.dataset, data_dir=config.data_dir, seed=config.seed)
    )

    def evaluate(state: TrainState) -> dict[str, Any]:
        metrics = trainer.evaluate(state, held_out, model.metric_fn)
        return {
            "eval_loss": metrics["loss"], "eval_accuracy": metrics["accuracy"],
            "eval_examples": metrics["examples"],
            "eval_batch_size": trainer.evaluator(model.metric_fn).batch_size,
        }  # fmt: skip

    return evaluate


def _train_images(config: TrainConfig, workdir: Workdir | None, out: TextIO) -> dict[str, Any]:
    source = load_source(config.dataset, data_dir=config.data_dir, seed=config.seed)
    schedule = config.schedule()
    updates = config.updates
    if config.epochs is not None:
        updates = _updates_in(config.epochs * len(source), schedule)
    model, trainer, state, search = _start(config, source, out)
    evaluate = _evaluation(config, trainer, model)
    state, position, done = (state, 0, 0) if workdir is None else workdir.resume(state)
    if done:
        trainer.plan(state, next(ShuffledBatches(source, 1)))  # the schedule goes on
    print(_plan_line(trainer, search, done, config.batch_schedule), file=out)
    batches = ShuffledBatches(source, trainer.target_batch_size, seed=config.seed, start=position)
    consumed = [position]  # the stream's position after the last batch trained on

    def step(
        state: TrainState, drawn: tuple[dict[str, np.ndarray], int]
    ) -> tuple[TrainState, dict[str, Any]]:
        tick = time.perf_counter()
        T = trainer.target_batch_size  # of the state it returned last
        batch, read = drawn
        state, metrics = trainer.step(state, batch)
        loss = float(metrics["loss"])  # blocks: the time below is the update's
        seconds = time.perf_counter() - tick
        consumed[0] = read  # trained on
        scheduled = {} if config.batch_schedule is None else {"target_batch_size": T}
        return state, {
            "loss": loss, "train_accuracy": float(metrics["accuracy"]),
            "micro_batch_size": int(metrics["micro_batch_size"]),
            "accumulation_steps": int(metrics["accumulation_steps"]), **scheduled,
            "examples": T, "examples_per_s": T / seconds, "seconds": seconds,
            "compiles": trainer.compiles,
        }  # fmt: skip

    def plans() -> dict[str, Any]:
        return {"plans": [plan_entry(trainer)], "search_seconds": search["search_seconds"]}

    hooks = RunHooks(
        config, done=done, updates=updates, describe=_image_line, plans=plans, workdir=workdir,
        position=lambda: consumed[0], out=out, evaluate=evaluate, compiles=trainer.compiles,
        plans_now={None: (trainer.micro_batch_size, trainer.accumulation_steps,
                          trainer.target_batch_size)},
    )  # fmt: skip
    hooks.run(step, state, _scheduled(batches, trainer.schedule, done))
    return _summary(trainer, search, hooks)


def _scheduled(
    batches: ShuffledBatches, schedule: Callable[[int], int], done: int
) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """From update ``done`` on: each update's batch and the stream's position after it."""
    for updates in itertools.count(done):
        batches.batch_size = schedule(updates)
        yield next(batches), batches.position


def _updates_in(examples: float, schedule: Any) -> int:
    """The updates whose target batches add up to ``examples`` (at least one).

    Examples:
        >>> from jax_adaptive.schedule import BatchSchedule
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


def _summary(trainer: AdaptiveTrainer, search: dict[str, Any], hooks: RunHooks) -> dict[str, Any]:
    lines = hooks.lines
    evaluated = [line for line in lines if "eval_loss" in line]
    return {
        "micro_batch_size": trainer.micro_batch_size,
        "accumulation_steps": trainer.accumulation_steps,
        **search,
        "from_plan_cache": search["from_plan_cache"] is not None,
        "plan_cache": search["from_plan_cache"],
        "compiles_total": trainer.compiles,  # plan.json's: the search's and every re-plan's
        **hooks.timing("examples"),
        "target_batch_sizes": [line["examples"] for line in lines],
        "updates": len(lines),
        "losses": [line["loss"] for line in lines],
        "train_accuracy": lines[-1]["train_accuracy"] if lines else None,
        "held_out": {k[5:]: evaluated[-1][k] for k in evaluated[-1] if k.startswith("eval_")}
        if evaluated
        else None,
    }


def train_images(config: TrainConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """Trains a zoo image model as configured; prints the plan, each update and a summary.

    With ``workdir``, writes ``plan.json``, ``metrics.jsonl`` (one line per update) and
    orbax checkpoints (train state and data position) every ``checkpoint_every``
    updates and at the end; ``resume`` goes on from the latest one.

    Returns:
        A summary: the plan, the search cost and the loss of each update.

    Examples:
        >>> import io
        >>> config = TrainConfig(model="mlp", target_batch_size=8, updates=2, progress=False)
        >>> summary = train_images(config, out=io.StringIO())
        >>> summary["micro_batch_size"], len(summary["losses"])
        (8, 2)
    """
    check_config(config)
    run = {f: getattr(config, f) for f in _RUN_FIELDS}  # what a resumed checkpoint must match
    if config.batch_schedule is not None:
        run["batch_schedule"] = config.batch_schedule
    if ghost_batch_size(config) is not None:  # a BatchNorm's statistics: the training's
        run["ghost_batch_size"] = ghost_batch_size(config)
    # The stream's position after an update: the examples of the updates so far.
    per_update = (
        config.target_batch_size
        if config.batch_schedule is None
        else config.schedule().examples_before
    )
    return run_path(
        config, _train_images, _summary_line, out=out, run=run, examples_per_update=per_update
    )


def _summary_line(summary: dict[str, Any]) -> str:
    losses, held_out = summary["losses"], summary["held_out"]
    planning = summary["search_seconds"] + summary["compiling_seconds"]
    return (
        f"summary: plan {summary['micro_batch_size']} x {summary['accumulation_steps']}, "
        + _sizes_text(summary["target_batch_sizes"])
        + f"{summary['compiles_total']} compiles"
        + (" (the plan from the plan cache)" if summary["from_plan_cache"] else "")
        + f", {planning:.1f}s planning (the search"
        + (f" and {summary['compiling_updates']} update"
           f"{'s' * (summary['compiling_updates'] != 1)} that compiled"
           if summary["compiling_updates"] else "")
        + "), "
        + speed_text(summary, "examples", summary["updates"])
        + ", final "
        + (f"loss {losses[-1]:.4f} train_accuracy {summary['train_accuracy']:.3f}" if losses
           else "loss n/a")
        + (f", held-out loss {held_out['loss']:.4f} accuracy {held_out['accuracy']:.3f} "
           f"({held_out['examples']} examples)" if held_out else "")
    )  # fmt: skip


def _sizes_text(sizes: list[int]) -> str:
    """The target batch sizes of a run that changed them, as ``target batch 8 -> 32, ``.

    Examples:
        >>> _sizes_text([8, 8, 32]), _sizes_text([8, 8])
        ('target batch 8 -> 32, ', '')
    """
    changes = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    return f"target batch {' -> '.join(map(str, changes))}, " if len(changes) > 1 else ""
