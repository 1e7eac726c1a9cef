"""Ghost batches: BatchNorm training that does not depend on the micro-batch size."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, load_example

import jax_adaptive as ja
from jax_adaptive import NnxTrainer
from jax_adaptive.models import ResNet, linen_classifier_loss

T, G = 48, 8  # target batch, ghost batch
MODEL = ResNet(stage_sizes=(1,), num_filters=4, num_classes=3)
SGD = optax.sgd(0.1, momentum=0.9)


def image_batches(num, n=T, side=8, channels=3):
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.normal(size=(n, side, side, channels)).astype(np.float32),
            "label": rng.integers(0, 3, n).astype(np.int32),
        }
        for _ in range(num)
    ]


BATCHES = image_batches(3)


@functools.cache
def variables():
    # an RBG key: XLA:CPU compiles a threefry initialisation of a ResNet slowly
    return jax.jit(MODEL.init)(jax.random.key(0, impl="rbg"), BATCHES[0]["image"][:1])


def cross_entropy(logits, labels):
    """Independent of optax's loss: -log softmax at the label."""
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]


def in_groups(params, stats, group_grad, batches):
    """Plain optax: each batch's groups of G in order, gradients summed, one SGD update."""
    opt_state = SGD.init(params)
    for batch in batches:
        grads = jax.tree.map(jnp.zeros_like, params)
        for start in range(0, T, G):
            part = slice(start, start + G)
            g, stats = group_grad(params, stats, batch["image"][part], batch["label"][part])
            grads = jax.tree.map(jnp.add, grads, g)
        updates, opt_state = SGD.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats


@functools.cache
def reference():
    """Plain optax: groups of G in order, each a batch of the model's own BatchNorm."""
    params, stats = variables()["params"], variables()["batch_stats"]

    @jax.jit
    def group_grad(params, stats, x, y):
        def loss(p):
            logits, new = MODEL.apply(
                {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return jnp.sum(cross_entropy(logits, y)) / T, new["batch_stats"]

        return jax.grad(loss, has_aux=True)(params)

    return in_groups(params, stats, group_grad, BATCHES)


def train_linen(ghost_batch_size, loss_fn=None, **trainer_kwargs):
    if loss_fn is None:
        loss_fn = linen_classifier_loss(
            MODEL, mutable=("batch_stats",), ghost_batch_size=ghost_batch_size
        )
    trainer = ja.AdaptiveTrainer(
        loss_fn, SGD, target_batch_size=T, has_aux=True, has_state=True, **trainer_kwargs
    )
    state = trainer.init(
        variables()["params"], BATCHES[0], model_state={"batch_stats": variables()["batch_stats"]}
    )
    for batch in BATCHES:
        state, _ = trainer.step(state, batch)
    return trainer, state


@functools.cache
def ghost_linen(micro):
    return train_linen(G, micro_batch_size=micro, multiple_of=G)


# 8 and 24 divide T; 32 does not: its second micro-step has two groups of padding,
# which must not move the running averages.
@pytest.mark.parametrize("micro", [8, 24, 32])
def test_ghost_batches_train_the_same_at_any_micro_batch_size(micro):
    trainer, state = ghost_linen(micro)
    assert trainer.micro_batch_size == micro
    params, stats = reference()
    assert_trees_close(state.model_state["batch_stats"], stats, 1e-5)
    assert_trees_close(state.params, params, 1e-5)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), params, variables()["params"])
    assert min(jax.tree.leaves(moved)) > 1e-4  # every parameter trained


def test_side_by_side_groups_train_as_the_sequential_form():
    """The groups at once (the default) against one after another in a scan, with padding."""
    plain = linen_classifier_loss(MODEL, mutable=("batch_stats",))
    ghost = ja.ghost_batches(plain, G)
    batch, key = BATCHES[0], jax.random.key(0)
    args = (variables()["params"], {"batch_stats": variables()["batch_stats"]}, batch, key)
    assert not uses_scan(ghost, *args)  # the fast form, not a fallback
    sequential = ja.ghost_batches(plain, G, sequential=True)
    assert uses_scan(sequential, *args)
    _, side = ghost_linen(32)  # through the adapter's ghost_batch_size
    _, scan = train_linen(G, sequential, micro_batch_size=32, multiple_of=G)
    assert_trees_close(side.params, scan.params, 1e-5)
    assert_trees_close(side.model_state, scan.model_state, 1e-5)


