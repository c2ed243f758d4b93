"""Training recipes as data (fine-tuning, pre-training, digits; masked patch prediction), the
defaults a dataset brings of its own (`DATASET_DEFAULTS`: the digits' recipes, model and
augmentation) and what turns a recipe into a compiled model: the optimizer with its warm-up
schedule (`vit_keras.schedules.WarmupSchedule`), `compile_model`. Imports only Keras at module
level."""

import dataclasses

import keras

from vit_keras.tools.runs import evaluation

# In the core, which `import vit_keras` registers: a saved optimizer finds them there.
from vit_keras.training import layer_decay
from vit_keras.training.schedules import WarmupSchedule


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

# The recipes' own variants beside `vit_keras.VARIANTS`, by their --model name: the config and
# the classifier a new model of it has by default (every other variant: the class token).
RECIPE_VARIANTS = {DIGITS_VIT["name"]: (DIGITS_VIT, DIGITS_CLASSIFIER)}
# The variant of a run from --weights that names none (a release needs --model).
DEFAULT_VARIANT = "ViT-B/16"


def variant_config(name):
    """What `vit_keras.build_model` takes for the --model `name`: a recipe variant's config
    (`RECIPE_VARIANTS`), else the name itself."""
    return RECIPE_VARIANTS[name][0] if name in RECIPE_VARIANTS else name


def default_classifier(name):
    """The classifier of a new model of the variant `name` without --classifier."""
    return RECIPE_VARIANTS[name][1] if name in RECIPE_VARIANTS else "token"


# The pre-training recipe's shape (AdamW, warm-up then linear decay) at digits scale.
DIGITS_RECIPE = dataclasses.replace(
    PRETRAIN_RECIPE, name="digits", learning_rate=3e-3, warmup_steps=78, total_steps=None,
    epochs=30, batch_size=32, image_size=16, label_smoothing=0.1, dropout=0.1)

# Masked patch prediction, the paper's appendix B.1.2: "Adam, with a base learning rate of 2e-4,
# warmup of 10k steps and cosine learning rate decay", batch 4096, 1M steps. It names no weight
# decay for MPP: none here. No head to zero: the MPP head is new, the ViT's head is not used.
MPP_RECIPE = Recipe(
    name="mpp", optimizer="adamw", learning_rate=2e-4, weight_decay=0.0, warmup_steps=10_000,
    decay="cosine", total_steps=1_000_000, batch_size=4096, image_size=224, grad_clip_norm=1.0,
    dropout=0.0, zero_head=False)
# The same shape at digits scale (16 px, 4x4 patches: 16 tokens per image).
MPP_DIGITS_RECIPE = dataclasses.replace(
    MPP_RECIPE, name="mpp_digits", learning_rate=1e-3, warmup_steps=100, total_steps=None,
    epochs=60, batch_size=64, image_size=16)


@dataclasses.dataclass(frozen=True)
class DatasetDefaults:
    """What a run on one dataset takes for the flags it leaves out; the defaults are every
    dataset's (vit_jax's)."""

    recipes: tuple = ()          # --recipe auto: the one of these in the objective's table
    model: str = DEFAULT_VARIANT  # --model of a run from scratch (no --weights)
    crop_min_area: float = 0.05  # the inception crop's smallest area fraction
    flip: bool = True            # random horizontal flip


# Datasets with defaults of their own, by their --dataset name. The digits: their own recipes
# and ViT, no horizontal flip (a flipped 2 is not a 2), a mild inception crop.
DATASET_DEFAULTS = {
    "digits": DatasetDefaults(recipes=("digits", "mpp_digits"), model=DIGITS_VIT["name"],
                              crop_min_area=0.8, flip=False),
}

# Recipes that fine-tune --weights at the weights' own image size when --image_size is not given:
# a model pre-trained on the digits at 16 px is fine-tuned on them at 16 px.
WEIGHTS_IMAGE_SIZE_RECIPES = ("digits",)


def dataset_defaults(dataset):
    """The `DatasetDefaults` of the --dataset `dataset`."""
    return DATASET_DEFAULTS.get(dataset, DatasetDefaults())


def dataset_recipe(recipes, dataset):
    """The recipe of `recipes` (an objective's table, --recipe name → `Recipe`) made for
    `dataset`, or None."""
    names = [name for name in dataset_defaults(dataset).recipes if name in recipes]
    return recipes[names[0]] if names else None


