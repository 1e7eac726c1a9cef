"""Shape buckets and token budgets, against a masked full-batch reference.

The reference is plain optax: one jitted step per update on the update's whole padded
batch, with the per-token (or per-sequence) mean written out here from the logits and
the mask, not through the trainer or `gpt_token_loss`.
"""

import contextlib
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import jax_adaptive as ja
from jax_adaptive.buckets import bucket_for
from jax_adaptive.memory import MemoryModel, predict_line
from jax_adaptive.models import GPT, gpt_token_loss
from jax_adaptive.testing import inject_oom

MODEL = GPT(vocab_size=11, max_len=16, width=16, depth=1, heads=2)
BUCKETS = (4, 8, 16)
TARGET_TOKENS = 64  # 16, 8 and 4 sequences per update
LIMIT = 160_000  # micro-batches of 11, 5 and 2: below every update (the ledger: state + in flight)
# Adam divides by sqrt(v) + eps: with the default eps a near-zero gradient turns float
# rounding (a sum over micro-batches is not bit-equal to one sum) into 1e-4 differences.
OPTIMIZER = optax.adam(3e-3, eps=1e-4)


def _next_token_counts(batch):
    return batch["mask"][:, 1:].sum(axis=1)


def _sequences(n, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 17, n)
    return [{"tokens": rng.integers(0, 11, k).astype(np.int32)} for k in lengths]


def _params():
    return MODEL.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]


def _reference(params, batches, weighting):
    opt_state = OPTIMIZER.init(params)

    @jax.jit
    def step(params, opt_state, tokens, mask):
        def loss(p):
            logits = MODEL.apply({"params": p}, tokens)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
            valid = mask[:, 1:].astype(jnp.float32)
            if weighting == "token":
                return jnp.sum(ce * valid) / jnp.sum(valid)
            return jnp.mean(jnp.sum(ce * valid, axis=1) / jnp.sum(valid, axis=1))

        grads = jax.grad(loss)(params)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for batch in batches:
        params, opt_state = step(params, opt_state, batch.batch["tokens"], batch.batch["mask"])
    return params


def _trainer(**kwargs):
    return ja.BucketedTrainer(
        gpt_token_loss(MODEL),
        OPTIMIZER,
        buckets=BUCKETS,
        count_tokens=_next_token_counts,
        **{
            "target_tokens": TARGET_TOKENS,
            "memory_limit": LIMIT,
            "plan_cache": False,
            "objective": "max",  # the exact largest size per bucket is checked below
            **kwargs,
        },
    )


def _batches(sequences, trainer):
    sizes = {length: trainer.examples_per_update(length) for length in BUCKETS}
    return list(ja.bucket_batches(sequences, sizes))


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One token-weighted run over mixed lengths, with a plan cache file."""
    cache = tmp_path_factory.mktemp("plans") / "plans.json"
    sequences = _sequences(120)
    trainer = _trainer(plan_cache=cache)
    state, history = trainer.fit(trainer.init(_params(), sequences[0]), sequences)
    return trainer, state, history, _batches(sequences, trainer), cache


def test_mixed_lengths_equal_the_masked_full_batch_reference(fitted):
    trainer, state, history, batches, _ = fitted
    assert len(history) == len(batches) >= 6
    assert {h["bucket"] for h in history} == set(BUCKETS)
    # Micro-batches smaller than the update, some not dividing it (masked padding rows).
    steps = {b["bucket"]: b["accumulation_steps"] for b in trainer.bucket_log}
    assert steps[16] > 1 and steps[8] > 1, trainer.bucket_log
    assert any(4 * 16 // b["bucket"] % b["micro_batch_size"] for b in trainer.bucket_log)
    assert_trees_close(state.params, _reference(_params(), batches, "token"), 2e-5)


def test_example_weighting_equals_the_mean_of_per_sequence_means(fitted):
    sequences = _sequences(40, seed=1)
    trainer = _trainer(weighting="example", plan_cache=fitted[-1])  # the same plans
    state, _ = trainer.fit(trainer.init(_params(), sequences[0]), sequences)
    assert_trees_close(
        state.params, _reference(_params(), _batches(sequences, trainer), "example"), 2e-5
    )


def test_token_weighting_reports_the_mean_loss_per_real_token(fitted):
    sequences = _sequences(40, seed=3)
    trainer = _trainer(plan_cache=fitted[-1])
    state = trainer.init(_params(), sequences[0])
    params = state.params
    _, metrics = trainer.step(state, _batches(sequences, trainer)[0])
    batch = _batches(sequences, trainer)[0].batch
    logits = MODEL.apply({"params": params}, batch["tokens"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["tokens"][:, 1:])
    valid = batch["mask"][:, 1:]
    np.testing.assert_allclose(metrics["loss"], np.sum(ce * valid) / valid.sum(), rtol=1e-5)
    assert metrics["tokens"] == valid.sum()
    assert metrics["padded_tokens"] == batch["mask"].size


def _tagged(n, seed=5):
    """Sequences whose every token is the sequence's index: a batch says which it holds."""
    lengths = np.random.default_rng(seed).integers(2, 17, n)
    return [{"tokens": np.full(k, i, np.int32)} for i, k in enumerate(lengths)]


