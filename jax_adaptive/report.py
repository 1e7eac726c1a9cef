"""``python -m jax_adaptive.report WORKDIR``: a run's plots, `jax_adaptive.cli.report.main`."""

import sys

from jax_adaptive.cli.report import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
