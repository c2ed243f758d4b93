"""Fine-tuning with a part of the weights: LoRA adapters, the linear probe, and rematerialised
blocks. Each turns the ViT a run built into the model it trains (`prepare_run_model`), before the
model is compiled:

- LoRA (`enable_lora`, `--lora_rank R`): Keras' `enable_lora` on the attention projections
  (`query`, `key`, `value`, `out`: `EinsumDense`) and the MLP's `Dense_0` and `Dense_1` of every
  encoder block; every other weight frozen but the classifier (`pre_logits` and `head`) and,
  with `train_norms`, the LayerNorms. The run's `model.keras` is `merge_lora`'s plain model (the
  adapters folded into the kernels: it loads with only `import vit_keras`), and `adapters.npz`
  beside it holds the trained weights alone (`save_adapters`; `apply_adapters` puts them on the
  base model again).

  Each update is `(alpha / R) * A @ B` of rank <= R, the paper's: for `out` `(heads, head_dim,
  hidden)` and the MLP's kernels Keras' own (`A` the kernel's shape with its last axis `R`), for
  `query`, `key` and `value` `(hidden, heads, head_dim)` that of `layers.HeadsProjection`
  (`A` `(hidden, R)`, `B` `(R, heads, head_dim)`: one update of the `hidden -> hidden` map).
- The linear probe (`linear_probe_model`, `--linear_probe`): the paper's linear evaluation on a
  whole dataset. The encoder is frozen and runs as at inference (its dropout and drop path rates
  set to 0, so `training=True` computes what `training=False` does); only `head` trains.
- Rematerialisation (`rematerialize`, `--remat`): each `TransformerBlock`'s forward is recomputed
  in the backward pass instead of keeping its activations (`keras.remat` of each block's call:
  `jax.checkpoint`, `tf.recompute_grad`, `torch.utils.checkpoint`), for larger batches in the same
  memory. The saved model does not carry it.
"""

import functools
import os

import keras
import numpy as np

from vit_keras import errors
from vit_keras.layers import TransformerBlock
from vit_keras.tools import callbacks as callbacks_lib

# The classifier a LoRA run trains in full; the linear probe trains `head` alone (linear).
HEAD_LAYERS = ("pre_logits", "head")
# Keys of adapters.npz that are no weights.
_RANK_KEY, _ALPHA_KEY = "__lora_rank__", "__lora_alpha__"


class FinetuningOptionError(errors.UserError, ValueError):
    """Fine-tuning flags that cannot go together (`--linear_probe --lora_rank 4`) or a value
    they cannot take."""


class AdaptersError(errors.UserError, ValueError):
    """An adapters file that does not fit the base model it is applied to."""


def lora_on(config):
    """Whether a `RunConfig` asks for LoRA (`--lora_rank` of 0 or none: off)."""
    return bool(config.lora_rank)


def check_options(config, objective=None):
    """Refuses fine-tuning flags that make no sense, before anything loads (one line each).

    Args:
      config: the run's `training.RunConfig`.
      objective: the run's `objectives.Objective`; LoRA and the linear probe fine-tune a
        classifier, so any other objective (masked patch prediction) refuses them.
    """
    from vit_keras.tools import objectives  # objectives imports the recipes; kept off import

    rank, alpha = config.lora_rank, config.lora_alpha
    if rank is not None and rank < 0:
        raise FinetuningOptionError(f"--lora_rank must be a positive rank (0 or none: no LoRA); "
                                    f"got {rank}.")
    if not rank and alpha is not None:
        raise FinetuningOptionError(f"--lora_alpha {alpha:g} scales LoRA adapters: it needs "
                                    f"--lora_rank.")
    if alpha is not None and alpha <= 0:
        raise FinetuningOptionError(f"--lora_alpha must be positive (the update is scaled by "
                                    f"alpha / rank); got {alpha:g}.")
    if not rank and config.lora_train_norms:
        raise FinetuningOptionError("--lora_train_norms trains the LayerNorms beside LoRA "
                                    "adapters: it needs --lora_rank.")
    if rank and config.linear_probe:
        raise FinetuningOptionError(
            "--linear_probe trains the head alone and --lora_rank adapts the encoder: choose one.")
    if config.linear_probe:
        for flag in ("attention_dropout", "drop_path_rate", "dropout"):
            if (getattr(config, flag) or 0) > 0:
                raise FinetuningOptionError(
                    f"--linear_probe runs the frozen encoder as at inference, without dropout: "
                    f"drop --{flag} {getattr(config, flag):g}.")
    if (rank or config.linear_probe) and objective is not None and not isinstance(
            objective, objectives.Classification):
        used = "--lora_rank" if rank else "--linear_probe"
        raise FinetuningOptionError(
            f"{used} fine-tunes a classifier (apps/finetune.py, apps/train.py); "
            f"{type(objective).__name__} trains the encoder itself. --remat applies there.")


