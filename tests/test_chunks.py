"""Chunks of micro-steps in one dispatch, and the default plan with the least padding.

References: the plain full-batch optax step (exactness), every chunk's and size's ledger
brute-forced against the limit (the choice), and one dispatch per micro-step (the
random keys a chunk's micro-steps see).
"""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, full_batch_reference, mlp_loss, mlp_params
from helpers import regression_batches as batches_of
from user_model import CNN

import jax_adaptive as ja
from jax_adaptive import testing
from jax_adaptive.chunking import SLOWER_CHUNK
from jax_adaptive.data import synthetic_images
from jax_adaptive.models import linen_classifier_loss
from jax_adaptive.testing import inject_oom

T = 12


def train(trainer, batches, params=None):
    state = trainer.init(mlp_params() if params is None else params, batches[0])
    for batch in batches:
        state, metrics = trainer.step(state, batch)
    return state, metrics


@pytest.mark.parametrize("micro", [1, 2, 5, 7])  # 5 and 7 leave a padded last micro-batch
@pytest.mark.parametrize("chunk", [2, 3, "auto"])
def test_chunks_equal_the_full_batch_step(micro, chunk):
    batches = batches_of(3, T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=micro, chunk=chunk
    )
    state, metrics = train(trainer, batches)
    steps = math.ceil(T / micro)
    assert trainer.plan_info.chunk == (steps if chunk == "auto" else min(chunk, steps))
    assert metrics["accumulation_steps"] == steps
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
    assert_trees_close(state.params, reference, 1e-5)
    assert int(state.updates) == 3


def dropout_loss(params, batch, rng):
    keep = jax.random.bernoulli(rng, 0.7, batch["y"].shape[:1])
    return mlp_loss(params, batch, rng) * (0.5 + keep)


def test_a_chunks_micro_steps_see_the_keys_they_see_dispatched_one_by_one():
    batches = batches_of(2, T)
    states = [
        train(
            ja.AdaptiveTrainer(
                dropout_loss, optax.sgd(0.1), target_batch_size=T, micro_batch_size=5, chunk=c
            ),
            batches,
        )[0]
        for c in (1, "auto")
    ]
    assert_trees_close(states[0].params, states[1].params, 1e-6)
    # and the keys matter: another rng gives other parameters
    other = ja.AdaptiveTrainer(
        dropout_loss, optax.sgd(0.1), target_batch_size=T, micro_batch_size=5
    )
    state = other.init(mlp_params(), batches[0], rng=jax.random.key(7))
    for batch in batches:
        state, _ = other.step(state, batch)
    assert not jnp.allclose(state.params["w2"], states[0].params["w2"])


