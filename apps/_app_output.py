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

import importlib.abc
import importlib.machinery
import logging
import os
import re
import sys
import tempfile
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
