"""Chooses the Keras backend from `--backend` before Keras is imported.

Every app starts with:

    import _backend
    _backend.select_backend()   # before `import keras` / `import vit_keras`

and defines a matching absl flag (`flags.DEFINE_enum("backend", None, _backend.BACKENDS, ...)`) so
that absl accepts `--backend` too.
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
