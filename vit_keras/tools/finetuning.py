"""Fine-tuning with a part of the weights: LoRA adapters, the linear probe, and rematerialised
blocks. Each turns the ViT a run built into the model it trains (a part of the run,
`run_parts`), before the model is compiled:

- LoRA (`enable_lora`, `--lora_rank R`): Keras' `enable_lora` on the attention projections
  (`query`, `key`, `value`, `out`: `EinsumDense`) and the MLP's `Dense_0` and `Dense_1` of every
  encoder block; every other weight frozen but the classifier (`pre_logits`, `head`, and a
  distilled DeiT's second head `head_dist`) and, with `train_norms`, the LayerNorms. The run's
  `model.keras` is `merge_lora`'s plain model (the adapters folded into the kernels: it loads
  with only `import vit_keras`), and `adapters.npz` beside it holds the trained weights alone
  (`save_adapters`; `apply_adapters` checks them and returns a new model, the base with them;
  the base is not changed).

  Each update is `(alpha / R) * A @ B` of rank <= R, the paper's: for `out` `(heads, head_dim,
  hidden)` and the MLP's kernels Keras' own (`A` the kernel's shape with its last axis `R`), for
  `query`, `key` and `value` `(hidden, heads, head_dim)` that of `layers.HeadsProjection`
  (`A` `(hidden, R)`, `B` `(R, heads, head_dim)`: one update of the `hidden -> hidden` map).
- The linear probe (`linear_probe_model`, `--linear_probe`): the paper's linear evaluation on a
  whole dataset. The encoder is frozen and runs as at inference (its dropout and drop path rates
  set to 0, so `training=True` computes what `training=False` does); only the head trains (both
  heads of a distilled DeiT, `head` and `head_dist`, which the model averages: a frozen new
  `head_dist` would stay zero and halve every logit for good).
- Rematerialisation (`rematerialize`, `--remat`): each `TransformerBlock`'s forward is recomputed
  in the backward pass instead of keeping its activations (`keras.remat` of each block's call:
  `jax.checkpoint`, `tf.recompute_grad`, `torch.utils.checkpoint`), for larger batches in the same
  memory. The saved model does not carry it.
"""

import os
import zipfile
import zlib

import keras
import numpy as np

from vit_keras import atomic_files, errors
from vit_keras.model import ViT
from vit_keras.model.layers import HeadsProjection
from vit_keras.weights.checkpoints import files

# Keys of adapters.npz that are no weights.
_RANK_KEY, _ALPHA_KEY = "__lora_rank__", "__lora_alpha__"


class FinetuningOptionError(errors.UserError, ValueError):
    """Fine-tuning flags that cannot go together (`--linear_probe --lora_rank 4`) or a value
    they cannot take."""


AdaptersError = errors.AdaptersError  # where it was first defined; one class


def check_options(config, objective=None):
    """Refuses fine-tuning flags that make no sense, before anything loads (one line each).

    Args:
      config: the run's `training.RunConfig`.
      objective: the run's `objectives.Objective`; LoRA and the linear probe fine-tune a
        classifier, so any other objective (masked patch prediction) refuses them.
    """
    settings = config.finetuning
    rank, alpha = settings.lora_rank, settings.lora_alpha
    if rank is not None and rank < 0:
        raise FinetuningOptionError(f"--lora_rank must be a positive rank (0 or none: no LoRA); "
                                    f"got {rank}.")
    if not rank and alpha is not None:
        raise FinetuningOptionError(f"--lora_alpha {alpha:g} scales LoRA adapters: it needs "
                                    f"--lora_rank.")
    if alpha is not None and alpha <= 0:
        raise FinetuningOptionError(f"--lora_alpha must be positive (the update is scaled by "
                                    f"alpha / rank); got {alpha:g}.")
    if not rank and settings.lora_train_norms:
        raise FinetuningOptionError("--lora_train_norms trains the LayerNorms beside LoRA "
                                    "adapters: it needs --lora_rank.")
    if rank and settings.linear_probe:
        raise FinetuningOptionError(
            "--linear_probe trains the head alone and --lora_rank adapts the encoder: choose one.")
    if settings.linear_probe:
        for flag in ("attention_dropout", "drop_path_rate", "dropout"):
            if (getattr(config.model, flag) or 0) > 0:
                raise FinetuningOptionError(
                    f"--linear_probe runs the frozen encoder as at inference, without dropout: "
                    f"drop --{flag} {getattr(config.model, flag):g}.")
    if (rank or settings.linear_probe) and objective is not None and not (
            objective.trains_a_classifier):
        used = "--lora_rank" if rank else "--linear_probe"
        raise FinetuningOptionError(
            f"{used} fine-tunes a classifier (apps/finetune.py, apps/train.py); "
            f"{type(objective).__name__} trains the encoder itself. --remat applies there.")


