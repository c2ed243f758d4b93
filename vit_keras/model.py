"""`build_vit`: a variant config → a functional `keras.Model`, and the attention-scores view of one.

Architecture only: weights come in through `vit_keras.pretrained` (`vit_keras.build_model`).
"""

import dataclasses
import re

import keras
import numpy as np

from vit_keras import configs, geometry, heads, layers, resnet
from vit_keras import normalization as normalization_lib

CLASSIFIERS = ("token", "gap", "map")
"""Poolings: the class token, the mean of the patch tokens, SigLIP's attention pooling (MAP)."""


def build_vit(variant, *, image_size=None, num_classes=None, include_top=True,
              include_preprocessing=True, normalization=None, classifier="token",
              representation_size=None, dropout=0.0, attention_dropout=0.0, drop_path_rate=0.0,
              channels=3, layer_norm_epsilon=None, approximate_gelu=None,
              hybrid_numerics="vit_jax", dynamic_image_size=False, name=None):
    """The architecture half of `vit_keras.build_model`: every argument but `weights`, documented
    there. `layer_norm_epsilon` and `approximate_gelu` (True: `gelu="tanh"`, False: `"exact"`)
    override the config's fields when given; `normalization` None is the paper's. Returns the
    freshly initialised `keras.Model`."""
    config = _with_overrides(configs.get_config(variant), layer_norm_epsilon, approximate_gelu)
    height, width = geometry.pair(224 if image_size is None else image_size, "image size")
    num_classes = 1000 if num_classes is None else num_classes
    _check_switches(config, classifier, representation_size)
    if hybrid_numerics not in resnet.NUMERICS:
        raise ValueError(f"Unknown hybrid_numerics {hybrid_numerics!r}; expected one of "
                         f"{list(resnet.NUMERICS)}.")
    epsilon = config.layer_norm_epsilon

    input_size = (None, None) if dynamic_image_size else (height, width)
    images = keras.Input((*input_size, channels), name="images")
    x = images
    if include_preprocessing:
        pixels = normalization_lib.get_normalization(
            normalization_lib.PAPER if normalization is None else normalization)
        x = normalization_lib.PixelNormalization(*pixels.for_channels(channels), dtype="float32",
                                                 name="rescale")(x)
    elif normalization is not None:
        raise ValueError(f"normalization={normalization!r} needs include_preprocessing=True "
                         f"(without it the model takes pixels already normalised).")
    feature_map = (height, width)  # what the patch embedding sees at the built size
    if config.is_hybrid:
        stem = resnet.ResNetStem(config.resnet_layers, config.resnet_width, name="resnet",
                                 **resnet.NUMERICS[hybrid_numerics])
        x = stem(x)
        feature_map = stem.compute_output_shape((None, height, width, channels))[1:3]
    for side, size, grid in zip(("height", "width"), (height, width), feature_map):
        if grid % config.patch_size:
            feature = f" (a feature map of {grid})" if config.is_hybrid else ""
            raise ValueError(
                f"Image {side} {size}{feature} is not divisible by patch size "
                f"{config.patch_size} of {config.name}; use an image size that is a multiple of "
                f"{config.patch_size * size // grid}.")
    patches = layers.PatchEmbedding(config.patch_size, config.hidden_size,
                                    flatten=not dynamic_image_size, use_bias=config.patch_bias,
                                    name="embedding")(x)
    x = patches
    if dynamic_image_size:  # the grid stays for the position embeddings to resample to
        x = keras.layers.Reshape((-1, config.hidden_size), name="patch_tokens")(x)
    # Token order [cls, dist, registers..., patches]. Position embeddings cover the class and
    # distillation tokens (posemb_prefix) or only the patches; registers take none (DINOv2-reg).
    class_token = config.has_class_token(classifier)
    covered = int(class_token) + int(config.distillation)

    def prefix_tokens(x):
        if config.distillation:
            x = layers.DistillationToken(name="dist")(x)
        if class_token:
            x = layers.ClassToken(name="cls")(x)
        return x

    if config.posemb_prefix:
        x = prefix_tokens(x)
    if dynamic_image_size:
        grid = tuple(side // config.patch_size for side in feature_map)
        x = layers.AddPositionEmbs(
            grid_size=grid, num_prefix_tokens=covered if config.posemb_prefix else 0,
            name="posembed_input")(x, patches)
    else:
        x = layers.AddPositionEmbs(name="posembed_input")(x)
    if not config.posemb_prefix:
        x = prefix_tokens(x)
    if config.num_registers:
        x = layers.RegisterTokens(config.num_registers, insert_at=covered, name="reg")(x)
    x = keras.layers.Dropout(dropout, name="dropout")(x)
    if config.pre_norm:
        x = keras.layers.LayerNormalization(epsilon=epsilon, name="pre_norm")(x)
    for index, rate in enumerate(np.linspace(0.0, drop_path_rate, config.num_layers)):
        x = layers.TransformerBlock(
            config.num_heads, config.mlp_dim, dropout=dropout, attention_dropout=attention_dropout,
            drop_path_rate=float(rate), layer_norm_epsilon=epsilon, gelu=config.gelu,
            layer_scale_init=config.layer_scale_init, name=f"encoderblock_{index}")(x)
    # Under mixed precision the last LayerNorm and everything after it run in float32.
    head_dtype = "float32" if keras.config.dtype_policy().name.startswith("mixed") else None
    if not config.fc_norm:
        x = keras.layers.LayerNormalization(epsilon=epsilon, dtype=head_dtype,
                                            name="encoder_norm")(x)
    num_prefix = config.num_prefix_tokens(classifier)
    if classifier == "map":
        x = heads.MAPHead(config.num_heads, config.mlp_dim, layer_norm_epsilon=epsilon,
                          gelu=config.gelu, num_prefix_tokens=num_prefix, dtype=head_dtype,
                          name="MAPHead_0")(x)
    elif config.distillation:
        return _distilled(images, x, config, include_top, num_classes, head_dtype, name)
    else:
        x = layers.TokenPooling(classifier, num_prefix_tokens=num_prefix, dtype=head_dtype,
                                name="pooling")(x)
    if config.fc_norm:
        x = keras.layers.LayerNormalization(epsilon=epsilon, dtype=head_dtype, name="fc_norm")(x)
    if representation_size:
        x = keras.layers.Dense(representation_size, activation="tanh", dtype=head_dtype,
                               name="pre_logits")(x)
    if include_top:
        x = keras.layers.Dense(num_classes, kernel_initializer="zeros", dtype=head_dtype,
                               name="head")(x)
    return keras.Model(images, x, name=_model_name(config, name))


def _model_name(config, name):
    return name or re.sub(r"[/+]", "_", config.name)


def _with_overrides(config, layer_norm_epsilon, approximate_gelu):
    """`config` with the build arguments that override its fields (None: the config's)."""
    changes = {}
    if layer_norm_epsilon is not None:
        changes["layer_norm_epsilon"] = float(layer_norm_epsilon)
    if approximate_gelu is not None:
        changes["gelu"] = "tanh" if approximate_gelu else "exact"
    return dataclasses.replace(config, **changes) if changes else config


def _check_switches(config, classifier, representation_size):
    """Refuses a classifier that the config's switches cannot pool with."""
    if classifier not in CLASSIFIERS:
        raise ValueError(f"Unknown classifier {classifier!r}; expected one of {CLASSIFIERS}.")
    if classifier == "token" and config.class_token is False:
        raise ValueError(f"{config.name} has no class token (class_token=False), so it cannot "
                         f"pool with classifier='token'; use 'gap' or 'map'.")
    if config.distillation and classifier != "token":
        raise ValueError(f"{config.name} has a distillation token, whose head reads the class "
                         f"and distillation tokens (DeiT); use classifier='token', not "
                         f"{classifier!r}.")
    if config.distillation and (representation_size or config.fc_norm):
        raise ValueError(f"{config.name}: DeiT's distilled heads read the tokens directly; a "
                         f"representation layer or fc_norm is not supported with distillation.")
    if config.is_hybrid and (config.num_registers or config.distillation):
        raise ValueError(f"{config.name}: hybrids take no register or distillation tokens.")


def _distilled(images, tokens, config, include_top, num_classes, head_dtype, name):
    """DeiT's two heads, averaged as at inference (timm's `VisionTransformerDistilled`): the class
    token's `head` and the distillation token's `head_dist`. Without the top, the mean of the two
    tokens (timm's pre-logits)."""
    cls = layers.TokenPooling("token", dtype=head_dtype, name="pooling")(tokens)
    dist = layers.TokenPooling("distillation", dtype=head_dtype, name="pooling_dist")(tokens)
    if include_top:
        cls = keras.layers.Dense(num_classes, kernel_initializer="zeros", dtype=head_dtype,
                                 name="head")(cls)
        dist = keras.layers.Dense(num_classes, kernel_initializer="zeros", dtype=head_dtype,
                                  name="head_dist")(dist)
    x = keras.layers.Average(dtype=head_dtype, name="distilled_average")([cls, dist])
    return keras.Model(images, x, name=_model_name(config, name))


def with_dynamic_image_size(model):
    """A copy of a fixed-size vit_keras model that takes images of any size, with the same weights.

    The copy is what `build_model(..., dynamic_image_size=True)` would build at the model's image
    size: its input is `(batch, None, None, channels)` and its position embeddings are resampled
    in the forward pass to each input's token grid (unchanged at the model's own size, where both
    give the same logits). For a model trained at a fixed size that should now serve others.

    Args:
      model: a model from `build_model` (ViT, GAP or hybrid), or loaded from a vit_keras .keras
        file. A model that already has a dynamic image size is returned as it is.
    """
    position = model.get_layer("posembed_input")
    if getattr(position, "grid_size", None) is not None:
        return model
    grid = geometry.token_grid(model)
    num_prefix_tokens = position.pos_embedding.shape[1] - grid[0] * grid[1]
    hidden = position.pos_embedding.shape[-1]
    patch_grid = {}

    def clone(layer):
        config = layer.get_config()
        if layer.name == "embedding":
            config["flatten"] = False
        elif layer.name == "posembed_input":
            config.update(grid_size=grid, num_prefix_tokens=num_prefix_tokens)
        return type(layer).from_config(config)

    def call(layer, *args, **kwargs):
        if layer.name == "embedding":
            patch_grid["patches"] = layer(*args, **kwargs)
            return keras.layers.Reshape((-1, hidden), name="patch_tokens")(patch_grid["patches"])
        if layer.name == "posembed_input":
            return layer(*args, patch_grid["patches"], **kwargs)
        return layer(*args, **kwargs)

    channels = model.input.shape[-1]
    dynamic = keras.models.clone_model(
        model, input_tensors=keras.Input((None, None, channels), name="images"),
        clone_function=clone, call_function=call)
    dynamic.set_weights(model.get_weights())
    return dynamic


def transformer_blocks(model):
    """The model's `TransformerBlock`s in the order they run."""
    return [layer for layer in model.layers if isinstance(layer, layers.TransformerBlock)]


def attention_scores(model, images, batch_size=16):
    """Every encoder block's attention probabilities for a batch of images.

    Args:
      model: a model from `build_model` (or a loaded one).
      images: `(batch, height, width, channels)`, as the model takes them.
      batch_size: images per forward pass.

    Returns:
      A list with one float32 NumPy array `(batch, heads, tokens, tokens)` per block, in order.
      Only this call takes the explicit-softmax path; the model itself keeps fused attention.
    """
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(f"Model {model.name!r} has no TransformerBlock layers.")
    # The part of the graph before the first block (preprocessing, patches, tokens).
    stem = keras.Model(model.input, blocks[0].input)
    images = np.asarray(images)
    per_block = [[] for _ in blocks]
    for start in range(0, len(images), batch_size):
        x = stem(images[start:start + batch_size], training=False)
        for index, block in enumerate(blocks):
            x, scores = block(x, training=False, return_attention_scores=True)
            per_block[index].append(keras.ops.convert_to_numpy(scores))
    return [np.concatenate(chunks) for chunks in per_block]
