"""The command line, ``python -m jax_adaptive.train`` (guide: docs/cli.md).

It imports the library and nothing in the library imports it: `jax_adaptive.cli.main`
(flags, `main`, `train`), `jax_adaptive.cli.config` (`TrainConfig` and its checks), the
image path (`jax_adaptive.cli.images`, `jax_adaptive.cli.image_models`), ``--model
gpt`` (`jax_adaptive.cli.language_model`), `jax_adaptive.cli.run` (what a run does
around the one loop), `jax_adaptive.cli.workdir` and `jax_adaptive.cli.checkpoints`,
`jax_adaptive.cli.datasets`, `jax_adaptive.cli.report` and `jax_adaptive.cli.extras`.
"""
