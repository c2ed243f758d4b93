"""The public entry points that join an architecture and its weights: `build_model` and
`build_model_from_checkpoint`.

The model builder (`model.py`) knows nothing of checkpoints and the checkpoint loader
(`checkpoints/`) builds no models; this facade depends on both, so imports point one way.
"""

from vit_keras import configs
from vit_keras import geometry
from vit_keras import model as model_lib
from vit_keras.checkpoints import loader


def build_model(variant, *, weights=None, image_size=224, num_classes=1000, include_top=True,
                include_preprocessing=True, classifier="token", representation_size=None,
                dropout=0.0, attention_dropout=0.0, drop_path_rate=0.0, channels=3,
                layer_norm_epsilon=1e-6, approximate_gelu=False, hybrid_numerics="vit_jax",
                name=None):
    """Builds a Vision Transformer as a functional `keras.Model`.

    Args:
      variant: a name from `vit_keras.VARIANTS` (e.g. `"ViT-B/16"`), a `ViTConfig`, or a dict of
        `ViTConfig` fields for a custom architecture.
      weights: optional checkpoint (vit_jax/big_vision `.npz`, timm or Hugging Face state dict or
        folder) loaded after building with `vit_keras.load_pretrained` (strict, position
        embeddings resampled, a head of another class count zero-initialised).
      image_size: `int` or `(height, width)`; multiples of the patch size.
      num_classes: size of the classification head.
      include_top: with `False` the model ends at the pooled `(batch, features)` representation
        (after the final LayerNorm and the representation layer, if any) and has no head.
      include_preprocessing: `True`: inputs are RGB pixels in [0, 255], rescaled in the graph to
        [-1, 1] (the original weights' convention); `False`: inputs are already normalised.
      classifier: `"token"` (class token) or `"gap"` (global average pooling, no class token).
      representation_size: width of the optional `pre_logits` layer (Dense + tanh) before the head.
      dropout: dropout rate after the embeddings, the attention and the MLP.
      attention_dropout: dropout rate on the attention probabilities.
      drop_path_rate: stochastic depth of the last block; earlier blocks get linearly less.
      channels: number of input channels.
      layer_norm_epsilon: 1e-6 as in the original models.
      approximate_gelu: the tanh GELU of Flax (exact erf GELU, as in timm and Hugging Face, if False).
      hybrid_numerics: hybrids only: the weight-standardisation and GroupNorm epsilons of
        `"vit_jax"` (the original models) or `"timm"` (see `vit_keras.resnet.NUMERICS`).
      name: the model's name (default: the variant's, with "/" replaced by "_").

    Returns:
      A `keras.Model` mapping `(batch, height, width, channels)` to logits `(batch, num_classes)`
      (float32 under mixed precision) or, without the top, to features `(batch, features)`.
    """
    model = model_lib.build_vit(
        variant, image_size=image_size, num_classes=num_classes, include_top=include_top,
        include_preprocessing=include_preprocessing, classifier=classifier,
        representation_size=representation_size, dropout=dropout,
        attention_dropout=attention_dropout, drop_path_rate=drop_path_rate, channels=channels,
        layer_norm_epsilon=layer_norm_epsilon, approximate_gelu=approximate_gelu,
        hybrid_numerics=hybrid_numerics, name=name)
    if weights is not None:
        loader.load_pretrained(model, weights)
    return model


def _variant_for(fields, variant, path):
    """The `ViTConfig` for the checkpoint's fields: `variant` if it agrees, else the paper's
    variant with those fields, else a custom config."""
    fields = {"resnet_layers": None, "resnet_width": 1, **fields}
    names_ = tuple(fields)
    if variant is not None:
        config = configs.get_config(variant)
        wanted = {n: getattr(config, n) for n in names_}
        if wanted != fields:
            differ = ", ".join(f"{n} {fields[n]} (variant: {wanted[n]})" for n in names_
                               if wanted[n] != fields[n])
            raise ValueError(f"Checkpoint {path!r} does not hold a {config.name}: {differ}. Leave "
                             f"the variant out to build the checkpoint's own architecture.")
        return config
    for config in configs.VARIANTS.values():
        if {n: getattr(config, n) for n in names_} == fields:
            return config
    return configs.ViTConfig(name="custom", **fields)


def build_model_from_checkpoint(path, *, variant=None, image_size=None, num_classes=None,
                                include_top=None, num_heads=None, strict=True, interpolation=None,
                                antialias=None, **build_kwargs):
    """Builds the model a checkpoint describes and loads it.

    The file determines patch size, width, depth, MLP size, heads, class token or GAP, the
    representation layer, channels and (for Hugging Face) LayerNorm epsilon and GELU variant.

    Args:
      path: any checkpoint `read_checkpoint` accepts.
      variant: optional variant name; an error if the checkpoint holds another architecture.
      image_size: `int` or `(height, width)`; default: the checkpoint's own resolution. Position
        embeddings are resampled when it differs (see `vit_keras.load_pretrained`).
      num_classes: default: the checkpoint's head; another count gets a zero-initialised head.
      include_top: default: `True` when the checkpoint has a head or `num_classes` is given.
      num_heads: for timm files of non-standard width (the file does not store it).
      strict: as in `vit_keras.load_pretrained`.
      interpolation: as in `vit_keras.load_pretrained`.
      antialias: as in `vit_keras.load_pretrained`.
      **build_kwargs: any other `build_model` argument (e.g. `include_preprocessing`, `dropout`),
        overriding what the checkpoint says.

    Returns:
      The loaded `keras.Model`.
    """
    if variant is not None and num_heads is None:
        num_heads = configs.get_config(variant).num_heads
    checkpoint = loader.read_checkpoint(path, num_heads=num_heads)
    arch = loader.architecture(checkpoint)
    config = _variant_for(arch["config"], variant, checkpoint.path)
    if image_size is None:
        if arch["grid"] is None:
            raise ValueError(f"Cannot tell the image size of {checkpoint.path!r} (its position "
                             f"grid is not square); pass image_size=(height, width).")
        image_size = geometry.image_size_for_grid(config, arch["grid"])
    if include_top is None:
        include_top = num_classes is not None or arch["num_classes"] is not None
    num_classes = num_classes or arch["num_classes"]
    if include_top and num_classes is None:
        raise ValueError(f"{checkpoint.path!r} has no classification head; pass num_classes=... "
                         f"for a new (zero-initialised) head, or include_top=False.")
    kwargs = {"image_size": image_size, "num_classes": num_classes or 1000,
              "include_top": include_top, "classifier": arch["classifier"],
              "representation_size": arch["representation_size"], "channels": arch["channels"],
              "layer_norm_epsilon": arch["layer_norm_epsilon"],
              "approximate_gelu": arch["approximate_gelu"], **build_kwargs}
    model = model_lib.build_vit(config, **kwargs)
    return loader.load_pretrained(model, checkpoint, strict=strict, interpolation=interpolation,
                           antialias=antialias)
