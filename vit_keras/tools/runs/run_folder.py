"""A training run's folder, `OUTPUT_DIR/RUN_NAME/`: the one place that knows its layout.

    model.keras          the model, rewritten atomically after every epoch and at the end (fsdp:
                         at the end only)
    adapters.npz         a LoRA run's trained weights alone (`finetuning.apply_adapters`)
    metrics.json         the final metrics, the resolved recipe and the run's settings
    flags.txt            the app's flags (usable as its --flagfile)
    class_names.json     a JSON list of strings, one per output class
    history.csv          one row per epoch (Keras' CSVLogger)
    training_curves.png  loss (and accuracy, for classification) per epoch
    logs/                TensorBoard event files
    backup/              the state to resume from, while the run is unfinished: an epoch's
                         model.keras, or (fsdp) an Orbax checkpoint of its shards
    skipped_files.txt    an image folder's files that could not be read, one per line
    lock                 while a process runs in the folder: its pid and host (JSON)

Every file is written through a temporary name and `os.replace`, so a killed run never leaves a
truncated file (the temporary files it may leave are removed when the run resumes). Nothing is
written through a symbolic link: the files this module writes are opened with `O_NOFOLLOW`, and
a run refuses a folder with a link in it (`refuse_links`). `metrics.json` is written last: a
folder that has it holds a finished run. Apps that take a `.keras` file find the rest beside it
with `RunFolder.of_model`.
"""

import contextlib
import csv
import errno
import json
import os
import shutil
import socket

import numpy as np

from vit_keras import atomic_files, errors

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; Windows has no symbolic links to refuse here
# The entries a run writes in its folder (beside the temporary files of its atomic writes):
# `--overwrite` deletes a folder's contents only when it holds nothing else.
RUN_FILES = ("model.keras", "adapters.npz", "metrics.json", "flags.txt", "class_names.json",
             "history.csv", "training_curves.png", "logs", "backup", "skipped_files.txt", "lock")


def atomic_save_model(model, path):
    """`model.save(path)` through a temporary file and `os.replace`, so `path` is always whole
    (and a link at `path` is replaced, never written through). A write that fails (a full disk)
    is a one-line `RunFolderWriteError` naming `path`.

    Keras writes a `.keras` file through Python's `zipfile` (the weights' HDF5 is built in
    memory), so a full disk is an `OSError` here; h5py writing a `.weights.h5` file itself
    crashes the process when the disk fills (a segmentation fault inside `File.close`)."""
    from vit_keras.tools.distributed import sharding

    with writing(path), atomic_files.replacing(path, ".keras") as temporary:
        with sharding.whole_values(model):  # weights split over processes (fsdp): gathered
            model.save(temporary)


def atomic_write_json(data, path):
    """`data` as indented JSON (NumPy scalars, tuples and sets converted), written atomically and
    never through a link."""
    atomic_write_text(json.dumps(data, indent=2, default=_json_default) + "\n", path)


def atomic_write_text(text, path):
    """`text` written to `path` as UTF-8, atomically and never through a link."""
    atomic_write_bytes(text.encode("utf-8"), path)


def atomic_write_bytes(data, path):
    """`data` written to `path` whole or not at all, never through a link
    (`atomic_files.write_bytes`; `RunFolderWriteError` names `path` when it cannot be written)."""
    with writing(path):
        atomic_files.write_bytes(data, path)


# What a write fails with when the disk (or the quota, or the file-size limit) is full.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@contextlib.contextmanager
def writing(path):
    """Turns an `OSError` raised while the block writes `path` into a one-line
    `RunFolderWriteError` naming `path` and what to do (`RunFolderError` for a link). A write
    through `atomic_files.replacing` has deleted its temporary file by then, giving the space
    back."""
    try:
        yield
    except RunFolderError:
        raise
    except OSError as error:
        raise write_error(path, error) from None


def write_error(path, error):
    """The `RunFolderError` for an `OSError` writing `path` (a file, or a folder it was in)."""
    if error.errno == errno.ELOOP:
        return link_error(error.filename or path)
    reason = error.strerror or " ".join(str(error).split())
    if error.errno in DISK_FULL:
        return RunFolderWriteError(
            f"Cannot write {path}: {reason}. Free space on its disk (or write elsewhere), then "
            f"run the same command again (a training run resumes from its last backed-up "
            f"epoch).")
    return RunFolderWriteError(f"Cannot write {path}: {reason}.")


def link_error(path):
    """The `RunFolderError` for a symbolic link where a file is to be written."""
    return RunFolderError(f"{path} is a symbolic link: a run writes its files only inside its "
                          f"folder, never through a link. Remove the link, or pass another "
                          f"--run_name.")


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


