"""Training recipes: learning-rate schedules, optimizers, callbacks, distribution and one `run`.

- `FINETUNE_RECIPE` is vit_jax's fine-tuning recipe (SGD momentum 0.9, global-norm clipping 1.0,
  linear warm-up then cosine decay, no weight decay, zero-initialised head).
- `PRETRAIN_RECIPE` is the paper's pre-training recipe (Adam β1 0.9, β2 0.999, weight decay 0.1,
  linear warm-up then linear decay).
- `DIGITS_RECIPE` / `DIGITS_VIT` train a small ViT from scratch on scikit-learn's digits, the
  offline default of `apps/finetune.py` and `apps/train.py`.

`run(RunConfig(...))` is what the apps call: data → model → compile → fit → evaluate → files under
`saved_models/<run_name>/`. Tests call the pieces directly.

This module imports only Keras and NumPy at module level; TensorFlow (tf.data, MirroredStrategy)
and JAX are imported inside the functions that need them.
"""

import contextlib
import csv
import dataclasses
import json
import math
import os
import time

import keras
import numpy as np
from keras import ops

_PACKAGE = "vit_keras"


# --- recipes ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Recipe:
    """Optimisation settings of one training recipe.

    `total_steps` and `warmup_steps` count optimizer updates (with gradient accumulation, one
    update per `accum_steps` batches). `epochs`, when set, replaces `total_steps` for datasets
    measured in epochs.
    """

    name: str
    optimizer: str             # "sgd" or "adamw"
    learning_rate: float
    warmup_steps: int
    decay: str                 # "cosine" or "linear" (after the warm-up, to 0)
    total_steps: int
    batch_size: int
    image_size: int
    momentum: float = 0.9      # SGD
    beta_1: float = 0.9        # Adam
    beta_2: float = 0.999      # Adam
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    label_smoothing: float = 0.0
    dropout: float = 0.0
    epochs: int = None
    zero_head: bool = True


# vit_jax configs/common.py + train.py (fine-tuning): batch 512, 10k steps (CIFAR), 384 px.
FINETUNE_RECIPE = Recipe(
    name="finetune", optimizer="sgd", learning_rate=0.03, momentum=0.9, weight_decay=0.0,
    grad_clip_norm=1.0, warmup_steps=500, decay="cosine", total_steps=10_000, batch_size=512,
    image_size=384, zero_head=True)

# The paper, section 4.1 / appendix B.1: Adam(0.9, 0.999), batch 4096, weight decay 0.1,
# linear warm-up (10k steps) and linear decay, global-norm clipping 1, dropout 0.1.
PRETRAIN_RECIPE = Recipe(
    name="pretrain", optimizer="adamw", learning_rate=1e-3, beta_1=0.9, beta_2=0.999,
    weight_decay=0.1, grad_clip_norm=1.0, warmup_steps=10_000, decay="linear",
    total_steps=300_000, batch_size=4096, image_size=224, dropout=0.1, zero_head=False)

# A small ViT for the 8x8 digits upsampled to 16x16: 4x4 patches (2x2 digit pixels) → 16 tokens.
# Global average pooling generalises better than the class token on 1,257 training images.
DIGITS_VIT = {"name": "ViT-digits", "patch_size": 4, "hidden_size": 64, "mlp_dim": 128,
              "num_heads": 4, "num_layers": 4}
DIGITS_CLASSIFIER = "gap"

# The pre-training recipe's shape (AdamW, warm-up then linear decay) at digits scale.
DIGITS_RECIPE = dataclasses.replace(
    PRETRAIN_RECIPE, name="digits", learning_rate=3e-3, warmup_steps=78, total_steps=None,
    epochs=30, batch_size=32, image_size=16, label_smoothing=0.1, dropout=0.1)
