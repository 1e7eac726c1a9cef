"""What a command-line run trains: `TrainConfig` (one field per flag) and its checks.

Importing it does not start JAX (nor import optax or the models): `check_config` runs
before, so that ``--help`` and a bad flag answer at once.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jax_adaptive import checks
from jax_adaptive.cli.extras import check_extra
from jax_adaptive.schedule import BatchSchedule, parse_batch_schedule

if TYPE_CHECKING:
    import optax

__all__ = [
    "GHOST_BATCH_SIZE", "IMAGE_MODELS", "MODEL_NAMES", "OBJECTIVES", "OPTIMIZER_NAMES",  # noqa: F822
    "TrainConfig", "check_config", "check_ghost", "ghost_batch_size", "load_factory",
    "make_optimizer", "refusal",
]  # fmt: skip

_ZOO = {  # each zoo image model: its class in jax_adaptive.models, the variables it mutates
    "cnn": ("CNN", ()),
    "mlp": ("MLP", ()),
    "resnet-tiny": ("ResNetTiny", ("batch_stats",)),
    "resnet18": ("ResNet18", ("batch_stats",)),
    "resnet50": ("ResNet50", ("batch_stats",)),
    "vit-micro": ("ViTMicro", ()),
    "vit-tiny": ("ViTTiny", ()),
}
MODEL_NAMES = (*_ZOO, "gpt")  # the choices of --model
OPTIMIZER_NAMES = ("adam", "adamw", "sgd")  # the choices of --optimizer: optax's names
OBJECTIVES = ("auto", "least_padding", "max", "throughput")  # the choices of --objective

LONG_RUN = 1000
"""Updates from which ``--objective auto`` times the plans (``throughput``): the timing
costs a few seconds of compiles and slower updates, a small share of such a run
(``python experiments/plan_speed.py`` reports it as a share of 1,000 updates)."""

TIMING_SHARE = 0.02
"""The share of a run ``--objective auto``'s timing may cost (`TrainConfig.timing_budget`):
a model whose compiles are long (a minute each on a GPU host) stops timing early."""
_MAX_T = checks.MAX_TARGET_BATCH_SIZE  # the largest target batch the micro-step counts


def __getattr__(name: str) -> Any:
    """``IMAGE_MODELS``: each zoo image model's class and the variables it mutates.

    Built at first use (PEP 562): the models import Flax and JAX, which the flags' checks
    do without.
    """
    if name != "IMAGE_MODELS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    models = importlib.import_module("jax_adaptive.models")
    table = {model: (getattr(models, cls), mutable) for model, (cls, mutable) in _ZOO.items()}
    globals()[name] = table  # built once
    return table


def _batch_norm(model: str) -> bool:
    """Whether the zoo model ``model`` has BatchNorm statistics (False for any other)."""
    return bool(_ZOO.get(model, (None, ()))[1])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a run trains; every field is a command-line flag (``--help`` says each).

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
    objective: str = "auto"  # auto: throughput for LONG_RUN updates or more
    multiple_of: int | None = None  # None: the ghost batch of a BatchNorm model, else 1
    ghost_batch_size: int | None = None  # zoo ResNets' BatchNorm groups; None: `ghost_batch_size`
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
    allow_nonfinite: bool = False  # a NaN or infinite loss goes on instead of stopping
    distributed: str | None = None  # "auto" or "HOST:PORT,PROCESSES,ID": jax.distributed
    distributed_timeout: int = 45  # seconds: for every process to join, for a silent one
    tensorboard: bool = False  # each update's scalars as TensorBoard event files in workdir
    background_search: bool = False  # train from one size that fits while the search goes on

    def chosen_objective(self) -> tuple[str, str | None]:
        """The trainer's objective, and why when ``"auto"`` chose it (else None).

        Examples:
            >>> TrainConfig(updates=20).chosen_objective()[0]
            'least_padding'
            >>> TrainConfig(updates=5000).chosen_objective()
            ('throughput', 'auto: 5000 updates, at least 1000')
        """
        if self.objective != "auto":
            return self.objective, None
        if self.epochs is None and self.updates >= LONG_RUN:
            return "throughput", f"auto: {self.updates} updates, at least {LONG_RUN}"
        if self.epochs is not None:
            return "least_padding", f"auto: {self.epochs} epochs, a length not known yet"
        return "least_padding", f"auto: {self.updates} updates, fewer than {LONG_RUN}"

    def timing_budget(self) -> float | None:
        """The most ``--objective auto``'s timing may cost, in updates (else None: no bound).

        Examples:
            >>> TrainConfig(updates=5000).timing_budget()
            100.0
            >>> TrainConfig(updates=5000, objective="throughput").timing_budget() is None
            True
        """
        objective, why = self.chosen_objective()
        return TIMING_SHARE * self.updates if objective == "throughput" and why else None

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
        """Every target batch size the run may use.

        Examples:
            >>> TrainConfig(batch_schedule="0:64,20:256").target_sizes()
            [64, 256]
        """
        steps = self.schedule().steps
        return [self.target_batch_size] if steps is None else [size for _, size in steps]

    def plan_cache_arg(self) -> str | bool | None:
        """The trainer's ``plan_cache`` (resolved): by default the workdir's ``plans.json``.

        Examples:
            >>> TrainConfig(workdir="/tmp/run/sub/..").plan_cache_arg()
            '/tmp/run/plans.json'
        """
        if self.plan_cache is None and self.workdir is not None:
            return str(Path(self.workdir).resolve() / "plans.json")  # a resumed run keeps it
        if isinstance(self.plan_cache, str):
            return str(Path(self.plan_cache).resolve())
        return self.plan_cache

    def distributed_args(self) -> dict[str, Any] | None:
        """``jax.distributed.initialize``'s arguments for ``distributed``; None: one process.

        ``"auto"`` leaves them to the cluster's environment (SLURM, Open MPI, ...).
        ``HOST:PORT,PROCESSES,ID`` is checked whole, before JAX starts (a one-line
        `ValueError` names the field at fault).

        Examples:
            >>> TrainConfig(distributed="localhost:1234,2,1").distributed_args()
            {'coordinator_address': 'localhost:1234', 'num_processes': 2, 'process_id': 1}
            >>> TrainConfig(distributed="localhost:notaport,2,0").distributed_args()
            Traceback (most recent call last):
            ValueError: --distributed 'localhost:notaport,2,0': the port 'notaport' is not a number from 1 to 65535; write HOST:PORT,PROCESSES,ID with 0 <= ID < PROCESSES, e.g. localhost:1234,2,0, or 'auto'.
        """  # noqa: E501
        if self.distributed in (None, "auto"):
            return None if self.distributed is None else {}
        fields = self.distributed.split(",")
        host, colon, port = fields[0].rpartition(":")
        processes, index = [*fields[1:], "", ""][:2]
        count = int(processes) if processes.isdigit() else 0
        wrong = refusal(
            (len(fields) != 3, f"it has {len(fields)} comma-separated fields, not 3"),
            (not colon or not _HOST.fullmatch(host), f"the host {host!r} is not a host name "
             "or address (HOST:PORT, [IPv6]:PORT)"),
            (not (port.isdigit() and 1 <= int(port) <= 65535),
             f"the port {port!r} is not a number from 1 to 65535"),
            (count < 1, f"the process count {processes!r} is not a positive number"),
            (not (index.isdigit() and int(index) < count),
             f"the process ID {index!r} is not a number from 0 to PROCESSES - 1"),
        )  # fmt: skip
        if wrong:
            raise ValueError(
                f"--distributed {self.distributed!r}: {wrong}; write HOST:PORT,PROCESSES,ID "
                "with 0 <= ID < PROCESSES, e.g. localhost:1234,2,0, or 'auto'."
            )
        return {"coordinator_address": fields[0], "num_processes": int(processes),
                "process_id": int(index)}  # fmt: skip


_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
"""A host of ``--distributed``: a name, an IPv4 address, or an IPv6 one in brackets."""


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
    gpt, model = config.model == "gpt", str(config.model)
    if ":" in model:
        load_factory(model)
    _refuse(
        (":" not in model and model not in MODEL_NAMES, f"--model {model!r} is neither a zoo "
         f"model ({', '.join(MODEL_NAMES)}) nor package.module:factory."),
        (config.target_tokens is not None and not gpt,
         "--target-tokens is for --model gpt; image models take --target-batch-size."),
        (config.optimizer not in OPTIMIZER_NAMES, f"unknown optimizer {config.optimizer!r}; "
         f"choose one of {', '.join(OPTIMIZER_NAMES)}."),
        (config.resume and config.workdir is None,
         "--resume needs --workdir (the directory of the run to resume)."),
        (config.tensorboard and config.workdir is None,
         "--tensorboard writes its event files into --workdir: add --workdir DIR."),
        (config.batch_schedule is not None and gpt,
         "--batch-schedule is for image models; --model gpt takes --target-tokens."),
        (config.objective not in OBJECTIVES,
         f"--objective {config.objective!r} must be one of {', '.join(OBJECTIVES)}."),
        (config.distributed is not None and (gpt or not config.data_parallel),
         "--distributed trains an image model over every process's devices: add "
         "--data-parallel (--model gpt runs on one process)."),
        (config.background_search and gpt, "--background-search is for image models; "
         "--model gpt plans each bucket at its first batch."),
        (config.background_search and config.micro_batch_size != "auto",
         "--background-search goes on searching while training: it needs "
         "--micro-batch-size auto."),
    )  # fmt: skip
    config.distributed_args()  # raises naming the flag
    if config.tensorboard:
        check_extra("tensorboardX", "tensorboard", "--tensorboard")
    check, t_max = flag_int, {"high": _MAX_T, "high_name": "2**31 - 1"}
    check("--distributed-timeout", config.distributed_timeout)
    check("--target-batch-size", config.target_batch_size, **t_max)
    if config.batch_schedule is not None:
        config.schedule()  # raises naming the flag
    if config.micro_batch_size != "auto":
        largest = max(config.target_sizes())
        bound = "the largest size of --batch-schedule" if config.batch_schedule else (
            "--target-batch-size")  # fmt: skip
        check("--micro-batch-size", config.micro_batch_size, high=largest,
              high_name=f"{bound} {largest}")  # fmt: skip
    if config.memory_limit is not None:
        check("--memory-limit", config.memory_limit)
    flag_number("--learning-rate", config.learning_rate)
    check("--updates", config.updates)
    if config.epochs is not None:
        flag_number("--epochs", config.epochs)
    check("--seed", config.seed, low=0, high=2**63 - 1, high_name="2**63 - 1")
    check("--checkpoint-every", config.checkpoint_every)
    if config.multiple_of is not None:
        check("--multiple-of", config.multiple_of, **t_max)
    if config.ghost_batch_size is not None:
        check("--ghost-batch-size", config.ghost_batch_size, low=0, **t_max)
    if ":" not in config.model:  # a user's model is checked once loaded
        check_ghost(config, _batch_norm(config.model))
    check("--eval-every", config.eval_every, low=0)
    if config.target_tokens is not None:
        check("--target-tokens", config.target_tokens, **t_max)
    check("--max-length", config.max_length)
    paths = {"--workdir": config.workdir, "--compilation-cache": config.compilation_cache}
    for flag, path in paths.items():
        _refuse(
            (path is not None and any(c in path for c in "*?[]"),
             f"{flag} {path!r} must not hold *, ?, [ or ] (orbax reads them as patterns)."),
            (path is not None and Path(path).exists() and not Path(path).is_dir(),
             f"{flag} {path!r} is a file; it must name a directory."),
        )  # fmt: skip
    if gpt:
        tokens = config.target_tokens
        _refuse(
            (config.dataset != "synthetic",
             "--model gpt trains on synthetic sequences: use --dataset synthetic."),
            (config.micro_batch_size != "auto",
             "--model gpt plans each bucket itself: use --micro-batch-size auto."),
            (config.epochs is not None,
             "--model gpt reads an endless stream: use --updates, not --epochs."),
            (config.max_length < 16, f"--max-length {config.max_length} must be at least 16."),
            (tokens is not None and tokens < config.max_length, f"--target-tokens {tokens} must "
             f"be at least --max-length {config.max_length}: an update holds at least one "
             "sequence of each bucket."),
        )  # fmt: skip


GHOST_BATCH_SIZE = 32
"""The examples each BatchNorm statistic of the ResNets is computed over, by default."""


def ghost_batch_size(config: TrainConfig, batch_norm: bool | None = None) -> int | None:
    """The ghost batch of a model with BatchNorm: a property of the run, not the plan.

    ``--ghost-batch-size`` (0: none), else the largest divisor of `GHOST_BATCH_SIZE` that
    divides every target batch, at least 8; else None, as for a model without BatchNorm
    (``batch_norm``; None: the zoo's table, False for a user's model until it is loaded)
    or a data-parallel run. Every micro-batch holds whole ghost batches, so the training
    is the same on any device.

    Examples:
        >>> ghost_batch_size(TrainConfig(model="resnet-tiny", target_batch_size=96))
        32
        >>> ghost_batch_size(TrainConfig(model="resnet-tiny", ghost_batch_size=16))
        16
        >>> ghost_batch_size(TrainConfig(model="resnet-tiny", target_batch_size=100)) is None
        True
    """
    if batch_norm is None:
        batch_norm = _batch_norm(config.model)
    if not batch_norm or config.data_parallel or config.ghost_batch_size == 0:
        return None
    if config.ghost_batch_size is not None:
        return config.ghost_batch_size
    size = math.gcd(GHOST_BATCH_SIZE, *config.target_sizes())
    return size if size >= 8 else None


def check_ghost(config: TrainConfig, batch_norm: bool) -> int | None:
    """The run's `ghost_batch_size`, ``--ghost-batch-size`` checked against the model and plan.

    The command line checks a zoo model's with the other flags, a user's model once loaded.
    """
    ghost, chosen = ghost_batch_size(config, batch_norm), config.ghost_batch_size
    if chosen:
        _refuse(
            (config.data_parallel, "--ghost-batch-size does not combine with --data-parallel "
             "(each device normalizes its own share of a micro-batch)."),
            (ghost is None, f"--ghost-batch-size is for models with BatchNorm statistics; "
             f"--model {config.model} has none."),
            (any(t % chosen for t in config.target_sizes()), f"--ghost-batch-size {chosen} "
             f"must divide every target batch ({', '.join(map(str, config.target_sizes()))})."),
        )  # fmt: skip
    micro = config.micro_batch_size
    _refuse(
        (ghost is not None and micro != "auto" and micro % ghost, f"--micro-batch-size {micro} "
         f"holds no whole number of BatchNorm's ghost batches of {ghost}: pass a multiple of "
         f"{ghost}, a --ghost-batch-size that divides {micro}, or --ghost-batch-size 0 "
         "(statistics per micro-batch: the training then depends on the device)."),
    )  # fmt: skip
    return ghost


def refusal(*checks: tuple[bool, str]) -> str | None:
    """The message of the first check that is true, or None.

    Examples:
        >>> refusal((False, "a"), (True, "b"), (True, "c"))
        'b'
    """
    return next((message for wrong, message in checks if wrong), None)


def _refuse(*checks: tuple[bool, str]) -> None:
    """Raises the `ValueError` of the first check that is true."""
    if (message := refusal(*checks)) is not None:
        raise ValueError(message)


def load_factory(spec: str) -> Callable[..., Any]:
    """The factory ``--model package.module:factory`` names, imported; else a one-line `ValueError`.

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
    except (Exception, SystemExit) as exc:  # an ImportError, the module's own error or exit
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(
            f"--model {spec!r}: cannot import {module_name} ({type(exc).__name__}: {first})."
        ) from exc
    factory: Any = module
    for part in name.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {name!r}.")
    return factory


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """The optax optimizer the config names, at its learning rate."""
    import optax  # here: the flags are checked before optax (and JAX) are imported

    return getattr(optax, config.optimizer)(config.learning_rate)