def trainable_parameters(model):
    """The number of weights an optimizer updates in `model`."""
    return int(sum(np.prod(weight.shape) for weight in model.trainable_weights))


def _warn_of_a_rank_beyond_break_even(model, rank, log):
    """Logs a warning when LoRA of `rank` would train more weights than the kernels it adapts
    hold: full fine-tuning of those kernels would then train fewer."""
    targets = model.lora_targets
    kernels = sum(int(np.prod(_base_kernel(layer).shape)) for layer in targets)
    per_rank = sum(int(np.prod(shape)) for layer in targets for shape in adapter_shapes(layer, 1))
    if rank * per_rank >= kernels:
        log(f"Warning: LoRA rank {rank} trains {rank * per_rank:,} adapter weights, as many as "
            f"or more than the {kernels:,} weights of the kernels they adapt (the whole model "
            f"has {model.count_params():,}): full fine-tuning would train fewer; a rank below "
            f"{-(-kernels // per_rank)} trains fewer than they hold.")


# LoRA --------------------------------------------------------------------------------------------

def lora_targets(model):
    """The layers LoRA adapts (`vit_keras.ViT.lora_targets`): each encoder block's `query`,
    `key`, `value`, `out` (EinsumDense) and `Dense_0`, `Dense_1` (Dense), block by block."""
    return _vit(model, "LoRA").lora_targets


def enable_lora(model, rank, alpha=None, train_norms=False):
    """Enables LoRA of `rank` (scale `alpha / rank`, default alpha = rank) on `lora_targets` of a
    built ViT, in place, and freezes every other weight but the classifier
    (`ViT.classifier_layers`: `pre_logits`, the heads) and, with `train_norms`, the LayerNorms.
    `B` starts at zero: the model computes what it did. Returns the model."""
    vit = _vit(model, "LoRA")
    for layer in vit.lora_targets:
        layer.enable_lora(int(rank), lora_alpha=None if alpha is None else float(alpha))
        _keep_adapters_in_weights_files(layer)
    trained = {id(weight) for weight in _lora_weights(vit)}
    trained |= {id(weight) for layer in vit.classifier_layers for weight in layer.weights}
    if train_norms:
        trained |= {id(weight) for norm in vit.norms for weight in norm.weights}
    for weight in model.weights:
        weight.trainable = id(weight) in trained
    return model


def adapter_shapes(layer, rank):
    """`(A shape, B shape)` of LoRA of `rank` on one of `lora_targets`, without enabling it: Keras'
    `A` is the kernel's shape with its last axis `rank` and `B` `(rank, units)`;
    `layers.HeadsProjection` (query, key, value) adapts the one `hidden -> hidden` map, `A`
    `(hidden, rank)` and `B` `(rank, heads, head_dim)`. (apply_adapters checks a file against
    these before reading its arrays, and against the enabled layer's after.)"""
    shape = tuple(_base_kernel(layer).shape)
    if isinstance(layer, HeadsProjection):
        return (shape[0], rank), (rank, *shape[1:])
    return (*shape[:-1], rank), (rank, shape[-1])


