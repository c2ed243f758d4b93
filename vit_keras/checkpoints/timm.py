"""timm `VisionTransformer` state dicts (`.pth`, `.bin` or `.safetensors`), the ViT family included.

The keys say most of a timm model's switches (LayerScale `ls1`/`ls2`, `reg_token`, `dist_token`,
`norm_pre`, `fc_norm`, `attn_pool`, a patch embedding without bias); what they cannot say comes
from the timm architecture name (`timm_architecture=`, or the `architecture` of the `config.json`
timm writes beside a hub file):

| name contains | LayerNorm epsilon | GELU |
|---|---|---|
| `_clip_` (laion, openai) | 1e-5 | exact |
| `_clip_quickgelu_` (openai) | 1e-5 | quick |
| anything else (DeiT, DeiT III, DINOv2, SigLIP, MAE, AugReg) | 1e-6 | exact |

and the heads from its size (`tiny` 3, `small` 6, `base` 12, `large` 16, `huge` 16, `giant` 24,
`so400m` 16) when the paper's variants do not give one for the width.
"""

import os
import re

from vit_keras import configs, errors
from vit_keras.checkpoints import files, names

_ANCHOR = "patch_embed.proj.weight"
CONFIG = "config.json"
_HEADS_BY_SIZE = {"tiny": 3, "small": 6, "base": 12, "large": 16, "huge": 16, "giant": 24,
                  "so400m": 16, "so150m": 16}


def matches(state_dict):
    return _ANCHOR in state_dict


def default_num_heads(hidden_size):
    """The head count of the paper's variants for a hidden size (timm files do not store it)."""
    heads = {c.num_heads for c in configs.VARIANTS.values() if c.hidden_size == hidden_size}
    if len(heads) != 1:
        raise errors.CheckpointError(
            f"Cannot tell the number of attention heads of a timm checkpoint with hidden size "
            f"{hidden_size} (not a standard variant); pass num_heads=..., variant=... or "
            f"timm_architecture=....")
    return heads.pop()


def architecture_hints(timm_architecture):
    """What a timm architecture name (`"vit_base_patch16_clip_quickgelu_224.openai"`, the
    pretrained tag after the dot ignored) says that the keys do not: `layer_norm_epsilon`,
    `gelu`, and `num_heads` where its size names one."""
    name = timm_architecture.split(".")[0]
    hints = {"layer_norm_epsilon": 1e-5 if "_clip_" in name else 1e-6,
             "gelu": "quick" if "quickgelu" in name else "exact"}
    size = re.match(r"^(?:vit|deit3?)_([a-z0-9]+)_", name)
    if size and size.group(1) in _HEADS_BY_SIZE:
        hints["num_heads"] = _HEADS_BY_SIZE[size.group(1)]
    return hints


def architecture_beside(path):
    """The `architecture` of timm's `config.json` in the folder of `path` (a hub download), or
    None when there is none or it is not timm's."""
    config = os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG)
    if not os.path.isfile(config):
        return None
    try:
        architecture = files.read_json(config).get("architecture")
    except (OSError, ValueError, AttributeError):  # a CheckpointError is a ValueError
        return None  # not timm's: the weights alone decide
    return architecture if isinstance(architecture, str) else None


def convert(state_dict, num_heads=None, timm_architecture=None):
    """`(canonical params, info)`. timm resamples state-dict position embeddings bicubic with
    antialias (`checkpoint_filter_fn`), so that is this format's default. `num_heads` wins over
    the architecture name, which wins over the paper's variant of that width."""
    hints = architecture_hints(timm_architecture) if timm_architecture else {}
    num_heads = num_heads or hints.pop("num_heads", None) or default_num_heads(
        state_dict[_ANCHOR].shape[0])
    hints.pop("num_heads", None)
    params = names.from_timm(state_dict, num_heads)
    info = {"format": "timm", "interpolation": "bicubic", "antialias": True,
            "num_heads": num_heads, **hints}
    if hints:
        info["approximate_gelu"] = hints["gelu"] == "tanh"
    return params, info
