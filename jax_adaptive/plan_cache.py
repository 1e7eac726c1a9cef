"""A persistent plan cache: the micro-batch size a job found, remembered across runs.

A plan's key holds all that decides it (device, capacity, limit, headroom, a fingerprint of
the lowered micro-step, target batch size, JAX version); an entry is only a hint, guarded
like any new size, and a corrupt file or senseless entry is ignored with a warning. The
file (``$XDG_CACHE_HOME/jax_adaptive/plans.json`` unless ``$JAX_ADAPTIVE_PLAN_CACHE`` names
another or is ``off``) may sit where others can write: a symbolic link at it or its lock is
never followed, and writes go through an exclusive temporary file. Guide: docs/memory.md.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import stat
import time
import warnings
from pathlib import Path
from typing import Any

import jax

from jax_adaptive import checks
from jax_adaptive.files import write_atomic

__all__ = ["PlanCache", "enable_compilation_cache", "plan_key"]

_ENV = "JAX_ADAPTIVE_PLAN_CACHE"
_WARNED: set[str] = set()  # the files this process has warned of


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _flaw(entry: dict[str, Any], target_batch_size: int) -> tuple[str, str] | None:
    """``("stale" | "malformed", why)`` where the entry is not what sizing would store."""
    size, estimate = entry.get("micro_batch_size"), entry.get("estimated_bytes")
    if not (checks.is_int(size) and 1 <= size <= target_batch_size):
        return "stale", f"micro_batch_size={size!r} is not in [1, {target_batch_size}]"
    if estimate is not None and not (checks.is_int(estimate) and estimate >= 0):
        return "malformed", f"estimated_bytes={estimate!r} is not an int >= 0 nor null"
    return None


class _Link(OSError):
    """The cache's file or lock is a symbolic link: it is never read or written through."""


