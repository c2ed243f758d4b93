"""One training run: `RunConfig` (the apps' flags, grouped by concern: `run_config`) and an
`objectives.Objective` → `run` → `saved_models/<run_name>/`. `run` chooses the run's optional
parts once (`run_parts.choose`: LoRA, linear probe, remat, layer decay, EMA) and goes through
named steps, calling each part's hooks: `_prepare` (recipe, data, schedule, resumption point,
compiled model), `_train` (`fit`, or nothing when resumed after training) and `_report` (the
objective's evaluation, the model, metrics.json last)."""

import contextlib
import dataclasses
import importlib.util
import io
import math
import os
import shutil
import tempfile
import time
import warnings

import keras

from vit_keras import errors
from vit_keras import model as model_lib
from vit_keras.model import configs as configs_lib
from vit_keras.tools import finetuning, plots
from vit_keras.tools.distributed import distribution as distribution_lib
from vit_keras.tools.distributed import memory
from vit_keras.tools.runs import callbacks as callbacks_lib
from vit_keras.tools.runs import config_flags, run_parts
from vit_keras.tools.runs import objectives as objectives_lib
from vit_keras.tools.runs import recipes as recipes_lib
from vit_keras.tools.runs import run_folder as run_folder_lib
from vit_keras.tools.runs.run_config import RunConfig
from vit_keras.tools.runs.run_folder import (
    RunFolder,
    RunFolderError,
    RunFolderMismatchError,
    parse_flags_text,
)
from vit_keras.training import masked_patch_prediction
from vit_keras.weights import keras_files, pretrained
from vit_keras.weights.checkpoints import save_npz

CLASSIFICATION = objectives_lib.Classification()

# The flags that may differ between two runs into one run folder (a resume, or a rerun of a
# finished run): where the folder is, how much the run prints, whether tfds may download, and how
# the processes of a multi-process run find each other. Every other flag says what is trained, so
# a rerun that changes one is refused (`finished_run`).
FLAGS_A_RERUN_MAY_CHANGE = ("output_dir", "run_name", "verbose", "download",
                            "coordinator_address", "process_id", "peer_timeout", "num_processes")


# The flags that override a field of the recipe of the same name.
RECIPE_FLAGS = ("optimizer", "learning_rate", "momentum", "weight_decay", "grad_clip_norm",
                "warmup_steps", "decay", "total_steps", "epochs", "batch_size", "image_size",
                "label_smoothing", "dropout")


def resolve_recipe(config, objective=CLASSIFICATION):
    """The run's `recipes.Recipe`: the objective's base recipe (`Objective.choose_recipe`) with
    every explicitly given field replaced, and why the base was chosen.

    With `--weights` on a recipe of `recipes.WEIGHTS_IMAGE_SIZE_RECIPES` (the digits') and no
    `--image_size`, `image_size` is `None`: the weights' own size, known once the model is built
    (`run` fills it in). A model pre-trained on the digits at 16 px is fine-tuned on them at
    16 px."""
    base, reason = objective.choose_recipe(config)
    given = config.flags()
    overrides = {name: given[name] for name in RECIPE_FLAGS if given[name] is not None}
    if given["total_steps"] is not None and given["epochs"] is None:
        overrides["epochs"] = None   # an explicit step count wins over the recipe's epochs
    if (given["weights"] and given["image_size"] is None
            and base.name in recipes_lib.WEIGHTS_IMAGE_SIZE_RECIPES):
        overrides["image_size"] = None
    return dataclasses.replace(base, **overrides), reason


def default_run_name(config, app="finetune", backend=None):
    """A deterministic name, so the same command finds the same run folder (and resumes it):
    `APP_DATASET_MODEL[_METHOD]_BACKEND`, where MODEL is the variant (with the release name) or
    the weights file's name (a run's `model.keras`: its run folder's), METHOD the fine-tuning
    method (`lora4`, `linear-probe`, `layer-decay0.75`) and BACKEND the Keras backend (default:
    the one in use). Runs that differ in anything else share the name, and a rerun with other
    flags is refused (`finished_run`)."""
    dataset = config.data.dataset.replace("folder:", "folder-").strip("/").replace("/", "_")
    weights = config.model.weights
    model = (config.model.model or _default_variant(config)).replace("/", "_")
    if pretrained.is_release_name(weights):
        model = f"{model}_{weights}"  # one release serves many variants
    elif weights:
        path = weights.rstrip("/")
        model = os.path.splitext(os.path.basename(path))[0]
        if os.path.basename(path) == "model.keras":  # a run's model: name it by its run
            model = os.path.basename(os.path.dirname(os.path.abspath(path))) or model
    methods = [part.run_name for part in run_parts.choose(config) if part.run_name]
    return "_".join([app, dataset, model, *methods, backend or keras.backend.backend()])


def _default_variant(config):
    """The variant of a run without `--model`: the dataset's own (`recipes.DATASET_DEFAULTS`)
    when it starts from scratch, else ViT-B/16."""
    if config.model.weights:
        return recipes_lib.DEFAULT_VARIANT
    return recipes_lib.dataset_defaults(config.data.dataset).model


