"""Datasets and input pipelines: tfds names, image folders and scikit-learn's bundled digits.

Every pipeline is `tf.data` and feeds `model.fit` on all three Keras backends. Images come out as
float32 RGB pixels in [0, 255], shape `(batch, image_size, image_size, 3)`, and labels as one-hot
float32 `(batch, num_classes)`. Models from `vit_keras.build_model(..., include_preprocessing=True)`
rescale pixels to [-1, 1] (`(x - 127.5) / 127.5`, the original ViT weights' convention) in the graph,
so the pipeline never normalises.

This module imports TensorFlow; `vit_keras/__init__.py` does not import it (use `vit_keras.tools.data`).

    splits = load_splits("digits")                    # or "cifar10", "folder:/path/to/images"
    train = make_pipeline(splits, "train", image_size=16, batch_size=64, training=True)
    test = make_pipeline(splits, "test", image_size=16, batch_size=256)
"""

import dataclasses
import os
import socket
import threading

import numpy as np
import tensorflow as tf

SPLITS = ("train", "val", "test")
DIGITS = "digits"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")


class DatasetNotPreparedError(RuntimeError):
    """A tfds dataset is not in `data_dir` and cannot be downloaded (no network or not allowed)."""


@dataclasses.dataclass
class Splits:
    """A dataset's train/val/test sources before preprocessing.

    `source(split)` gives a `tf.data.Dataset` of `(image, label)`: `image` uint8
    `(height, width, 3)` (sizes may differ between images), `label` int32 scalar.
    """

    name: str
    class_names: list
    num_examples: dict            # split -> number of examples
    sources: dict                 # split -> callable returning the tf.data.Dataset
    notes: list = dataclasses.field(default_factory=list)  # what the loader decided or skipped

    @property
    def num_classes(self):
        return len(self.class_names)

    def source(self, split):
        if split not in self.sources:
            raise ValueError(f"Unknown split {split!r}; {self.name} has splits {sorted(self.sources)}.")
        return self.sources[split]()


def load_splits(dataset=DIGITS, *, data_dir=None, val_fraction=None, download=True, seed=0,
                log=print):
    """Resolves a `--dataset` value to its `Splits`.

    Args:
      dataset: `"digits"` (scikit-learn's bundled 8x8 digits, offline), `"folder:PATH"` (one
        sub-folder per class, optionally under `PATH/train`, `PATH/val`, `PATH/test`), or a tfds name
        (`"cifar10"`, `"oxford_iiit_pet"`, `"imagenet2012"`, ...).
      data_dir: tfds data directory (tfds' default `~/tensorflow_datasets` when None).
      val_fraction: fraction of the training images held out for validation where the dataset has
        no validation split of its own (default 0.1 for folders, 0.02 for tfds as vit_jax).
      download: whether a tfds dataset that is not prepared may be downloaded (needs the network).
      seed: seed of the held-out splits.
      log: where notes (skipped files, split choices) are printed.
    """
    if dataset == DIGITS:
        splits = digits_splits(seed=seed)
    elif dataset.startswith("folder:"):
        splits = folder_splits(dataset[len("folder:"):], val_fraction=val_fraction or 0.1,
                               seed=seed)
    else:
        splits = tfds_splits(dataset, data_dir=data_dir, val_fraction=val_fraction or 0.02,
                             download=download)
    for note in splits.notes:
        log(note)
    return splits


# --- scikit-learn digits ------------------------------------------------------------------------