def uses_scan(loss_fn, params, state, batch, rng):
    weights = jnp.ones(len(jax.tree.leaves(batch)[0]))
    jaxpr = jax.make_jaxpr(functools.partial(loss_fn, weights=weights))(params, state, batch, rng)
    return "scan[" in str(jaxpr)


# ------------------------------------------------------------------ linen, pmap's axis_name


@functools.cache
def imagenet_example():
    """examples/imagenet_resnet.py's tiny ResNet and its variables: BatchNorm(axis_name="batch")."""
    model = load_example("imagenet_resnet").make_tiny(3)[0]
    init = bound(lambda x: model.init(jax.random.key(0, impl="rbg"), x))
    return model, jax.jit(init)(BATCHES[0]["image"][:1])


def bound(fn):
    """``fn`` with the axis ``"batch"`` bound over its whole batch, as a one-device pmap."""
    return lambda x: jax.tree.map(lambda a: a[0], jax.vmap(fn, axis_name="batch")(x[None]))


@functools.cache
def imagenet_reference():
    """The hand-written loop: plain optax, groups of G in order, the axis bound per group."""
    model, init = imagenet_example()
    params, stats = init["params"], init["batch_stats"]

    @jax.jit
    def group_grad(params, stats, x, y):
        def loss(p):
            apply = bound(lambda x: model.apply(
                {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            ))  # fmt: skip
            logits, new = apply(x)
            return jnp.sum(cross_entropy(logits, y)) / T, new["batch_stats"]

        return jax.grad(loss, has_aux=True)(params)

    return in_groups(params, stats, group_grad, BATCHES)


@pytest.mark.parametrize("micro", [16, 32])
def test_a_model_written_for_pmap_trains_as_a_loop_over_groups(micro):
    model, init = imagenet_example()
    loss_fn = linen_classifier_loss(
        model, mutable=("batch_stats",), axis_name="batch", ghost_batch_size=G
    )
    trainer = ja.AdaptiveTrainer(
        loss_fn, SGD, target_batch_size=T, micro_batch_size=micro, multiple_of=G,
        has_aux=True, has_state=True,
    )  # fmt: skip
    state = trainer.init(
        init["params"], BATCHES[0], model_state={"batch_stats": init["batch_stats"]}
    )
    for batch in BATCHES:
        state, _ = trainer.step(state, batch)
    params, stats = imagenet_reference()
    args = (init["params"], {"batch_stats": init["batch_stats"]}, BATCHES[0], KEY)
    assert not uses_scan(loss_fn, *args)  # BatchNorm(axis_name=...)'s groups side by side
    assert_trees_close(state.model_state["batch_stats"], stats, 1e-5)
    assert_trees_close(state.params, params, 1e-5)


# ------------------------------------------------------------------ NNX


class NnxBnNet(nnx.Module):
    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def vector_batches(num):
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.normal(size=(T, 4)).astype(np.float32),
            "label": rng.integers(0, 3, T).astype(np.int32),
        }
        for _ in range(num)
    ]


def nnx_reference(model, batches):
    """Plain optax on the NNX module: groups of G in order, BatchNorm state threaded."""
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

    @jax.jit
    def group_grad(params, stats, x, y):
        def loss(p):
            module = nnx.merge(graphdef, p, stats, copy=True)
            module.train()
            logits = module(x)
            return jnp.sum(cross_entropy(logits, y)) / T, nnx.state(module, nnx.BatchStat)

        return jax.grad(loss, has_aux=True)(params)

    return in_groups(params, stats, group_grad, batches)


