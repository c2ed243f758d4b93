"""What several apps share, once. Import after `_backend.start_app()` (Keras comes in lazily)."""

import json
import os
import sys
import zipfile

from absl import app, flags
import numpy as np

import _app_output
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
    from vit_keras.tools.runs.run_folder import RunFolder, load_class_names

    if path:
        if not os.path.isfile(path):
            raise app.UsageError(f"--class_names {path} is not a file.")
        return load_class_names(path)
    return RunFolder.of_model(model_path).read_class_names()


def check_weights(weights, variant, image_size=None):
    """`--weights` checked by the library's one check (`vit_keras.weights.pretrained.release_of`) before
    anything slow loads: the `Release` it names for `--model`'s variant, or None for a file, a
    folder, a hub id or no `--weights`. Downloads nothing; of a `.keras` file it reads only the
    architecture (`check_keras_weights`).

    Raises the library's user errors; a release name without a variant names the flag to pass,
    `--model`, in the library's sentence.
    """
    from vit_keras import errors
    from vit_keras.weights import pretrained

    if not weights:  # `--weights=` as no --weights
        return None
    if weights.endswith(".keras"):
        check_keras_weights(weights, variant)
        return None
    try:
        return pretrained.release_of(weights, variant, image_size)
    except errors.ReleaseNeedsVariantError as error:
        raise errors.ReleaseNeedsVariantError(error.release, variant_flag="--model") from None


# The architecture fields a `.keras` file's layers state, and the `ViTConfig` fields they are.
_ARCHITECTURE_FIELDS = ("patch_size", "hidden_size", "mlp_dim", "num_heads", "num_layers",
                        "resnet_layers", "resnet_width")


def check_model_file(path, flag="--model"):
    """Refuses, in one line and before anything loads, a `path` that is missing, a folder, not
    named `.keras`, not a Keras model archive (a zip holding `config.json`), or one that would
    exhaust memory when loaded (`vit_keras.check_keras_file`)."""
    if not os.path.exists(path):
        raise app.UsageError(f"{flag} {path}: no such file.")
    if not os.path.isfile(path):
        raise app.UsageError(f"{flag} {path} is a folder; give a .keras model file.")
    if not path.endswith(".keras"):
        raise app.UsageError(f"{flag} {path} is not a .keras file; give a model saved by "
                             f"model.save (a run's model.keras, or apps/convert.py's output).")
    if not (zipfile.is_zipfile(path) and _holds_config(path)):
        raise app.UsageError(f"{flag} {path} is not a Keras model file (a zip archive holding "
                             f"config.json): it is damaged or of another format.")
    from vit_keras.weights import keras_files  # pylint: disable=import-outside-toplevel

    try:
        keras_files.check_keras_file(path)
    except keras_files.KerasFileError as error:
        raise app.UsageError(f"{flag} {error}") from None


def _holds_config(path):
    try:
        with zipfile.ZipFile(path) as archive:
            return "config.json" in archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return False


def load_keras_model(path, flag="--model"):
    """The model in the `.keras` file at `path`, without its training state, on the app's
    backend; a file that is not one (`check_model_file`), or that Keras cannot rebuild, is a
    one-line error naming `flag`."""
    check_model_file(path, flag)
    import keras

    import vit_keras  # noqa: F401  (registers the layers for loading)

    try:
        return keras.saving.load_model(path, compile=False)
    except (ValueError, TypeError, KeyError, OSError, zipfile.BadZipFile) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise app.UsageError(f"{flag} {path} could not be loaded as a Keras model: {reason}") \
            from None


def keras_file_architecture(path):
    """The ViT architecture a `.keras` file's config states, `{field: value}` of
    `_ARCHITECTURE_FIELDS` (a masked patch prediction model's encoder included), read from its
    `config.json` alone; `None` when it holds no vit_keras ViT."""
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    found = {"num_layers": 0, "resnet_layers": None, "resnet_width": 1}

    def walk(node):
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        kind, settings = node.get("class_name"), node.get("config")
        if isinstance(settings, dict):
            if kind == "ViT" and isinstance(settings.get("variant"), dict):
                variant = settings["variant"]  # a vit_keras.ViT saves its variant's fields
                found.update({name: variant.get(name) for name in _ARCHITECTURE_FIELDS
                              if name in variant})
                found["resnet_layers"] = (None if variant.get("resnet_layers") is None
                                          else tuple(variant["resnet_layers"]))
                found["resnet_width"] = variant.get("resnet_width", 1)
            elif kind == "PatchEmbedding":
                found.update(patch_size=settings.get("patch_size"),
                             hidden_size=settings.get("hidden_size"))
            elif kind == "TransformerBlock":
                found["num_layers"] += 1
                found.update(num_heads=settings.get("num_heads"),
                             mlp_dim=settings.get("mlp_dim"))
            elif kind == "ResNetStem":
                found.update(resnet_layers=tuple(settings.get("num_layers") or ()),
                             resnet_width=settings.get("width_factor", 1))
        for value in node.values():
            walk(value)

    walk(config)
    return found if found["num_layers"] and "hidden_size" in found else None


