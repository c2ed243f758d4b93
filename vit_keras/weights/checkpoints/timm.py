"""timm `VisionTransformer` state dicts (`.pth`, `.bin` or `.safetensors`), the ViT family included.

The keys say most of a timm model's switches (LayerScale `ls1`/`ls2`, `reg_token`, `dist_token`,
`norm_pre`, `fc_norm`, `attn_pool`, a patch embedding without bias); what they cannot say comes
from timm's `config.json` beside a hub file (its `architecture`, and the `mean` and `std` of its
`pretrained_cfg`), else from the timm architecture name (`timm_architecture=`), whose family's
record (`vit_keras.weights.families`, `by_timm_name`) says:

| name contains | LayerNorm epsilon | GELU | normalisation |
|---|---|---|---|
| `_clip_` (laion, openai, ...) | 1e-5 | exact | `"clip"` (LAION's L/14: `"inception"`) |
| `_clip_quickgelu_` (openai) | 1e-5 | quick | `"clip"` |
| `deit`, `_dinov2`, tag `.mae` or `.dino` | 1e-6 | exact | `"imagenet"` |
| `_siglip`, tag `.augreg*` or `.orig_in21k*` | 1e-6 | exact | `"inception"` |
| anything else | 1e-6 | exact | not known |

and the heads from its size (`tiny` 3, `small` 6, `base` 12, `large` 16, ...: `_HEADS_BY_SIZE`,
timm's size words; AIMv2's own, its record's) at the width that size has: a file of another
width needs its heads from the caller or the config (`convert`).

The rotary families (timm's `Eva` models: EVA-02, DINOv3, PE, RoPE-ViT) need the name: the keys
give their parts (separate q/k/v projections, `q_bias`/`v_bias`, `gamma_1`/`gamma_2`, SwiGLU as
`fc1_g`/`fc1_x` or packed in `fc1`, the MLP's norm, `patch_embed.norm`, RMSNorm's missing biases,
RoPE-Mixed's `rope.freqs`) but not the kind and settings of the rotary embeddings, which
the family's record gives for the name (docs/checkpoints.md, "The rotary and gated families"); a
file of `Eva` keys without a name is refused rather than read without its RoPE. Without either, the keys
decide what they can: CLIP's (`norm_pre` and a patch embedding without bias) give its epsilon and
normalisation, a distillation token DeiT's normalisation; CLIP's GELU variant (quick in OpenAI's
weights as timm's `_clip_quickgelu_` models hold them, exact in timm's `_clip_` ones) they cannot
tell, and that is said in one warning.

timm's NaFlexVit files (`naflexvit_*`: SigLIP 2's towers and timm's own NaFlexViTs) hold the same
parts under `embeds.*`, with a linear patch embedding over flattened patches and a `(1, rows,
cols, hidden)` position grid; they are read back into these keys (`_from_naflexvit`), as NaFlex
models. How the grid is resized (bilinear or bicubic, aspect-preserving or not) only the name
says, so they too need it; the factorized grids (`_parfac_`) and RADIO's unantialiased one are
refused by name.
"""

import dataclasses
import logging
import os
import re

from vit_keras import errors
from vit_keras.model import configs, geometry
from vit_keras.model import pixel_normalization as normalization_lib
from vit_keras.weights import families
from vit_keras.weights.checkpoints import files, names

logger = logging.getLogger("vit_keras")

_ANCHOR = "patch_embed.proj.weight"
_NAFLEX_ANCHOR = "embeds.proj.weight"  # timm's NaFlexVit (`naflexvit_*`)
CONFIG = "config.json"
# The heads of the models timm (1.0.31) builds under a size in their names, by width: the
# name's heads hold for a file of that width only. A narrowed file (timm's `embed_dim=...`) of
# another width takes its heads from the caller or timm's config.json, or is refused.
_HEADS_BY_SIZE = {"tiny": {192: 3}, "small": {384: 6}, "small_plus": {384: 6},
                  "medium": {512: 8}, "mediumd": {512: 8}, "betwixt": {640: 10},
                  "base": {768: 12, 896: 14}, "large": {1024: 16}, "huge": {1280: 16},
                  "huge_plus": {1280: 20}, "giant": {1408: 16, 1536: 24},
                  "gigantic": {1664: 16}, "enormous": {1792: 16}, "so150m": {896: 14},
                  "so150m2": {832: 13},
                  "so400m": {1152: 16}, "7b": {4096: 32}}


