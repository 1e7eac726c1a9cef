"""Sharded train state on 8 CPU devices (FSDP, ZeRO-1, an NNX model), against one device.

The figures come from sharded_job.py, run once in a subprocess (the device count is
fixed when JAX starts). Every trained configuration is compared with plain optax on one
device, one full-batch step per update, after 3 updates at 5 micro-batches of 24 for a
target of 100 (which they do not divide); with BatchNorm, one step over groups of 4 in
order (ghost batches).
"""

from pathlib import Path

import pytest
from helpers import job_result

JOB = Path(__file__).with_name("sharded_job.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return job_result(JOB, tmp_path_factory.mktemp("sharded"), timeout=240)


def test_fsdp_shards_parameters_and_optimizer_state_and_is_exact(result):
    fsdp = result["fsdp"]
    want = {"w1": "P(None, 'data')", "b1": "P('data',)", "w2": "P('data',)"}
    assert fsdp["param_specs"] == fsdp["mu_specs"] == want
    assert fsdp["steps"] == 5
    assert fsdp["difference"] < TOL


def test_zero1_shards_the_optimizer_state_only_and_is_exact(result):
    zero1 = result["zero1"]
    assert set(zero1["param_specs"].values()) == {"P()"}
    assert zero1["mu_specs"] == {"w1": "P('data', None)", "b1": "P('data',)", "w2": "P('data',)"}
    assert zero1["difference"] < TOL


def test_replicated_is_exact(result):
    assert result["replicated"]["difference"] < TOL


def test_nnx_trainer_shards_as_the_models_annotations_say_and_is_exact(result):
    nnx = result["nnx"]
    assert nnx["kernel_specs"] == ["P(None, 'data')", "P('data', None)"]
    assert nnx["steps"] == 5
    assert nnx["micro_step"]["all-gather"] > 0  # the kernels are gathered, so they were split
    assert nnx["difference"] < TOL


def test_ghost_batches_and_batch_statistics_under_fsdp_train_as_one_device(result):
    ghost = result["ghost"]
    # BatchNorm over groups of 4 at 24 x 5 for T = 100 (the last micro-batch 4 real rows,
    # 5 groups of padding that must leave the statistics alone), the kernels and the
    # BatchNorm's scale split over data, its statistics replicated.
    assert ghost["specs"] == ["P(None, 'data')", "P('data',)"] and ghost["stats_spec"] == "P()"
    assert ghost["steps"] == 5 and "state sharded over data (FSDP)" in ghost["plan"]
    assert ghost["stats_moved"] > 0.1  # the running averages did move: 75 groups
    assert ghost["difference"] < TOL and ghost["stats_difference"] < TOL


def test_the_ledger_counts_each_devices_share_of_the_live_state(result):
    for mode in ("replicated", "fsdp", "zero1"):
        assert result[mode]["ledger_state"] == result[mode]["live_state"], mode
    # Sharding shrinks what each device holds: FSDP most, ZeRO-1 between.
    states = [result[m]["live_state"] for m in ("fsdp", "zero1", "replicated")]
    assert states == sorted(states) and states[0] * 4 < states[2]


def test_sharded_state_fits_a_larger_micro_batch_under_the_same_limit(result):
    searched = result["searched"]
    assert searched["replicated"] == 40  # the limit is its ledger at 40
    assert searched["fsdp"] > searched["zero1"] > searched["replicated"]


def test_the_plan_states_the_collectives_it_costs(result):
    replicated, fsdp, zero1 = result["replicated"], result["fsdp"], result["zero1"]
    assert sum(replicated["micro_step"].values()) == 0  # each device accumulates its own
    assert replicated["per_update"] == {"all-reduce": 1}  # one reduction, in the optimizer step
    assert "per micro-step" not in replicated["plan"]
    assert "collectives 1 all-reduce per update" in replicated["plan"]
    gathers = fsdp["micro_step"]["all-gather"]
    assert gathers > 0
    assert fsdp["per_update"]["all-gather"] == 5 * gathers  # none in the optimizer step
    assert f"{gathers} all-gather" in fsdp["plan"] and "per micro-step" in fsdp["plan"]
    assert sum(zero1["micro_step"].values()) == 0  # the parameters are whole on each device
    assert zero1["per_update"]["all-gather"] > 0  # the updated parameters, once per update


def test_the_plan_states_the_sharding_it_assumed(result):
    said = {
        "replicated": "state replicated over 8 devices",
        "fsdp": "state sharded over data (FSDP)",
        "zero1": "optimizer state sharded over data (ZeRO-1)",
        "nnx": "state sharded over data (FSDP)",  # from the model's annotations
    }
    for mode, words in said.items():
        assert f", {words}, " in result[mode]["plan"], (mode, result[mode]["plan"])


def test_a_plan_on_one_device_says_no_sharding():
    from jax_adaptive.memory import Ledger
    from jax_adaptive.plan import Plan

    plan = Plan(24, 5, Ledger(1, 2, 3), None, 1)
    assert "sharded" not in str(plan) and "replicated" not in str(plan)
    sharded = str(plan._replace(sharding="state sharded over data (FSDP)"))
    assert sharded.endswith("1 micro-step per dispatch, state sharded over data (FSDP)")


def test_a_sharding_that_cannot_hold_is_one_line(result):
    divide, axis = result["errors"]["divide"], result["errors"]["axis"]
    assert divide == (
        "param_sharding['b1']: P('data',) splits dimension 0 of shape (12,), of size 12, "
        "over 8 devices (data): it must divide."
    )
    assert "\n" not in axis and "names axis 'model', not in the mesh {'data': 8}" in axis
    assert axis.startswith("opt_state_sharding['w2']")


def test_a_sharding_needs_a_mesh_and_its_axes():
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import jax_adaptive as ja

    def loss(p, b, r):
        return b * p["w"].sum()

    with pytest.raises(ValueError, match=r"^opt_state_sharding needs a mesh"):
        ja.AdaptiveTrainer(loss, optax.sgd(0.1), target_batch_size=4, opt_state_sharding=P())
    trainer = ja.AdaptiveTrainer(
        loss, optax.adam(0.1), target_batch_size=4, mesh=ja.data_mesh(jax.devices()[:1]),
        param_sharding={"w": P("model")}, plan_cache=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^param_sharding\['w'\]: .* names axis 'model'"):
        trainer.init({"w": jnp.ones(4)}, jnp.ones(4))
