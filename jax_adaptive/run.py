"""The command line's run path, shared by the image models and ``--model gpt``.

`TrainConfig` is a run, `Workdir` where it writes, `host_loop` the one loop of both
paths; `train_images` is the image path (`jax_adaptive.train_lm.train_gpt` the GPT's).
``plan.json`` has one shape for both: ``{"config": {...}, "plans": [...],
"search_seconds": s}``, a `plan_entry` per trainer: the image path's one with ``"bucket":
null``, the GPT's one per bucket planned so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import optax
import tqdm

from jax_adaptive import models
from jax_adaptive.checkpoint import Checkpoints
from jax_adaptive.datasets import ShuffledBatches, load_source
from jax_adaptive.distributed import data_mesh
from jax_adaptive.step import TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = [
    "MODEL_NAMES", "OPTIMIZER_NAMES", "TrainConfig", "Workdir", "check_config", "host_loop",
    "make_optimizer", "plan_entry", "train_images",
]  # fmt: skip

_MODELS = {  # each zoo image model and the variables it mutates
    "cnn": (models.CNN, ()),
    "mlp": (models.MLP, ()),
    "resnet-tiny": (models.ResNetTiny, ("batch_stats",)),
    "resnet18": (models.ResNet18, ("batch_stats",)),
    "resnet50": (models.ResNet50, ("batch_stats",)),
    "vit-micro": (models.ViTMicro, ()),
    "vit-tiny": (models.ViTTiny, ()),
}
_OPTIMIZERS = {"adam": optax.adam, "adamw": optax.adamw, "sgd": optax.sgd}
MODEL_NAMES = (*_MODELS, "gpt")  # the choices of --model
OPTIMIZER_NAMES = tuple(_OPTIMIZERS)  # the choices of --optimizer


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a run trains; every field is a command-line flag.

    Example:
        >>> TrainConfig(model="mlp", updates=3).target_batch_size
        256
    """

    model: str = "cnn"
    dataset: str = "synthetic"
    data_dir: str | None = None
    target_batch_size: int = 256
    micro_batch_size: int | str = "auto"
    memory_limit: int | None = None
    optimizer: str = "adam"
    learning_rate: float = 3e-3
    updates: int = 20
    epochs: float | None = None
    seed: int = 0
    objective: str = "max"
    plan_cache: str | bool | None = None  # None: the default file; False: none
    compilation_cache: str | None = None
    workdir: str | None = None
    resume: bool = False
    checkpoint_every: int = 10
    progress: bool = True
    target_tokens: int | None = None  # --model gpt: padded tokens per update
    max_length: int = 256  # --model gpt: the longest sequence (and the largest bucket)
    data_parallel: bool = False  # split each micro-batch over all devices

    def plan_cache_arg(self) -> str | bool | None:
        """The trainer's ``plan_cache``: by default the workdir's ``plans.json``, if any.

        Example:
            >>> TrainConfig(workdir="/tmp/run").plan_cache_arg()
            '/tmp/run/plans.json'
        """
        if self.plan_cache is None and self.workdir is not None:
            return str(Path(self.workdir).absolute() / "plans.json")  # a resumed run keeps it
        return self.plan_cache


def check_config(config: TrainConfig) -> None:
    """Raises a one-line `ValueError` for a config no path can run.

    Example:
        >>> check_config(TrainConfig(optimizer="lion"))
        Traceback (most recent call last):
        ValueError: unknown optimizer 'lion'; choose one of adam, adamw, sgd.
    """
    if config.model not in MODEL_NAMES:
        raise ValueError(f"unknown model {config.model!r}; choose one of {', '.join(MODEL_NAMES)}.")
    if config.target_tokens is not None and config.model != "gpt":
        raise ValueError(
            "--target-tokens is for --model gpt; image models take --target-batch-size."
        )
    if config.optimizer not in _OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {config.optimizer!r}; choose one of {', '.join(_OPTIMIZERS)}."
        )
    if config.resume and config.workdir is None:
        raise ValueError("--resume needs --workdir (the directory of the run to resume).")
    if config.checkpoint_every <= 0:
        raise ValueError(f"checkpoint_every={config.checkpoint_every} must be positive.")


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """The optax optimizer the config names, at its learning rate.

    Example:
        >>> make_optimizer(TrainConfig(optimizer="sgd")).init({"w": jnp.ones(2)})
        (EmptyState(), EmptyState())
    """
    return _OPTIMIZERS[config.optimizer](config.learning_rate)