def matches(state_dict):
    return _ANCHOR in state_dict or _NAFLEX_ANCHOR in state_dict


def default_num_heads(hidden_size):
    """The head count of the paper's variants for a hidden size (timm files do not store it), the
    last resort of a file whose name and config do not say."""
    heads = {c.num_heads for c in configs.VARIANTS.values() if c.hidden_size == hidden_size}
    if len(heads) != 1:
        raise errors.CheckpointError(
            f"Cannot tell the number of attention heads of a timm checkpoint with hidden size "
            f"{hidden_size} (not a standard variant); pass num_heads=..., variant=... or "
            f"timm_architecture=....")
    return heads.pop()


# Keys of timm ViTs that vit_keras' model has no place for, and what they are.
_UNSUPPORTED = (
    (r"\.attn\.[qk]_norm\.", "qk-norm (a norm on queries and keys)"),
    (r"\.attn\.norm\.", "a norm inside attention"),
    (r"\.attn\.gate\.", "a gated attention output"),
    (r"\.mlp\.(?:w12|w3)\.", "a SwiGLU of other names (w12, w3)"),
    (r"^rel_pos|\.relative_position", "relative position biases (BEiT)"),
    (r"^embeds\.pos_embed_[yx]$", "factorized position embeddings (timm's naflexvit_*_parfac_*)"),
    (r"^embeds\.norm_input\.", "a norm on each patch's pixels"),
)
# Keys only timm's `Eva` class writes (AIMv2's `fc1_g` is a VisionTransformer's, without RoPE).
_EVA_KEYS = r"\.attn\.(?:[qkv]_proj\.|[qv]_bias$)|\.gamma_[12]$|\.mlp\.norm\."


def architecture_hints(timm_architecture):
    """What a timm architecture name (`"vit_base_patch16_clip_quickgelu_224.openai"`; the
    pretrained tag after the dot matters only for the normalisation, the evaluation crop and MAE's
    family) says what the keys do not, from its family's record (`families.by_timm_name`):
    `layer_norm_epsilon`, `gelu`, `heads_by_width` (`{width: heads}`) where its size names them,
    the rotary settings, the `image_size` it ends in (or its family's), the `family` that names
    the model, and `normalization` and `eval_crop` where the record names one."""
    name = timm_architecture.split(".")[0]
    own = families.by_timm_name(name)  # the name's family; MAE's is its tag's
    hints = {"layer_norm_epsilon": own.layer_norm_epsilon,
             "gelu": "quick" if "quickgelu" in name else "exact"}  # timm's GELU is exact else
    size = re.match(r"^(?:vit_pe_[a-z]+|vit|deit3?|eva02|naflexvit)_([a-z0-9]+(?:_plus)?)_", name)
    found, heads = families.first_match(own.timm_heads, name)
    if not found:
        heads = _HEADS_BY_SIZE.get(size.group(1)) if size else None
    if heads:
        hints["heads_by_width"] = heads
    image_size = re.search(r"_(\d+)$", name)
    image_size = int(image_size.group(1)) if image_size else own.image_size
    if image_size:
        hints["image_size"] = (image_size, image_size)
    rope = families.first_match(own.timm_rope, name)[1] or own.rope
    grid = re.search(r"_patch(\d+)_(\d+)", name) if own.rope_own_grid else None
    if grid:
        side = int(grid.group(2)) // int(grid.group(1))
        rope = dataclasses.replace(rope, ref_grid=(side, side))
    if rope is not None:
        hints["rope"] = rope
    hints.update(own.timm)
    for pattern, switches in own.timm_switches:
        if re.search(pattern, name):
            hints.update(switches)
    family = families.by_timm_name(timm_architecture)
    if family.names_models:
        hints["family"] = family.name
    eval_crop = eval_crop_for_name(timm_architecture)
    if eval_crop:
        hints["eval_crop"] = eval_crop
    normalization = normalization_for_name(timm_architecture)
    if normalization:
        hints["normalization"] = normalization_lib.NORMALIZATIONS[normalization]
        hints["normalization_source"] = f"the timm architecture {timm_architecture!r}"
    return hints


def normalization_for_name(timm_name):
    """The name of the normalisation (a key of `vit_keras.model.pixel_normalization.NORMALIZATIONS`)
    that a timm model name with or without its pretrained tag says (its family's
    `timm_normalization`, else the family's where its name says it), or None."""
    family = families.by_timm_name(timm_name)
    found, normalization = families.first_match(family.timm_normalization, timm_name)
    if found:
        return normalization  # a None rule ends the search too
    return family.normalization if family.normalization_by_name else None


