"""The command line's run path, shared by the image models and ``--model gpt``.

`TrainConfig` is a run, `Workdir` where it writes, `host_loop` the one loop of both
paths; `jax_adaptive.train_images.train_images` is the image path
(`jax_adaptive.train_lm.train_gpt` the GPT's).
``plan.json`` has one shape for both: ``{"config": {...}, "plans": [...],
"search_seconds": s}``, a `plan_entry` per trainer: the image path's one with ``"bucket":
null``, the GPT's one per bucket planned so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Hashable, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import optax
import tqdm

from jax_adaptive import models
from jax_adaptive.checkpoint import Checkpoints
from jax_adaptive.checks import MAX_TARGET_BATCH_SIZE
from jax_adaptive.read_ahead import ReadAhead
from jax_adaptive.schedule import BatchSchedule, parse_batch_schedule
from jax_adaptive.step import TrainState
from jax_adaptive.trainer import AdaptiveTrainer

__all__ = [
    "IMAGE_MODELS", "MODEL_NAMES", "OBJECTIVES", "OPTIMIZER_NAMES", "TrainConfig", "Workdir",
    "check_config", "host_loop", "load_factory", "make_optimizer", "plan_entry", "run_path",
]  # fmt: skip

IMAGE_MODELS = {  # each zoo image model and the variables it mutates
    "cnn": (models.CNN, ()),
    "mlp": (models.MLP, ()),
    "resnet-tiny": (models.ResNetTiny, ("batch_stats",)),
    "resnet18": (models.ResNet18, ("batch_stats",)),
    "resnet50": (models.ResNet50, ("batch_stats",)),
    "vit-micro": (models.ViTMicro, ()),
    "vit-tiny": (models.ViTTiny, ()),
}
_OPTIMIZERS = {"adam": optax.adam, "adamw": optax.adamw, "sgd": optax.sgd}
MODEL_NAMES = (*IMAGE_MODELS, "gpt")  # the choices of --model
OPTIMIZER_NAMES = tuple(_OPTIMIZERS)  # the choices of --optimizer
OBJECTIVES = ("least_padding", "max", "throughput")  # the choices of --objective


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a run trains; every field is a command-line flag.

    Examples:
        >>> TrainConfig(model="mlp", updates=3).target_batch_size
        256
    """

    model: str = "cnn"
    dataset: str = "synthetic"
    data_dir: str | None = None
    target_batch_size: int = 256
    batch_schedule: str | None = None  # "0:64,20:256": the target batch grows (image models)
    micro_batch_size: int | str = "auto"
    memory_limit: int | None = None
    optimizer: str = "adam"
    learning_rate: float = 3e-3
    updates: int = 20
    epochs: float | None = None
    seed: int = 0
    objective: str = "least_padding"
    multiple_of: int | None = None  # None: the ghost batch of a BatchNorm model, else 1
    eval_every: int = 10  # held-out evaluation every N updates and at the end; 0: none
    simulate_device: bool = True  # a CPU with no memory_limit simulates a small device
    plan_cache: str | bool | None = None  # None: the default file; False: none
    compilation_cache: str | None = None
    workdir: str | None = None
    resume: bool = False
    checkpoint_every: int = 10
    progress: bool = True
    target_tokens: int | None = None  # --model gpt: padded tokens per update
    max_length: int = 256  # --model gpt: the longest sequence (and the largest bucket)
    data_parallel: bool = False  # split each micro-batch over all devices

    def schedule(self) -> BatchSchedule:
        """The target batch size per update: ``batch_schedule``'s, else the constant.

        Examples:
            >>> TrainConfig(batch_schedule="0:64,20:256").schedule()(20)
            256
        """
        if self.batch_schedule is None:
            return BatchSchedule(self.target_batch_size)
        return parse_batch_schedule(self.batch_schedule)

    def target_sizes(self) -> list[int]:
        """Every target batch size the run may use (one without a schedule).

        Examples:
            >>> TrainConfig(batch_schedule="0:64,20:256").target_sizes()
            [64, 256]
        """
        schedule = self.schedule()
        if schedule.steps is None:
            return [self.target_batch_size]
        return [size for _, size in schedule.steps]

    def plan_cache_arg(self) -> str | bool | None:
        """The trainer's ``plan_cache``: by default the workdir's ``plans.json``, if any.

        Examples:
            >>> TrainConfig(workdir="/tmp/run").plan_cache_arg()
            '/tmp/run/plans.json'
        """
        if self.plan_cache is None and self.workdir is not None:
            return str(Path(self.workdir).absolute() / "plans.json")  # a resumed run keeps it
        return self.plan_cache


