"""Datasets and input pipelines: tfds names, image folders and scikit-learn's bundled digits.

Every pipeline is `tf.data` and feeds `model.fit` on all three Keras backends. Images come out as
float32 RGB pixels in [0, 255], shape `(batch, image_size, image_size, 3)`, and labels as one-hot
float32 `(batch, num_classes)`. Models from `vit_keras.build_model(..., include_preprocessing=True)`
normalise pixels in the graph as their weights were trained (`vit_keras.normalization`), so the
pipeline never normalises.

This module imports TensorFlow; `vit_keras/__init__.py` does not import it (use `vit_keras.tools.data`).

    splits = load_splits("digits")                    # or "cifar10", "folder:/path/to/images"
    train = make_pipeline(splits, "train", image_size=16, batch_size=64, training=True)
    test = make_pipeline(splits, "test", image_size=16, batch_size=256)
"""

import dataclasses
import json
import logging
import math
import os
import re
import socket
import threading

import numpy as np
import tensorflow as tf

from vit_keras import atomic_files, errors

SPLITS = ("train", "val", "test")
DIGITS = "digits"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")


logger = logging.getLogger("vit_keras")


class DatasetNotPreparedError(errors.UserError, RuntimeError):
    """A tfds dataset is not in `data_dir` and cannot be downloaded (no network or not allowed)."""


class TooFewClassesError(errors.UserError, ValueError):
    """An image folder whose usable images are of fewer than two classes: a classifier trained or
    scored on one class reports 100% accuracy whatever it learnt."""


