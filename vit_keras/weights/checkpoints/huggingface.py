"""Hugging Face checkpoints of the ViT family: a `save_pretrained` folder or its weights file, with
the architecture read from `config.json` beside it when present.

The families (`config.json`'s `model_type`): `vit` (`ViTModel`, `ViTForImageClassification`),
`deit` (`DeiTModel`, `DeiTForImageClassification[WithTeacher]`), `dinov2` (`Dinov2Model`),
`dinov2_with_registers`, `clip_vision_model` (`CLIPVisionModel`; a full `clip` folder gives its
image tower), `siglip_vision_model` (`SiglipVisionModel`; a full `siglip` folder likewise),
`siglip2_vision_model` (`Siglip2VisionModel`, SigLIP 2's NaFlex tower: a NaFlex model, see
`vit_keras.ViT(naflex=True)`; a full `siglip2` folder likewise),
`vit_mae` (`ViTMAEModel`), and with rotary embeddings or gated MLPs `dinov3_vit`
(`DINOv3ViTModel`) and `aimv2_vision_model` (`Aimv2VisionModel` without its attention-pooling
`head`, `use_head=false`). The key names are `names.from_huggingface`'s; this module reads what
only `config.json` says (epsilon, GELU variant, heads, grid); the defaults each family's config
class has when a field is left out, its published normalisation and its name are its record's
(`vit_keras.weights.families`, `by_model_type`).
"""

import dataclasses
import logging
import math
import os
import re

from vit_keras import errors
from vit_keras.model import pixel_normalization as normalization_lib
from vit_keras.weights import families
from vit_keras.weights.checkpoints import files, names, timm

logger = logging.getLogger("vit_keras")

CONFIG = "config.json"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
# The patch embedding of every family: ViT/DeiT/DINOv2/MAE `embeddings.patch_embeddings.projection`,
# CLIP/SigLIP `embeddings.patch_embedding`; under `vit.`, `deit.` or `vision_model.` (full CLIP).
_ANCHOR = re.compile(r"(?:^|\.)embeddings\.patch_embed(?:dings?)?\.(?:projection\.)?weight$")
# Hugging Face activation names → the MLP's activation: a `ViTConfig.gelu` variant, or "silu"
# (AIMv2's gate; DINOv3's plain or gated MLP may take either).
_ACTIVATIONS = {"gelu": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
                "quick_gelu": "quick", "silu": "silu"}
# The MLP (`ViTConfig.mlp`) by (gated, SiLU).
_MLPS = {(False, False): "gelu", (False, True): "silu", (True, False): "geglu",
         (True, True): "swiglu"}
FAMILIES = families.model_types()
"""The `model_type`s vit_keras reads (`clip` and `siglip` folders: their `vision_config`), each
claimed by a family's record (`vit_keras.weights.families`)."""
_VISION_TOWERS = {"clip": "clip_vision_model", "siglip": "siglip_vision_model",
                  "siglip2": "siglip2_vision_model"}


def read_json(path):
    """The JSON object in the file at `path`; a `CheckpointError` naming the file if it is not one
    (or is too long or too deeply nested to be a configuration, see `files.read_json`)."""
    value = files.read_json(path)
    if not isinstance(value, dict):
        raise errors.CheckpointError(f"{path!r} holds a JSON {type(value).__name__}, not an object.")
    return value


def _shards(index):
    """The files an `model.safetensors.index.json` names, each a plain name inside its folder."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(name, str) for name in weight_map.values()):
        raise errors.CheckpointError(f"{index!r} has no \"weight_map\" of tensor names to shard files.")
    folder = os.path.dirname(index)
    shards = []
    for shard in sorted(set(weight_map.values())):
        # Lexically, not with realpath: the hub's snapshot folders hold symlinks into its blobs.
        path = os.path.normpath(os.path.join(folder, shard))
        if os.path.isabs(shard) or os.path.dirname(path) != os.path.normpath(folder):
            raise errors.CheckpointError(
                f"{index!r} names the shard {shard!r}, which is not a file in its "
                f"folder; refusing to read outside {folder!r}.")
        if not os.path.isfile(path):
            raise errors.CheckpointNotFoundError(
                f"{index!r} names the shard {shard!r}, which is missing "
                f"from {folder!r}.")
        shards.append(path)
    return shards


def weight_files(folder):
    """The weights of a `save_pretrained` folder: `model.safetensors` (or its shards) first."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single]
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        return _shards(index)
    for name in ("pytorch_model.bin", "model.pth", "pytorch_model.pth"):
        if os.path.exists(os.path.join(folder, name)):
            return [os.path.join(folder, name)]
    raise errors.CheckpointNotFoundError(
        f"No weights in folder {folder!r}: expected model.safetensors, "
        f"model.safetensors.index.json or pytorch_model.bin (a save_pretrained folder).")


