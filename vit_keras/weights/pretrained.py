"""The public entry points that join an architecture and its weights: `build_model` and
`build_model_from_checkpoint`, and the one place a `weights=` value is checked (`release_of`) and
resolved to a local checkpoint (`resolve_weights`).

The model builder (`model.py`) knows nothing of checkpoints and the checkpoint loader
(`checkpoints/`) builds no models; this facade depends on both, so imports point one way.
"""

import dataclasses
import logging
import os

from vit_keras import errors
from vit_keras import model as model_lib
from vit_keras.model import configs, geometry
from vit_keras.model import pixel_normalization as normalization_lib
from vit_keras.weights import download, release_files, releases
from vit_keras.weights.checkpoints import loader

logger = logging.getLogger("vit_keras")

HUB_PREFIX = "hf-hub:"
_CHECKPOINT_SUFFIXES = (".npz", ".pth", ".pt", ".bin", ".safetensors", ".keras", ".h5")


def is_release_name(weights):
    """Whether a `weights=` value names a published release (see `vit_keras.list_weights`) rather
    than a file; a release name needs the variant it is for."""
    return (isinstance(weights, str) and weights in releases.RELEASE_NAMES
            and not os.path.exists(weights))


def release_of(weights, variant=None, image_size=None):
    """The published `Release` a `weights=` value stands for, or None for a file, a folder, a
    `Checkpoint` or a hub id of no release. Reads and downloads nothing: the one check of a
    `weights=` value, made before anything slow (`resolve_weights` makes it first).

    Args:
      weights: as `resolve_weights` takes it.
      variant: the variant a release name is looked up for.
      image_size: picks among a release's resolutions (see `vit_keras.weights.releases.find_release`).

    Raises:
      vit_keras.errors.ReleaseNeedsVariantError: a release name without `variant`.
      vit_keras.errors.ReleaseNotFoundError: a release `variant` does not have (the message lists
        those it has), or a name that is neither a file nor a release.
      vit_keras.errors.CheckpointNotFoundError: a path (it has a folder or a checkpoint suffix)
        with nothing at it.
    """
    if isinstance(weights, os.PathLike):
        weights = os.fspath(weights)
    if not isinstance(weights, str) or os.path.exists(weights):
        return None
    if weights.startswith(HUB_PREFIX):
        return releases.release_for_hub_id(weights[len(HUB_PREFIX):])
    if "/" in weights or os.sep in weights or weights.endswith(_CHECKPOINT_SUFFIXES):
        raise errors.CheckpointNotFoundError(f"No checkpoint at {weights!r}.")
    if weights not in releases.RELEASE_NAMES:
        raise errors.ReleaseNotFoundError(
            f"weights={weights!r} is neither a file nor a release name; the releases are "
            f"{', '.join(releases.RELEASE_NAMES)} (vit_keras.list_weights() lists each "
            f"variant's).")
    if variant is None:
        raise errors.ReleaseNeedsVariantError(weights)
    return releases.find_release(variant, weights, image_size)


def resolve_weights(weights, variant=None, image_size=None):
    """The local checkpoint a `weights=` argument names, downloading it if it is published.

    Args:
      weights: a path (file or Hugging Face folder); a release name (see `vit_keras.list_weights`,
        e.g. `"augreg_in21k_ft_in1k"`), which needs `variant`; or `"hf-hub:<repo id>"`, a
        Hugging Face hub repository (timm or transformers layout, fetched with huggingface_hub).
        A `Checkpoint` passes through.
      variant: the variant a release name is looked up for.
      image_size: picks among a release's resolutions (see `vit_keras.weights.releases.find_release`).

    Returns:
      `(checkpoint, release)`: a path or `Checkpoint` (a release's file comes read and
      checked, see `read_release`), and the `Release` it is (or None).

    Raises:
      The errors of `release_of` (checked before anything is downloaded), and:
      vit_keras.weights.download.WeightsUnavailableError: when a release cannot be downloaded.
      vit_keras.weights.download.InvalidFileError: when a release's file (downloaded, cached or in a
        mirror folder) is not that release's checkpoint: an error page, a truncated or corrupt
        file, another model, NaN or Inf. A download that fails is never cached; the error on a
        cached file names it and says to delete it.
    """
    if isinstance(weights, os.PathLike):
        weights = os.fspath(weights)
    release = release_of(weights, variant, image_size)
    if isinstance(weights, str) and weights.startswith(HUB_PREFIX):
        return download.fetch_hub(weights[len(HUB_PREFIX):]), release
    if release is None:  # a file, a folder or a Checkpoint
        return weights, None
    # Checked each on its own (a bad config.json is refused before the weights are downloaded)
    # and then together, before any is cached; the weights are read once, by the check.
    files, checkpoint = download.fetch_release(
        release.files, base_url=release.base_url,
        check_file=lambda path, local: release_files.check_file(path, local, release),
        check_together=lambda files: release_files.read_together(files, release))
    return dataclasses.replace(checkpoint, path=files[release.path]), release


