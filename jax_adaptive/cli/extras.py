"""The command line's optional dependencies, each installed by an extra of the package.

``--dataset tfds:NAME`` needs ``tensorflow-datasets`` (``pip install
'jax_adaptive[tfds]'``), ``python -m jax_adaptive.report`` needs matplotlib (``pip
install 'jax_adaptive[report]'``); the library and the rest of the command line need
neither. `import_extra` imports one, or says in one line what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_extra"]


def import_extra(module: str, extra: str, what: str) -> ModuleType:
    """``module`` imported, or a one-line `ValueError` saying which extra ``what`` needs.

    Args:
        module: the module to import (``"tensorflow_datasets"``).
        extra: the package's extra that installs it (``"tfds"``).
        what: what needs it, as the user asked for it (``"--dataset tfds:mnist"``).

    Raises:
        ValueError: when ``module`` is not installed. An error raised while importing
            an installed one (a module it imports is missing) propagates as it is.

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