@pytest.mark.parametrize("micro", [8, 32])
def test_nnx_module_trains_in_place_the_same_at_any_micro_batch_size(micro):
    model, batches = NnxBnNet(rngs=nnx.Rngs(0)), vector_batches(3)
    params, stats = nnx_reference(nnx.clone(model), batches)
    trainer = NnxTrainer(
        model, SGD, target_batch_size=T, ghost_batch_size=G, micro_batch_size=micro
    )
    for batch in batches:
        trainer.step(batch)
    assert trainer.trainer.micro_batch_size == micro
    assert_trees_close(nnx.state(model, nnx.Param), params, 1e-5)
    assert_trees_close(nnx.state(model, nnx.BatchStat), stats, 1e-5)


def custom_nnx_loss(model):
    """A loss of the user's own, not the library's: logits of the module in training mode."""
    graphdef = nnx.graphdef(model)

    def loss_fn(params, stats, batch, rng):
        module = nnx.merge(graphdef, params, stats, copy=True)
        module.train()
        logits = module(batch["image"])
        return cross_entropy(logits, batch["label"]), nnx.state(module, nnx.BatchStat)

    return loss_fn


@pytest.mark.parametrize("micro", [8, 32])
def test_a_custom_nnx_loss_gets_the_ghost_batches_too(micro):
    model, batches = NnxBnNet(rngs=nnx.Rngs(0)), vector_batches(3)
    params, stats = nnx_reference(nnx.clone(model), batches)
    trainer = NnxTrainer(
        model, SGD, target_batch_size=T, loss_fn=custom_nnx_loss(model), ghost_batch_size=G,
        micro_batch_size=micro,
    )  # fmt: skip
    for batch in batches:
        trainer.step(batch)
    assert trainer.trainer.micro_batch_size == micro
    assert_trees_close(nnx.state(model, nnx.Param), params, 1e-5)
    assert_trees_close(nnx.state(model, nnx.BatchStat), stats, 1e-5)


def test_nnx_batchnorm_groups_side_by_side_train_as_the_sequential_form():
    # NNX's BatchNorm stops the gradient of its running averages: the momentum must
    # still be read, from the update itself
    model, batches = NnxBnNet(rngs=nnx.Rngs(0)), vector_batches(3)
    args = (nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat), batches[0], KEY)
    assert not uses_scan(ja.ghost_batches(custom_nnx_loss(model), G), *args)
    trained = []
    for sequential in (False, True):
        copy = nnx.clone(model)
        loss_fn = ja.ghost_batches(custom_nnx_loss(copy), G, sequential=sequential)
        trainer = NnxTrainer(
            copy, SGD, target_batch_size=T, loss_fn=loss_fn, micro_batch_size=32, multiple_of=G
        )
        for batch in batches:
            trainer.step(batch)
        trained.append(copy)
    side, scan = trained
    assert_trees_close(nnx.state(side, nnx.Param), nnx.state(scan, nnx.Param), 1e-5)
    assert_trees_close(nnx.state(side, nnx.BatchStat), nnx.state(scan, nnx.BatchStat), 1e-5)


def test_ghost_batches_for_a_model_without_batch_statistics_are_refused():
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"ghost_batch_size=8 needs batch statistics"):
        NnxTrainer(model, SGD, target_batch_size=T, loss_fn=lambda p, b, r: b["x"],
                   ghost_batch_size=8)  # fmt: skip


def train_nnx(batches, **kwargs):
    model = NnxBnNet(rngs=nnx.Rngs(0))
    trainer = NnxTrainer(model, SGD, target_batch_size=T, **kwargs)
    for batch in batches:
        trainer.step(batch)
    return trainer.trainer.micro_batch_size, model


