import jax
import numpy as np
import pytest

import jax_adaptive as ja
from jax_adaptive.data import leading_size, micro_batches, synthetic_images


@pytest.mark.parametrize("total", [1, 7, 12])
@pytest.mark.parametrize("size", [1, 2, 5, 12])
@pytest.mark.parametrize("on_device", [False, True, "id only"])
def test_micro_batches_cover_each_row_once(total, size, on_device):
    if size > total:
        size = total
    batch = {"id": np.arange(total), "x": np.arange(total * 2, dtype=np.float32).reshape(total, 2)}
    if on_device == "id only":  # a device leaf beside a host one: each cut its own way
        batch["id"] = jax.device_put(batch["id"])
    elif on_device:
        batch = jax.device_put(batch)
    seen = []
    parts = list(micro_batches(batch, size))
    assert len(parts) == -(-total // size)
    for part in parts:
        ids = np.asarray(part.batch["id"])
        assert isinstance(part.batch["id"], jax.Array) == bool(on_device)
        assert isinstance(part.batch["x"], jax.Array) == (on_device is True)
        assert ids.shape == (size,) and part.mask.shape == (size,)
        np.testing.assert_array_equal(np.asarray(part.batch["x"])[:, 0], ids * 2)
        assert part.offset == ids[0]
        # padding repeats real rows of the same micro-batch, never zeros or others' rows
        assert set(ids[~part.mask]) <= set(ids[part.mask])
        seen.extend(ids[part.mask].tolist())
    assert seen == list(range(total))


def test_leading_size_errors():
    with pytest.raises(ValueError, match="no arrays"):
        leading_size({})
    with pytest.raises(ValueError, match="scalar"):
        leading_size({"x": np.float32(1.0)})
    with pytest.raises(ValueError, match="disagree"):
        leading_size({"x": np.zeros(3), "y": np.zeros(4)})


def test_synthetic_images_share_patterns_across_seeds():
    a = synthetic_images(500, image_shape=(4, 4, 1), num_classes=2, seed=1)
    b = synthetic_images(500, image_shape=(4, 4, 1), num_classes=2, seed=2)
    assert not np.array_equal(a["image"], b["image"])
    for data in (a, b):
        means = [data["image"][data["label"] == c].mean(0) for c in (0, 1)]
        other = [
            x["image"][x["label"] == c].mean(0) for x in (b if data is a else a,) for c in (0, 1)
        ]
        np.testing.assert_allclose(means, other, atol=0.35)  # same class patterns


def _ids(n0, n1):
    return {"id": np.arange(n0, n1)}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: (_ids(i, i + 5) for i in range(0, 40, 5)), id="generator"),
        pytest.param(lambda: iter([_ids(i, i + 5) for i in range(0, 40, 5)]), id="list iterator"),
    ],
)
def test_rebatchers_of_one_iterator_share_what_was_read_past_a_batch(make):
    stream, seen = make(), []
    for _ in range(4):  # a new Rebatcher each time, as each call of fit makes one
        rebatcher = ja.Rebatcher(stream, 8)
        seen.extend(next(rebatcher)["id"].tolist())
        assert rebatcher.leftover == (5 - len(seen) % 5) % 5
    seen.extend(b["id"].tolist() for b in ja.Rebatcher(stream, 8))
    assert seen[:32] == list(range(32)) and seen[32:] == [list(range(32, 40))]


def test_an_iterable_that_is_not_an_iterator_is_read_afresh():
    chunks = [_ids(0, 5), _ids(5, 10)]
    assert next(ja.Rebatcher(chunks, 8))["id"].tolist() == list(range(8))
    assert next(ja.Rebatcher(chunks, 8))["id"].tolist() == list(range(8))