def _keep_adapters_in_weights_files(layer):
    """Makes a LoRA-enabled layer write its weights as they are (frozen kernel, bias, `A`, `B`)
    into weights files, and read them back so, in place.

    Keras writes the merged kernel and, reading it back, sets `A` and `B` to zero: a resumed run
    (its backup is a weights file) would then train adapters from `A = B = 0`, where both
    gradients are zero, and `adapters.npz` would hold nothing. The run's `model.keras` is the
    merged plain model (`merge_lora`), which this does not concern."""
    def save_own_variables(store):
        for index, weight in enumerate(layer.weights):
            store[str(index)] = weight

    def load_own_variables(store):
        if len(store.keys()) != len(layer.weights):
            raise ValueError(
                f"{layer.path}: the weights file has {len(store.keys())} arrays where the "
                f"LoRA-enabled layer has {len(layer.weights)} (kernel, bias, lora_kernel_a, "
                f"lora_kernel_b); it was not written by a LoRA model of the same rank.")
        for index, weight in enumerate(layer.weights):
            weight.assign(store[str(index)])

    layer.save_own_variables = save_own_variables
    layer.load_own_variables = load_own_variables


def merge_lora(model, into=None):
    """A plain model (no LoRA) computing what the LoRA-enabled `model` computes: its config
    rebuilt, each adapted kernel replaced by `kernel + (alpha / rank) * A @ B` (float32, NumPy),
    every other weight copied. `into`: a plain model of the same config to write into instead of
    building one (a checkpoint callback reuses its own). A model without LoRA is returned as is.
    """
    targets = [layer for layer in (model.lora_targets if isinstance(model, ViT) else [])
               if layer.lora_enabled]
    if not targets:
        return model
    plain = into if into is not None else ViT.from_config(model.get_config())
    values = {weight.path: keras.ops.convert_to_numpy(weight) for weight in model.weights}
    for layer in targets:
        kernel = _base_kernel(layer)
        values[kernel.path] = merged_kernel(layer)
    missing = [weight.path for weight in plain.weights if weight.path not in values]
    if missing:
        raise ValueError(f"The plain model has weights the LoRA model has not: {missing[:3]}.")
    for weight in plain.weights:
        weight.assign(values[weight.path])
    return plain


def merged_kernel(layer):
    """`kernel + (alpha / rank) * A @ B` of a LoRA-enabled Dense or EinsumDense, as a float32
    NumPy array of the kernel's shape (Keras' `layer.kernel` merges in the compute dtype)."""
    a = keras.ops.convert_to_numpy(layer.lora_kernel_a).astype("float32")
    b = keras.ops.convert_to_numpy(layer.lora_kernel_b).astype("float32")
    kernel = keras.ops.convert_to_numpy(_base_kernel(layer)).astype("float32")
    scale = np.float32(layer.lora_alpha / layer.lora_rank)
    return kernel + scale * np.tensordot(a, b, axes=1)


def save_adapters(model, path):
    """Writes what a LoRA run trained, alone, to `path` (`.npz`): every trainable weight of the
    LoRA-enabled `model` (adapters, classifier, LayerNorms if trained) by its path, and the rank
    and alpha. A few MB for ViT-B/16 at rank 8 where the model is 340 MB. Returns `path`."""
    targets = [layer for layer in _vit(model, "save_adapters").lora_targets if layer.lora_enabled]
    if not targets:
        raise ValueError(f"{model.name} has no LoRA adapters to save.")
    arrays = {weight.path: keras.ops.convert_to_numpy(weight) for weight in model.trainable_weights}
    arrays[_RANK_KEY] = np.asarray(targets[0].lora_rank)
    arrays[_ALPHA_KEY] = np.asarray(targets[0].lora_alpha, dtype="float64")
    with atomic_files.replacing(path) as temporary, open(temporary, "wb") as f:
        np.savez(f, **arrays)
    return path