# Digits: no horizontal flip (a flipped 2 is not a 2), a mild inception crop.
DIGITS_AUGMENTATION = {"crop_area": (0.8, 1.0), "flip": False}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """vit_jax's `create_learning_rate_schedule`: linear warm-up from 0, then cosine or linear decay.

        progress = clip((step - warmup_steps) / (total_steps - warmup_steps), 0, 1)
        cosine:  lr = base * 0.5 * (1 + cos(pi * progress))
        linear:  lr = end + (base - end) * (1 - progress)
        lr *= min(1, step / warmup_steps)

    `steps_per_update` divides the optimizer's iteration counter, which Keras advances on every
    batch even when gradients are accumulated, so `step` counts updates.
    """

    def __init__(self, base_learning_rate, total_steps, warmup_steps=0, decay="cosine",
                 end_learning_rate=0.0, steps_per_update=1):
        if decay not in ("cosine", "linear"):
            raise ValueError(f"Unknown decay {decay!r}; expected 'cosine' or 'linear'.")
        if total_steps <= warmup_steps:
            raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps "
                             f"({warmup_steps}); shorten the warm-up or train longer.")
        self.base_learning_rate = float(base_learning_rate)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.decay = decay
        self.end_learning_rate = float(end_learning_rate)
        self.steps_per_update = int(steps_per_update)

    def __call__(self, step):
        step = ops.floor(ops.cast(step, "float32") / self.steps_per_update)
        progress = ops.clip((step - self.warmup_steps) / (self.total_steps - self.warmup_steps),
                            0.0, 1.0)
        if self.decay == "cosine":
            lr = self.base_learning_rate * 0.5 * (1.0 + ops.cos(math.pi * progress))
        else:
            lr = self.end_learning_rate + (
                self.base_learning_rate - self.end_learning_rate) * (1.0 - progress)
        if self.warmup_steps:
            lr = lr * ops.minimum(1.0, step / self.warmup_steps)
        return lr

    def get_config(self):
        return {"base_learning_rate": self.base_learning_rate, "total_steps": self.total_steps,
                "warmup_steps": self.warmup_steps, "decay": self.decay,
                "end_learning_rate": self.end_learning_rate,
                "steps_per_update": self.steps_per_update}


def make_optimizer(recipe, total_steps=None, accum_steps=1):
    """The recipe's optimizer with its warm-up schedule, global-norm clipping and accumulation.

    `total_steps` (optimizer updates) overrides the recipe's; `accum_steps` > 1 averages the
    gradients of that many batches per update (Keras' `gradient_accumulation_steps`).
    """
    total_steps = int(total_steps or recipe.total_steps)
    warmup = min(recipe.warmup_steps, max(0, total_steps - 1))
    schedule = WarmupSchedule(recipe.learning_rate, total_steps, warmup, recipe.decay,
                              steps_per_update=accum_steps)
    common = {"global_clipnorm": recipe.grad_clip_norm or None,
              "gradient_accumulation_steps": accum_steps if accum_steps > 1 else None}
    if recipe.optimizer == "sgd":
        if recipe.weight_decay:
            common["weight_decay"] = recipe.weight_decay
        return keras.optimizers.SGD(schedule, momentum=recipe.momentum, **common)
    if recipe.optimizer == "adamw":
        return keras.optimizers.AdamW(schedule, weight_decay=recipe.weight_decay,
                                      beta_1=recipe.beta_1, beta_2=recipe.beta_2, **common)
    raise ValueError(f"Unknown optimizer {recipe.optimizer!r}; expected 'sgd' or 'adamw'.")


def use_jit_compile():
    """XLA on JAX and TensorFlow; not on torch, where Keras' `jit_compile` (torch.compile) takes
    minutes to compile a ViT training step on CPU and gives no speed-up (see PERFORMANCE notes)."""
    return keras.backend.backend() in ("jax", "tensorflow")


def compile_model(model, optimizer, label_smoothing=0.0, jit_compile=None):
    """Softmax cross-entropy on one-hot labels, top-1 and top-5 accuracy."""
    num_classes = model.output_shape[-1]
    metrics = [keras.metrics.CategoricalAccuracy(name="accuracy")]
    if num_classes > 5:
        metrics.append(keras.metrics.TopKCategoricalAccuracy(5, name="top5_accuracy"))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(from_logits=True,
                                                  label_smoothing=label_smoothing),
        metrics=metrics,
        jit_compile=use_jit_compile() if jit_compile is None else jit_compile)
    return model


# --- callbacks ----------------------------------------------------------------------------------

def atomic_save_model(model, path):
    """`model.save(path)` through a temporary file and `os.replace`, so `path` is always whole."""
    temporary = f"{path[:-len('.keras')]}.tmp-{os.getpid()}.keras"
    model.save(temporary)
    os.replace(temporary, path)


