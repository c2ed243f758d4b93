"""Training callbacks: atomic checkpoint and backup (a killed run never leaves a truncated file),
NaN guard, throughput."""

import json
import os
import time

import keras
import numpy as np

from vit_keras.tools.run_folder import atomic_save_model, atomic_write_json


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
    """`BackupAndRestore` whose weights and metadata files are replaced atomically, so a SIGKILL
    while saving leaves the previous epoch's backup intact instead of a truncated file."""

    def __init__(self, backup_dir, **kwargs):
        super().__init__(backup_dir, double_checkpoint=False, **kwargs)

    guard = None  # a StopOnNaN: nothing is written once the loss is not finite

    def _save_model(self):
        if self.guard and self.guard.bad_step:
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        temporary = os.path.join(self.backup_dir, f"saving-{os.getpid()}.weights.h5")
        self.model.save_weights(temporary, overwrite=True)
        os.replace(temporary, self._weights_path)
        atomic_write_json({"epoch": self._current_epoch, "batch": self._last_batch_seen},
                          self._training_metadata_path)

    @property
    def resume_epoch(self):
        """The epoch a run in `backup_dir` resumes at (0: no backup)."""
        try:
            with open(self._training_metadata_path) as f:
                return int(json.load(f)["epoch"])
        except (OSError, ValueError, KeyError):
            return 0


class NonFiniteLossError(RuntimeError):
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
