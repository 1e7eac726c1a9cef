"""Nothing lost: out-of-memory at any moment costs no state, no example, no exactness."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, mlp_loss, mlp_params, regression_batches

import jax_adaptive as ja
from jax_adaptive import testing
from jax_adaptive.models import linen_classifier_loss
from jax_adaptive.testing import inject_oom

N, T, EPOCHS = 320, 64, 10


def id_loss(params, batch, rng):
    """The regression loss plus ``seen[id]``: SGD on ``seen`` counts each example's visits."""
    return mlp_loss(params["mlp"], batch, rng) + params["seen"][batch["id"]]


def epoch_stream(epoch, rng):
    """One epoch of examples with ids, in chunks of random sizes (0 included)."""
    order = np.random.default_rng(epoch).permutation(N)
    data = regression_batches(1, N, seed=epoch)[0]
    cuts = np.sort(rng.integers(0, N, size=40))
    for chunk in np.split(order, cuts):
        yield {"id": chunk.astype(np.int32), "x": data["x"][chunk], "y": data["y"][chunk]}


def size_estimate(size):
    trainer = ja.AdaptiveTrainer(id_loss, optax.sgd(0.1), target_batch_size=T, micro_batch_size=T)
    trainer.init(
        {"mlp": mlp_params(), "seen": jnp.zeros(N)}, next(epoch_stream(0, np.random.default_rng(0)))
    )
    return trainer.ledger(size).total