def _positive_int(flag: str, value: Any, limit: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{flag} {value!r} must be a positive int.")
    if limit is not None and value > limit:
        raise ValueError(f"{flag} {value} must be at most {limit} (2**31 - 1).")


def _positive_number(flag: str, value: Any) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} {value!r} must be a finite number above 0.")


def _directory_flag(flag: str, path: str | None) -> None:
    if path is None:
        return
    if any(c in path for c in "*?[]"):
        raise ValueError(
            f"{flag} {path!r} must not hold *, ?, [ or ] (orbax reads them as patterns)."
        )
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{flag} {path!r} is a file; it must name a directory.")


def check_config(config: TrainConfig) -> None:
    """Raises a one-line `ValueError`, naming the flag, for a config no path can run.

    Examples:
        >>> check_config(TrainConfig(optimizer="lion"))
        Traceback (most recent call last):
        ValueError: unknown optimizer 'lion'; choose one of adam, adamw, sgd.
        >>> check_config(TrainConfig(learning_rate=float("nan")))
        Traceback (most recent call last):
        ValueError: --learning-rate nan must be a finite number above 0.
    """
    if ":" in str(config.model):
        load_factory(config.model)
    elif config.model not in MODEL_NAMES:
        raise ValueError(
            f"--model {config.model!r} is neither a zoo model ({', '.join(MODEL_NAMES)}) nor "
            "package.module:factory."
        )
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
    _positive_int("--target-batch-size", config.target_batch_size, MAX_TARGET_BATCH_SIZE)
    _check_schedule(config)
    largest = max(config.target_sizes())
    if config.micro_batch_size != "auto":
        if (
            isinstance(config.micro_batch_size, bool)
            or not isinstance(config.micro_batch_size, int)
            or not 0 < config.micro_batch_size <= largest
        ):
            flag = (
                "the largest size of --batch-schedule"
                if config.batch_schedule
                else ("--target-batch-size")
            )
            raise ValueError(
                f"--micro-batch-size {config.micro_batch_size!r} must be 'auto' or an int "
                f"from 1 to {flag} {largest}."
            )
    if config.memory_limit is not None:
        _positive_int("--memory-limit", config.memory_limit)
    _positive_number("--learning-rate", config.learning_rate)
    _positive_int("--updates", config.updates)
    if config.epochs is not None:
        _positive_number("--epochs", config.epochs)
    if (
        isinstance(config.seed, bool)
        or not isinstance(config.seed, int)
        or not (0 <= config.seed < 2**63)
    ):
        raise ValueError(f"--seed {config.seed!r} must be an int from 0 to 2**63 - 1.")
    _positive_int("--checkpoint-every", config.checkpoint_every)
    if config.objective not in OBJECTIVES:
        raise ValueError(
            f"--objective {config.objective!r} must be one of {', '.join(OBJECTIVES)}."
        )
    if config.multiple_of is not None:
        _positive_int("--multiple-of", config.multiple_of, MAX_TARGET_BATCH_SIZE)
    if (
        isinstance(config.eval_every, bool)
        or not isinstance(config.eval_every, int)
        or (config.eval_every < 0)
    ):
        raise ValueError(f"--eval-every {config.eval_every!r} must be an int, 0 or more.")
    if config.target_tokens is not None:
        _positive_int("--target-tokens", config.target_tokens, MAX_TARGET_BATCH_SIZE)
    _positive_int("--max-length", config.max_length)
    _directory_flag("--workdir", config.workdir)
    _directory_flag("--compilation-cache", config.compilation_cache)


