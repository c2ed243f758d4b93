"""Layer-wise learning-rate decay (BEiT, MAE, DINOv2 fine-tuning; timm's
`param_groups_layer_decay`): each layer's learning rate scaled by its depth.

The convention, as timm's (`timm/optim/_param_groups.py` with ViT's `group_matcher`): of a ViT
with `L` encoder blocks,

    embeddings (patch embedding, class/distillation/register tokens, position embeddings, a
    hybrid's ResNet stem: every layer before the first block)   lr * F ** (L + 1)
    encoder block i (`encoderblock_i`, 0-based)                  lr * F ** (L - i)
    the rest (final LayerNorm, pooling norm, pre-logits, head)   lr * 1

Keras has no parameter groups, so the scales live in the optimizer: `LayerDecaySGD` and
`LayerDecayAdamW` are Keras' SGD and AdamW whose `update_step` multiplies the learning rate of
each variable by its layer's scale. The scales are a table `{layer name: scale}` (from
`layer_decay_scales(model, F)`), part of the optimizer's config; a variable takes the scale of
the first component of its path (`encoderblock_3/MlpBlock_3/Dense_0/kernel`) that the table
names, else 1. `update_step` is the one per-variable step every backend goes through (TensorFlow
inside its distribution strategy's update; torch through the generic loop, as these classes are
not the fused `torch_sgd`/`torch_adamw` ones), so the same code runs on JAX, TensorFlow and torch.

Decoupled weight decay is scaled too: `variable -= lr * scale * weight_decay * variable`, as
torch's AdamW and SGD do with timm's per-group learning rates (weight decay there is
`lr * wd`). Which variables decay is unchanged (the recipe's choice; timm leaves 1-D parameters
and tokens out, vit_keras' recipes do not).

Part of the library core so that `import vit_keras` registers the optimizers: a model saved
with one (its compile config) loads with nothing else imported, on any backend. Imports
Keras and the model.
"""

import keras
from keras import ops

from vit_keras import errors
from vit_keras import model as model_lib


class LayerDecayError(errors.UserError, ValueError):
    """A layer decay outside (0, 1], or layer decay asked of a model without encoder blocks."""


def check_layer_decay(layer_decay):
    """Raises `LayerDecayError` unless `layer_decay` is None (off) or in (0, 1]."""
    if layer_decay is not None and not 0 < layer_decay <= 1:
        raise LayerDecayError(
            f"--layer_decay must be in (0, 1] (each block's learning rate is scaled by "
            f"layer_decay ** depth; 0.65-0.75 is usual for ViT-B); got {layer_decay}.")


def layer_decay_scales(model, layer_decay):
    """`{layer name: learning-rate scale}` of `model`'s layers (the convention above), from the
    ViT's own depth groups (`vit_keras.ViT.layer_groups`).

    Args:
      model: a ViT from `vit_keras.build_model` (or loaded from a vit_keras .keras file). For a
        model around a ViT's layers (the MPP model of `build_pretraining_model`), pass the ViT:
        the layers are the same, and so are the names the table keys.
      layer_decay: F in (0, 1].

    Raises `LayerDecayError` when F is out of range or the model is no ViT."""
    check_layer_decay(layer_decay)
    try:
        groups = model_lib.ViT.of(model).layer_groups()
    except ValueError:
        raise LayerDecayError(
            f"--layer_decay needs a model with encoder blocks (a vit_keras ViT); {model.name!r} "
            f"has none. Drop --layer_decay.") from None
    depth = len(groups) - 1  # the embeddings' group, then one per block
    return {layer.name: float(layer_decay ** (depth + 1 - index))
            for index, (_, layers) in enumerate(groups) for layer in layers if layer.weights}


def scale_table(scales):
    """`[(layer names, scale), ...]`: the layers of `scales` grouped by scale, smallest first
    (embeddings, then blocks 0, 1, ...), and last `(["everything else"], 1.0)`: the final norm,
    pre-logits and head, which no table names. For the log and the docs."""
    groups = {}
    for name, scale in scales.items():
        groups.setdefault(scale, []).append(name)
    return [(names, scale) for scale, names in sorted(groups.items())] + [
        (["everything else"], 1.0)]


def describe_scales(scales):
    """One line of `scale_table`: each group's layers and learning-rate scale."""
    return "; ".join(f"{', '.join(names)} x{scale:.4g}" for names, scale in scale_table(scales))


class _LayerScaledUpdates:
    """The optimizer piece: a per-variable learning-rate scale from `layer_scales`, applied in
    `update_step` (and to the decoupled weight decay, moved into `update_step` so that it is
    scaled the same way and goes through each backend's distributed update)."""

    def __init__(self, *args, layer_scales=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.layer_scales = {str(name): float(scale)
                             for name, scale in (layer_scales or {}).items()}

    def _scale_of(self, path):
        for part in path.split("/"):
            if part in self.layer_scales:
                return self.layer_scales[part]
        return 1.0

    def build(self, variables):
        super().build(variables)
        # Python constants by variable index: the scales are part of the traced step, not state
        # (the optimizer's variables, which backups save, stay Keras' own).
        self._variable_scales = [self._scale_of(v.path) for v in variables]
        self._variable_decays = [self.weight_decay is not None and self._use_weight_decay(v)
                                 for v in variables]

    def _apply_weight_decay(self, variables):
        pass  # in update_step, scaled (every backend's own version would use the base lr)

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        scale = self._variable_scales[index]
        learning_rate = ops.multiply(ops.cast(learning_rate, variable.dtype), scale)
        if self._variable_decays[index]:
            decay = ops.multiply(learning_rate, ops.cast(self.weight_decay, variable.dtype))
            self.assign_sub(variable, ops.multiply(variable, decay))
        super().update_step(gradient, variable, learning_rate)

    def get_config(self):
        return {**super().get_config(), "layer_scales": dict(self.layer_scales)}


@keras.saving.register_keras_serializable(package="vit_keras")
class LayerDecaySGD(_LayerScaledUpdates, keras.optimizers.SGD):
    """`keras.optimizers.SGD` with a learning-rate scale per layer (`layer_scales`, from
    `layer_decay_scales`). With momentum, the scale multiplies the step added to the velocity,
    as torch's SGD does with a parameter group's learning rate."""


@keras.saving.register_keras_serializable(package="vit_keras")
class LayerDecayAdamW(_LayerScaledUpdates, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` with a learning-rate scale per layer (`layer_scales`). Adam's
    step does not scale with the gradient, so the scale multiplies the learning rate of the
    step (and of the weight decay), not the gradient."""