def plan_entry(trainer: AdaptiveTrainer, bucket: Hashable | None = None) -> dict[str, Any]:
    """One trainer's plan as ``plan.json`` holds it (every `SizeTrial` field passes through).

    Example:
        >>> import numpy as np
        >>> trainer = AdaptiveTrainer(lambda p, b, r: (b * p) ** 2, optax.sgd(0.1),
        ...                           target_batch_size=8, micro_batch_size=4)
        >>> _ = trainer.init(jnp.ones(()), np.ones(8, np.float32))
        >>> entry = plan_entry(trainer)
        >>> entry["bucket"], entry["micro_batch_size"], entry["accumulation_steps"]
        (None, 4, 2)
    """
    return {
        "bucket": bucket,
        "micro_batch_size": trainer.micro_batch_size,
        "accumulation_steps": trainer.accumulation_steps,
        "examples_per_update": trainer.target_batch_size,
        "compiles": trainer.compiles,
        "capacity": trainer.capacity(),
        "memory_limit": trainer.memory_limit,
        "search_log": [trial._asdict() for trial in trainer.search_log],
    }


class Workdir(contextlib.AbstractContextManager):
    """A run's directory: ``plan.json``, ``metrics.jsonl`` and, for ``run``, checkpoints.

    Args:
        path: the directory (created when missing).
        config: the run's config, written into ``plan.json``.
        run: what a checkpoint must agree on to be resumed; None: no checkpoints.

    Raises:
        ValueError: when the directory holds checkpoints and ``config.resume`` is off.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp, Workdir(tmp, TrainConfig()) as work:
        ...     work.write_plan([], search_seconds=0.0)
        ...     work.log({"update": 1, "loss": 0.5})
        ...     sorted(p.name for p in work.path.iterdir())
        ['metrics.jsonl', 'plan.json']
    """

    def __init__(self, path: str | Path, config: TrainConfig, run: Mapping[str, Any] | None = None):
        self.path, self.config = Path(path).absolute(), config
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = None if run is None else Checkpoints(self.path / "checkpoints", run)
        held = self.checkpoints is not None and self.checkpoints.latest() is not None
        if held and not config.resume:
            self.checkpoints.close()
            raise ValueError(
                f"{self.path} already holds checkpoints; pass --resume to go on, or another "
                "--workdir."
            )
        self._metrics = open(self.path / "metrics.jsonl", "a")
        self._plan: Any = None

    @classmethod
    def of(
        cls, config: TrainConfig, run: Mapping[str, Any] | None = None
    ) -> contextlib.AbstractContextManager[Workdir | None]:
        """The config's workdir as a context (None without ``config.workdir``).

        Example:
            >>> with Workdir.of(TrainConfig()) as work:
            ...     print(work)
            None
        """
        if config.workdir is None:
            return contextlib.nullcontext()
        return cls(config.workdir, config, run)

    def write_plan(self, plans: list[dict[str, Any]], *, search_seconds: float) -> None:
        """(Re)writes ``plan.json`` when the plans or the search time changed."""
        plan = {"plans": plans, "search_seconds": search_seconds}
        if plan != self._plan:
            text = {"config": dataclasses.asdict(self.config), **plan}
            (self.path / "plan.json").write_text(json.dumps(text, indent=1, default=str))
            self._plan = plan

    def log(self, line: dict[str, Any]) -> None:
        """Appends one update's metrics as a JSON line (flushed: a killed run keeps it)."""
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()

    def save(self, update: int, state: TrainState, position: int) -> None:
        """Checkpoints after ``update`` updates (nothing without checkpoints)."""
        if self.checkpoints is not None:
            self.checkpoints.save(update, state, position)

    def close(self) -> None:
        """Closes the metrics file and waits for the checkpoints."""
        self._metrics.close()
        if self.checkpoints is not None:
            self.checkpoints.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _postfix(line: dict[str, Any]) -> dict[str, str]:
    shown = {"loss": f"{line['loss']:.3f}"}
    if "examples_per_s" in line:
        shown["ex_s"] = f"{line['examples_per_s']:.0f}"
    if "bucket" in line:
        shown["bucket"] = str(line["bucket"])
    return shown | {"micro": f"{line['micro_batch_size']}x{line['accumulation_steps']}"}