def test_two_memory_limits_give_two_plans_and_one_training():
    batches = vector_batches(3)
    # the limits: the ledgers of two multiples of G, as this machine measures them
    probe = NnxTrainer(NnxBnNet(rngs=nnx.Rngs(0)), SGD, target_batch_size=T, ghost_batch_size=G)
    probe.init(batches[0])
    limits = [probe.trainer.ledger(size).total for size in (16, 24)]
    plans = dict(
        train_nnx(batches, ghost_batch_size=G, memory_limit=limit, plan_cache=False)
        for limit in limits
    )
    assert sorted(plans) == [16, 24], sorted(plans)
    a, b = plans.values()
    assert_trees_close(nnx.state(a, nnx.Param), nnx.state(b, nnx.Param), 1e-5)
    assert_trees_close(nnx.state(a, nnx.BatchStat), nnx.state(b, nnx.BatchStat), 1e-5)
    expected = nnx_reference(NnxBnNet(rngs=nnx.Rngs(0)), batches)[1]
    assert_trees_close(nnx.state(a, nnx.BatchStat), expected, 1e-5)


def test_per_micro_batch_statistics_depend_on_the_plan():
    """What ghost batches fix: without them, two micro-batch sizes train differently."""
    batches = vector_batches(3)
    (_, at_8), (_, at_24) = (train_nnx(batches, micro_batch_size=m) for m in (8, 24))
    differ = jax.tree.map(
        lambda a, b: np.abs(a - b).max(),
        nnx.state(at_8, nnx.BatchStat),
        nnx.state(at_24, nnx.BatchStat),
    )
    assert max(jax.tree.leaves(differ)) > 1e-3


# ------------------------------------------------------------------ the wrapper itself


def running_mean_loss(params, state, batch, rng):
    """Per-example squared deviation from the group mean; the state a running mean."""
    mean = jnp.mean(batch["x"])
    return (batch["x"] - mean) ** 2 * params, {"mean": 0.5 * state["mean"] + 0.5 * mean}


def test_groups_run_in_order_and_padding_groups_leave_the_state():
    ghost = jax.jit(ja.ghost_batches(running_mean_loss, 2))
    x = jnp.array([0.0, 2.0, 4.0, 4.0, 9.0, 9.0])
    losses, state = ghost(1.0, {"mean": jnp.float32(0)}, {"x": x}, KEY, weights=jnp.ones(6))
    expected = 0.0
    for mean in (1.0, 4.0, 9.0):  # the groups' means, in order
        expected = 0.5 * expected + 0.5 * mean
    np.testing.assert_allclose(state["mean"], expected)
    np.testing.assert_allclose(losses, [1, 1, 0, 0, 0, 0])
    padded = jnp.array([1, 1, 1, 1, 0, 0.0])  # the last group is padding
    _, state = ghost(1.0, {"mean": jnp.float32(0)}, {"x": x}, KEY, weights=padded)
    np.testing.assert_allclose(state["mean"], 0.5 * (0.5 * 1.0) + 0.5 * 4.0)


def in_a_loop(loss_fn, state, x, weights, group_size):
    """The reference: the groups one after another, a group of zero weights skipped."""
    outs = []
    for start in range(0, len(x), group_size):
        out, new = loss_fn(1.0, state, {"x": x[start : start + group_size]}, KEY)
        state = new if np.any(weights[start : start + group_size]) else state
        outs.append(out)
    return np.concatenate(outs), state


def averages(params, state, batch, rng):
    """Running averages of momentum 0.9, 1 (a float count) and 0 (the last group's mean)."""
    mean = jnp.mean(batch["x"])
    return (batch["x"] - mean) ** 2, {
        "ema": 0.9 * state["ema"] + 0.1 * mean,
        "count": state["count"] + 1.0,
        "last": 0.0 * state["last"] + mean,
    }


def affine_forms(params, state, batch, rng):
    """Updates proven m * old + f: in a jit, chosen by the data, an integer leaf kept."""
    mean = jnp.mean(batch["x"])
    new = {
        "ema": jax.jit(lambda old: 0.9 * old + 0.1 * mean)(state["ema"]),
        "chosen": jnp.where(mean > 3, 0.5 * state["chosen"], state["chosen"] - mean),
        "kept": state["kept"],
    }
    return (batch["x"] - mean) ** 2, jax.lax.stop_gradient(new)