def test_the_chunk_is_the_fewest_dispatches_the_limit_allows():
    T48, micro = 48, 4  # 12 micro-steps
    batches = batches_of(2, T48)
    probe = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T48, micro_batch_size=micro, chunk=1
    )
    probe.init(mlp_params(), batches[0])
    ledgers = {c: probe.ledger(micro, chunk=c).total for c in range(1, 13)}
    limit = ledgers[1] + (ledgers[12] - ledgers[1]) * 2 // 5
    fitting = [c for c, total in ledgers.items() if total <= limit]
    expected = min(fitting, key=lambda c: (12 // c + 12 % c, c))  # brute force
    assert 1 < expected < 12
    # The update's last program (a chunk: it divides 12) runs the optimizer step too
    # when that fits; the plan's ledger is then the larger of the two programs'.
    last = probe.ledger(micro, chunk=expected, with_optimizer_step=True).total
    peak = max(ledgers[expected], last) if last <= limit else ledgers[expected]
    trainer = ja.AdaptiveTrainer(
        mlp_loss,
        optax.adam(1e-2),
        target_batch_size=T48,
        micro_batch_size=micro,
        memory_limit=limit,
    )
    state, _ = train(trainer, batches)
    assert trainer.plan_info.chunk == expected
    assert trainer.plan_info.fused == (last <= limit)
    assert trainer.plan_info.ledger.total == peak <= limit
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
    assert_trees_close(state.params, reference, 1e-5)


def test_the_last_program_runs_the_optimizer_step_when_its_ledger_fits():
    """Brute force over the limit: the chunk's ledger, the last program's (the chunk and
    the optimizer step), and the bytes of the new state the latter holds beside the old."""
    batches = batches_of(3, T)
    probe = ja.AdaptiveTrainer(mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=4)
    state = probe.init(mlp_params(), batches[0])
    chunk = probe.ledger(4, chunk=3)
    last = probe.ledger(4, chunk=3, with_optimizer_step=True)
    # Beside the old state: the new parameters and the inner optimizer state (Adam's
    # count and moments); at most 12 bytes more per leaf of the state (a scalar counter,
    # a pointer in XLA's table of outputs). The accumulator and the totals are written
    # over the donated ones.
    new_state = sum(
        x.nbytes for x in jax.tree.leaves((state.params, state.opt_state.inner_opt_state))
    )
    slack = 12 * len(jax.tree.leaves(state))
    assert new_state <= last.in_flight - chunk.in_flight <= new_state + slack
    assert last.state == chunk.state
    for limit, fused in ((last.total, True), (last.total - 1, False)):
        trainer = ja.AdaptiveTrainer(
            mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=4,
            memory_limit=limit,
        )  # fmt: skip
        with inject_oom(trainer) as counter:  # injects nothing: counts the dispatches
            state, _ = train(trainer, batches)
        assert trainer.plan_info.chunk == 3 and trainer.plan_info.fused is fused
        assert trainer.plan_info.ledger.total == (last if fused else chunk).total <= limit
        assert counter.executions_seen == 3  # one program per update
        reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
        assert_trees_close(state.params, reference, 1e-5)


@pytest.mark.parametrize(
    ("kwargs", "fault", "chunk"),
    [
        # the whole update in one program (6 x 2, or 3 x 4), fused: its first dispatch
        ({"micro_batch_size": 2}, 1, 6),
        ({"micro_batch_size": 4}, 1, 3),
        # six single micro-steps, two dispatched ahead: the last, fused one fails while
        # the micro-step before it may still run (at a fixed size an out-of-memory in a
        # plain micro-step propagates, as documented)
        ({"micro_batch_size": 2, "chunk": 1, "in_flight": 2}, 6, 1),
    ],
)
def test_an_out_of_memory_in_the_last_program_loses_nothing_and_runs_one_micro_step_apart(
    kwargs, fault, chunk
):
    """The second update (which keeps no host copies) fails in its last program, the one
    with the optimizer step in it: nothing is lost, and from then on one micro-step per
    dispatch and the optimizer step apart."""
    batches, m = batches_of(3, T), kwargs["micro_batch_size"]
    trainer = ja.AdaptiveTrainer(mlp_loss, optax.adam(1e-2), target_batch_size=T, **kwargs)
    state = trainer.init(mlp_params(), batches[0])
    assert trainer.plan_info.chunk is None  # decided at the first update
    state, _ = trainer.step(state, batches[0])
    assert trainer.plan_info.fused and trainer.plan_info.chunk == chunk
    with inject_oom(trainer, executions={fault}) as faults:  # deletes what it donates
        for batch in batches[1:]:
            state, metrics = trainer.step(state, batch)
    assert faults.injected == [(fault, m)]
    assert trainer.plan_info.fused is False and trainer.plan_info.chunk == 1
    assert metrics["micro_batch_size"] == m and metrics["accumulation_steps"] == T // m
    assert int(state.updates) == 3
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
    assert_trees_close(state.params, reference, 1e-5)


def test_the_compiled_last_program_is_one_full_batch_step():
    """``compile(m, c, with_optimizer_step=True)`` called by hand, as its docs say."""
    batch = batches_of(1, T)[0]
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=4
    )
    state = trainer.init(mlp_params(), batch)
    program = trainer.compile(4, 3, with_optimizer_step=True)
    opt = state.opt_state
    params, opt_state, _, means = program(
        state.params, opt._replace(acc_grads=None), opt.acc_grads, state.model_state,
        {"loss": jnp.zeros(())}, batch, jnp.ones(T), state.rng, 0, 4, T,
    )  # fmt: skip
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), [batch])
    assert_trees_close(params, reference, 1e-5)
    assert int(opt_state.gradient_step) == 1 and int(opt_state.mini_step) == 0
    np.testing.assert_allclose(means["loss"], jnp.mean(mlp_loss(mlp_params(), batch, None)), 1e-5)


