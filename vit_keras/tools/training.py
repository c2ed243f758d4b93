"""One training run: `RunConfig` (the apps' flags) → `run` → `saved_models/<run_name>/`, plus its
history, metrics table and evaluation reports. Imports only Keras and NumPy at module level."""

import contextlib
import csv
import dataclasses
import math
import os
import shutil
import signal
import tempfile
import time
import warnings

import keras
import numpy as np

from vit_keras import errors
from vit_keras import pretrained
from vit_keras.tools import callbacks as callbacks_lib
from vit_keras.tools import distribution as distribution_lib
from vit_keras.tools import recipes as recipes_lib
from vit_keras.tools.config_flags import option
from vit_keras.tools.run_folder import RunFolder

# A test hook: set to 1, `run` kills its own process with SIGKILL once training has finished,
# before the final evaluation (as a kill at that moment would), so that the resumption at the
# evaluation can be tested without racing a timer.
KILL_AFTER_TRAINING = "VIT_KERAS_TEST_KILL_AFTER_TRAINING"


@dataclasses.dataclass
class RunConfig:
    """Everything a training run needs; `None` means "the recipe's (or the dataset's) default".

    Each field declared with `option` is also the training apps' flag of the same name, default
    and help (`config_flags.define_flags`); `resolve_recipe` turns the values into a recipe.
    """

    # data
    dataset: str = option(
        "digits", "digits (scikit-learn's bundled 8x8 digits, offline), folder:PATH (one "
        "sub-folder per class, or PATH/train + PATH/val [+ PATH/test]), or a tfds name "
        "(cifar10, cifar100, oxford_iiit_pet, oxford_flowers102, imagenet2012, ...).")
    data_dir: str = option(None, "tfds data directory (default ~/tensorflow_datasets).")
    download: bool = option(
        True, "Let tfds download and prepare a dataset that is not in --data_dir (needs the "
        "network; without it the run fails at once with instructions).")
    val_fraction: float = option(
        None, "Fraction of train held out as val when the dataset has no val split (default 0.1 "
        "for folders, 0.02 for tfds as vit_jax's train[98%:]).")
    # model
    model: str = option(
        None, "Variant (ViT-Ti/16, ViT-S/16, ViT-B/16, ViT-L/16, ... or the official spelling "
        "ViT-B_16; see vit_keras.VARIANTS) or ViT-digits. Default: ViT-digits on digits without "
        "--weights, ViT-B/16 otherwise; with a checkpoint file in --weights the file decides "
        "(--model then only checks it); a release name in --weights needs --model.")
    weights: str = option(
        None, "Pretrained weights: a published release by name (imagenet21k, "
        "imagenet21k+imagenet2012, augreg_in21k, augreg_in21k_ft_in1k, augreg_in1k; needs "
        "--model; the file nearest --image_size is downloaded once into $VIT_KERAS_HOME, default "
        "$KERAS_HOME/vit_keras; $VIT_KERAS_WEIGHTS_MIRROR names a mirror URL or folder), "
        "hf-hub:REPO_ID, any file vit_keras.load_pretrained reads (vit_jax .npz, timm "
        ".pth/.safetensors, a Hugging Face folder) or a .keras file. A new head is "
        "zero-initialised and position embeddings are resampled to --image_size.")
    classifier: str = option(
        None, "Class token or global average pooling (default: gap for ViT-digits, token "
        "otherwise; with --weights the checkpoint decides).", choices=("token", "gap"))
    image_size: int = option(None, "Training and evaluation resolution (recipe default: 384 "
                             "fine-tuning, 224 pre-training, 16 digits; with --weights on the "
                             "digits recipe, the weights' own).")
    dropout: float = option(None, "Dropout rate (recipe default: 0.0 fine-tuning, 0.1 "
                            "otherwise).")
    attention_dropout: float = option(0.0, "Dropout on the attention probabilities.")
    drop_path_rate: float = option(0.0, "Stochastic depth of the last block.")
    representation_size: int = option(
        None, "Width of a pre-logits layer (Dense + tanh) before the head (new models only).")
    # recipe
    recipe: str = option(
        "auto", "Base recipe: auto = digits on the digits data (with or without --weights), "
        "finetune with --weights elsewhere, pretrain otherwise. The flags below override single "
        "values.",
        choices=("auto", *recipes_lib.RECIPES))
    optimizer: str = option(None, "sgd (momentum, fine-tuning) or adamw (pre-training, digits).",
                            choices=("sgd", "adamw"))
    learning_rate: float = option(
        None, "Peak learning rate (recipe default: 0.03 fine-tuning, 1e-3 pre-training, 3e-3 "
        "digits).")
    momentum: float = option(None, "SGD momentum (default 0.9).")
    weight_decay: float = option(
        None, "Decoupled weight decay (default 0 fine-tuning, 0.1 pre-training and digits).")
    grad_clip_norm: float = option(None, "Global-norm gradient clipping; 0 turns it off "
                                   "(default 1.0).")
    warmup_steps: int = option(None, "Linear warm-up in optimizer updates (default 500 "
                               "fine-tuning, 10000 pre-training, 78 digits).")
    decay: str = option(None, "Decay after the warm-up (default cosine fine-tuning, linear "
                        "pre-training).", choices=("cosine", "linear"))
    total_steps: int = option(
        None, "Optimizer updates in all (default 10000 fine-tuning); sets --epochs to "
        "ceil(total_steps * accum_steps / steps_per_epoch).")
    epochs: int = option(None, "Epochs (default: from --total_steps; 30 on digits).")
    steps_per_epoch: int = option(None, "Batches per epoch (default: training images // batch "
                                  "size).")
    batch_size: int = option(None, "Global batch size (default 512 fine-tuning, 4096 "
                             "pre-training, 32 digits).")
    eval_batch_size: int = option(256, "Batch size of validation and test.")
    accum_steps: int = option(1, "Gradient accumulation: batches averaged per update.")
    label_smoothing: float = option(None, "Label smoothing (default 0; 0.1 on digits).")
    # augmentation
    crop_min_area: float = option(
        None, "Inception crop: smallest crop area fraction (default 0.05 as vit_jax; 0.8 on "
        "digits).")
    flip: bool = option(None, "Random horizontal flip (default on; off on digits).")
    randaugment: str = option(
        None, "RandAugment as NUM_OPS,MAGNITUDE (e.g. 2,0.5; keras.layers.RandAugment).")
    mixup: float = option(0.0, "MixUp alpha (0: off; keras.layers.MixUp).")
    cutmix: float = option(0.0, "CutMix factor (0: off; keras.layers.CutMix).")
    # compute
    mixed_precision: str = option(
        "none", "Mixed precision policy (variables stay float32; float16 adds loss scaling).",
        choices=("none", "bfloat16", "float16"))
    jit_compile: bool = option(
        None, "XLA/jit compilation of the train step (default: on for jax and tensorflow, off "
        "for torch, where torch.compile of a ViT step takes minutes on CPU).")
    distribution: str = option(
        "none", "data_parallel: keras DataParallel over all local devices (jax) or "
        "tf.distribute.MirroredStrategy (tensorflow); model_parallel: keras ModelParallel "
        "sharding attention and MLP kernels (jax only). torch has neither.",
        choices=distribution_lib.DISTRIBUTIONS)
    model_parallel_size: int = option(
        None, "Devices on the mesh's model axis for model_parallel (default: all; with several "
        "processes, each process's own).")
    # several processes (docs/distributed.md)
    coordinator_address: str = option(
        None, "HOST:PORT of process 0, which every process of a multi-process run (jax) connects "
        "to; a comma-separated list of all processes' addresses is accepted, its first is used. "
        "Default $KERAS_DISTRIBUTION_JOB_ADDRESSES.")
    num_processes: int = option(
        None, "Processes in the run, jax only (default $KERAS_DISTRIBUTION_NUM_PROCESSES, else "
        "1); 0 lets JAX detect them (Cloud TPU pod slice, SLURM, Open MPI). --batch_size stays "
        "the global batch; process 0 alone writes the run folder, which must be on a "
        "filesystem every process reads, for resuming.")
    process_id: int = option(
        None, "This process's number, 0 to num_processes - 1 (default "
        "$KERAS_DISTRIBUTION_PROCESS_ID).")
    peer_timeout: int = option(
        distribution_lib.DEFAULT_PEER_TIMEOUT, "Seconds without a heartbeat from another "
        "process after which the others stop with an error (multi-process runs).")
    # run
    output_dir: str = option("saved_models", "Where run folders are written.")
    run_name: str = option(
        None, "Run folder name (default APP_DATASET_MODEL); the same name resumes an unfinished "
        "run and leaves a finished one (its metrics.json) as it is.")
    overwrite: bool = option(
        False, "Start the run over: delete what the run folder holds (a finished run's model and "
        "metrics, an unfinished run's backup) and train afresh. Never written to flags.txt.")
    seed: int = option(0, "Seed of the initialisation, the data order and the splits.")
    verbose: int = option(1, "Keras fit verbosity: 1 progress bars, 2 one line per epoch.")
    flags_text: str = None          # written to flags.txt (the app's --flagfile); not a flag


