"""Bad input, as a hostile user gives it: each is a one-line error that names the argument.

The library's cases raise `TypeError` or `ValueError` in one line that names the
argument; the command line's exit with status 2 and one line on stderr that names the
flag, before any training starts (nothing printed on stdout: no plan, no update).
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_adaptive as ja
from jax_adaptive.cli.main import main
from jax_adaptive.data import leading_size

T = 8


def loss(params, batch, rng):
    return (batch["x"] @ params - batch["y"]) ** 2


def aux_loss(params, batch, rng):
    return loss(params, batch, rng), {"loss": batch["y"]}


def batch_of(n=T, x_dtype=np.float32):
    return {"x": np.ones((n, 3), x_dtype), "y": np.ones(n, np.float32)}


def trainer(**kwargs):
    kwargs = {"target_batch_size": T, "plan_cache": False, **kwargs}
    return ja.AdaptiveTrainer(kwargs.pop("loss_fn", loss), kwargs.pop("optimizer", optax.sgd(0.1)),
                              **kwargs)  # fmt: skip


def initialised(**kwargs):
    t = trainer(micro_batch_size=4, **kwargs)
    return t, t.init(jnp.zeros(3), batch_of())


def step_with(batch=None, **step_kwargs):
    t, state = initialised()
    return t.step(state, batch_of() if batch is None else batch, **step_kwargs)


def own_step(**kwargs):
    return ja.AdaptiveStep(lambda m: None, **{"plan_cache": False, **kwargs})


def bucketed(**kwargs):
    kwargs = {"buckets": (8, 16), "target_tokens": 64, "plan_cache": False, **kwargs}
    return ja.BucketedTrainer(lambda p, b, r: jnp.sum(b["x"] * p, axis=1), optax.sgd(0.1),
                              **kwargs)  # fmt: skip


LIBRARY = {
    # the trainer's arguments
    "target_batch_size=0": (lambda: trainer(target_batch_size=0), "target_batch_size=0"),
    "target_batch_size=-4": (lambda: trainer(target_batch_size=-4), "target_batch_size=-4"),
    "target_batch_size=2**31": (lambda: trainer(target_batch_size=2**31), "2\\*\\*31 - 1"),
    "target_batch_size=8.0": (lambda: trainer(target_batch_size=8.0), "target_batch_size"),
    "target_batch_size=True": (lambda: trainer(target_batch_size=True), "target_batch_size"),
    "target_batch_size='8'": (lambda: trainer(target_batch_size="8"), "target_batch_size"),
    "micro_batch_size=0": (lambda: trainer(micro_batch_size=0), "micro_batch_size=0"),
    "micro_batch_size=9": (lambda: trainer(micro_batch_size=9), "micro_batch_size=9"),
    "micro_batch_size='big'": (lambda: trainer(micro_batch_size="big"), "micro_batch_size"),
    "micro_batch_size=2.5": (lambda: trainer(micro_batch_size=2.5), "micro_batch_size"),
    "memory_limit=0": (lambda: trainer(memory_limit=0), "memory_limit=0"),
    "memory_limit=1.5": (lambda: trainer(memory_limit=1.5), "memory_limit"),
    "memory_limit='1GB'": (lambda: trainer(memory_limit="1GB"), "memory_limit"),
    "headroom='x'": (lambda: trainer(headroom="x"), "headroom"),
    "headroom=1.0": (lambda: trainer(headroom=1.0), "headroom"),
    "headroom=-0.1": (lambda: trainer(headroom=-0.1), "headroom"),
    "headroom=nan": (lambda: trainer(headroom=float("nan")), "headroom"),
    "grow=True": (lambda: trainer(grow=True), "grow"),
    "grow=0": (lambda: trainer(grow=0), "grow=0"),
    "grow='sometimes'": (lambda: trainer(grow="sometimes"), "grow"),
    "oom_retries=-1": (lambda: trainer(oom_retries=-1), "oom_retries=-1"),
    "oom_retries='3'": (lambda: trainer(oom_retries="3"), "oom_retries"),
    "oom_retries=1.0": (lambda: trainer(oom_retries=1.0), "oom_retries"),
    "device='cpu'": (lambda: trainer(device="cpu"), "device"),
    "device=0": (lambda: trainer(device=0), "device"),
    "multiple_of=0": (lambda: trainer(multiple_of=0), "multiple_of=0"),
    "multiple_of=16": (lambda: trainer(multiple_of=16), "multiple_of=16"),
    "in_flight=0": (lambda: trainer(in_flight=0), "in_flight=0"),
    "plan_cache=3": (lambda: trainer(plan_cache=3), "plan_cache"),
    "objective='fastest'": (lambda: trainer(objective="fastest"), "objective"),
    "loss_fn=None": (lambda: trainer(loss_fn=None), "loss_fn"),
    "optimizer='adam'": (lambda: trainer(optimizer="adam"), "optimizer"),
    # AdaptiveStep's and Evaluator's, through the same checks
    "AdaptiveStep memory_limit=True": (lambda: own_step(memory_limit=True), "memory_limit"),
    "AdaptiveStep memory_limit=1.5": (lambda: own_step(memory_limit=1.5), "memory_limit"),
    "AdaptiveStep memory_limit='8GB'": (lambda: own_step(memory_limit="8GB"), "memory_limit"),
    "AdaptiveStep oom_retries=-1": (lambda: own_step(oom_retries=-1), "oom_retries=-1"),
    "AdaptiveStep oom_retries='3'": (lambda: own_step(oom_retries="3"), "oom_retries"),
    "AdaptiveStep headroom='x'": (lambda: own_step(headroom="x"), "headroom"),
    "AdaptiveStep device='cpu'": (lambda: own_step(device="cpu"), "device"),
    "AdaptiveStep batch_argnum='1'": (lambda: own_step(batch_argnum="1"), "batch_argnum"),
    "Evaluator device=0": (lambda: ja.Evaluator(lambda p, b: b, device=0), "device"),
    # the bucketed trainer's
    "buckets='16'": (lambda: bucketed(buckets="16"), "buckets"),
    "buckets=16": (lambda: bucketed(buckets=16), "buckets"),
    "buckets=(0, 16)": (lambda: bucketed(buckets=(0, 16)), "buckets"),
    "buckets=()": (lambda: bucketed(buckets=()), "buckets"),
    "buckets=(8.5,)": (lambda: bucketed(buckets=(8.5,)), "buckets"),
    "target_tokens and target_batch_size": (
        lambda: bucketed(target_batch_size=4), "target_tokens and target_batch_size"),
    "target_tokens=8": (lambda: bucketed(target_tokens=8), "target_tokens=8"),
    "weighting='tokens'": (lambda: bucketed(weighting="tokens"), "weighting"),
    "pow2_buckets(8, 16)": (lambda: ja.pow2_buckets(8, 16), "min_length"),
    # init, step, fit and the data helpers
    "aux named 'loss'": (
        lambda: trainer(loss_fn=aux_loss, has_aux=True).init(jnp.zeros(3), batch_of()),
        "metric named 'loss'"),
    "example_batch with a scalar": (
        lambda: trainer().init(jnp.zeros(3), {"x": np.float32(1.0)}), "scalar"),
    "batch of int32 for float32": (lambda: step_with(batch_of(x_dtype=np.int32)), "dtype int32"),
    "batch of 7 examples": (lambda: step_with(batch_of(7)), "target_batch_size=8"),
    "batch of another shape": (
        lambda: step_with({"x": np.ones((T, 4), np.float32), "y": np.ones(T, np.float32)}),
        "per-example shape"),
    "batch of another structure": (lambda: step_with({"x": np.ones((T, 3), np.float32)}),
                                   "structure"),
    "weights of the wrong shape": (lambda: step_with(weights=np.ones(3)), "weights"),
    "set_memory_limit(-1)": (lambda: initialised()[0].set_memory_limit(-1), "memory_limit=-1"),
    "fit num_updates=0": (
        lambda: initialised()[0].fit(initialised()[1], [batch_of()], num_updates=0),
        "num_updates=0"),
    "Rebatcher size=0": (lambda: ja.Rebatcher([], 0), "size=0"),
    "leading sizes disagree": (
        lambda: leading_size({"x": np.zeros(3), "y": np.zeros(4)}), "disagree"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LIBRARY))
def test_library_bad_input_is_one_line_naming_the_argument(name):
    make, names = LIBRARY[name]
    with pytest.raises((TypeError, ValueError), match=names) as info:
        make()
    message = str(info.value)
    assert "\n" not in message, message
    assert len(message) < 300, message


CLI = {
    "--target-batch-size 0": (["--target-batch-size", "0"], "--target-batch-size 0"),
    "--target-batch-size -8": (["--target-batch-size", "-8"], "--target-batch-size -8"),
    "--target-batch-size 2**31": (["--target-batch-size", str(2**31)], "--target-batch-size"),
    "--target-batch-size x": (["--target-batch-size", "x"], "--target-batch-size"),
    "--micro-batch-size 0": (["--micro-batch-size", "0"], "--micro-batch-size 0"),
    "--micro-batch-size 300": (["--micro-batch-size", "300"], "--micro-batch-size 300"),
    "--micro-batch-size big": (["--micro-batch-size", "big"], "--micro-batch-size"),
    "--memory-limit lots": (["--memory-limit", "lots"], "--memory-limit"),
    "--memory-limit 0": (["--memory-limit", "0"], "--memory-limit"),
    "--memory-limit -5MB": (["--memory-limit", "-5MB"], "--memory-limit"),
    "--memory-limit 1.5": (["--memory-limit", "1.5"], "--memory-limit"),
    "--learning-rate nan": (["--learning-rate", "nan"], "--learning-rate nan"),
    "--learning-rate inf": (["--learning-rate", "inf"], "--learning-rate inf"),
    "--learning-rate -1": (["--learning-rate", "-1"], "--learning-rate -1"),
    "--learning-rate 0": (["--learning-rate", "0"], "--learning-rate 0"),
    "--updates 0": (["--updates", "0"], "--updates 0"),
    "--updates -1": (["--updates", "-1"], "--updates -1"),
    "--model gpt --updates 0": (["--model", "gpt", "--updates", "0"], "--updates 0"),
    "--epochs 0": (["--epochs", "0"], "--epochs 0"),
    "--epochs -1": (["--epochs", "-1"], "--epochs -1"),
    "--epochs inf": (["--epochs", "inf"], "--epochs inf"),
    "--epochs nan": (["--epochs", "nan"], "--epochs nan"),
    "--updates with --epochs": (["--updates", "2", "--epochs", "1"], "--epochs"),
    "--seed 2**70": (["--seed", str(2**70)], "--seed"),
    "--seed -1": (["--seed", "-1"], "--seed -1"),
    "--seed 2**70 as text": (["--seed", "2**70"], "--seed"),
    "--checkpoint-every 0": (["--checkpoint-every", "0"], "--checkpoint-every 0"),
    "--model gpt --target-tokens 0": (["--model", "gpt", "--target-tokens", "0"],
                                      "--target-tokens 0"),
    "--model gpt --target-tokens -5": (["--model", "gpt", "--target-tokens", "-5"],
                                       "--target-tokens -5"),
    "--model gpt --target-tokens 8": (["--model", "gpt", "--target-tokens", "8"],
                                      "--target-tokens 8"),
    "--model gpt --max-length 8": (["--model", "gpt", "--max-length", "8"], "--max-length 8"),
    "--model gpt --epochs 1": (["--model", "gpt", "--epochs", "1"], "--epochs"),
    "--model gpt --micro-batch-size 4": (["--model", "gpt", "--micro-batch-size", "4"],
                                         "--micro-batch-size"),
    "--target-tokens for cnn": (["--target-tokens", "512"], "--target-tokens"),
    "--model lenet": (["--model", "lenet"], "--model"),
    "--optimizer lion": (["--optimizer", "lion"], "--optimizer"),
    "--objective fastest": (["--objective", "fastest"], "--objective"),
    "--dataset imagenet": (["--dataset", "imagenet"], "'synthetic:N' or 'tfds:NAME'"),
    "--resume without --workdir": (["--resume"], "--resume"),
    "--workdir a file": (["--workdir", "{file}"], "--workdir"),
    "--workdir under /proc": (["--workdir", "/proc/jax_adaptive_test/run"], "--workdir"),
    "--workdir under a file": (["--workdir", "{file}/run"], "--workdir"),
    "--workdir with **": (["--workdir", "{tmp}/runs/**/x"], "--workdir"),
    "--workdir with [": (["--workdir", "{tmp}/run[1]"], "--workdir"),
    "--compilation-cache a file": (["--compilation-cache", "{file}"], "--compilation-cache"),
    "--compilation-cache under /proc": (["--compilation-cache", "/proc/jax_adaptive_test"],
                                        "--compilation-cache"),
    "--unknown-flag": (["--batch-size", "8"], "--batch-size"),
    "--ghost-batch-size -1": (["--model", "resnet-tiny", "--ghost-batch-size", "-1"],
                              "--ghost-batch-size -1"),
    "--ghost-batch-size for cnn": (["--ghost-batch-size", "16"], "--ghost-batch-size"),
    "--ghost-batch-size 24 of 256": (["--model", "resnet-tiny", "--ghost-batch-size", "24"],
                                     "--ghost-batch-size 24"),
    "--ghost-batch-size --data-parallel": (["--model", "resnet-tiny", "--ghost-batch-size",
                                            "16", "--data-parallel"], "--ghost-batch-size"),
    "--micro-batch-size 16 of ghost 32": (["--model", "resnet-tiny", "--micro-batch-size",
                                           "16"], "--micro-batch-size 16"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CLI))
def test_cli_bad_input_exits_2_with_one_line_before_training(name, tmp_path, capsys):
    flags, names = CLI[name]
    (tmp_path / "a_file").write_text("not a directory")
    fill = {"file": str(tmp_path / "a_file"), "tmp": str(tmp_path)}
    flags = [flag.format(**fill) for flag in flags]
    assert main([*flags, "--no-progress", "--no-plan-cache"]) == 2
    out, err = capsys.readouterr()
    assert out == "", f"training started: {out!r}"
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert names in err, err


def test_there_are_at_least_50_bad_inputs():
    assert len(LIBRARY) + len(CLI) >= 50 and len(LIBRARY) >= 25 and len(CLI) >= 25


_ANOTHER_DEVICE = """
import jax, jax.numpy as jnp, numpy as np, optax
import jax_adaptive as ja
assert jax.device_count() == 2, jax.devices()
loss = lambda p, b, r: (b["x"] @ p - b["y"]) ** 2
batch = {"x": np.arange(24, dtype=np.float32).reshape(8, 3) / 24, "y": np.ones(8, np.float32)}
trainer = ja.AdaptiveTrainer(loss, optax.sgd(0.1), target_batch_size=8, micro_batch_size=3,
                             device=jax.devices()[0], plan_cache=False)