def run_epochs(faults=None, **trainer_kwargs):
    trainer = ja.AdaptiveTrainer(id_loss, optax.sgd(0.1), target_batch_size=T, **trainer_kwargs)
    chunks = np.random.default_rng(99)
    state = trainer.init(
        {"mlp": mlp_params(), "seen": jnp.zeros(N)},
        {"id": np.zeros(1, np.int32), **regression_batches(1, 1)[0]},
    )
    visits, sizes = [], []
    with inject_oom(trainer, **(faults or {})) as injector:
        for epoch in range(EPOCHS):
            state, history = trainer.fit(state, epoch_stream(epoch, chunks), num_updates=N // T)
            assert len(history) == N // T
            visits.append(np.asarray(state.params["seen"]) / (-0.1 / T))
            sizes += [h["micro_batch_size"] for h in history]
    return state, visits, sizes, injector


@pytest.fixture(scope="module")
def fault_free():
    return run_epochs(memory_limit=size_estimate(8))


@pytest.mark.parametrize("delete_donated", [True, False])
def test_200_injected_ooms_change_nothing(fault_free, delete_donated):
    limit = size_estimate(8)
    rng = np.random.default_rng(2026)
    executions = set(rng.choice(np.arange(1, 801), size=200, replace=False).tolist())
    state, visits, sizes, injector = run_epochs(
        faults={"executions": executions, "delete_donated": delete_donated},
        memory_limit=limit,
        grow=1,
        oom_retries=8,  # the schedule holds runs of up to 4 faults in a row
    )
    assert len(injector.injected) == 200, (len(injector.injected), injector.executions_seen)
    assert min(sizes) < 8, "the faults must have shrunk the micro-batch"
    for epoch, seen in enumerate(visits, start=1):
        np.testing.assert_allclose(seen, epoch, atol=1e-4)  # each id once an epoch
    expected, *_ = fault_free
    assert_trees_close(state.params, expected.params, 1e-6)
    assert int(state.updates) == EPOCHS * N // T


# ------------------------------------------------------------------ model state


class BatchNormNet(nn.Module):
    """A third-party module, used through the adapter unchanged."""

    @nn.compact
    def __call__(self, x, train=False):
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam
        # would amplify into noise-driven steps.
        x = nn.Dense(8, use_bias=False)(x)  # [m, positions, 8]: activations dominate
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(3)(jnp.mean(nn.relu(x), axis=1))


def bn_setup():
    model = BatchNormNet()
    variables = model.init(jax.random.key(0), jnp.zeros((2, 64, 4)))
    rng = np.random.default_rng(0)
    batches = [
        {
            "image": rng.normal(size=(24, 64, 4)).astype(np.float32),
            "label": rng.integers(0, 3, 24).astype(np.int32),
        }
        for _ in range(3)
    ]
    return model, variables, batches


def bn_reference(model, variables, batches, partitions, optimizer):
    """A plain loop: the given micro-batches, BatchNorm state threaded, one optax step each."""
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
    opt_state = optimizer.init(params)
    for batch, sizes in zip(batches, partitions, strict=True):
        grads = jax.tree.map(jnp.zeros_like, params)
        offset = 0
        for size in sizes:
            real = min(size, 24 - offset)
            idx = offset + np.arange(size) % real  # padding repeats the real rows
            micro = {k: v[idx] for k, v in batch.items()}
            mask = np.arange(size) < real

            def loss(p, micro=micro, mask=mask, state=model_state):
                logits, new_state = model.apply(
                    {"params": p, **state}, micro["image"], train=True, mutable=["batch_stats"]
                )
                losses = optax.softmax_cross_entropy_with_integer_labels(logits, micro["label"])
                return jnp.sum(jnp.where(mask, losses, 0)) / 24, new_state

            g, model_state = jax.grad(loss, has_aux=True)(params)
            grads = jax.tree.map(jnp.add, grads, g)
            offset += real
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, model_state


@pytest.mark.parametrize(
    ("fault_at", "partitions"),
    [
        # the first micro-step fails: the update starts again at 5
        (1, [[5] * 5, [5] * 5, [5] * 5]),
        # the third fails after two ran: it goes on at 5 from example 12, from the
        # host copy a new size's first update keeps
        (3, [[6, 6, 5, 5, 5], [5] * 5, [5] * 5]),
    ],
)
def test_batch_stats_are_threaded_and_restored(fault_at, partitions):
    model, variables, batches = bn_setup()
    loss = linen_classifier_loss(model, mutable=("batch_stats",))
    probe = ja.AdaptiveTrainer(
        loss,
        optax.adam(1e-2),
        target_batch_size=24,
        micro_batch_size=6,
        has_aux=True,
        has_state=True,
    )
    model_state = {"batch_stats": variables["batch_stats"]}
    probe.init(variables["params"], batches[0], model_state=model_state)
    limit = probe.ledger(6).total

    trainer = ja.AdaptiveTrainer(
        loss,
        optax.adam(1e-2),
        target_batch_size=24,
        memory_limit=limit,
        has_aux=True,
        has_state=True,
        grow="never",
    )
    state = trainer.init(variables["params"], batches[0], model_state=model_state)
    assert trainer.micro_batch_size == 6
    with inject_oom(trainer, executions={fault_at}):
        for batch in batches:
            state, _ = trainer.step(state, batch)
    params, stats = bn_reference(model, variables, batches, partitions, optax.adam(1e-2))
    assert_trees_close(state.model_state, stats, 1e-6)
    assert_trees_close(state.params, params, 1e-5)


# ------------------------------------------------------------------ policies, errors


def test_nothing_fits_names_the_bytes():
    batches = regression_batches(1, T)
    trainer = ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), target_batch_size=T, oom_retries=2)
    state = trainer.init(mlp_params(), batches[0])
    with inject_oom(trainer, executions=range(1, 10**6)):
        with pytest.raises(ja.NothingFitsError, match=r"the micro-step of 1 needs [\d,]+ bytes"):
            trainer.step(state, batches[0])
    # the state is intact: it trains on once memory is back
    state, metrics = trainer.step(state, batches[0])
    assert int(state.updates) == 1 and metrics["micro_batch_size"] >= 1


def test_a_compile_oom_marks_the_size_as_not_fitting():
    trainer = ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), target_batch_size=T, objective="max")
    with inject_oom(trainer, compile_sizes={T}):
        trainer.init(mlp_params(), regression_batches(1, T)[0])
    assert trainer.micro_batch_size == T - 1
    assert trainer.search_log[0][:2] == (T, False)
    assert trainer.search_log[0].decided_by == "compile"