def trainable_parameters(model):
    """The number of weights an optimizer updates in `model`."""
    return int(sum(np.prod(weight.shape) for weight in model.trainable_weights))


def prepare_run_model(vit, config, log=print):
    """The ViT a run trains from the one it built (call before compiling): a linear probe
    (`config.linear_probe`, a copy), rematerialised (`config.remat`) and LoRA-enabled
    (`config.lora_rank`), both in place."""
    if config.linear_probe:
        vit = linear_probe_model(vit)
        log("Linear probe: the encoder frozen, at inference; only the head trains.")
    if config.remat:
        rematerialize(vit)
        log("--remat: each encoder block is recomputed in the backward pass.")
    if lora_on(config):
        enable_lora(vit, config.lora_rank, config.lora_alpha,
                    train_norms=config.lora_train_norms)
        alpha = config.lora_alpha if config.lora_alpha is not None else config.lora_rank
        log(f"LoRA rank {config.lora_rank}, alpha {alpha:g} on the attention projections and "
            f"the MLP; trained: adapters, {' and '.join(HEAD_LAYERS)}"
            + (", LayerNorms" if config.lora_train_norms else "") + ".")
    return vit


# LoRA --------------------------------------------------------------------------------------------

def lora_targets(model):
    """The layers LoRA adapts: each encoder block's `query`, `key`, `value`, `out` (EinsumDense)
    and `Dense_0`, `Dense_1` (Dense), block by block."""
    targets = []
    for block in _blocks(model):
        attention, mlp = block.attention, block.mlp
        targets += [attention.query, attention.key, attention.value, attention.out,
                    mlp.dense_0, mlp.dense_1]
    if not targets:
        raise ValueError(f"{model.name} has no TransformerBlock: LoRA adapts a vit_keras ViT.")
    return targets


def enable_lora(model, rank, alpha=None, train_norms=False):
    """Enables LoRA of `rank` (scale `alpha / rank`, default alpha = rank) on `lora_targets` of a
    built model, in place, and freezes every other weight but the classifier (`HEAD_LAYERS`) and,
    with `train_norms`, the LayerNorms. `B` starts at zero: the model computes what it did.
    Returns the model."""
    for layer in lora_targets(model):
        layer.enable_lora(int(rank), lora_alpha=None if alpha is None else float(alpha))
        _keep_adapters_in_weights_files(layer)
    trained = {id(weight) for weight in _lora_weights(model)}
    trained |= {id(weight) for name in HEAD_LAYERS if _has_layer(model, name)
                for weight in model.get_layer(name).weights}
    if train_norms:
        trained |= {id(weight) for norm in _layer_norms(model) for weight in norm.weights}
    for weight in model.weights:
        weight.trainable = id(weight) in trained
    return model


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
    targets = [layer for layer in (lora_targets(model) if _blocks(model) else [])
               if layer.lora_enabled]
    if not targets:
        return model
    plain = into if into is not None else keras.Model.from_config(model.get_config())
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
    targets = [layer for layer in lora_targets(model) if layer.lora_enabled]
    if not targets:
        raise ValueError(f"{model.name} has no LoRA adapters to save.")
    arrays = {weight.path: keras.ops.convert_to_numpy(weight) for weight in model.trainable_weights}
    arrays[_RANK_KEY] = np.asarray(targets[0].lora_rank)
    arrays[_ALPHA_KEY] = np.asarray(targets[0].lora_alpha, dtype="float64")
    temporary = f"{path}.tmp-{os.getpid()}.npz"  # np.savez adds .npz to a name without it
    np.savez(temporary, **arrays)
    os.replace(temporary, path)
    return path


def apply_adapters(base_model, path, merge=True):
    """The base model of a LoRA run with the adapters `save_adapters` wrote to `path`.

    Args:
      base_model: the model the run adapted: the same variant, image size and number of classes
        (e.g. `vit_keras.build_model_from_checkpoint(weights, num_classes=N)`), with the
        pre-trained weights the run started from. It is not changed.
      path: an `adapters.npz`.
      merge: True: a plain model with the adapters merged (`merge_lora`), what the run saved as
        `model.keras`; False: the LoRA-enabled model, to train further.

    Raises `AdaptersError` when the file's weights do not fit the model.
    """
    with np.load(path) as stored:
        arrays = dict(stored)
    if _RANK_KEY not in arrays:
        raise AdaptersError(f"{path} is not an adapters file of vit_keras (no LoRA rank in it).")
    rank, alpha = int(arrays.pop(_RANK_KEY)), float(arrays.pop(_ALPHA_KEY))
    model = keras.Model.from_config(base_model.get_config())
    model.set_weights(base_model.get_weights())
    enable_lora(model, rank, alpha)
    weights = {weight.path: weight for weight in model.weights}
    unknown = sorted(set(arrays) - set(weights))
    if unknown:
        raise AdaptersError(f"{path} holds weights that {base_model.name} has not: "
                            f"{', '.join(unknown[:3])}; apply it to the model the run adapted.")
    for name, value in arrays.items():
        if tuple(weights[name].shape) != value.shape:
            raise AdaptersError(
                f"{path}: {name} is {value.shape} but {base_model.name} has "
                f"{tuple(weights[name].shape)}; build the base model with the run's variant, "
                f"image size and number of classes.")
        weights[name].assign(value)
    return merge_lora(model) if merge else model