def reads_its_state(params, state, batch, rng):  # as batch renormalisation's outputs do
    return batch["x"] - state["mean"], {"mean": 0.5 * state["mean"] + 0.5 * jnp.mean(batch["x"])}


def keeps_the_largest(params, state, batch, rng):  # not m * old + f
    return batch["x"], {"max": jnp.maximum(state["max"], jnp.max(batch["x"]))}


def counts_in_integers(params, state, batch, rng):
    return batch["x"], {"n": state["n"] + 1}


def layer(update):
    """A loss whose state a stateful layer writes as users write one: through stop_gradient.

    ``update(old, x)`` is the new state from the old one and the group's rows; the outputs
    do not read the state, so only the update decides whether the groups compose.
    """

    def loss_fn(params, state, batch, rng):
        new = update(state, batch["x"])
        return (batch["x"] - jnp.mean(batch["x"])) ** 2, jax.lax.stop_gradient(new)

    return loss_fn


def state_dependent_momentum(old, x):
    momentum = 0.5 + 0.4 * jnp.tanh(old["avg"])  # m depends on the state: not m * old + f
    return {"avg": momentum * old["avg"] + (1 - momentum) * jnp.mean(x)}


# Each is not m * old + f in the state, and each was composed side by side as if it were,
# silently wrong (a running max of 52.11 for 6.97), while only a derivative checked it.
NOT_AFFINE = {
    "running max": (
        layer(lambda old, x: {"max": jnp.maximum(old["max"], jnp.max(x))}),
        {"max": 3.0},
    ),
    "running min": (
        layer(lambda old, x: {"min": jnp.minimum(old["min"], jnp.mean(x))}),
        {"min": 3.0},
    ),
    "clipped average": (
        layer(lambda old, x: {"avg": jnp.clip(0.9 * old["avg"] + 0.1 * jnp.mean(x), -1.0, 1.5)}),
        {"avg": 1.0},
    ),
    "state-dependent momentum": (layer(state_dependent_momentum), {"avg": 1.0}),
    "two leaves mixed": (  # affine, but not leaf by leaf
        layer(
            lambda old, x: {"a": 0.5 * old["a"] + 0.5 * old["b"], "b": 0.9 * old["b"] + jnp.mean(x)}
        ),
        {"a": 1.0, "b": 2.0},
    ),
    "elements mixed": (  # affine, but not element by element
        layer(lambda old, x: {"v": 0.5 * old["v"] + 0.25 * old["v"][::-1] + jnp.mean(x)}),
        {"v": jnp.array([1.0, 2.0])},
    ),
}


@pytest.mark.parametrize(
    "loss_fn, state, side_by_side",
    [
        (averages, {"ema": 1.0, "count": 2.0, "last": 5.0}, True),
        (affine_forms, {"ema": 1.0, "chosen": 2.0, "kept": 7}, True),
        (reads_its_state, {"mean": 1.0}, False),
        (keeps_the_largest, {"max": 3.0}, False),
        (counts_in_integers, {"n": 0}, False),
    ]
    + [pytest.param(*case, False, id=name) for name, case in NOT_AFFINE.items()],
)
def test_groups_run_side_by_side_only_for_running_averages(loss_fn, state, side_by_side):
    x = jnp.array([0.0, 2.0, 4.0, 4.0, 9.0, 7.0, 1.0, 5.0])
    ghost = ja.ghost_batches(loss_fn, 2)
    sequential = jax.jit(ja.ghost_batches(loss_fn, 2, sequential=True))
    state = jax.tree.map(jnp.asarray, state)
    assert uses_scan(ghost, 1.0, state, {"x": x}, KEY) != side_by_side
    for weights in (np.ones(8), np.array([1, 1, 0, 0, 1, 1, 0, 0.0])):  # with padding groups
        weights = jnp.asarray(weights)
        out, new = jax.jit(ghost)(1.0, state, {"x": x}, KEY, weights=weights)
        expected_out, expected = in_a_loop(loss_fn, state, x, weights, 2)
        np.testing.assert_allclose(out, expected_out, rtol=1e-6)
        assert_trees_close(new, expected, 1e-6)
        assert_trees_close(new, sequential(1.0, state, {"x": x}, KEY, weights=weights)[1], 1e-6)


