"""The start of every app: the Keras backend from `--backend`, chosen before Keras is imported.

Every app begins with:

    import _backend
    _backend.start_app()   # before `import keras` / `import vit_keras`

(Python puts a script's folder first on `sys.path`, so `import _backend` finds this file.)
"""

import importlib.util
import os
import sys

import _app_output

# Run from a checkout without installing the package.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

BACKENDS = ("jax", "tensorflow", "torch")
# Set to 0 to leave glibc's malloc untouched on JAX (see start_app).
KEEP_HOST_MEMORY = "VIT_KERAS_KEEP_HOST_MEMORY"


class FlagfileLoopError(ValueError):
    """A `--flagfile` that includes itself, directly or through others."""


def expand_flagfiles(argv, _reading=()):
    """argv with each `--flagfile PATH` / `--flagfile=PATH` (or `-flagfile`) replaced by the flags
    in that file (one a line; `#` and `//` comments; nested flag files), in place, as absl reads
    them: a flag after the file overrides the file's. An unreadable file is left out (absl reports
    it); a file that includes itself, directly or through others, raises `FlagfileLoopError`."""
    expanded, args = [], iter(argv)
    for arg in args:
        path = None
        for prefix in ("--flagfile", "-flagfile"):
            if arg == prefix:
                path = next(args, "")
            elif arg.startswith(prefix + "="):
                path = arg[len(prefix) + 1:]
        if path is None:
            expanded.append(arg)
            if arg == "--":  # absl reads no flag after it
                expanded += list(args)
            continue
        path = os.path.expanduser(path)
        real = os.path.realpath(path)
        if real in _reading:
            chain = " -> ".join((*_reading[_reading.index(real):], real))
            raise FlagfileLoopError(f"--flagfile {path} includes itself ({chain}); remove the "
                                    f"--flagfile line that closes the loop.")
        try:
            with open(path) as f:
                lines = [line.strip() for line in f]
        except OSError:
            continue
        expanded += expand_flagfiles([line for line in lines
                                      if line and not line.startswith(("#", "//"))],
                                     (*_reading, real))
    return expanded


def select_backend(argv=None):
    """Sets `KERAS_BACKEND` from `--backend NAME` or `--backend=NAME` (or absl's single-dash
    `-backend`), wherever it stands in argv before a `--` or in a `--flagfile` it names (the last
    one wins, as in absl).

    Args:
      argv: the command line (default `sys.argv`).

    Returns:
      The chosen backend, or `None` when argv has no `--backend` (KERAS_BACKEND is then untouched).

    Raises:
      ValueError: for an unknown backend, a `--flagfile` loop, or when Keras was already imported
        on another backend.
    """
    argv = expand_flagfiles(sys.argv if argv is None else argv)
    backend = None
    for index, arg in enumerate(argv):
        if arg == "--":
            break
        if arg in ("--backend", "-backend") and index + 1 < len(argv):
            backend = argv[index + 1]
        elif arg.startswith(("--backend=", "-backend=")):
            backend = arg.split("=", 1)[1]
    if backend is None:
        return None
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}.")
    keras = sys.modules.get("keras")
    if keras is not None and keras.backend.backend() != backend:
        raise ValueError(
            f"Keras was imported on the {keras.backend.backend()} backend before --backend={backend} "
            f"was read; call select_backend() before importing keras or vit_keras.")
    os.environ["KERAS_BACKEND"] = backend
    return backend