def run_flags_text(config, objective=CLASSIFICATION):
    """The run's `flags.txt`: `config.flags_text` (the app's flags), or for a run started from
    Python the same lines made from `config` and the objective's options (with `--backend`), so
    the file replays it with the app and guards its folder as an app's does."""
    if config.flags_text is not None:
        return config.flags_text
    lines = [*config_flags.flag_lines(config, leave_out=("overwrite", *objective.left_out_flags)),
             *(config_flags.flag_lines(objective) if dataclasses.is_dataclass(objective) else []),
             f"--backend={keras.backend.backend()}"]
    return "".join(f"{line}\n" for line in sorted(lines))


def _boolean_flags(objective=CLASSIFICATION):
    configs = [RunConfig] + ([type(objective)] if dataclasses.is_dataclass(objective) else [])
    return {field.name for config in configs for field in config_flags.flag_fields(config)
            if field.type in (bool, "bool")}


def differing_flags(recorded, given, objective=CLASSIFICATION):
    """`[(flag, value in recorded, value in given)]` for each flag but
    `FLAGS_A_RERUN_MAY_CHANGE` whose value differs between two flags.txt texts (`None`: not
    given), in name order."""
    booleans = _boolean_flags(objective)
    recorded = parse_flags_text(recorded, booleans)
    given = parse_flags_text(given, booleans)
    return [(name, recorded.get(name), given.get(name)) for name in sorted({*recorded, *given})
            if name not in FLAGS_A_RERUN_MAY_CHANGE and recorded.get(name) != given.get(name)]


def set_precision(mixed_precision):
    """`none`, `bfloat16` or `float16` → Keras' global dtype policy (call before building)."""
    policies = {"none": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}
    if mixed_precision not in policies:
        raise ValueError(f"Unknown mixed precision {mixed_precision!r}; expected one of "
                         f"{sorted(policies)}.")
    keras.mixed_precision.set_global_policy(policies[mixed_precision])


def build_run_model(config, recipe, num_classes, log=print):
    """The ViT of a run: from `--weights` (a release name with `--model`, a checkpoint or a
    `.keras` file) or freshly initialised."""
    settings, weights = config.model, config.model.weights
    options = {"dropout": recipe.dropout, "attention_dropout": settings.attention_dropout,
               "drop_path_rate": settings.drop_path_rate,
               "naflex": bool(settings.max_num_patches)}
    if weights and weights.endswith(".keras"):
        keras_files.check_keras_file(weights)
        loaded = keras.saving.load_model(weights, compile=False)
        size = model_image_size(loaded)
        if masked_patch_prediction.is_pretraining_model(loaded):
            # apps/pretrain.py's model: fine-tune its ViT, without [mask] token and MPP head.
            log(f"{weights} is a masked patch prediction model: fine-tuning its encoder.")
            loaded = masked_patch_prediction.pretrained_encoder(loaded)
        else:
            loaded = model_lib.ViT.of(loaded)  # a file of an earlier vit_keras: adopted
            if (loaded.output_shape[-1] == num_classes and recipe.image_size in (None, size)
                    and loaded.naflex == options["naflex"]):
                log(f"Continuing from {weights} (same classes and image size).")
                return loaded
        # Another head or resolution: go through the npz layout, which resamples position
        # embeddings and zero-initialises a new head (one mechanism for every weight source),
        # and keeps neither the model's name (its family's) nor its evaluation crop.
        with tempfile.TemporaryDirectory() as scratch:
            path = save_npz(loaded, os.path.join(scratch, "weights.npz"))
            return pretrained.build_model_from_checkpoint(
                path, image_size=recipe.image_size, num_classes=num_classes,
                include_top=True, name=loaded.name, eval_crop=getattr(loaded, "eval_crop", None),
                **options)
    if weights:
        # A release name without --model: pretrained.release_of raises ReleaseNeedsVariantError
        # (one check, one message; the apps make it before the data loads).
        given = {"representation_size": settings.representation_size,
                 "normalization": settings.normalization,
                 "timm_architecture": settings.timm_architecture}
        return pretrained.build_model_from_checkpoint(
            weights, variant=settings.model, image_size=recipe.image_size,
            num_classes=num_classes, include_top=True,
            **{name: value for name, value in given.items() if value}, **options)
    name = settings.model or _default_variant(config)
    variant = recipes_lib.variant_config(name)
    classifier = settings.classifier or recipes_lib.default_classifier(name)
    configs_lib.get_config(variant)  # validates the name with a clear error
    return pretrained.build_model(
        variant, image_size=recipe.image_size, num_classes=num_classes, classifier=classifier,
        representation_size=settings.representation_size, **options)


def augmentation_for(config):
    """The run's `data.Augmentation`: the flags', else the dataset's defaults
    (`recipes.DATASET_DEFAULTS`)."""
    from vit_keras.tools import data  # tf.data: TensorFlow loads when a run starts, not at import

    given, defaults = config.augmentation, recipes_lib.dataset_defaults(config.data.dataset)
    crop = given.crop_min_area if given.crop_min_area is not None else defaults.crop_min_area
    flip = given.flip if given.flip is not None else defaults.flip
    randaugment = None
    if given.randaugment:
        try:
            num_ops, magnitude = given.randaugment.split(",")
            randaugment = (int(num_ops), float(magnitude))
        except ValueError:
            raise ValueError(f"--randaugment takes NUM_OPS,MAGNITUDE (e.g. 2,0.5); got "
                             f"{given.randaugment!r}.") from None
    return data.Augmentation(crop_area=(float(crop), 1.0), flip=bool(flip),
                             randaugment=randaugment, mixup=given.mixup, cutmix=given.cutmix)