def _check_schedule(config: TrainConfig) -> None:
    """``--batch-schedule``: parsed (one-line errors naming it), for image models only."""
    if config.batch_schedule is None:
        return
    if config.model == "gpt":
        raise ValueError("--batch-schedule is for image models; --model gpt takes --target-tokens.")
    config.schedule()  # raises naming the flag


def load_factory(spec: str) -> Callable[..., Any]:
    """The factory ``--model package.module:factory`` names, imported (one-line errors).

    The factory is called with the dataset's number of classes and returns ``(model,
    loss)``: a Flax linen module mapping images ``[m, H, W, C]`` to logits ``[m,
    classes]``, and ``loss(logits, labels) -> [m]``, one loss per example (no mean).

    Raises:
        ValueError: naming ``--model``, when the module cannot be imported or holds no
            such callable.

    Examples:
        >>> load_factory("jax_adaptive.models:CNN").__name__
        'CNN'
        >>> load_factory("jax_adaptive.models")
        Traceback (most recent call last):
        ValueError: --model 'jax_adaptive.models' must be a zoo model or package.module:factory.
    """
    module_name, _, name = spec.partition(":")
    if not module_name or not name or not all(p.isidentifier() for p in name.split(".")):
        raise ValueError(f"--model {spec!r} must be a zoo model or package.module:factory.")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or the module's own error at import
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(
            f"--model {spec!r}: cannot import {module_name} ({type(exc).__name__}: {first})."
        ) from None
    factory: Any = module
    for part in name.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {name!r}.")
    return factory


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """The optax optimizer the config names, at its learning rate.

    Examples:
        >>> import jax.numpy as jnp
        >>> make_optimizer(TrainConfig(optimizer="sgd")).init({"w": jnp.ones(2)})
        (EmptyState(), EmptyState())
    """
    return _OPTIMIZERS[config.optimizer](config.learning_rate)