def test_a_micro_batch_must_be_whole_groups():
    ghost = ja.ghost_batches(running_mean_loss, 4)
    x = {"x": jnp.arange(6.0)}
    with pytest.raises(ValueError, match=r"6 examples .* group_size=4.*multiple_of=4"):
        ghost(1.0, {"mean": 0.0}, x, KEY, weights=jnp.ones(6))
    losses, _ = ghost(1.0, {"mean": 0.0}, x, KEY)  # outside the trainer: a shorter last group
    np.testing.assert_allclose(losses, [2.25, 0.25, 0.25, 2.25, 0.25, 0.25])
    # smaller than a group (a device that cannot hold one): one group, padding masked
    small = {"x": jnp.array([1.0, 3.0])}
    losses, state = ghost(1.0, {"mean": 0.0}, small, KEY, weights=jnp.ones(2))
    np.testing.assert_allclose(losses, [1.0, 1.0])
    np.testing.assert_allclose(state["mean"], 1.0)
    _, state = ghost(1.0, {"mean": 0.0}, small, KEY, weights=jnp.zeros(2))
    np.testing.assert_allclose(state["mean"], 0.0)
    with pytest.raises(ValueError, match="group_size=0"):
        ja.ghost_batches(running_mean_loss, 0)


def test_the_model_state_is_not_differentiated():
    # d/dp of group 2's loss through group 1's state would be non-zero without the stop
    def loss_fn(params, state, batch, rng):
        return batch["x"] * params * state["s"], {"s": state["s"] + params}

    ghost = ja.ghost_batches(loss_fn, 1)
    grad = jax.grad(lambda p: jnp.sum(ghost(p, {"s": 1.0}, {"x": jnp.ones(2)}, KEY)[0]))
    np.testing.assert_allclose(grad(1.0), 3.0)  # d/dp [p * 1 + p * stop(1 + p)] = 1 + (1 + p)


KEY = jax.random.key(0)


def test_the_trainer_passes_weights_to_a_loss_that_declares_them():
    # T = 10 at micro-batch 4: three micro-steps, the last with two padding rows
    # weights=None: the trainer also calls the loss without them, to learn its outputs
    def loss_fn(params, state, batch, rng, *, weights=None):
        seen = state["seen"] + (0 if weights is None else weights.sum())
        return (batch["x"] * params) ** 2, {"seen": seen}

    trainer = ja.AdaptiveTrainer(
        loss_fn, optax.sgd(0.1), target_batch_size=10, micro_batch_size=4, has_state=True
    )
    batch = {"x": np.arange(10, dtype=np.float32)}
    state = trainer.init(jnp.float32(1), batch, model_state={"seen": jnp.float32(0)})
    weights = np.linspace(0.5, 1.5, 10).astype(np.float32)
    state, _ = trainer.step(state, batch, weights=weights)
    np.testing.assert_allclose(state.model_state["seen"], weights.sum(), rtol=1e-6)
    state, _ = trainer.step(state, batch)
    np.testing.assert_allclose(state.model_state["seen"], weights.sum() + 10, rtol=1e-6)


def test_the_trainers_multiple_of_follows_the_ghost_batch_and_a_target_must_be_whole_groups():
    loss_fn = linen_classifier_loss(MODEL, mutable=("batch_stats",), ghost_batch_size=G)

    def trainer(target, **kwargs):
        return ja.AdaptiveTrainer(
            loss_fn, SGD, target_batch_size=target, has_aux=True, has_state=True, **kwargs
        )

    with pytest.raises(ValueError, match=f"target_batch_size=44 is not whole ghost batches of {G}"):
        trainer(44)
    with pytest.raises(ValueError, match=f"target_batch_size=20 is not whole ghost batches of {G}"):
        trainer([(0, 16), (2, 20)])  # a schedule: every target batch
    assert trainer(T, multiple_of=3)._planner.multiple_of == 24  # lcm(3, G)
