"""`load_pretrained`, `save_npz` and `architecture`: checkpoints in and out of built models.

Every format is first read into the canonical vit_jax layout (`names.py`); from there one code path
resamples position embeddings, reconciles heads, checks every key and shape, and only then assigns.
"""

import dataclasses
import logging
import os

import keras
import numpy as np

from vit_keras import errors
from vit_keras.model import configs, geometry
from vit_keras.model.position_embeddings import RopeSpec
from vit_keras.weights import patch_resize, posemb
from vit_keras.weights.checkpoints import files, huggingface, names, npz, timm

logger = logging.getLogger("vit_keras")

_HEAD = (names.HEAD + "kernel", names.HEAD + "bias")
_HEAD_DIST = (names.HEAD_DIST + "kernel", names.HEAD_DIST + "bias")
_LISTED = 10
"""How many problems an error lists before it sums up the rest as "and N more"."""


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint read into the canonical vit_jax layout.

    `format` is `"vit_jax"`, `"big_vision"`, `"timm"` or `"huggingface"`; `interpolation` and
    `antialias` are the format's own position-embedding resampling; `hints` holds what the weights
    alone do not say (`num_heads`, `layer_norm_epsilon`, `gelu`, `grid`).
    """

    path: str
    format: str
    params: dict
    interpolation: str
    antialias: bool
    hints: dict


def read_checkpoint(path, *, num_heads=None, timm_architecture=None):
    """Reads any supported checkpoint into a `Checkpoint`; never executes code from the file.

    Args:
      path: a vit_jax or big_vision `.npz`; a timm or Hugging Face state dict (`.safetensors`,
        `.pth`, `.bin`); or a Hugging Face `save_pretrained` folder. The format is told from the
        content, not the extension.
      num_heads: attention heads, needed to lay out fused PyTorch projections when the file does not
        say (timm files; default: the paper's variant of that hidden size).
      timm_architecture: a timm file's architecture name, for what its keys cannot say (LayerNorm
        epsilon, GELU variant, heads; see `vit_keras.weights.checkpoints.timm`). Default: the
        `architecture` of timm's `config.json` beside the file, if any.

    Returns:
      A `Checkpoint` (a `Checkpoint` passed as `path` comes back as it is).

    Raises:
      vit_keras.errors.CheckpointError: naming the file and what is wrong with it: an unknown
        format, a truncated or corrupt container, a malformed `config.json`, or no ViT in it.
      vit_keras.errors.CheckpointNotFoundError: nothing at `path`, or a folder without weights.
    """
    if isinstance(path, Checkpoint):
        return path
    path = os.fspath(path)
    if not os.path.exists(path):
        raise errors.CheckpointNotFoundError(f"No checkpoint at {path!r}.")
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    paths = huggingface.weight_files(path) if os.path.isdir(path) else [path]
    kind = files.sniff(paths[0])
    if kind == files.NPZ:
        params, info = npz.read(paths[0])
    else:
        if kind == files.SAFETENSORS:
            state_dict = files.read_safetensors(paths)
        else:
            state_dict = {k: v for p in paths for k, v in files.read_torch(p).items()}
        if timm.matches(state_dict):
            unsupported = timm.unsupported_features(state_dict)
            if unsupported:
                raise errors.CheckpointError(
                    f"{path!r} is a timm ViT with {', '.join(unsupported)}, which vit_keras does "
                    f"not support: its model holds the paper's ViT and DeiT, DeiT III, DINOv2, "
                    f"SigLIP, SigLIP 2, CLIP, MAE, EVA-02, DINOv3, PE, AIMv2, RoPE-ViT and NaFlexViT "
                    f"(docs/checkpoints.md).")
            params, info = timm.convert(state_dict, num_heads, timm_architecture,
                                        timm.config_beside(paths[0]))
        elif huggingface.matches(state_dict):
            params, info = huggingface.convert(state_dict, huggingface.read_config(folder),
                                               num_heads, folder)
        else:
            raise errors.CheckpointError(
                f"{path!r} is a state dict but neither a timm nor a Hugging Face ViT (no "
                f"`patch_embed.proj.weight` or `embeddings.patch_embeddings.projection.weight`). "
                f"First keys: {sorted(state_dict)[:5]}.")
    info = dict(info)
    return Checkpoint(path, info.pop("format"), params, info.pop("interpolation"),
                      info.pop("antialias"), info)


def _fit_position_embeddings(checkpoint, params, weights, grid, interpolation, antialias,
                             checkpoint_grid):
    """Resamples the checkpoint's position embeddings in `params` to the model's grid if needed."""
    if names.POSEMB not in params or names.POSEMB not in weights:
        return
    old, target = params[names.POSEMB], tuple(weights[names.POSEMB].shape)
    old_grid = checkpoint_grid or checkpoint.hints.get("grid")
    same_grid = old_grid is None or geometry.pair(old_grid, "token grid") == grid
    if old.ndim != 3 or old.shape[-1] != target[-1] or (old.shape[1] == target[1] and same_grid):
        return  # same size (an exact no-op), or a mismatch reported with the others
    prefix = _posemb_prefix_tokens(params, old_grid)
    interpolation = interpolation or checkpoint.interpolation
    antialias = checkpoint.antialias if antialias is None else antialias
    if interpolation == "vit_jax":
        antialias = False
    new = posemb.resample_position_embeddings(
        old, grid, num_prefix_tokens=prefix, old_grid=old_grid, interpolation=interpolation,
        antialias=antialias)
    model_prefix = target[1] - grid[0] * grid[1]
    if prefix > model_prefix:  # only reachable with strict=False: the model has fewer tokens
        new = new[:, prefix - model_prefix:]
    elif prefix < model_prefix:
        new = np.concatenate([np.zeros_like(new[:, :model_prefix - prefix]), new], axis=1)
    side = int(round((old.shape[1] - prefix) ** 0.5))
    old_rows, old_cols = geometry.pair(old_grid, "token grid") if old_grid else (side, side)
    logger.info("Resampled position embeddings from %dx%d to %dx%d (%s%s).", old_rows, old_cols,
                *grid, interpolation, ", antialias" if antialias else "")
    params[names.POSEMB] = new


def _posemb_prefix_tokens(params, grid=None):
    """How many prefix tokens (class, distillation) the canonical position embeddings cover: all of
    them (the original layout), or none (DeiT III, timm's `no_embed_class`). Registers never have
    position embeddings. Told from the `grid` where known, else from the token count: k*k + 1 and
    k*k + 2 are never squares, so a square count with prefix tokens means none are covered."""
    prefix = int(names.CLS in params) + int(names.DIST in params)
    tokens = np.shape(params[names.POSEMB])[1]
    if grid is not None:
        rows, cols = geometry.pair(grid, "token grid")
        return tokens - rows * cols if tokens - rows * cols in (0, prefix) else prefix
    side = int(round(tokens ** 0.5))
    return 0 if prefix and side * side == tokens else prefix


def _fit_patch_embedding(params, weights):
    """Resamples the checkpoint's patch-embedding kernel in `params` to the model's patch size
    (FlexiViT's PI-resize, see `resample_patch_embedding`) if only its spatial size differs.
    Plain ViTs only: a hybrid's kernel reads a ResNet feature map, not pixels."""
    key = names.EMBEDDING_KERNEL
    hybrid = names.RESNET_ROOT in params or names.RESNET_ROOT in weights
    if hybrid or key not in params or key not in weights:
        return
    old, target = np.asarray(params[key]), tuple(weights[key].shape)
    if old.ndim != 4 or len(target) != 4 or old.shape[2:] != target[2:]:
        return  # a mismatch reported with the others
    if old.shape[:2] == target[:2]:
        return  # same patch size
    params[key] = patch_resize.resample_patch_embedding(old, target[:2])
    logger.info("Resampled the patch embedding from %dx%d to %dx%d patches (PI-resize).",
                *old.shape[:2], *target[:2])


def _reconcile_heads(params, weights):
    """Applies the fine-tuning conventions to `params`; returns the model keys to zero-initialise."""
    pre_logits = [k for k in params if k.startswith(names.PRE_LOGITS)]
    dropped = bool(pre_logits) and names.PRE_LOGITS + "kernel" not in weights
    if dropped:
        width = np.shape(params.get(names.PRE_LOGITS + "kernel", np.zeros((0, 0))))[-1]
        for key in pre_logits:
            del params[key]
        logger.warning("Model has no representation layer: the checkpoint's pre_logits (%d units) "
                       "is dropped, as vit_jax does when fine-tuning.", width)
    zeroed = []
    for head, name in ((_HEAD, "classification head"), (_HEAD_DIST, "distillation head")):
        zeroed += _reconcile_head(params, weights, head, name, dropped)
    return zeroed


def _reconcile_head(params, weights, head, name, dropped):
    """`head`'s (kernel, bias) keys to zero-initialise: those of a model head that the checkpoint
    lacks or holds for another class count."""
    found = {key: params.pop(key) for key in head if key in params}
    if head[0] not in weights:
        if found:
            logger.info("Model has no %s: the checkpoint's is not loaded.", name)
        return []
    model_head = tuple(weights[head[0]].shape)
    if head[0] not in found:
        reason = f"Checkpoint has no {name}"
    elif found[head[0]].shape[-1] != model_head[-1]:
        reason = f"Checkpoint {name} has {found[head[0]].shape[-1]} classes, the model {model_head[-1]}"
    elif dropped and tuple(found[head[0]].shape) != model_head:
        reason = f"The checkpoint's {name} reads the dropped representation layer"
    else:
        params.update(found)
        return []
    logger.warning("%s: the model's %d-class %s is zero-initialised (the fine-tuning "
                   "convention).", reason, model_head[-1], name)
    return [k for k in head if k in weights]


def _without_unit_axes(shape):
    return tuple(d for d in shape if d != 1)


def _fits(array, shape):
    """`array` reshaped to `shape` if it equals it up to unit axes (e.g. GroupNorm's (1, 1, 1, C))."""
    if tuple(array.shape) == tuple(shape):
        return array
    if _without_unit_axes(array.shape) == _without_unit_axes(shape):
        return array.reshape(shape)
    return None


def non_finite_arrays(params):
    """The keys of the arrays in `params` that hold a NaN or an infinity, in key order."""
    return [key for key in sorted(params)
            if np.asarray(params[key]).dtype.kind in "fc" and not np.isfinite(params[key]).all()]


def check_finite(params, path):
    """Raises a `vit_keras.errors.CheckpointError` naming the arrays of the checkpoint at `path`
    that hold NaN or Inf."""
    bad = non_finite_arrays(params)
    if bad:
        raise errors.CheckpointError(
            f"{path!r} holds NaN or Inf values in {len(bad)} "
            f"array{'s' if len(bad) > 1 else ''} ({_summary(bad, ', ')}): the file is "
            f"damaged, or a training run diverged before it was written.")


def _summary(items, separator, indent=""):
    """The first `_LISTED` items joined, and how many more there are."""
    shown = separator.join(items[:_LISTED])
    more = len(items) - _LISTED
    return shown + (f"{separator}{indent}and {more} more" if more > 0 else "")


def variant_named(fields):
    """The paper's variant (a `ViTConfig`) with the architecture `fields` (as `architecture`'s
    `config`), or None."""
    fields = {"resnet_layers": None, "resnet_width": 1, **fields}
    return next((config for config in configs.VARIANTS.values()
                 if {name: getattr(config, name) for name in fields} == fields), None)


def _model_architecture(weights):
    """`architecture`'s `config` for a model's canonical weights (read from shapes alone)."""
    shapes = {key: np.broadcast_to(np.float32(0), tuple(weight.shape))  # no memory: zero strides
              for key, weight in weights.items()}
    return architecture(Checkpoint("", "", shapes, "", False, {}))["config"]


def _architecture_hint(checkpoint, weights):
    """`"it holds a ViT-Ti/16 (hidden_size 192, ...), not the model's ViT-S/16 (hidden_size 384,
    ...)"` when the two architectures differ, else None (the problems are then in the keys)."""
    try:
        found, wanted = architecture(checkpoint)["config"], _model_architecture(weights)
    except (ValueError, KeyError, IndexError):
        return None
    differ = [name for name in dict.fromkeys([*found, *wanted]) if found.get(name) != wanted.get(name)]
    if not differ:
        return None

    def described(fields):
        variant = variant_named(fields)
        values = ", ".join(f"{name} {fields.get(name)}" for name in differ)
        return f"{variant.name if variant else 'custom ViT'} ({values})"

    return f"it holds a {described(found)}, not the model's {described(wanted)}"


def load_pretrained(model, path, *, strict=True, interpolation=None, antialias=None,
                    checkpoint_grid=None, allow_non_finite=False, timm_architecture=None,
                    check_normalization=True):
    """Loads a checkpoint of any supported format into a vit_keras model, in place.

    Args:
      model: a model from `build_model` (any image size, classes, `include_top`).
      path: a checkpoint file or Hugging Face folder (see `read_checkpoint`), or a `Checkpoint`.
      strict: `True`: any missing key, unexpected key or shape mismatch raises one `CheckpointError`,
        before anything is assigned; it says first how the architectures differ (e.g. the file
        holds a ViT-Ti/16, the model is a ViT-S/16), then lists the first problems and counts the
        rest. `False`: those are logged and skipped.
      interpolation: position-embedding resampling when the grids differ: `"vit_jax"`,
        `"bilinear"` or `"bicubic"` (see `resample_position_embeddings`). Default: the format's own
        (`"vit_jax"` for `.npz`, `"bicubic"` for timm and Hugging Face).
      antialias: PyTorch-style antialiasing for `"bilinear"`/`"bicubic"`. Default: the format's own
        (on for timm state dicts, as timm's `checkpoint_filter_fn`; off otherwise).
      checkpoint_grid: the checkpoint's patch grid `(rows, cols)` when it is not square and the file
        does not say (Hugging Face's `config.json` does).
      allow_non_finite: `False`: an array to be loaded that holds NaN or Inf raises a `CheckpointError`
        naming the arrays, before anything is assigned. `True`: such arrays are loaded.
      timm_architecture: as in `read_checkpoint` (here it matters only for the heads).
      check_normalization: `True`: a warning when the model normalises its input pixels
        otherwise than the checkpoint's weights were trained with (build it with
        `normalization=`, or with `build_model_from_checkpoint`, which reads it from the file).

    Returns:
      The model. A head with another class count (or none in the file) is zero-initialised, and a
      `pre_logits` layer the model lacks is dropped; each says so in one log line. A plain ViT
      with another patch size gets the checkpoint's patch embedding resampled to it
      (`resample_patch_embedding`, FlexiViT's PI-resize), also with one log line.
    """
    checkpoint = path if isinstance(path, Checkpoint) else None
    weights = {names.keras_to_canonical(w.path): w for w in model.weights}
    query = names.QUERY_KERNEL.format(0)
    if checkpoint is None:
        checkpoint = read_checkpoint(
            path, num_heads=weights[query].shape[1] if query in weights else None,
            timm_architecture=timm_architecture)
    if check_normalization:
        _check_normalization(model, checkpoint)
    params = dict(checkpoint.params)
    _fit_position_embeddings(checkpoint, params, weights, _vit_part(model, "token_grid"), interpolation,
                             antialias, checkpoint_grid)
    _fit_patch_embedding(params, weights)
    zeroed = _reconcile_heads(params, weights)

    missing, mismatched, assignments, from_file = [], [], [], []
    for key, weight in weights.items():
        if key in zeroed:
            assignments.append((weight, np.zeros(weight.shape, weight.dtype)))
        elif key not in params:
            missing.append(f"  missing from the checkpoint: {key} (model weight {weight.path}, "
                           f"shape {tuple(weight.shape)})")
        else:
            array = _fits(np.asarray(params[key]), weight.shape)
            if array is None:
                mismatched.append(f"  shape mismatch: {key}: model {tuple(weight.shape)}, "
                                  f"checkpoint {tuple(params[key].shape)}")
            else:
                assignments.append((weight, array.astype(weight.dtype)))
                from_file.append(key)
    unexpected = [f"  unexpected in the checkpoint: {key} (shape {tuple(np.shape(params[key]))})"
                  for key in sorted(set(params) - set(weights))]
    problems = missing + unexpected + mismatched
    if problems:
        hint = _architecture_hint(checkpoint, weights)
        message = (f"Checkpoint {checkpoint.path!r} ({checkpoint.format}) does not fit model "
                   f"{model.name!r}" + (f": {hint}" if hint else "") + ".")
        listing = (f"\n{len(problems)} difference{'s' if len(problems) > 1 else ''}:\n"
                   + _summary(problems, "\n", indent="  "))
        if strict:
            raise errors.CheckpointError(
                message + " Build the model with the checkpoint's architecture "
                "(vit_keras.build_model_from_checkpoint reads it from the file), or pass "
                "strict=False to load only the arrays that fit." + listing)
        logger.warning("%s strict=False: loading the %d arrays that fit.%s", message,
                       len(assignments), listing)
    if not allow_non_finite:
        try:
            check_finite({key: params[key] for key in from_file}, checkpoint.path)
        except errors.CheckpointError as error:
            raise errors.CheckpointError(
                f"{error} Nothing was loaded; pass allow_non_finite=True to load it "
                f"anyway.") from None
    for weight, array in assignments:
        weight.assign(array)
    logger.info("Loaded %d arrays from %s (%s) into %s.", len(assignments) - len(zeroed),
                checkpoint.path, checkpoint.format, model.name)
    return model


def _check_normalization(model, checkpoint):
    """Warns when `model` normalises its pixels otherwise than `checkpoint` was trained with."""
    used, trained = _vit_part(model, "normalization"), checkpoint.hints.get("normalization")
    if used is not None and trained is not None and not used.matches(trained):
        logger.warning(
            "Model %r normalises its input as %s, but %s was trained on pixels normalised as %s "
            "(%s): its outputs will be wrong. Build the model with normalization=%s, or with "
            "vit_keras.build_model_from_checkpoint.", model.name, used, checkpoint.path,
            trained, checkpoint.hints.get("normalization_source", "the checkpoint"),
            repr(trained.name) if trained.name else (trained.mean, trained.std))


def save_npz(model, path):
    """Writes a vit_keras model's weights as an official vit_jax `.npz` (loadable by vit_jax and by
    timm's `_load_weights`). Returns `path`."""
    params = {}
    for weight in model.weights:
        key = names.keras_to_canonical(weight.path)
        if key in params:
            raise ValueError(f"Two weights of {model.name!r} map to {key!r}; save_npz expects a "
                             f"model from vit_keras.build_model.")
        params[key] = np.asarray(keras.ops.convert_to_numpy(weight), dtype=np.float32)
    npz.write(path, params, _vit_part(model, "normalization"))
    return path


def _vit_part(model, part):
    """What a `vit_keras.ViT` says of itself (read by attribute: the loader imports no model)."""
    if not hasattr(model, part):
        raise ValueError(
            f"Model {model.name!r} is not a vit_keras.ViT; checkpoints load into and save from "
            f"models of vit_keras.build_model (a model loaded from a .keras file of an earlier "
            f"vit_keras: pass vit_keras.ViT.of(model)).")
    return getattr(model, part)


def architecture(checkpoint):
    """The architecture stored in a `Checkpoint`: a dict of `ViTConfig` size fields (`config`),
    its switch fields (`switches`, every field of `configs.SWITCHES`: from the keys, and from the
    checkpoint's hints where the keys cannot tell, e.g. epsilon and GELU) and the `build_model`
    arguments the file determines (`classifier`, `representation_size`, `num_classes`,
    `channels`, `grid`, `normalization` (None where the file does not say);
    `layer_norm_epsilon` and `gelu` repeat the switches)."""
    params = checkpoint.params
    kernel = params.get(names.EMBEDDING_KERNEL)
    if kernel is None or kernel.ndim != 4 or kernel.shape[0] != kernel.shape[1]:
        raise errors.CheckpointError(
            f"{checkpoint.path!r}: expected a square patch-embedding kernel "
            f"(patch, patch, channels, hidden); got "
            f"{None if kernel is None else kernel.shape}.")
    num_layers = 0
    while names.QUERY_KERNEL.format(num_layers) in params:
        num_layers += 1
    if not num_layers:
        raise errors.CheckpointError(
            f"{checkpoint.path!r} has no encoder blocks "
            f"({names.QUERY_KERNEL.format(0)!r} is missing).")
    switches = _switches(checkpoint)
    needed = [names.MLP_KERNEL.format(0)] + ([names.POSEMB] if not switches["rope"] else [])
    for key in needed:
        if key not in params:
            raise errors.CheckpointError(
                f"{checkpoint.path!r} has no {key!r}: it is not a whole ViT checkpoint"
                + (" (nor one with rotary position embeddings: a timm file needs its "
                   "architecture name, timm_architecture=..., to say which)"
                   if key == names.POSEMB else "") + ".")
    query = params[names.QUERY_KERNEL.format(0)]
    config = {"patch_size": int(kernel.shape[0]), "hidden_size": int(kernel.shape[3]),
              "mlp_dim": int(params[names.MLP_KERNEL.format(0)].shape[1]),
              "num_heads": int(query.shape[1]), "num_layers": num_layers}
    channels = kernel.shape[2]
    root = params.get(names.RESNET_ROOT)
    if root is not None:  # a hybrid: count the units of each ResNet stage
        units = []
        while f"block{len(units) + 1}/unit1/conv1/kernel" in params:
            stage, count = len(units) + 1, 0
            while f"block{stage}/unit{count + 1}/conv1/kernel" in params:
                count += 1
            units.append(count)
        config["resnet_layers"] = tuple(units)
        config["resnet_width"] = root.shape[-1] // 64
        channels = root.shape[2]
    if names.MAP_HEAD + "probe" in params:
        classifier = "map"
    elif names.CLS in params and not switches["fc_norm"]:
        classifier = "token"
    else:  # timm's `avg` pooling, which comes with fc_norm (MAE fine-tuning)
        classifier = "gap"
    classifier = checkpoint.hints.get("classifier", classifier)
    if names.CLS in params and classifier != "token":
        switches["class_token"] = True
    grid = checkpoint.hints.get("grid")
    if grid is None and names.POSEMB in params:
        tokens = params[names.POSEMB].shape[1] - _posemb_prefix_tokens(params)
        side = int(round(tokens ** 0.5))
        grid = (side, side) if side * side == tokens else None
    head = params.get(names.HEAD + "kernel")
    pre_logits = params.get(names.PRE_LOGITS + "kernel")
    return {
        "config": config,
        "normalization": checkpoint.hints.get("normalization"),
        "classifier": classifier,
        "representation_size": None if pre_logits is None else int(pre_logits.shape[1]),
        "num_classes": None if head is None else int(head.shape[1]),
        "channels": int(channels),
        "grid": grid,
        "layer_norm_epsilon": switches["layer_norm_epsilon"],
        "gelu": switches["gelu"],
        "switches": switches,
    }


def _switches(checkpoint):
    """The `ViTConfig` switches of a checkpoint: the keys say whether LayerScale, registers, a
    distillation token, pre_norm, fc_norm and a patch bias are there and which tokens the position
    embeddings cover; the hints (a Hugging Face `config.json`, a timm architecture name) say
    epsilon and GELU, and win over the keys for any switch they name."""
    params, hints = checkpoint.params, checkpoint.hints
    grid = hints.get("grid")
    num_heads = int(params[names.QUERY_KERNEL.format(0)].shape[1])
    layer_scale = names.BLOCK.format(0) + names.LAYER_SCALE_ATTENTION in params
    attention, mlp = names.BLOCK.format(0) + names.ATTENTION, names.MLP.format(0)
    biases = "".join(name[0] for name in ("query", "key", "value")
                     if f"{attention}{name}/bias" in params)
    switches = {
        # The init value is not stored; the weights are loaded over it.
        "layer_scale_init": hints.get("layer_scale_init", 1e-5) if layer_scale else None,
        "num_registers": int(params[names.REG].shape[1]) if names.REG in params else 0,
        "distillation": names.DIST in params,
        "posemb_prefix": names.POSEMB not in params or not (
            _posemb_prefix_tokens(params, grid) == 0
            and (names.CLS in params or names.DIST in params)),
        "pre_norm": names.PRE_NORM + "scale" in params,
        "fc_norm": names.FC_NORM + "scale" in params,
        "patch_bias": "embedding/bias" in params,
        "layer_norm_epsilon": 1e-6,
        "gelu": "exact",
        "class_token": None,
        "mlp": "swiglu" if mlp + "gate/kernel" in params else "gelu",
        "norm": ("rms_norm" if names.BLOCK.format(0) + "LayerNorm_0/scale" in params
                 and names.BLOCK.format(0) + "LayerNorm_0/bias" not in params else "layer_norm"),
        "position_embedding": "learned" if names.POSEMB in params else "none",
        "posemb_interpolation": "bicubic",  # timm's; SigLIP 2's bilinear comes with the hints
        "posemb_preserve_aspect": False,  # timm's naflexvit_*_par_*: with the hints
        "qkv_bias": biases or "none",
        "proj_bias": attention + "out/bias" in params,
        "mlp_bias": mlp + "Dense_1/bias" in params,
        "mlp_norm": mlp + "norm/scale" in params,
        "patch_norm": names.PATCH_NORM + "scale" in params,
        "map_num_heads": _map_heads(params, num_heads),
        "map_prefix": False,
        # The rotary embeddings' kind and settings the keys cannot tell (but RoPE-Mixed's learned
        # frequencies): they come with the hints, from the architecture's name.
        "rope": (RopeSpec("mixed", temperature=10.0, xy=True)  # RoPE-Mixed's (x, y) order
                 if names.ROPE_FREQUENCIES.format(0) in params else None),
    }
    switches.update({name: hints[name] for name in configs.SWITCHES if name in hints})
    if switches["map_num_heads"] == num_heads:
        switches["map_num_heads"] = None
    return switches


def _map_heads(params, num_heads):
    """The MAP head's heads where they differ from the blocks' `num_heads` (PE's), else None."""
    query = params.get(names.MAP_HEAD + "MultiHeadDotProductAttention_0/query/kernel")
    heads = None if query is None else int(query.shape[1])
    return None if heads == num_heads else heads
