"""The optional parts of a training run, one object each: the linear probe, rematerialised blocks,
LoRA, layer-wise learning-rate decay and the weights' EMA. `choose` makes the parts a `RunConfig`
asks for, checking their flags before anything loads; `training.run` calls every part's hooks at
its steps, in `choose`'s order, and knows no part by name:

- `run_name`: the method in the run folder's default name (`lora4`, `linear-probe`,
  `layer-decay0.75`), or None;
- `adapt_model(vit, log)`: the ViT the run trains, from the one it built (before the objective's
  model, the optimizer and the backup: a resumed run rebuilds the same model);
- `optimizer_options(model, log)`: arguments of `recipes.make_optimizer`;
- `compiled(model)`: after `compile`, in the distribution's scope;
- `checkpoint`: the callback class that writes model.keras after every epoch, or None (the
  plain `callbacks.AtomicModelCheckpoint`);
- `callbacks(validation, guard)`: callbacks of `fit` (`validation()` gives the validation
  pipeline; `guard` is the run's `StopOnNaN`);
- `before_evaluation(model, validation, log)`: a choice made before the objective's final
  evaluation, as metrics.json fields;
- `saved_model(model)`: the model written as model.keras at the end; `save(model, folder)`: the
  part's own files beside it.

The model-side work is the library's (`finetuning`, `layer_decay`, `ema`); a part says when a run
does it.
"""

import dataclasses

from vit_keras.model import ViT
from vit_keras.tools import finetuning
from vit_keras.tools.runs import callbacks as callbacks_lib
from vit_keras.tools.runs import ema as ema_lib
from vit_keras.training import layer_decay


class Part:
    """A part of a training run that adds nothing; subclasses override the hooks they need (see
    the module docstring)."""

    run_name = None
    checkpoint = None

    def adapt_model(self, vit, log):
        return vit

    def optimizer_options(self, vit, log):
        """Keyword arguments of `recipes.make_optimizer`, from the run's ViT (the one the
        objective's model is built around: its layers, and so their names, are that model's)."""
        return {}

    def compiled(self, model):
        pass

    def callbacks(self, validation, guard):
        return []

    def before_evaluation(self, model, validation, log):
        return {}

    def saved_model(self, model):
        return model

    def save(self, model, folder):
        pass


def _warn_of_a_random_encoder(used, learns, log):
    log(f"Warning: {used} without --weights: the encoder is randomly initialised and frozen, so "
        f"only {learns} learn on random features; give --weights to fine-tune a pre-trained "
        f"encoder.")


@dataclasses.dataclass
class LinearProbe(Part):
    """`--linear_probe`: the encoder frozen and run as at inference, the head alone trained
    (`finetuning.linear_probe_model`)."""

    pretrained: bool = True  # whether the run has --weights

    run_name = "linear-probe"

    def adapt_model(self, vit, log):
        if not self.pretrained:
            _warn_of_a_random_encoder("--linear_probe", "the head", log)
        vit = finetuning.linear_probe_model(vit)
        log(f"Linear probe: the encoder frozen, at inference; only "
            f"{' and '.join(layer.name for layer in vit.heads)} train.")
        return vit


class Remat(Part):
    """`--remat`: each encoder block recomputed in the backward pass
    (`finetuning.rematerialize`)."""

    def adapt_model(self, vit, log):
        finetuning.rematerialize(vit)
        log("--remat: each encoder block is recomputed in the backward pass.")
        return vit


class MergedModelCheckpoint(callbacks_lib.AtomicModelCheckpoint):
    """The run's per-epoch `model.keras` of a LoRA run: the merged plain model (built once)."""

    _plain = None

    def on_epoch_end(self, epoch, logs=None):
        if self.guard and self.guard.bad_step:
            return
        if self._plain is None:
            self._plain = ViT.from_config(self.model.get_config())
        callbacks_lib.atomic_save_model(finetuning.merge_lora(self.model, into=self._plain), self.path)


