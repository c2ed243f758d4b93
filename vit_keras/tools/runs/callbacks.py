"""Training callbacks: atomic checkpoint and backup (a killed run never leaves a truncated file),
NaN guard, throughput."""

import hashlib
import os
import re
import shutil
import time

import keras
import numpy as np

from vit_keras import errors
from vit_keras.tools.distributed import sharded_checkpoint
from vit_keras.tools.runs.run_folder import atomic_save_model, atomic_write_json, read_json, writing

# The backups a run writes (`epoch-N.weights.h5` and Keras' `latest.weights.h5`: earlier
# versions'). A training_metadata.json naming anything else is refused: the run would load that
# file, and delete it at the next epoch as its stale backup.
_BACKUP_NAME = re.compile(r"epoch-\d+(\.keras|\.orbax|\.weights\.h5)|latest\.weights\.h5")


class AtomicModelCheckpoint(keras.callbacks.Callback):
    """Writes the whole model to `path` (a `.keras` file) at the end of every epoch, atomically."""

    def __init__(self, path):
        super().__init__()
        if not path.endswith(".keras"):
            raise ValueError(f"AtomicModelCheckpoint writes a .keras file; got {path!r}.")
        self.path = path

    guard = None  # a StopOnNaN: nothing is written once the loss is not finite

    def on_epoch_end(self, epoch, logs=None):
        if not (self.guard and self.guard.bad_step):
            atomic_save_model(self.model, self.path)