def apply_adapters(base_model, path, merge=True):
    """The base model of a LoRA run with the adapters `save_adapters` wrote to `path`.

    The file is checked as a checkpoint is before anything is applied: an `.npz` of plain
    arrays, a positive whole rank and a finite positive alpha, every adapter of that rank and
    the classifier's weights present (the LayerNorms all or none), nothing else, each array of
    the shape the base model needs, every value finite. The shapes are read from the arrays'
    headers first, so a file declaring huge arrays is refused before they are read.

    Args:
      base_model: the model the run adapted: the same variant, image size and number of classes
        (e.g. `vit_keras.build_model_from_checkpoint(weights, num_classes=N)`), with the
        pre-trained weights the run started from. It is not changed.
      path: an `adapters.npz`.
      merge: True: a plain model with the adapters merged (`merge_lora`), what the run saved as
        `model.keras`; False: the LoRA-enabled model, to train further.

    Raises:
      vit_keras.errors.AdaptersError: the file cannot be applied to `base_model`; one line
        naming the file and what is wrong with it.
    """
    path = os.fspath(path)
    with _open_adapters(path) as archive:
        headers = _array_headers(archive, path)
        rank, alpha = _rank_and_alpha(archive, headers, path)
        _check_arrays_fit(headers, _expected_shapes(base_model, rank), path, base_model.name)
        arrays = {name: _read_array(archive, name, path) for name in headers
                  if name not in (_RANK_KEY, _ALPHA_KEY)}
    for name, value in arrays.items():
        if not np.all(np.isfinite(value)):
            raise AdaptersError(f"{path}: {name} holds NaN or infinite values; the run that wrote "
                                f"it diverged or the file is damaged.")
    model = _vit(base_model, "LoRA").rebuilt()
    enable_lora(model, rank, alpha)
    weights = {weight.path: weight for weight in model.weights}
    for name, value in arrays.items():
        if tuple(weights[name].shape) != value.shape:  # adapter_shapes and Keras disagree
            raise AdaptersError(
                f"{path}: {name} is {value.shape} but {base_model.name} has "
                f"{tuple(weights[name].shape)}; build the base model with the run's variant, "
                f"image size and number of classes.")
        weights[name].assign(value)
    return merge_lora(model) if merge else model


def _open_adapters(path):
    if not os.path.isfile(path):
        raise AdaptersError(f"No adapters file at {path!r}.")
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise AdaptersError(f"{path} is not an adapters file of vit_keras (an .npz archive): "
                            f"{error}.") from None


def _array_headers(archive, path):
    """`{name: (shape, dtype)}` of every array in an `.npz`, read from the `.npy` headers alone."""
    headers = {}
    for member in archive.infolist():
        if not member.filename.endswith(".npy"):
            raise AdaptersError(f"{path} holds {member.filename!r}, which is no NumPy array: "
                                f"it is not an adapters file of vit_keras.")
        try:
            shape, dtype, _ = files.npy_header(archive, member)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as error:
            raise AdaptersError(f"{path}: {member.filename} is not a readable NumPy array "
                                f"({error}).") from None
        headers[member.filename[:-len(".npy")]] = (shape, dtype)
    return headers


def _read_array(archive, name, path):
    try:
        with archive.open(name + ".npy") as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise AdaptersError(f"{path}: {name} cannot be read ({error}); the file is damaged.") \
            from None


def _rank_and_alpha(archive, headers, path):
    """The file's LoRA rank (a whole number >= 1) and alpha (finite, > 0)."""
    for key in (_RANK_KEY, _ALPHA_KEY):
        if key not in headers:
            raise AdaptersError(f"{path} is not an adapters file of vit_keras (no {key} in it).")
        shape, dtype = headers[key]
        if shape != () or dtype.kind not in ("iu" if key == _RANK_KEY else "iuf"):
            raise AdaptersError(f"{path}: {key} is an array {shape} of {dtype}, not one "
                                f"{'whole number' if key == _RANK_KEY else 'number'}.")
    rank, alpha = (_read_array(archive, key, path)[()] for key in (_RANK_KEY, _ALPHA_KEY))
    if rank < 1:
        raise AdaptersError(f"{path}: LoRA rank {rank} is not a positive rank.")
    if not (np.isfinite(alpha) and alpha > 0):
        raise AdaptersError(f"{path}: LoRA alpha {alpha} is not a finite positive scale.")
    return int(rank), float(alpha)