def digits_arrays(seed=0):
    """The 1,797 digits as a fixed stratified split: 70% train, 10% val, 20% test.

    Returns `{split: (images, labels)}` with images uint8 `(n, 8, 8, 3)` (values 0..16 scaled to
    0..255, grey replicated to RGB) and labels int32 `(n,)`. The split depends only on `seed`.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype("uint8")
    images = np.repeat(images[..., None], 3, axis=-1)
    labels = digits.target.astype("int32")
    rest_x, test_x, rest_y, test_y = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=seed)
    train_x, val_x, train_y, val_y = train_test_split(
        rest_x, rest_y, test_size=0.125, stratify=rest_y, random_state=seed)
    return {"train": (train_x, train_y), "val": (val_x, val_y), "test": (test_x, test_y)}


def digits_splits(seed=0):
    arrays = digits_arrays(seed)

    def source(split):
        return lambda: tf.data.Dataset.from_tensor_slices(arrays[split])

    return Splits(DIGITS, [str(d) for d in range(10)],
                  {split: len(arrays[split][1]) for split in SPLITS},
                  {split: source(split) for split in SPLITS})


# --- image folders ------------------------------------------------------------------------------

def check_image(path):
    """`None` if PIL can decode the file as an image, else a one-line reason."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:  # verify() leaves the file unusable; load pixels once
            image.load()
    except Exception as error:  # PIL raises many types for bad files
        return f"{type(error).__name__}: {error}"
    return None


