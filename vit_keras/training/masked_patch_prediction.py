"""Masked patch prediction (MPP): the paper's self-supervised pre-training (section 4.6,
appendix B.1.2), as a functional `keras.Model` that `model.fit` trains on every backend.

Of each image's patch embeddings, `corruption_rate` (50%) are corrupted: of those, 80% are replaced
by a learnable [mask] embedding, 10% by the embedding of a random *other* patch of the same image,
and 10% are left unchanged. A linear head on each patch's own output token predicts the patch's
target, and the loss counts the corrupted patches only. Targets (`TARGETS`):

- `"mean_colour"` (the paper's choice): the patch's mean colour in 3 bits, per channel the mean of
  the raw 0..255 pixels quantised to 8 levels (`floor(mean / 32)`), label `r + 8 g + 64 b`: 512
  classes, softmax cross-entropy.
- `"downsampled_colour"` (ablation): the same 3-bit colour of each cell of a 4x4 grid over the
  patch: 16 labels of 512 classes per patch.
- `"pixels"` (ablation): L2 regression onto the patch's pixels, normalised as the model's input
  (`x / 127.5 - 1`), `patch_size * patch_size * channels` values per patch.

The corruption runs inside the compiled train step (`MaskedPatchCorruption`, Keras random ops with
a `SeedGenerator`) when the model is called with `training=True`; at inference nothing is corrupted.
The loss is added by the `MaskedPatchPredictionLoss` layer (`add_loss`), so the model compiles with
`loss=None`. The model is a plain `build_model` ViT with the corruption layer after its patch
embedding and the MPP head in place of pooling and classification head;
`pretrained_encoder(model)` gives that ViT back without them, and `apps/finetune.py --weights
PRETRAINED.keras` fine-tunes from it with a new zero-initialised head.

    vit = vit_keras.build_model("ViT-B/16", image_size=224, dropout=0.0)
    model = build_pretraining_model(vit, seed=0)
    model.compile(optimizer="adam", loss=None)
    model.fit(images_dataset)                 # (images, anything) batches; labels are unused
"""

import keras
from keras import ops

from vit_keras import model as model_lib
from vit_keras.model import failed_calls, heads, layers

_PACKAGE = "vit_keras"
TARGETS = ("mean_colour", "downsampled_colour", "pixels")
COLOUR_BITS = 3
DOWNSAMPLED_GRID = 4


def colour_labels(images, patch_size, grid=1, bits=COLOUR_BITS):
    """The quantised mean colour of each patch (or of each cell of a `grid` x `grid` split of it).

    Args:
      images: raw pixels in [0, 255], `(batch, height, width, channels)`.
      patch_size: the model's patch size; height and width are multiples of it.
      grid: cells per patch side (1: the whole patch; 4: the 4x4-downsampled ablation target).
      bits: bits per channel: each channel's mean becomes `floor(mean * 2**bits / 256)`.

    Returns:
      int32 labels `(batch, num_patches, grid * grid)`, patches row-major, cells row-major;
      label `sum_c level_c * (2**bits)**c` (`r + 8 g + 64 b` for 3 bits and RGB).
    """
    _, height, width, channels = images.shape
    if patch_size % grid:
        raise ValueError(f"Patch size {patch_size} is not divisible by the target grid {grid}; "
                         f"use a grid that divides the patch size.")
    rows, cols, cell = height // patch_size, width // patch_size, patch_size // grid
    x = ops.reshape(ops.cast(images, "float32"), (-1, rows, grid, cell, cols, grid, cell, channels))
    means = ops.mean(x, axis=(3, 6))  # (batch, rows, grid, cols, grid, channels)
    means = ops.reshape(ops.transpose(means, (0, 1, 3, 2, 4, 5)),
                        (-1, rows * cols, grid * grid, channels))
    levels = 2 ** bits
    quantised = ops.clip(ops.floor(means * (levels / 256.0)), 0, levels - 1)
    place = ops.convert_to_tensor([float(levels ** c) for c in range(channels)])
    return ops.cast(ops.sum(quantised * place, axis=-1), "int32")