def _held(batch):
    return batch.bucket, [int(row[0]) for row in batch.batch["tokens"]]


@pytest.mark.parametrize("read_ahead", [0, 7])
@pytest.mark.parametrize("source", ["list iterator", "generator"])
def test_what_waits_in_the_buckets_stays_with_the_stream(source, read_ahead):
    """Readers of one iterator, each stopping part-way, give the batches of one reader
    over the whole stream (the reference): each sequence once, in the same batches and
    order. An iterator without weak references (a list's) is held while sequences wait
    in it; a generator is kept weakly. A list is read afresh by each reader. Read
    ahead, the sequences are read in another thread, and what a stopped reader read
    ahead and did not bucket comes first to the next reader."""
    sequences = _tagged(90)
    sizes = {4: 5, 8: 3, 16: 2}
    reference = [_held(b) for b in ja.bucket_batches(sequences, sizes)]
    threads = set()

    def generated():
        for sequence in sequences:
            threads.add(threading.get_ident())
            yield sequence

    stream = iter(sequences) if source == "list iterator" else generated()
    got = []
    for stop in (1, 3, 2):  # three readers that stop after a few batches, then one to the end
        with contextlib.closing(ja.bucket_batches(stream, sizes, read_ahead=read_ahead)) as r:
            got += [_held(next(r)) for _ in range(stop)]
    got += [_held(b) for b in ja.bucket_batches(stream, sizes, read_ahead=read_ahead)]
    assert got == reference
    if source == "generator":
        assert (threading.get_ident() in threads) == (read_ahead == 0), threads
    # Under other buckets, what waits is bucketed again: every sequence still once.
    stream, seen = iter(sequences), []
    seen += _held(next(ja.bucket_batches(stream, sizes)))[1]
    seen += [i for b in ja.bucket_batches(stream, {16: 4}) for i in _held(b)[1]]
    assert len(seen) == len(set(seen)) and len(sequences) - 4 < len(seen) <= len(sequences)
    assert [_held(next(ja.bucket_batches(sequences, sizes)))] * 2 == reference[:1] * 2


def test_a_stream_error_read_ahead_reaches_the_next_reader_after_its_sequences():
    """A reader that read ahead into the stream's error and stopped before it hands the
    error back with the sequences before it: the next reader yields their batches, then
    raises it, as one reader that reads as it goes does."""
    sequences = _tagged(40)
    sizes = {4: 5, 8: 3, 16: 2}

    def failing():
        yield from sequences
        raise OSError("the disk went away")

    def batches_then_error(readers):
        stream, got = failing(), []
        with pytest.raises(OSError, match="the disk went away"):
            for stop, read_ahead in readers:
                reader = ja.bucket_batches(stream, sizes, read_ahead=read_ahead)
                with contextlib.closing(reader):
                    for batch in reader:
                        got.append(_held(batch))
                        if len(got) == stop:
                            time.sleep(0.2)  # the thread reads on, into the error
                            break
        return got

    one_reader = batches_then_error([(None, 0)])
    assert len(one_reader) > 2 and batches_then_error([(1, 200), (None, 0)]) == one_reader
    with pytest.raises(ValueError, match=r"read_ahead=1\.5 must be an int >= 0"):
        ja.bucket_batches(sequences, sizes, read_ahead=1.5)


