"""The command line, ``python -m jax_adaptive.train``; nothing in the library imports it.

The guide, and which module does what: docs/cli.md.
"""