@dataclasses.dataclass
class Splits:
    """A dataset's train/val/test sources before preprocessing.

    `source(split)` gives a `tf.data.Dataset` of `(image, label)`: `image` uint8
    `(height, width, 3)` (sizes may differ between images), `label` int32 scalar. For an image
    folder, `sources` give `(path, label)` and `source` decodes them (`UnreadableFiles.decode`),
    so that a training stream shuffles and skips file names, not decoded images.
    """

    name: str
    class_names: list
    num_examples: dict            # split -> number of examples (listed files, for a folder)
    sources: dict                 # split -> callable returning the undecoded tf.data.Dataset
    notes: list = dataclasses.field(default_factory=list)  # what the loader decided
    unreadable: "UnreadableFiles" = None  # image folders: the files skipped, by name
    files: dict = None            # image folders: split -> (paths, labels) as listed

    @property
    def num_classes(self):
        return len(self.class_names)

    def source(self, split):
        return self.decode(self.encoded_source(split))

    def encoded_source(self, split):
        """What `sources[split]` gives: `(path, label)` for a folder, else `(image, label)`."""
        if split not in self.sources:
            raise ValueError(f"Unknown split {split!r}; {self.name} has splits {sorted(self.sources)}.")
        return self.sources[split]()

    def decode(self, dataset, keyed=False):
        """`encoded_source` elements (with `keyed`, `(key, element)`) → `(image, label)` ones."""
        return dataset if self.unreadable is None else self.unreadable.decode(dataset, keyed)

    @property
    def skipped_files(self):
        """`[(path, reason)]` of the files skipped so far (image folders; else empty)."""
        return [] if self.unreadable is None else self.unreadable.items()

    def record_unreadable(self, path, resume=False, write=True):
        """Keeps the list of skipped files in `path` (`UnreadableFiles.record_to`); nothing for
        datasets that are not image folders."""
        if self.unreadable is not None:
            self.unreadable.record_to(path, resume=resume, write=write)

    def check_readable_classes(self):
        """Raises `TooFewClassesError` when the images of a split not skipped so far are of
        fewer than two classes (image folders; nothing for other datasets).

        A class whose files all turned out unreadable is known only once they are read: call it
        after a split has been read through (a run's final evaluation), before its result is
        kept. Files not read yet count as readable.
        """
        if self.files is None:
            return
        skipped = set(self.unreadable.paths())
        for split, (files, labels) in self.files.items():
            _require_two_classes(
                self.name[len("folder:"):], split, self.class_names,
                [label for file, label in zip(files, labels) if file not in skipped],
                f" ({len(skipped)} files skipped as unreadable, named above); replace or remove "
                f"the unreadable files, then start the run over (--overwrite)")


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
      log: where notes (split choices) and skipped files (as they are found) are printed.
    """
    if dataset == DIGITS:
        splits = digits_splits(seed=seed)
    elif dataset.startswith("folder:"):
        splits = folder_splits(dataset[len("folder:"):], val_fraction=val_fraction or 0.1,
                               seed=seed, log=log)
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

# The file names listed as images: what `tf.io.decode_image`, the one decoder of folder datasets,
# reads. Whether a listed file really is a readable image is known only when it is decoded.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp")
# The record of a run's unreadable files (`UnreadableFiles.record_to`): a header, then one JSON
# object per file and line, so that any name (a tab, a newline, a byte that is not UTF-8) reads
# back exactly. Records of earlier versions hold `path<TAB>reason` lines; they are still read.
_RECORD_HEADER = ('# Files of the image folder that were skipped, one JSON object per line: '
                  '{"path": ..., "reason": ...}. A resumed run skips the same ones.\n')
# Files named individually in the log; after that only the count and the record name them.
_LOGGED_FILES = 20
# Files decoded one after another in each of the decoder's parallel tasks: enough to make the cost
# of a task's small dataset negligible, few enough to keep every core busy from the first batch.
_FILES_PER_TASK = 32


def list_image_files(path, class_names=None):
    """Lists `path/<class>/<file>` without opening any file (`os.scandir`).

    Returns `(files, labels, class_names, skipped)`: `files` the paths with an image extension
    (`IMAGE_EXTENSIONS`, any case), sorted within each class; `labels` their class indices;
    `skipped` a list of `(path, reason)` for the files no pipeline can read, known from their
    name alone: another extension, a name that is not UTF-8 (TensorFlow's file names are UTF-8),
    a symbolic link that leads nowhere or in a loop, something that is not a regular file.
    Hidden files (`.name`) and sub-folders of a class folder are ignored.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Image folder {_shown(path)!r} does not exist; expected one "
                                f"sub-folder per class, e.g. {_shown(path)}/cat/*.jpg, "
                                f"{_shown(path)}/dog/*.jpg.")
    found = sorted(entry.name for entry in os.scandir(path) if _is_folder(entry))
    class_names = class_names or found
    if not class_names:
        raise TooFewClassesError(f"Image folder {_shown(path)!r} has no class sub-folders; "
                                 f"expected {_shown(path)}/<class name>/<image files>.")
    files, labels, skipped = [], [], []
    for label, name in enumerate(class_names):
        folder = os.path.join(path, name)
        if not os.path.isdir(folder):
            continue
        for entry in sorted(os.scandir(folder), key=lambda entry: entry.name):
            if entry.name.startswith("."):
                continue
            problem = _listing_problem(entry)
            if problem is None:
                files.append(entry.path)
                labels.append(label)
            elif problem is not _IGNORED:
                skipped.append((entry.path, problem))
    return files, labels, list(class_names), skipped


# `_listing_problem` of a class folder's entry that is left alone without a word: a sub-folder.
_IGNORED = "ignored"


