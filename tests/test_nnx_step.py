"""Flax's NNX MNIST step, converted as the guide shows, against the original step.

The example's model, loss, optimizer and metrics (examples/nnx_mnist.py) with Dropout at
rate 0; the reference runs Flax's own ``nnx.value_and_grad`` and ``nnx.Optimizer``, the
batch's groups one after another, and never calls jax_adaptive.
"""

import json
import logging
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import FailedRuns, load_example

import jax_adaptive as ja

mnist = load_example("nnx_mnist")

T, G = 40, 8  # the batch, the ghost batch
BATCHES = list(mnist.random_batches(3, T))


def objects():
    """The example's model, optimizer, metrics and rngs, Dropout at rate 0."""
    model = mnist.CNN(rngs=nnx.Rngs(0))
    model.dropout1.rate = model.dropout2.rate = 0.0
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    model.train()
    return model, optimizer, metrics, nnx.Rngs(0)


def reference(sizes):
    """The original step's code over ``BATCHES``, BatchNorm over groups of ``sizes``."""
    model, optimizer, metrics, rngs = objects()

    @nnx.jit
    def train_step(model, optimizer, metrics, batch, rngs):
        grads, loss, logits, start = None, 0.0, [], 0
        for size in sizes:
            part = {key: value[start : start + size] for key, value in batch.items()}
            grad_fn = nnx.value_and_grad(mnist.loss_fn, has_aux=True)
            (part_loss, part_logits), part_grads = grad_fn(model, part, rngs)
            weighted = jax.tree.map(lambda g, w=size / T: g * w, part_grads)
            grads = weighted if grads is None else jax.tree.map(jnp.add, grads, weighted)
            loss, start = loss + part_loss * size / T, start + size
            logits.append(part_logits)
        metrics.update(loss=loss, logits=jnp.concatenate(logits), labels=batch["label"])
        optimizer.update(model, grads)

    for batch in BATCHES:
        train_step(model, optimizer, metrics, batch, rngs)
    return model, optimizer, metrics


