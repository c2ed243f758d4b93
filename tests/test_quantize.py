"""int8 weight quantization of a vit_keras model (`keras.Model.quantize("int8")`, as
apps/predict.py and apps/evaluate.py --quantize int8 apply it)."""

import numpy as np

from vit_keras.tools.runs import evaluation

from conftest import randomize_weights, tiny_data, tiny_model


def _quantized(model):
    return evaluation.quantized_copy(model, "int8")


def test_int8_quantizes_every_projection_and_the_head(tiny_config):
    model = _quantized(tiny_model(tiny_config))
    block = model.get_layer("encoderblock_0")
    projections = [block.attention.query, block.attention.key, block.attention.value,
                   block.attention.out, block.mlp.dense_0, block.mlp.dense_1,
                   model.get_layer("head")]
    assert [layer.quantization_mode for layer in projections] == ["int8"] * len(projections)
    assert all(str(layer._kernel.dtype) == "int8" for layer in projections)


def test_int8_logits_stay_close_to_float(tiny_config):
    model = randomize_weights(tiny_model(tiny_config))
    x, _ = tiny_data(n=8)
    expected = model.predict(x, verbose=0)
    found = _quantized(model).predict(x, verbose=0)
    assert not np.array_equal(found, expected)  # it did quantize
    # Per-channel int8 weights and per-token int8 inputs: about 1% of the logits' scale.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(found, expected, atol=0.05 * scale)


def test_quantized_copy_leaves_the_float_model_as_it_was(tiny_config):
    model = tiny_model(tiny_config)
    _quantized(model)
    assert model.get_layer("head").quantization_mode is None
    assert evaluation.quantized_copy(model, "none") is model