def _estimate(trainer, size):
    return trainer.ledger(size).total


@pytest.mark.parametrize("grow", ["never", 2])
def test_a_real_oom_shrinks_to_the_headroom_below_its_estimate_and_grow_policies(grow):
    """After a real OOM at T, the size is the largest whose estimate is within
    (1 - headroom) of T's estimate; ``grow=2`` tries T again two updates later."""
    batches = regression_batches(3, T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.sgd(0.1), target_batch_size=T, grow=grow, objective="max"
    )
    state = trainer.init(mlp_params(), batches[0])
    cap = _estimate(trainer, T) * (1 - trainer.headroom)
    sizes = []
    # The first failure is the update's one program, the micro-step with the optimizer
    # step in it: it runs apart, at T again; the second, T's micro-step alone, shrinks.
    with inject_oom(trainer, executions={1, 2}) as faults:
        for batch in batches:
            state, metrics = trainer.step(state, batch)
            sizes.append(metrics["micro_batch_size"])
    assert faults.injected == [(1, T), (2, T)]
    shrunk = sizes[0]
    assert _estimate(trainer, shrunk) <= cap < _estimate(trainer, shrunk + 1)
    assert sizes == ([shrunk] * 3 if grow == "never" else [shrunk, shrunk, T])


def test_repeated_real_ooms_in_one_update_halve_the_learned_capacity():
    batches = regression_batches(1, T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.sgd(0.1), target_batch_size=T, grow="never", objective="max"
    )
    state = trainer.init(mlp_params(), batches[0])
    # 1: the micro-step with the optimizer step in it (then apart); 2 and 3: T, then below.
    with inject_oom(trainer, executions={1, 2, 3}):
        _, metrics = trainer.step(state, batches[0])
    failed = [t for t in trainer.search_log if t.decided_by == "run"]
    assert failed[0].size == T and len(failed) == 2
    size = metrics["micro_batch_size"]
    # Halfway between the peak that failed and what no size goes below: the train state
    # (and totals) resident and one example's inputs (its rows, its weight, 3 int32s).
    one_example = sum(x[:1].nbytes for x in jax.tree.leaves(batches[0])) + 4 + 3 * 4
    floor = failed[1].state_bytes + one_example
    cap = floor + (failed[1].estimated_bytes - floor) // 2
    assert _estimate(trainer, size) <= cap < _estimate(trainer, size + 1)


def test_other_errors_at_run_time_propagate_unchanged():
    class Boom(Exception):
        pass

    batches = regression_batches(1, T)
    trainer = ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), target_batch_size=T)
    state = trainer.init(mlp_params(), batches[0])

    class Exploding(testing.FaultInjector):
        def before_execution(self, size, args):
            raise Boom("not memory")

    trainer.fault_hook = Exploding()
    with pytest.raises(Boom, match="not memory"):
        trainer.step(state, batches[0])
    assert not any(t.reason == "step" for t in trainer.search_log)


def test_host_copies_hold_only_what_a_micro_step_changes():
    """A size's first update keeps each micro-step's accumulator and totals on the host,
    never Adam's moments (which micro-steps only read), and the optimizer step, which
    does not donate here, needs no snapshot."""
    batches = regression_batches(2, T)
    params = mlp_params()
    trainer = ja.AdaptiveTrainer(  # chunk=1: a host copy per micro-step, not per chunk
        mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=4, chunk=1
    )
    state = trainer.init(params, batches[0])
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    state, _ = trainer.step(state, batches[0])
    steps = -(-T // 4)
    # The accumulator and the loss total after each micro-step but the last, which runs
    # the optimizer step too: nothing follows it to go on from.
    assert trainer.plan_info.fused
    assert trainer.host_bytes == (steps - 1) * (param_bytes + 4)
    state, _ = trainer.step(state, batches[1])  # the size ran once: no copies at all
    assert trainer.host_bytes == (steps - 1) * (param_bytes + 4)