def assert_same(got, want):
    for name, filt in [("params", nnx.Param), ("batch_stats", nnx.BatchStat)]:
        for a, b in zip(
            jax.tree.leaves(nnx.state(got[0], filt)),
            jax.tree.leaves(nnx.state(want[0], filt)),
            strict=True,
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    opt = [jax.tree.leaves(nnx.state(o, nnx.OptState)) for o in (got[1], want[1])]
    for a, b in zip(*opt, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg="optimizer state")
    computed = [o.compute() for o in (got[2], want[2])]
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(computed[0][name], computed[1][name], rtol=1e-5)


def limit_for(step_fn, size, **kwargs):
    """The bytes the step at ``size`` needs: a device that holds it and nothing larger."""
    probe = ja.AdaptiveNnxStep(step_fn, plan_cache=False, **kwargs)
    model, optimizer, metrics, rngs = objects()
    probe(model, optimizer, metrics, BATCHES[0], rngs)  # plans the whole batch
    return probe.step.ledger(size).total


def train(step, faults=None):
    model, optimizer, metrics, rngs = objects()
    sizes = []
    for i, batch in enumerate(BATCHES):
        if i == 1 and faults is not None:
            step.step.fault_hook = faults
        step(model, optimizer, metrics, batch, rngs)
        sizes.append(step.micro_batch_size)
    return (model, optimizer, metrics), sizes


@pytest.mark.parametrize("size", [24, 16])
def test_the_converted_example_trains_the_same_at_every_plan_by_default(size):
    """Ghost batches of 8 by default (the largest divisor of 32 dividing 40): two plans,
    one that does not divide the batch, give the original step's code over groups of 8."""
    step_fn = mnist.train_step.step_fn  # the example's step, converted as the guide shows
    step = ja.AdaptiveNnxStep(
        step_fn, memory_limit=limit_for(step_fn, size), objective="max", plan_cache=False
    )
    got, sizes = train(step)
    assert sizes == [size] * 3
    assert_same(got, reference([G] * (T // G)))


@nnx.jit  # kept: AdaptiveNnxStep runs the Python function under it
def own_statistics_step(model, optimizer, metrics, batch, rngs):
    """The example's step with each micro-batch's own BatchNorm statistics, asked by name."""
    grad_fn = ja.micro_batch_value_and_grad(
        mnist.loss_fn, has_aux=True, ghost_batch_size="micro_batch"
    )
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def test_each_micro_batch_own_statistics_asked_by_name():
    step = ja.AdaptiveNnxStep(
        own_statistics_step,
        memory_limit=limit_for(own_statistics_step, 24),
        objective="max",
        plan_cache=False,
    )
    got, sizes = train(step)
    assert sizes == [24] * 3 and T % 24  # a plan that does not divide the batch
    assert_same(got, reference([24, 16]))  # BatchNorm over each micro-batch, in order


class _OutOfMemory:
    """Out-of-memory errors raised at the first two runs after it is installed (at dispatch):
    a size that ran is tried once more, and shrunk when it fails again."""

    def __init__(self):
        self.fired = []

    def before_compile(self, size):
        pass

    def before_execution(self, size, args):
        if len(self.fired) < 2:
            self.fired.append(size)
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (injected).")


@nnx.jit  # kept: AdaptiveNnxStep runs the Python function under it
def ghost_step(model, optimizer, metrics, batch, rngs):
    """The example's step with ghost batches of G: the same training at every plan."""
    grad_fn = ja.micro_batch_value_and_grad(mnist.loss_fn, has_aux=True, ghost_batch_size=G)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def test_ghost_batches_train_the_same_at_every_plan_and_after_an_out_of_memory():
    limit = limit_for(ghost_step, 24, multiple_of=G)
    step = ja.AdaptiveNnxStep(
        ghost_step, memory_limit=limit, multiple_of=G, objective="max", plan_cache=False
    )
    faults = _OutOfMemory()
    got, sizes = train(step, faults)
    assert faults.fired == [24, 24] and sizes[0] == 24 and sizes[-1] < 24, (faults.fired, sizes)
    assert all(size % G == 0 for size in sizes)
    assert_same(got, reference([G] * (T // G)))


def ghost_grads(rate):
    """The ghost step's loss, logits, gradient and objects at Dropout ``rate``, and its program."""
    model, _, _, rngs = objects()
    model.dropout1.rate = model.dropout2.rate = rate
    grad_fn = ja.micro_batch_value_and_grad(
        mnist.loss_fn, has_aux=True, ghost_batch_size=G, micro_batch_size=T
    )
    graphdef, state = nnx.split((model, rngs))

    def pure(state, batch):
        model, rngs = nnx.merge(graphdef, state)
        return grad_fn(model, batch, rngs), nnx.state((model, rngs))

    program = str(jax.make_jaxpr(pure)(state, BATCHES[0]))
    return jax.jit(pure)(state, BATCHES[0]), program


def groups_in_order(rate):
    """The same with Flax's own nnx.value_and_grad over the groups of G, one after another."""
    model, _, _, rngs = objects()
    model.dropout1.rate = model.dropout2.rate = rate
    graphdef, state = nnx.split((model, rngs))

    @jax.jit
    def pure(state, batch):
        model, rngs = nnx.merge(graphdef, state)
        grad_fn = nnx.value_and_grad(mnist.loss_fn, has_aux=True)
        loss, logits, grads = 0.0, [], None
        for start in range(0, T, G):
            part = {key: value[start : start + G] for key, value in batch.items()}
            (part_loss, part_logits), part_grads = grad_fn(model, part, rngs)
            part_grads = jax.tree.map(lambda g: g * G / T, part_grads)
            grads = part_grads if grads is None else jax.tree.map(jnp.add, grads, part_grads)
            loss, logits = loss + part_loss * G / T, [*logits, part_logits]
        return ((loss, jnp.concatenate(logits)), grads), nnx.state((model, rngs))

    return pure(state, BATCHES[0])


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_ghost_groups_run_side_by_side_for_batch_norm_and_in_order_for_dropout(rate):
    # BatchNorm's running averages (NNX's, written through stop_gradient) compose: the
    # groups run as one batch. Dropout's key counts are state its masks read: in order.
    got, program = ghost_grads(rate)
    assert ("scan[" in program) == (rate > 0), rate
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(groups_in_order(rate)), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_without_a_plan_it_is_nnx_value_and_grad():
    model, optimizer, metrics, rngs = objects()
    step = ja.AdaptiveNnxStep(own_statistics_step, plan_cache=False)
    for batch in BATCHES:
        step(model, optimizer, metrics, batch, rngs)
    assert step.micro_batch_size == T
    assert_same((model, optimizer, metrics), reference([T]))  # the original step verbatim


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size=0 must be"),
        ({"ghost_batch_size": 16}, "not whole ghost batches of ghost_batch_size=16"),
        ({"batch_argnum": 5}, "batch_argnum=5 is not one of the 3 arguments"),
        ({"argnums": 1}, "argnums=1 must be an NNX object"),
    ],
)
def test_bad_input_is_refused_in_one_line(kwargs, match):
    model, batch, rngs = mnist.CNN(rngs=nnx.Rngs(0)), BATCHES[0], nnx.Rngs(0)
    with pytest.raises((ValueError, TypeError), match=match):
        kwargs = {"micro_batch_size": 8, **kwargs}  # inside a step of 8, not whole-batch
        ja.micro_batch_value_and_grad(mnist.loss_fn, has_aux=True, **kwargs)(model, batch, rngs)


def test_a_step_with_two_array_arguments_must_say_which_is_the_batch():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    step = ja.AdaptiveNnxStep(lambda model, batch, lr: None, plan_cache=False)
    with pytest.raises(ValueError, match="say which is the batch with batch_argnum"):
        step(model, {"x": np.ones((4, 2), np.float32)}, np.float32(0.1))


def test_an_unknown_option_is_refused_at_decoration_not_at_the_first_call():
    # micro_batch_value_and_grad takes a micro_batch_size; the step does not: a user who
    # passes one to the step hears so where it is written, with the options it has.
    with pytest.raises(TypeError, match=r"unknown option micro_batch_size; .* memory_limit, "):
        ja.AdaptiveNnxStep(mnist.train_step.step_fn, micro_batch_size=8)
    with pytest.raises(TypeError, match="unknown option memory_limt"):  # a typo
        ja.AdaptiveNnxStep(mnist.train_step.step_fn, memory_limt=10**6, plan_cache=False)


def test_call_time_rngs_give_each_micro_batch_its_own_dropout_keys():
    class Dropped(nnx.Module):  # Dropout taking rngs at call time, as the MNIST example's
        def __init__(self):
            self.dropout = nnx.Dropout(rate=0.5)
            self.scale = nnx.Param(jnp.ones(()))

        def __call__(self, x, rngs):
            return self.dropout(x * self.scale[...], rngs=rngs)

    def loss_fn(model, batch, rngs):
        out = model(batch["x"], rngs)
        return out.mean(), out

    model, rngs = Dropped(), nnx.Rngs(dropout=0)
    batch = {"x": jnp.ones((8, 64))}
    grad_fn = ja.micro_batch_value_and_grad(loss_fn, has_aux=True, micro_batch_size=2)
    (loss, out), grads = nnx.jit(grad_fn)(model, batch, rngs)
    kept = np.asarray(out != 0).reshape(4, 2 * 64)  # each micro-batch's mask
    assert len({row.tobytes() for row in kept}) == 4  # four micro-batches, four masks
    assert int(rngs.dropout.count[...]) == 4  # the caller's Rngs moved on once per call
    np.testing.assert_allclose(grads["scale"][...], loss, rtol=1e-6)  # d mean(s x m) / ds


@pytest.fixture
def said():
    """The jax_adaptive logger's records while the test runs."""
    records, handler, log = [], logging.Handler(), logging.getLogger("jax_adaptive")
    handler.emit = records.append
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)  # the plan lines, whatever a test before this one set
    yield records
    log.setLevel(level)
    log.removeHandler(handler)


def _values(objects):
    return [np.asarray(x) for o in objects for x in jax.tree.leaves(nnx.state(o))]


def test_an_out_of_memory_at_a_size_that_ran_leaves_every_variable_and_trains_on(said):
    step_fn = mnist.train_step.step_fn
    step = ja.AdaptiveNnxStep(step_fn, memory_limit=limit_for(step_fn, 24), plan_cache=False)
    said.clear()  # the probe's
    model, optimizer, metrics, rngs = objects()
    for batch in BATCHES[:2]:
        step(model, optimizer, metrics, batch, rngs)
    trusted, before = step.micro_batch_size, _values((model, optimizer, metrics))
    plans = [r.getMessage() for r in said if r.getMessage().startswith("plan")]
    assert plans == [f"plan: {step.plan_info}"], plans  # one line, once
    assert plans[0].startswith("plan: micro-batch 24 x 2 micro-steps (searched")
    # the gradient's run at the size that ran twice, and its retry, then the update, run
    # out of memory
    step.fault_hook = faults = FailedRuns(step, runs={1, 2, 4})
    with pytest.raises(ja.OptimizerStepOutOfMemory):
        step(model, optimizer, metrics, BATCHES[2], rngs)
    assert faults.fired[:2] == [(1, trusted), (2, trusted)] and len(faults.fired) == 3
    for got, want in zip(_values((model, optimizer, metrics)), before, strict=True):
        np.testing.assert_array_equal(got, want)  # every variable readable, as it was
    step(model, optimizer, metrics, BATCHES[2], rngs)  # trains on from there
    plans = [r.getMessage() for r in said if r.getMessage().startswith("plan")]
    assert len(plans) == 2 and plans[1].startswith("plan (24 ran out of memory): micro-batch")
    assert_same((model, optimizer, metrics), reference([G] * (T // G)))


def _linear_objects():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _mean_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


_LINEAR_BATCH = {"x": np.ones((6, 3), np.float32), "y": np.zeros((6, 2), np.float32)}


def test_a_step_that_never_micro_batches_says_so_once_and_runs_as_nnx_jit(said):
    def keeps_nnx_value_and_grad(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_mean_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    step = ja.AdaptiveNnxStep(keeps_nnx_value_and_grad, memory_limit=10**6, plan_cache=False)
    model, optimizer = _linear_objects()
    want_model, want_optimizer = _linear_objects()
    for _ in range(2):
        step(model, optimizer, _LINEAR_BATCH)
        nnx.jit(keeps_nnx_value_and_grad)(want_model, want_optimizer, _LINEAR_BATCH)
    lines = [r.getMessage() for r in said if "never calls" in r.getMessage()]
    assert len(lines) == 1 and "ja.micro_batch_value_and_grad" in lines[0]
    assert step.search_log == [] and step.micro_batch_size == 6  # no search: the whole batch
    np.testing.assert_allclose(model.kernel[...], want_model.kernel[...], rtol=1e-6)


def test_micro_batch_value_and_grad_outside_the_adaptive_step_warns_once():
    model, optimizer = _linear_objects()

    @nnx.jit  # kept by mistake: nothing plans a micro-batch
    def step(model, optimizer, batch):
        _, grads = ja.micro_batch_value_and_grad(_mean_loss)(model, batch)
        optimizer.update(model, grads)

    with pytest.warns(UserWarning, match="outside ja.AdaptiveNnxStep") as warned:
        for _ in range(3):
            step(model, optimizer, _LINEAR_BATCH)
    assert len(warned) == 1


def test_a_batch_of_another_size_gets_its_own_ghost_batches_and_plan():
    class Normed(nnx.Module):  # BatchNorm: ghost batches of gcd(32, T) by default
        def __init__(self, rngs):
            self.linear = nnx.Linear(16, 256, rngs=rngs)
            self.norm = nnx.BatchNorm(256, rngs=rngs)
            self.out = nnx.Linear(256, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.norm(self.linear(x))))

    def step_fn(model, optimizer, batch):
        loss_fn = lambda model, batch: ((model(batch["x"]) - batch["y"]) ** 2).mean()  # noqa: E731
        _, grads = ja.micro_batch_value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)

    def batch(n):
        x = np.random.default_rng(n).normal(size=(n, 16)).astype(np.float32)
        return {"x": x, "y": x[:, :1]}

    def objects():
        model = Normed(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    probe = ja.AdaptiveNnxStep(step_fn, plan_cache=False)
    probe(*objects(), batch(64))
    step = ja.AdaptiveNnxStep(step_fn, memory_limit=probe.step.ledger(32).total, plan_cache=False)
    model, optimizer = objects()
    step(model, optimizer, batch(40))  # ghost batches of 8
    assert step.micro_batch_size % 8 == 0
    step(model, optimizer, batch(64))  # of 32: a plan of its own, multiples of 32
    assert step.micro_batch_size == 32


def test_a_model_sharded_as_flax_shards_it_trains_call_after_call(tmp_path):
    """Its state's shardings come back as they went in (a resharding error on the second
    call before), and the micro-batched step equals the same step under nnx.jit."""
    job, out = pathlib.Path(__file__).with_name("sharded_nnx_job.py"), tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, str(job), str(out)],
        cwd=job.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["micro_batch_size"] < 256 and result["accumulation_steps"] > 1, result
    assert result["after"] == result["before"] and "data" in result["before"][0], result
    assert result["max_diff"] < 1e-5, result