def test_fit_in_pieces_on_one_iterator_equals_one_fit(fitted):
    """``fit(state, it, n)`` called again on the same iterator goes on with the sequences
    already read into buckets or read ahead (two updates' worth: here the whole stream,
    in a background thread): three fits of 2, 1 and the rest give one fit's updates.
    Reference: the masked full-batch optax steps on one reader's batches."""
    sequences = _sequences(32, seed=2)
    trainer = _trainer(plan_cache=fitted[-1])
    state = trainer.init(_params(), sequences[0])
    stream, history = iter(sequences), []
    for n in (2, 1, None):
        state, h = trainer.fit(state, stream, n, read_ahead=2 * 16)
        history += h
    batches = _batches(sequences, trainer)
    assert [h["bucket"] for h in history] == [b.bucket for b in batches]
    assert_trees_close(state.params, _reference(_params(), batches, "token"), 2e-5)


def test_an_out_of_memory_in_one_bucket_loses_nothing(fitted, tmp_path):
    sequences = _sequences(60)
    cache = shutil.copy(fitted[-1], tmp_path)  # the shrunk plan is stored: keep it apart
    trainer = _trainer(plan_cache=cache, chunk=1)  # a dispatch per micro-step
    state = trainer.init(_params(), sequences[0])
    batches, injected, sizes = _batches(sequences, trainer), [], {}
    for batch in batches:
        bucket = trainer.trainers.get(batch.bucket)
        if bucket is not None and bucket.accumulation_steps > 1 and not injected:
            # A bucket whose size already ran fails at its second micro-step.
            sizes["before"] = bucket.micro_batch_size
            with inject_oom(bucket, executions={2}) as faults:
                state, metrics = trainer.step(state, batch)
            injected, sizes["after"] = faults.injected, int(metrics["micro_batch_size"])
        else:
            state, _ = trainer.step(state, batch)
    assert injected and sizes["after"] < sizes["before"]
    assert_trees_close(state.params, _reference(_params(), batches, "token"), 2e-5)


def test_each_bucket_gets_the_exact_largest_size_and_the_plan_cache_keeps_them(fitted):
    trainer, _, _, _, cache = fitted

    def fits(bucket, size):
        return bucket.ledger(size).total <= LIMIT

    for length, bucket in trainer.trainers.items():  # the largest: its neighbour does not fit
        m = bucket.micro_batch_size
        assert fits(bucket, m) and not fits(bucket, m + 1), length
    bucket = trainer.trainers[8]  # and by brute force, in one bucket
    assert bucket.micro_batch_size == max(s for s in range(1, 9) if fits(bucket, s))
    sequences = _sequences(120)
    again = _trainer(plan_cache=cache)
    again.fit(again.init(_params(), sequences[0]), sequences)
    assert [b["compiles"] for b in again.bucket_log] == [0] * len(BUCKETS)
    assert {b["bucket"]: b["micro_batch_size"] for b in again.bucket_log} == {
        b["bucket"]: b["micro_batch_size"] for b in trainer.bucket_log
    }


def test_a_new_bucket_starts_its_search_at_the_predicted_size(fitted):
    trainer = fitted[0]
    later = [b for b in trainer.bucket_log if b["predicted_micro_batch_size"] is not None]
    assert later, trainer.bucket_log
    for entry in later:  # the sizes its planning tried, the first the prediction
        assert entry["sizes_tried"][0] == max(1, entry["predicted_micro_batch_size"])


def test_predict_line_recovers_a_peak_linear_in_tokens_and_attention():
    def peak(length, m):
        return 5_000 + 20 * length + m * (7 * length + 2 * length**2)

    seen = {(length, m): peak(length, m) for length in (32, 128) for m in (3, 8, 20)}
    intercept, slope = predict_line(seen, 64, capacity=10**6)
    assert intercept == pytest.approx(peak(64, 0), rel=1e-6)
    assert slope == pytest.approx(peak(64, 1) - peak(64, 0), rel=1e-6)
    model = MemoryModel(prior=(intercept, slope))
    assert model.largest_within(peak(64, 11)) == 11