def host_loop(
    step: Callable[[TrainState], tuple[TrainState, dict[str, Any]]],
    state: TrainState,
    config: TrainConfig,
    *,
    done: int,
    updates: int,
    describe: Callable[[dict[str, Any]], str],
    plans: Callable[[], dict[str, Any]],
    workdir: Workdir | None = None,
    position: Callable[[], int] = lambda: 0,
    out: TextIO | None = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Runs updates ``done + 1`` to ``updates``, logging, checkpointing and printing each.

    Args:
        step: one update from a state: the new state and its metrics line (host values
            with at least ``loss``, ``micro_batch_size`` and ``accumulation_steps``).
        state: the state after ``done`` updates.
        config: ``progress`` and ``checkpoint_every`` are read.
        done: updates already done (a resumed run's).
        updates: the last update.
        describe: the printed line of an update's metrics line.
        plans: the arguments of `Workdir.write_plan`, asked before the first update and
            after each (``plan.json`` is rewritten when they changed).
        workdir: where to log, checkpoint and write the plans, if anywhere.
        position: the data stream's position, saved with each checkpoint.
        out: where the lines go (default stdout).

    Returns:
        The final state and the metrics line of each update run (``update`` first).

    Example:
        >>> import io
        >>> step = lambda s: (s + 1, {"loss": 1.0 / (s + 1), "micro_batch_size": 4,
        ...                           "accumulation_steps": 2})
        >>> state, lines = host_loop(step, 0, TrainConfig(progress=False), done=0, updates=2,
        ...                          describe=lambda m: f"update {m['update']}",
        ...                          plans=dict, out=io.StringIO())
        >>> state, [m["loss"] for m in lines]
        (2, [1.0, 0.5])
    """
    out = out or sys.stdout
    lines: list[dict[str, Any]] = []
    bar = tqdm.tqdm(total=updates, initial=done, disable=not config.progress, unit="update")
    try:
        if workdir is not None:
            workdir.write_plan(**plans())
        for update in range(done + 1, updates + 1):
            state, metrics = step(state)
            lines.append({"update": update, **metrics})
            if workdir is not None:
                workdir.log(lines[-1])
                workdir.write_plan(**plans())
                if update % config.checkpoint_every == 0 or update == updates:
                    workdir.save(update, state, position())
            bar.set_postfix(_postfix(lines[-1]))
            bar.update()
            tqdm.tqdm.write(describe(lines[-1]), file=out)
    finally:
        bar.close()
    return state, lines


_RUN_FIELDS = ("model", "dataset", "target_batch_size", "optimizer", "learning_rate", "seed")


def _image_trainer(
    config: TrainConfig, num_classes: int
) -> tuple[Any, tuple[str, ...], AdaptiveTrainer]:
    module, mutable = _MODELS[config.model]
    model = module(num_classes=num_classes)
    trainer = AdaptiveTrainer(
        models.linen_classifier_loss(model, mutable=mutable),
        make_optimizer(config),
        target_batch_size=config.target_batch_size,
        micro_batch_size=config.micro_batch_size,
        memory_limit=config.memory_limit,
        has_aux=True,
        has_state=bool(mutable),
        objective=config.objective,
        plan_cache=config.plan_cache_arg(),
        mesh=data_mesh() if config.data_parallel else None,
    )
    return model, mutable, trainer


def _plan_line(trainer: AdaptiveTrainer, seconds: float, done: int, cached: bool) -> str:
    per_device = trainer.micro_batch_size // trainer.shards
    return (
        f"plan: micro-batch {trainer.micro_batch_size} x {trainer.accumulation_steps} "
        f"accumulation steps = target batch {trainer.target_batch_size}; "
        f"{trainer.compiles} sizes compiled in {seconds:.1f}s"
        + (f"; {per_device} per device on {trainer.shards}" if trainer.shards > 1 else "")
        + (" (from the plan cache)" if cached else "")
        + (f"; resumed at update {done}" if done else "")
    )


def _image_line(line: dict[str, Any]) -> str:
    return (
        f"update {line['update']:4d}  loss {line['loss']:.4f}  accuracy "
        f"{line['accuracy']:.3f}  micro-batch {line['micro_batch_size']}"
    )


def _train_images(config: TrainConfig, workdir: Workdir | None, out: TextIO) -> dict[str, Any]:
    source = load_source(config.dataset, data_dir=config.data_dir, seed=config.seed)
    updates = config.updates
    if config.epochs is not None:
        updates = max(1, int(config.epochs * len(source) / config.target_batch_size))
    model, mutable, trainer = _image_trainer(config, source.num_classes)
    example = next(ShuffledBatches(source, 1))
    variables = model.init(jax.random.key(config.seed), jnp.asarray(example["image"]))
    params, model_state = variables.pop("params"), dict(variables)
    start = time.perf_counter()
    state = trainer.init(
        params, example, rng=jax.random.key(config.seed), model_state=model_state if mutable else ()
    )
    search_seconds = time.perf_counter() - start
    position, done = 0, 0
    if config.resume and workdir is not None and workdir.checkpoints is not None:
        restored = workdir.checkpoints.restore(state)
        if restored is not None:
            state, position = restored
            done = int(state.updates)
    cached = any(t.decided_by == "plan cache" for t in trainer.search_log)
    print(_plan_line(trainer, search_seconds, done, cached), file=out)
    batches = ShuffledBatches(source, config.target_batch_size, seed=config.seed, start=position)

    def step(state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        tick = time.perf_counter()
        state, metrics = trainer.step(state, next(batches))
        loss = float(metrics["loss"])  # blocks: the time below is the update's
        return state, {
            "loss": loss, "accuracy": float(metrics["accuracy"]),
            "micro_batch_size": int(metrics["micro_batch_size"]),
            "accumulation_steps": trainer.accumulation_steps,
            "examples_per_s": config.target_batch_size / (time.perf_counter() - tick),
        }  # fmt: skip

    state, lines = host_loop(
        step, state, config, done=done, updates=updates, describe=_image_line,
        plans=lambda: {"plans": [plan_entry(trainer)], "search_seconds": search_seconds},
        workdir=workdir, position=lambda: batches.position, out=out,
    )  # fmt: skip
    return {
        "micro_batch_size": trainer.micro_batch_size,
        "accumulation_steps": trainer.accumulation_steps,
        "compiles": trainer.compiles,
        "search_seconds": search_seconds,
        "from_plan_cache": cached,
        "examples_per_s": lines[-1]["examples_per_s"] if lines else 0.0,
        "losses": [line["loss"] for line in lines],
        "accuracy": lines[-1]["accuracy"] if lines else None,
    }


def train_images(config: TrainConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """Trains a zoo image model as configured; prints the plan, each update and a summary.

    With ``workdir``, writes ``plan.json``, ``metrics.jsonl`` (one line per update) and
    orbax checkpoints (train state and data position) every ``checkpoint_every``
    updates and at the end; ``resume`` goes on from the latest one.

    Returns:
        A summary: the plan, the search cost and the loss of each update.

    Example:
        >>> import io
        >>> config = TrainConfig(model="mlp", target_batch_size=8, updates=2, progress=False)
        >>> summary = train_images(config, out=io.StringIO())
        >>> summary["micro_batch_size"], len(summary["losses"])
        (8, 2)
    """
    out = out or sys.stdout
    check_config(config)
    run = {f: getattr(config, f) for f in _RUN_FIELDS}  # what a resumed checkpoint must match
    with Workdir.of(config, run) as workdir:
        summary = _train_images(config, workdir, out)
    losses = summary["losses"]
    print(
        f"summary: plan {summary['micro_batch_size']} x {summary['accumulation_steps']}, "
        f"search {summary['compiles']} compiles in {summary['search_seconds']:.1f}s, "
        f"{summary['examples_per_s']:.0f} examples/s, final loss "
        + (f"{losses[-1]:.4f} accuracy {summary['accuracy']:.3f}" if losses else "n/a"),
        file=out,
    )
    return summary