def read_history(path):
    """The epoch rows of a history.csv (Keras' `CSVLogger`): `[{"epoch": int, "loss": float,
    ...}]`, one per epoch in order (an epoch run again after a resume keeps its last row); `[]`
    when the file is absent.

    A value CSVLogger could not fill is left out of its row: it writes `NA` in a column no log
    of that epoch held (a pre-training run's `val_loss`, when a fit has no validation data). A
    row that is not one (more values than columns, a value that is no number: a row a full disk
    cut short, see `RunFolder.cut_unfinished_history_row`) is left out."""
    if not os.path.exists(path):
        return []
    rows = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("epoch") in (None, "", "epoch") or None in row:
                continue
            try:
                rows[int(row["epoch"])] = {key: (float(value) if key != "epoch" else int(value))
                                           for key, value in row.items()
                                           if value not in (None, "", "NA")}
            except ValueError:
                continue
    return [rows[epoch] for epoch in sorted(rows)]


class RunFolderError(errors.UserError, RuntimeError):
    """A run folder cannot be used: it cannot be written, or another process holds it."""


class RunFolderBusyError(RunFolderError):
    """Another live process holds the run folder's lock."""


class RunFolderWriteError(RunFolderError):
    """A file of the run folder could not be written (a full disk, most often)."""


class RunFolderMismatchError(RunFolderError):
    """The run folder holds a run made with other flags than the ones given."""


def check_run_name(name):
    """Raises `RunFolderError` unless `name` is one folder name: not empty, `.` or `..`, and
    without a path separator (a run folder is always a new folder inside `--output_dir`)."""
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    if name in ("", ".", "..") or "\0" in name or any(sep in name for sep in separators):
        raise RunFolderError(
            f"--run_name {name!r} is not a folder name: a run name is one path component "
            f"(no {' or '.join(repr(sep) for sep in separators)}, not '.' or '..'); choose "
            f"where run folders go with --output_dir.")