def normalised_patch_pixels(images, patch_size):
    """Each patch's pixels `(batch, num_patches, patch_size * patch_size * channels)`, scaled as
    the model's input (`x / 127.5 - 1`), patches row-major, each patch's pixels in (row, column,
    channel) order, as `PatchEmbedding` flattens them."""
    _, height, width, channels = images.shape
    p = patch_size
    rows, cols = height // p, width // p
    x = ops.reshape(ops.cast(images, "float32") / 127.5 - 1.0, (-1, rows, p, cols, p, channels))
    return ops.reshape(ops.transpose(x, (0, 1, 3, 2, 4, 5)), (-1, rows * cols, p * p * channels))


def corrupt_tokens(tokens, mask_token, seed, corruption_rate=0.5, mask_fraction=0.8,
                   random_fraction=0.1):
    """Corrupts `round(corruption_rate * num_patches)` patch embeddings of every image.

    Which patches: the `k` highest of uniform scores (a uniform random subset of exactly `k`).
    How, per corrupted patch, by one uniform draw `u`: `u < mask_fraction` → `mask_token`;
    `u < mask_fraction + random_fraction` → the embedding of another patch of the same image,
    uniform over the other `num_patches - 1`; otherwise unchanged.

    Args:
      tokens: patch embeddings `(batch, num_patches, hidden)`, `num_patches` ≥ 2.
      mask_token: `(1, 1, hidden)`.
      seed: a `keras.random.SeedGenerator` (or anything `keras.random` takes as a seed).
      corruption_rate: fraction of the patches corrupted.
      mask_fraction: fraction of the corrupted patches replaced by the [mask] embedding.
      random_fraction: fraction of the corrupted patches replaced by another patch's embedding.

    Returns:
      `(corrupted tokens (batch, num_patches, hidden), mask (batch, num_patches) float32, 1 where
      corrupted, source (batch, num_patches) int32)`: `source[b, i]` is the patch whose embedding
      position `i` now holds (`i` itself when kept) and -1 where the [mask] embedding is.
    """
    num_patches = tokens.shape[1]
    if num_patches is None or num_patches < 2:
        raise ValueError(f"Masked patch prediction needs at least 2 patches per image; got tokens "
                         f"of shape {tuple(tokens.shape)}.")
    count = min(num_patches, max(1, round(corruption_rate * num_patches)))
    shape = (ops.shape(tokens)[0], num_patches)
    _, chosen = ops.top_k(keras.random.uniform(shape, seed=seed), count)
    mask = ops.sum(ops.one_hot(chosen, num_patches, dtype="float32"), axis=1)
    kind = keras.random.uniform(shape, seed=seed)
    corrupted = mask > 0.5
    use_mask = ops.logical_and(corrupted, kind < mask_fraction)
    use_other = ops.logical_and(corrupted, ops.logical_and(
        kind >= mask_fraction, kind < mask_fraction + random_fraction))
    # Another patch, uniform over the other num_patches - 1: draw j < num_patches - 1 and skip i.
    position = ops.arange(num_patches, dtype="int32")[None, :]
    other = ops.cast(keras.random.randint(shape, 0, num_patches - 1, seed=seed), "int32")
    other = other + ops.cast(other >= position, "int32")
    source = ops.where(use_other, other, ops.broadcast_to(position, shape))
    gathered = ops.take_along_axis(
        tokens, ops.broadcast_to(ops.expand_dims(source, -1), ops.shape(tokens)), axis=1)
    out = ops.where(ops.expand_dims(use_mask, -1), ops.cast(mask_token, tokens.dtype), gathered)
    return out, mask, ops.where(use_mask, -1, source)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MaskedPatchCorruption(keras.layers.Layer):
    """The MPP corruption of patch embeddings (see `corrupt_tokens`), in training only.

    Input: `(batch, num_patches, hidden)`. Output: `(tokens, mask)`, the tokens of the same shape
    (unchanged outside training) and `mask` `(batch, num_patches)` float32, 1 where corrupted
    (all 0 outside training). Weight: `mask_token` `(1, 1, hidden)`, the learnable [mask]
    embedding, zero-initialised.
    """

    def __init__(self, corruption_rate=0.5, mask_fraction=0.8, random_fraction=0.1, seed=None,
                 **kwargs):
        super().__init__(**kwargs)
        for name, value in (("corruption_rate", corruption_rate), ("mask_fraction", mask_fraction),
                            ("random_fraction", random_fraction)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]; got {value}.")
        if mask_fraction + random_fraction > 1.0:
            raise ValueError(f"mask_fraction ({mask_fraction}) + random_fraction "
                             f"({random_fraction}) exceeds 1; the rest is left unchanged.")
        self.corruption_rate = float(corruption_rate)
        self.mask_fraction = float(mask_fraction)
        self.random_fraction = float(random_fraction)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def build(self, input_shape):
        self.mask_token = self.add_weight(name="mask_token", shape=(1, 1, input_shape[-1]),
                                          initializer="zeros")

    def call(self, tokens, training=None):
        if not training:
            return tokens, ops.zeros(ops.shape(tokens)[:2], dtype="float32")
        corrupted, mask, _ = corrupt_tokens(tokens, self.mask_token, self.seed_generator,
                                            self.corruption_rate, self.mask_fraction,
                                            self.random_fraction)
        return corrupted, mask

    def compute_output_spec(self, tokens, training=None):
        return (keras.KerasTensor(tokens.shape, dtype=tokens.dtype),
                keras.KerasTensor(tokens.shape[:2], dtype="float32"))

    def get_config(self):
        return {**super().get_config(), "corruption_rate": self.corruption_rate,
                "mask_fraction": self.mask_fraction, "random_fraction": self.random_fraction,
                "seed": self.seed}