def choose_recipe(config):
    """The base `recipes.Recipe` of a run and why it was chosen (a sentence for the log)."""
    if config.recipe != "auto":
        if config.recipe not in recipes_lib.RECIPES:
            raise ValueError(f"Unknown recipe {config.recipe!r}; expected auto or one of "
                             f"{sorted(recipes_lib.RECIPES)}.")
        return recipes_lib.RECIPES[config.recipe], f"recipe {config.recipe} (--recipe)"
    if config.dataset == "digits":
        if config.weights:
            return recipes_lib.DIGITS_RECIPE, (f"fine-tuning {config.weights} on the digits with "
                                               "the digits recipe")
        return recipes_lib.DIGITS_RECIPE, ("no pretrained weights given (--weights): training "
                                           "from scratch with the digits recipe (the paper's "
                                           "pre-training recipe at digits scale)")
    if config.weights:
        return recipes_lib.FINETUNE_RECIPE, (f"fine-tuning {config.weights} with vit_jax's "
                                             "fine-tuning recipe")
    return recipes_lib.PRETRAIN_RECIPE, ("no pretrained weights given (--weights): training "
                                         "from scratch with the paper's pre-training recipe")


def resolve_recipe(config):
    """The run's `recipes.Recipe`: the chosen base with every explicitly given field replaced.

    With `--weights` on the digits recipe and no `--image_size`, `image_size` is `None`: the
    weights' own size, known once the model is built (`run` fills it in). A model pre-trained on
    the digits at 16 px is fine-tuned on them at 16 px."""
    base, reason = choose_recipe(config)
    overrides = {field: getattr(config, field) for field in (
        "optimizer", "learning_rate", "momentum", "weight_decay", "grad_clip_norm",
        "warmup_steps", "decay", "total_steps", "epochs", "batch_size", "image_size",
        "label_smoothing", "dropout") if getattr(config, field) is not None}
    if config.total_steps is not None and config.epochs is None:
        overrides["epochs"] = None   # an explicit step count wins over the recipe's epochs
    if config.weights and config.image_size is None and base.name == "digits":
        overrides["image_size"] = None
    return dataclasses.replace(base, **overrides), reason