def _positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_config(config, path):
    """Refuses a `config.json` whose fields that vit_keras reads have impossible values, or a model
    vit_keras cannot hold."""
    def bad(field, expected):
        return errors.CheckpointError(
            f"{path!r}: {field} is {config.get(field)!r}; expected {expected}.")

    model_type = config.get("model_type", "vit")
    if model_type not in FAMILIES:
        raise bad("model_type", f"one of {sorted(FAMILIES + tuple(_VISION_TOWERS))} (the ViT "
                                f"family vit_keras reads)")
    for field in ("num_attention_heads", "patch_size"):
        if field in config and not _positive_int(config[field]):
            raise bad(field, "a positive whole number")
    size = config.get("image_size")
    if "image_size" in config and not (_positive_int(size) or (
            isinstance(size, (list, tuple)) and len(size) == 2 and all(map(_positive_int, size)))):
        raise bad("image_size", "a positive whole number or [height, width]")
    epsilon = config.get("layer_norm_eps", 1.0)
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise bad("layer_norm_eps", "a positive number")
    if config.get("hidden_act", "gelu") not in _ACTIVATIONS:
        raise bad("hidden_act", f"one of {sorted(_ACTIVATIONS)} (the activations vit_keras "
                                f"supports)")
    if config.get("use_swiglu_ffn"):
        raise bad("use_swiglu_ffn", "false: read DINOv2 giant from timm's file "
                                    "(vit_giant_patch14_dinov2), whose SwiGLU vit_keras holds")
    if model_type == "aimv2_vision_model" and config.get("use_head", True):
        raise bad("use_head", "false: AIMv2's attention-pooling head is not supported; load the "
                              "encoder from a folder saved with use_head=false, or from timm's "
                              "file (aimv2_*), which pools by the mean of the patch tokens")


def vision_config(config):
    """The image tower's config in a `config.json` dict: the dict itself, or a full CLIP or
    SigLIP model's `vision_config` (with its `model_type`); None for None."""
    if config is None:
        return None
    tower = _VISION_TOWERS.get(config.get("model_type"))
    if tower is None:
        return config
    nested = config.get("vision_config")
    if not isinstance(nested, dict):
        nested = {}  # every field at its default
    return {**nested, "model_type": tower}


def read_config(folder):
    """`config.json` in `folder` (its image tower's part, see `vision_config`) as a dict, or None;
    a `CheckpointError` naming the file and the field when it is not JSON, a field vit_keras
    reads has an impossible value, or the model is not one of the `FAMILIES`."""
    path = os.path.join(folder, CONFIG)
    if not os.path.exists(path):
        return None
    config = vision_config(read_json(path))
    _check_config(config, path)
    return config


def _preprocessor_config(folder):
    """`(path, dict)` of the folder's `preprocessor_config.json`, or `(path, None)` without one."""
    path = os.path.join(folder, PREPROCESSOR_CONFIG)
    return path, read_json(path) if os.path.isfile(path) else None


def read_eval_crop(folder):
    """The evaluation transform (`ViT.eval_crop`) of the folder's image processor: for
    `do_center_crop` after resizing the shorter side (`size.shortest_edge`), `(crop_size /
    shortest_edge, "bilinear" or "bicubic" by its PIL `resample` code 2 or 3, "floor")`. None
    (resize only) without the file or a crop, and for the crops vit_keras does not reproduce:
    after resizing to `size.height` x `size.width`, a side of `crop_size` that is not square, a
    bare number for `size` (its meaning is the processor class's) or another resampling."""
    _, config = _preprocessor_config(folder)
    if not config or not config.get("do_center_crop"):
        return None
    size, crop = config.get("size"), config.get("crop_size")
    short = size.get("shortest_edge") if isinstance(size, dict) and len(size) == 1 else None
    if isinstance(crop, dict) and crop.get("height") == crop.get("width"):
        crop = crop.get("height")
    resample = config.get("resample")
    interpolation = {2: "bilinear", 3: "bicubic"}.get(resample) if _positive_int(resample) else None
    # A side beyond int32 is none that tf.image resizes to (and beyond floats, none to divide).
    if not (_positive_int(short) and _positive_int(crop) and crop <= short < 2**31
            and interpolation):
        return None
    fraction = crop / short
    while math.floor(crop / fraction) < short:  # the shorter side resized as the file says
        fraction = math.nextafter(fraction, 0)
    return fraction, interpolation, "floor"


