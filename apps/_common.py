"""What several apps share, once. Import after `_backend.start_app()` (Keras comes in lazily)."""

import os
import sys

from absl import app, flags
import numpy as np

import _backend

FLAGS = flags.FLAGS


def parse_image_size(values):
    """An `--image_size` list flag (one number, or height,width) → an int or `(height, width)`."""
    try:
        sizes = [int(value) for value in values]
    except ValueError:
        sizes = None
    if not sizes or len(sizes) > 2 or min(sizes) < 1:
        raise app.UsageError(f"--image_size takes one positive number or height,width; got "
                             f"{','.join(values)!r}.")
    return sizes[0] if len(sizes) == 1 else tuple(sizes)


def read_class_names(path, model_path):
    """Class names from `path` (`--class_names`: a JSON list or one name per line), else from
    `class_names.json` in the model's run folder, else `None` (classes are numbered)."""
    from vit_keras.tools.run_folder import RunFolder, load_class_names

    if path:
        if not os.path.isfile(path):
            raise app.UsageError(f"--class_names {path} is not a file.")
        return load_class_names(path)
    return RunFolder.of_model(model_path).read_class_names()


def check_weights(weights, variant, image_size=None):
    """`--weights` checked by the library's one check (`vit_keras.pretrained.release_of`) before
    anything slow loads: the `Release` it names for `--model`'s variant, or None for a file, a
    folder, a hub id or no `--weights`. Reads and downloads nothing.

    Raises the library's user errors; a release name without a variant names the flag to pass,
    `--model`, in the library's sentence.
    """
    from vit_keras import errors, pretrained

    if not weights:  # `--weights=` as no --weights
        return None
    try:
        return pretrained.release_of(weights, variant, image_size)
    except errors.ReleaseNeedsVariantError as error:
        raise errors.ReleaseNeedsVariantError(error.release, variant_flag="--model") from None


class ReloadMismatchError(Exception):
    """A saved `.keras` file does not compute what the model that wrote it computes."""


def verify_reload(model, path, tolerance=1e-5, shown_as=None):
    """Reloads `path` and compares it with `model` on a fixed random image; returns the largest
    difference, or raises `ReloadMismatchError` (naming `shown_as`, default `path`).

    Compares the logits and, where the model has a `head` layer, the features it takes: a new
    head is zero-initialised, and zeros match zeros whatever the weights under them hold.
    """
    import keras

    reloaded = keras.models.load_model(path)
    shown_as = shown_as or path
    images = np.random.default_rng(0).uniform(0, 255, (1, *model.input_shape[1:])).astype(
        "float32")

    def outputs(m):
        names = {layer.name for layer in m.layers}
        probe = keras.Model(m.input, [m.output, *([m.get_layer("head").input]
                                                  if "head" in names else [])])
        return [np.asarray(a, dtype=np.float64) for a in probe.predict_on_batch(images)]

    expected, found = outputs(model), outputs(reloaded)
    if [e.shape for e in expected] != [f.shape for f in found]:
        raise ReloadMismatchError(f"Reloaded {shown_as} has outputs of shapes "
                                  f"{[f.shape for f in found]}, not {[e.shape for e in expected]}.")
    difference = max(float(np.max(np.abs(f - e))) for f, e in zip(found, expected))
    scale = max(1.0, *(float(np.max(np.abs(e))) for e in expected))
    if not difference <= tolerance * scale:  # NaN fails too
        raise ReloadMismatchError(f"Reloaded {shown_as} differs from the model that wrote it by "
                                  f"{difference:g} (logits or the features under the head).")
    return difference


def define_model_output_flags():
    """`--out` (a `.keras` path) and `--overwrite`, for the apps that write one model file."""
    flags.DEFINE_string("out", None, "Output .keras file, e.g. saved_models/NAME.keras.",
                        required=True)
    flags.DEFINE_bool("overwrite", False, "Replace --out if it exists (without it, an existing "
                      "file stops the program before any work).")