def default_run_name(config, app="finetune"):
    """A deterministic name, so the same command finds the same run folder (and resumes it)."""
    dataset = config.dataset.replace("folder:", "folder-").strip("/").replace("/", "_")
    model = (config.model or (recipes_lib.DIGITS_VIT["name"] if config.dataset == "digits" and
                              not config.weights else "ViT-B_16")).replace("/", "_")
    if pretrained.is_release_name(config.weights):
        model = f"{model}_{config.weights}"  # one release serves many variants
    elif config.weights:
        path = config.weights.rstrip("/")
        model = os.path.splitext(os.path.basename(path))[0]
        if os.path.basename(path) == "model.keras":  # a run's model: name it by its run
            model = os.path.basename(os.path.dirname(os.path.abspath(path))) or model
    return f"{app}_{dataset}_{model}"


def set_precision(mixed_precision):
    """`none`, `bfloat16` or `float16` → Keras' global dtype policy (call before building)."""
    policies = {"none": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}
    if mixed_precision not in policies:
        raise ValueError(f"Unknown mixed precision {mixed_precision!r}; expected one of "
                         f"{sorted(policies)}.")
    keras.mixed_precision.set_global_policy(policies[mixed_precision])


def build_run_model(config, recipe, num_classes, log=print):
    """The model of a run: from `--weights` (a release name with `--model`, a checkpoint or a
    `.keras` file) or freshly initialised."""
    from vit_keras import configs as configs_lib

    options = {"dropout": recipe.dropout, "attention_dropout": config.attention_dropout,
               "drop_path_rate": config.drop_path_rate}
    if config.weights and config.weights.endswith(".keras"):
        from vit_keras import masked_patch_prediction

        loaded = keras.saving.load_model(config.weights, compile=False)
        size = model_image_size(loaded)
        if masked_patch_prediction.is_pretraining_model(loaded):
            # apps/pretrain.py's model: fine-tune its ViT, without [mask] token and MPP head.
            log(f"{config.weights} is a masked patch prediction model: fine-tuning its encoder.")
            loaded = masked_patch_prediction.pretrained_encoder(loaded)
        elif loaded.output_shape[-1] == num_classes and recipe.image_size in (None, size):
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
        # A release name without --model: pretrained.resolve_weights raises
        # ReleaseNeedsVariantError (one check, one message).
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
    from vit_keras import geometry

    height = model.input_shape[1]
    return height if height is not None else (geometry.token_grid(model)[0] *
                                              geometry.token_pixels(model))