def plan_entry(trainer: AdaptiveTrainer, bucket: Hashable | None = None) -> dict[str, Any]:
    """One trainer's plan as ``plan.json`` holds it (every `SizeTrial` field passes through).

    Examples:
        >>> import jax.numpy as jnp, numpy as np
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
        "examples_per_update": trainer.target_batch_size,  # the next update's
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
        examples_per_update: what a checkpoint's data position must be after its
            updates (`jax_adaptive.checkpoint.Checkpoints`); None: the path checks the
            position itself.

    Raises:
        ValueError: when the directory holds checkpoints and ``config.resume`` is off.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp, Workdir(tmp, TrainConfig()) as work:
        ...     work.write_plan([], search_seconds=0.0)
        ...     work.log({"update": 1, "loss": 0.5})
        ...     sorted(p.name for p in work.path.iterdir())
        ['metrics.jsonl', 'plan.json']
    """

    def __init__(
        self,
        path: str | Path,
        config: TrainConfig,
        run: Mapping[str, Any] | None = None,
        *,
        examples_per_update: int | Callable[[int], int] | None = None,
    ):
        self.path, self.config = Path(path).absolute(), config
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"--workdir {str(path)!r} is a file; it must name a directory.")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "metrics.jsonl").touch()
        except OSError as exc:
            raise ValueError(
                f"--workdir {str(path)!r} cannot be used: {exc.strerror or exc}."
            ) from None
        self.checkpoints = None
        if run is not None:
            self.checkpoints = Checkpoints(
                self.path / "checkpoints", run, examples_per_update=examples_per_update
            )
        held = self.checkpoints is not None and self.checkpoints.latest() is not None
        if held and not config.resume:
            self.checkpoints.close()
            raise ValueError(
                f"{self.path} already holds checkpoints; pass --resume to go on, or another "
                "--workdir."
            )
        self._metrics: TextIO | None = None
        self._plan: Any = None

    @classmethod
    def of(
        cls,
        config: TrainConfig,
        run: Mapping[str, Any] | None = None,
        *,
        examples_per_update: int | Callable[[int], int] | None = None,
    ) -> contextlib.AbstractContextManager[Workdir | None]:
        """The config's workdir as a context (None without ``config.workdir``); args as above.

        Examples:
            >>> with Workdir.of(TrainConfig()) as work:
            ...     print(work)
            None
        """
        if config.workdir is None:
            return contextlib.nullcontext()
        return cls(config.workdir, config, run, examples_per_update=examples_per_update)

    def write_plan(self, plans: list[dict[str, Any]], *, search_seconds: float) -> None:
        """(Re)writes ``plan.json`` when the plans or the search time changed."""
        plan = {"plans": plans, "search_seconds": search_seconds}
        if plan != self._plan:
            text = {"config": dataclasses.asdict(self.config), **plan}
            (self.path / "plan.json").write_text(json.dumps(text, indent=1, default=str))
            self._plan = plan

    def start(self, done: int) -> None:
        """Keeps only the lines of updates ``1..done`` in ``metrics.jsonl``.

        A run that goes on after ``done`` updates (a resumed one) writes the later ones
        again: one line per update, however often they were redone.

        Examples:
            >>> import tempfile
            >>> with tempfile.TemporaryDirectory() as tmp, Workdir(tmp, TrainConfig()) as work:
            ...     for update in (1, 2, 3):
            ...         work.log({"update": update})
            ...     work.start(1)
            ...     work.log({"update": 2})
            ...     (work.path / "metrics.jsonl").read_text().split()
            ['{"update":', '1}', '{"update":', '2}']
        """
        if self._metrics is not None:
            self._metrics.close()
        path = self.path / "metrics.jsonl"
        kept = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:  # a killed run may leave half a line
                if int(json.loads(line)["update"]) <= done:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                continue
        tmp = path.with_name(f".metrics-{os.getpid()}.jsonl")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        self._metrics = open(path, "a")

    def log(self, line: dict[str, Any]) -> None:
        """Appends one update's metrics as a JSON line (flushed: a killed run keeps it)."""
        if self._metrics is None:
            self._metrics = open(self.path / "metrics.jsonl", "a")
        self._metrics.write(json.dumps(line) + "\n")
        self._metrics.flush()

    def resume(self, state: TrainState) -> tuple[TrainState, int, int]:
        """Where the run goes on from: ``(state, data position, updates done)``.

        The latest intact checkpoint's with ``--resume`` (placed like ``state``), else
        ``state`` itself at position 0 after 0 updates.

        Examples:
            >>> import tempfile, jax, jax.numpy as jnp
            >>> from jax_adaptive.step import multi_steps
            >>> params = {"w": jnp.ones(2)}
            >>> opt = multi_steps(optax.sgd(1.0), 1).init(params)
            >>> state = TrainState(params, opt._replace(gradient_step=jnp.int32(3)), (),
            ...                    jax.random.key(0))  # after 3 updates
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     with Workdir(tmp, TrainConfig(), {"seed": 0}) as work:
            ...         work.save(3, state, position=96)
            ...     with Workdir(tmp, TrainConfig(resume=True), {"seed": 0}) as work:
            ...         _, position, done = work.resume(state)
            >>> position, done
            (96, 3)
        """
        if self.config.resume and self.checkpoints is not None:
            restored = self.checkpoints.restore(state)
            if restored is not None:
                state, position = restored
                return state, position, int(state.updates)
        return state, 0, 0

    def save(self, update: int, state: TrainState, position: int) -> None:
        """Checkpoints after ``update`` updates (nothing without checkpoints)."""
        if self.checkpoints is not None:
            self.checkpoints.save(update, state, position)

    def close(self) -> None:
        """Closes the metrics file and waits for the checkpoints."""
        if self._metrics is not None:
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


def _due(update: int, every: int, last: int) -> bool:
    """Whether held-out evaluation runs after ``update`` (every ``every``, and the last)."""
    return every > 0 and (update % every == 0 or update == last)


