"""What an app prints is the app's own: the libraries' start-up noise silenced where they allow
it, and one format for every warning.

`_backend.start_app()` calls `set_up()` before TensorFlow, JAX, torch or Keras is imported:

- TensorFlow: `TF_CPP_MIN_LOG_LEVEL=3` (unless set) hides its C++ logs (the `failed call to
  cuInit` of a machine without a GPU among them). The lines its libraries write while they load,
  before their logging reads that setting (oneDNN, `Could not find cuda drivers`, `All log
  messages before absl::InitializeLog()`), are held back while `import tensorflow` runs, and
  only those below the level in force are dropped: `TF_CPP_MIN_LOG_LEVEL=0` shows them all.
- Python logging: the libraries' INFO records are left out (absl apps show them by default; JAX
  says there that it found no TPU), the `vit_keras` and absl loggers' (the library's and the
  apps' own notes) are kept; `--verbosity` still decides. Every record is printed as
  `WARNING: message` (`ERROR: `, ...), an INFO one as its message alone, like the apps' own
  `ERROR: ` lines.
- Python warnings (`warnings.warn`) are printed in the same format, on one line. Keras' "Your
  input ran out of data; interrupting training" is left out: the apps' training streams never
  end, and it comes from an evaluation set of unknown length (an image folder's, whose unreadable
  files are left out), whose end Keras finds by running out, interrupting nothing.
"""

import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import re
import sys
import tempfile
import traceback
import warnings

TF_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
# The libraries whose INFO records an app prints: the package's and the apps' own (absl's logger).
_INFO_LOGGERS = ("vit_keras", "absl")
# An absl C++ log line: severity letter (I, W, E, F), date, time, thread, file:line].
_CPP_LOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ \]]+:\d+\] ")
_CPP_SEVERITIES = "IWEF"
_BEFORE_INITIALIZE_LOG = "WARNING: All log messages before absl::InitializeLog() is called"


def set_up():
    """Silences the libraries' noise and sets the one format of warnings (see the module)."""
    os.environ.setdefault(TF_LOG_LEVEL, "3")
    try:
        level = int(os.environ[TF_LOG_LEVEL])
    except ValueError:
        level = 0
    if level > 0 and "tensorflow" not in sys.modules:
        sys.meta_path.insert(0, _QuietImport("tensorflow", level))
    _set_up_logging()
    warnings.showwarning = _show_warning
    warnings.filterwarnings("ignore", message="Your input ran out of data")


def _set_up_logging():
    from absl import flags  # pylint: disable=import-outside-toplevel
    from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

    # absl raises the root logger to INFO when --verbosity is not given; a value set here stays
    # unless the command line gives one.
    flags.FLAGS.verbosity = absl_logging.converter.ABSL_WARNING
    for name in _INFO_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    absl_logging.get_absl_handler().setFormatter(_LevelPrefix())


@contextlib.contextmanager
def quiet_failed_checkpoint_writes():
    """While a training run runs, leaves out what an fsdp backup's failed write prints besides
    the app's one `ERROR: Cannot write ...` line (a full disk, a quota), hundreds of tracebacks
    that repeat it: Orbax logs each of its writing threads' errors before the save raises the
    first (the line); TensorStore's writes still under way then post their results to the
    asyncio loop Orbax has closed (unraisable `RuntimeError: Event loop is closed`s), and
    asyncio logs their failures, which nothing reads ("Future exception was never retrieved").
    Any other error is printed as before. The apps' own, not the library's: it changes the
    process's logging and `sys.unraisablehook`, put back at the end of a run without a failed
    write."""
    # Imported now: the records may come while the interpreter shuts down.
    from vit_keras.tools.distributed import sharded_checkpoint  # pylint: disable=import-outside-toplevel

    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]  # Orbax's, asyncio's
    previous_hook = sys.unraisablehook
    dropped = []

    def printed(record):
        if (_reports_a_background_error(record)
                and sharded_checkpoint.write_failure(record.exc_info[1])):
            dropped.append(record)
            return False
        return True

    def hook(unraisable):
        if _posted_to_a_closed_loop(unraisable):
            dropped.append(unraisable)
        else:
            previous_hook(unraisable)

    for logger in loggers:
        logger.addFilter(printed)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        # After a failed write the run ends in its error, and the app with it; TensorStore's
        # writes still under way print until the process exits (asyncio's tasks freed at its
        # end), so the filters stay.
        if not dropped:
            sys.unraisablehook = previous_hook
            for logger in loggers:
                logger.removeFilter(printed)


def _reports_a_background_error(record):
    """Whether `record` is Orbax's log of a thread's error, or asyncio's of a task's that
    nothing read, with the error."""
    message = str(record.msg)
    return bool(record.exc_info) and record.exc_info[1] is not None and (
        "_SignalingThread.run() raised" in message or message.startswith(
            ("Future exception was never retrieved", "Task exception was never retrieved")))


def _posted_to_a_closed_loop(unraisable):
    frames = traceback.extract_tb(unraisable.exc_traceback)[-2:]
    return (type(unraisable.exc_value) is RuntimeError
            and str(unraisable.exc_value) == "Event loop is closed"
            and [frame.name for frame in frames] == ["call_soon_threadsafe", "_check_closed"])


class _LevelPrefix(logging.Formatter):
    """`WARNING: message` (an INFO record: the message alone), without absl's prefix of date,
    thread and source line."""

    def format(self, record):
        text = super().format(record)
        return text if record.levelno <= logging.INFO else f"{record.levelname}: {text}"


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """`warnings.showwarning` as one line in the apps' format, naming where it was raised."""
    text = " ".join(str(message).split())
    print(f"WARNING: {text} ({category.__name__}, {os.path.basename(filename)}:{lineno})",
          file=file or sys.stderr)


class _QuietImport(importlib.abc.MetaPathFinder):
    """Imports the module `name` with its writes to the standard error held back, then writes
    them out but the C++ log lines below `level` (with their continuation lines). Leaves
    `sys.meta_path` once the module is loaded: a probe (`importlib.util.find_spec`, which Keras
    and the training loop make) loads nothing."""

    def __init__(self, name, level):
        self.name, self.level = name, level

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            load = spec.loader.exec_module

            def exec_module(module):
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                with _HeldBackStderr(self.level):
                    load(module)

            spec.loader.exec_module = exec_module
        return spec


class _HeldBackStderr:
    """Points file descriptor 2 (where C++ libraries write) at a temporary file, and on exit
    back at the standard error, writing out what was not noise."""

    def __init__(self, level):
        self.level = level

    def __enter__(self):
        sys.stderr.flush()
        self.held = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.held.fileno(), 2)

    def __exit__(self, *exc_info):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.held.seek(0)
        text = self.held.read().decode("utf-8", "replace")
        self.held.close()
        kept = self._kept(text.splitlines(keepends=True))
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()

    def _kept(self, lines):
        kept, dropping = [], False
        for line in lines:
            match = _CPP_LOG_LINE.match(line)
            if match:
                dropping = _CPP_SEVERITIES.index(match.group(1)) < self.level
            elif line.startswith(_BEFORE_INITIALIZE_LOG):  # a warning about the lines below
                dropping = self.level > _CPP_SEVERITIES.index("I")
            elif line.startswith(("WARNING: ", "Traceback")):
                dropping = False  # a Python warning or error, not a C++ line's continuation
            if not dropping:
                kept.append(line)
        return kept
