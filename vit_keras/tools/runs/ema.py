"""Weight EMA of a training run (`--ema_decay`): the average, its evaluation each epoch and the
choice of the run's model.

The average is Keras' own (`use_ema=True, ema_momentum=decay` on the optimizer,
`recipes.make_optimizer(ema_decay=...)`): it is updated inside the compiled train step, after
each update of the weights, and kept among the optimizer's variables, so the run's backup
(`AtomicBackupAndRestore`: weights and optimizer state) carries it across a resume. Keras' rule,
`BaseOptimizer._update_model_variables_moving_average`:

    step 1 (iterations == 0): average = weights after the first update
    step t > 1:               average = decay * average + (1 - decay) * weights after update t

With `--accum_steps`, the average is updated on every batch (Keras' `iterations` counts updates,
and its first-step rule holds for the first update's batches).

`EmaEvaluation` evaluates the average on the validation split at the end of every epoch and adds
`val_ema_<metric>` to the epoch's logs (history.csv, TensorBoard). Keras writes the average into
the weights when `fit` ends (`finalize_variable_values`); the callback puts the raw weights back,
so that after `fit`, as after a resume from the backup, the model holds the raw weights and the
optimizer the average. `choose_weights` then keeps whichever validates better.
"""

import keras
import numpy as np

from vit_keras import errors


class EmaDecayError(errors.UserError, ValueError):
    """An EMA decay outside (0, 1), or EMA asked of a run without a validation split."""


def check_ema_decay(ema_decay, validation_split="val"):
    """Raises `EmaDecayError` unless `ema_decay` is None (off) or in (0, 1), with a validation
    split to choose between the average and the raw weights."""
    if ema_decay is None:
        return
    if not 0 < ema_decay < 1:
        raise EmaDecayError(f"--ema_decay must be in (0, 1) (the weight of the past average at "
                            f"each step; 0.999-0.9999 is usual); got {ema_decay}.")
    if validation_split is None:
        raise EmaDecayError("--ema_decay needs a validation split to choose between the average "
                            "and the raw weights; this training app has none. Drop --ema_decay.")


def _averaged_variables(model):
    """`[(model variable, its average)]` of `model`'s optimizer (Keras keeps the average in
    `_model_variables_moving_average`, in the order of the variables it was built with)."""
    optimizer = model.optimizer
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
    if not getattr(optimizer, "use_ema", False):
        raise ValueError(f"Model {model.name!r} was compiled without an EMA of its weights; "
                         f"compile it with recipes.make_optimizer(..., ema_decay=...).")
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return [(variable, average) for variable, average in
            zip(optimizer._trainable_variables, optimizer._model_variables_moving_average)
            if average is not None]


def swap_average(model):
    """Exchanges `model`'s weights with their moving average in place (call twice to undo)."""
    for variable, average in _averaged_variables(model):
        raw = keras.ops.convert_to_numpy(variable)
        variable.assign(average)
        average.assign(raw)


def _evaluate(model, data):
    """`model.evaluate` of a dataset or an `(images, labels)` pair, as a dict."""
    x, y = data if isinstance(data, tuple) else (data, None)
    return model.evaluate(x, y, verbose=0, return_dict=True)


def _score(results):
    """Higher is better: the accuracy when the model has one, else minus the loss."""
    return results["accuracy"] if "accuracy" in results else -results["loss"]


class EmaEvaluation(keras.callbacks.Callback):
    """Evaluates the weights' average on `validation_data` (a dataset or `(images, labels)`)
    at the end of each epoch: logs `val_ema_<metric>` (seen by the logging callbacks after it in
    the list). Puts the raw weights back into the model when `fit` ends, undoing Keras'
    `finalize_variable_values`."""

    def __init__(self, validation_data):
        super().__init__()
        self.validation_data = validation_data
        self._raw_weights = None

    guard = None  # a StopOnNaN: nothing is evaluated once the loss is not finite

    def on_epoch_end(self, epoch, logs=None):
        if self.guard and self.guard.bad_step:
            return
        swap_average(self.model)
        try:
            results = _evaluate(self.model, self.validation_data)
        finally:
            swap_average(self.model)
        if logs is not None:
            logs.update({f"val_ema_{name}": float(value) for name, value in results.items()})
        if epoch == self.params.get("epochs", 0) - 1:  # `fit` overwrites them next
            self._raw_weights = [np.array(keras.ops.convert_to_numpy(variable))
                                 for variable, _ in _averaged_variables(self.model)]

    def on_train_end(self, logs=None):
        if self._raw_weights is not None:
            for (variable, _), raw in zip(_averaged_variables(self.model), self._raw_weights):
                variable.assign(raw)
            self._raw_weights = None


def choose_weights(model, validation_data):
    """Leaves in `model` whichever of its raw weights and their average validates better on
    `validation_data` (the average only when strictly better) and says which.

    Returns `{"weights": "ema" | "raw", "val_raw_accuracy", "val_ema_accuracy"}` (`..._loss`
    for a model without accuracy)."""
    raw = _evaluate(model, validation_data)
    swap_average(model)
    ema = _evaluate(model, validation_data)
    chosen = "ema" if _score(ema) > _score(raw) else "raw"
    if chosen == "raw":
        swap_average(model)
    metric = "accuracy" if "accuracy" in raw else "loss"
    return {"weights": chosen, f"val_raw_{metric}": float(raw[metric]),
            f"val_ema_{metric}": float(ema[metric])}