def _rng_seed(seed):
    keras.utils.set_random_seed(seed)
    import tensorflow as tf  # TF ops without a seed of their own read its global seed

    tf.random.set_seed(seed)


@contextlib.contextmanager
def _no_length_warning(multi_process):
    """With several processes, Keras' per-process split of an evaluation set (rebatch, shard)
    loses its length, so Keras finds its end by running out and warns "Your input ran out of
    data; interrupting training" at its first pass, though nothing is interrupted."""
    with warnings.catch_warnings():
        if multi_process:
            warnings.filterwarnings("ignore", message="Your input ran out of data")
        yield


def model_image_size(model):
    """The side of the square images a built model takes: its input's, or for a model of dynamic
    image size the size it was built for."""
    height = model.input_shape[1]
    return height if height is not None else model_lib.ViT.of(model).image_size[0]


def finished_run(folder, overwrite=False, processes=distribution_lib.Processes(), log=print,
                 flags_text=None, objective=CLASSIFICATION):
    """What a run folder holds before a run starts in it, decided by process 0 for all (call
    while holding the folder's lock).

    Without `overwrite`, a folder whose `flags.txt` records other flags than `flags_text` (the
    new run's, `run_flags_text`) in anything but `FLAGS_A_RERUN_MAY_CHANGE` holds another run:
    `RunFolderMismatchError` names each differing flag with both values, and nothing changes.
    Returns the finished run's metrics (from `metrics.json`, with `"already_complete": True`)
    when the folder holds one and `overwrite` is false: nothing is to be done. Otherwise returns
    `None` after removing, on process 0, what `overwrite` discards (everything, from a run
    folder only: `RunFolder.clear`), the temporary files of interrupted writes and the unfinished
    last row of a history.csv (an unfinished run then resumes from its backup). `RunFolderError`
    when the folder has a symbolic link in it (`RunFolder.refuse_links`)."""
    refusal, complete = None, False
    if processes.is_chief and not overwrite:
        recorded = folder.read_flags_text() if flags_text is not None else None
        differing = differing_flags(recorded, flags_text, objective) if recorded else []
        if differing:
            refusal = (
                f"{folder.path} holds a run made with other flags (its flags.txt): "
                + "; ".join(f"--{name} {_shown(old)} there, {_shown(new)} now"
                            for name, old, new in differing)
                + ". Pass another --run_name for a new run, or --overwrite to delete this one "
                  "and start over (only --" + ", --".join(FLAGS_A_RERUN_MAY_CHANGE)
                + " may change between runs in one folder).")
        complete = refusal is None and folder.is_complete()
    status = distribution_lib.process_values(2 if refusal else int(complete), processes)[0]
    if status == 2:
        raise RunFolderMismatchError(refusal or f"Process 0 refused the run folder {folder.path}: "
                                                f"its flags.txt records other flags (see its log).")
    if status == 1:
        log(f"Run {folder.path} is complete (its metrics.json is written): nothing to do. Pass "
            f"--overwrite to train it again, or another --run_name.")
        return {**(folder.read_metrics() or {}), "already_complete": True}
    error = None
    if processes.is_chief:
        try:
            if overwrite and [name for name in os.listdir(folder.path)
                              if os.path.join(folder.path, name) != folder.lock]:
                folder.clear()  # refuses a folder that is no run folder, deleting nothing
                log(f"--overwrite: deleted what {folder.path} held; starting the run over.")
            removed = folder.remove_temporary_files()
            if removed:
                log(f"Removed {_count(len(removed), 'temporary file')} of interrupted writes from "
                    f"{folder.path}: {', '.join(removed)}.")
            folder.refuse_links()
            if folder.cut_unfinished_history_row():
                log(f"Cut the unfinished last row of {folder.history} (a write the disk could "
                    f"not finish); its epoch runs again.")
        except RunFolderError as raised:
            error = raised
    # The others wait until that is done, and stop with process 0 when it could not.
    if distribution_lib.process_values(int(error is not None), processes)[0]:
        raise error or RunFolderError(f"Process 0 could not use the run folder {folder.path} "
                                      f"(see its log).")
    return None


def _count(number, noun):
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _shown(value):
    return "unset" if value is None else value