def test_the_whole_update_in_one_program_writes_no_accumulator():
    """Zeros between updates, the state's accumulator stays the new state's: the program
    that is the whole update starts from zeros of its own and neither reads, donates nor
    writes it. References: the buffers' addresses, the bytes of the live arrays the
    program returns, and the full-batch step; then a target of two chunks, whose last
    program does reset the accumulator it was given."""
    params, batches = mlp_params(width=64), batches_of(3, T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=4
    )
    state = trainer.init(params, batches[0])
    addresses = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(state.opt_state.acc_grads)]
    for batch in batches:
        state, metrics = trainer.step(state, batch)
        assert trainer.plan_info.fused and trainer.plan_info.chunk == 3
        acc = jax.tree.leaves(state.opt_state.acc_grads)
        assert [a.unsafe_buffer_pointer() for a in acc] == addresses
        assert not any(np.any(np.asarray(a)) for a in acc)
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), params, batches)
    assert_trees_close(state.params, reference, 1e-5)
    # What the program writes: the new state but its accumulator, and the means; at most
    # 12 bytes a leaf more (a pointer in XLA's table of outputs), less than the accumulator.
    written = (state.params, state.opt_state._replace(acc_grads=None), metrics["loss"])
    written_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(written))
    acc_bytes = sum(a.nbytes for a in acc)
    out = trainer.compile(4, 3, with_optimizer_step=True).memory_analysis().output_size_in_bytes
    slack = 12 * len(jax.tree.leaves(written))
    assert written_bytes <= out <= written_bytes + slack < written_bytes + acc_bytes
    # Twice the target: two chunks of 3, the last fused, given the first's sums, and
    # returning the accumulator reset.
    batches = batches_of(3, 2 * T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=2 * T, micro_batch_size=4, chunk=3
    )
    state, _ = train(trainer, batches, params)
    assert trainer.plan_info.fused and trainer.plan_info.chunk == 3
    assert not any(np.any(np.asarray(a)) for a in jax.tree.leaves(state.opt_state.acc_grads))
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), params, batches)
    assert_trees_close(state.params, reference, 1e-5)


def test_an_update_transfers_only_its_batch():
    """The totals' zeros, the offsets, k and T are the same device buffers at every
    update (a host argument would be a transfer in every call), and the zeros are never
    donated: they are alive after each update and still zero. Reference: the arguments
    each run received, recorded by a fault hook that never fires."""
    seen = []

    class Recorder(testing.FaultInjector):
        def before_execution(self, size, args):
            seen.append(args)

    params, batches = mlp_params(width=16), batches_of(3, 2 * T)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=2 * T, micro_batch_size=4, chunk=3
    )
    state = trainer.init(params, batches[0])
    trainer.fault_hook = Recorder()
    for batch in batches:
        state, _ = trainer.step(state, batch)
    assert len(seen) == 2 * len(batches)  # two chunks of 3 per update

    def pointers(args):
        scalars = (args.offset, args.k, args.target)
        assert all(isinstance(x, jax.Array) for x in (*jax.tree.leaves(args.totals), *scalars))
        return [x.unsafe_buffer_pointer() for x in (*jax.tree.leaves(args.totals), *scalars)]

    firsts, seconds = seen[::2], seen[1::2]
    assert all(pointers(a) == pointers(firsts[0]) for a in firsts)
    assert all(pointers(a)[1:] == pointers(seconds[0])[1:] for a in seconds)  # the sums vary
    zeros = jax.tree.leaves(firsts[0].totals)
    assert not any(z.is_deleted() for z in zeros) and not any(np.any(np.asarray(z)) for z in zeros)
    assert [int(a.offset) for a in seen[:2]] == [0, 12] and int(seen[0].target) == 2 * T
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), params, batches)
    assert_trees_close(state.params, reference, 1e-5)