def make_optimizer(recipe, total_steps=None, accum_steps=1, layer_scales=None, ema_decay=None):
    """The recipe's optimizer with its warm-up schedule, global-norm clipping and accumulation.

    `total_steps` (optimizer updates) overrides the recipe's; `accum_steps` > 1 averages the
    gradients of that many batches per update (Keras' `gradient_accumulation_steps`).
    `layer_scales` (`layer_decay.layer_decay_scales`: layer name → learning-rate scale) gives
    the layer-decay SGD or AdamW (`vit_keras.layer_decay`). `ema_decay` keeps an exponential
    moving average of the weights in the optimizer (Keras' `use_ema`, `ema_momentum`; never
    written into the weights during training: `tools.runs.ema`).
    """
    total_steps = int(total_steps or recipe.total_steps)
    warmup = min(recipe.warmup_steps, max(0, total_steps - 1))
    schedule = WarmupSchedule(recipe.learning_rate, total_steps, warmup, recipe.decay,
                              steps_per_update=accum_steps)
    common = {"global_clipnorm": recipe.grad_clip_norm or None,
              "gradient_accumulation_steps": accum_steps if accum_steps > 1 else None}
    if ema_decay is not None:
        common.update(use_ema=True, ema_momentum=float(ema_decay))
    if layer_scales is not None:
        common["layer_scales"] = layer_scales
    sgd, adamw = ((layer_decay.LayerDecaySGD, layer_decay.LayerDecayAdamW) if layer_scales is not None
                  else (keras.optimizers.SGD, keras.optimizers.AdamW))
    if recipe.optimizer == "sgd":
        if recipe.weight_decay:
            common["weight_decay"] = recipe.weight_decay
        return sgd(schedule, momentum=recipe.momentum, **common)
    if recipe.optimizer == "adamw":
        return adamw(schedule, weight_decay=recipe.weight_decay, beta_1=recipe.beta_1,
                     beta_2=recipe.beta_2, **common)
    raise ValueError(f"Unknown optimizer {recipe.optimizer!r}; expected 'sgd' or 'adamw'.")


def use_jit_compile():
    """XLA on JAX and TensorFlow; not on torch, where Keras' `jit_compile` (torch.compile) takes
    minutes to compile a ViT training step on CPU and gives no speed-up (docs/performance.md)."""
    return keras.backend.backend() in ("jax", "tensorflow")


def portable_compile_config(model, keep_jit_compile=False):
    """Makes what `model.save` records of `model`'s compilation load on every backend.

    - The optimizer is recorded under its public name (`keras.optimizers.AdamW`). On torch Keras
      compiles with a torch subclass and records its private module
      (`keras.src.backend.torch.optimizers.torch_adamw`): another backend reading that imports
      torch (TensorFlow then crashes) and would update the weights with torch's code. The
      public class gives each backend its own.
    - `jit_compile` is recorded as "auto" unless `keep_jit_compile`: Keras records the value it
      resolved, so a model trained with XLA on JAX would torch.compile its first `predict` on
      torch (about a minute on CPU, with recompilation warnings); "auto" lets the loading
      backend choose (eager on torch, XLA on JAX).

    Keras keeps the arguments of `compile` in `model._compile_config`; they are replaced there.
    Call after `compile`; calling again changes nothing."""
    config = getattr(model, "_compile_config", None)
    if config is None:
        return model
    optimizer = config.config.get("optimizer")
    public = getattr(keras.optimizers, type(optimizer).__name__, None)
    if (isinstance(optimizer, keras.optimizers.Optimizer) and isinstance(public, type)
            and isinstance(optimizer, public)):
        serialized = keras.saving.serialize_keras_object(optimizer)
        serialized.update(module="keras.optimizers", registered_name=None)
        config.config["optimizer"] = serialized  # the optimizer's state is saved from the model
    if not keep_jit_compile:
        config.config["jit_compile"] = "auto"
    return model


def compile_model(model, optimizer, label_smoothing=0.0, jit_compile=None):
    """Softmax cross-entropy on one-hot labels, top-1 and top-5 accuracy.

    The accuracies are weighted metrics: they honour sample weights (the zero-weight padding of
    a multi-process evaluation, `distribution.pad_to_whole_batches`) and equal plain ones
    without. `jit_compile=None` compiles with `use_jit_compile()` and saves "auto"; `True` or
    `False` is used and saved as given (`portable_compile_config`)."""
    metrics = [keras.metrics.CategoricalAccuracy(name="accuracy")]
    if evaluation.reports_top_k(model.output_shape[-1]):
        metrics.append(keras.metrics.TopKCategoricalAccuracy(evaluation.TOP_K,
                                                             name="top5_accuracy"))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(from_logits=True,
                                                  label_smoothing=label_smoothing),
        weighted_metrics=metrics,
        jit_compile=use_jit_compile() if jit_compile is None else jit_compile)
    return portable_compile_config(model, keep_jit_compile=jit_compile is not None)


# Supervised training's recipes (apps/finetune.py, apps/train.py) and masked patch prediction's
# (apps/pretrain.py), by their --recipe names.
RECIPES = {"finetune": FINETUNE_RECIPE, "pretrain": PRETRAIN_RECIPE, "digits": DIGITS_RECIPE}
MPP_RECIPES = {"mpp": MPP_RECIPE, "mpp_digits": MPP_DIGITS_RECIPE}