def read_normalization(folder, model_type):
    """`(Normalization, where it comes from)` of a folder's pixels: its image processor's
    `preprocessor_config.json` (`image_mean`, `image_std`, `rescale_factor`, `do_normalize`), else
    the published processors of its family `model_type` (its record's `normalization`, where
    the `model_type` alone says it: not `vit`'s, which DINO's weights share); `(None, None)` when
    neither says."""
    path, config = _preprocessor_config(folder)
    if config is not None:
        try:
            scale = float(config.get("rescale_factor", 1 / 255)) if config.get(
                "do_rescale", True) else 1.0
            if not config.get("do_normalize", True):
                mean, std = (0.0,), (1.0,)
            else:
                mean, std = config["image_mean"], config["image_std"]
            # (x * scale - mean) / std in the [0, 1] scale that `Normalization` takes.
            mean = [float(m) / (255 * scale) for m in _as_list(mean)]
            std = [float(s) / (255 * scale) for s in _as_list(std)]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            raise errors.CheckpointError(
                f"{path!r} does not say how pixels are normalised ({type(error).__name__}: "
                f"{error}); expected image_mean and image_std.") from None
        try:
            return (normalization_lib.get_normalization((mean, std)),
                    f"{PREPROCESSOR_CONFIG} (image_mean, image_std)")
        except ValueError as error:  # values a model cannot compute with (see Normalization)
            raise errors.CheckpointError(f"{path!r} (rescale_factor, image_mean, image_std): "
                                         f"{error}") from None
    family = families.by_model_type(model_type)
    name = family.normalization if family and family.normalization_by_name else None
    if name is None:
        return None, None
    return (normalization_lib.NORMALIZATIONS[name],
            f"the published image processors of the {model_type} family")


def _as_list(value):
    return value if isinstance(value, (list, tuple)) else [value]


def matches(state_dict):
    return any(_ANCHOR.search(key) for key in state_dict)


def family(state_dict, config=None):
    """The family (a `model_type` of `FAMILIES`) of a Hugging Face state dict: `config.json`'s
    `model_type` when there is one, else told from the keys."""
    if config and "model_type" in config:
        return vision_config(config)["model_type"]
    patches = next((value for key, value in state_dict.items()
                    if key.endswith("embeddings.patch_embedding.weight")), None)
    if patches is not None and patches.ndim == 2:  # a Linear over NaFlex's flattened patches
        return "siglip2_vision_model"
    keys = "\n".join(state_dict)
    for pattern, found in ((r"embeddings\.rms_norm\.weight$", "aimv2_vision_model"),
                           (r"^(?:model\.)?layer\.\d+\.attention\.q_proj", "dinov3_vit"),
                           (r"embeddings\.class_embedding$", "clip_vision_model"),
                           (r"embeddings\.patch_embedding\.weight$", "siglip_vision_model"),
                           (r"embeddings\.register_tokens$", "dinov2_with_registers"),
                           (r"layer_scale1\.lambda1$", "dinov2"),
                           (r"embeddings\.distillation_token$", "deit")):
        if re.search(pattern, keys, re.MULTILINE):
            return found
    return "vit"  # ViTMAEModel has ViT's keys and defaults