def test_a_changed_limit_decides_the_chunk_and_the_fusion_again():
    """At a fixed size nothing grows or shrinks, yet the chunk and the fused last program
    were decided under the old limit: a raised limit gives the whole update in one
    program, a lowered one shorter chunks again, each the brute-forced choice."""
    batches = batches_of(3, T)
    probe = ja.AdaptiveTrainer(mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=2)
    probe.init(mlp_params(), batches[0])
    chunks = {c: probe.ledger(2, chunk=c).total for c in range(1, 7)}
    whole = probe.ledger(2, chunk=6, with_optimizer_step=True).total
    low = chunks[2]  # chunks of 2, at most, and no fused last program
    assert low < min(chunks[3], whole)
    high = max(chunks[6], whole)
    trainer = ja.AdaptiveTrainer(
        mlp_loss, optax.adam(1e-2), target_batch_size=T, micro_batch_size=2, memory_limit=low
    )
    state = trainer.init(mlp_params(), batches[0])
    state, _ = trainer.step(state, batches[0])
    assert (trainer.plan_info.chunk, trainer.plan_info.fused) == (2, False)
    trainer.set_memory_limit(high)
    state, _ = trainer.step(state, batches[1])
    assert (trainer.plan_info.chunk, trainer.plan_info.fused) == (6, True)
    trainer.set_memory_limit(low)
    state, _ = trainer.step(state, batches[2])
    assert (trainer.plan_info.chunk, trainer.plan_info.fused) == (2, False)
    assert trainer.plan_info.ledger.total <= low
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
    assert_trees_close(state.params, reference, 1e-5)


def _seconds(program, args, reps=3):
    """The fastest of ``reps`` calls of ``program`` on ``args`` after a warm-up call."""
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        jax.block_until_ready(program(*args()))
        times.append(time.perf_counter() - start)
    return min(times[1:])