def test_buckets_group_a_stream_without_losing_or_repeating_a_sequence():
    sequences = [{"t": np.full(n, i)} for i, n in enumerate([3, 9, 4, 2, 12, 16, 1, 7, 5])]
    batches = list(ja.bucket_batches(sequences, {4: 2, 8: 2, 16: 2}))
    seen = [int(row[0]) for b in batches for row in b.batch["t"]]
    assert len(seen) == len(set(seen))
    assert sorted(seen) == [0, 1, 2, 3, 4, 6, 7, 8]  # 5 (length 16) waits for a partner
    for b in batches:
        lengths = b.batch["mask"].sum(axis=1)
        assert all(bucket_for(int(n), (4, 8, 16)) == b.bucket for n in lengths)
    assert ja.pow2_buckets(100) == (16, 32, 64, 100)
    assert ja.pow2_buckets(64, min_length=8) == (8, 16, 32, 64)


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="exactly one of"):
        ja.BucketedTrainer(gpt_token_loss(MODEL), OPTIMIZER, buckets=BUCKETS)
    with pytest.raises(ValueError, match="largest bucket"):
        _trainer(target_tokens=8)
    with pytest.raises(ValueError, match="length 17 does not fit any bucket of \\[4, 8, 16\\]"):
        bucket_for(17, BUCKETS)
    trainer = _trainer()
    with pytest.raises(RuntimeError, match="init"):
        trainer.step(None, ja.BucketBatch(4, {}))


def _conv(x, kernel):
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip


def _image_logits(params, images, mask):
    """Two masked convolutions and a masked mean: padding never reaches a real pixel."""
    m = mask[..., None].astype(images.dtype)
    h = jax.nn.relu(_conv(images, params["k1"]) + params["b1"][None, None, None]) * m
    h = jax.nn.relu(_conv(h, params["k2"]) + params["b2"][None, None, None]) * m
    return (jnp.sum(h, axis=(1, 2)) / jnp.sum(m, axis=(1, 2))) @ params["out"]


def _image_loss(params, batch, rng):
    logits = _image_logits(params, batch["image"], batch["mask"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def test_image_shape_buckets_equal_unpadded_images_one_by_one():
    rng = np.random.default_rng(0)
    images = [
        {"image": rng.normal(size=(h, w, 3)).astype(np.float32),
         "label": np.int32(rng.integers(3)), "index": np.int32(i)}
        for i, (h, w) in enumerate(rng.choice((6, 12), size=(40, 2)))
    ]  # fmt: skip
    keys = jax.random.split(jax.random.key(1), 3)
    params = {
        "k1": jax.random.normal(keys[0], (3, 3, 3, 8)) * 0.3, "b1": jnp.full(8, 0.1),
        "k2": jax.random.normal(keys[1], (3, 3, 8, 8)) * 0.2, "b2": jnp.full(8, 0.1),
        "out": jax.random.normal(keys[2], (8, 3)) * 0.3,
    }  # fmt: skip
    optimizer = optax.sgd(0.5, momentum=0.9)
    trainer = ja.BucketedTrainer(
        _image_loss, optimizer, buckets=[(8, 8), (8, 16), (16, 8), (16, 16)],
        target_batch_size=4, weighting="none", micro_batch_size=3, plan_cache=False,
    )  # fmt: skip
    state, history = trainer.fit(trainer.init(params, images[0]), images)
    assert len({tuple(h["bucket"]) for h in history}) == 4 and len(history) >= 6

    # The reference: each image at its own size, unpadded, in one full-batch step.
    @jax.jit
    def one(p, image, label):
        logits = _image_logits(p, image[None], jnp.ones((1, *image.shape[:2]), bool))
        return optax.softmax_cross_entropy_with_integer_labels(logits, label[None])[0]

    def mean_loss(p, rows):
        return sum(one(p, images[i]["image"], images[i]["label"]) for i in rows) / len(rows)

    reference, opt_state = params, optimizer.init(params)
    for batch in ja.bucket_batches(images, {b: 4 for b in trainer.buckets}):
        grads = jax.grad(mean_loss)(reference, batch.batch["index"].tolist())
        updates, opt_state = optimizer.update(grads, opt_state, reference)
        reference = optax.apply_updates(reference, updates)
    assert_trees_close(state.params, reference, 2e-5)
