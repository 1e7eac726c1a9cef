"""No plan cache for the whole session: tests, doctests and the subprocesses they start.

A run must never depend on what an earlier one stored; the plan cache's own tests give
it a file of their own.
"""

import os

os.environ["JAX_ADAPTIVE_PLAN_CACHE"] = "off"