def target_size(target, patch_size, channels=3):
    """The MPP head's width for a target: `(labels per patch, classes per label)` for the colour
    targets, `(values per patch, None)` for `"pixels"`."""
    if target == "mean_colour":
        return 1, (2 ** COLOUR_BITS) ** channels
    if target == "downsampled_colour":
        return DOWNSAMPLED_GRID ** 2, (2 ** COLOUR_BITS) ** channels
    if target == "pixels":
        return patch_size * patch_size * channels, None
    raise ValueError(f"Unknown MPP target {target!r}; expected one of {TARGETS}.")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MaskedPatchTargets(keras.layers.Layer):
    """Each patch's MPP target from the raw images, always in float32.

    Input: raw pixels `(batch, height, width, channels)` in [0, 255]. Output: int32 labels
    `(batch, num_patches, labels per patch)` for the colour targets (`colour_labels`), float32
    `(batch, num_patches, patch_size**2 * channels)` for `"pixels"` (`normalised_patch_pixels`).
    """

    def __init__(self, patch_size, target="mean_colour", **kwargs):
        kwargs["dtype"] = "float32"  # pixel means of 0..255 values lose levels in 16 bits
        super().__init__(**kwargs)
        target_size(target, 1)  # validates the name
        self.patch_size = int(patch_size)
        self.target = target

    def call(self, images):
        if self.target == "pixels":
            return normalised_patch_pixels(images, self.patch_size)
        grid = DOWNSAMPLED_GRID if self.target == "downsampled_colour" else 1
        return colour_labels(images, self.patch_size, grid)

    def compute_output_spec(self, images):
        _, height, width, channels = images.shape
        patches = (height // self.patch_size) * (width // self.patch_size)
        size, classes = target_size(self.target, self.patch_size, channels)
        return keras.KerasTensor((images.shape[0], patches, size),
                                 dtype="float32" if classes is None else "int32")

    def get_config(self):
        config = super().get_config()
        config.pop("dtype", None)  # always float32
        return {**config, "patch_size": self.patch_size, "target": self.target}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PatchTokens(keras.layers.Layer):
    """Drops the prefix (class) token: `(batch, prefix + patches, hidden)` →
    `(batch, patches, hidden)`."""

    def __init__(self, num_prefix_tokens=0, **kwargs):
        super().__init__(**kwargs)
        self.num_prefix_tokens = int(num_prefix_tokens)

    def call(self, tokens):
        return tokens[:, self.num_prefix_tokens:]

    def compute_output_shape(self, input_shape):
        batch, tokens, hidden = input_shape
        return (batch, None if tokens is None else tokens - self.num_prefix_tokens, hidden)

    def get_config(self):
        return {**super().get_config(), "num_prefix_tokens": self.num_prefix_tokens}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MaskedPatchPredictionLoss(keras.layers.Layer):
    """Adds the MPP loss (`add_loss`) and passes the predictions through.

    Inputs: `[predictions, targets, mask]`: predictions `(batch, num_patches, labels * classes)`
    (colour targets; logits) or `(batch, num_patches, values)` (`"pixels"`), targets from
    `MaskedPatchTargets`, mask `(batch, num_patches)`, 1 where corrupted.
    Loss: per patch the softmax cross-entropy averaged over its labels (or the mean squared error
    over its values), averaged over the corrupted patches in training and over every patch
    outside it (nothing is corrupted then). Computed in float32.
    Output: the predictions, unchanged.
    """

    def __init__(self, target="mean_colour", **kwargs):
        kwargs["dtype"] = "float32"
        super().__init__(**kwargs)
        target_size(target, 1)
        self.target = target

    def patch_losses(self, predictions, targets):
        """The loss of every patch, `(batch, num_patches)` float32."""
        predictions = ops.cast(predictions, "float32")
        if self.target == "pixels":
            return ops.mean(ops.square(predictions - targets), axis=-1)
        labels = targets.shape[-1]
        logits = ops.reshape(predictions, (-1, predictions.shape[1], labels,
                                           predictions.shape[-1] // labels))
        return ops.mean(keras.losses.sparse_categorical_crossentropy(
            targets, logits, from_logits=True), axis=-1)

    def call(self, inputs, training=None):
        predictions, targets, mask = inputs
        losses = self.patch_losses(predictions, targets)
        weights = ops.cast(mask, "float32") if training else ops.ones_like(losses)
        self.add_loss(ops.sum(losses * weights) / ops.maximum(ops.sum(weights), 1.0))
        return predictions

    def compute_output_spec(self, inputs, training=None):
        return keras.KerasTensor(inputs[0].shape, dtype=inputs[0].dtype)

    def get_config(self):
        config = super().get_config()
        config.pop("dtype", None)
        return {**config, "target": self.target}


def build_pretraining_model(vit, target="mean_colour", corruption_rate=0.5, mask_fraction=0.8,
                            random_fraction=0.1, seed=None, name=None):
    """The MPP pre-training model around a ViT from `vit_keras.build_model` (its layers shared).

    The ViT's graph up to its final LayerNorm (`encoder_norm`), with `MaskedPatchCorruption` right
    after the patch embedding (before the class token and position embeddings are added), then
    the patch tokens (class token dropped) through a linear head `mpp_head` to the target. The
    ViT's pooling, `pre_logits` and classification head are left out.

    Args:
      vit: a ViT (not a hybrid) built with `include_preprocessing=True`: the targets come from the
        raw 0..255 pixels it takes.
      target: one of `TARGETS`.
      corruption_rate: fraction of the patches corrupted (0.5 in the paper).
      mask_fraction: of the corrupted, the fraction replaced by the [mask] embedding (0.8).
      random_fraction: of the corrupted, the fraction replaced by another patch (0.1).
      seed: seed of the corruption's `SeedGenerator`.
      name: the model's name (default: the ViT's with `_mpp`).

    Returns:
      A `keras.Model` from images `(batch, height, width, channels)` to the head's predictions
      `(batch, num_patches, width)`: `labels * classes` logits for the colour targets (512, or
      16 * 512 for `"downsampled_colour"`), `patch_size**2 * channels` values for `"pixels"`.
      Its loss is added by its `MaskedPatchPredictionLoss` layer: compile with `loss=None`.
    """
    vit = model_lib.ViT.of(vit)
    if vit.stem is not None:
        raise ValueError(f"Model {vit.name!r} is not a plain ViT from vit_keras.build_model; "
                         f"masked patch prediction needs the patch embedding on the pixels (no "
                         f"hybrid).")
    if vit.rescale is None:
        raise ValueError(f"Model {vit.name!r} was built with include_preprocessing=False; masked "
                         f"patch prediction computes its targets from the raw 0..255 pixels the "
                         f"model takes, so build it with include_preprocessing=True.")
    images = keras.Input(vit.input.shape[1:], name="images")
    x, mask, patch_size = images, None, None
    for layer in vit.layers[1:]:
        if isinstance(layer, heads.TokenPooling):
            break
        x = layer(x)
        if isinstance(layer, layers.PatchEmbedding):
            patch_size = layer.patch_size
            x, mask = MaskedPatchCorruption(corruption_rate, mask_fraction, random_fraction,
                                            seed=seed, name="mpp_corruption")(x)
    prefix = int(_has(vit, layers.ClassToken))
    labels, classes = target_size(target, patch_size, images.shape[-1])
    head_dtype = "float32" if keras.config.dtype_policy().name.startswith("mixed") else None
    predictions = keras.layers.Dense(labels * (classes or 1), dtype=head_dtype,
                                     name="mpp_head")(PatchTokens(prefix, name="patch_tokens")(x))
    targets = MaskedPatchTargets(patch_size, target, name="mpp_targets")(images)
    outputs = MaskedPatchPredictionLoss(target, name="mpp_loss")([predictions, targets, mask])
    # Its failing `fit` keeps the weights it shares with `vit` (`failed_calls`).
    return failed_calls.FailSafeModel(images, outputs, name=name or f"{vit.name}_mpp")


def _has(model, kind):
    return any(isinstance(layer, kind) for layer in model.layers)


def is_pretraining_model(model):
    """Whether `model` is an MPP pre-training model (it holds a `MaskedPatchCorruption`)."""
    return _has(model, MaskedPatchCorruption)


def pretrained_encoder(model, name=None):
    """The plain ViT inside an MPP pre-training model, without its [mask] embedding and MPP head.

    Its weights are the pre-training model's (copied): images → patch embedding → (class token)
    → position embeddings → blocks → `encoder_norm` → `TokenPooling` (the class token when the
    model has one, else the mean of the tokens, as `build_model` pools).

    Returns:
      A `vit_keras.ViT` without its top, from images to pooled features `(batch, hidden)`: what
      a `build_model` ViT with `include_top=False` computes, and what `vit_keras.save_npz` writes
      as a checkpoint without a head (which `build_model_from_checkpoint` completes with a zero head).
    """
    if not is_pretraining_model(model):
        raise ValueError(f"Model {model.name!r} is not a masked patch prediction pre-training "
                         f"model (it has no MaskedPatchCorruption layer).")
    images = keras.Input(model.input.shape[1:], name="images")
    x = images
    for layer in model.layers[1:]:
        if isinstance(layer, PatchTokens):  # the MPP head's input: the encoder ends before it
            break
        if not isinstance(layer, (MaskedPatchCorruption, MaskedPatchTargets)):
            x = layer(x)
    mode = "token" if _has(model, layers.ClassToken) else "gap"
    pooled = heads.TokenPooling(mode, dtype=x.dtype, name="pooling")(x)
    encoder = keras.Model(images, pooled, name=name or model.name.removesuffix("_mpp"))
    return model_lib.ViT.of(encoder)
