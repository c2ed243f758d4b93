"""One training run: `RunConfig` (the apps' flags) → `run` → `saved_models/<run_name>/`, plus its
history, metrics table and evaluation reports. Imports only Keras and NumPy at module level."""

import csv
import dataclasses
import math
import os
import time

import keras
import numpy as np

from vit_keras.tools import callbacks as callbacks_lib
from vit_keras.tools import distribution as distribution_lib
from vit_keras.tools import recipes as recipes_lib
from vit_keras.tools.run_folder import RunFolder


@dataclasses.dataclass
class RunConfig:
    """Everything a training run needs; `None` means "the recipe's (or the dataset's) default".

    The apps fill this from flags; `resolve` turns it into concrete values.
    """

    dataset: str = "digits"
    data_dir: str = None
    download: bool = True
    val_fraction: float = None
    # model
    model: str = None               # a variant name; default ViT-digits (digits) or ViT-B/16
    weights: str = None             # a checkpoint load_pretrained reads, or a .keras file
    classifier: str = None          # "token" or "gap"; default "gap" for ViT-digits, else "token"
    image_size: int = None
    dropout: float = None
    attention_dropout: float = 0.0
    drop_path_rate: float = 0.0
    representation_size: int = None
    # recipe
    recipe: str = "auto"            # auto: finetune with --weights, digits on digits, else pretrain
    optimizer: str = None
    learning_rate: float = None
    momentum: float = None
    weight_decay: float = None
    grad_clip_norm: float = None
    warmup_steps: int = None
    decay: str = None
    total_steps: int = None
    epochs: int = None
    steps_per_epoch: int = None
    batch_size: int = None
    eval_batch_size: int = 256
    accum_steps: int = 1
    label_smoothing: float = None
    # augmentation
    crop_min_area: float = None     # inception crop area range (crop_min_area, 1)
    flip: bool = None
    randaugment: str = None         # "NUM_OPS,MAGNITUDE", e.g. "2,0.5"
    mixup: float = 0.0
    cutmix: float = 0.0
    # engine
    mixed_precision: str = "none"   # none, bfloat16, float16
    jit_compile: bool = None        # default: on for jax/tensorflow, off for torch
    distribution: str = "none"
    model_parallel_size: int = None
    # run
    output_dir: str = "saved_models"
    run_name: str = None
    seed: int = 0
    verbose: int = 1
    flags_text: str = None          # written to flags.txt (the app's --flagfile)


def choose_recipe(config):
    """The base `recipes.Recipe` of a run and why it was chosen (a sentence for the log)."""
    if config.recipe != "auto":
        if config.recipe not in recipes_lib.RECIPES:
            raise ValueError(f"Unknown recipe {config.recipe!r}; expected auto or one of "
                             f"{sorted(recipes_lib.RECIPES)}.")
        return recipes_lib.RECIPES[config.recipe], f"recipe {config.recipe} (--recipe)"
    if config.weights:
        return recipes_lib.FINETUNE_RECIPE, (f"fine-tuning {config.weights} with vit_jax's "
                                             "fine-tuning recipe")
    if config.dataset == "digits":
        return recipes_lib.DIGITS_RECIPE, ("no pretrained weights given (--weights): training "
                                           "from scratch with the digits recipe (the paper's "
                                           "pre-training recipe at digits scale)")
    return recipes_lib.PRETRAIN_RECIPE, ("no pretrained weights given (--weights): training "
                                         "from scratch with the paper's pre-training recipe")


def resolve_recipe(config):
    """The run's `recipes.Recipe`: the chosen base with every explicitly given field replaced."""
    base, reason = choose_recipe(config)
    overrides = {field: getattr(config, field) for field in (
        "optimizer", "learning_rate", "momentum", "weight_decay", "grad_clip_norm",
        "warmup_steps", "decay", "total_steps", "epochs", "batch_size", "image_size",
        "label_smoothing", "dropout") if getattr(config, field) is not None}
    if config.total_steps is not None and config.epochs is None:
        overrides["epochs"] = None   # an explicit step count wins over the recipe's epochs
    return dataclasses.replace(base, **overrides), reason


