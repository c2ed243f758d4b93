"""`ViT.predict_on_batch` on JAX: one jitted forward pass of the weights as they are.

Keras' JAX trainer gathers the model's whole state on every `predict_on_batch`, passes each
variable through its compiled predict step (donated and returned) and assigns every one back
afterwards, whatever the batch: for a ViT's 200 variables 0.2-0.8 ms a call on a 2-core CPU
(`benchmarks/batch_calls.py`), more on a GPU, where every returned buffer is a device buffer
(issue 59: `predict_on_batch` 5-11% slower than a jitted `stateless_call` on a ViT-B/16 batch
of 256 on an H100). Here the weights go in as arguments and only the outputs come back.

The result is Keras': the same `stateless_call(..., training=False)`, the weights read when the
call is made, NumPy outputs. Keras' own path runs instead where this one could differ: a model
not compiled with XLA (`run_eagerly`, `jit_compile=False`), under a `keras.distribution`, not yet
built, or whose forward pass changes a non-trainable variable (found when it is traced; a ViT's
never does: it has no batch statistics, and its dropout draws no seed at inference).
"""

import inspect
import weakref

import keras
import numpy as np

# model -> (Keras' predict_function when the forward pass was made, the jitted forward pass, or
# None when the model's forward pass changes its state). Keyed weakly, holding the model weakly:
# an entry goes with its model. Remade when Keras remakes its own (`compile`).
_FORWARDS = weakref.WeakKeyDictionary()


class _ForwardChangesState(Exception):
    """Raised while tracing a forward pass that assigns a non-trainable variable."""


def predict_on_batch(model, x):
    """`model.predict_on_batch(x)` (outputs as NumPy arrays) without Keras' round trip of the
    model's state, or through Keras where that round trip matters (see the module)."""
    forward = _forward_of(model)
    if forward is None:
        return keras.Model.predict_on_batch(model, x)
    trainable = [variable.value for variable in model.trainable_variables]
    non_trainable = [variable.value for variable in model.non_trainable_variables]
    try:
        outputs = forward(trainable, non_trainable, x)
    except _ForwardChangesState:
        _FORWARDS[model] = (model.predict_function, None)
        return keras.Model.predict_on_batch(model, x)
    return keras.tree.map_structure(np.asarray, outputs)


def _forward_of(model):
    """The model's jitted `(trainable, non_trainable, x) -> outputs`, or None for Keras' path."""
    if (model.run_eagerly or not model.jit_compile
            or keras.distribution.distribution() is not None or not model.built):
        return None
    model.make_predict_function()  # Keras' own, so that compile() remakes both
    made_for, forward = _FORWARDS.get(model, (None, None))
    if made_for is not model.predict_function:
        forward = _jitted_forward(weakref.ref(model))
        _FORWARDS[model] = (model.predict_function, forward)
    return forward


def _jitted_forward(model_ref):
    import jax  # pylint: disable=import-outside-toplevel

    # As Keras' predict step calls it: `training=False` where `call` takes it.
    takes_training = "training" in inspect.signature(model_ref().call).parameters
    arguments = {"training": False} if takes_training else {}

    def predict_forward(trainable, non_trainable, x):  # XLA's module: jit_predict_forward
        outputs, updated = model_ref().stateless_call(trainable, non_trainable, x, **arguments)
        # Inside the trace an unchanged variable is the very tracer that went in.
        if any(new is not old for new, old in zip(updated, non_trainable)):
            raise _ForwardChangesState()
        return outputs

    return jax.jit(predict_forward)