def scan_folder(path, class_names=None):
    """Lists `(file, label)` under `path/<class>/`, checking that each file decodes.

    Returns `(files, labels, class_names, bad)`, `bad` a list of `(file, reason)` for files that are
    not readable images; they are left out of `files`.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Image folder {path!r} does not exist; expected one sub-folder per "
                                f"class, e.g. {path}/cat/*.jpg, {path}/dog/*.jpg.")
    found = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    class_names = class_names or found
    if not class_names:
        raise ValueError(f"Image folder {path!r} has no class sub-folders; expected "
                         f"{path}/<class name>/<image files>.")
    files, labels, bad = [], [], []
    for label, name in enumerate(class_names):
        folder = os.path.join(path, name)
        if not os.path.isdir(folder):
            continue
        for file in sorted(os.listdir(folder)):
            full = os.path.join(folder, file)
            if not os.path.isfile(full):
                continue
            reason = check_image(full)
            if reason:
                bad.append((full, reason))
            else:
                files.append(full)
                labels.append(label)
    return files, labels, list(class_names), bad


def _decode(path, label):
    image = tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
    return image, label


def folder_splits(path, val_fraction=0.1, seed=0):
    """`PATH/train` + `PATH/val` (+ `PATH/test`), or one folder split into train and val.

    Files that do not decode are reported by name with a count and skipped. Without a test split,
    test metrics are computed on val (said in the notes).
    """
    path = os.path.abspath(os.path.expanduser(path))
    notes, split_files = [], {}
    if os.path.isdir(os.path.join(path, "train")):
        files, labels, class_names, bad = scan_folder(os.path.join(path, "train"))
        split_files["train"] = (files, labels)
        for split, folder in (("val", "val"), ("test", "test")):
            if os.path.isdir(os.path.join(path, folder)):
                split_paths, split_labels, _, unreadable = scan_folder(
                    os.path.join(path, folder), class_names)
                split_files[split] = (split_paths, split_labels)
                bad += unreadable
        if "val" not in split_files:
            split_files["train"], split_files["val"] = _hold_out(files, labels, val_fraction, seed)
            notes.append(f"{path}: no val/ folder; holding out {val_fraction:.0%} of train/ as val.")
    else:
        files, labels, class_names, bad = scan_folder(path)
        split_files["train"], split_files["val"] = _hold_out(files, labels, val_fraction, seed)
        notes.append(f"{path}: no train/ and val/ folders; holding out {val_fraction:.0%} of the "
                     f"images (stratified, seed {seed}) as val.")
    if "test" not in split_files:
        split_files["test"] = split_files["val"]
        notes.append(f"{path}: no test split; test metrics are computed on val.")
    if bad:
        notes.append(f"Skipped {len(bad)} unreadable file(s) in {path}:")
        notes.extend(f"  {file} ({reason})" for file, reason in bad)
    for split, (files, _) in split_files.items():
        if not files:
            raise ValueError(f"Image folder {path!r} has no readable images for the {split} split.")

    def source(split):
        files, labels = split_files[split]
        return lambda: tf.data.Dataset.from_tensor_slices(
            (tf.constant(files), tf.constant(labels, tf.int32))).map(
                _decode, num_parallel_calls=tf.data.AUTOTUNE)

    splits = Splits(f"folder:{path}", class_names,
                    {split: len(files) for split, (files, _) in split_files.items()},
                    {split: source(split) for split in split_files}, notes)
    splits.skipped_files = bad
    return splits


def _hold_out(files, labels, fraction, seed):
    """A stratified split of `(files, labels)` into `((train files, labels), (val files, labels))`."""
    rng = np.random.default_rng(seed)
    files, labels = np.asarray(files), np.asarray(labels, dtype="int32")
    val = np.zeros(len(files), bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        count = max(1, int(round(fraction * len(members)))) if len(members) > 1 else 0
        val[rng.permutation(members)[:count]] = True
    return ((files[~val].tolist(), labels[~val].tolist()),
            (files[val].tolist(), labels[val].tolist()))


# --- tfds ---------------------------------------------------------------------------------------

def network_reachable(host="storage.googleapis.com", port=443, timeout=3.0):
    """Whether a TCP connection to `host` opens within `timeout` seconds (DNS included)."""
    result = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result)


def tfds_splits(name, data_dir=None, val_fraction=0.02, download=True):
    """A tfds dataset as `Splits`, checking that it is prepared before anything is downloaded.

    Splits follow vit_jax: `train[:98%]` / `train[98%:]` / `test` where the dataset has no
    validation split; `train` / `validation` / `test` where it has both; ImageNet-style datasets
    without a test split evaluate on `validation` and hold out part of train as val.
    Raises `DatasetNotPreparedError` within seconds when the data is missing and cannot be fetched.
    """
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as error:
        raise ValueError(
            f"Unknown dataset {name!r}: {error}. Use 'digits', 'folder:PATH' or a tfds name such as "
            f"cifar10, cifar100, oxford_iiit_pet, oxford_flowers102.") from None
    where = data_dir or "~/tensorflow_datasets"
    if not builder.is_prepared():
        how = (f"Prepare it on a machine with network access with\n"
               f"    python -c \"import tensorflow_datasets as tfds; "
               f"tfds.builder('{name}', data_dir='{where}').download_and_prepare()\"\n"
               f"(or `tfds build {name} --data_dir DIR`) and copy DIR/{name} into {where}")
        if getattr(builder, "MANUAL_DOWNLOAD_INSTRUCTIONS", None):
            how += (f"; {name} needs a manual download first: put its files in "
                    f"{where}/downloads/manual (see the tfds catalog page for {name})")
        if not download:
            raise DatasetNotPreparedError(
                f"tfds dataset {name!r} is not prepared in {where} and downloading is off. {how}.")
        if not network_reachable():
            raise DatasetNotPreparedError(
                f"tfds dataset {name!r} is not prepared in {where} and the network is unreachable, "
                f"so it cannot be downloaded. {how}.")
        builder.download_and_prepare()
    available = set(builder.info.splits)
    if "test" in available:
        test = "test"
        if "validation" in available:
            train, val = "train", "validation"
        else:
            train, val = _train_holdout(val_fraction)
    elif "validation" in available:
        test = "validation"
        train, val = _train_holdout(val_fraction)
    else:
        raise ValueError(f"tfds dataset {name!r} has splits {sorted(available)}; expected train and "
                         f"test or validation.")
    chosen = {"train": train, "val": val, "test": test}
    label_feature = builder.info.features["label"]
    num_examples = {split: builder.info.splits[spec].num_examples for split, spec in chosen.items()}

    def source(spec):
        def load():
            ds = builder.as_dataset(split=spec, as_supervised=True, shuffle_files=False)
            return ds.map(_to_rgb, num_parallel_calls=tf.data.AUTOTUNE)
        return load

    notes = [f"{name}: splits train={train}, val={val}, test={test} (from {where})."]
    return Splits(name, list(label_feature.names), num_examples,
                  {split: source(spec) for split, spec in chosen.items()}, notes)


def _train_holdout(fraction):
    percent = max(1, int(round(fraction * 100)))
    return f"train[:{100 - percent}%]", f"train[{100 - percent}%:]"


def _to_rgb(image, label):
    if image.shape[-1] == 1:
        image = tf.image.grayscale_to_rgb(image)
    return image, tf.cast(label, tf.int32)


# --- preprocessing and augmentation -------------------------------------------------------------

def inception_crop(image, image_size, *, seed, area_range=(0.05, 1.0),
                   aspect_ratio_range=(3 / 4, 4 / 3)):
    """vit_jax's train-time crop: a random box covering `area_range` of the image with an aspect
    ratio in `aspect_ratio_range`, resized (bilinear) to `image_size`. Returns float32 [0, 255].

    `seed`: int `(2,)`; the box is a stateless draw, the same for the same seed."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image), bounding_boxes=tf.zeros([0, 0, 4]), seed=seed, area_range=area_range,
        aspect_ratio_range=aspect_ratio_range, min_object_covered=0.0,
        use_image_if_no_bounding_boxes=True)
    return resize(tf.slice(image, begin, size), image_size)