def default_run_name(config, app="finetune"):
    """A deterministic name, so the same command finds the same run folder (and resumes it)."""
    dataset = config.dataset.replace("folder:", "folder-").strip("/").replace("/", "_")
    model = (config.model or (recipes_lib.DIGITS_VIT["name"] if config.dataset == "digits" and
                              not config.weights else "ViT-B_16")).replace("/", "_")
    if config.weights:
        model = os.path.splitext(os.path.basename(config.weights.rstrip("/")))[0]
    return f"{app}_{dataset}_{model}"


def set_precision(mixed_precision):
    """`none`, `bfloat16` or `float16` → Keras' global dtype policy (call before building)."""
    policies = {"none": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}
    if mixed_precision not in policies:
        raise ValueError(f"Unknown mixed precision {mixed_precision!r}; expected one of "
                         f"{sorted(policies)}.")
    keras.mixed_precision.set_global_policy(policies[mixed_precision])


def build_run_model(config, recipe, num_classes, log=print):
    """The model of a run: from `--weights` (checkpoint or `.keras`) or freshly initialised."""
    from vit_keras import configs as configs_lib
    from vit_keras import pretrained

    options = {"dropout": recipe.dropout, "attention_dropout": config.attention_dropout,
               "drop_path_rate": config.drop_path_rate}
    if config.weights and config.weights.endswith(".keras"):
        loaded = keras.saving.load_model(config.weights, compile=False)
        size = loaded.input_shape[1]
        if loaded.output_shape[-1] == num_classes and size == recipe.image_size:
            log(f"Continuing from {config.weights} (same classes and image size).")
            return loaded
        # Another head or resolution: go through the npz layout, which resamples position
        # embeddings and zero-initialises a new head (one mechanism for every weight source).
        import tempfile

        from vit_keras.checkpoints import save_npz

        with tempfile.TemporaryDirectory() as scratch:
            path = save_npz(loaded, os.path.join(scratch, "weights.npz"))
            return pretrained.build_model_from_checkpoint(
                path, image_size=recipe.image_size, num_classes=num_classes,
                include_top=True, **options)
    if config.weights:
        return pretrained.build_model_from_checkpoint(
            config.weights, variant=config.model, image_size=recipe.image_size,
            num_classes=num_classes, include_top=True,
            **({"representation_size": config.representation_size}
               if config.representation_size else {}), **options)
    variant = config.model or (recipes_lib.DIGITS_VIT if config.dataset == "digits" else "ViT-B/16")
    is_digits_model = isinstance(variant, dict) or variant == recipes_lib.DIGITS_VIT["name"]
    if variant == recipes_lib.DIGITS_VIT["name"]:
        variant = recipes_lib.DIGITS_VIT
    classifier = config.classifier or (recipes_lib.DIGITS_CLASSIFIER if is_digits_model
                                       else "token")
    configs_lib.get_config(variant)  # validates the name with a clear error
    return pretrained.build_model(
        variant, image_size=recipe.image_size, num_classes=num_classes, classifier=classifier,
        representation_size=config.representation_size, **options)


def augmentation_for(config):
    from vit_keras.tools import data

    digits = config.dataset == "digits"
    crop = config.crop_min_area
    if crop is None:
        crop = recipes_lib.DIGITS_AUGMENTATION["crop_area"][0] if digits else 0.05
    flip = config.flip if config.flip is not None else (
        recipes_lib.DIGITS_AUGMENTATION["flip"] if digits else True)
    randaugment = None
    if config.randaugment:
        try:
            num_ops, magnitude = config.randaugment.split(",")
            randaugment = (int(num_ops), float(magnitude))
        except ValueError:
            raise ValueError(f"--randaugment takes NUM_OPS,MAGNITUDE (e.g. 2,0.5); got "
                             f"{config.randaugment!r}.") from None
    return data.Augmentation(crop_area=(float(crop), 1.0), flip=bool(flip),
                             randaugment=randaugment, mixup=config.mixup, cutmix=config.cutmix)