@dataclasses.dataclass
class Lora(Part):
    """`--lora_rank`: LoRA adapters on every block, all else frozen but the head
    (`finetuning.enable_lora`). model.keras is the merged plain model, after every epoch and at
    the end; adapters.npz holds the adapters alone."""

    rank: int
    alpha: float = None
    train_norms: bool = False
    pretrained: bool = True  # whether the run has --weights

    checkpoint = MergedModelCheckpoint

    @property
    def run_name(self):
        return f"lora{self.rank}"

    def adapt_model(self, vit, log):
        if not self.pretrained:
            _warn_of_a_random_encoder(f"--lora_rank {self.rank}", "low-rank adapters", log)
        finetuning._warn_of_a_rank_beyond_break_even(vit, self.rank, log)
        finetuning.enable_lora(vit, self.rank, self.alpha, train_norms=self.train_norms)
        alpha = self.alpha if self.alpha is not None else self.rank
        log(f"LoRA rank {self.rank}, alpha {alpha:g} on the attention projections and the MLP; "
            f"trained: adapters, {' and '.join(layer.name for layer in vit.classifier_layers)}"
            + (", LayerNorms" if self.train_norms else "") + ".")
        return vit

    def saved_model(self, model):
        return finetuning.merge_lora(model)

    def save(self, model, folder):
        finetuning.save_adapters(model, folder.adapters)


@dataclasses.dataclass
class LayerDecay(Part):
    """`--layer_decay F`: each layer's learning rate scaled by F to its depth
    (`vit_keras.layer_decay`)."""

    decay: float

    def __post_init__(self):
        layer_decay.check_layer_decay(self.decay)

    @property
    def run_name(self):
        return f"layer-decay{self.decay:g}"

    def optimizer_options(self, vit, log):
        scales = layer_decay.layer_decay_scales(vit, self.decay)
        log(f"Layer decay {self.decay:g}, learning-rate scales: "
            f"{layer_decay.describe_scales(scales)}.")
        return {"layer_scales": scales}


@dataclasses.dataclass
class Ema(Part):
    """`--ema_decay`: an exponential moving average of the weights in the optimizer, validated
    each epoch (val_ema_*), and the run's model when it validates better (`tools.runs.ema`)."""

    decay: float
    validation_split: str = "val"  # the objective's: the average needs one to be chosen

    def __post_init__(self):
        ema_lib.check_ema_decay(self.decay, self.validation_split)

    def optimizer_options(self, vit, log):
        return {"ema_decay": self.decay}

    def compiled(self, model):
        model.optimizer.build(model.trainable_variables)  # here, in the scope: a backup loads it

    def callbacks(self, validation, guard):
        evaluation = ema_lib.EmaEvaluation(validation())
        evaluation.guard = guard
        return [evaluation]

    def before_evaluation(self, model, validation, log):
        choice = {"decay": self.decay, **ema_lib.choose_weights(model, validation())}
        log(f"EMA: the run's model has the {choice['weights']} weights (validation: {choice}).")
        return {"ema": choice}


def choose(config, objective=None):
    """The parts a `training.RunConfig` asks for, in the order the run applies them (the probe
    copies the model, remat and LoRA change it in place). Raises the parts' one-line errors for
    flags that are out of range or cannot go together (`finetuning.check_options`), also against
    `objective` (an `objectives.Objective`) when given."""
    finetuning.check_options(config, objective)
    settings, pretrained = config.finetuning, bool(config.model.weights)
    parts = []
    if settings.linear_probe:
        parts.append(LinearProbe(pretrained))
    if config.compute.remat:
        parts.append(Remat())
    if settings.lora_rank:  # 0 or None: off
        parts.append(Lora(settings.lora_rank, settings.lora_alpha, settings.lora_train_norms,
                          pretrained))
    if settings.layer_decay is not None:
        parts.append(LayerDecay(settings.layer_decay))
    if settings.ema_decay is not None:
        parts.append(Ema(settings.ema_decay, objective.validation_split if objective else "val"))
    return parts