def read_release(path, release):
    """The `Checkpoint` at `path`, checked to be `release`'s; see
    `vit_keras.weights.release_files.read_release`, which this names in the public API."""
    return release_files.read_release(path, release)


def _fields(config, fields):
    """`config`'s values of the architecture `fields`."""
    return {name: getattr(config, name) for name in fields}


def build_model(variant, *, weights=None, image_size=None, num_classes=None,
                representation_size=None, **arguments):
    """Builds a Vision Transformer (a `vit_keras.ViT`, a functional `keras.Model`) with weights.

    Args:
      variant: a name from `vit_keras.VARIANTS` (e.g. `"ViT-B/16"`), a `ViTConfig`, or a dict of
        `ViTConfig` fields for a custom architecture.
      weights: optional weights loaded after building with `vit_keras.load_pretrained` (strict,
        position embeddings resampled, a head of another class count zero-initialised): a
        published release by name (`"imagenet21k"`, `"imagenet21k+imagenet2012"`,
        `"augreg_in21k"`, `"augreg_in21k_ft_in1k"`, `"augreg_in1k"`; `vit_keras.list_weights`
        lists them), downloaded once into the cache (see `vit_keras.weights.download`); a checkpoint
        file or folder (vit_jax/big_vision `.npz`, timm or Hugging Face state dict); or
        `"hf-hub:<repo id>"` (see `resolve_weights`).
      image_size: `int` or `(height, width)`; multiples of the patch size. Default: the
        release's resolution (the file nearest to `image_size` is taken when a release has
        several), else 224.
      num_classes: size of the classification head. Default: the release's (1000 or 21843),
        else 1000.
      representation_size: width of the optional `pre_logits` layer (Dense + tanh) before the head
        (default: none, or the release file's, which has one in the original ImageNet-21k files).
      **arguments: the other arguments of `vit_keras.ViT` (`include_top`,
        `include_preprocessing`, `normalization`, `classifier`, `dropout`, `attention_dropout`,
        `drop_path_rate`, `channels`, `layer_norm_epsilon`, `gelu`,
        `hybrid_numerics`, `dynamic_image_size`, `attention`, `dtype`, `name`), documented
        there. `normalization` None is the weights' own (the release table's, timm's pretrained
        config, the Hugging Face image processor, what a checkpoint's keys identify; see
        `build_model_from_checkpoint`), else the paper's.

    Returns:
      A `vit_keras.ViT` mapping `(batch, height, width, channels)` to logits `(batch,
      num_classes)` (float32 under mixed precision) or, without the top, to features `(batch,
      features)`.
    """
    unknown = set(arguments) - set(model_lib.ViT.ARGUMENTS)
    if unknown:
        raise TypeError(f"build_model() got unknown arguments {sorted(unknown)}; it takes "
                        f"weights, image_size, num_classes, representation_size and those of "
                        f"vit_keras.ViT: {', '.join(model_lib.ViT.ARGUMENTS)}.")
    arguments.setdefault("include_top", True)
    checkpoint, release = resolve_weights(weights, variant, image_size)
    if release is not None:  # the release's file decides the size, head and pre-logits left open
        return build_model_from_checkpoint(
            checkpoint, variant=variant, image_size=image_size, num_classes=num_classes,
            **arguments,
            **({} if representation_size is None else {"representation_size": representation_size}))
    if checkpoint is not None:
        checkpoint = loader.read_checkpoint(checkpoint,
                                            num_heads=configs.get_config(variant).num_heads)
        arguments["normalization"] = input_normalization(
            arguments.get("normalization"), checkpoint, arguments.get("include_preprocessing", True))
        variant = _family_named(configs.get_config(variant), checkpoint)
        arguments.setdefault("eval_crop", checkpoint.hints.get("eval_crop"))
    model = model_lib.ViT(variant, image_size=image_size, num_classes=num_classes,
                          representation_size=representation_size, **arguments)
    if checkpoint is not None:
        loader.load_pretrained(model, checkpoint, check_normalization=False)
    return model