def read_history(path):
    """Epoch rows of a CSVLogger file, one per epoch (a re-run epoch keeps its last row)."""
    if not os.path.exists(path):
        return []
    rows = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("epoch") in (None, "", "epoch"):
                continue
            rows[int(row["epoch"])] = {key: (float(value) if key != "epoch" else int(value))
                                       for key, value in row.items() if value not in (None, "")}
    return [rows[epoch] for epoch in sorted(rows)]


def plot_history(history, path):
    """Loss and accuracy per epoch (train and val) as a 10x4 inch PNG at 100 dpi."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(figure)
    epochs = [row["epoch"] + 1 for row in history]
    for index, metric in enumerate(("loss", "accuracy")):
        axes = figure.add_subplot(1, 2, index + 1)
        for prefix, label in (("", "train"), ("val_", "val")):
            values = [row.get(prefix + metric, np.nan) for row in history]
            axes.plot(epochs, values, marker="o", markersize=3, label=label)
        axes.set_xlabel("epoch")
        axes.set_title(metric)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def _rng_seed(seed):
    keras.utils.set_random_seed(seed)
    import tensorflow as tf  # tf.data shuffles and crops with TensorFlow's global seed

    tf.random.set_seed(seed)


def run(config, app="finetune", log=print, started=None):
    """Trains and evaluates one run; writes `saved_models/<run_name>/`; returns the metrics dict.

    Files: `model.keras` (after every epoch, atomically), `metrics.json` (atomically),
    `flags.txt`, `class_names.json`, `history.csv`, `training_curves.png`, `logs/` (TensorBoard) and,
    while the run is unfinished, `backup/` (BackupAndRestore: the same command resumes from the
    last completed epoch).
    Raises `callbacks.NonFiniteLossError` when the loss becomes NaN or infinite.
    """
    from vit_keras.tools import data

    started = started or time.perf_counter()
    recipe, reason = resolve_recipe(config)
    log(reason + ".")
    run_name = config.run_name or default_run_name(config, app)
    folder = RunFolder(os.path.join(config.output_dir, run_name)).create()
    if config.flags_text is not None:
        folder.write_flags(config.flags_text)

    _rng_seed(config.seed)
    splits = data.load_splits(config.dataset, data_dir=config.data_dir,
                              val_fraction=config.val_fraction,
                              download=config.download, seed=config.seed, log=log)
    folder.write_class_names(splits.class_names)

    set_precision(config.mixed_precision)
    scope = distribution_lib.distribution_scope(config.distribution, config.model_parallel_size)
    replicas = (distribution_lib.num_replicas(config.distribution)
                if config.distribution != "none" else 1)
    if recipe.batch_size % replicas:
        raise ValueError(f"Batch size {recipe.batch_size} is not divisible by the {replicas} "
                         f"devices of --distribution {config.distribution}; use a multiple of "
                         f"{replicas}.")
    accum = max(1, int(config.accum_steps or 1))
    steps_per_epoch = config.steps_per_epoch or max(1, splits.num_examples["train"] //
                                                    recipe.batch_size)
    if recipe.epochs:
        epochs = recipe.epochs
    else:
        epochs = max(1, math.ceil(recipe.total_steps * accum / steps_per_epoch))
    total_updates = max(1, epochs * steps_per_epoch // accum)

    backup = callbacks_lib.AtomicBackupAndRestore(folder.backup)
    resume_epoch = backup.resume_epoch
    augmentation = augmentation_for(config)
    # Keras keeps one iterator over a repeated stream across epochs: epoch e reads batches
    # e * steps_per_epoch onwards, so a resumed run starts the stream where its backup stopped.
    train_ds = data.make_pipeline(splits, "train", image_size=recipe.image_size,
                                  batch_size=recipe.batch_size, training=True,
                                  augmentation=augmentation, seed=config.seed,
                                  start_batch=resume_epoch * steps_per_epoch)
    eval_batch = config.eval_batch_size - config.eval_batch_size % replicas or replicas
    eval_sets = {split: data.make_pipeline(splits, split, image_size=recipe.image_size,
                                           batch_size=eval_batch)
                 for split in ("val", "test")}

    jit_compile = config.jit_compile
    if (jit_compile is None and config.distribution == "data_parallel"
            and keras.backend.backend() == "tensorflow"):
        # XLA cannot use MirroredStrategy's per-device variables ("Trying to access resource ...
        # located in device CPU:1 from device CPU:0", tensorflow.org/xla/known_issues).
        jit_compile = False
        log("MirroredStrategy: XLA compilation off (TensorFlow's XLA cannot place mirrored "
            "variables).")
    with scope:
        model = build_run_model(config, recipe, splits.num_classes, log=log)
        optimizer = recipes_lib.make_optimizer(recipe, total_updates, accum)
        recipes_lib.compile_model(model, optimizer, recipe.label_smoothing, jit_compile)

    nan_guard = callbacks_lib.StopOnNaN()
    backup.guard = nan_guard
    if resume_epoch:
        log(f"Resuming {folder.path} from its backup after epoch {resume_epoch} of {epochs}.")
    throughput = callbacks_lib.Throughput(recipe.batch_size, steps_per_epoch)
    checkpoint = callbacks_lib.AtomicModelCheckpoint(folder.model)
    checkpoint.guard = nan_guard
    callbacks = [
        nan_guard,
        throughput,
        keras.callbacks.CSVLogger(folder.history, append=True),
        checkpoint,
        backup,   # last: the backup of an epoch exists only once its other files are written
    ]
    import importlib.util

    if importlib.util.find_spec("tensorboard") and importlib.util.find_spec("tensorflow"):
        callbacks.insert(2, keras.callbacks.TensorBoard(folder.logs,
                                                        write_graph=False))
    else:
        log("TensorBoard is not installed (pip install tensorboard): no TensorBoard logs.")

    log(f"Run {run_name}: {model.name}, {model.count_params():,} parameters, image size "
        f"{recipe.image_size}, {splits.num_examples['train']} training images, batch "
        f"{recipe.batch_size}" + (f" x {accum} accumulated" if accum > 1 else "") +
        f", {epochs} epochs of {steps_per_epoch} steps, {recipe.optimizer} lr "
        f"{recipe.learning_rate:g}, backend {keras.backend.backend()}.")
    fit_started = time.perf_counter()
    model.fit(train_ds, epochs=epochs, steps_per_epoch=steps_per_epoch,
              validation_data=eval_sets["val"], callbacks=callbacks, verbose=config.verbose,
              shuffle=False)  # tf.data shuffles
    fit_seconds = time.perf_counter() - fit_started
    if nan_guard.bad_step:
        epoch, batch, loss = nan_guard.bad_step
        raise callbacks_lib.NonFiniteLossError(
            f"The training loss became {loss} at epoch {epoch + 1}, batch {batch + 1}; the run "
            f"stopped and {folder.model} keeps the last finite epoch. Lower "
            f"--learning_rate (now {recipe.learning_rate:g}), keep --grad_clip_norm on (now "
            f"{recipe.grad_clip_norm:g}), lengthen --warmup_steps, or use --mixed_precision "
            f"bfloat16 instead of float16.")

    results = {split: model.evaluate(ds, verbose=0, return_dict=True)
               for split, ds in eval_sets.items()}
    folder.save_model(model)
    history = read_history(folder.history)
    plot_history(history, folder.curves)
    last = history[-1] if history else {}
    metrics = {
        "test_accuracy": results["test"]["accuracy"],
        "test_top5_accuracy": results["test"].get("top5_accuracy"),
        "test_loss": results["test"]["loss"],
        "val_accuracy": results["val"]["accuracy"],
        "val_top5_accuracy": results["val"].get("top5_accuracy"),
        "val_loss": results["val"]["loss"],
        "train_loss": last.get("loss"),
        "train_accuracy": last.get("accuracy"),
        "images_per_second": throughput.images_per_second(),
        "wall_time_s": time.perf_counter() - started,
        "fit_time_s": fit_seconds,
        "epochs": epochs,
        "resumed_from_epoch": resume_epoch,
        "num_examples": splits.num_examples,
        "history": history,
        "model_path": folder.model,
        "config": {
            "backend": keras.backend.backend(),
            "keras_version": keras.__version__,
            "run_name": run_name,
            "dataset": config.dataset,
            "recipe": dataclasses.asdict(recipe),
            "recipe_reason": reason,
            "run": {k: v for k, v in dataclasses.asdict(config).items() if k != "flags_text"},
            "model_name": model.name,
            "num_parameters": model.count_params(),
            "steps_per_epoch": steps_per_epoch,
            "total_updates": total_updates,
            "accum_steps": accum,
            "augmentation": dataclasses.asdict(augmentation),
            "jit_compile": model.jit_compile if hasattr(model, "jit_compile") else None,
            "dtype_policy": keras.config.dtype_policy().name,
            "distribution": config.distribution,
            "replicas": replicas,
        },
    }
    folder.write_metrics(metrics)
    set_precision("none")
    if config.distribution != "none" and keras.backend.backend() == "jax":
        keras.distribution.set_distribution(None)
    return metrics


def metrics_table(metrics):
    """A markdown table of a run's headline numbers."""
    def pct(value):
        return "-" if value is None else f"{100 * value:.2f}%"

    rows = [("test accuracy", pct(metrics["test_accuracy"])),
            ("test top-5 accuracy", pct(metrics.get("test_top5_accuracy"))),
            ("val accuracy", pct(metrics["val_accuracy"])),
            ("test loss", f"{metrics['test_loss']:.4f}"),
            ("train loss (last epoch)", "-" if metrics.get("train_loss") is None
             else f"{metrics['train_loss']:.4f}"),
            ("training images/s", "-" if not metrics.get("images_per_second")
             else f"{metrics['images_per_second']:.1f}"),
            ("epochs", str(metrics["epochs"]) + (f" (resumed after {metrics['resumed_from_epoch']})"
                                                 if metrics.get("resumed_from_epoch") else "")),
            ("wall time", f"{metrics['wall_time_s']:.1f} s"),
            ("backend", metrics["config"]["backend"])]
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines)