state = trainer.init(jnp.zeros(3), batch)
elsewhere = jax.device_put(batch, jax.devices()[1])  # committed to the other device
state, metrics = trainer.step(state, elsewhere)
grad = jax.grad(lambda p: jnp.mean(loss(p, batch, None)))(jnp.zeros(3))
np.testing.assert_allclose(state.params, -0.1 * grad, rtol=1e-6)
print("placed", state.params.devices() == {jax.devices()[0]})
"""


def test_a_batch_on_another_device_is_placed_not_refused():
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
    }
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_ANOTHER_DEVICE)], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["placed", "True"]


def test_a_float64_numpy_batch_is_taken_as_jax_takes_it_at_every_step():
    """NumPy's default float64, with JAX's x64 off: cast to float32, not refused, each step."""
    t = trainer(micro_batch_size=3)
    state = t.init(jnp.zeros(3), batch_of())
    wide = {"x": np.arange(T * 3, dtype=np.float64).reshape(T, 3) / 10, "y": np.ones(T)}
    narrow = {k: v.astype(np.float32) for k, v in wide.items()}
    grad = jax.grad(lambda p: jnp.mean(loss(p, narrow, None)))
    params = jnp.zeros(3)
    for _ in range(3):  # the first update, then the steady ones
        state, _ = t.step(state, wide)
        params = params - 0.1 * grad(params)
    np.testing.assert_allclose(state.params, params, rtol=1e-5)
    assert state.params.dtype == jnp.float32