def _is_folder(entry):
    """Whether a `os.scandir` entry is a folder; False for a link that loops or leads nowhere."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _listing_problem(entry):
    """Why the `os.scandir` entry of a class folder cannot be an image of it, seen without
    opening it (`None`: it is listed as one; `_IGNORED`: a sub-folder)."""
    try:
        if not entry.is_file():  # follows links: a link to a file is that file
            if entry.is_dir():
                return _IGNORED
            if entry.is_symlink():
                return "a symbolic link to nothing (its target does not exist)"
            return "not a regular file"
    except OSError as error:  # a link in a loop (ELOOP), ...
        return f"cannot be opened: {error.strerror or error}"
    try:
        entry.path.encode("utf-8")
    except UnicodeEncodeError:
        return ("its name is not UTF-8 (TensorFlow reads UTF-8 file names only); rename it")
    if not entry.name.lower().endswith(IMAGE_EXTENSIONS):
        return f"not an image file name (expected {', '.join(IMAGE_EXTENSIONS)})"
    return None


def _shown(path):
    """`path` as one line of text: a character that is not printable (a newline, a tab) as its
    Python escape (`\\n`, `\\t`), a byte that is not UTF-8 (kept by `os.fsdecode`) as `\\xNN`."""
    if path.isprintable():
        return path
    return "".join(char if char.isprintable()
                   else f"\\x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF
                   else repr(char)[1:-1] for char in path)


def decode_image_file(path):
    """Reads and decodes one image file with `tf.io.decode_image`, the decoder of every folder
    pipeline (JPEG, PNG, GIF's first frame, BMP, WebP): uint8 `(height, width, 3)`.

    Decoded with the file's own channels, then made RGB (grey repeated, alpha dropped, as
    `tf.io.decode_png(..., channels=3)` does): asked for 3 channels, the WebP decoder refuses an
    image with alpha."""
    image = tf.io.decode_image(tf.io.read_file(path), expand_animations=False)
    rgb = tf.cond(tf.shape(image)[-1] >= 3, lambda: image[..., :3],
                  lambda: tf.image.grayscale_to_rgb(image[..., :1]))
    return tf.ensure_shape(rgb, (None, None, 3))


def decode_error(path):
    """`None` if `decode_image_file(path)` succeeds, else its error as one line."""
    try:
        decode_image_file(path)
    except tf.errors.OpError as error:
        return _op_error_message(error)
    return None


def _op_error_message(error):
    """A TensorFlow op error's own sentence, without the function and op names around it."""
    message = error.message.split("\n")[0]
    if message.startswith("{{function_node"):
        message = message.split("}}", 1)[-1].strip()
    return message.split(" [Op:")[0].strip() or type(error).__name__