def test_a_chunk_much_slower_than_its_micro_steps_one_by_one_is_not_taken():
    """XLA:CPU runs a convolution inside a loop with slow kernels (jax-ml/jax#12868): the
    chunk of a CNN written as the Flax MNIST example writes one can run many times slower
    than its micro-steps dispatched one by one. The plan takes the chunk unless it is
    more than SLOWER_CHUNK times slower. Reference: the test's own timing of the two
    compiled programs (the whole update in one program, and one micro-step), then the
    full-batch step."""
    T, m = 64, 16
    data = synthetic_images(3 * T)
    batches = [{k: v[i * T : (i + 1) * T] for k, v in data.items()} for i in range(3)]
    model = CNN(features=(32, 64), dense=256)  # the Flax MNIST example's widths
    params = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))["params"]
    loss = linen_classifier_loss(model)
    trainer = ja.AdaptiveTrainer(
        loss, optax.adam(1e-3), target_batch_size=T, micro_batch_size=m, has_aux=True
    )
    state = trainer.init(params, batches[0])
    whole = trainer.compile(m, T // m, with_optimizer_step=True)
    one = trainer.compile(m)
    opt = state.opt_state._replace(acc_grads=None)

    def args(rows, k):  # fresh accumulator and totals at each call: the programs donate them
        batch = {key: jnp.asarray(v[:rows]) for key, v in batches[0].items()}
        return lambda: (
            state.params, opt, jax.tree.map(jnp.zeros_like, state.opt_state.acc_grads),
            state.model_state, {"loss": jnp.zeros(()), "accuracy": jnp.zeros(())}, batch,
            jnp.ones(rows), state.rng, 0, k, T,
        )  # fmt: skip

    ratio = _seconds(whole, args(T, T // m + 1)) / (T // m * _seconds(one, args(m, 2)))
    for batch in batches:
        state, metrics = trainer.step(state, batch)
    assert trainer.plan_info.fused and metrics["accumulation_steps"] == T // m
    mean_loss = lambda p, b, rng: loss(p, b, rng)[0]  # noqa: E731
    reference = full_batch_reference(
        mean_loss, optax.adam(1e-3), params, batches, rng=jax.random.key(0)
    )  # no dropout: any key
    assert_trees_close(state.params, reference, 2e-5)
    if SLOWER_CHUNK / 2 < ratio < SLOWER_CHUNK * 2:  # a coin toss: neither plan is wrong
        pytest.skip(
            f"the chunk took {ratio:.2f} times its micro-steps one by one on this machine, "
            f"too near SLOWER_CHUNK={SLOWER_CHUNK} for a timing to say which plan is right"
        )
    assert trainer.plan_info.chunk == (1 if ratio > SLOWER_CHUNK else T // m)


@pytest.fixture(scope="module")
def ledgers48():
    """Brute force: the ledger of every size 1..48, each from its own compile."""
    probe = ja.AdaptiveTrainer(mlp_loss, optax.adam(1e-2), target_batch_size=48, micro_batch_size=1)
    probe.init(mlp_params(), batches_of(1, 48)[0])
    return {s: probe.ledger(s).total for s in range(1, 49)}


@pytest.mark.parametrize("multiple_of", [1, 4])
def test_the_default_plan_has_the_fewest_micro_steps_and_the_least_padding(multiple_of, ledgers48):
    T48, ledgers = 48, ledgers48
    batches = batches_of(2, T48)
    limit = ledgers[13]  # the largest size that fits: 13, four micro-steps
    largest = max(s for s, total in ledgers.items() if total <= limit)
    assert largest == 13
    trainer = ja.AdaptiveTrainer(
        mlp_loss,
        optax.adam(1e-2),
        target_batch_size=T48,
        memory_limit=limit,
        multiple_of=multiple_of,
        plan_cache=False,
    )
    state, metrics = train(trainer, batches)
    steps = math.ceil(T48 / largest)  # 4
    expected = -(-math.ceil(T48 / steps) // multiple_of) * multiple_of  # 12 either way
    if multiple_of == 4:  # the search's largest multiple of 4 is 12
        assert trainer.plan_info.largest == 12
    else:
        assert trainer.plan_info.largest == largest
    assert trainer.micro_batch_size == expected == 12 and metrics["accumulation_steps"] == steps
    reference = full_batch_reference(mlp_loss, optax.adam(1e-2), mlp_params(), batches)
    assert_trees_close(state.params, reference, 1e-5)


def test_objective_max_keeps_the_largest_size(ledgers48):
    batches = batches_of(1, 48)
    trainer = ja.AdaptiveTrainer(
        mlp_loss,
        optax.adam(1e-2),
        target_batch_size=48,
        memory_limit=ledgers48[13],
        objective="max",
        plan_cache=False,
    )
    trainer.init(mlp_params(), batches[0])
    assert trainer.micro_batch_size == trainer.plan_info.largest == 13


@pytest.mark.parametrize("chunk", [0, -1, "x", 1.5, True])
def test_a_bad_chunk_is_refused_in_one_line(chunk):
    with pytest.raises(ValueError, match="chunk"):
        ja.AdaptiveTrainer(mlp_loss, optax.sgd(0.1), target_batch_size=T, chunk=chunk)
