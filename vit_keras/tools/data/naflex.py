"""NaFlex input pipelines: `tf.data` batches of patch sequences for `ViT(naflex=True)`.

Each image is resized, keeping its aspect ratio, to its NaFlex size for a patch budget
(`vit_keras.naflex_size`, transformers' and big_vision's rule), cut into patches and padded, all
inside the pipeline: `naflex_example` is `vit_keras.naflex_patches` in TensorFlow ops, and gives
its patches for the same image (to the resize's float rounding). Elements are
`({"patches", "patch_coord", "patch_valid"}, one-hot labels)` with the layouts of
`vit_keras.naflex_patches`; pixels stay float32 in [0, 255], as `make_pipeline`'s.

Training batches come in sequence-length buckets with a token budget, as timm's NaFlex loader
makes them: each batch has one sequence length `L` from `seq_lens`, its images resized to a
budget of `L` patches, and `tokens_per_batch // L` images, so that a step costs about the same
at every length and a compiled backend compiles one program per bucket. The buckets come in
cycles, each bucket once per cycle in an order drawn from `(seed, cycle)`; the stream stays a
pure function of the seed and the example index, so `start_batch` resumes it exactly.

    batching = NaFlexBatching(max_num_patches=16, patch_size=4, tokens_per_batch=64 * 16)
    train = make_naflex_pipeline(splits, "train", batching, training=True)
    test = make_naflex_pipeline(splits, "test", batching, batch_size=256)
"""

import dataclasses

import tensorflow as tf

from vit_keras.model.naflex_patches import SCALE_SEARCH_END, positive_int
from vit_keras.tools import data

# timm's default buckets (128, 256, 576, 784, 1024 patches) as fractions of the largest, so that
# a budget of 1,024 patches gets exactly timm's.
_BUCKET_FRACTIONS = (128 / 1024, 256 / 1024, 576 / 1024, 784 / 1024, 1.0)
_SCHEDULE = 3  # the purpose of the stateless seeds that order each cycle's buckets


def default_seq_lens(max_num_patches):
    """timm's buckets scaled to `max_num_patches`: `(128, 256, 576, 784, 1024)` for 1,024."""
    return tuple(sorted({max(1, round(max_num_patches * f)) for f in _BUCKET_FRACTIONS}))


