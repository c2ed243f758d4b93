"""`ViT.train_on_batch` on JAX: Keras' compiled step without Keras' checked round trip of every
variable (`vit_keras.model.jax_train`), and Keras' results, weights and errors."""

import keras
import numpy as np
import pytest

from vit_keras.model import jax_train

from conftest import randomize_weights, tiny_data, tiny_model

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="the round trip it skips is Keras' JAX trainer's; on the "
                                       "other backends ViT.train_on_batch is Keras' own")


@pytest.fixture
def keras_path_calls(monkeypatch):
    """The models whose `train_on_batch` reached Keras' own."""
    calls = []
    original = keras.Model.train_on_batch

    def counted(model, *args, **kwargs):
        calls.append(model)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "train_on_batch", counted)
    return calls


@pytest.fixture
def one_block(tiny_config):
    """The tiny ViT of one block: each test here compiles its training step several times."""
    return {**tiny_config, "num_layers": 1}


def compiled_pair(config, **compile_args):
    """Two identical compiled tiny ViTs: one for ViT's path, one for Keras'."""
    models = []
    for _ in range(2):
        model = randomize_weights(tiny_model(config))
        model.compile(**{"optimizer": keras.optimizers.AdamW(0.01), "jit_compile": True,
                         "loss": keras.losses.CategoricalCrossentropy(from_logits=True),
                         "metrics": ["accuracy", keras.metrics.AUC(name="auc")],
                         **compile_args})
        models.append(model)
    return models


def state_arrays(model):
    return [np.array(variable.value) for group in jax_train.state_variables(model)
            for variable in group]


def test_train_on_batch_gives_keras_logs_weights_and_optimizer_state(one_block,
                                                                     keras_path_calls):
    ours, theirs = compiled_pair(one_block)
    x, y = tiny_data()
    weights = np.random.default_rng(1).uniform(0.5, 2.0, len(x)).astype("float32")
    calls = [dict(), dict(return_dict=True), dict(sample_weight=weights), dict()]
    for kwargs in calls:
        expected = keras.Model.train_on_batch(theirs, x, y, **kwargs)
        assert ours.train_on_batch(x, y, **kwargs) == expected  # Python floats, Keras' order
    assert keras_path_calls == [theirs] * len(calls)
    assert isinstance(expected, list) and len(expected) == 3
    # Model, optimizer (moments, iterations) and metrics state alike, bit for bit; each read
    # through its variable, which a donated array would refuse.
    ours_state, theirs_state = state_arrays(ours), state_arrays(theirs)
    assert len(ours_state) == len(theirs_state) > 3 * len(ours.trainable_variables)
    for mine, keras_own in zip(ours_state, theirs_state):
        np.testing.assert_array_equal(mine, keras_own)
    assert int(ours.optimizer.iterations.value) == len(calls)


def test_a_step_after_freezing_trains_what_keras_would(one_block):
    ours, theirs = compiled_pair(one_block, metrics=None)
    x, y = tiny_data()
    for model in (ours, theirs):
        model.get_layer("embedding").trainable = False  # after compile, as users do
        model.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=True,
                      loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    frozen = [np.array(w) for w in ours.get_layer("embedding").get_weights()]
    loss = ours.train_on_batch(x, y)
    assert isinstance(loss, float) and loss == keras.Model.train_on_batch(theirs, x, y)
    for before, after in zip(frozen, ours.get_layer("embedding").get_weights()):
        np.testing.assert_array_equal(before, after)
    for mine, keras_own in zip(state_arrays(ours), state_arrays(theirs)):
        np.testing.assert_array_equal(mine, keras_own)


def test_keras_path_serves_what_the_lean_path_does_not(one_block, monkeypatch):
    routed = []  # Keras' own train_on_batch, recorded, not run (its eager step compiles for 5 s)
    monkeypatch.setattr(keras.Model, "train_on_batch",
                        lambda model, *args, **kwargs: routed.append(kwargs) or "Keras' path")
    model = tiny_model(one_block)
    x, y = tiny_data()
    model.compile(optimizer="sgd", loss="categorical_crossentropy", jit_compile=False)
    assert model.train_on_batch(x, y) == "Keras' path"
    model.compile(optimizer="sgd", loss="categorical_crossentropy", jit_compile=True)
    assert isinstance(model.train_on_batch(x, y), float) and len(routed) == 1
    class_weight = {0: 2.0, 1: 1.0, 2: 1.0}
    assert model.train_on_batch(x, y, class_weight=class_weight) == "Keras' path"
    assert routed[-1]["class_weight"] == class_weight
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        assert model.train_on_batch(x, y) == "Keras' path"
    finally:
        keras.distribution.set_distribution(None)
    assert len(routed) == 3


def test_a_step_that_fails_leaves_the_model_able_to_train(one_block):
    model = randomize_weights(tiny_model(one_block))
    model.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=True,
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    x, y = tiny_data()
    model.train_on_batch(x, y)
    weights = [np.array(w) for w in model.get_weights()]
    with pytest.raises(ValueError):  # labels of 5 classes for a head of 3
        model.train_on_batch(x, np.eye(5, dtype="float32")[:len(x)])
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    assert np.isfinite(model.train_on_batch(x, y))