def _expected_shapes(base_model, rank):
    """`(required, optional)`: `{weight path: shape}` a file of `rank` for `base_model` must hold
    (every adapter, the classifier) and the LayerNorms' it may hold (all or none)."""
    required = {}
    base_model = _vit(base_model, "LoRA")
    for layer in base_model.lora_targets:
        a, b = adapter_shapes(layer, rank)
        required[f"{layer.path}/lora_kernel_a"] = a
        required[f"{layer.path}/lora_kernel_b"] = b
    required.update({weight.path: tuple(weight.shape) for layer in base_model.classifier_layers
                     for weight in layer.weights})
    norms = {weight.path: tuple(weight.shape) for norm in base_model.norms
             for weight in norm.weights}
    return required, norms


def _check_arrays_fit(headers, expected, path, model_name):
    required, norms = expected
    found = {name: header for name, header in headers.items()
             if name not in (_RANK_KEY, _ALPHA_KEY)}
    unknown = sorted(set(found) - set(required) - set(norms))
    if unknown:
        raise AdaptersError(f"{path} holds weights that {model_name} has not: "
                            f"{', '.join(unknown[:3])}; apply it to the model the run adapted.")
    given_norms = set(found) & set(norms)
    missing = sorted((set(required) | (set(norms) if given_norms else set())) - set(found))
    if missing:
        raise AdaptersError(
            f"{path} is incomplete: {len(missing)} of the weights a LoRA run of {model_name} "
            f"trains are missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}"
            f"); use the whole adapters.npz the run wrote.")
    for name, (shape, dtype) in found.items():
        wanted = required.get(name, norms.get(name))
        if shape != wanted:
            raise AdaptersError(
                f"{path}: {name} is {shape} but {model_name} needs {wanted} at the file's LoRA "
                f"rank; build the base model with the run's variant, image size and number of "
                f"classes.")
        if dtype.kind != "f":
            raise AdaptersError(f"{path}: {name} holds {dtype} values, not floating point.")


# The linear probe --------------------------------------------------------------------------------

def linear_probe_model(model):
    """A copy of `model` whose encoder is frozen and computes as at inference (dropout and drop
    path rates 0, so `fit`'s `training=True` changes nothing in it) and whose heads alone train
    (with a distilled DeiT both, `head` and `head_dist`, which the model averages: a frozen new
    `head_dist` would stay zero and halve every logit for good)."""
    vit = _vit(model, "The linear probe")
    if not vit.heads:
        raise ValueError(f"{vit.name} has no head layer to probe with.")
    probe = vit.rebuilt(dropout=0.0, attention_dropout=0.0, drop_path_rate=0.0)
    heads = {id(layer) for layer in probe.heads}
    for layer in probe.layers:
        layer.trainable = id(layer) in heads
    return probe


# Rematerialisation -------------------------------------------------------------------------------

def rematerialize(model):
    """Makes each encoder block of `model` recompute its forward in the backward pass
    (`vit_keras.ViT.set_remat`), in place; returns the model. The model's config is unchanged,
    so a saved model does not carry the rematerialisation."""
    _vit(model, "--remat").set_remat(True)
    return model


# Walking the model -------------------------------------------------------------------------------

def _vit(model, needed_by):
    """`model` as the `ViT` it is; these functions change it in place, so a functional model of
    an earlier vit_keras is refused (adopt it first with `vit_keras.ViT.of`)."""
    if not isinstance(model, ViT):
        raise ValueError(f"{needed_by} needs a vit_keras.ViT (from vit_keras.build_model); "
                         f"{model.name!r} is a {type(model).__name__}. For a model loaded from a "
                         f".keras file of an earlier vit_keras, pass vit_keras.ViT.of(model).")
    return model


def _base_kernel(layer):
    """The frozen kernel variable of a LoRA-enabled layer (its `kernel` property merges)."""
    return next(weight for weight in layer.weights if weight.name == "kernel")


def _lora_weights(model):
    return [weight for layer in model.lora_targets if layer.lora_enabled
            for weight in (layer.lora_kernel_a, layer.lora_kernel_b)]