def host_loop(
    step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]],
    state: TrainState,
    batches: Iterator[Any],
    config: TrainConfig,
    *,
    done: int,
    updates: int,
    describe: Callable[[dict[str, Any]], str],
    plans: Callable[[], dict[str, Any]],
    workdir: Workdir | None = None,
    position: Callable[[], int] = lambda: 0,
    out: TextIO | None = None,
    evaluate: Callable[[TrainState], dict[str, Any]] | None = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Runs updates ``done + 1`` to ``updates``, logging, checkpointing and printing each.

    The next batches are read ahead in a background thread while an update runs
    (`jax_adaptive.read_ahead.ReadAhead`, two at most), so that drawing them (reading,
    decoding each example) does not add to the update's time.

    Args:
        step: one update from a state and the next item of ``batches``: the new state
            and its metrics line (host values with at least ``loss``,
            ``micro_batch_size`` and ``accumulation_steps``).
        state: the state after ``done`` updates.
        batches: what each update takes, in order (read in that thread only).
        config: ``progress`` and ``checkpoint_every`` are read.
        done: updates already done (a resumed run's).
        updates: the last update.
        describe: the printed line of an update's metrics line.
        plans: the arguments of `Workdir.write_plan`, asked before the first update and
            after each (``plan.json`` is rewritten when they changed).
        workdir: where to log, checkpoint and write the plans, if anywhere.
        position: the data stream's position after the batches trained on, saved with
            each checkpoint (not the reader's, which is ahead).
        out: where the lines go (default stdout).
        evaluate: held-out metrics of a state (``eval_*`` keys), added to the line of
            every ``config.eval_every``-th update and of the last, before it is
            logged, checkpointed and described; None: no evaluation.

    Returns:
        The final state and the metrics line of each update run (``update`` first).

    Examples:
        >>> import io
        >>> step = lambda s, b: (s + b, {"loss": 1.0 / (s + b), "micro_batch_size": 4,
        ...                              "accumulation_steps": 2})
        >>> state, lines = host_loop(step, 0, iter([1, 1]), TrainConfig(progress=False),
        ...                          done=0, updates=2, describe=lambda m: f"update {m['update']}",
        ...                          plans=dict, out=io.StringIO())
        >>> state, [m["loss"] for m in lines]
        (2, [1.0, 0.5])
    """
    out = out or sys.stdout
    lines: list[dict[str, Any]] = []
    bar = tqdm.tqdm(total=updates, initial=done, disable=not config.progress, unit="update")
    ahead = ReadAhead(batches, depth=2)
    try:
        if workdir is not None:
            workdir.start(done)  # the lines of updates about to be redone go
            workdir.write_plan(**plans())
        for update in range(done + 1, updates + 1):
            state, metrics = step(state, next(ahead))
            lines.append({"update": update, **metrics})
            if evaluate is not None and _due(update, config.eval_every, updates):
                lines[-1].update(evaluate(state))
            if workdir is not None:
                workdir.log(lines[-1])
                workdir.write_plan(**plans())
                if update % config.checkpoint_every == 0 or update == updates:
                    workdir.save(update, state, position())
            bar.set_postfix(_postfix(lines[-1]))
            bar.update()
            tqdm.tqdm.write(describe(lines[-1]), file=out)
    finally:
        ahead.close()  # a resumed run draws the batches read ahead again, from the position
        bar.close()
    return state, lines


def run_path(
    config: TrainConfig,
    train: Callable[[TrainConfig, Workdir | None, TextIO], dict[str, Any]],
    summarize: Callable[[dict[str, Any]], str],
    *,
    out: TextIO | None = None,
    run: Mapping[str, Any] | None = None,
    examples_per_update: int | Callable[[int], int] | None = None,
) -> dict[str, Any]:
    """Runs one path of the command line: its training in its workdir, then its summary.

    Args:
        config: the run, already checked.
        train: ``(config, workdir or None, out) -> summary``.
        summarize: the summary's one line.
        out: where to print (standard output by default).
        run: what a resumed checkpoint must match (see `Workdir`).
        examples_per_update: what a checkpoint's data position must be (see `Workdir`).

    Returns:
        The summary.

    Examples:
        >>> import io
        >>> run_path(TrainConfig(), lambda c, w, o: {"losses": []}, lambda s: "done",
        ...          out=io.StringIO())
        {'losses': []}
    """
    out = out or sys.stdout
    with Workdir.of(config, run, examples_per_update=examples_per_update) as workdir:
        summary = train(config, workdir, out)
    print(summarize(summary), file=out)
    return summary
