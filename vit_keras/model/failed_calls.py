"""A `fit`, `evaluate` or `predict` that raises leaves the model as it was: its weights, and able
to run again. Two upstream bugs took that away (Keras 3.15.1; its main branch of 2026-08 alike):

- On JAX, Keras' trainer takes every variable's value off the model while it runs (its compiled
  step holds the only copy, `Trainer._purge_model_variables`) and puts the steps' results back
  only when the call ends normally, or, for `fit`, once a step has run. When the first step
  raises (labels of another number of classes, a batch too large for the device, Ctrl-C during
  the compile), or any step of `predict` or `evaluate`, every weight is left `None`: the next
  call fails with `TypeError: 'NoneType' object is not callable`, and a trained model is lost.
- On TensorFlow, a `fit` whose first step raised leaves a `tf.function` that has been traced
  once: the next `fit` fails with `Creating variables on a non-first call to a function
  decorated with tf.function` (the optimizer's variables are made in the first trace).

`kept_on_error` puts back, on JAX, the values of the last step that ran (Keras' own
`jax_state_sync`), then, for each variable still without a value, the one it had when the call
began; on TensorFlow it drops the traced training step, to be traced anew. Holding the starting
values costs nothing: the compiled step donates its inputs, so a value a step replaced is freed
as it would be without this. (Without `jit_compile`, a JAX `fit` keeps them until it returns.)

`FailSafeModel` is a functional `keras.Model` whose calls run inside it: `vit_keras.ViT` is one,
and so are the models vit_keras builds around a ViT's layers (feature extractors, the masked patch
prediction model), whose failing call would otherwise take away the weights they share with it.
"""

import contextlib

import keras


@contextlib.contextmanager
def kept_on_error(model):
    """Around `model.fit` / `evaluate` / `predict`: if the call raises, the model keeps its
    weights (on JAX the latest its steps made, or those it had before the call) and can run
    again; the error goes on."""
    backend = keras.backend.backend()
    # `_value`, the array itself (`.value` checks scopes: +0.25 ms for a ViT-B's 200 variables).
    held = ([(variable, variable._value) for variable in _state_variables(model)]  # pylint: disable=protected-access
            if backend == "jax" else [])
    try:
        yield
    except BaseException:
        if backend == "jax":
            model.jax_state_sync()
            for variable, value in held:
                # A value donated to a step that ran is gone; that step's result is in place.
                if variable._value is None and value is not None and not value.is_deleted():  # pylint: disable=protected-access
                    variable.assign(value)
            model._jax_state = None  # pylint: disable=protected-access  (as Keras' calls end)
        elif backend == "tensorflow":
            model.train_function = None
        raise


def _state_variables(model):
    """Every variable Keras' JAX trainer may take off the model: its own, its optimizer's (once
    built) and its metrics'."""
    optimizer = getattr(model, "optimizer", None)
    return [*model.variables, *(optimizer.variables if optimizer is not None else ()),
            *model.metrics_variables]


@keras.saving.register_keras_serializable(package="vit_keras")
class FailSafeModel(keras.Model):
    """A functional `keras.Model`, `FailSafeModel(inputs, outputs, name=None)`, whose `fit`,
    `evaluate` and `predict` keep its weights (and so those of any model it shares layers with)
    when they raise: `kept_on_error`. It saves and loads as a functional model does."""

    def __init__(self, inputs, outputs, name=None, **kwargs):
        super().__init__(inputs, outputs, name=name, **kwargs)

    def fit(self, *args, **kwargs):
        with kept_on_error(self):
            return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with kept_on_error(self):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with kept_on_error(self):
            return super().predict(*args, **kwargs)