def input_normalization(normalization, checkpoint, include_preprocessing=True, release=None):
    """The normalisation a model built from `checkpoint` gets: `normalization` when given, else
    `release`'s, else the checkpoint's own (see `build_model_from_checkpoint`), else the paper's,
    with a warning that says it was assumed and how to choose. None without preprocessing."""
    if not include_preprocessing:
        return normalization  # ViT refuses a normalization without preprocessing
    if normalization is not None:
        return normalization_lib.get_normalization(normalization)
    if release is not None:
        return release.normalization
    found = checkpoint.hints.get("normalization")
    if found is not None:
        logger.info("Input normalisation %s, from %s.", found,
                    checkpoint.hints.get("normalization_source", "the checkpoint"))
        return found
    logger.warning(
        "%r does not say how its pixels were normalised in training: the model assumes the "
        "original ViT weights' (x - 127.5) / 127.5 ('inception'). If it was trained otherwise, "
        "pass normalization='imagenet' (DeiT, DINOv2, MAE), 'clip' or (mean, std) (apps: "
        "--normalization).", checkpoint.path)
    return normalization_lib.PAPER


def _family_named(config, checkpoint):
    """`config` under the name of the checkpoint's family, where it has one (`"DINOv3-B/16"`,
    not the paper's `"ViT-B/16"` of the same width, nor `"custom"`)."""
    family = checkpoint.hints.get("family")
    if family is None:
        return config
    return dataclasses.replace(config, name=configs.family_variant_name(family, config))


def _variant_for(fields, variant, path):
    """The `ViTConfig` for the checkpoint's fields: `variant` if it agrees, else the paper's
    variant with those fields, else a custom config."""
    fields = {"resnet_layers": None, "resnet_width": 1, **fields}
    if variant is not None:
        config = configs.get_config(variant)
        wanted = _fields(config, fields)
        if wanted != fields:
            differ = ", ".join(f"{n} {fields[n]} (variant: {wanted[n]})" for n in fields
                               if wanted[n] != fields[n])
            raise errors.CheckpointError(
                f"Checkpoint {path!r} does not hold a {config.name}: {differ}. Leave "
                f"the variant out to build the checkpoint's own architecture.")
        return config
    return loader.variant_named(fields) or configs.ViTConfig(name="custom", **fields)


