"""Where the modules lived before the sub-packages: the core's (the API page's names of 21b95ce)
and the application half's (`vit_keras.tools.training`, before `tools/` was split by concern).

`import vit_keras.layers`, `from vit_keras.checkpoints import timm` and `from vit_keras.tools
import training` keep working until `REMOVAL`: each old path is a stand-in whose every attribute
is the new module's, read through a `DeprecationWarning` that names the new path. No module is
loaded for a stand-in; the library itself imports only the new paths.
"""

import importlib
import sys
import types
import warnings

REMOVAL = "2027-06-01"
"""The day the old paths go."""

MOVED = {
    **{f"vit_keras.{name}": f"vit_keras.model.{name}" for name in (
        "attention", "configs", "geometry", "heads", "interpolation_ops", "layers", "resnet",
        "xla_cpu")},
    # Renamed to say what they hold (registered when `vit_keras.model` is imported).
    **{f"{package}.kernels": "vit_keras.model.backend_ops"
       for package in ("vit_keras", "vit_keras.model")},
    **{f"{package}.normalization": "vit_keras.model.pixel_normalization"
       for package in ("vit_keras", "vit_keras.model")},
    **{f"vit_keras.{name}": f"vit_keras.weights.{name}" for name in (
        "checkpoints", "download", "download_http", "keras_files", "labels", "patch_resize",
        "posemb", "pretrained", "release_files", "releases")},
    **{f"vit_keras.checkpoints.{name}": f"vit_keras.weights.checkpoints.{name}" for name in (
        "files", "huggingface", "loader", "names", "npz", "timm")},
    **{f"vit_keras.{name}": f"vit_keras.inspection.{name}" for name in ("analysis", "features")},
    **{f"vit_keras.{name}": f"vit_keras.training.{name}" for name in (
        "fewshot", "layer_decay", "masked_patch_prediction", "schedules")},
    # The application half by concern (registered when `vit_keras.tools` is imported).
    **{f"vit_keras.tools.{name}": f"vit_keras.tools.runs.{name}" for name in (
        "callbacks", "config_flags", "ema", "evaluation", "objectives", "recipes", "run_config",
        "run_folder", "run_parts", "training")},
    **{f"vit_keras.tools.{name}": f"vit_keras.tools.distributed.{name}" for name in (
        "distribution", "memory", "sharded_checkpoint", "sharding")},
}
"""Old module path → the module it is now."""


class MovedModule(types.ModuleType):
    """An old module path: reading or setting an attribute reads or sets the new module's, with
    a `DeprecationWarning`."""

    def __init__(self, old, new):
        super().__init__(old, f"Moved to {new}; this path goes on {REMOVAL}.")
        self.__dict__["moved_to"] = new

    def _module(self):
        new = self.__dict__["moved_to"]
        warnings.warn(f"{self.__name__} moved to {new}: import it from there ({self.__name__} "
                      f"goes on {REMOVAL}).", DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def __getattr__(self, name):
        if name.startswith("__"):  # importlib's and inspect's questions about the stand-in
            raise AttributeError(name)
        return getattr(self._module(), name)

    def __setattr__(self, name, value):  # monkeypatching an old path patches the module
        setattr(self._module(), name, value)

    def __delattr__(self, name):
        delattr(self._module(), name)


def _package_of(old):
    """The package an old path lives in: its nearest parent that is no old path itself
    (`vit_keras` for `vit_keras.checkpoints.timm`, `vit_keras.tools` for
    `vit_keras.tools.training`)."""
    parent = old.rpartition(".")[0]
    while parent in MOVED:
        parent = parent.rpartition(".")[0]
    return parent


def register(package):
    """Puts a stand-in for each old path in `package` (a module: `vit_keras`, `vit_keras.tools`)
    in `sys.modules` and on its parent (`package` or a parent stand-in) so that both `import`
    forms find it. Each package registers its own when it is imported: `import vit_keras`
    imports no `vit_keras.tools`."""
    for old, new in MOVED.items():  # a parent before its children
        if _package_of(old) != package.__name__:
            continue
        stand_in = sys.modules.setdefault(old, MovedModule(old, new))
        parent, _, name = old.rpartition(".")
        holder = package if parent == package.__name__ else sys.modules[parent]
        holder.__dict__.setdefault(name, stand_in)