def check_keras_weights(path, variant):
    """`--weights` as a `.keras` file: refused in one line when it is not one, or when `--model`
    names another architecture than the file holds (the run would train the file's and record
    `--model`'s). Reads the file's `config.json` only."""
    from vit_keras.model import configs
    from vit_keras.tools.runs import recipes

    check_model_file(path, "--weights")
    if not variant:
        return
    try:
        architecture = keras_file_architecture(path)
    except (ValueError, KeyError, zipfile.BadZipFile) as error:
        raise app.UsageError(f"--weights {path}: its config.json cannot be read ({error}).") \
            from None
    if architecture is None:
        raise app.UsageError(f"--weights {path} holds no vit_keras ViT, so it cannot be the "
                             f"--model {variant} asked for; leave --model out or give a ViT.")
    config = configs.get_config(recipes.variant_config(variant))
    differ = [f"{name} {architecture[name]} (--model {variant}: {getattr(config, name)})"
              for name in _ARCHITECTURE_FIELDS if architecture[name] != getattr(config, name)]
    if differ:
        raise app.UsageError(
            f"--weights {path} does not hold a {variant}: {', '.join(differ)}. Leave --model "
            f"out to fine-tune the file's own architecture, or give the variant it holds.")


class ReloadMismatchError(Exception):
    """A saved `.keras` file does not compute what the model that wrote it computes."""


def verify_reload(model, path, tolerance=1e-5, shown_as=None):
    """Reloads `path` and compares it with `model` on a fixed random image; returns the largest
    difference, or raises `ReloadMismatchError` (naming `shown_as`, default `path`).

    Compares the logits and, where the model has a `head` layer, the features it takes: a new
    head is zero-initialised, and zeros match zeros whatever the weights under them hold.
    """
    import keras

    import vit_keras

    reloaded = keras.models.load_model(path)
    shown_as = shown_as or path
    images = np.random.default_rng(0).uniform(0, 255, (1, *model.input_shape[1:])).astype(
        "float32")

    def outputs(m):
        heads = m.heads if isinstance(m, vit_keras.ViT) else []
        probe = keras.Model(m.input, [m.output, *[head.input for head in heads]])
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


NORMALIZATION_NAMES = ("inception", "imagenet", "clip")
"""`--normalization`'s choices: the names of `vit_keras.NORMALIZATIONS` (a test keeps them equal;
the flag is defined before Keras is imported)."""


def define_checkpoint_flags():
    """`--normalization` and `--timm_architecture`, for the apps that build a model from
    `--weights`: what a checkpoint file may not say itself."""
    flags.DEFINE_enum(
        "normalization", None, NORMALIZATION_NAMES,
        "How the weights' pixels were normalised in training, which the model then does itself: "
        "inception ((x - 127.5) / 127.5, the paper's), imagenet (ImageNet's mean and std: DeiT, "
        "DINOv2, MAE) or clip. Default: what the weights say (the release table, timm's "
        "config.json or model name, the Hugging Face image processor), else inception with a "
        "warning.")
    flags.DEFINE_string(
        "timm_architecture", None,
        "For a timm state dict: the timm model name (e.g. vit_base_patch16_clip_quickgelu_224."
        "openai), which says what its keys cannot: CLIP's GELU, LayerNorm epsilon, heads, "
        "normalisation. Default: the architecture in timm's config.json beside the file.")


def checkpoint_options():
    """The `build_model_from_checkpoint` arguments of `define_checkpoint_flags`' flags given."""
    given = {"normalization": FLAGS.normalization, "timm_architecture": FLAGS.timm_architecture}
    return {name: value for name, value in given.items() if value is not None}


def define_model_output_flags():
    """`--out` (a `.keras` path) and `--overwrite`, for the apps that write one model file."""
    flags.DEFINE_string("out", None, "Output .keras file, e.g. saved_models/NAME.keras.",
                        required=True)
    flags.DEFINE_bool("overwrite", False, "Replace --out if it exists (without it, an existing "
                      "file stops the program before any work).")


def check_model_output(out, overwrite):
    """Refuses, before any work, an `--out` that is not a `.keras` path, or one `check_output_file`
    refuses: a model written earlier is never replaced without `--overwrite`."""
    if not out.endswith(".keras"):
        raise app.UsageError(f"--out must end with .keras; got {out!r}.")
    check_output_file("--out", out, overwrite)


