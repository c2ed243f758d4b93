"""Hugging Face `ViTModel` / `ViTForImageClassification` checkpoints: a `save_pretrained` folder or
its weights file, with the architecture read from `config.json` beside it when present."""

import json
import os

from vit_keras import errors
from vit_keras.checkpoints import names, timm

CONFIG = "config.json"
_ANCHOR = "embeddings.patch_embeddings.projection.weight"
# Hugging Face activation names → vit_keras' approximate_gelu.
_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def _read_json(path):
    """The JSON object in the file at `path`; a `CheckpointError` naming the file if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise errors.CheckpointError(f"{path!r} is not valid JSON ({error}).") from error
    if not isinstance(value, dict):
        raise errors.CheckpointError(f"{path!r} holds a JSON {type(value).__name__}, not an object.")
    return value


def _shards(index):
    """The files an `model.safetensors.index.json` names, each a plain name inside its folder."""
    weight_map = _read_json(index).get("weight_map")
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
    """Refuses a `config.json` whose fields that vit_keras reads have impossible values."""
    def bad(field, expected):
        return errors.CheckpointError(f"{path!r}: {field} is {config[field]!r}; expected {expected}.")

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
    if config.get("hidden_act", "gelu") not in _GELU:
        raise bad("hidden_act", f"one of {sorted(_GELU)} (the activations vit_keras supports)")


def read_config(folder):
    """`config.json` in `folder` as a dict, or None; a `CheckpointError` naming the file and the field
    when it is not JSON or a field vit_keras reads has an impossible value."""
    path = os.path.join(folder, CONFIG)
    if not os.path.exists(path):
        return None
    config = _read_json(path)
    _check_config(config, path)
    return config


def matches(state_dict):
    return any(key.endswith(_ANCHOR) for key in state_dict)


def hints(config):
    """Architecture facts from a ViT `config.json` that the weights alone do not carry."""
    if not config:
        return {}
    _check_config(config, CONFIG)
    out = {"layer_norm_epsilon": float(config.get("layer_norm_eps", 1e-12)),
           "approximate_gelu": _GELU[config.get("hidden_act", "gelu")]}
    if "num_attention_heads" in config:
        out["num_heads"] = int(config["num_attention_heads"])
    if "image_size" in config and "patch_size" in config:
        size = config["image_size"]
        rows, cols = (size, size) if isinstance(size, int) else size
        out["grid"] = (rows // config["patch_size"], cols // config["patch_size"])
    return out


def convert(state_dict, config=None, num_heads=None):
    """`(canonical params, info)`. The heads come from `config.json`, else from `num_heads`, else
    from the paper's variant of that width; LayerNorm epsilon defaults to Hugging Face's 1e-12."""
    info = {"format": "huggingface", "interpolation": "bicubic", "antialias": False,
            "layer_norm_epsilon": 1e-12, **hints(config)}
    if num_heads and "num_heads" not in info:  # config.json knows better than the caller
        info["num_heads"] = num_heads
    if "num_heads" not in info:
        hidden = next(v for k, v in state_dict.items() if k.endswith(_ANCHOR)).shape[0]
        info["num_heads"] = timm.default_num_heads(hidden)
    return names.from_huggingface(state_dict, info["num_heads"]), info

