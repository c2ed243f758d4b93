"""Training callbacks: atomic checkpoint and backup (a killed run never leaves a truncated file),
NaN guard, throughput."""

import base64
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
    """`BackupAndRestore` that commits each epoch's backup atomically, random state included.

    A backup is `epoch-N.weights.h5` (weights and optimizer state: Keras' `save_weights` writes
    both) and `training_metadata.json`, which names that file and holds `random_state(model)`:
    the dropout and drop-path generators' states are in `model.variables` but not in
    `model.weights`, so without them a resumed run would replay the first epoch's dropout masks.
    The JSON is replaced last, with `os.replace`: a SIGKILL at any moment leaves either the
    previous backup or the new one, never weights of one epoch with the epoch count of another,
    nor a truncated file.
    """

    def __init__(self, backup_dir, **kwargs):
        super().__init__(backup_dir, double_checkpoint=False, **kwargs)

    guard = None  # a StopOnNaN: nothing is written once the loss is not finite

    def _save_model(self):
        if self.guard and self.guard.bad_step:
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        previous = self._read_metadata()
        name = f"epoch-{self._current_epoch}.weights.h5"
        temporary = os.path.join(self.backup_dir, f"saving-{os.getpid()}.weights.h5")
        self.model.save_weights(temporary, overwrite=True)
        os.replace(temporary, os.path.join(self.backup_dir, name))
        atomic_write_json({"epoch": self._current_epoch, "batch": self._last_batch_seen,
                           "weights": name, "random_state": random_state(self.model)},
                          self._training_metadata_path)
        stale = (previous or {}).get("weights", "latest.weights.h5")
        if stale != name and os.path.exists(os.path.join(self.backup_dir, stale)):
            os.remove(os.path.join(self.backup_dir, stale))

    def _load_model(self):
        metadata = self._read_metadata()
        if metadata is None:
            return
        # Backups written before the file was named in the metadata used Keras' name.
        self._weights_path = os.path.join(self.backup_dir,
                                          metadata.get("weights", "latest.weights.h5"))
        super()._load_model()
        if "random_state" in metadata:
            set_random_state(self.model, metadata["random_state"])
            self._torch_state = metadata["random_state"]

    _torch_state = None

    def on_train_batch_begin(self, batch, logs=None):
        # Keras on torch wraps tf.data in a DataLoader whose iterator, created as `fit` fetches
        # its first batch, draws a seed from torch's global generator: a draw the uninterrupted
        # run made in its first epoch. Restored after it, the generator is where the backup was.
        if self._torch_state is not None:
            set_torch_random_state(self._torch_state)
            self._torch_state = None

    def _read_metadata(self):
        try:
            with open(self._training_metadata_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    @property
    def resume_epoch(self):
        """The epoch a run in `backup_dir` resumes at (0: no backup)."""
        try:
            return int(self._read_metadata()["epoch"])
        except (TypeError, KeyError, ValueError):
            return 0


def _seed_variables(model):
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def random_state(model):
    """What a resumed run needs to draw the random numbers the uninterrupted run would have, and
    `save_weights` leaves out, as JSON: `{"seed_generators": [[variable path, [ints]], ...],
    "torch": base64 or absent, "torch_cuda": [base64, ...] or absent}`.

    The model's `SeedGenerator` states (dropout, drop path); on torch also the global
    generators, from which Keras' `Dropout` without a seed draws (torch cannot seed a fused
    dropout, so Keras calls `torch.nn.functional.dropout`).
    """
    state = {"seed_generators": [[v.path, np.asarray(keras.ops.convert_to_numpy(v)).tolist()]
                                 for v in _seed_variables(model)]}
    if keras.backend.backend() == "torch":
        import torch

        state["torch"] = _b64(torch.get_rng_state())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_random_state(model, state):
    """Restores the `SeedGenerator` states of what `random_state` returned, by position (their
    variables' paths carry a per-process counter); `set_torch_random_state` restores the rest."""
    variables = _seed_variables(model)
    saved = state["seed_generators"]
    if len(variables) != len(saved):
        raise ValueError(f"The backup holds {len(saved)} random-generator states but the model "
                         f"has {len(variables)}: it was built with other dropout or drop-path "
                         f"settings than the run that wrote the backup.")
    for variable, (_, values) in zip(variables, saved):
        variable.assign(np.asarray(values, dtype=variable.dtype))


def set_torch_random_state(state):
    """Restores torch's global generators from what `random_state` returned (if it has them)."""
    if "torch" in state:
        import torch

        torch.set_rng_state(_from_b64(state["torch"]))
        if "torch_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_from_b64(s) for s in state["torch_cuda"]])


def _b64(tensor):
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _from_b64(text):
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


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