def eval_crop_for_name(timm_name):
    """`(crop_fraction, interpolation)` of timm's evaluation transform that a timm model name with
    its pretrained tag says (its family's `eval_crop`, else its `timm_eval_crops`), or None
    (resize only)."""
    family = families.by_timm_name(timm_name)
    return family.eval_crop or families.first_match(family.timm_eval_crops, timm_name)[1]


def config_beside(path):
    """What timm's `config.json` in the folder of `path` (a hub download, or timm's
    `save_for_hf`) says, as a dict with any of: `architecture` (with its pretrained tag,
    `"vit_small_patch14_dinov2.lvd142m"`), `normalization` (the `mean` and `std` of its
    `pretrained_cfg`), `eval_crop` (its `crop_pct` and `interpolation`, for a centre crop of
    bilinear or bicubic resizing: `ViT`'s `eval_crop`), `num_heads` (of its `model_args`) and
    `image_size` (`(height, width)` of its `model_args`' `img_size`: the model's) and
    `input_size` (of its `pretrained_cfg`: the data's, which may differ from the model's); for a
    NaFlexVit, `posemb_interpolation` and `posemb_preserve_aspect` where its `model_args` set
    timm's `pos_embed_interp_mode` and `pos_embed_ar_preserving`, and `patch_size` (of its
    `model_args`: a NaFlexVit's linear patch embedding does not say it).
    Empty when there is no such file or it is not timm's: the weights alone decide."""
    config = os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG)
    if not os.path.isfile(config):
        return {}
    try:
        config = files.read_json(config)
        found = {}
        if isinstance(config.get("architecture"), str):
            tag = (config.get("pretrained_cfg") or {}).get("tag")
            found["architecture"] = config["architecture"] + (
                f".{tag}" if isinstance(tag, str) and tag else "")
        data = config.get("pretrained_cfg") or {}
        if "mean" in data and "std" in data:
            found["normalization"] = normalization_lib.get_normalization(
                (data["mean"], data["std"]))
        if data.get("crop_mode", "center") == "center":  # else a transform vit_keras lacks
            try:
                found["eval_crop"] = tuple(geometry.eval_crop(
                    (data.get("crop_pct"), data.get("interpolation"))))
            except ValueError:
                pass  # none that vit_keras runs: resized
        model_args = config.get("model_args") or {}
        heads = model_args.get("num_heads")
        if _positive_int(heads):
            found["num_heads"] = heads
        if _positive_int(model_args.get("patch_size")):
            found["patch_size"] = model_args["patch_size"]
        if model_args.get("pos_embed_interp_mode") in ("bilinear", "bicubic"):  # NaFlexVit's
            found["posemb_interpolation"] = model_args["pos_embed_interp_mode"]
        if isinstance(model_args.get("pos_embed_ar_preserving"), bool):
            found["posemb_preserve_aspect"] = model_args["pos_embed_ar_preserving"]
        for key, size in (("image_size", model_args.get("img_size")),
                          ("input_size", (data.get("input_size") or [None])[1:])):
            size = [size, size] if _positive_int(size) else size
            if isinstance(size, (list, tuple)) and len(size) == 2 and all(map(_positive_int, size)):
                found[key] = tuple(size)
        return found
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        return {}  # not timm's: the weights alone decide


def _positive_int(value):
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def unsupported_features(state_dict):
    """What the timm state dict holds that vit_keras' ViT has no place for (qk-norm, SwiGLU,
    rotary embeddings, ...), as phrases; empty for the family vit_keras reads."""
    return [what for pattern, what in _UNSUPPORTED
            if any(re.search(pattern, key) for key in state_dict)]


