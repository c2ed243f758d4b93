"""NaFlex input pipelines (`vit_keras.tools.data.naflex`): images of any sizes resized, patchified
and padded inside tf.data as `vit_keras.naflex_patches` does it; training batches in
sequence-length buckets with a token budget, resumable at any batch; one compiled program per
bucket when `model.fit` trains on them."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import vit_keras
from vit_keras.model import ViT
from vit_keras.model.naflex_patches import naflex_grid_shapes
from vit_keras.tools import data
from vit_keras.tools.data import naflex

BACKEND = keras.backend.backend()
SIZES = ((37, 91), (120, 45), (64, 64), (13, 200), (300, 17), (48, 40))
TINY = dict(name="tiny", patch_size=4, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)


def _mixed_splits(sizes=SIZES, seed=0):
    """A dataset of random RGB images of the given sizes, classes 0 and 1 in turn."""
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    labels = [index % 2 for index in range(len(images))]

    def source():
        return tf.data.Dataset.from_generator(
            lambda: zip(images, labels),
            output_signature=(tf.TensorSpec([None, None, 3], tf.uint8),
                              tf.TensorSpec([], tf.int32)))

    sources = {split: source for split in data.SPLITS}
    return data.Splits("mixed", ["a", "b"], {split: len(images) for split in data.SPLITS},
                       sources), images


@pytest.mark.backend_independent
def test_the_pipelines_size_rule_is_naflex_size_exactly():
    sizes = [(h, w) for h in (1, 7, 16, 33, 100, 255, 1000) for w in (1, 9, 16, 64, 301, 999)]
    for patch, budget in ((16, 256), (14, 729), (4, 16), (16, 1)):
        got = [tuple(int(v) for v in naflex.naflex_size(h, w, patch, budget)) for h, w in sizes]
        assert got == [vit_keras.naflex_size(h, w, patch, budget) for h, w in sizes]


def test_evaluation_batches_are_naflex_patches_of_the_same_images():
    """Against `naflex_patches` on this backend's resize: TensorFlow's is the pipeline's own
    (exact); JAX's and torch's antialiased bilinear differ from it by float rounding."""
    splits, images = _mixed_splits()
    batching = naflex.NaFlexBatching(patch_size=8, max_num_patches=40)
    features, labels = next(iter(naflex.make_naflex_pipeline(splits, "test", batching,
                                                             batch_size=len(images))))
    expected = vit_keras.naflex_patches(images, 8, 40)
    np.testing.assert_array_equal(features["patch_coord"], expected["patch_coord"])
    np.testing.assert_array_equal(features["patch_valid"], expected["patch_valid"])
    np.testing.assert_allclose(features["patches"], expected["patches"],
                               atol=0 if BACKEND == "tensorflow" else 0.01)
    np.testing.assert_array_equal(labels.numpy().argmax(-1), [0, 1, 0, 1, 0, 1])
    # Wide and tall images keep their aspect ratio within a patch.
    grids = naflex_grid_shapes(features["patch_coord"], features["patch_valid"])
    assert [tuple(g) for g in grids] == [vit_keras.naflex_size(h, w, 8, 40) for h, w in SIZES]


@pytest.mark.backend_independent
def test_training_batches_hold_the_token_budget_and_each_bucket_once_per_cycle():
    splits = data.load_splits("digits", log=lambda _: None)
    batching = naflex.NaFlexBatching(patch_size=4, max_num_patches=16, tokens_per_batch=512)
    assert batching.seq_lens == (2, 4, 9, 12, 16)
    assert batching.batch_sizes == (256, 128, 56, 42, 32)
    # Over 8 devices every batch divides by 8, the budget's rounded down (and 1 image up to 8).
    divided = naflex.NaFlexBatching(16, tokens_per_batch=512, batch_divisor=8)
    assert divided.batch_sizes == (256, 128, 56, 40, 32)
    assert naflex.NaFlexBatching(16, tokens_per_batch=8, batch_divisor=8).batch_sizes == (8,) * 5
    assert naflex.default_seq_lens(1024) == (128, 256, 576, 784, 1024)  # timm's buckets
    batches = list(naflex.make_naflex_pipeline(splits, "train", batching, training=True)
                   .take(3 * len(batching.seq_lens)))
    lengths = [features["patches"].shape[1] for features, _ in batches]
    for cycle in range(3):
        assert sorted(lengths[5 * cycle:5 * cycle + 5]) == list(batching.seq_lens)
    assert lengths[:5] != lengths[5:10] or lengths[5:10] != lengths[10:15]  # drawn orders
    for features, labels in batches:
        batch, length = features["patches"].shape[:2]
        assert batch == 512 // length and labels.shape == (batch, 10)
        assert features["patches"].shape[2] == 4 * 4 * 3
        valid = features["patch_valid"].numpy()
        # An 8x8 digit's crop fills its budget but for the rounding of its sides to whole patches.
        assert valid.sum(1).max() <= length and valid.sum(1).min() >= 1
        assert not features["patches"].numpy()[~valid].any()  # padding is zeros
        np.testing.assert_array_equal(valid, np.sort(valid, axis=1)[:, ::-1])  # valid, then pad


@pytest.mark.backend_independent
def test_a_training_stream_started_at_any_batch_is_the_uninterrupted_one():
    splits = data.load_splits("digits", log=lambda _: None)
    batching = naflex.NaFlexBatching(patch_size=4, max_num_patches=16, tokens_per_batch=256)

    def stream(count, start_batch=0, seed=3):
        pipeline = naflex.make_naflex_pipeline(splits, "train", batching, training=True,
                                               seed=seed, start_batch=start_batch)
        return [(features["patches"].numpy(), labels.numpy()) for features, labels
                in pipeline.take(count)]

    whole = stream(24)  # over 1.5 passes of the 1,257 images
    for start in (1, 7, 13, 19):
        for (x, y), (x2, y2) in zip(whole[start:], stream(24 - start, start)):
            np.testing.assert_array_equal(x, x2)
            np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(whole[0][1], stream(1, seed=4)[0][1])


@pytest.mark.backend_independent
def test_bad_batching_and_square_image_augmentations_are_refused():
    splits = data.load_splits("digits", log=lambda _: None)
    with pytest.raises(ValueError, match="longer than max_num_patches=16"):
        naflex.NaFlexBatching(patch_size=4, max_num_patches=16, seq_lens=(8, 32))
    with pytest.raises(ValueError, match="needs tokens_per_batch"):
        naflex.make_naflex_pipeline(splits, "train", naflex.NaFlexBatching(16, 4), training=True)
    with pytest.raises(ValueError, match="MixUp"):
        naflex.make_naflex_pipeline(
            splits, "train", naflex.NaFlexBatching(16, 4, tokens_per_batch=64), training=True,
            augmentation=data.Augmentation(mixup=0.2))


def test_fit_on_buckets_compiles_one_program_per_bucket():
    """A step's Python runs once per trace: on JAX one jitted program per bucket's shape; on
    TensorFlow no more (its `tf.function` relaxes shapes, XLA then compiles each); torch runs
    the steps eagerly. Each bucket is met in the first cycle, and later cycles add none."""
    splits = data.load_splits("digits", log=lambda _: None)
    batching = naflex.NaFlexBatching(patch_size=4, max_num_patches=16, tokens_per_batch=128)
    model = ViT(TINY, image_size=16, num_classes=10, naflex=True)
    traces = []
    step = model.train_step

    def counted(*args, **kwargs):
        traces.append(1)
        return step(*args, **kwargs)

    model.train_step = counted
    model.compile(optimizer="adam", jit_compile=BACKEND != "torch",
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    train = naflex.make_naflex_pipeline(splits, "train", batching, training=True)
    history = model.fit(train, epochs=3, steps_per_epoch=5, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    if BACKEND == "jax":
        assert len(traces) == len(batching.seq_lens)
    elif BACKEND == "tensorflow":
        assert 1 <= len(traces) <= len(batching.seq_lens)
    else:
        assert len(traces) == 15