class ActivationMemoryError(errors.UserError, ValueError):
    """A training step's activations cannot fit in the memory of the device it runs on."""


def training_activation_bytes(model, batch_size, image_size=None):
    """A lower bound of the bytes of activations one training step of `model` keeps for its
    backward pass, at `batch_size` images per device of `image_size` pixels a side (default: the
    model's; a model of dynamic image size may be fed another).

    Per image and Transformer block: the attention logits and probabilities,
    `2 * heads * tokens**2` float32 values (unless the block's attention runs through a fused
    kernel, which keeps none), and `8 * tokens * hidden + 2 * tokens * mlp_dim` values in the
    compute dtype (the inputs of the two LayerNorms, of the q/k/v and output projections, and of
    the MLP's two layers and its GELU). Embeddings, a hybrid's ResNet, the head, gradients and
    the optimizer come on top.
    """
    from vit_keras import geometry
    from vit_keras import layers as vit_layers

    blocks = [layer for layer in model.layers if isinstance(layer, vit_layers.TransformerBlock)]
    if not blocks:
        return 0
    if image_size is None:
        rows, cols = geometry.token_grid(model)
    else:
        rows = cols = int(image_size) // geometry.token_pixels(model)
    has_class_token = any(isinstance(layer, vit_layers.ClassToken) for layer in model.layers)
    tokens = rows * cols + int(has_class_token)
    total = 0
    for block in blocks:
        hidden = block.attention.query.kernel.shape[0]
        value_bytes = 2 if block.compute_dtype in ("float16", "bfloat16") else 4
        linear = (8 * tokens * hidden + 2 * tokens * block.mlp_dim) * value_bytes
        # `_fused`: the layer's own answer to whether keras.ops.dot_product_attention reaches a
        # fused kernel here (attention dropout takes the explicit path).
        fused = getattr(block.attention, "_fused", False) and not block.attention_dropout
        attention = 0 if fused else 2 * block.num_heads * tokens * tokens * 4
        total += linear + attention
    return total * int(batch_size)