class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`BackupAndRestore` that commits each epoch's backup atomically and resumes a run exactly.

    A backup is `epoch-N.keras` (the model with its optimizer state, read back with
    `load_weights`; a `.keras` file, not a `.weights.h5` one, because h5py writing a file itself
    crashes the process when the disk fills, see `run_folder.atomic_save_model`) and
    `training_metadata.json`, which names that file and holds the states of the
    model's `SeedGenerator`s (dropout, drop path): they are in `model.variables` but not in
    `model.weights`, so without them a resumed run would replay the first epoch's dropout masks.
    The JSON is replaced last, with `os.replace`: a SIGKILL at any moment leaves either the
    previous backup or the new one, never weights of one epoch with the epoch count of another,
    nor a truncated file. It also records the SHA-256 of each file of the backup, checked before
    the backup is loaded: a damaged file is refused (`errors.CheckpointError`, naming it), and
    so is a metadata file naming anything but a backup of this folder.

    On torch, Keras' `Dropout` without a seed draws from torch's global generator (torch cannot
    seed its fused dropout), and so does the `DataLoader` Keras wraps the input in, each time it
    creates an iterator: once per `fit` for a repeated `tf.data` stream, once per epoch for
    arrays, so a resumed `fit` makes a draw the uninterrupted one did not. The callback therefore
    seeds that generator from `(seed, epoch)` at each epoch's first step.

    With `delete_checkpoint=False` (Keras' argument) the backup outlives `fit`: the training run
    deletes it once its final metrics are written, and `restore` loads it into a model without
    training, for a run killed between its last epoch and its final evaluation.

    With several processes, saving is a collective operation on JAX (every process must take
    part) but only one process may write the shared `backup_dir`: the others pass a private
    `save_dir`, which takes their writes and is deleted at the end; every process resumes from
    `backup_dir`.

    With `sharded=True` (what `Distribution.sharded_backup` says of an fsdp run, JAX) the
    weights are never gathered: each backup is an Orbax checkpoint `epoch-N.orbax`
    (`sharded_checkpoint`) in `backup_dir`, to which every process writes its own devices'
    shards, and which is read back onto whatever mesh the resumed run has. The metadata is
    written once the checkpoint is committed on every process, by the process whose `save_dir`
    is `backup_dir`.
    """

    def __init__(self, backup_dir, seed=0, save_dir=None, sharded=False, **kwargs):
        super().__init__(backup_dir, double_checkpoint=False, **kwargs)
        self.seed = seed
        self.save_dir = save_dir or backup_dir
        self.sharded = sharded

    guard = None  # a StopOnNaN: nothing is written once the loss is not finite

    def _save_model(self):
        if self.guard and self.guard.bad_step:
            return
        os.makedirs(self.save_dir, exist_ok=True)
        metadata_path = os.path.join(self.save_dir, "training_metadata.json")
        previous = read_json(metadata_path)
        if self.sharded:
            name = f"epoch-{self._current_epoch}{sharded_checkpoint.SUFFIX}"
            path = os.path.join(self.backup_dir, name)
            with writing(path):  # a full disk: one line
                sharded_checkpoint.save(self.model, path)
        else:
            name = f"epoch-{self._current_epoch}.keras"
            path = os.path.join(self.save_dir, name)
            atomic_save_model(self.model, path)
        metadata = {"epoch": self._current_epoch, "batch": self._last_batch_seen,
                    "weights": name, "seed_generators": seed_generator_states(self.model)}
        if self.save_dir == self.backup_dir:  # the metadata a resumed run reads
            metadata["digests"] = file_digests(path)
        atomic_write_json(metadata, metadata_path)
        stale = _backup_name(previous)
        if stale is None or stale == name:
            return
        stale = os.path.join(self.save_dir, stale)
        if os.path.isdir(stale) and not os.path.islink(stale):
            shutil.rmtree(stale)
        elif os.path.exists(stale):
            os.remove(stale)

    def on_train_end(self, logs=None):
        if self.save_dir == self.backup_dir:
            super().on_train_end(logs)
        elif os.path.exists(self.save_dir):  # the chief deletes the shared backup
            shutil.rmtree(self.save_dir)

    def _load_model(self):
        metadata = self._read_metadata()
        if metadata is None:
            return
        self._weights_path = self._backup_path(metadata)
        if not os.path.exists(self._weights_path):  # Keras would resume from fresh weights
            raise FileNotFoundError(
                f"The backup in {self.backup_dir} is of epoch {metadata.get('epoch')} but its "
                f"weights file {self._weights_path} is missing; delete {self.backup_dir} to "
                f"start the run afresh.")
        sharded = self._weights_path.endswith(sharded_checkpoint.SUFFIX)
        # A .keras backup of an earlier version, without digests, has its zip's CRCs.
        if sharded or "digests" in metadata:
            self._check_digests(metadata.get("digests"))
        if sharded:
            sharded_checkpoint.restore(self.model, self._weights_path)
            self.model._initial_epoch = int(metadata["epoch"])  # pylint: disable=protected-access
        else:
            super()._load_model()
        if "seed_generators" in metadata:
            set_seed_generator_states(self.model, metadata["seed_generators"])

    def _backup_path(self, metadata):
        """The backup file (or Orbax folder) `metadata` names, in `backup_dir`."""
        name = _backup_name(metadata)
        if name is None:
            named = metadata.get("weights") if isinstance(metadata, dict) else metadata
            raise errors.CheckpointError(
                f"{self._training_metadata_path} names {named!r} as its backup, which is not a "
                f"backup name a run writes (epoch-N.keras or epoch-N.orbax, in "
                f"{self.backup_dir}): delete {self.backup_dir} to start the run afresh.")
        return os.path.join(self.backup_dir, name)

    def _check_digests(self, digests):
        """`errors.CheckpointError` naming the first file of the backup that is not as it was
        committed: changed, missing, or added."""
        if not isinstance(digests, dict):
            raise errors.CheckpointError(
                f"{self._training_metadata_path} records no digests of its backup's files "
                f"(an earlier vit_keras wrote it), so {self._weights_path} cannot be checked: "
                f"delete {self.backup_dir} to start the run afresh.")
        found = file_digests(self._weights_path)
        for name in sorted({*digests, *found}):
            if digests.get(name) != found.get(name):
                change = ("is missing" if name not in found else "was added" if name not in
                          digests else "has changed")
                raise errors.CheckpointError(
                    f"The backup file {os.path.join(self.backup_dir, name)} {change} since the "
                    f"backup was written (training_metadata.json records each file's SHA-256): "
                    f"the backup is damaged; delete {self.backup_dir} to start the run afresh.")

    def restore(self, model):
        """Loads the backup into `model` (built and compiled as the run that wrote it) without
        training: for a run whose training ended before its final evaluation."""
        self.set_model(model)
        self._load_model()
        return model

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0 and keras.backend.backend() == "torch":
            import torch

            # After the first batch is fetched: after any iterator the epoch created.
            seed = np.random.SeedSequence([self.seed, self._epoch]).generate_state(1)[0]
            torch.manual_seed(int(seed))

    def _read_metadata(self):
        return read_json(self._training_metadata_path)

    @property
    def checkpoint_path(self):
        """The path of the backup a resumed run loads (a `.keras` file or an Orbax folder), or
        None before the first backup."""
        metadata = self._read_metadata()
        return None if metadata is None else self._backup_path(metadata)

    @property
    def resume_epoch(self):
        """The epoch a run in `backup_dir` resumes at (0: no backup)."""
        try:
            return int(self._read_metadata()["epoch"])
        except (TypeError, KeyError, ValueError):
            return 0


def _backup_name(metadata):
    """The backup a training_metadata.json names, or None when it names no backup a run writes
    (a path, another file's name)."""
    if not isinstance(metadata, dict):
        return None
    name = metadata.get("weights", "latest.weights.h5")  # Keras' own, before it was named
    return name if isinstance(name, str) and _BACKUP_NAME.fullmatch(name) else None


def file_digests(path):
    """`{name: SHA-256 in hex}` of the file `path`, or of each file below the folder `path`,
    named relative to the folder `path` is in (`epoch-2.orbax/manifest.ocdbt`)."""
    files = [path] if not os.path.isdir(path) else [
        os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    digests = {}
    for file in sorted(files):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digests[os.path.relpath(file, os.path.dirname(path))] = digest.hexdigest()
    return digests


def _seed_generator_variables(model):
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def seed_generator_states(model):
    """`[[variable path, [ints]], ...]`: the states of `model`'s `SeedGenerator`s, in order."""
    return [[v.path, np.asarray(keras.ops.convert_to_numpy(v)).tolist()]
            for v in _seed_generator_variables(model)]


def set_seed_generator_states(model, states):
    """Restores what `seed_generator_states` returned, by position: the variables' paths carry a
    per-process counter."""
    variables = _seed_generator_variables(model)
    if len(variables) != len(states):
        raise ValueError(f"The backup holds {len(states)} random-generator states but the model "
                         f"has {len(variables)}: it was built with other dropout or drop-path "
                         f"settings than the run that wrote the backup.")
    for variable, (_, values) in zip(variables, states):
        variable.assign(np.asarray(values, dtype=variable.dtype))


class NonFiniteLossError(errors.UserError, RuntimeError):
    """Training produced a NaN or infinite loss."""


class StopOnNaN(keras.callbacks.Callback):
    """Stops training at the first batch whose loss is NaN or infinite and records where.

    `run` turns this into `NonFiniteLossError` with a message that says what to change.
    """

    def __init__(self):
        super().__init__()
        self.bad_step = None

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(float(loss)):
            self.bad_step = (self._epoch, batch, float(loss))
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


class Throughput(keras.callbacks.Callback):
    """Measures training images/s per epoch (the first epoch includes compilation)."""

    def __init__(self, batch_size, steps_per_epoch):
        super().__init__()
        self.images_per_epoch = batch_size * steps_per_epoch
        self.epoch_seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._last = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        # Up to the last training batch: validation time is not training throughput.
        self.epoch_seconds.append(getattr(self, "_last", time.perf_counter()) - self._start)

    def images_per_second(self):
        """Steady state: epochs after the first when there are some."""
        seconds = self.epoch_seconds[1:] or self.epoch_seconds
        return self.images_per_epoch * len(seconds) / sum(seconds) if seconds else None