# --- evaluation and prediction ------------------------------------------------------------------

def softmax(logits):
    logits = np.asarray(logits, dtype="float64")
    exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)


def classification_report(logits, labels, class_names):
    """Top-1, top-5 and per-class accuracy from logits `(n, classes)` and int labels `(n,)`."""
    logits, labels = np.asarray(logits), np.asarray(labels)
    ranked = np.argsort(-logits, axis=-1, kind="stable")
    correct = ranked[:, 0] == labels
    top5 = (ranked[:, :5] == labels[:, None]).any(axis=-1)
    per_class = {}
    for index, name in enumerate(class_names):
        members = labels == index
        per_class[name] = {"accuracy": float(correct[members].mean()) if members.any() else None,
                           "count": int(members.sum())}
    return {"accuracy": float(correct.mean()), "top5_accuracy": float(top5.mean()),
            "count": int(len(labels)), "per_class": per_class}


def evaluate_model(model, dataset):
    """Runs `model` over a `make_pipeline` dataset; returns `(logits, int labels)` as NumPy."""
    logits, labels = [], []
    for images, one_hot in dataset.as_numpy_iterator():
        logits.append(keras.ops.convert_to_numpy(model(images, training=False)))
        labels.append(one_hot.argmax(-1))
    return np.concatenate(logits).astype("float32"), np.concatenate(labels)


def top_k_predictions(logits, class_names, k=5):
    """`[[(class name, probability), ...] per image]`, best first."""
    probabilities = softmax(logits)
    k = min(k, probabilities.shape[-1])
    ranked = np.argsort(-probabilities, axis=-1, kind="stable")[:, :k]
    return [[(class_names[i] if i < len(class_names) else str(i), float(p[i])) for i in row]
            for row, p in zip(ranked, probabilities)]