def parse_flags_text(text, booleans=()):
    """The flags of a `flags.txt` (`--name=value` lines, absl's `--name` / `--noname` for a
    boolean in `booleans`) as `{name: value string}`; a boolean's value is "true" or "false"."""
    found = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("--"):
            continue
        name, has_value, value = line[2:].partition("=")
        if has_value:
            found[name] = value
        elif name.startswith("no") and name[2:] in booleans:
            found[name[2:]] = "false"
        else:
            found[name] = "true"
    return found


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
    adapters = property(lambda self: self._file("adapters.npz"))
    metrics = property(lambda self: self._file("metrics.json"))
    flags = property(lambda self: self._file("flags.txt"))
    class_names = property(lambda self: self._file("class_names.json"))
    history = property(lambda self: self._file("history.csv"))
    curves = property(lambda self: self._file("training_curves.png"))
    logs = property(lambda self: self._file("logs"))
    backup = property(lambda self: self._file("backup"))
    skipped_files = property(lambda self: self._file("skipped_files.txt"))
    lock = property(lambda self: self._file("lock"))

    def create(self):
        """Creates the folder; `RunFolderError` (one line, no traceback needed) if it cannot."""
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as error:
            raise self._unwritable(error) from None
        return self

    def _unwritable(self, error):
        return RunFolderError(
            f"Cannot write the run folder {self.path}: {error.strerror or error}. Make it "
            f"writable, or choose another --output_dir or --run_name.")

    @contextlib.contextmanager
    def locked(self):
        """Holds the folder's `lock` file while the block runs: a second process that tries
        meanwhile gets `RunFolderBusyError` naming this one's pid and host, at once.

        The lock is an advisory `flock` on the file, which the kernel drops when its process
        ends, however it ends: the file of a killed run never locks the folder. The file holds
        `{"pid": ..., "host": ...}` for the message, and is removed when the block ends.
        Creates the folder; `RunFolderError` when it cannot be written.
        """
        self.create()
        try:
            import fcntl
        except ImportError:  # no flock (Windows): run without the guard
            yield self
            return
        try:
            descriptor = self._acquire(fcntl)
        except RunFolderError:
            raise
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise link_error(self.lock) from None
            raise self._unwritable(error) from None
        try:
            yield self
        finally:
            with contextlib.suppress(OSError):
                os.remove(self.lock)  # before unlocking: a waiting opener then sees a new file
            os.close(descriptor)

    def _acquire(self, fcntl):
        while True:
            descriptor = os.open(self.lock, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = read_json(self.lock) or {}
                os.close(descriptor)
                who = (f"process {holder['pid']} on {holder.get('host', 'an unknown host')}"
                       if "pid" in holder else "another process")
                raise RunFolderBusyError(
                    f"{self.path} is in use by {who} (lock file {self.lock}): wait for that run "
                    f"to end, or pass another --run_name.") from None
            except BaseException:
                os.close(descriptor)
                raise
            # The previous holder removes the file before unlocking: locking a removed file
            # locks nothing anyone else sees, so try again with the file now at the path.
            try:
                same = os.path.samestat(os.fstat(descriptor), os.stat(self.lock))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(descriptor)
        os.ftruncate(descriptor, 0)
        os.write(descriptor, json.dumps({"pid": os.getpid(),
                                         "host": socket.gethostname()}).encode())
        return descriptor

    def is_complete(self):
        """Whether the folder holds a finished run: its `metrics.json`, written last."""
        return self.read_metrics() is not None

    def foreign_entries(self):
        """The folder's entries that no run writes: neither `RUN_FILES` nor the temporary file of
        an interrupted atomic write (`NAME.tmp-PID...`)."""
        return sorted(name for name in os.listdir(self.path)
                      if name not in RUN_FILES and ".tmp-" not in name)

    def clear(self):
        """Removes everything a run wrote (for `--overwrite`); keeps the folder and its lock.

        Only from a run folder: a folder holding anything a run does not write (another run's
        folder, a user's file) raises `RunFolderError` and loses nothing, and so does one with a
        `lock` file inside it that another process holds (`RunFolderBusyError`). Links are
        removed, never followed. Call while holding the folder's lock."""
        foreign = self.foreign_entries()
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more"
                                              if len(foreign) > 5 else "")
            raise RunFolderError(
                f"--overwrite deletes only what a run wrote, and {self.path} holds {shown}, "
                f"which no run writes: it is not a run folder. Pass another --run_name (or "
                f"--output_dir), or empty the folder yourself.")
        self._refuse_held_locks()
        for name in os.listdir(self.path):
            path = self._file(name)
            if path == self.lock:
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)

    def _refuse_held_locks(self):
        """`RunFolderBusyError` when a `lock` below the folder (not its own) is held: a run
        folder nested in this one, in use."""
        try:
            import fcntl
        except ImportError:  # no flock (Windows): nothing can be held
            return
        for root, _, files in os.walk(self.path):
            for name in files:
                path = os.path.join(root, name)
                if name != "lock" or path == self.lock or os.path.islink(path):
                    continue
                descriptor = os.open(path, os.O_RDONLY | _NOFOLLOW)
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise RunFolderBusyError(
                        f"--overwrite would delete {os.path.dirname(path)}, which another "
                        f"process is running in (lock file {path}); nothing was deleted.") from None
                finally:
                    os.close(descriptor)

    def refuse_links(self):
        """Raises `RunFolderError` naming the first symbolic link inside the folder (at any
        depth): the run's writers (Keras' CSVLogger, TensorBoard, h5py, matplotlib) follow
        links, so a run starts only in a folder without them. The folder itself may be a link."""
        for root, folders, files in os.walk(self.path):
            for name in sorted(folders + files):
                path = os.path.join(root, name)
                if os.path.islink(path):
                    raise link_error(path)

    def remove_backup(self):
        shutil.rmtree(self.backup, ignore_errors=True)

    def remove_temporary_files(self):
        """Deletes what interrupted atomic writes left (call while holding the lock: no other
        process is then writing them). Returns their paths relative to the folder."""
        found = self.temporary_files()
        for name in found:
            path = self._file(name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)  # an uncommitted Orbax checkpoint
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        return found

    def cut_unfinished_history_row(self):
        """Cuts a last row of history.csv that a write did not finish, so that the rows a resumed
        run appends start on a line of their own. Returns whether there was one.

        Only a full disk leaves one (Keras' `CSVLogger` writes a row and flushes it at the end of
        an epoch). That epoch has no backup, since the backup is written after the row
        (`training._callbacks`), so it runs again and writes its row whole."""
        if not os.path.isfile(self.history) or os.path.islink(self.history):
            return False
        with open(self.history, "rb+") as f:
            text = f.read()
            if not text or text.endswith(b"\n"):
                return False
            f.truncate(text.rfind(b"\n") + 1)
        return True

    def write_flags(self, text):
        atomic_write_text(text, self.flags)

    def read_flags_text(self):
        """The text of the run's `flags.txt` (`parse_flags_text` reads it), or `None`."""
        try:
            with open(self.flags, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write_class_names(self, names):
        atomic_write_json(list(names), self.class_names)

    def write_metrics(self, metrics):
        atomic_write_json(metrics, self.metrics)

    def save_model(self, model):
        atomic_save_model(model, self.model)

    def read_class_names(self):
        """The run's class names, or `None` when it has no `class_names.json`."""
        return load_class_names(self.class_names) if os.path.exists(self.class_names) else None

    def read_history(self):
        """The rows of the run's history.csv (`read_history`), `[]` before its first epoch."""
        return read_history(self.history)

    def read_metrics(self):
        """The run's `metrics.json` as a dict, or `None` when absent or unreadable."""
        return read_json(self.metrics)

    def temporary_files(self):
        """Files left by interrupted atomic writes (none after a clean run), relative to the
        folder: `NAME.tmp-PID[.keras]` beside the outputs, `*.tmp-PID[.keras]`, an Orbax
        checkpoint not yet committed (`epoch-N.orbax.orbax-checkpoint-tmp-*`, a folder) and
        (from earlier versions' backups) `saving-PID.weights.h5` in `backup/`."""
        from vit_keras.tools.distributed.sharded_checkpoint import ORBAX_TEMPORARY_MARK

        found = [name for name in os.listdir(self.path) if ".tmp-" in name and (
            os.path.isfile(self._file(name)) or os.path.islink(self._file(name)))]
        if os.path.isdir(self.backup):
            found += [os.path.join("backup", name) for name in os.listdir(self.backup)
                      if name.startswith("saving-") or ".tmp-" in name
                      or ORBAX_TEMPORARY_MARK in name]
        return found
