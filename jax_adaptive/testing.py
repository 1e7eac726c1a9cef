"""Fault injection: out-of-memory errors on demand, through the path a real one takes."""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterator
from typing import Any

import jax

from jax_adaptive.step import DONATED, MicroArgs

__all__ = ["FaultInjector", "inject_oom"]


class FaultInjector:
    """Makes chosen micro-step executions, or chosen sizes' compiles, run out of memory.

    As a real out-of-memory does, it deletes a run's donated inputs and raises
    ``jax.errors.JaxRuntimeError`` with XLA's ``RESOURCE_EXHAUSTED`` text.

    Args:
        executions: 1-based numbers of the micro-step executions to fail, counted from
            when the injector is installed.
        compile_sizes: micro-batch sizes whose compile always fails.
        delete_donated: False mimics an error raised at dispatch on a GPU.

    Attributes:
        executions_seen: micro-step executions so far.
        injected: the (execution number, size) of each injected failure.
    """

    def __init__(
        self,
        executions: Container[int] = (),
        compile_sizes: Container[int] = (),
        delete_donated: bool = True,
    ):
        self.executions = executions
        self.compile_sizes = compile_sizes
        self.delete_donated = delete_donated
        self.executions_seen = 0
        self.injected: list[tuple[int, int]] = []

    def before_execution(self, size: int, args: MicroArgs | tuple[()]) -> None:
        """Called by the trainer just before a micro-step of ``size`` runs on ``args``."""
        self.executions_seen += 1
        if self.executions_seen not in self.executions:
            return
        if self.delete_donated and isinstance(args, MicroArgs):
            for name in DONATED:
                for leaf in jax.tree.leaves(getattr(args, name)):
                    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                        leaf.delete()
        self.injected.append((self.executions_seen, size))
        raise jax.errors.JaxRuntimeError(
            f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate a micro-batch of "
            f"{size} (injected at execution {self.executions_seen})."
        )

    def before_compile(self, size: int) -> None:
        """Called by the trainer just before it compiles the micro-step for ``size``."""
        if size in self.compile_sizes:
            self.injected.append((0, size))
            raise jax.errors.JaxRuntimeError(
                f"RESOURCE_EXHAUSTED: Out of memory while compiling the micro-step for {size} "
                "(injected)."
            )


@contextlib.contextmanager
def inject_oom(trainer: Any, **kwargs: Any) -> Iterator[FaultInjector]:
    """Installs a `FaultInjector` as a trainer's ``fault_hook`` inside a ``with`` block.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, optax, jax_adaptive as ja
        >>> from jax_adaptive.testing import inject_oom
        >>> trainer = ja.AdaptiveTrainer(lambda p, b, r: (b * p) ** 2, optax.sgd(0.1),
        ...                              target_batch_size=8)
        >>> batch = np.ones(8, np.float32)
        >>> state = trainer.init(jnp.ones(()), batch)
        >>> with inject_oom(trainer, executions={1, 2}) as faults:
        ...     state, metrics = trainer.step(state, batch)
        >>> faults.injected  # 8 with the optimizer step in its program, then 8 alone
        [(1, 8), (2, 8)]
        >>> metrics["micro_batch_size"] < 8
        True
    """
    injector = FaultInjector(**kwargs)
    previous, trainer.fault_hook = trainer.fault_hook, injector
    try:
        yield injector
    finally:
        trainer.fault_hook = previous
