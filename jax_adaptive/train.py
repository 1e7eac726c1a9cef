"""``python -m jax_adaptive.train``: the command line, `jax_adaptive.cli.main.main`."""

import sys

from jax_adaptive.cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