def run(config, app="finetune", log=print, started=None, objective=CLASSIFICATION):
    """Trains `objective` (default: classification) and evaluates one run; writes
    `saved_models/<run_name>/`; returns the metrics dict.

    Files: `model.keras` (after every epoch, atomically), `metrics.json` (atomically, last),
    `flags.txt`, `class_names.json`, `history.csv`, `training_curves.png`, `logs/` (TensorBoard),
    `lock` while the run is in progress, and `backup/` until `metrics.json` is written.
    A folder with `metrics.json` holds a finished run: `run` returns its metrics (with
    `"already_complete": True`) and changes nothing, unless `config.overwrite` starts it over.
    An unfinished run resumes: from the last completed epoch's backup, or, when training had
    finished, at the final evaluation. Another process running in the folder is refused at once
    (`run_folder.RunFolderBusyError`), and so is a folder that cannot be written, holds a
    symbolic link, or, with `overwrite`, holds files no run writes (`run_folder.RunFolderError`),
    and a run name that is not one folder name. A folder whose `flags.txt` records other flags
    than this run's (`run_flags_text`) in anything but `FLAGS_A_RERUN_MAY_CHANGE` is refused
    without `overwrite` (`run_folder.RunFolderMismatchError`, naming the flags).
    With several processes (`config.num_processes`, `distribution.initialize_processes`), every
    process trains, evaluates and saves (saving is collective on JAX), but only process 0 writes
    the run folder (and holds its lock); the others write into a private temporary folder
    deleted at the end.
    Raises `config_flags.FlagRangeError` for a setting outside its flag's range (before anything
    loads), `callbacks.NonFiniteLossError` when the loss becomes NaN or infinite,
    `memory.ActivationMemoryError` when a training step cannot fit in memory, and
    `distribution.MultiProcessError` when several processes cannot be set up.
    """
    started = started or time.perf_counter()
    config_flags.check_ranges(config)  # one line each, before anything loads
    if dataclasses.is_dataclass(objective):
        config_flags.check_ranges(objective)
    parts = run_parts.choose(config, objective)  # their flags checked here, before anything loads
    _check_naflex(config, objective)
    # First: JAX must join the other processes before it computes anything.
    several = config.processes
    processes = distribution_lib.initialize_processes(several.coordinator_address,
                                                      several.num_processes, several.process_id,
                                                      several.peer_timeout)
    compute = config.compute
    distribution = distribution_lib.get(compute.distribution, compute.model_parallel_size,
                                        processes, compute.fsdp_min_bytes)
    output = config.output
    run_name = output.run_name or default_run_name(config, app)
    run_folder_lib.check_run_name(run_name)
    folder = RunFolder(os.path.join(output.output_dir, run_name))
    with folder.locked() if processes.is_chief else contextlib.nullcontext():
        finished = finished_run(folder, output.overwrite, processes, log,
                                run_flags_text(config, objective), objective)
        if finished is not None:
            return finished
        state = _RunState(config, objective, parts, run_name, folder, processes, distribution,
                          log, started)
        try:
            _prepare(state)
            fit_seconds = _train(state)
            return _report(state, fit_seconds)
        except OSError as error:  # history.csv, TensorBoard, the curves: a full disk, one line
            if error.errno not in run_folder_lib.DISK_FULL:
                raise
            raise run_folder_lib.write_error(error.filename or folder.path, error) from None
        finally:  # the process as it was, however the run ended
            set_precision("none")
            distribution.reset()


class NaFlexOptionError(errors.UserError, ValueError):
    """A flag that a NaFlex run (`--max_num_patches`) cannot take."""


def _check_naflex(config, objective):
    """Refuses, in one line, what a NaFlex run does not do (yet): another objective than
    classification, the per-batch augmentations of square images, several processes (each
    would need its slice of every bucket's batch)."""
    if not config.model.max_num_patches:
        for flag in ("tokens_per_batch", "naflex_seq_lens"):
            if getattr(config.optimization, flag):
                raise NaFlexOptionError(f"--{flag} sizes NaFlex batches; it needs "
                                        f"--max_num_patches.")
        return
    lengths = _lengths(config.optimization.naflex_seq_lens) or ()
    if lengths and not 1 <= min(lengths) <= max(lengths) <= config.model.max_num_patches:
        raise NaFlexOptionError(
            f"--naflex_seq_lens {','.join(map(str, lengths))}: each bucket's length must be from "
            f"1 to --max_num_patches {config.model.max_num_patches}.")
    refused = [flag for flag, given in (
        ("an objective other than classification (apps/finetune.py, apps/train.py)",
         type(objective) is not objectives_lib.Classification),
        ("--randaugment", config.augmentation.randaugment),
        ("--mixup", config.augmentation.mixup), ("--cutmix", config.augmentation.cutmix),
        ("--num_processes", (config.processes.num_processes or 1) > 1)) if given]
    if refused:
        raise NaFlexOptionError(
            f"--max_num_patches (NaFlex) trains in one process (on its devices), classifying, "
            f"with the crop and flip as augmentation; it cannot take {', '.join(refused)}.")