def _open(path: Path, flags: int) -> int:
    """``os.open`` (new files: 0o666 less the umask) that raises `_Link` at a symbolic link."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP and path.is_symlink():
            raise _Link(f"{path.name} is a symbolic link, which the cache never follows") from exc
        raise


def plan_key(**parts: Any) -> str:
    """A stable hex digest of the named parts of a plan's key (JSON-serialisable values).

    Examples:
        >>> plan_key(device="cpu", target=256) == plan_key(target=256, device="cpu")
        True
    """
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class PlanCache:
    """Plans by key in one JSON file, ``path`` (`PlanCache.default_path` by default).

    Examples:
        >>> import tempfile, pathlib
        >>> cache = PlanCache(pathlib.Path(tempfile.mkdtemp()) / "plans.json")
        >>> cache.put("k", {"micro_batch_size": 438})
        >>> cache.get("k")["micro_batch_size"]
        438
        >>> cache.get("other") is None
        True
    """

    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.path = Path(path) if path is not None else self.default_path()

    @staticmethod
    def default_path() -> Path:
        """The default file: ``$JAX_ADAPTIVE_PLAN_CACHE``, else under the user's cache dir."""
        named = os.environ.get(_ENV)
        if named and named != "off":
            return Path(named)
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "jax_adaptive" / "plans.json"

    @classmethod
    def from_arg(cls, arg: PlanCache | str | os.PathLike[str] | bool | None) -> PlanCache | None:
        """The cache a trainer's ``plan_cache`` argument names, or None for none.

        None means the default (off where ``JAX_ADAPTIVE_PLAN_CACHE=off``), False none,
        a path that file, a `PlanCache` itself.
        """
        if isinstance(arg, PlanCache):
            return arg
        if arg is False:
            return None
        if arg is None or arg is True:
            return None if os.environ.get(_ENV) == "off" else cls()
        if isinstance(arg, str | os.PathLike):
            return cls(arg)
        raise TypeError(f"plan_cache must be a path, a PlanCache, True/False or None, got {arg!r}.")

    def _warn(self, problem: str) -> None:
        """Warns once per file in this process: training goes on, with or without it."""
        key = str(self.path.absolute())
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"ignoring the plan cache {self.path}: {problem}.", stacklevel=4)

    def _read(self) -> dict[str, Any]:
        """The file's entries; {} (with a warning) when it is unreadable; `_Link` at a link."""
        try:
            fd = _open(self.path, os.O_RDONLY)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.close(fd)
                self._warn("it is a directory, so the plans found are not remembered")
                return {}
            with os.fdopen(fd) as f:
                entries = json.loads(f.read())
            if not isinstance(entries, dict):
                raise ValueError(f"expected a JSON object, got {type(entries).__name__}")
            return entries
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except _Link:
            raise
        except (OSError, ValueError, RecursionError) as exc:  # deep nesting: RecursionError
            self._warn(f"it is unreadable ({_first_line(exc)}); plans are searched afresh")
            return {}

    def get(self, key: str) -> dict[str, Any] | None:
        """The plan stored under ``key``, or None."""
        try:
            entry = self._read().get(key)
        except _Link as exc:
            self._warn(f"{exc}, so plans are not remembered")
            return None
        return entry if isinstance(entry, dict) else None

    def plan(self, key: str, target_batch_size: int) -> dict[str, Any] | None:
        """The plan under ``key``, or None; a stale or malformed one warns.

        Examples:
            >>> import tempfile, pathlib
            >>> cache = PlanCache(pathlib.Path(tempfile.mkdtemp()) / "plans.json")
            >>> cache.put("k", {"micro_batch_size": 438})
            >>> cache.plan("k", target_batch_size=4096)["micro_batch_size"]
            438
            >>> cache.put("k", {"micro_batch_size": 438, "estimated_bytes": "lots"})
            >>> with warnings.catch_warnings(record=True) as caught:
            ...     warnings.simplefilter("always")
            ...     print(cache.plan("k", target_batch_size=4096))
            None
            >>> print(caught[0].message)  # doctest: +ELLIPSIS
            ignoring a malformed plan in ...: estimated_bytes='lots' is not an int >= 0 nor null
        """
        entry = self.get(key)
        flaw = None if entry is None else _flaw(entry, target_batch_size)
        if flaw is not None:
            warnings.warn(f"ignoring a {flaw[0]} plan in {self.path}: {flaw[1]}", stacklevel=5)
            return None
        return entry

    def put(self, key: str, plan: dict[str, Any]) -> None:
        """Stores ``plan`` under ``key``; never raises (a file it cannot write warns once).

        Under an exclusive lock on ``<file>.lock`` it reads, merges and atomically replaces
        the file, so writers in several processes lose nothing and a crash leaves no half file.

        Examples:
            >>> import tempfile, pathlib
            >>> path = pathlib.Path(tempfile.mkdtemp()) / "plans.json"
            >>> PlanCache(path).put("a", {"micro_batch_size": 4})
            >>> PlanCache(path).put("b", {"micro_batch_size": 8})
            >>> sorted(json.loads(path.read_text()))
            ['a', 'b']
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = _open(self.path.with_name(self.path.name + ".lock"), os.O_WRONLY | os.O_CREAT)
            with os.fdopen(lock, "w"):
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                entries = self._read()
                entries[key] = {**plan, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
                write_atomic(self.path, json.dumps(entries, indent=1, sort_keys=True))
        except _Link as exc:
            self._warn(f"{exc}, so plans are not remembered")
        except OSError as exc:
            self._warn(f"it cannot be written ({_first_line(exc)}), so plans are not remembered")


def enable_compilation_cache(path: str | os.PathLike[str] | None = None) -> Path:
    """Turns on JAX's persistent compilation cache, so a second run skips XLA compiles.

    Returns the directory: ``path``, by default ``xla/`` beside the plan cache's file.

    Examples:
        >>> import tempfile
        >>> enable_compilation_cache(tempfile.mkdtemp()).is_dir()
        True
        >>> jax.config.update("jax_compilation_cache_dir", None)  # off again
    """
    directory = Path(path) if path is not None else PlanCache.default_path().parent / "xla"
    try:
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(20, "it is a file")
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"cannot use {str(directory)!r} as the compilation cache (--compilation-cache): "
            f"{exc.strerror or exc}."
        ) from None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
