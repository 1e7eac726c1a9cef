"""The planner's capacity on a device that reports its memory (a GPU's memory_stats)."""

import jax
import optax
from helpers import mlp_loss, mlp_params, regression_batches

from jax_adaptive.distributed import Placement
from jax_adaptive.executables import Executables
from jax_adaptive.planner import Planner
from jax_adaptive.sizing import Sizing
from jax_adaptive.step import TrainState, multi_steps

T = 12


class ReportingDevice:
    """A device as a GPU describes itself: its allocator's limit and what is live on it."""

    platform, device_kind = "gpu", "a GPU with 1 GB for JAX"

    def __init__(self, limit, in_use):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return dict(self.stats)


def test_the_capacity_leaves_out_headroom_and_what_other_arrays_hold():
    optimizer = optax.adam(1e-2)
    params = mlp_params()
    state = TrainState(params, multi_steps(optimizer, 1).init(params), (), jax.random.key(0))
    state = jax.device_put(state)
    own = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    others = 7_000_000  # another model a user keeps on the same device
    device = ReportingDevice(limit=10**9, in_use=own + others)
    sizing = Sizing("micro-step of", headroom=0.05, device=device)
    executables = Executables(
        mlp_loss, optimizer, sizing, everywhere=Placement().everywhere, in_flight=1, key=dict
    )
    executables.bind(state, regression_batches(1, T)[0])
    planner = Planner(executables, target_batch_size=T)
    planner.plan_for(state)
    assert planner.capacity() == int(10**9 * 0.95) - others
    assert planner.plan.micro_batch_size == T  # a small model: the whole batch fits
    # A memory_limit below the device's capacity is the capacity.
    sizing.set_memory_limit(10**5)
    assert planner.capacity() == 10**5