@dataclasses.dataclass
class _RunState:
    """One run between its steps: `_prepare` fills in the rest, `_train` trains, `_report`
    evaluates and writes metrics.json."""

    config: RunConfig
    objective: objectives_lib.Objective
    parts: list                  # run_parts.Part: what the run adds to plain training
    name: str
    folder: RunFolder
    processes: distribution_lib.Processes
    distribution: distribution_lib.Distribution
    log: object
    started: float
    writes: RunFolder = None     # process 0: the run folder; the others: a private scratch one
    recipe: recipes_lib.Recipe = None
    reason: str = None
    splits: object = None        # data.Splits of the dataset
    training: object = None      # data.Splits whose "train" split the objective trains on
    replicas: int = 1
    accum: int = 1
    steps_per_epoch: int = None
    epochs: int = None
    total_updates: int = None
    backup: callbacks_lib.AtomicBackupAndRestore = None
    placement: object = None     # fsdp: sharding.Placement, what model.keras gathers
    resume_epoch: int = 0
    model: keras.Model = None
    vit: object = None           # the ViT inside `model` (the model itself when classifying)
    augmentation: object = None  # data.Augmentation
    throughput: callbacks_lib.Throughput = None
    naflex: object = None        # data.naflex.NaFlexBatching of a NaFlex run (--max_num_patches)

    @property
    def trained(self):
        """Whether training had ended before the run was resumed (at its final evaluation)."""
        return self.resume_epoch >= self.epochs

    @property
    def eval_batch(self):
        batch = self.config.optimization.eval_batch_size
        return batch - batch % self.replicas or self.replicas

    def pipeline(self, split, whole_batches=False):
        """A split's evaluation batches at the run's size (`Objective.evaluate`), through the
        model's evaluation transform, as apps/evaluate.py feeds the saved model."""
        from vit_keras.tools import data  # tf.data: TensorFlow loads when a run starts
        from vit_keras.tools.data import naflex

        if self.naflex is not None:
            dataset = self.naflex_inputs(naflex.make_naflex_pipeline(
                self.splits, split, self.naflex, batch_size=self.eval_batch))
        else:
            dataset = data.make_pipeline(self.splits, split, image_size=self.recipe.image_size,
                                         batch_size=self.eval_batch,
                                         eval_crop=getattr(self.vit, "eval_crop", None))
        # Keras' JAX distributions split every batch evenly over the devices (and the processes),
        # so a last, partial batch is padded to a whole one of zero-weight examples.
        if whole_batches and (self.processes.multi or (
                self.replicas > 1 and keras.backend.backend() == "jax")):
            dataset = distribution_lib.pad_to_whole_batches(
                dataset, self.splits.num_examples[split], self.eval_batch)
        return dataset

    def naflex_inputs(self, dataset):
        """A NaFlex pipeline as this run feeds it: on TensorFlow over several replicas,
        `patch_valid` as int32, which the model casts back (MirroredStrategy cannot split a bool
        input: its AddN has no bool kernel)."""
        if self.replicas == 1 or keras.backend.backend() != "tensorflow":
            return dataset
        import tensorflow as tf

        return dataset.map(lambda features, *rest: (
            {**features, "patch_valid": tf.cast(features["patch_valid"], tf.int32)}, *rest))

    def validation(self):
        """The objective's validation split as `fit` validates on it."""
        return self.pipeline(self.objective.validation_split, whole_batches=True)


def _prepare(state):
    """Recipe, data, schedule, resumption point and the compiled model of a run."""
    from vit_keras.tools import data  # tf.data: TensorFlow loads when a run starts

    config, processes, log = state.config, state.processes, state.log
    state.recipe, state.reason = resolve_recipe(config, state.objective)
    log(state.reason + ".")
    # Saving is collective on JAX: every process saves, but only process 0 into the run folder;
    # the others write into a private folder deleted at the end.
    state.writes = (state.folder if processes.is_chief else RunFolder(
        tempfile.mkdtemp(prefix=f"vit_keras-process{processes.index}-")))
    if processes.multi:
        log(f"Process {processes.index} of {processes.count}"
            + ("" if processes.is_chief else f": process 0 writes {state.folder.path}") + ".")
    if processes.is_chief:
        state.folder.write_flags(run_flags_text(config, state.objective))
    _rng_seed(config.seed)
    state.splits = data.load_splits(config.data.dataset, data_dir=config.data.data_dir,
                                    val_fraction=config.data.val_fraction,
                                    download=config.data.download, seed=config.seed, log=log)
    if processes.is_chief:
        state.folder.write_class_names(state.splits.class_names)
    state.training = state.objective.training_splits(state.splits)
    set_precision(config.compute.mixed_precision)
    distribution = state.distribution
    scope = distribution.scope()
    _schedule(state)
    _find_resume_epoch(state)
    with scope:
        _build_and_compile(state)
    resident = 0  # the bytes each device keeps between steps, under a sharding distribution
    placed = distribution.placement(state.model)
    if placed is not None:
        log(f"--distribution {distribution.kind}, {placed.describe()}.")
        resident = placed.parameter_bytes + placed.optimizer_bytes + placed.gradient_bytes
        if distribution.sharded_backup:  # model.keras, at the end, is the first gathering
            state.placement = placed
            shortfall = memory.saving_shortfall(placed.total_parameter_bytes
                                                + placed.total_optimizer_bytes)
            if shortfall:
                log(f"Warning: {shortfall}: the run trains and backs up its epochs without "
                    f"gathering them (sharded Orbax checkpoints), and stops before writing "
                    f"model.keras.")
    if not state.trained:
        # A NaFlex step holds about the tokens of its longest bucket's batch: --batch_size
        # sequences of --max_num_patches, counted as square images of as many patches.
        size = (state.recipe.image_size if state.naflex is None else state.vit.token_pixels
                * math.ceil(math.sqrt(state.naflex.max_num_patches)))
        memory.check_activation_memory(state.vit, state.recipe.batch_size // state.replicas,
                                       size, resident_bytes=resident)
    state.augmentation = augmentation_for(config)
    # An image folder's unreadable files are named in skipped_files.txt as they are met; a resumed
    # run reads it back, so that its stream skips them as the interrupted one did.
    state.splits.record_unreadable(state.folder.skipped_files, resume=bool(state.resume_epoch),
                                   write=processes.is_chief)


