"""Hugging Face `ViTModel` / `ViTForImageClassification` checkpoints: a `save_pretrained` folder or
its weights file, with the architecture read from `config.json` beside it when present."""

import json
import os

from vit_keras.checkpoints import names
from vit_keras.checkpoints import timm

CONFIG = "config.json"
_ANCHOR = "embeddings.patch_embeddings.projection.weight"
# Hugging Face activation names → vit_keras' approximate_gelu.
_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def weight_files(folder):
    """The weights of a `save_pretrained` folder: `model.safetensors` (or its shards) first."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single]
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, shard) for shard in shards]
    for name in ("pytorch_model.bin", "model.pth", "pytorch_model.pth"):
        if os.path.exists(os.path.join(folder, name)):
            return [os.path.join(folder, name)]
    raise FileNotFoundError(
        f"No weights in folder {folder!r}: expected model.safetensors, "
        f"model.safetensors.index.json or pytorch_model.bin (a save_pretrained folder).")


def read_config(folder):
    """`config.json` in `folder` as a dict, or None."""
    path = os.path.join(folder, CONFIG)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def matches(state_dict):
    return any(key.endswith(_ANCHOR) for key in state_dict)


def hints(config):
    """Architecture facts from a ViT `config.json` that the weights alone do not carry."""
    if not config:
        return {}
    activation = config.get("hidden_act", "gelu")
    if activation not in _GELU:
        raise ValueError(f"Unsupported hidden_act {activation!r} in config.json; vit_keras supports "
                         f"{sorted(_GELU)}.")
    out = {"layer_norm_epsilon": float(config.get("layer_norm_eps", 1e-12)),
           "approximate_gelu": _GELU[activation]}
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