def build_model_from_checkpoint(path, *, variant=None, image_size=None, num_classes=None,
                                include_top=None, num_heads=None, strict=True, interpolation=None,
                                antialias=None, allow_non_finite=False, timm_architecture=None,
                                **build_kwargs):
    """Builds the model a checkpoint describes and loads it.

    The file determines patch size, width, depth, MLP size, heads, class token or GAP, the
    representation layer, channels and (for Hugging Face) LayerNorm epsilon and GELU variant.
    The model's input normalisation (with `include_preprocessing`, the default) is the
    checkpoint's own: a release's from the release table; an `.npz`'s the original weights'
    `(x - 127.5) / 127.5` (or the one `save_npz` stored in it); a timm file's from timm's
    `config.json` beside it (`pretrained_cfg` mean and std), else its architecture name, else
    the keys where they identify the family (CLIP, distilled DeiT); a Hugging Face folder's
    from its `preprocessor_config.json`, else its family's published processors. When none of
    these says, the paper's is assumed, with a warning. `normalization=` overrides it.

    Args:
      path: any checkpoint `read_checkpoint` accepts (a `Checkpoint` too, as `resolve_weights`
        returns it: it is not read again), a release name (with `variant`) or
        `"hf-hub:<repo id>"` (see `resolve_weights`).
      variant: optional variant name; an error if the checkpoint holds another architecture.
      image_size: `int` or `(height, width)`; default: the checkpoint's own resolution. Position
        embeddings are resampled when it differs (see `vit_keras.load_pretrained`).
      num_classes: default: the checkpoint's head; another count gets a zero-initialised head.
      include_top: default: `True` when the checkpoint has a head or `num_classes` is given.
      num_heads: for timm files of non-standard width (the file does not store it).
      timm_architecture: for timm files, the timm model name (e.g.
        `"vit_base_patch16_clip_quickgelu_224"`), which decides what the keys cannot: LayerNorm
        epsilon, GELU variant, heads (see `vit_keras.weights.checkpoints.timm`). Default: the
        `architecture` of a timm `config.json` beside the file, if any.
      strict: as in `vit_keras.load_pretrained`.
      interpolation: as in `vit_keras.load_pretrained`.
      antialias: as in `vit_keras.load_pretrained`.
      allow_non_finite: as in `vit_keras.load_pretrained`: `False` refuses a checkpoint with NaN
        or Inf in the arrays it loads.
      **build_kwargs: any other `build_model` argument (e.g. `include_preprocessing`, `dropout`),
        overriding what the checkpoint says.

    Returns:
      The loaded `vit_keras.ViT`, named after the checkpoint's family and size where the file
      says its family (`"DINOv3-B/16"`, `"EVA02-S/14"`, see `configs.family_variant_name`),
      else after the paper's variant it holds, else `"custom"`.

    Raises:
      vit_keras.errors.CheckpointError: when the checkpoint cannot be read or holds another
        architecture than `variant`; and the errors of `resolve_weights`.
    """
    if variant is not None and num_heads is None:
        num_heads = configs.get_config(variant).num_heads
    path, release = resolve_weights(path, variant, image_size)
    checkpoint = loader.read_checkpoint(path, num_heads=num_heads,
                                        timm_architecture=timm_architecture)
    arch = loader.architecture(checkpoint)
    config = _family_named(dataclasses.replace(
        _variant_for(arch["config"], variant, checkpoint.path), **arch["switches"]), checkpoint)
    if image_size is None and arch["grid"] is None and config.position_embedding == "none":
        image_size = 224  # rotary embeddings alone: no size is stored, any size works
    if image_size is None:
        if arch["grid"] is None:
            raise errors.CheckpointError(
                f"Cannot tell the image size of {checkpoint.path!r} (its position "
                f"grid is not square); pass image_size=(height, width).")
        image_size = geometry.image_size_for_grid(config, arch["grid"])
    if include_top is None:
        include_top = num_classes is not None or arch["num_classes"] is not None
    num_classes = num_classes or arch["num_classes"]
    if include_top and num_classes is None:
        raise errors.CheckpointError(
            f"{checkpoint.path!r} has no classification head; pass num_classes=... "
            f"for a new (zero-initialised) head, or include_top=False.")
    kwargs = {"image_size": image_size, "num_classes": num_classes or 1000,
              "include_top": include_top, "classifier": arch["classifier"],
              "representation_size": arch["representation_size"], "channels": arch["channels"],
              **build_kwargs}
    kwargs["normalization"] = input_normalization(
        kwargs.get("normalization"), checkpoint, kwargs.get("include_preprocessing", True),
        release)
    kwargs.setdefault("eval_crop", checkpoint.hints.get("eval_crop"))
    if checkpoint.hints.get("naflex"):  # SigLIP 2's NaFlex towers: NaFlex, unless told otherwise
        kwargs.setdefault("naflex", True)
    model = model_lib.ViT(config, **kwargs)
    return loader.load_pretrained(model, checkpoint, strict=strict, interpolation=interpolation,
                                  antialias=antialias, allow_non_finite=allow_non_finite,
                                  check_normalization=False)