class MergedModelCheckpoint(callbacks_lib.AtomicModelCheckpoint):
    """The run's per-epoch `model.keras` of a LoRA run: the merged plain model (built once)."""

    _plain = None

    def on_epoch_end(self, epoch, logs=None):
        if self.guard and self.guard.bad_step:
            return
        if self._plain is None:
            self._plain = keras.Model.from_config(self.model.get_config())
        callbacks_lib.atomic_save_model(merge_lora(self.model, into=self._plain), self.path)


# The linear probe --------------------------------------------------------------------------------

def linear_probe_model(model):
    """A copy of `model` whose encoder is frozen and computes as at inference (dropout and drop
    path rates 0, so `fit`'s `training=True` changes nothing in it) and whose `head` alone
    trains."""
    if not _has_layer(model, "head"):
        raise ValueError(f"{model.name} has no head layer to probe with.")
    config = model.get_config()
    for layer in config["layers"]:
        settings = layer["config"]
        if layer["class_name"] == "Dropout":
            settings["rate"] = 0.0
        for rate in ("dropout", "attention_dropout", "drop_path_rate"):
            if rate in settings and _is_block(layer):
                settings[rate] = 0.0
    probe = keras.Model.from_config(config)
    probe.set_weights(model.get_weights())
    for layer in probe.layers:
        layer.trainable = layer.name == "head"
    return probe


# Rematerialisation -------------------------------------------------------------------------------

def rematerialize(model):
    """Makes each `TransformerBlock` of `model` recompute its forward in the backward pass
    (`keras.remat`: `jax.checkpoint`, `tf.recompute_grad`, `torch.utils.checkpoint`), in place;
    returns the model.

    Not `keras.RematScope(mode="list_of_layers")`: Keras then passes the call's keyword arguments
    through `jax.checkpoint`, which turns `training=True` into a traced array that the layers
    cannot branch on in Python. Here each block's call rematerialises a function of its input
    alone, `training` bound. The model's config is unchanged, so a saved model does not carry
    the rematerialisation.
    """
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(f"{model.name} has no TransformerBlock to rematerialise.")
    for block in blocks:
        if not getattr(block, "rematerialized", False):
            block.call = _rematerialized_call(block)
            block.rematerialized = True
    return model


def _rematerialized_call(block):
    """`block.call` (same signature) with its forward recomputed in the backward pass; a call
    returning attention scores (analysis, not training) runs as it was.

    The block's random generators (dropout, drop path) advance inside the recomputed function;
    JAX forbids a traced value to leave it but through its outputs, so their states go in and
    come out as arguments (in `fit`'s stateless scope, where assigning records a new value)."""
    call = block.call
    weights = {id(weight) for weight in block.weights}
    generators = [variable for variable in block.variables if id(variable) not in weights]

    def forward(x, states, training):
        for variable, state in zip(generators, states):
            variable.assign(state)
        return call(x, training=training), [variable.value for variable in generators]

    def rematerialized_call(x, training=None, return_attention_scores=False):
        if return_attention_scores:
            return call(x, training=training, return_attention_scores=True)
        y, states = keras.remat(functools.partial(forward, training=training))(
            x, [variable.value for variable in generators])
        for variable, state in zip(generators, states):
            variable.assign(state)
        return y

    return rematerialized_call


# Walking the model -------------------------------------------------------------------------------

def _blocks(model):
    return [layer for layer in model.layers if isinstance(layer, TransformerBlock)]


def _is_block(layer_config):
    registered = layer_config.get("registered_name") or layer_config["class_name"]
    return registered.endswith("TransformerBlock")


def _has_layer(model, name):
    return any(layer.name == name for layer in model.layers)


def _base_kernel(layer):
    """The frozen kernel variable of a LoRA-enabled layer (its `kernel` property merges)."""
    return next(weight for weight in layer.weights if weight.name == "kernel")


def _lora_weights(model):
    return [weight for layer in lora_targets(model) if layer.lora_enabled
            for weight in (layer.lora_kernel_a, layer.lora_kernel_b)]


def _layer_norms(model):
    norms = [layer for layer in model.layers
             if isinstance(layer, keras.layers.LayerNormalization)]
    for block in _blocks(model):
        norms += [block.norm_0, block.norm_2]
    return norms