def _hints_from_keys(state_dict, warn=True):
    """What the keys alone decide about numerics: CLIP's epsilon and normalisation from its
    `norm_pre` and bias-free patch embedding, with a warning (`warn`) that its GELU variant cannot
    be told; DeiT's normalisation from a distillation token."""
    if "norm_pre.weight" in state_dict and "patch_embed.proj.bias" not in state_dict:
        if warn:
            logger.warning(
                "The keys of this timm checkpoint are CLIP's (norm_pre, no patch bias): LayerNorm "
                "epsilon 1e-5 and CLIP's normalisation; its GELU cannot be told from the keys, "
                "exact assumed (timm's vit_*_clip_*): for OpenAI's quick GELU pass "
                "timm_architecture='vit_base_patch16_clip_quickgelu_224' (or the model's own "
                "name; apps: --timm_architecture).")
        return {"layer_norm_epsilon": 1e-5, "gelu": "exact",
                "normalization": normalization_lib.NORMALIZATIONS["clip"],
                "normalization_source": "the keys (CLIP's)"}
    if "dist_token" in state_dict:
        return {"normalization": normalization_lib.NORMALIZATIONS["imagenet"],
                "normalization_source": "the keys (DeiT's distillation token)"}
    return {}


def convert(state_dict, num_heads=None, timm_architecture=None, beside=None):
    """`(canonical params, info)`. timm resamples state-dict position embeddings bicubic with
    antialias (`checkpoint_filter_fn`), so that is this format's default. Each setting comes from
    the first that says it: the caller (`num_heads`), timm's `config.json` (`beside`, see
    `config_beside`), the weights (RoPE-Mixed's frequencies hold the heads), and the architecture
    name (`timm_architecture`, else the config's) where the weights agree with it: its heads
    only for the width it names them at. Where two of these disagree, or none says the heads of
    a width that the paper's variants do not give, a `CheckpointError` says which to pass."""
    beside = beside or {}
    timm_architecture = timm_architecture or beside.get("architecture")
    naflex_grid = None
    if _NAFLEX_ANCHOR in state_dict:
        state_dict, naflex_grid = _from_naflexvit(state_dict, timm_architecture,
                                                  beside.get("patch_size"))
    normalization = beside.get("normalization")
    eval_crop = beside.get("eval_crop")
    if not timm_architecture and "rope.freqs" not in state_dict and any(
            re.search(_EVA_KEYS, key) for key in state_dict):
        raise errors.CheckpointError(
            "The keys of this timm checkpoint are those of timm's Eva models (EVA-02, DINOv3, "
            "PE, RoPE-ViT), whose rotary position embeddings the keys do not describe: pass its "
            "architecture name, timm_architecture='eva02_base_patch14_224' or the like (apps: "
            "--timm_architecture); a hub download's config.json names it.")
    hints = _hints_from_keys(state_dict, warn=not timm_architecture)
    if timm_architecture:  # the name decides all but a normalisation it does not name
        hints = {key: value for key, value in hints.items() if key.startswith("normalization")}
        hints.update(architecture_hints(timm_architecture))
    if normalization is not None:
        hints.update(normalization=normalization,
                     normalization_source="timm's config.json (pretrained_cfg mean and std)")
    if eval_crop is not None:
        hints["eval_crop"] = eval_crop
    hints.update({key: beside[key] for key in ("posemb_interpolation", "posemb_preserve_aspect")
                  if key in beside})
    if (timm_architecture and "cls_token" in state_dict
            and families.by_timm_name(timm_architecture.split(".")[0]).rope_own_grid):
        # PE counts patches from 1 beside its class token.
        hints["rope"] = dataclasses.replace(hints["rope"], grid_offset=1.0)
    num_heads = _num_heads(state_dict, num_heads, beside.get("num_heads"),
                           hints.pop("heads_by_width", None), timm_architecture)
    grid = naflex_grid or _grid(state_dict, beside.get("image_size"),
                                beside.get("input_size") or hints.pop("image_size", None))
    hints.pop("image_size", None)
    if grid:
        hints["grid"] = grid
    params = names.from_timm(state_dict, num_heads, hints.get("map_num_heads"))
    info = {"format": "timm", "interpolation": "bicubic", "antialias": True,
            "num_heads": num_heads, **hints}
    return params, info


