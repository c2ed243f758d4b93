"""The start of every app: the Keras backend from `--backend`, chosen before Keras is imported.

Every app begins with:

    import _backend
    _backend.start_app()   # before `import keras` / `import vit_keras`
"""

import os
import sys

BACKENDS = ("jax", "tensorflow", "torch")


def select_backend(argv=None):
    """Sets `KERAS_BACKEND` from `--backend NAME` or `--backend=NAME`, wherever it stands in argv.

    Args:
      argv: the command line (default `sys.argv`).

    Returns:
      The chosen backend, or `None` when argv has no `--backend` (KERAS_BACKEND is then untouched).

    Raises:
      ValueError: for an unknown backend, or when Keras was already imported on another backend.
    """
    argv = sys.argv if argv is None else argv
    backend = None
    for index, arg in enumerate(argv):
        if arg == "--backend" and index + 1 < len(argv):
            backend = argv[index + 1]
        elif arg.startswith("--backend="):
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


def start_app(only=None, help_text=None):
    """Reads `--backend`, defines its absl flag and sets the apps' runtime defaults.

    Call before importing keras or vit_keras (on JAX, `import vit_keras` must also come before JAX
    starts: see `vit_keras.xla_cpu`).

    Args:
      only: a backend the app always runs on (the exporter: "tensorflow"); `--backend` may then
        name only that one.
      help_text: the `--backend` flag's help.

    Returns:
      The backend chosen on the command line, or `None` (KERAS_BACKEND then decides).
    """
    backend = select_backend(None if only is None else ["--backend", only])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ info and warning logs
    # torch's OpenMP threads spin while waiting; beside tf.data's threads on a small CPU that made
    # training steps 5-10x slower here. Passive waiting costs nothing measurable on an idle machine.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from absl import flags  # pylint: disable=import-outside-toplevel

    # Filed under the calling app's module: an app's `--help` lists only its own flags.
    app = sys._getframe(1).f_globals["__name__"]  # pylint: disable=protected-access
    if "backend" not in flags.FLAGS:
        flags.DEFINE_enum(
            "backend", only, [only] if only else BACKENDS,
            help_text or "Keras backend, chosen before Keras is imported (default: KERAS_BACKEND, "
                         "else Keras' own default).",
            module_name=app if app != "__main__" else sys.argv[0])  # as absl names the script
    return backend