class UnreadableFiles:
    """The files of an image folder that could not be used, by name, each with its reason.

    Files are added when the folder is listed (a name without an image extension) and when a
    pipeline reads them and the decoder refuses them (empty, truncated, another format behind an
    image extension): where they are read, never before. Safe to add to from tf.data's threads.
    `record_to` keeps the list in a file as it grows, so it survives a killed run and a resumed
    run skips the same files.
    """

    def __init__(self, log=print):
        self._reasons = {}
        self._lock = threading.Lock()
        self._log = log
        self._record = None

    def __len__(self):
        return len(self._reasons)

    def items(self):
        """`[(path, reason)]`, sorted by path."""
        with self._lock:
            return sorted(self._reasons.items())

    def paths(self):
        return [path for path, _ in self.items()]

    def add(self, path, reason):
        """Adds a file (once): logs it, and appends it to the record file if there is one."""
        with self._lock:
            if path in self._reasons:
                return
            self._reasons[path] = reason
            count = len(self._reasons)
            if self._record:
                with open(self._record, "a", encoding="utf-8") as f:
                    f.write(_record_line(path, reason))
        if count <= _LOGGED_FILES:
            self._log(f"Skipped {_shown(path)}: {reason.rstrip('.')}.")
        elif count == _LOGGED_FILES + 1:
            self._log(f"Skipped more than {_LOGGED_FILES} files; the others are counted, not "
                      f"logged" + (f", and listed in {self._record}." if self._record else "."))

    def record_to(self, path, resume=False, write=True):
        """Keeps the list in the file `path` (a run folder's `skipped_files.txt`).

        Args:
          path: the record file.
          resume: take the files already in `path` as unreadable (a resumed run: the training
            stream then skips them without reading them, so it stays exact); otherwise the run
            starts afresh and an old record is replaced.
          write: whether to write the file (several processes: only the first one writes).
        """
        recorded = read_unreadable_record(path) if resume else []
        with self._lock:
            for file, reason in recorded:
                self._reasons.setdefault(file, reason)
            self._record = path if write else None
            if write:
                with atomic_files.replacing(path) as temporary, open(
                        temporary, "w", encoding="utf-8") as f:
                    f.write(_RECORD_HEADER)
                    f.writelines(_record_line(file, reason) for file, reason in
                                 sorted(self._reasons.items()))

    def summary(self):
        """One line with the count and where the list is, or `None` when nothing was skipped."""
        count = len(self)
        if not count:
            return None
        names = ", ".join(map(_shown, self.paths()[:3])) + (", ..." if count > 3 else "")
        where = f"; the list is in {self._record}" if self._record else ""
        return f"Skipped {count} unreadable file(s): {names}{where}."

    def note_refused(self, paths):
        """The failure path of `decode`: names the files the decoder refused, each with the
        decoder's own error (decoding it again here). Returns True."""
        for path in paths.numpy() if hasattr(paths, "numpy") else paths:
            path = path.decode("utf-8") if isinstance(path, bytes) else str(path)  # listed: UTF-8
            try:
                reason = decode_error(path) or "refused by the decoder while reading"
            except Exception as error:  # naming a file must never stop the run
                reason = f"{type(error).__name__}: {error}"
            self.add(path, reason)
        return True

    def decode(self, dataset, keyed=False):
        """Decodes a folder pipeline's `(path, label)` elements (or `(key, (path, label))` with
        `keyed`), in parallel and in order, into `(image uint8 (H, W, 3), label)` (or
        `(key, (image, label))`); files the decoder refuses are left out and added here.

        The files go in tasks of `_FILES_PER_TASK`, decoded side by side by `interleave`: within
        a task, `ignore_errors` drops a file the decoder refuses, and the gap it leaves in the
        task's positions names it (a `tf.py_function` on that path only).
        """
        if keyed:  # flat tuples through the tasks: nested ones cost measurably per image
            dataset = dataset.map(lambda key, example: (key, *example))
        dataset = dataset.batch(_FILES_PER_TASK).interleave(
            self._decode_task, cycle_length=tf.data.AUTOTUNE, block_length=_FILES_PER_TASK,
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if keyed:
            dataset = dataset.map(lambda key, image, label: (key, (image, label)))
        return dataset

    def _decode_task(self, *batch):
        """`(*keys, paths, labels)`, each `(n,)` → the dataset of their `(*key, image, label)` in
        order, without the files the decoder refuses, which are named."""
        paths, labels = batch[-2:]
        count = tf.size(paths)

        def read(position, *element):
            return (position, *element[:-2], decode_image_file(element[-2]), element[-1])

        decoded = tf.data.Dataset.from_tensor_slices((tf.range(count), *batch)).map(
            read).ignore_errors()
        # A last element at position `count` (label -1) closes a gap at the task's end.
        end = tf.data.Dataset.from_tensors(
            (count, *[tf.zeros([], keys.dtype) for keys in batch[:-2]],
             tf.zeros([0, 0, 3], tf.uint8), tf.constant(-1, labels.dtype)))

        def name_refused(expected, element):
            position = element[0]
            noted = tf.cond(position > expected,
                            lambda: tf.py_function(self.note_refused,
                                                   [paths[expected:position]], tf.bool),
                            lambda: tf.constant(True))
            with tf.control_dependencies([noted]):
                return position + 1, element[1:]

        return decoded.concatenate(end).scan(tf.constant(0), name_refused).filter(
            lambda *element: element[-1] >= 0)

    def without_known(self, dataset):
        """Drops the keyed `(key, (path, label))` elements whose file is already known to be
        unreadable, without reading them; returns `(dataset, True)`, or `(dataset, False)` when
        none is known."""
        known = [path for path in self.paths() if _is_utf8(path)]  # others were never listed
        if not known:
            return dataset, False
        table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            tf.constant(known), tf.ones(len(known), tf.int32)), default_value=0)
        return dataset.filter(lambda key, example: table.lookup(example[0]) == 0), True


def _is_utf8(path):
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _record_line(path, reason):
    """One line of the record: `{"path": ..., "reason": ...}` in JSON. A byte of a name that is
    not UTF-8 (a lone surrogate, from `os.fsdecode`) is written as its `\\uDCxx` escape, which
    `json.loads` reads back as the same character."""
    line = json.dumps({"path": path, "reason": reason}, ensure_ascii=False)
    return re.sub("[\ud800-\udfff]", lambda match: f"\\u{ord(match.group()):04x}", line) + "\n"


