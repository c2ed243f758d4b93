"""vit_keras.tools.runs.ema: Keras' weight average as the recipes configure it, its evaluation each
epoch, the choice of the run's weights, and its survival across a resume."""

import json
import os

import keras
import numpy as np
import pytest

from vit_keras import errors
from vit_keras.tools.runs import callbacks, ema, recipes, training

from conftest import randomize_weights, tiny_data, tiny_model

DECAY = 0.8
# SGD without momentum, clipping or warm-up: the weights after each step are known in NumPy.
PLAIN_SGD = recipes.Recipe(name="plain", optimizer="sgd", learning_rate=0.05, momentum=0.0,
                           warmup_steps=0, decay="linear", total_steps=1000, batch_size=8,
                           image_size=8, grad_clip_norm=0.0)


def _compiled(tiny_config, seed=0, recipe=PLAIN_SGD):
    keras.utils.set_random_seed(seed)
    model = randomize_weights(tiny_model(tiny_config), seed=seed)
    return recipes.compile_model(model, recipes.make_optimizer(recipe, total_steps=100,
                                                               ema_decay=DECAY))


def _averages(model):
    return [np.array(keras.ops.convert_to_numpy(a)) for _, a in ema._averaged_variables(model)]


def _numpy_average(weights_after_each_step):
    """Keras' rule: the first step's weights, then average = d * average + (1 - d) * weights."""
    average = [np.array(w) for w in weights_after_each_step[0]]
    for weights in weights_after_each_step[1:]:
        average = [DECAY * a + (1 - DECAY) * w for a, w in zip(average, weights)]
    return average


def test_the_average_follows_keras_recurrence_over_known_steps():
    # The rule is the optimizer's, whatever the model: a Dense layer keeps the test fast.
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    recipes.compile_model(model, recipes.make_optimizer(PLAIN_SGD, ema_decay=DECAY))
    optimizer, variables = model.optimizer, model.trainable_variables
    rng = np.random.default_rng(1)
    seen = []
    for _ in range(4):
        gradients = [rng.normal(0, 1, v.shape).astype("float32") for v in variables]
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in gradients], variables)
        seen.append([np.array(keras.ops.convert_to_numpy(v)) for v in variables])
    for found, expected in zip(_averages(model), _numpy_average(seen)):
        # float32 recurrences of 4 steps on values ~0.1-1.
        np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-6)


class _Record(keras.callbacks.Callback):
    """The raw weights at each epoch's end (one step per epoch: after each step)."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([np.array(keras.ops.convert_to_numpy(v))
                             for v in self.model.trainable_variables])


@pytest.mark.slow  # fit with validation and two evaluations per epoch: about 5 s
def test_fit_logs_the_average_each_epoch_and_ends_with_the_raw_weights(tiny_config):
    x, y = tiny_data(n=8)
    model = _compiled({**tiny_config, "num_layers": 1})
    record = _Record()
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                        validation_data=(x, y),
                        callbacks=[ema.EmaEvaluation((x, y)), record]).history
    assert {"val_ema_loss", "val_ema_accuracy"} <= set(history)
    # The compiled step's average is the recurrence over the weights after each step.
    for found, expected in zip(_averages(model), _numpy_average(record.weights)):
        np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-6)
    # Keras writes the average into the weights when fit ends; the callback undoes that.
    for variable, raw in zip(model.trainable_variables, record.weights[-1]):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), raw)
    # The last epoch's val_ema_loss is the average's loss.
    ema.swap_average(model)
    loss = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
    ema.swap_average(model)
    np.testing.assert_allclose(history["val_ema_loss"][-1], loss, rtol=1e-5)


def _head_favouring(model, label):
    """Makes `model`'s weights predict `label` for every image (a large head bias)."""
    for variable in model.trainable_variables:
        if variable.path == "head/bias":
            bias = np.zeros(variable.shape, "float32")
            bias[label] = 100.0
            variable.assign(bias)