def atomic_write_json(data, path):
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(data, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(temporary, path)


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    return str(value)


class AtomicModelCheckpoint(keras.callbacks.Callback):
    """Writes the whole model to `path` (a `.keras` file) at the end of every epoch, atomically."""

    def __init__(self, path):
        super().__init__()
        if not path.endswith(".keras"):
            raise ValueError(f"AtomicModelCheckpoint writes a .keras file; got {path!r}.")
        self.path = path

    guard = None  # a StopOnNaN: nothing is written once the loss is not finite

    def on_epoch_end(self, epoch, logs=None):
        if not (self.guard and self.guard.bad_step):
            atomic_save_model(self.model, self.path)


class AtomicBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`BackupAndRestore` whose weights and metadata files are replaced atomically, so a SIGKILL
    while saving leaves the previous epoch's backup intact instead of a truncated file."""

    def __init__(self, backup_dir, **kwargs):
        super().__init__(backup_dir, double_checkpoint=False, **kwargs)

    guard = None  # a StopOnNaN: nothing is written once the loss is not finite

    def _save_model(self):
        if self.guard and self.guard.bad_step:
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        temporary = os.path.join(self.backup_dir, f"saving-{os.getpid()}.weights.h5")
        self.model.save_weights(temporary, overwrite=True)
        os.replace(temporary, self._weights_path)
        atomic_write_json({"epoch": self._current_epoch, "batch": self._last_batch_seen},
                          self._training_metadata_path)

    @property
    def resume_epoch(self):
        """The epoch a run in `backup_dir` resumes at (0: no backup)."""
        try:
            with open(self._training_metadata_path) as f:
                return int(json.load(f)["epoch"])
        except (OSError, ValueError, KeyError):
            return 0


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss."""


class StopOnNaN(keras.callbacks.Callback):
    """Stops training at the first batch whose loss is NaN or infinite and records where.

    `run` turns this into `NonFiniteLossError` with a message that says what to change.
    """

    def __init__(self):
        super().__init__()
        self.bad_step = None

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(float(loss)):
            self.bad_step = (self._epoch, batch, float(loss))
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


class Throughput(keras.callbacks.Callback):
    """Measures training images/s per epoch (the first epoch includes compilation)."""

    def __init__(self, batch_size, steps_per_epoch):
        super().__init__()
        self.images_per_epoch = batch_size * steps_per_epoch
        self.epoch_seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._last = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        # Up to the last training batch: validation time is not training throughput.
        self.epoch_seconds.append(getattr(self, "_last", time.perf_counter()) - self._start)

    def images_per_second(self):
        """Steady state: epochs after the first when there are some."""
        seconds = self.epoch_seconds[1:] or self.epoch_seconds
        return self.images_per_epoch * len(seconds) / sum(seconds) if seconds else None


# --- distribution -------------------------------------------------------------------------------

DISTRIBUTIONS = ("none", "data_parallel", "model_parallel")
_mirrored_strategy = None  # the last MirroredStrategy distribution_scope made (TensorFlow)


def model_parallel_layout_map(device_mesh):
    """Shards attention (over heads) and MLP kernels (over the hidden MLP units) on the mesh's
    `model` axis; everything else is replicated."""
    from keras import distribution

    layout_map = distribution.LayoutMap(device_mesh)
    for projection in ("query", "key", "value"):
        layout_map[f".*MultiHeadDotProductAttention_1/{projection}/kernel"] = (None, "model", None)
        layout_map[f".*MultiHeadDotProductAttention_1/{projection}/bias"] = ("model", None)
    layout_map[".*MultiHeadDotProductAttention_1/out/kernel"] = ("model", None, None)
    layout_map[".*MlpBlock_3/Dense_0/kernel"] = (None, "model")
    layout_map[".*MlpBlock_3/Dense_0/bias"] = ("model",)
    layout_map[".*MlpBlock_3/Dense_1/kernel"] = ("model", None)
    return layout_map


def distribution_scope(kind="none", model_parallel_size=None):
    """Sets up `--distribution` and returns the context to build and compile the model in.

    - `data_parallel`: `keras.distribution.DataParallel` over all local devices on JAX;
      `tf.distribute.MirroredStrategy` on TensorFlow. Batches are split across devices.
    - `model_parallel`: `keras.distribution.ModelParallel` on JAX with a (data, model) mesh and
      `model_parallel_layout_map`; `model_parallel_size` devices on the model axis (default: all).
    The torch backend has no such engine in Keras; other combinations raise `ValueError`.
    """
    backend = keras.backend.backend()
    if kind in (None, "", "none"):
        return contextlib.nullcontext()
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"Unknown distribution {kind!r}; expected one of {DISTRIBUTIONS}.")
    if backend == "jax":
        from keras import distribution

        devices = distribution.list_devices()
        if kind == "data_parallel":
            distribution.set_distribution(distribution.DataParallel(devices=devices))
        else:
            model_size = int(model_parallel_size or len(devices))
            if len(devices) % model_size:
                raise ValueError(f"model_parallel_size {model_size} does not divide the "
                                 f"{len(devices)} devices.")
            mesh = distribution.DeviceMesh((len(devices) // model_size, model_size),
                                           ("batch", "model"), devices)
            distribution.set_distribution(distribution.ModelParallel(
                layout_map=model_parallel_layout_map(mesh), batch_dim_name="batch"))
        return contextlib.nullcontext()
    if backend == "tensorflow" and kind == "data_parallel":
        import tensorflow as tf

        global _mirrored_strategy
        _mirrored_strategy = tf.distribute.MirroredStrategy()
        return _mirrored_strategy.scope()
    if backend == "tensorflow":
        raise ValueError("--distribution model_parallel needs the JAX backend: Keras' ModelParallel "
                         "is implemented for JAX only, and TensorFlow's DTensor path is not "
                         "supported here. Use --backend jax, or data_parallel on TensorFlow.")
    raise ValueError(f"--distribution {kind} is not available on the {backend} backend: Keras has "
                     f"no distribution engine for torch. Use --backend jax (data_parallel, "
                     f"model_parallel) or --backend tensorflow (data_parallel).")


def num_replicas(kind="none"):
    """How many devices a batch is split over under `kind`."""
    if kind in (None, "", "none"):
        return 1
    if keras.backend.backend() == "jax":
        from keras import distribution

        return len(distribution.list_devices())
    return _mirrored_strategy.num_replicas_in_sync if _mirrored_strategy else 1


# --- one training run ---------------------------------------------------------------------------

RECIPES = {"finetune": FINETUNE_RECIPE, "pretrain": PRETRAIN_RECIPE, "digits": DIGITS_RECIPE}


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
    """The base `Recipe` of a run and why it was chosen (a sentence for the log)."""
    if config.recipe != "auto":
        if config.recipe not in RECIPES:
            raise ValueError(f"Unknown recipe {config.recipe!r}; expected auto or one of "
                             f"{sorted(RECIPES)}.")
        return RECIPES[config.recipe], f"recipe {config.recipe} (--recipe)"
    if config.weights:
        return FINETUNE_RECIPE, f"fine-tuning {config.weights} with vit_jax's fine-tuning recipe"
    if config.dataset == "digits":
        return DIGITS_RECIPE, ("no pretrained weights given (--weights): training from scratch "
                               "with the digits recipe (the paper's pre-training recipe at "
                               "digits scale)")
    return PRETRAIN_RECIPE, ("no pretrained weights given (--weights): training from scratch "
                             "with the paper's pre-training recipe")


def resolve_recipe(config):
    """The run's `Recipe`: the chosen base with every explicitly given field replaced."""
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
    model = (config.model or (DIGITS_VIT["name"] if config.dataset == "digits" and
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
    from vit_keras import model as model_lib

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

        from vit_keras.checkpoints import build_model_from_checkpoint, save_npz

        with tempfile.TemporaryDirectory() as folder:
            path = save_npz(loaded, os.path.join(folder, "weights.npz"))
            return build_model_from_checkpoint(
                path, image_size=recipe.image_size, num_classes=num_classes,
                include_top=True, **options)
    if config.weights:
        from vit_keras.checkpoints import build_model_from_checkpoint

        return build_model_from_checkpoint(
            config.weights, variant=config.model, image_size=recipe.image_size,
            num_classes=num_classes, include_top=True,
            **({"representation_size": config.representation_size}
               if config.representation_size else {}), **options)
    variant = config.model or (DIGITS_VIT if config.dataset == "digits" else "ViT-B/16")
    is_digits_model = isinstance(variant, dict) or variant == DIGITS_VIT["name"]
    if variant == DIGITS_VIT["name"]:
        variant = DIGITS_VIT
    classifier = config.classifier or (DIGITS_CLASSIFIER if is_digits_model else "token")
    configs_lib.get_config(variant)  # validates the name with a clear error
    return model_lib.build_model(
        variant, image_size=recipe.image_size, num_classes=num_classes, classifier=classifier,
        representation_size=config.representation_size, **options)


def augmentation_for(config):
    from vit_keras import data

    digits = config.dataset == "digits"
    crop = config.crop_min_area
    if crop is None:
        crop = DIGITS_AUGMENTATION["crop_area"][0] if digits else 0.05
    flip = config.flip if config.flip is not None else (DIGITS_AUGMENTATION["flip"] if digits
                                                        else True)
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
    Raises `NonFiniteLossError` when the loss becomes NaN or infinite.
    """
    from vit_keras import data

    started = started or time.perf_counter()
    recipe, reason = resolve_recipe(config)
    log(reason + ".")
    run_name = config.run_name or default_run_name(config, app)
    run_dir = os.path.abspath(os.path.join(config.output_dir, run_name))
    os.makedirs(run_dir, exist_ok=True)
    if config.flags_text is not None:
        with open(os.path.join(run_dir, "flags.txt"), "w") as f:
            f.write(config.flags_text)

    _rng_seed(config.seed)
    splits = data.load_splits(config.dataset, data_dir=config.data_dir,
                              val_fraction=config.val_fraction,
                              download=config.download, seed=config.seed, log=log)
    atomic_write_json(splits.class_names, os.path.join(run_dir, "class_names.json"))

    set_precision(config.mixed_precision)
    scope = distribution_scope(config.distribution, config.model_parallel_size)
    replicas = num_replicas(config.distribution) if config.distribution != "none" else 1
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

    augmentation = augmentation_for(config)
    train_ds = data.make_pipeline(splits, "train", image_size=recipe.image_size,
                                  batch_size=recipe.batch_size, training=True,
                                  augmentation=augmentation, seed=config.seed)
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
        optimizer = make_optimizer(recipe, total_updates, accum)
        compile_model(model, optimizer, recipe.label_smoothing, jit_compile)

    nan_guard = StopOnNaN()
    backup = AtomicBackupAndRestore(os.path.join(run_dir, "backup"))
    backup.guard = nan_guard
    resume_epoch = backup.resume_epoch
    if resume_epoch:
        log(f"Resuming {run_dir} from its backup after epoch {resume_epoch} of {epochs}.")
    throughput = Throughput(recipe.batch_size, steps_per_epoch)
    checkpoint = AtomicModelCheckpoint(os.path.join(run_dir, "model.keras"))
    checkpoint.guard = nan_guard
    callbacks = [
        nan_guard,
        throughput,
        keras.callbacks.CSVLogger(os.path.join(run_dir, "history.csv"), append=True),
        checkpoint,
        backup,   # last: the backup of an epoch exists only once its other files are written
    ]
    import importlib.util

    if importlib.util.find_spec("tensorboard") and importlib.util.find_spec("tensorflow"):
        callbacks.insert(2, keras.callbacks.TensorBoard(os.path.join(run_dir, "logs"),
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
        raise NonFiniteLossError(
            f"The training loss became {loss} at epoch {epoch + 1}, batch {batch + 1}; the run "
            f"stopped and {run_dir}/model.keras keeps the last finite epoch. Lower "
            f"--learning_rate (now {recipe.learning_rate:g}), keep --grad_clip_norm on (now "
            f"{recipe.grad_clip_norm:g}), lengthen --warmup_steps, or use --mixed_precision "
            f"bfloat16 instead of float16.")

    results = {split: model.evaluate(ds, verbose=0, return_dict=True)
               for split, ds in eval_sets.items()}
    atomic_save_model(model, os.path.join(run_dir, "model.keras"))
    history = read_history(os.path.join(run_dir, "history.csv"))
    plot_history(history, os.path.join(run_dir, "training_curves.png"))
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
        "model_path": os.path.join(run_dir, "model.keras"),
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
    atomic_write_json(metrics, os.path.join(run_dir, "metrics.json"))
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