def hints(config, model_type="vit"):
    """Architecture facts from a `config.json` (dict, or None: the family's defaults) that the
    weights alone do not carry: `layer_norm_epsilon`, `gelu`, `num_heads`, `grid`, the `family`
    that names the model, and the family's position-embedding layout (`posemb_prefix`: every
    Hugging Face family adds position embeddings to its class and distillation tokens), the MLP's
    activation (`silu`: SiLU, else the GELU `gelu` names) and,
    where the config says, whether it is `gated` (DINOv3's `use_gated_mlp`)."""
    given = config is not None
    config = vision_config(config) or {}
    _check_config({"model_type": model_type, **config}, CONFIG)
    model_type = config.get("model_type", model_type)
    record = families.by_model_type(model_type)
    # A config.json leaves out the fields at their config class's defaults (transformers 4 saved
    # the difference); without a config.json the heads are the caller's or the paper's.
    config = {**record.transformers_defaults, **config}
    if given:
        config.setdefault("num_attention_heads", record.transformers_heads)
    activation = _ACTIVATIONS[config["hidden_act"]]
    gelu = "exact" if activation == "silu" else activation
    # AIMv2's RMSNorm names its epsilon rms_norm_eps.
    epsilon = config["rms_norm_eps" if "rms_norm_eps" in record.transformers_defaults
                     else "layer_norm_eps"]
    out = {"layer_norm_epsilon": float(epsilon), "gelu": gelu, "posemb_prefix": True,
           "silu": activation == "silu"}
    if isinstance(config.get("use_gated_mlp"), bool):
        out["gated"] = config["use_gated_mlp"]
    if record.names_models:
        out["family"] = record.name
    if record.rope:  # DINOv3's, with transformers' rope_theta for its temperature
        out["rope"] = record.rope
        if "rope_theta" in config:
            out["rope"] = dataclasses.replace(record.rope, temperature=float(config["rope_theta"]))
    out.update(record.transformers)  # DINOv3's pooler output: the class token after the norm
    if "num_attention_heads" in config:
        out["num_heads"] = int(config["num_attention_heads"])
    if "image_size" in config and "patch_size" in config:
        size = config["image_size"]
        rows, cols = (size, size) if isinstance(size, int) else size
        out["grid"] = (rows // config["patch_size"], cols // config["patch_size"])
    elif _positive_int(config.get("num_patches")):  # SigLIP 2: a square grid of num_patches
        side = math.isqrt(config["num_patches"])
        out["grid"] = (side, side)
    if _positive_int(config.get("patch_size")):
        out["patch_size"] = config["patch_size"]
    return out


def _encoder_and_heads(state_dict, model_type):
    """`state_dict` without the parts of a family's folder that no vit_keras model holds:
    `ViTMAEForPreTraining`'s decoder (the hub's `facebook/vit-mae-*` folders; only the encoder is
    ever fine-tuned), and `DeiTModel`'s pooler, which no published DeiT checkpoint trained (they
    are `DeiTForImageClassification[WithTeacher]` folders, whose `DeiTModel` has no pooler):
    vit_keras pools a distilled model as timm and DeiT do, by the mean of the class and
    distillation tokens, and says so in one log line."""
    if model_type == "vit_mae":
        return {k: v for k, v in state_dict.items() if not k.startswith("decoder.")}
    pooler = [k for k in state_dict if re.search(r"(?:^|\.)pooler\.dense\.", k)]
    if model_type == "deit" and pooler:
        logger.warning("DeiT: the checkpoint's pooler (Dense + tanh on the class token) is not "
                       "loaded; the model pools by the mean of the class and distillation "
                       "tokens, as DeiT and timm do.")
        return {k: v for k, v in state_dict.items() if k not in pooler}
    return state_dict


def convert(state_dict, config=None, num_heads=None, folder=None):
    """`(canonical params, info)`. The heads come from `config.json` (its family's default where
    it leaves them out), else from `num_heads`, else from the paper's variant of that width; a
    `num_heads` that `config.json` contradicts is a `CheckpointError`. LayerNorm epsilon and the
    MLP's activation come from `config.json`, else the family's defaults (ViT's epsilon is 1e-12,
    CLIP's GELU the quick one, ...), and whether the MLP is gated from the weights (a
    `use_gated_mlp` that contradicts them is a `CheckpointError`); the input normalisation and
    evaluation crop from `folder`'s image processor (see `read_normalization`,
    `read_eval_crop`)."""
    model_type = family(state_dict, config)
    state_dict = _encoder_and_heads(state_dict, model_type)
    info = {"format": "huggingface", "interpolation": "bicubic", "antialias": False,
            **hints(config, model_type)}
    if folder is not None:
        normalization, source = read_normalization(folder, model_type)
        if normalization is not None:
            info.update(normalization=normalization, normalization_source=source)
        eval_crop = read_eval_crop(folder)
        if eval_crop is not None:
            info["eval_crop"] = eval_crop
    if num_heads and info.setdefault("num_heads", num_heads) != num_heads:
        raise errors.CheckpointError(
            f"num_heads={num_heads} was asked for, but {os.path.join(folder or '.', CONFIG)!r} "
            f"says num_attention_heads={info['num_heads']}: a model of other heads would not "
            f"compute what the checkpoint was trained to.")
    if "num_heads" not in info:
        hidden = next(v for k, v in state_dict.items() if _ANCHOR.search(k)).shape[0]
        info["num_heads"] = timm.default_num_heads(hidden)
    params = names.from_huggingface(state_dict, info["num_heads"], info.pop("patch_size", None))
    gated = names.MLP.format(0) + "gate/kernel" in params
    if info.pop("gated", gated) != gated:
        raise errors.CheckpointError(
            f"{os.path.join(folder or '.', CONFIG)!r} says use_gated_mlp="
            f"{str(not gated).lower()}, but the weights have {'a' if gated else 'no'} gate "
            f"projection (mlp.gate_proj): the config and the weights are of different models.")
    info["mlp"] = _MLPS[gated, info.pop("silu")]
    return params, info