@pytest.mark.parametrize("average_label, chosen", [(1, "ema"), (0, "raw")])
def test_choose_weights_keeps_the_weights_that_validate_better(tiny_config, average_label,
                                                               chosen):
    x = tiny_data(n=8)[0]
    y = np.eye(3, dtype="float32")[np.ones(8, int)]     # every label is 1
    model = _compiled(tiny_config)
    model.optimizer.build(model.trainable_variables)
    _head_favouring(model, average_label)
    ema.swap_average(model)   # the average predicts `average_label`...
    _head_favouring(model, 1 - average_label)  # ...the raw weights the other class
    choice = ema.choose_weights(model, (x, y))
    assert choice == {"weights": chosen, "val_raw_accuracy": float(average_label == 0),
                      "val_ema_accuracy": float(average_label == 1)}
    predicted = np.argmax(model.predict(x, verbose=0), axis=-1)
    assert (predicted == 1).all()  # the model holds the better weights


class _Crash(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise KeyboardInterrupt  # stands in for a kill after epoch 2 was backed up


@pytest.mark.slow  # two fits of 4 epochs with backups: over 5 s on torch
def test_a_resumed_fit_keeps_the_average(tmp_path, tiny_config):
    """fit 2 epochs, killed, resumed for 2 more == fit 4 uninterrupted: the average (optimizer
    state in the backup) and its logged evaluation, to float tolerance."""
    x, y = tiny_data(n=16)
    digits = recipes.DIGITS_RECIPE  # AdamW, warm-up: a state the backup must carry

    def fit(backup, crash=False, seed=0):
        model = _compiled(tiny_config, seed=seed, recipe=digits)
        extra = [_Crash()] if crash else []
        history = model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                            callbacks=[ema.EmaEvaluation((x, y)), *extra,
                                       callbacks.AtomicBackupAndRestore(str(tmp_path / backup))])
        return model, history.history

    uninterrupted, history = fit("a")
    with pytest.raises(KeyboardInterrupt):
        fit("b", crash=True)
    resumed, resumed_history = fit("b", seed=1)  # another seed: all state from the backup
    np.testing.assert_allclose(resumed_history["val_ema_loss"], history["val_ema_loss"][2:],
                               rtol=1e-5)
    for found, expected in zip(_averages(resumed), _averages(uninterrupted)):
        np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5])
def test_an_ema_decay_outside_0_1_is_a_user_error(value):
    with pytest.raises(errors.UserError, match=r"--ema_decay must be in \(0, 1\)"):
        ema.check_ema_decay(value)


def test_ema_without_a_validation_split_is_refused():
    with pytest.raises(errors.UserError, match="needs a validation split"):
        ema.check_ema_decay(0.99, validation_split=None)


def test_a_run_refuses_a_bad_decay_before_anything_loads(tmp_path):
    config = training.RunConfig.of(dataset="no-such-dataset", ema_decay=2.0,
                                   output_dir=str(tmp_path))
    with pytest.raises(errors.UserError, match="--ema_decay"):
        training.run(config, log=lambda _: None)
    config = training.RunConfig.of(dataset="no-such-dataset", layer_decay=0.0,
                                   output_dir=str(tmp_path))
    with pytest.raises(errors.UserError, match="--layer_decay"):
        training.run(config, log=lambda _: None)
    assert not os.listdir(tmp_path)


@pytest.mark.slow  # a digits run
# What the run records is decided by training.run, alike on every backend (the average and the
# choice themselves are tested on each above): one pass, torch's, where the run is cheapest
# (4 s against TensorFlow's 36 s, which traces every step function anew).
@pytest.mark.backend_independent("torch")
def test_a_run_with_ema_and_layer_decay_records_its_choice(tmp_path):
    config = training.RunConfig.of(image_size=8, batch_size=16, epochs=2, steps_per_epoch=3,
                                   ema_decay=0.9, layer_decay=0.75, output_dir=str(tmp_path),
                                   run_name="ema", verbose=0)
    lines = []
    metrics = training.run(config, log=lines.append)
    assert metrics["ema"]["weights"] in ("ema", "raw") and metrics["ema"]["decay"] == 0.9
    assert {"val_raw_accuracy", "val_ema_accuracy"} <= set(metrics["ema"])
    assert all("val_ema_accuracy" in row for row in metrics["history"])
    assert any(line.startswith("Layer decay 0.75, learning-rate scales: ") for line in lines)
    written = json.loads((tmp_path / "ema" / "metrics.json").read_text())
    assert written["ema"] == metrics["ema"]
    # The model written is the chosen one: it scores the chosen val accuracy.
    chosen = metrics["ema"][f"val_{metrics['ema']['weights']}_accuracy"]
    assert metrics["val_accuracy"] == pytest.approx(chosen, abs=1e-6)