def keep_freed_host_memory():
    """`vit_keras.keep_freed_host_memory()`, before NumPy or any of vit_keras is imported.

    glibc's settings reach only threads that have not allocated yet, and importing NumPy starts
    OpenBLAS's threads (a late call left a ViT-Ti/16 training step on JAX page-faulting ~26,000
    times instead of 0 in some processes). `vit_keras/host_memory.py` imports only the standard
    library, so it is run on its own, without the package's `__init__`. Returns whether the
    settings were applied.
    """
    spec = importlib.util.spec_from_file_location(
        "_vit_keras_host_memory", os.path.join(_CHECKOUT, "vit_keras", "host_memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.keep_freed_host_memory()


def flag_module(depth=1):
    """absl's name for the module `depth` frames above the caller: the module whose `--help` lists
    the flags defined under it (absl names the script `sys.argv[0]`)."""
    name = sys._getframe(depth + 1).f_globals["__name__"]  # pylint: disable=protected-access
    return sys.argv[0] if name == "__main__" else name


def parse_flags(argv):
    """The apps' absl flag parser, `app.run(main, flags_parser=_backend.parse_flags)`: a flag that
    is unknown, malformed or outside its range (`vit_keras.tools.runs.config_flags`) ends the app
    before `main` with one line, `ERROR: ...`, and status 2, as every other mistake does (absl's
    own parser prints two lines and exits with 1). Also refuses a `--backend` that absl read but
    `select_backend` did not, so a run never records a backend it did not run on."""
    from absl import flags  # pylint: disable=import-outside-toplevel

    try:
        remaining = flags.FLAGS(argv)
    except flags.Error as error:
        _exit_with_error(" ".join(str(error).split()))
    if "backend" in flags.FLAGS and flags.FLAGS.backend is not None and (
            flags.FLAGS.backend != os.environ.get("KERAS_BACKEND")):
        _exit_with_error(f"--backend {flags.FLAGS.backend} was read after Keras chose the "
                         f"{os.environ.get('KERAS_BACKEND') or 'default'} backend; write it as "
                         f"--backend {flags.FLAGS.backend} or --backend={flags.FLAGS.backend}.")
    return remaining


def _exit_with_error(message):
    print(f"ERROR: {message}", file=sys.stderr)
    sys.exit(2)


def keep_tensorflow_off_the_gpus():
    """Hides the GPUs from TensorFlow, if it is installed: on JAX and torch the apps use it for
    tf.data alone, and a TensorFlow that sees a GPU starts a CUDA context on it and takes its
    memory from the backend that trains. Before TensorFlow's first op; the apps' business, not
    the library's (a library changes no process-wide state)."""
    if importlib.util.find_spec("tensorflow") is None:
        return
    # Keras (and with it torch, which loads triton) before TensorFlow, as the apps always imported
    # them: triton loaded after TensorFlow crashes the process (README, "Install").
    import keras  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    tf.config.set_visible_devices([], "GPU")


def start_app(only=None, help_text=None):
    """Reads `--backend`, defines its absl flag and sets the apps' runtime defaults.

    Call before importing keras or vit_keras. An unknown backend or a `--flagfile` loop ends the
    app with one line, `ERROR: ...`, and status 2; so does any other flag error once the app runs
    `app.run(main, flags_parser=parse_flags)`. It silences the libraries' start-up noise and
    prints warnings as `WARNING: ...` (`_app_output`). On JAX and torch it hides the GPUs from
    TensorFlow (`keep_tensorflow_off_the_gpus`). On JAX it also calls
    `vit_keras.keep_freed_host_memory()` before JAX starts its CPU client (the app's first array),
    unless `VIT_KERAS_KEEP_HOST_MEMORY=0`: see `vit_keras.model.xla_cpu`.

    Args:
      only: a backend the app always runs on (the exporter: "tensorflow"); `--backend` may then
        name only that one.
      help_text: the `--backend` flag's help.

    Returns:
      The backend chosen on the command line, or `None` (KERAS_BACKEND then decides).
    """
    try:
        backend = select_backend(None if only is None else ["--backend", only])
    except ValueError as error:
        _exit_with_error(error)
    # torch's OpenMP threads spin while waiting; beside tf.data's threads on a small CPU that made
    # training steps 5-10x slower here. Passive waiting costs nothing measurable on an idle machine.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if ((backend or os.environ.get("KERAS_BACKEND")) == "jax"
            and os.environ.get(KEEP_HOST_MEMORY, "1").strip() != "0"):
        # XLA:CPU mallocs each step's scratch buffer; without this every step page-faults it in
        # again. Importing keras on JAX starts no CPU client yet, so this still comes first.
        keep_freed_host_memory()
    _app_output.set_up()  # before TensorFlow, JAX or torch loads: their noise, one warning format
    if (backend or os.environ.get("KERAS_BACKEND")) in ("jax", "torch"):
        keep_tensorflow_off_the_gpus()
    from absl import flags  # pylint: disable=import-outside-toplevel

    # Filed under the calling app's module: an app's `--help` lists only its own flags.
    if "backend" not in flags.FLAGS:
        flags.DEFINE_enum(
            "backend", only, [only] if only else BACKENDS,
            help_text or "Keras backend, chosen before Keras is imported (default: KERAS_BACKEND, "
                         "else Keras' own default).",
            module_name=flag_module())
    return backend