def flag_int(
    flag: str, value: Any, *, low: int = 1, high: int | None = None, high_name: str | None = None
) -> int:
    """A command-line flag's int from ``low`` to ``high``, or a one-line `ValueError` naming it.

    Every wrong value (a bool, a float, out of range) is a `ValueError`: the flag's text is
    already parsed. ``high_name`` names ``high`` in the message (``"2**31 - 1"``, a flag).

    Examples:
        >>> flag_int("--updates", 0)
        Traceback (most recent call last):
        ValueError: --updates 0 must be a positive int.
        >>> flag_int("--seed", 2**70, low=0, high=2**63 - 1, high_name="2**63 - 1")
        Traceback (most recent call last):
        ValueError: --seed 1180591620717411303424 must be at most 2**63 - 1.
    """
    if not checks.is_int(value) or value < low:
        kind = "a positive int" if low == 1 else f"an int, {low} or more"
        raise ValueError(f"{flag} {value!r} must be {kind}.")
    if high is not None and value > high:
        raise ValueError(f"{flag} {value} must be at most {high_name or high}.")
    return int(value)


def flag_number(flag: str, value: Any) -> float:
    """A command-line flag's finite number above 0, or a one-line `ValueError` naming it.

    Examples:
        >>> flag_number("--epochs", float("inf"))
        Traceback (most recent call last):
        ValueError: --epochs inf must be a finite number above 0.
    """
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} {value!r} must be a finite number above 0.")
    return float(value)
