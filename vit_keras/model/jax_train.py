"""`ViT.train_on_batch` on JAX: Keras' own compiled training step, without Keras' per-call toll.

Keras' JAX `train_on_batch` lists the model's, optimizer's and metrics' variables twice (each list
walks every layer), reads each value through `Variable.value` (which checks for stateless and
autocast scopes), and after the step puts each of the ~600 new values of a ViT back with
`Variable.assign` (a conversion, a dtype and a shape check per variable); it also copies the
batch to the device twice. For a ViT that is 4-6 ms a call on a 2-core CPU, whatever the batch
(`benchmarks/batch_calls.py --call train`), and on a GPU it is time the device waits (issue 59:
a ViT-B/16 step of 72.9 ms of kernels took 81.4 ms through `train_on_batch` on an H200).

Here the same step (`model.train_function`, compiled by Keras and donating the state it is
given) runs on the variables listed once, their arrays read and set directly: the step returns
each variable's new array in the order it was given, of the variable's own shape and dtype, so
there is nothing to check. The result is Keras': the same metrics reset, the same logs, the same
weights after each call. Keras' own path runs where this one could differ: a model not compiled
with XLA, under a `keras.distribution` (which places the batch and the state by layouts), with
`class_weight`, or while a `fit` holds the state (a call from a callback).
"""

import keras
import numpy as np


def train_on_batch(model, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
    """`model.train_on_batch(...)` (Keras' signature and result) without Keras' round trip of
    the model's state through `Variable.value` and `Variable.assign` (see the module)."""
    if not _lean_path_applies(model, class_weight):
        return keras.Model.train_on_batch(model, x, y, sample_weight=sample_weight,
                                          class_weight=class_weight, return_dict=return_dict)
    import jax  # pylint: disable=import-outside-toplevel

    # pylint: disable=protected-access  (Keras' trainer, whose step this runs)
    batch = keras.tree.map_structure(
        lambda value: value if isinstance(value, jax.Array) else jax.device_put(value),
        (x, y, sample_weight))
    model._symbolic_build(data_batch=batch)  # builds the optimizer and metrics on the first call
    model.make_train_function()
    metrics = model.metrics  # one walk of the layers for the reset, the state and the logs
    for metric in metrics:
        metric.reset_state()
    groups = state_variables(model, metrics)
    state = tuple([variable._value for variable in group] for group in groups)
    if any(value is None for values in state for value in values):  # taken off by a running fit
        return keras.Model.train_on_batch(model, x, y, sample_weight=sample_weight,
                                          return_dict=return_dict)
    logs, state = model.train_function(state, iter([batch]))
    for group, values in zip(groups, state):
        for variable, value in zip(group, values):
            variable._direct_assign(value)
    logs = python_logs(logs)
    return logs if return_dict else _in_metrics_order(logs, metrics, model._compile_metrics)


def state_variables(model, metrics=None):
    """The four lists Keras' JAX step takes and returns, in its order: trainable,
    non-trainable, optimizer and metrics variables (of `metrics`, default `model.metrics`)."""
    metrics = model.metrics if metrics is None else metrics
    return (model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
            [variable for metric in metrics for variable in metric.variables])


def python_logs(logs):
    """Keras' logs as `train_on_batch` returns them: nested dicts flattened, each scalar a Python
    float (what cannot be one stays as it is)."""
    flat = {}
    for key, value in sorted((logs or {}).items()):
        if isinstance(value, dict):
            flat.update(python_logs(value))
            continue
        value = np.asarray(value)
        try:
            value = float(value)
        except (TypeError, ValueError):
            pass
        flat[key] = value
    return flat


def _in_metrics_order(logs, metrics, compile_metrics):
    """Keras' list of `train_on_batch` results: the metrics' values in `model.metrics`' order,
    those of `compile(metrics=...)` one by one, then any other log by name; one value alone."""
    names = []
    for metric in metrics:
        names += ([each.name for each in metric.metrics] if metric is compile_metrics
                  else [metric.name])
    results = [logs[name] for name in names if name in logs]
    results += [logs[key] for key in sorted(logs) if key not in names]
    return results[0] if len(results) == 1 else results


def _lean_path_applies(model, class_weight):
    jax_state = getattr(model, "_jax_state", None)
    return (class_weight is None and model.compiled and model.jit_compile
            and not model.run_eagerly and keras.distribution.distribution() is None
            and not (jax_state and not getattr(model, "_jax_state_synced", True)))