@dataclasses.dataclass(frozen=True)
class NaFlexBatching:
    """How a NaFlex pipeline sizes its batches.

    Attributes:
      max_num_patches: the evaluation budget and sequence length, and the longest bucket.
      patch_size: the model's patch size in pixels (a pipeline needs it; a run's schedule
        does not).
      seq_lens: the training buckets' sequence lengths (default `default_seq_lens`), each at
        most `max_num_patches`.
      tokens_per_batch: the training token budget per batch (patches, padding included); a
        bucket of length `L` has `tokens_per_batch // L` images, rounded down to a multiple of
        `batch_divisor` (at least `batch_divisor`).
      batch_divisor: what every training batch divides by: the devices a batch is split over
        (`--distribution`), as timm's NaFlex loader's `batch_divisor`.
    """

    max_num_patches: int
    patch_size: int = None
    seq_lens: tuple = None
    tokens_per_batch: int = None
    batch_divisor: int = 1

    def __post_init__(self):
        positive_int(self.max_num_patches, "max_num_patches")
        if self.patch_size is not None:
            positive_int(self.patch_size, "patch_size")
        seq_lens = self.seq_lens or default_seq_lens(self.max_num_patches)
        seq_lens = tuple(sorted({positive_int(length, "seq_lens") for length in seq_lens}))
        if seq_lens[-1] > self.max_num_patches:
            raise ValueError(f"seq_lens {seq_lens} has buckets longer than max_num_patches="
                             f"{self.max_num_patches}, the model's longest sequence.")
        object.__setattr__(self, "seq_lens", seq_lens)
        if self.tokens_per_batch is not None:
            positive_int(self.tokens_per_batch, "tokens_per_batch")
        positive_int(self.batch_divisor, "batch_divisor")

    @property
    def batch_sizes(self):
        """Images per training batch of each bucket, in the order of `seq_lens`."""
        if self.tokens_per_batch is None:
            raise ValueError("A NaFlex training pipeline needs tokens_per_batch.")
        divisor = self.batch_divisor
        return tuple(max(divisor, self.tokens_per_batch // length // divisor * divisor)
                     for length in self.seq_lens)

    def steps_per_epoch(self, num_examples):
        """Training batches that hold about `num_examples` images: whole cycles' average."""
        per_cycle = sum(self.batch_sizes)
        return max(1, round(num_examples * len(self.seq_lens) / per_cycle))

    def bucket_order(self, cycle, seed):
        """The bucket indices of `cycle`'s batches, int32 `(buckets,)`: a stateless draw."""
        draw = tf.random.stateless_uniform([len(self.seq_lens)],
                                           data._stream_seed(seed, _SCHEDULE, cycle))
        return tf.cast(tf.argsort(draw), tf.int32)

    def batch_of(self, position, seed):
        """Which batch, and bucket, the stream's `position`-th image falls in (int64, int32)."""
        sizes = tf.constant(self.batch_sizes, tf.int64)
        per_cycle = tf.reduce_sum(sizes)
        cycle, offset = position // per_cycle, position % per_cycle
        order = self.bucket_order(cycle, seed)
        ends = tf.cumsum(tf.gather(sizes, order))
        slot = tf.searchsorted(ends, offset[None], side="right")[0]
        return cycle * len(self.seq_lens) + tf.cast(slot, tf.int64), order[slot]

    def bucket_of_batch(self, batch, seed):
        """The bucket index (int32) of the stream's batch number `batch` (int64)."""
        count = len(self.seq_lens)
        return self.bucket_order(batch // count, seed)[batch % count]

    def first_position(self, batch, seed):
        """The stream position of batch `batch`'s first image (a Python int)."""
        count = len(self.seq_lens)
        cycle, slot = divmod(int(batch), count)
        order = self.bucket_order(tf.constant(cycle, tf.int64), seed).numpy()[:slot]
        return cycle * sum(self.batch_sizes) + sum(self.batch_sizes[i] for i in order)


def naflex_size(height, width, patch_size, max_num_patches):
    """`vit_keras.naflex_size` in TensorFlow ops: `(rows, cols)` int32 of an image's patch grid.

    The same float64 operations in the same order, so the binary search ends where
    transformers' and `vit_keras.naflex_size`'s end."""
    patch = tf.constant(float(patch_size), tf.float64)
    height, width = tf.cast(height, tf.float64), tf.cast(width, tf.float64)
    budget = tf.cast(max_num_patches, tf.float64)

    def scaled(scale, size):
        return tf.maximum(patch, tf.math.ceil(size * scale / patch) * patch)

    def halve(low, high):
        scale = (low + high) / 2
        fits = (scaled(scale, height) / patch) * (scaled(scale, width) / patch) <= budget
        return tf.where(fits, scale, low), tf.where(fits, high, scale)

    low, _ = tf.while_loop(lambda low, high: high - low >= SCALE_SEARCH_END, halve,
                           (tf.constant(SCALE_SEARCH_END / 10, tf.float64),
                            tf.constant(100.0, tf.float64)))
    return (tf.cast(scaled(low, height) / patch, tf.int32),
            tf.cast(scaled(low, width) / patch, tf.int32))


def naflex_example(image, patch_size, max_num_patches, length=None):
    """One image `(height, width, channels)` → its NaFlex patches, padded to `length` (default
    `max_num_patches`): `{"patches": float32 (length, P*P*C), "patch_coord": int32 (length, 2),
    "patch_valid": bool (length,)}`, as `vit_keras.naflex_patches` gives them."""
    length = max_num_patches if length is None else length
    image = tf.cast(image, tf.float32)
    channels = image.shape[-1]
    rows, cols = naflex_size(tf.shape(image)[0], tf.shape(image)[1], patch_size, max_num_patches)
    size = tf.stack([rows, cols]) * patch_size
    image = tf.cond(tf.reduce_all(tf.shape(image)[:2] == size), lambda: image,
                    lambda: tf.image.resize(image, size, method="bilinear", antialias=True))
    grid = tf.reshape(image, [rows, patch_size, cols, patch_size, channels])
    patches = tf.reshape(tf.transpose(grid, [0, 2, 1, 3, 4]),
                         [rows * cols, patch_size * patch_size * channels])
    count = rows * cols
    index = tf.range(count)
    coords = tf.stack([index // cols, index % cols], axis=-1)
    padding = length - count
    static = length if isinstance(length, int) else None  # a bucket's length is a tensor
    return {"patches": tf.ensure_shape(tf.pad(patches, [[0, padding], [0, 0]]),
                                       [static, patch_size * patch_size * channels]),
            "patch_coord": tf.ensure_shape(tf.pad(coords, [[0, padding], [0, 0]]), [static, 2]),
            "patch_valid": tf.range(length) < count}


def make_naflex_pipeline(splits, split, batching, *, training=False, batch_size=None,
                         augmentation=None, shuffle_buffer=10_000, seed=0, start_batch=0):
    """The `tf.data` input of one split for a NaFlex model: `(features, one-hot labels)`.

    Evaluation pipelines resize every image to `batching.max_num_patches`, pad to it, keep the
    order and every example once, in batches of `batch_size`. Training pipelines shuffle,
    repeat and augment as `data.make_pipeline` does (the inception crop's box and the flip, by
    stateless draws from `(seed, example index)`, then the NaFlex resize of the box), in the
    buckets of `batching` (`tokens_per_batch` needed): features `(tokens_per_batch // L, L, ...)`
    for the batch's length `L`. `start_batch=b` starts at the uninterrupted stream's batch `b`.
    RandAugment, MixUp and CutMix, per-batch layers of square images, are refused.
    """
    augmentation = augmentation or data.Augmentation()
    num_classes = splits.num_classes
    if batching.patch_size is None:
        raise ValueError("A NaFlex pipeline needs the model's patch_size in its NaFlexBatching.")

    def one_hot(label):
        return tf.one_hot(label, num_classes, dtype=tf.float32)

    if not training:
        if not batch_size or start_batch:
            raise ValueError("A NaFlex evaluation pipeline takes a batch_size and no start_batch.")

        def evaluate(image, label):
            return naflex_example(image, batching.patch_size, batching.max_num_patches), \
                one_hot(label)

        ds = splits.source(split).map(evaluate, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)

    if augmentation.randaugment or augmentation.mixup or augmentation.cutmix:
        raise ValueError("RandAugment, MixUp and CutMix act on batches of square images; a "
                         "NaFlex pipeline takes the crop and the flip only.")
    seq_lens = tf.constant(batching.seq_lens, tf.int32)
    sizes = tf.constant(batching.batch_sizes, tf.int64)
    start = batching.first_position(start_batch, seed)
    ds = data._training_stream(splits, split, shuffle_buffer, True, seed, start)

    def preprocess(position, index, image, label):
        batch, bucket = batching.batch_of(position, seed)
        crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(
            data._stream_seed(seed, data._AUGMENT, index), 2))
        image = data.inception_box(image, seed=crop_seed, area_range=tuple(augmentation.crop_area))
        image = tf.ensure_shape(image, [None, None, 3])  # the box's slice loses the channels
        if augmentation.flip:
            image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        length = seq_lens[bucket]
        return batch, naflex_example(image, batching.patch_size, length, length), one_hot(label)

    # The stream's images are counted from its start (`position`), after unreadable files are
    # dropped, so that each batch's images are consecutive and a window always fills.
    ds = ds.enumerate(start).map(lambda position, keyed: preprocess(position, keyed[0], *keyed[1]),
                                 num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.group_by_window(
        key_func=lambda batch, features, label: batch,
        reduce_func=lambda batch, window: window.batch(sizes[batching.bucket_of_batch(batch, seed)]),
        window_size_func=lambda batch: sizes[batching.bucket_of_batch(batch, seed)])
    ds = ds.map(lambda batch, features, labels: (features, labels))
    return ds.prefetch(tf.data.AUTOTUNE)


def load_image_files(paths, batching):
    """Image files for prediction by a NaFlex model: `{"patches", "patch_coord", "patch_valid"}`
    NumPy arrays `(len(paths), batching.max_num_patches, ...)`, each image at its own aspect
    ratio (`naflex_example`). Raises `ValueError` naming every file that does not decode
    (`data.decode_image_files`)."""
    examples = [naflex_example(image, batching.patch_size, batching.max_num_patches)
                for image in data.decode_image_files(paths)]
    return {key: tf.stack([example[key] for example in examples]).numpy()
            for key in examples[0]}