def _from_naflexvit(state_dict, timm_architecture, patch_size=None):
    """`(state dict, grid)`: a timm NaFlexVit's keys as its `VisionTransformer`'s (undoing timm's
    `checkpoint_filter_fn`: `embeds.*` back to `patch_embed.*`, `pos_embed`, `cls_token`,
    `reg_token`; its linear patch embedding over (row, column, channel) patches back to a Conv2d
    weight; its `(1, rows, cols, hidden)` position grid flattened) and the grid `(rows, cols)`.
    Its position embeddings cover the patches alone, never the prefix tokens. The patch size is
    `patch_size` (timm's config.json's `model_args`), else the name's, else that of 3 channels."""
    if not timm_architecture:
        raise errors.CheckpointError(
            "The keys of this timm checkpoint are those of timm's NaFlexVit (embeds.*), whose "
            "position grid is resized as its name says (bilinear for SigLIP 2's, bicubic and "
            "aspect-preserving for naflexvit_*_par_*): pass its architecture name, "
            "timm_architecture='naflexvit_base_patch16_siglip' or the like (apps: "
            "--timm_architecture); a hub download's config.json names it.")
    if "_radio_" in timm_architecture:
        raise errors.CheckpointError(
            f"{timm_architecture!r} is one of NVIDIA's RADIO backbones, whose position grid timm "
            f"resizes without antialiasing (v3's with aligned corners too); vit_keras resizes "
            f"with antialiasing only, so it does not read them.")
    out, grid = {}, None
    for key, value in state_dict.items():
        if key == _NAFLEX_ANCHOR and value.ndim == 2:  # a Linear over flattened patches
            hidden, values = value.shape
            said = re.search(r"_patch(\d+)", timm_architecture)
            patch = patch_size or (int(said.group(1)) if said else int(round((values / 3) ** 0.5)))
            if values % (patch * patch):
                raise errors.CheckpointError(
                    f"The patch embedding of this NaFlexVit reads {values} values per patch, "
                    f"not patch x patch x channels for the patch size {patch} of "
                    f"{timm_architecture!r}.")
            value = value.reshape(hidden, patch, patch, -1).transpose(0, 3, 1, 2)
        elif key == "embeds.pos_embed" and value.ndim == 4:
            grid = tuple(int(side) for side in value.shape[1:3])
            value = value.reshape(1, grid[0] * grid[1], value.shape[-1])
        renamed = re.sub(r"^embeds\.(proj|norm)\.", r"patch_embed.\1.", key)
        out[re.sub(r"^embeds\.(pos_embed|cls_token|reg_token)$", r"\1", renamed)] = value
    return out, grid


def _num_heads(state_dict, asked, configured, heads_by_width, timm_architecture):
    """The attention heads of a timm file (see `convert`)."""
    width = int(state_dict[_ANCHOR].shape[0])
    frequencies = state_dict.get("rope.freqs")  # (2, depth, heads, head_dim / 2)
    stored = int(frequencies.shape[2]) if frequencies is not None and frequencies.ndim == 4 else None
    said = [(heads, where) for heads, where in (
        (asked, "num_heads"), (configured, "timm's config.json (model_args)"),
        (stored, "the weights (rope.freqs)")) if heads]
    if len({heads for heads, _ in said}) > 1:
        raise errors.CheckpointError(
            "The attention heads of this timm checkpoint disagree: " + ", ".join(
                f"{where} says {heads}" for heads, where in said) + "; pass the right num_heads.")
    if said:
        return said[0][0]
    if heads_by_width and width in heads_by_width:
        return heads_by_width[width]
    if heads_by_width:
        raise errors.CheckpointError(
            f"This timm checkpoint is {width} wide, which is not the width its name "
            f"{timm_architecture!r} has ({' or '.join(map(str, heads_by_width))}): a narrowed "
            f"model, whose heads only its maker knows; pass num_heads=... (apps/convert.py: "
            f"--num_heads).")
    return default_num_heads(width)


def _grid(state_dict, configured, default):
    """The token grid `(rows, cols)` the model was built for: the image size of timm's
    config.json's `model_args`, checked against the position embeddings; without absolute ones
    (rotary families), the `default`: its `pretrained_cfg`'s input size, else the size the name
    ends in (or its family's); else None (the position embeddings tell)."""
    patch = state_dict[_ANCHOR].shape[-2:]
    position = state_dict.get("pos_embed")
    size = configured or (default if position is None else None)
    if size is None:
        return None
    grid = (size[0] // patch[0], size[1] // patch[1])
    if position is not None and position.ndim == 3:
        tokens = position.shape[1] - grid[0] * grid[1]
        covered = int("cls_token" in state_dict) + int("dist_token" in state_dict)
        if tokens not in (0, covered):
            raise errors.CheckpointError(
                f"timm's config.json (model_args.img_size) says the model takes "
                f"{size[0]}x{size[1]} images ({grid[0]}x{grid[1]} patches), but its position "
                f"embeddings hold "
                f"{position.shape[1]} tokens: the config is not this file's.")
    return grid