def check_model_output(out, overwrite):
    """Refuses, before any work, an `--out` that is not a `.keras` path, that is a symbolic link
    (a file is written, never through a link), whose folder is not one (a file or a dangling
    link in its path), or that exists and is not to be overwritten: a model written earlier is never
    replaced without `--overwrite`."""
    if not out.endswith(".keras"):
        raise app.UsageError(f"--out must end with .keras; got {out!r}.")
    if os.path.islink(out):
        raise app.UsageError(f"--out {out} is a symbolic link (to {os.readlink(out)}); give the "
                             f"path of the file itself.")
    folder = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(folder):  # the nearest existing folder above it: created below
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise app.UsageError(f"--out {out}: {folder} is not a folder"
                             + (" (a symbolic link to nothing)" if os.path.islink(folder) else "")
                             + "; choose another --out.")
    if os.path.exists(out) and not overwrite:
        raise app.UsageError(f"{out} exists already: pass --overwrite to replace it, or choose "
                             f"another --out.")


def save_checked_model(model, out):
    """Writes `model` to `out` once a reload of it computes what `model` computes: saved under a
    temporary name, reloaded and compared (`verify_reload`), then renamed into place, so `out` is
    never a partial or a wrong file. Returns the largest difference; raises
    `ReloadMismatchError` (the temporary file deleted)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    temporary = f"{out[:-len('.keras')]}.tmp-{os.getpid()}.keras"
    model.save(temporary)
    try:
        difference = verify_reload(model, temporary, shown_as=out)
    except ReloadMismatchError:
        os.remove(temporary)
        raise
    os.replace(temporary, out)
    return difference


def run_flags_text(module_name, leave_out=("overwrite",)):
    """The text of a run's `flags.txt` (its `--flagfile`): the flags the app defined under
    `module_name` (absl files a script's under its path), without absl's and TensorFlow's own,
    one `--name=value` a line, with `--backend` set to the backend the run uses, so that the file
    replays the run on that backend whatever KERAS_BACKEND says. `leave_out` names flags a replay
    must not repeat (`--overwrite` would erase the run the file describes)."""
    import keras

    if "backend" in FLAGS and FLAGS.backend is None:
        FLAGS.backend = keras.backend.backend()
    lines = sorted(flag.serialize() for flag in FLAGS.get_flags_for_module(module_name)
                   if flag.value is not None and flag.name not in leave_out)
    return "".join(line + "\n" for line in lines)


def training_app(name, started, recipe="auto", recipe_help=None, objective=None):
    """Defines the training flags under the calling app and returns its absl main, which runs
    `training.run` with the objective and prints the objective's summary.

    The flags are the `option` fields of `vit_keras.tools.training.RunConfig` but the
    objective's `left_out_flags`, with the objective's `flag_overrides`, and the objective's own
    `option` fields.

    Args:
      name: the app's name: run folders are called NAME_DATASET_MODEL by default.
      started: `time.perf_counter()` at the app's start (the run's wall time counts from it).
      recipe: the `--recipe` default. Other than "auto", the digits data still gets the digits
        recipe unless `--recipe` is given.
      recipe_help: the `--recipe` help (default: the objective's, which explains "auto").
      objective: a `vit_keras.tools.objectives.Objective` class (default: `Classification`).
    """
    from vit_keras.tools import config_flags, objectives, training

    objective = objective or objectives.Classification
    overrides = {field: dict(settings) for field, settings in objective.flag_overrides.items()}
    overrides.setdefault("recipe", {}).update(
        default=recipe, **({"help": recipe_help} if recipe_help else {}))
    module_name = _backend.flag_module()
    config_flags.define_flags(training.RunConfig, module_name=module_name,
                              leave_out=objective.left_out_flags, **overrides)
    config_flags.define_flags(objective, module_name=module_name)

    @exit_on_user_error
    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
        from vit_keras.tools.run_folder import RunFolder

        if recipe != "auto" and FLAGS.dataset == "digits" and not FLAGS["recipe"].present:
            FLAGS.recipe = "digits"  # before flags.txt records it: a rerun then replays the same
        check_weights(FLAGS.weights, FLAGS.model)  # now, not after the data has loaded
        config = config_flags.from_flags(training.RunConfig, leave_out=objective.left_out_flags,
                                         flags_text=run_flags_text(module_name))
        run_objective = config_flags.from_flags(objective)
        metrics = training.run(config, app=name, started=started, objective=run_objective)
        print()
        print(run_objective.summary(metrics))
        process = metrics.get("process", {"index": 0})
        if process["index"]:
            print(f"\nProcess {process['index']} of {process['count']}: process 0 writes "
                  f"{RunFolder.of_model(metrics['model_path']).path}.")
            return 0
        print(f"\n{'Model:' if metrics.get('already_complete') else 'Saved model:'} "
              f"{metrics['model_path']}")
        print(f"Metrics:     {RunFolder.of_model(metrics['model_path']).metrics}")
        return 0

    return main


def run_settings(model_path):
    """dataset, data_dir, seed and val_fraction of the run that wrote `model_path`, if known."""
    from vit_keras.tools.run_folder import RunFolder

    run = ((RunFolder.of_model(model_path).read_metrics() or {}).get("config") or {}).get("run")
    return {key: run.get(key) for key in ("dataset", "data_dir", "seed", "val_fraction")} if run else {}


def load_run_splits(model_path, dataset=None, data_dir=None, seed=None, val_fraction=None):
    """`(dataset name, Splits)` for evaluating the model at `model_path`: each setting from its
    flag, else from the run that trained the model when it is the same dataset (so `val` and `test`
    are that run's held-out images), else the defaults (digits, seed 0).

    Raises `vit_keras.tools.data.DatasetNotPreparedError` for a tfds dataset not on disk.
    """
    from vit_keras.tools import data

    settings = run_settings(model_path)
    dataset = dataset or settings.get("dataset") or "digits"
    same_run = dataset == settings.get("dataset")
    seed = seed if seed is not None else (settings.get("seed") if same_run else 0) or 0
    splits = data.load_splits(
        dataset, data_dir=data_dir or (settings.get("data_dir") if same_run else None),
        val_fraction=val_fraction or (settings.get("val_fraction") if same_run else None),
        seed=seed)
    return dataset, splits


def model_image_size(model):
    """The side of the square images a model is fed by the apps' pipelines: its input's, or for a
    model of dynamic image size the size it was built for."""
    from vit_keras.tools import training

    return training.model_image_size(model)


def exit_on_user_error(main):
    """Wraps an absl main: a user's mistake ends the app with one line, `ERROR: <what was wrong
    and what to do>`, and status 2, without a traceback or the `--help` text.

    A user's mistake is an `app.UsageError` (a flag's value), a `vit_keras.errors.UserError`
    (a release without its variant, a checkpoint that cannot be loaded, data not prepared, weights
    that cannot be downloaded, a busy run folder, a diverged loss, ...), or a `ValueError` or a
    missing, existing or wrong kind of path (`FileNotFoundError`, `FileExistsError`,
    `NotADirectoryError`, `IsADirectoryError`) raised by the code of vit_keras or of the apps: an
    unknown variant, an image size the patch size does not divide, a missing image folder. The
    same errors raised inside Keras, TensorFlow, JAX, torch or NumPy keep their traceback: they are
    bugs to report. (The traceback test, `_raised_by_own_code`, stays for the plain `ValueError`s
    of the library's argument checks, `get_config`, `build_vit`, the recipes' and the data
    pipeline's: a program that passes a bad argument is not a user's mistake, so they are not
    `UserError`s.)
    """
    import functools

    from vit_keras import errors

    @functools.wraps(main)
    def wrapped(argv):
        try:
            return main(argv)
        except (app.UsageError, errors.UserError) as error:
            message = str(error)
        except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
                IsADirectoryError) as error:
            if not _raised_by_own_code(error):
                raise
            message = str(error)
        print(f"ERROR: {message}", file=sys.stderr)
        return 2

    return wrapped


def _raised_by_own_code(error):
    """Whether the innermost frame of `error`'s traceback is in vit_keras or in apps/."""
    import traceback

    import vit_keras

    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    roots = (os.path.dirname(os.path.abspath(vit_keras.__file__)),
             os.path.dirname(os.path.abspath(__file__)))
    return os.path.abspath(frames[-1].filename).startswith(tuple(root + os.sep for root in roots))
