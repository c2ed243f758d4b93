"""`build_vit`: a variant config → a functional `keras.Model`, and the attention-scores view of one.

Architecture only: weights come in through `vit_keras.pretrained` (`vit_keras.build_model`).
"""

import re

import keras
import numpy as np

from vit_keras import configs, geometry, layers, resnet


def build_vit(variant, *, image_size=None, num_classes=None, include_top=True,
              include_preprocessing=True, classifier="token", representation_size=None,
              dropout=0.0, attention_dropout=0.0, drop_path_rate=0.0, channels=3,
              layer_norm_epsilon=1e-6, approximate_gelu=False, hybrid_numerics="vit_jax",
              dynamic_image_size=False, name=None):
    """The architecture half of `vit_keras.build_model`: every argument but `weights`, documented
    there. Returns the freshly initialised `keras.Model`."""
    config = configs.get_config(variant)
    height, width = geometry.pair(224 if image_size is None else image_size, "image size")
    num_classes = 1000 if num_classes is None else num_classes
    if classifier not in layers.TokenPooling.MODES:
        raise ValueError(f"Unknown classifier {classifier!r}; expected one of "
                         f"{layers.TokenPooling.MODES}.")
    if hybrid_numerics not in resnet.NUMERICS:
        raise ValueError(f"Unknown hybrid_numerics {hybrid_numerics!r}; expected one of "
                         f"{list(resnet.NUMERICS)}.")

    input_size = (None, None) if dynamic_image_size else (height, width)
    images = keras.Input((*input_size, channels), name="images")
    x = images
    if include_preprocessing:
        x = keras.layers.Rescaling(1 / 127.5, offset=-1.0, dtype="float32", name="rescale")(x)
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
                                    flatten=not dynamic_image_size, name="embedding")(x)
    x = patches
    if dynamic_image_size:  # the grid stays for the position embeddings to resample to
        x = keras.layers.Reshape((-1, config.hidden_size), name="patch_tokens")(x)
    if classifier == "token":
        x = layers.ClassToken(name="cls")(x)
    if dynamic_image_size:
        grid = tuple(side // config.patch_size for side in feature_map)
        x = layers.AddPositionEmbs(grid_size=grid, num_prefix_tokens=int(classifier == "token"),
                                   name="posembed_input")(x, patches)
    else:
        x = layers.AddPositionEmbs(name="posembed_input")(x)
    x = keras.layers.Dropout(dropout, name="dropout")(x)
    for index, rate in enumerate(np.linspace(0.0, drop_path_rate, config.num_layers)):
        x = layers.TransformerBlock(
            config.num_heads, config.mlp_dim, dropout=dropout, attention_dropout=attention_dropout,
            drop_path_rate=float(rate), layer_norm_epsilon=layer_norm_epsilon,
            approximate_gelu=approximate_gelu, name=f"encoderblock_{index}")(x)
    # Under mixed precision the last LayerNorm and everything after it run in float32.
    head_dtype = "float32" if keras.config.dtype_policy().name.startswith("mixed") else None
    x = keras.layers.LayerNormalization(
        epsilon=layer_norm_epsilon, dtype=head_dtype, name="encoder_norm")(x)
    x = layers.TokenPooling(classifier, dtype=head_dtype, name="pooling")(x)
    if representation_size:
        x = keras.layers.Dense(representation_size, activation="tanh", dtype=head_dtype,
                               name="pre_logits")(x)
    if include_top:
        x = keras.layers.Dense(num_classes, kernel_initializer="zeros", dtype=head_dtype,
                               name="head")(x)
    return keras.Model(images, x, name=name or re.sub(r"[/+]", "_", config.name))


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