def read_unreadable_record(path):
    """`[(path, reason)]` from a record written by `UnreadableFiles.record_to` (empty when the
    file does not exist), or by an earlier version (`path<TAB>reason` lines)."""
    if not os.path.exists(path):
        return []
    entries = []
    with open(path, encoding="utf-8", newline="\n") as f:
        for line in f:
            line = line[:-1] if line.endswith("\n") else line
            if line.startswith("{"):
                try:
                    entry = json.loads(line)
                    entries.append((entry["path"], entry["reason"]))
                except (ValueError, KeyError, TypeError):
                    pass  # a line cut short by a killed run
            elif not line.startswith("#") and "\t" in line:  # an earlier version's record
                entries.append(tuple(line.split("\t", 1)))
    return entries


def folder_splits(path, val_fraction=0.1, seed=0, log=print):
    """`PATH/train` + `PATH/val` (+ `PATH/test`), or one folder split into train and val.

    Only lists the files: nothing is opened until a pipeline reads it. Files the decoder refuses
    are skipped where they are read and named in `Splits.unreadable` (and by `log`), as are files
    no pipeline can read by their name (`list_image_files`). Without a test split, test metrics
    are computed on val (said in the notes).

    Raises `TooFewClassesError` when the training images are of fewer than two classes; a class
    folder without image files is kept as a class (its index stays), with a warning on the
    `vit_keras` logger. `Splits.check_readable_classes` checks the same once files have been read.
    """
    path = os.path.abspath(os.path.expanduser(path))
    notes, split_files = [], {}
    if os.path.isdir(os.path.join(path, "train")):
        files, labels, class_names, skipped = list_image_files(os.path.join(path, "train"))
        split_files["train"] = (files, labels)
        for split, folder in (("val", "val"), ("test", "test")):
            if os.path.isdir(os.path.join(path, folder)):
                split_paths, split_labels, _, not_images = list_image_files(
                    os.path.join(path, folder), class_names)
                split_files[split] = (split_paths, split_labels)
                skipped += not_images
        if "val" not in split_files:
            split_files["train"], split_files["val"] = _hold_out(files, labels, val_fraction, seed)
            notes.append(f"{path}: no val/ folder; holding out {val_fraction:.0%} of train/ as val.")
    else:
        files, labels, class_names, skipped = list_image_files(path)
        split_files["train"], split_files["val"] = _hold_out(files, labels, val_fraction, seed)
        notes.append(f"{path}: no train/ and val/ folders; holding out {val_fraction:.0%} of the "
                     f"images (stratified, seed {seed}) as val.")
    if "test" not in split_files:
        split_files["test"] = split_files["val"]
        notes.append(f"{path}: no test split; test metrics are computed on val.")
    for split, (files, _) in split_files.items():
        if not files:
            raise ValueError(f"Image folder {path!r} has no image files ({', '.join(IMAGE_EXTENSIONS)}) "
                             f"for the {split} split.")
    _check_classes(path, class_names, split_files)
    notes.append(f"{path}: {len(class_names)} classes, "
                 + ", ".join(f"{len(files)} {split}" for split, (files, _) in split_files.items())
                 + " image files (decoded as they are read; unreadable ones are skipped and named).")
    unreadable = UnreadableFiles(log=log)

    def source(split):
        files, labels = split_files[split]
        return lambda: tf.data.Dataset.from_tensor_slices(
            (tf.constant(files), tf.constant(labels, tf.int32)))

    splits = Splits(f"folder:{path}", class_names,
                    {split: len(files) for split, (files, _) in split_files.items()},
                    {split: source(split) for split in split_files}, notes, unreadable=unreadable,
                    files=split_files)
    for file, reason in skipped:
        unreadable.add(file, reason)
    return splits


def _check_classes(path, class_names, split_files):
    """Refuses a split whose image files are of fewer than two classes; warns of a class without
    training images."""
    for split, (_, labels) in split_files.items():
        _require_two_classes(path, split, class_names, labels,
                             f" (class folders: {', '.join(map(_shown, class_names))})")
    counts = np.bincount(np.asarray(split_files["train"][1], dtype="int64"),
                         minlength=len(class_names))
    for index, (name, count) in enumerate(zip(class_names, counts)):
        if not count:
            logger.warning("%s has no image files: it stays class %d of %d, but no training "
                           "image is of it.", _shown(os.path.join(path, name)), index,
                           len(class_names))