def _schedule(state):
    """Replicas, accumulation, steps per epoch, epochs and optimizer updates of a run (call
    once its distribution is set up)."""
    settings, recipe = state.config.optimization, state.recipe
    state.replicas = state.distribution.replicas
    if recipe.batch_size % state.replicas:
        raise ValueError(f"Batch size {recipe.batch_size} is not divisible by the "
                         f"{state.replicas} devices of --distribution {state.distribution.kind}; use "
                         f"a multiple of {state.replicas}.")
    state.accum = max(1, int(settings.accum_steps or 1))
    examples = state.training.num_examples["train"]
    if state.config.model.max_num_patches:
        from vit_keras.tools.data import naflex

        longest = state.config.model.max_num_patches
        state.naflex = naflex.NaFlexBatching(  # the lengths checked by _check_naflex
            longest, seq_lens=_lengths(settings.naflex_seq_lens),
            tokens_per_batch=settings.tokens_per_batch or recipe.batch_size * longest,
            batch_divisor=state.replicas)
        state.steps_per_epoch = settings.steps_per_epoch or state.naflex.steps_per_epoch(examples)
    else:
        state.steps_per_epoch = settings.steps_per_epoch or max(1, examples // recipe.batch_size)
    state.epochs = recipe.epochs or max(
        1, math.ceil(recipe.total_steps * state.accum / state.steps_per_epoch))
    state.total_updates = max(1, state.epochs * state.steps_per_epoch // state.accum)


def _lengths(values):
    """`--naflex_seq_lens`' strings as ints (None when not given)."""
    if not values:
        return None
    try:
        return tuple(int(value) for value in values)
    except ValueError:
        raise NaFlexOptionError(f"--naflex_seq_lens takes whole numbers of patches, e.g. "
                                f"64,128,256; got {','.join(values)}.") from None


def _find_resume_epoch(state):
    """The run's backup and the epoch it resumes after (0: a fresh run), agreed by all
    processes."""
    folder = state.folder
    # The backup outlives `fit`: it is deleted once metrics.json is written, so that a run
    # killed during its final evaluation resumes there instead of training again.
    # fsdp: each process writes its own shards of an Orbax checkpoint, nothing gathered.
    state.backup = callbacks_lib.AtomicBackupAndRestore(
        folder.backup, seed=state.config.seed, save_dir=state.writes.backup,
        sharded=state.distribution.sharded_backup, delete_checkpoint=False)
    state.resume_epoch = state.backup.resume_epoch
    found = distribution_lib.process_values(state.resume_epoch, state.processes)
    if len(set(found)) > 1:
        epochs_found = ", ".join(f"process {i}: {epoch}" for i, epoch in enumerate(found))
        raise distribution_lib.MultiProcessError(
            f"The processes disagree on the epoch to resume from ({epochs_found}): process 0 "
            f"writes the backup {folder.backup}, and every process must read it, so "
            f"--output_dir must be on a filesystem all of them see. Delete {folder.backup} to "
            f"start afresh.")


def _build_and_compile(state):
    """The objective's model from the run's ViT, compiled with the recipe's optimizer (call in
    the distribution's scope)."""
    config, recipe, log = state.config, state.recipe, state.log
    jit_compile = config.compute.jit_compile
    if jit_compile is None and state.distribution.xla_off:
        jit_compile = False
        log(state.distribution.xla_off)
    vit = build_run_model(config, recipe, state.splits.num_classes, log=log)
    # A resumed run rebuilds the same model (LoRA, linear probe, remat) before its backup loads.
    for part in state.parts:
        vit = part.adapt_model(vit, log)
    model = state.objective.build_model(vit, config.seed)
    options = {}  # layer decay's scales, EMA
    for part in state.parts:
        options.update(part.optimizer_options(vit, log))
    optimizer = recipes_lib.make_optimizer(recipe, state.total_updates, state.accum, **options)
    state.objective.compile(model, optimizer, recipe, jit_compile)
    for part in state.parts:
        part.compiled(model)
    if config.compute.jit_compile is None:  # the loading backend chooses (also when forced off)
        recipes_lib.portable_compile_config(model)
    if recipe.image_size is None:  # the weights' own (resolve_recipe)
        state.recipe = dataclasses.replace(recipe, image_size=model_image_size(model))
    if state.naflex is not None:
        state.naflex = dataclasses.replace(state.naflex, patch_size=vit.token_pixels)
    state.model, state.vit = model, vit


def _train(state):
    """Trains the run's model from its resumption point; returns the seconds `fit` took (0 for
    a run resumed after its training)."""
    from vit_keras.tools import data  # tf.data: TensorFlow loads when a run starts

    recipe, folder, model = state.recipe, state.folder, state.model
    batching = state.naflex
    images_per_step = (recipe.batch_size if batching is None
                       else sum(batching.batch_sizes) / len(batching.batch_sizes))
    state.throughput = callbacks_lib.Throughput(images_per_step, state.steps_per_epoch)
    state.log(
        f"Run {state.name}: {state.objective.describe(model)}, {model.count_params():,} "
        f"parameters ({finetuning.trainable_parameters(model):,} trained), image size "
        f"{recipe.image_size}, {state.training.num_examples['train']} "
        f"training images, batch {recipe.batch_size}"
        + ("" if batching is None else
           f" (NaFlex: up to {batching.max_num_patches} patches, buckets "
           f"{'/'.join(map(str, batching.seq_lens))} of "
           f"{'/'.join(map(str, batching.batch_sizes))} images)")
        + (f" x {state.accum} accumulated" if state.accum > 1 else "")
        + f", {_count(state.epochs, 'epoch')} of {_count(state.steps_per_epoch, 'step')}, "
        f"{recipe.optimizer} lr "
        f"{recipe.learning_rate:g}, backend {keras.backend.backend()}.")
    if state.trained:
        state.log(f"Resuming {folder.path}: its training ended (epoch {state.resume_epoch} of "
                  f"{state.epochs}) before {state.objective.evaluation}; evaluating the "
                  f"backed-up model.")
        state.backup.restore(model)
        return 0.0
    if state.resume_epoch:
        state.log(f"Resuming {folder.path} from its backup after epoch {state.resume_epoch} of "
                  f"{state.epochs}.")
    # Keras keeps one iterator over a repeated stream across epochs: epoch e reads batches
    # e * steps_per_epoch onwards, so a resumed run starts the stream where its backup stopped.
    start_batch = state.resume_epoch * state.steps_per_epoch
    if batching is not None:
        from vit_keras.tools.data import naflex

        train_ds = state.naflex_inputs(naflex.make_naflex_pipeline(
            state.training, "train", batching, training=True, augmentation=state.augmentation,
            seed=state.config.seed, start_batch=start_batch))
    else:
        train_ds = data.make_pipeline(state.training, "train", image_size=recipe.image_size,
                                      batch_size=recipe.batch_size, training=True,
                                      augmentation=state.augmentation, seed=state.config.seed,
                                      start_batch=start_batch)
    return _fit(state, train_ds, state.objective.validation_split and state.validation())


def _callbacks(state, nan_guard):
    """`fit`'s callbacks: NaN guard, throughput, the parts' (before the logs, which then have
    what they log: EMA's val_ema_*), history.csv and TensorBoard (process 0's), the model after
    every epoch (a part's own checkpoint, LoRA's), and last the backup (an epoch's backup exists
    only once its other files are written)."""
    # fsdp writes model.keras once, at the end: each epoch's (sharded) backup gathers nothing.
    whole = None if state.distribution.sharded_backup else callbacks_lib.AtomicModelCheckpoint
    checkpoint = next((part.checkpoint for part in state.parts if part.checkpoint), whole)
    checkpoint = checkpoint and checkpoint(state.writes.model)
    if checkpoint is not None:
        checkpoint.guard = nan_guard
    state.backup.guard = nan_guard
    chief = state.processes.is_chief
    logs = []
    if not chief:
        pass  # history.csv and TensorBoard logs are process 0's
    elif importlib.util.find_spec("tensorboard") and importlib.util.find_spec("tensorflow"):
        logs.append(keras.callbacks.TensorBoard(state.folder.logs, write_graph=False))
    else:
        state.log("TensorBoard is not installed (pip install tensorboard): no TensorBoard logs.")
    parts = [callback for part in state.parts
             for callback in part.callbacks(state.validation, nan_guard)]
    return [nan_guard, state.throughput, *parts, *logs,
            *([keras.callbacks.CSVLogger(state.folder.history, append=True)] if chief else []),
            *([checkpoint] if checkpoint is not None else []), state.backup]


def build_before_tracing(model, dataset):
    """Creates the optimizer's and the compiled loss's and metrics' variables before `fit` traces
    its first step, from `dataset`'s element spec (no batch is read).

    On TensorFlow without a `tf.distribute` strategy, Keras 3.15 leaves them to the first traced
    train step (`_maybe_symbolic_build` in keras/src/backend/tensorflow/trainer.py), and a
    `tf.function` that creates variables is traced twice: the main job's step was traced twice
    before its first update. Under a strategy Keras builds them first itself, from the batch's
    shapes, with the same method called here; elsewhere this does nothing."""
    # pylint: disable=protected-access
    if (keras.backend.backend() != "tensorflow" or not hasattr(model, "_symbolic_build")
            or getattr(model, "_distribute_strategy", None) is not None):
        return
    model._symbolic_build(data_batch=dataset.element_spec)


def _fit(state, train_ds, val_ds):
    """`model.fit` with the run's callbacks; returns its seconds. Raises `NonFiniteLossError`
    when the loss stops being finite, keeping the backup: it holds the last epoch that ended
    with a finite loss (a resumed run's, the epochs before it resumed)."""
    nan_guard = callbacks_lib.StopOnNaN()
    build_before_tracing(state.model, train_ds)
    fit_started = time.perf_counter()
    with _no_length_warning(state.processes.multi):
        state.model.fit(train_ds, epochs=state.epochs, steps_per_epoch=state.steps_per_epoch,
                        validation_data=val_ds, callbacks=_callbacks(state, nan_guard),
                        verbose=state.config.output.verbose, shuffle=False)  # tf.data shuffles
    fit_seconds = time.perf_counter() - fit_started
    if nan_guard.bad_step:
        epoch, batch, loss = nan_guard.bad_step
        kept = (f"{state.folder.model} keeps the last epoch that ended with a finite loss"
                if os.path.exists(state.folder.model) else
                f"an {state.distribution.kind} run writes model.keras only at its end"
                if state.distribution.sharded_backup else
                "no epoch ended with a finite loss, so no model.keras was written")
        raise callbacks_lib.NonFiniteLossError(
            f"The training loss became {loss} at epoch {epoch + 1}, batch {batch + 1}; the run "
            f"stopped and {kept}. Lower "
            f"--learning_rate (now {state.recipe.learning_rate:g}), keep --grad_clip_norm on "
            f"(now {state.recipe.grad_clip_norm:g}), lengthen --warmup_steps, or use "
            f"--mixed_precision bfloat16 instead of float16.")
    return fit_seconds


def _report(state, fit_seconds):
    """Evaluates the trained model (the objective's evaluation), saves it, plots the history
    and writes metrics.json, last; returns the metrics."""
    with _no_length_warning(state.processes.multi):
        history = state.folder.read_history()
        chosen = {}  # metrics.json's record of what a part chose (EMA: which weights)
        for part in state.parts:
            chosen.update(part.before_evaluation(state.model, state.validation, state.log))
        results = state.objective.evaluate(state.model, state.splits, state.pipeline, history)
    state.splits.check_readable_classes()  # one class left readable: no result to keep
    if state.splits.skipped_files:
        state.log(state.splits.unreadable.summary())
    if state.placement is not None:  # fsdp: too big to gather, it stays in its Orbax backup
        placed = state.placement
        memory.check_host_memory_for_saving(
            placed.total_parameter_bytes + placed.total_optimizer_bytes,
            placed.total_parameter_bytes, state.backup.checkpoint_path)
    saved = state.model
    for part in state.parts:
        saved = part.saved_model(saved)  # LoRA: merged, plain
    state.writes.save_model(saved)
    for part in state.parts:
        part.save(state.model, state.writes)  # LoRA: adapters.npz
    if state.processes.is_chief:
        curves = io.BytesIO()  # written as every run file is: whole, a full disk one line
        plots.plot_history(history, curves)
        run_folder_lib.atomic_write_bytes(curves.getvalue(), state.folder.curves)
    metrics = {
        **results,
        "images_per_second": state.throughput.images_per_second(),
        "wall_time_s": time.perf_counter() - state.started,
        "fit_time_s": fit_seconds,
        **chosen,
        "trainable_parameters": finetuning.trainable_parameters(state.model),
        "epochs": state.epochs,
        "resumed_from_epoch": state.resume_epoch,
        "num_examples": state.training.num_examples,
        "skipped_files": len(state.splits.skipped_files),
        "history": history,
        "model_path": state.folder.model,
        "process": {"index": state.processes.index, "count": state.processes.count},
        "config": _config_record(state),
    }
    if state.processes.is_chief:
        state.folder.write_metrics(metrics)  # last: from now on the folder holds a finished run
        state.folder.remove_backup()
    else:
        shutil.rmtree(state.writes.path, ignore_errors=True)
    return metrics


def _config_record(state):
    """metrics.json's `config`: what the run was, resolved."""
    config, model = state.config, state.model
    objective = state.objective.options()
    return {
        "backend": keras.backend.backend(),
        "keras_version": keras.__version__,
        "run_name": state.name,
        "dataset": config.data.dataset,
        "recipe": dataclasses.asdict(state.recipe),
        "recipe_reason": state.reason,
        "run": config.flags(),
        **({"objective": objective} if objective is not None else {}),
        "model_name": model.name,
        "num_parameters": model.count_params(),
        "steps_per_epoch": state.steps_per_epoch,
        **({} if state.naflex is None else {"naflex": {
            "max_num_patches": state.naflex.max_num_patches,
            "seq_lens": list(state.naflex.seq_lens),
            "batch_sizes": list(state.naflex.batch_sizes)}}),
        "total_updates": state.total_updates,
        "accum_steps": state.accum,
        "augmentation": dataclasses.asdict(state.augmentation),
        "jit_compile": model.jit_compile if hasattr(model, "jit_compile") else None,
        "dtype_policy": keras.config.dtype_policy().name,
        "distribution": config.compute.distribution,
        "replicas": state.replicas,
    }
