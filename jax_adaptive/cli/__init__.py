"""The command line, ``python -m jax_adaptive.train``: a thin layer over the library.

It imports the library and nothing in the library imports it. Its modules:

* `jax_adaptive.cli.main`: the flags, `main` and `train` (which tests call too);
* `jax_adaptive.cli.config`: `TrainConfig`, one field per flag, and its checks;
* `jax_adaptive.cli.images`: the image path (`jax_adaptive.cli.image_models` builds
  the zoo's or a user's model); `jax_adaptive.cli.language_model`: ``--model gpt``;
* `jax_adaptive.cli.run`: the run's side of `jax_adaptive.loop.fit_loop` (lines,
  ``metrics.jsonl``, ``plan.json``, checkpoints) and its summary;
* `jax_adaptive.cli.workdir` and `jax_adaptive.cli.checkpoints`: where a run writes;
* `jax_adaptive.cli.datasets`: synthetic images and TFDS sources;
* `jax_adaptive.cli.report`: ``python -m jax_adaptive.report WORKDIR``, a run's plots;
* `jax_adaptive.cli.extras`: the optional dependencies (the ``tfds`` and ``report``
  extras), one line saying what to install when one is missing.
"""