def check_output_file(flag, path, overwrite):
    """Refuses, before any work, a file to write at `path` (given as `flag`) that is a symbolic
    link (a file is written, never through a link) or a folder, whose folder is not one (a file
    or a dangling link in its path), or that exists and is not to be overwritten. Missing folders
    above it are fine: the writer creates them."""
    if os.path.islink(path):
        raise app.UsageError(f"{flag} {path} is a symbolic link (to {os.readlink(path)}); give "
                             f"the path of the file itself.")
    if os.path.isdir(path):
        raise app.UsageError(f"{flag} {path} is a folder; give the path of a file.")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):  # the nearest existing folder above it: created below
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise app.UsageError(f"{flag} {path}: {folder} is not a folder"
                             + (" (a symbolic link to nothing)" if os.path.islink(folder) else "")
                             + f"; choose another {flag}.")
    if os.path.exists(path) and not overwrite:
        raise app.UsageError(f"{path} exists already: pass --overwrite to replace it, or choose "
                             f"another {flag}.")


def define_json_flags(what):
    """`--json` (a report written beside what the app prints) and `--overwrite`, listed by the
    calling app's `--help`."""
    module_name = _backend.flag_module()
    flags.DEFINE_string("json", None, f"Also write {what} as JSON to this path.",
                        module_name=module_name)
    flags.DEFINE_bool("overwrite", False, "Replace the --json file if it exists (without it, an "
                      "existing file stops the program before any work).", module_name=module_name)


def check_json_output():
    """`--json`, refused before any work as `check_output_file` refuses a file (an earlier
    report is not replaced without `--overwrite`)."""
    if FLAGS.json:
        check_output_file("--json", FLAGS.json, FLAGS.overwrite)


def write_json(data):
    """`data` as indented JSON at `--json` (its folders created), whole or not at all."""
    from vit_keras.tools.runs import run_folder

    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
    run_folder.atomic_write_json(data, FLAGS.json)


def save_checked_model(model, out):
    """Writes `model` to `out` once a reload of it computes what `model` computes: saved under a
    temporary name, reloaded and compared (`verify_reload`), then renamed into place, so `out` is
    never a partial or a wrong file. Returns the largest difference; raises
    `ReloadMismatchError` (the temporary file deleted)."""
    from vit_keras import atomic_files

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with atomic_files.replacing(out, ".keras") as temporary:
        model.save(temporary)
        return verify_reload(model, temporary, shown_as=out)


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


PROGRESS_HELP = ("Keras fit verbosity: 1 progress bars, 2 one line per epoch (default: 1 when "
                 "the standard output is a terminal, else 2, fit for a log file).")


def progress_verbosity():
    """Keras' `verbose` for the apps' `fit`: progress bars (1) on a terminal; elsewhere (a log
    file, a pipe) one line per epoch (2), since a bar redrawn after every step fills a log."""
    return 1 if sys.stdout.isatty() else 2


def training_app(name, started, recipe="auto", recipe_help=None, objective=None):
    """Defines the training flags under the calling app and returns its absl main, which runs
    `training.run` with the objective and prints the objective's summary.

    The flags are the `option` fields of `vit_keras.tools.runs.run_config.RunConfig` but the
    objective's `left_out_flags`, with the objective's `flag_overrides`, and the objective's own
    `option` fields.

    Args:
      name: the app's name: run folders are called NAME_DATASET_MODEL by default.
      started: `time.perf_counter()` at the app's start (the run's wall time counts from it).
      recipe: the `--recipe` default. Other than "auto", a dataset with a recipe of its own
        (`recipes.DATASET_DEFAULTS`: the digits) still gets it unless `--recipe` is given.
      recipe_help: the `--recipe` help (default: the objective's, which explains "auto").
      objective: a `vit_keras.tools.runs.objectives.Objective` class (default: `Classification`).
    """
    from vit_keras.tools.runs import config_flags, objectives, recipes, training

    objective = objective or objectives.Classification
    overrides = {field: dict(settings) for field, settings in objective.flag_overrides.items()}
    overrides.setdefault("recipe", {}).update(
        default=recipe, **({"help": recipe_help} if recipe_help else {}))
    overrides.setdefault("verbose", {}).update(default=None, help=PROGRESS_HELP)
    module_name = _backend.flag_module()
    config_flags.define_flags(training.RunConfig, module_name=module_name,
                              leave_out=objective.left_out_flags, **overrides)
    config_flags.define_flags(objective, module_name=module_name)

    @exit_on_user_error
    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
        from vit_keras.tools.runs.run_folder import RunFolder

        own = recipes.dataset_recipe(objective.recipes, FLAGS.dataset)
        if recipe != "auto" and own is not None and not FLAGS["recipe"].present:
            FLAGS.recipe = own.name  # before flags.txt records it: a rerun then replays the same
        check_weights(FLAGS.weights, FLAGS.model)  # now, not after the data has loaded
        config = config_flags.from_flags(training.RunConfig, leave_out=objective.left_out_flags,
                                         flags_text=run_flags_text(module_name))
        if config.output.verbose is None:  # after flags.txt: a replay decides for its own output
            config = config.replace(verbose=progress_verbosity())
        run_objective = config_flags.from_flags(objective)
        with _app_output.quiet_failed_checkpoint_writes():
            metrics = training.run(config, app=name, started=started, objective=run_objective)
        print()
        print(run_objective.summary(metrics))
        process = metrics.get("process", {"index": 0})
        if process["index"]:
            print(f"\nProcess {process['index']} of {process['count']}: process 0 writes "
                  f"{RunFolder.of_model(metrics['model_path']).path}.")
            return 0
        print(f"\n{'Model:      ' if metrics.get('already_complete') else 'Saved model:'} "
              f"{metrics['model_path']}")
        print(f"Metrics:     {RunFolder.of_model(metrics['model_path']).metrics}")
        return 0

    return main