def _require_two_classes(path, split, class_names, labels, more):
    """Raises `TooFewClassesError` when `labels` (a split's usable images) hold fewer than two
    classes; `more` ends the error's first sentence."""
    present = sorted(set(int(label) for label in labels))
    if len(present) >= 2:
        return
    found = f"of class {_shown(class_names[present[0]])!r} only" if present else "of no class"
    raise TooFewClassesError(
        f"Image folder {_shown(path)!r}: the {split} split's usable image files are {found}"
        f"{more}. A classifier needs images of at least two classes in every split (a class "
        f"per sub-folder), or it scores 100% whatever it learnt.")


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
    return resize(inception_box(image, seed=seed, area_range=area_range,
                                aspect_ratio_range=aspect_ratio_range), image_size)


def inception_box(image, *, seed, area_range=(0.05, 1.0), aspect_ratio_range=(3 / 4, 4 / 3)):
    """The part of `image` `(height, width, channels)` that `inception_crop` resizes, at its own
    size: NaFlex pipelines resize it to a patch budget instead of a square."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image), bounding_boxes=tf.zeros([0, 0, 4]), seed=seed, area_range=area_range,
        aspect_ratio_range=aspect_ratio_range, min_object_covered=0.0,
        use_image_if_no_bounding_boxes=True)
    return tf.slice(image, begin, size)


def resize(image, image_size):
    """Bilinear resize to `(image_size, image_size)`, float32 pixels in [0, 255]."""
    image = tf.image.resize(tf.cast(image, tf.float32), (image_size, image_size), method="bilinear")
    return tf.clip_by_value(image, 0.0, 255.0)


def eval_resize(image, image_size, eval_crop=None):
    """A model's evaluation transform (`ViT.eval_crop`), float32 `(image_size, image_size, 3)`
    in [0, 255]: `resize` for None; for `(crop_fraction, interpolation)` timm's (its
    `resolve_data_config` + `create_transform`): the shorter side resized to
    `floor(image_size / crop_fraction)`, the longer in proportion (truncated, as torchvision's
    `Resize` does), antialiased as PIL resamples, then the centre `image_size` square (offsets
    rounded half to even, as torchvision's `CenterCrop` rounds them; down with a third item
    `"floor"`, as transformers' image processors crop)."""
    if eval_crop is None:
        return resize(image, image_size)
    fraction, interpolation, *centre = eval_crop
    scale = int(math.floor(image_size / fraction))
    height, width = tf.unstack(tf.shape(image, out_type=tf.int64)[:2])
    short, long = tf.minimum(height, width), tf.maximum(height, width)
    longer = scale * long // short
    size = tf.where(height <= width, tf.stack([scale, longer]), tf.stack([longer, scale]))
    image = tf.image.resize(tf.cast(image, tf.float32), tf.cast(size, tf.int32),
                            method=interpolation, antialias=True)
    margins = tf.cast(size - image_size, tf.float32) / 2
    top, left = tf.unstack(tf.cast(tf.floor(margins) if centre else tf.round(margins), tf.int32))
    image = tf.image.crop_to_bounding_box(image, top, left, image_size, image_size)
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
                  shuffle_buffer=10_000, repeat=None, drop_remainder=None, seed=0, start_batch=0,
                  eval_crop=None):
    """The `tf.data` input of one split: `(images float32 (B, S, S, 3) in [0, 255], one-hot labels)`.

    Training pipelines shuffle, repeat forever, drop the last partial batch and augment;
    evaluation pipelines bring each image to the size by `eval_resize(..., eval_crop)` (None:
    resize), keep every example once, and keep the order.

    A training stream is a pure function of `seed` and the example index `i` counted from the
    stream's start: pass `p = i // n` over the split's `n` examples is shuffled (`shuffle_buffer`
    at a time) with a seed drawn from `(seed, p)`, and example `i`'s crop and flip are stateless
    draws seeded by `(seed, i)`. Nothing depends on thread timing, on TensorFlow's global seed or
    on earlier iterations. `start_batch=b` starts the stream at its batch `b` (examples from
    `b * batch_size`): a run resumed after `e` epochs of `s` steps passes `e * s` and sees the
    batches the uninterrupted run would have; getting there reads, without augmenting, at most
    one pass (an image folder's: file names only, no image). An image folder's unreadable files
    keep their index `i` and are left out of the batches; a resumed run stays exact when it
    knows the ones already met (`Splits.record_unreadable(..., resume=True)`).
    The exception: RandAugment, MixUp and CutMix (off by default) draw from their
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
            image = eval_resize(image, image_size, eval_crop)
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
    """`(index int64, (image, label))` from example `start_example` of the shuffled passes.

    An image folder's passes shuffle file names and decode after `skip`, so getting to
    `start_example` reads no image. Its unreadable files are dropped where they are read, after
    the index is counted; a resumed run drops those it already knows before `skip`, so that
    `start_example` counts the same usable examples as the uninterrupted run did.
    """
    count = max(1, splits.num_examples[split])
    buffer = min(shuffle_buffer, count)
    source = splits.encoded_source(split)  # built once, outside the traced function

    def one_pass(number):
        tf.random.set_seed(_GRAPH_SEED)  # in this traced function: its graph's seed alone
        order = tf.random.stateless_uniform([], _stream_seed(seed, _ORDER, number), minval=None,
                                            maxval=None, dtype=tf.int64)
        return source.shuffle(buffer, seed=order, reshuffle_each_iteration=False)

    usable, dropping_known = count, False
    passes = tf.data.Dataset.counter(0) if repeat else tf.data.Dataset.range(1)
    if start_example and splits.unreadable is not None:
        known, dropping_known = splits.unreadable.without_known(source.enumerate())
        if dropping_known:  # the usable examples of a pass: reads file names, no image
            usable = max(1, int(known.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1)))
    first_pass = start_example // usable if repeat else 0
    passes = tf.data.Dataset.counter(first_pass) if repeat else tf.data.Dataset.range(1)
    ds = passes.flat_map(one_pass).enumerate(first_pass * count)
    if dropping_known:
        ds, _ = splits.unreadable.without_known(ds)
    ds = ds.skip(start_example - first_pass * usable)
    ds = splits.decode(ds, keyed=True)
    if repeat:
        ds = ds.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    return ds


def batch_augmentations(augmentation, seed=0):
    """The per-batch `keras.layers` (RandAugment, MixUp, CutMix) an `Augmentation` asks for
    (RandAugment: `rand_augment.RandAugment`, Keras' with an equalisation that traces small).

    They compute in float32 whatever the global (mixed precision) policy: the pipeline's output is
    float32 pixels and labels."""
    import keras

    from vit_keras.tools.data import rand_augment

    layers = []
    if augmentation.randaugment:
        num_ops, magnitude = augmentation.randaugment
        layers.append(rand_augment.RandAugment(value_range=(0, 255), num_ops=int(num_ops),
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


def load_image_files(paths, image_size, eval_crop=None):
    """Reads image files for prediction: float32 `(n, image_size, image_size, 3)` in [0, 255],
    through the model's evaluation transform `eval_crop` (`eval_resize`; None: resized).

    Decodes with `decode_image_file`, the decoder of the folder pipelines. Raises `ValueError`
    naming every file that does not decode (a name that is not UTF-8 is named with `\\xNN`
    escapes, and refused as in image folders).
    """
    return tf.stack([eval_resize(image, image_size, eval_crop)
                     for image in decode_image_files(paths)]).numpy()


def decode_image_files(paths):
    """Each of `paths` decoded by `decode_image_file`: uint8 `(height, width, 3)` tensors at
    their own sizes. Raises `ValueError` naming every file that does not decode (a name that is
    not UTF-8 is named with `\\xNN` escapes, and refused as in image folders)."""
    images, bad = [], []
    for path in paths:
        if not _is_utf8(path):
            bad.append(f"{_shown(path)} (its name is not UTF-8, which TensorFlow's file names "
                       f"are; rename it)")
            continue
        try:
            images.append(decode_image_file(path))
        except tf.errors.OpError as error:
            bad.append(f"{_shown(path)} ({_op_error_message(error)})")
    if bad:
        raise ValueError(f"Cannot read {len(bad)} of the {len(paths)} image files: "
                         + "; ".join(bad) + ".")
    return images
