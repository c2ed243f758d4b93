"""A training run's folder, `OUTPUT_DIR/RUN_NAME/`: the one place that knows its layout.

    model.keras          the model, rewritten atomically after every epoch and at the end
    metrics.json         the final metrics, the resolved recipe and the run's settings
    flags.txt            the app's flags (usable as its --flagfile)
    class_names.json     a JSON list of strings, one per output class
    history.csv          one row per epoch (Keras' CSVLogger)
    training_curves.png  loss and accuracy per epoch
    logs/                TensorBoard event files
    backup/              the state to resume from, while the run is unfinished
    skipped_files.txt    an image folder's files that could not be read, one per line

Every file is written through a temporary name and `os.replace`, so a killed run never leaves a
truncated file. Apps that take a `.keras` file find the rest beside it with `RunFolder.of_model`.
"""

import json
import os

import numpy as np


def atomic_save_model(model, path):
    """`model.save(path)` through a temporary file and `os.replace`, so `path` is always whole."""
    temporary = f"{path[:-len('.keras')]}.tmp-{os.getpid()}.keras"
    model.save(temporary)
    os.replace(temporary, path)


def atomic_write_json(data, path):
    """`data` as indented JSON (NumPy scalars, tuples and sets converted), written atomically."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(data, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(temporary, path)


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    return str(value)


def read_json(path):
    """The JSON value in `path`, or `None` when the file is absent or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_class_names(path):
    """Class names from a JSON list of strings or a text file with one name per line."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            names = json.load(f)
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise ValueError(f"{path} must hold a JSON list of strings, one per class.")
            return names
        return [line.strip() for line in f if line.strip()]


class RunFolder:
    """The files of one run. Paths are absolute; nothing is created until `create()`."""

    def __init__(self, path):
        self.path = os.path.abspath(os.fspath(path))

    @classmethod
    def of_model(cls, model_path):
        """The run folder a `.keras` file sits in (any folder: its files may simply be absent)."""
        return cls(os.path.dirname(os.path.abspath(os.fspath(model_path))))

    def _file(self, name):
        return os.path.join(self.path, name)

    model = property(lambda self: self._file("model.keras"))
    metrics = property(lambda self: self._file("metrics.json"))
    flags = property(lambda self: self._file("flags.txt"))
    class_names = property(lambda self: self._file("class_names.json"))
    history = property(lambda self: self._file("history.csv"))
    curves = property(lambda self: self._file("training_curves.png"))
    logs = property(lambda self: self._file("logs"))
    backup = property(lambda self: self._file("backup"))
    skipped_files = property(lambda self: self._file("skipped_files.txt"))

    def create(self):
        os.makedirs(self.path, exist_ok=True)
        return self

    def write_flags(self, text):
        temporary = f"{self.flags}.tmp-{os.getpid()}"
        with open(temporary, "w") as f:
            f.write(text)
        os.replace(temporary, self.flags)

    def write_class_names(self, names):
        atomic_write_json(list(names), self.class_names)

    def write_metrics(self, metrics):
        atomic_write_json(metrics, self.metrics)

    def save_model(self, model):
        atomic_save_model(model, self.model)

    def read_class_names(self):
        """The run's class names, or `None` when it has no `class_names.json`."""
        return load_class_names(self.class_names) if os.path.exists(self.class_names) else None

    def read_metrics(self):
        """The run's `metrics.json` as a dict, or `None` when absent or unreadable."""
        return read_json(self.metrics)

    def temporary_files(self):
        """Names in the folder left by an interrupted atomic write (none after a clean run)."""
        return [name for name in os.listdir(self.path) if ".tmp" in name]