def run_settings(model_path):
    """dataset, data_dir, seed, val_fraction and max_num_patches of the run that wrote
    `model_path`, if known."""
    from vit_keras.tools.runs.run_folder import RunFolder

    run = ((RunFolder.of_model(model_path).read_metrics() or {}).get("config") or {}).get("run")
    keys = ("dataset", "data_dir", "seed", "val_fraction", "max_num_patches")
    return {key: run.get(key) for key in keys} if run else {}


def define_max_num_patches_flag():
    """`--max_num_patches`, for the apps that feed a NaFlex model images (predict, evaluate)."""
    from vit_keras.tools.runs import config_flags

    config_flags.define_number(
        "max_num_patches", None, "For a NaFlex model (ViT(naflex=True), apps/finetune.py "
        "--max_num_patches): the most patches each image is resized to at its own aspect ratio "
        "(vit_keras.naflex_size). Default: the training run's, from metrics.json beside the "
        "model, else the patches of the model's position grid.", bounds="[1, inf)", kind=int)


def naflex_batching(model, model_path=None):
    """`vit_keras.tools.data.naflex.NaFlexBatching` of a NaFlex `model` (None for a model of
    square images, where --max_num_patches is refused), at --max_num_patches, else the budget
    `define_max_num_patches_flag` names."""
    from vit_keras import model as model_lib

    given = FLAGS.max_num_patches
    if not getattr(model, "naflex", False):
        if given is not None:
            raise app.UsageError(f"--max_num_patches is for NaFlex models; {model.name} takes "
                                 f"square images of its own size.")
        return None
    from vit_keras.tools.data import naflex

    vit = model_lib.ViT.of(model)
    rows, cols = vit.token_grid
    budget = (given or (model_path and run_settings(model_path).get("max_num_patches"))
              or rows * cols)
    return naflex.NaFlexBatching(int(budget), patch_size=vit.token_pixels)


def load_run_splits(model_path, dataset=None, data_dir=None, seed=None, val_fraction=None):
    """`(dataset name, Splits)` for evaluating the model at `model_path`: each setting from its
    flag, else from the run that trained the model when it is the same dataset (so `val` and `test`
    are that run's held-out images), else the defaults (digits, seed 0).

    Raises `vit_keras.tools.data.DatasetNotPreparedError` for a tfds dataset not on disk.
    """
    from vit_keras.tools import data

    settings = run_settings(model_path)
    dataset = dataset or settings.get("dataset") or data.DIGITS  # load_splits' default
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
    from vit_keras.tools.runs import training

    return training.model_image_size(model)


def define_resize_only_flag():
    """`--resize_only`, for the apps that feed a model images (predict, evaluate)."""
    flags.DEFINE_bool(
        "resize_only", False,
        "Resize each image to the model's input size (bilinear, what vit_keras runs train and "
        "evaluate with) instead of the evaluation transform its weights state (a timm "
        "checkpoint's crop_pct and interpolation, or a transformers image processor's crop: the "
        "shorter side resized to size / crop_pct, then the centre cropped, as timm's data "
        "config does; the model's eval_crop).")


def eval_crop(model):
    """The evaluation transform the apps feed `model` with (`vit_keras.tools.data.eval_resize`):
    the model's `eval_crop` (None for a model of an earlier vit_keras), None with --resize_only."""
    return None if FLAGS.resize_only else getattr(model, "eval_crop", None)


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
    of the library's argument checks, `get_config`, `ViT`, the recipes' and the data
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
