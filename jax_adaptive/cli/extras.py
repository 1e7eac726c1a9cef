"""The command line's optional dependencies (tfds, matplotlib): one line saying which extra."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_extra"]


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