def device_memory():
    """`(bytes, name)` of the memory a training step runs in: the first accelerator's where the
    backend reports it, else the host's RAM (within a cgroup's limit); `(None, name)` when
    unknown (TensorFlow on a GPU)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform != "cpu":
            limit = (device.memory_stats() or {}).get("bytes_limit")
            return limit, f"{device.device_kind} ({device.platform})"
    elif backend == "torch":
        import torch

        if torch.cuda.is_available():
            return (torch.cuda.get_device_properties(0).total_memory,
                    torch.cuda.get_device_name(0))
    elif backend == "tensorflow":
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            return None, "GPU"
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        physical = min(physical, int(limit)) if limit.isdigit() else physical
    except OSError:
        pass
    return physical, "host memory (RAM)"


def _binary_size(count):
    value, unit = count / 1024 ** 3, "GiB"
    for larger in ("TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:,.1f} {unit}"


def check_activation_memory(model, batch_size, image_size, memory=None):
    """Raises `ActivationMemoryError` (one line: the estimate, the memory, the flags to change)
    when `training_activation_bytes` exceeds the device's memory (`device_memory()` unless
    `memory`, a `(bytes, name)` pair, is given); returns the estimate otherwise."""
    needed = training_activation_bytes(model, batch_size, image_size)
    available, where = memory or device_memory()
    if available and needed > available:
        raise ActivationMemoryError(
            f"A training step at --image_size {image_size} and --batch_size {batch_size} "
            f"(per device) keeps at least {_binary_size(needed)} of activations for "
            f"{model.name}, more than the {_binary_size(available)} of {where}: lower "
            f"--image_size or --batch_size (with --accum_steps to keep the batch per update).")
    return needed


def finished_run(folder, overwrite=False, processes=distribution_lib.Processes(), log=print):
    """What a run folder holds before a run starts in it, decided by process 0 for all (call
    while holding the folder's lock).

    Returns the finished run's metrics (from `metrics.json`, with `"already_complete": True`)
    when the folder holds one and `overwrite` is false: nothing is to be done. Otherwise returns
    `None` after removing, on process 0, what `overwrite` discards (everything) and the
    temporary files of interrupted writes (an unfinished run then resumes from its backup)."""
    complete = processes.is_chief and not overwrite and folder.is_complete()
    if distribution_lib.process_values(int(complete), processes)[0]:
        log(f"Run {folder.path} is complete (its metrics.json is written): nothing to do. Pass "
            f"--overwrite to train it again, or another --run_name.")
        return {**(folder.read_metrics() or {}), "already_complete": True}
    if processes.is_chief:
        if overwrite and [name for name in os.listdir(folder.path)
                          if os.path.join(folder.path, name) != folder.lock]:
            log(f"--overwrite: deleting what {folder.path} holds and starting the run over.")
            folder.clear()
        removed = folder.remove_temporary_files()
        if removed:
            log(f"Removed {len(removed)} temporary files of interrupted writes from "
                f"{folder.path}: {', '.join(removed)}.")
    distribution_lib.process_values(0, processes)  # the others wait until that is done
    return None


def run(config, app="finetune", log=print, started=None):
    """Trains and evaluates one run; writes `saved_models/<run_name>/`; returns the metrics dict.

    Files: `model.keras` (after every epoch, atomically), `metrics.json` (atomically, last),
    `flags.txt`, `class_names.json`, `history.csv`, `training_curves.png`, `logs/` (TensorBoard),
    `lock` while the run is in progress, and `backup/` until `metrics.json` is written.
    A folder with `metrics.json` holds a finished run: `run` returns its metrics (with
    `"already_complete": True`) and changes nothing, unless `config.overwrite` starts it over.
    An unfinished run resumes: from the last completed epoch's backup, or, when training had
    finished, at the final evaluation. Another process running in the folder is refused at once
    (`run_folder.RunFolderBusyError`), and so is a folder that cannot be written
    (`run_folder.RunFolderError`).
    With several processes (`config.num_processes`, `distribution.initialize_processes`), every
    process trains, evaluates and saves (saving is collective on JAX), but only process 0 writes
    the run folder (and holds its lock); the others write into a private temporary folder
    deleted at the end.
    Raises `callbacks.NonFiniteLossError` when the loss becomes NaN or infinite,
    `ActivationMemoryError` when a training step cannot fit in memory, and
    `distribution.MultiProcessError` when several processes cannot be set up.
    """
    started = started or time.perf_counter()
    # First: JAX must join the other processes before it computes anything.
    processes = distribution_lib.initialize_processes(config.coordinator_address,
                                                      config.num_processes, config.process_id,
                                                      config.peer_timeout)
    run_name = config.run_name or default_run_name(config, app)
    folder = RunFolder(os.path.join(config.output_dir, run_name))
    with folder.locked() if processes.is_chief else contextlib.nullcontext():
        finished = finished_run(folder, config.overwrite, processes, log)
        if finished is not None:
            return finished
        return _train_and_evaluate(config, folder, run_name, processes, log, started)


def _train_and_evaluate(config, folder, run_name, processes, log, started):
    from vit_keras.tools import data

    recipe, reason = resolve_recipe(config)
    log(reason + ".")
    # Saving is collective on JAX: every process saves, but only process 0 into the run folder;
    # the others write into a private folder deleted at the end.
    writes = (folder if processes.is_chief else
              RunFolder(tempfile.mkdtemp(prefix=f"vit_keras-process{processes.index}-")))
    if processes.multi:
        log(f"Process {processes.index} of {processes.count}"
            + ("" if processes.is_chief else f": process 0 writes {folder.path}") + ".")
    if config.flags_text is not None and processes.is_chief:
        folder.write_flags(config.flags_text)

    _rng_seed(config.seed)
    splits = data.load_splits(config.dataset, data_dir=config.data_dir,
                              val_fraction=config.val_fraction,
                              download=config.download, seed=config.seed, log=log)
    if processes.is_chief:
        folder.write_class_names(splits.class_names)

    set_precision(config.mixed_precision)
    scope = distribution_lib.distribution_scope(config.distribution, config.model_parallel_size,
                                                processes)
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

    # The backup outlives `fit`: it is deleted once metrics.json is written, so that a run
    # killed during its final evaluation resumes there instead of training again.
    backup = callbacks_lib.AtomicBackupAndRestore(folder.backup, seed=config.seed,
                                                  save_dir=writes.backup, delete_checkpoint=False)
    resume_epoch = backup.resume_epoch
    found = distribution_lib.process_values(resume_epoch, processes)
    if len(set(found)) > 1:
        epochs_found = ", ".join(f"process {i}: {epoch}" for i, epoch in enumerate(found))
        raise distribution_lib.MultiProcessError(
            f"The processes disagree on the epoch to resume from ({epochs_found}): process 0 "
            f"writes the backup {folder.backup}, and every process must read it, so --output_dir must "
            f"be on a filesystem all of them see. Delete {folder.backup} to start afresh.")
    trained = resume_epoch >= epochs

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
    if config.jit_compile is None:  # the loading backend chooses (also when forced off above)
        recipes_lib.portable_compile_config(model)
    if recipe.image_size is None:  # the weights' own (resolve_recipe)
        recipe = dataclasses.replace(recipe, image_size=model_image_size(model))
    if not trained:
        check_activation_memory(model, recipe.batch_size // replicas, recipe.image_size)

    augmentation = augmentation_for(config)
    # An image folder's unreadable files are named in skipped_files.txt as they are met; a resumed
    # run reads it back, so that its stream skips them as the interrupted one did.
    splits.record_unreadable(folder.skipped_files, resume=bool(resume_epoch),
                             write=processes.is_chief)
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
    if processes.multi:  # whole batches: each process gets an equal slice of every one
        eval_sets = {split: distribution_lib.pad_to_whole_batches(
            ds, splits.num_examples[split], eval_batch) for split, ds in eval_sets.items()}

    throughput = callbacks_lib.Throughput(recipe.batch_size, steps_per_epoch)
    log(f"Run {run_name}: {model.name}, {model.count_params():,} parameters, image size "
        f"{recipe.image_size}, {splits.num_examples['train']} training images, batch "
        f"{recipe.batch_size}" + (f" x {accum} accumulated" if accum > 1 else "") +
        f", {epochs} epochs of {steps_per_epoch} steps, {recipe.optimizer} lr "
        f"{recipe.learning_rate:g}, backend {keras.backend.backend()}.")
    if trained:
        log(f"Resuming {folder.path}: its training ended (epoch {resume_epoch} of {epochs}) "
            f"before the final evaluation; evaluating the backed-up model.")
        backup.restore(model)
        fit_seconds = 0.0
    else:
        if resume_epoch:
            log(f"Resuming {folder.path} from its backup after epoch {resume_epoch} of "
                f"{epochs}.")
        fit_seconds = _fit(model, config, folder, writes, processes, backup, throughput,
                           train_ds, eval_sets["val"], epochs, steps_per_epoch, recipe, log)
        if os.environ.get(KILL_AFTER_TRAINING) == "1":
            os.kill(os.getpid(), signal.SIGKILL)

    with _no_length_warning(processes.multi):
        results = {split: model.evaluate(ds, verbose=0, return_dict=True)
                   for split, ds in eval_sets.items()}
    if splits.skipped_files:
        log(splits.unreadable.summary())
    writes.save_model(model)
    history = read_history(folder.history)
    if processes.is_chief:
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
        "skipped_files": len(splits.skipped_files),
        "history": history,
        "model_path": folder.model,
        "process": {"index": processes.index, "count": processes.count},
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
    if processes.is_chief:
        folder.write_metrics(metrics)  # last: from now on the folder holds a finished run
        folder.remove_backup()
    else:
        shutil.rmtree(writes.path, ignore_errors=True)
    set_precision("none")
    if config.distribution != "none" and keras.backend.backend() == "jax":
        keras.distribution.set_distribution(None)
    return metrics


def _fit(model, config, folder, writes, processes, backup, throughput, train_ds, val_ds, epochs,
         steps_per_epoch, recipe, log):
    """`model.fit` with the run's callbacks; returns its seconds. Raises `NonFiniteLossError`
    (after deleting the backup: the next run starts afresh) when the loss stops being finite."""
    nan_guard = callbacks_lib.StopOnNaN()
    backup.guard = nan_guard
    checkpoint = callbacks_lib.AtomicModelCheckpoint(writes.model)
    checkpoint.guard = nan_guard
    callbacks = [
        nan_guard,
        throughput,
        *([keras.callbacks.CSVLogger(folder.history, append=True)] if processes.is_chief else []),
        checkpoint,
        backup,   # last: the backup of an epoch exists only once its other files are written
    ]
    import importlib.util

    if not processes.is_chief:
        pass  # TensorBoard logs are process 0's
    elif importlib.util.find_spec("tensorboard") and importlib.util.find_spec("tensorflow"):
        callbacks.insert(2, keras.callbacks.TensorBoard(folder.logs,
                                                        write_graph=False))
    else:
        log("TensorBoard is not installed (pip install tensorboard): no TensorBoard logs.")

    fit_started = time.perf_counter()
    with _no_length_warning(processes.multi):
        model.fit(train_ds, epochs=epochs, steps_per_epoch=steps_per_epoch,
                  validation_data=val_ds, callbacks=callbacks, verbose=config.verbose,
                  shuffle=False)  # tf.data shuffles
    fit_seconds = time.perf_counter() - fit_started
    if nan_guard.bad_step:
        if processes.is_chief:
            folder.remove_backup()
        epoch, batch, loss = nan_guard.bad_step
        raise callbacks_lib.NonFiniteLossError(
            f"The training loss became {loss} at epoch {epoch + 1}, batch {batch + 1}; the run "
            f"stopped and {folder.model} keeps the last finite epoch. Lower "
            f"--learning_rate (now {recipe.learning_rate:g}), keep --grad_clip_norm on (now "
            f"{recipe.grad_clip_norm:g}), lengthen --warmup_steps, or use --mixed_precision "
            f"bfloat16 instead of float16.")
    return fit_seconds


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