def resize(image, image_size):
    """Bilinear resize to `(image_size, image_size)`, float32 pixels in [0, 255]."""
    image = tf.image.resize(tf.cast(image, tf.float32), (image_size, image_size), method="bilinear")
    return tf.clip_by_value(image, 0.0, 255.0)


@dataclasses.dataclass
class Augmentation:
    """Train-time augmentation. Defaults are vit_jax's (inception crop, horizontal flip).

    `randaugment`: `(num_ops, magnitude in [0, 1])` or None; `mixup`: MixUp alpha (0: off);
    `cutmix`: CutMix factor (0: off). The last three are `keras.layers` applied per batch.
    """

    crop_area: tuple = (0.05, 1.0)
    flip: bool = True
    randaugment: tuple = None
    mixup: float = 0.0
    cutmix: float = 0.0


def make_pipeline(splits, split, *, image_size, batch_size, training=False, augmentation=None,
                  shuffle_buffer=10_000, repeat=None, drop_remainder=None, seed=0, start_batch=0):
    """The `tf.data` input of one split: `(images float32 (B, S, S, 3) in [0, 255], one-hot labels)`.

    Training pipelines shuffle, repeat forever, drop the last partial batch and augment;
    evaluation pipelines resize, keep every example once, and keep the order.

    A training stream is a pure function of `seed` and the example index `i` counted from the
    stream's start: pass `p = i // n` over the split's `n` examples is shuffled (`shuffle_buffer`
    at a time) with a seed drawn from `(seed, p)`, and example `i`'s crop and flip are stateless
    draws seeded by `(seed, i)`. Nothing depends on thread timing, on TensorFlow's global seed or
    on earlier iterations. `start_batch=b` starts the stream at its batch `b` (examples from
    `b * batch_size`): a run resumed after `e` epochs of `s` steps passes `e * s` and sees the
    batches the uninterrupted run would have; getting there reads, without augmenting, at most
    one pass. The exception: RandAugment, MixUp and CutMix (off by default) draw from their
    layers' own stateful `SeedGenerator`s in whatever order tf.data's parallel calls take, and a
    resumed run starts them again from their seed, so runs using them are not reproducible.
    """
    augmentation = augmentation or Augmentation()
    repeat = training if repeat is None else repeat
    drop_remainder = training if drop_remainder is None else drop_remainder
    num_classes = splits.num_classes
    if not training:
        if start_batch:
            raise ValueError(f"start_batch={start_batch} is for training streams; evaluation "
                             f"pipelines always start at the split's first example.")
        ds = splits.source(split)
    else:
        ds = _training_stream(splits, split, shuffle_buffer, repeat, seed, start_batch * batch_size)

    def preprocess(index, image, label):
        if training:
            crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(
                _stream_seed(seed, _AUGMENT, index), 2))
            image = inception_crop(image, image_size, seed=crop_seed,
                                   area_range=tuple(augmentation.crop_area))
            if augmentation.flip:
                image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        else:
            image = resize(image, image_size)
        image = tf.ensure_shape(image, (image_size, image_size, 3))
        return image, tf.one_hot(label, num_classes, dtype=tf.float32)

    if training:
        ds = ds.map(lambda index, example: preprocess(index, *example),
                    num_parallel_calls=tf.data.AUTOTUNE)
    else:
        ds = ds.map(lambda image, label: preprocess(None, image, label),
                    num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    if training:
        for layer in batch_augmentations(augmentation, seed):
            ds = ds.map(_apply_batch_layer(layer), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)


# Purposes of the stateless seeds drawn from (seed, purpose, index).
_ORDER, _AUGMENT = 1, 2
# Dataset.shuffle combines its seed with the graph-level seed; fixed inside the per-pass function
# (a graph of its own), it keeps the order independent of the caller's tf.random.set_seed.
_GRAPH_SEED = 0x5EED


def _stream_seed(seed, purpose, index):
    """A stateless seed, int64 `(2,)`, for `purpose` at `index` of the stream seeded by `seed`."""
    return tf.random.experimental.stateless_fold_in(tf.constant([seed, purpose], tf.int64), index)


def _training_stream(splits, split, shuffle_buffer, repeat, seed, start_example):
    """`(index int64, (image, label))` from example `start_example` of the shuffled passes."""
    count = max(1, splits.num_examples[split])
    buffer = min(shuffle_buffer, count)
    source = splits.source(split)  # built once, outside the traced function

    def one_pass(number):
        tf.random.set_seed(_GRAPH_SEED)  # in this traced function: its graph's seed alone
        order = tf.random.stateless_uniform([], _stream_seed(seed, _ORDER, number), minval=None,
                                            maxval=None, dtype=tf.int64)
        return source.shuffle(buffer, seed=order, reshuffle_each_iteration=False)

    first_pass = start_example // count if repeat else 0
    passes = tf.data.Dataset.counter(first_pass) if repeat else tf.data.Dataset.range(1)
    ds = passes.flat_map(one_pass).enumerate(first_pass * count)
    ds = ds.skip(start_example - first_pass * count)
    if repeat:
        ds = ds.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    return ds


def batch_augmentations(augmentation, seed=0):
    """The per-batch `keras.layers` (RandAugment, MixUp, CutMix) an `Augmentation` asks for.

    They compute in float32 whatever the global (mixed precision) policy: the pipeline's output is
    float32 pixels and labels."""
    import keras

    layers = []
    if augmentation.randaugment:
        num_ops, magnitude = augmentation.randaugment
        layers.append(keras.layers.RandAugment(value_range=(0, 255), num_ops=int(num_ops),
                                               factor=float(magnitude), seed=seed,
                                               dtype="float32"))
    if augmentation.mixup:
        layers.append(keras.layers.MixUp(alpha=float(augmentation.mixup), seed=seed,
                                         dtype="float32"))
    if augmentation.cutmix:
        layers.append(keras.layers.CutMix(factor=float(augmentation.cutmix), seed=seed,
                                          dtype="float32"))
    return layers


def _apply_batch_layer(layer):
    import keras

    # Clipped after every layer: MixUp's mean of two 255s can round to 255.00002.
    if isinstance(layer, (keras.layers.MixUp, keras.layers.CutMix)):
        def apply(images, labels):
            out = layer({"images": images, "labels": labels}, training=True)
            return _pixel_range(out["images"]), tf.cast(out["labels"], tf.float32)
    else:
        def apply(images, labels):
            return _pixel_range(layer(images, training=True)), labels
    return apply


def _pixel_range(images):
    return tf.clip_by_value(tf.cast(images, tf.float32), 0.0, 255.0)


def load_image_files(paths, image_size):
    """Reads image files for prediction: float32 `(n, image_size, image_size, 3)` in [0, 255].

    Raises `ValueError` naming every file that does not decode.
    """
    bad = [(path, check_image(path)) for path in paths]
    bad = [(path, reason) for path, reason in bad if reason]
    if bad:
        raise ValueError("Cannot read these image files: " +
                         "; ".join(f"{path} ({reason})" for path, reason in bad))
    images = [resize(_decode(tf.constant(path), 0)[0], image_size) for path in paths]
    return tf.stack(images).numpy()
