"""The command line's optional dependencies (tfds, matplotlib, tensorboardX): one line each."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["check_extra", "import_extra"]


def import_extra(module: str, extra: str, what: str) -> ModuleType:
    """``module`` imported, or a one-line `ValueError` saying which extra ``what`` needs.

    Examples:
        >>> import_extra("json", "none", "the example").__name__
        'json'
        >>> import_extra("no_such_module", "tfds", "--dataset tfds:mnist")
        Traceback (most recent call last):
        ValueError: --dataset tfds:mnist needs no_such_module: pip install 'jax_adaptive[tfds]'.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # installed, but something it imports is not
            raise
        raise ValueError(f"{what} needs {module}: pip install 'jax_adaptive[{extra}]'.") from exc


def check_extra(module: str, extra: str, what: str) -> None:
    """`import_extra`'s one-line `ValueError` if ``module`` is not installed, without importing it.

    For a flag's check, before JAX starts.

    Examples:
        >>> check_extra("json", "none", "the example")
        >>> check_extra("no_such_module", "tensorboard", "--tensorboard")
        Traceback (most recent call last):
        ValueError: --tensorboard needs no_such_module: pip install 'jax_adaptive[tensorboard]'.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, a module without a spec
        found = False
    if not found:
        raise ValueError(f"{what} needs {module}: pip install 'jax_adaptive[{extra}]'.")
