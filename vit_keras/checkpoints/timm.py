"""timm `VisionTransformer` state dicts (`.pth`, `.bin` or `.safetensors`)."""

from vit_keras import configs, errors
from vit_keras.checkpoints import names

_ANCHOR = "patch_embed.proj.weight"


def matches(state_dict):
    return _ANCHOR in state_dict


def default_num_heads(hidden_size):
    """The head count of the paper's variants for a hidden size (timm files do not store it)."""
    heads = {c.num_heads for c in configs.VARIANTS.values() if c.hidden_size == hidden_size}
    if len(heads) != 1:
        raise errors.CheckpointError(
            f"Cannot tell the number of attention heads of a timm checkpoint with hidden size "
            f"{hidden_size} (not a standard variant); pass num_heads=... or variant=...")
    return heads.pop()


def convert(state_dict, num_heads=None):
    """`(canonical params, info)`. timm resamples state-dict position embeddings bicubic with
    antialias (`checkpoint_filter_fn`), so that is this format's default."""
    num_heads = num_heads or default_num_heads(state_dict[_ANCHOR].shape[0])
    params = names.from_timm(state_dict, num_heads)
    return params, {"format": "timm", "interpolation": "bicubic", "antialias": True,
                    "num_heads": num_heads}
