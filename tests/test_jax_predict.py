"""`ViT.predict_on_batch`: Keras' outputs on every backend; on JAX without Keras' round trip of
the model's state (`vit_keras.model.jax_predict`)."""

import keras
import numpy as np
import pytest

from vit_keras import build_model
from vit_keras.model import jax_predict

from conftest import randomize_weights, tiny_data, tiny_model

BACKEND = keras.backend.backend()


def keras_predict_on_batch(model, x):
    """Keras' own `predict_on_batch`, past ViT's."""
    return keras.Model.predict_on_batch(model, x)


@pytest.fixture
def keras_path_calls(monkeypatch):
    """The number of calls that reached Keras' own `predict_on_batch`."""
    calls = []
    original = keras.Model.predict_on_batch

    def counted(model, x):
        calls.append(model)
        return original(model, x)

    monkeypatch.setattr(keras.Model, "predict_on_batch", counted)
    return calls


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_predict_on_batch_gives_keras_outputs_and_leaves_the_weights(tiny_config, policy,
                                                                      keras_path_calls):
    keras.config.set_dtype_policy(policy)
    # With dropout: its seed is non-trainable state, which inference must leave as it is.
    model = randomize_weights(build_model(tiny_config, image_size=8, num_classes=3, dropout=0.3))
    model.compile()
    x, _ = tiny_data()
    weights = [np.array(w) for w in model.get_weights()]
    ours = model.predict_on_batch(x)
    assert not keras_path_calls if BACKEND == "jax" else len(keras_path_calls) == 1
    expected = keras_predict_on_batch(model, x)
    assert isinstance(ours, np.ndarray) and ours.dtype == expected.dtype == np.float32
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)
    # The eager call rounds to bfloat16 where XLA's fused program need not.
    tolerance = 1e-5 if policy == "float32" else 0.02 * np.abs(expected).max()
    np.testing.assert_allclose(ours, keras.ops.convert_to_numpy(model(x)), atol=tolerance)
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)


def test_predict_on_batch_reads_the_weights_as_they_are_when_called(tiny_config):
    model = randomize_weights(tiny_model(tiny_config))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    x, y = tiny_data()
    first = model.predict_on_batch(x)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    after_fit = model.predict_on_batch(x)
    assert np.abs(after_fit - first).max() > 1e-6
    np.testing.assert_allclose(after_fit, keras_predict_on_batch(model, x), rtol=1e-6, atol=1e-6)
    randomize_weights(model, seed=1)
    np.testing.assert_allclose(model.predict_on_batch(x), keras_predict_on_batch(model, x),
                               rtol=1e-6, atol=1e-6)
    # Frozen, then LoRA-adapted after the first call (and compiled again, which TensorFlow's
    # traced predict function needs): the variables' split and number change.
    model.trainable = False
    frozen = model.predict_on_batch(x)
    np.testing.assert_allclose(frozen, keras_predict_on_batch(model, x), rtol=1e-6, atol=1e-6)
    model.trainable = True
    target = model.heads[0]
    target.enable_lora(2)
    for adapter in (target.lora_kernel_a, target.lora_kernel_b):
        adapter.assign(np.full(adapter.shape, 0.5, "float32"))
    model.compile()
    adapted = model.predict_on_batch(x)
    assert np.abs(adapted - frozen).max() > 1e-4
    np.testing.assert_allclose(adapted, keras_predict_on_batch(model, x), rtol=1e-6, atol=1e-6)


def test_keras_path_serves_what_the_jitted_forward_pass_would_not(tiny_config, keras_path_calls):
    model = randomize_weights(tiny_model(tiny_config))
    x, _ = tiny_data()
    model.compile(jit_compile=False)
    eager = model.predict_on_batch(x)
    assert len(keras_path_calls) == 1
    # The default: XLA on JAX and TensorFlow; on torch eager (torch.compile would take 20 s).
    model.compile(jit_compile="auto")
    np.testing.assert_allclose(model.predict_on_batch(x), eager, rtol=1e-5, atol=1e-5)
    assert len(keras_path_calls) == (1 if BACKEND == "jax" else 2)


class _CountingModel(keras.Model):
    """A model whose forward pass counts its calls in a non-trainable variable."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x):
        self.calls.assign(self.calls + 1.0)
        return self.dense(x)


@pytest.mark.skipif(BACKEND != "jax", reason="the round trip it skips is Keras' JAX trainer's")
def test_a_forward_pass_that_changes_state_takes_keras_path(keras_path_calls):
    model = _CountingModel()
    model.build((None, 3))
    model.compile(jit_compile=True)
    x = np.ones((2, 3), "float32")
    for call in range(1, 3):
        np.testing.assert_allclose(jax_predict.predict_on_batch(model, x),
                                   keras.ops.convert_to_numpy(model.dense(x)), rtol=1e-6)
        assert float(model.calls.value) == call
    assert len(keras_path_calls) == 2
