"""The layers, one behaviour per test, checked against NumPy references written from the paper."""

import math
import warnings

import keras
import numpy as np
import pytest
import scipy.special

import vit_keras
from vit_keras.model import attention as attention_kernels
from vit_keras.model import heads, layers, norms, transformer_blocks, xla_cpu
from vit_keras.model import mlp as mlp_lib

from conftest import random_images, randomize_weights, tiny_data, tiny_model


def _layer_cases():
    return [
        (layers.PatchEmbedding(4, 16, name="embedding"), (2, 8, 12, 3)),
        (layers.PatchEmbedding(4, 16, flatten=False, name="embedding"), (2, 8, 12, 3)),
        (layers.ClassToken(name="cls"), (2, 6, 16)),
        (layers.AddPositionEmbs(name="posembed_input"), (2, 7, 16)),
        (layers.MultiHeadDotProductAttention(4, attention_dropout=0.1), (2, 7, 16)),
        (layers.MlpBlock(32, dropout=0.2, gelu="tanh"), (2, 7, 16)),
        (layers.TransformerBlock(4, 32, dropout=0.1, attention_dropout=0.1, drop_path_rate=0.2,
                                 norm_spec=norms.NormSpec(epsilon=1e-5),
                                 mlp_spec=mlp_lib.MlpSpec(gelu="tanh"), seed=3), (2, 7, 16)),
        (heads.TokenPooling("gap"), (2, 7, 16)),
    ]


@pytest.mark.parametrize("layer,input_shape", _layer_cases(),
                         ids=lambda case: type(case).__name__ if isinstance(case, keras.Layer) else "")
def test_get_config_round_trip_rebuilds_an_identical_layer(layer, input_shape):
    x = np.random.default_rng(0).normal(size=input_shape).astype("float32")
    expected = keras.ops.convert_to_numpy(layer(x))
    clone = type(layer).from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    clone.build(input_shape)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(keras.ops.convert_to_numpy(clone(x)), expected, rtol=1e-6, atol=1e-6)
    # Every layer is found by name when a .keras file is read back.
    assert keras.saving.get_registered_object(f"vit_keras>{type(layer).__name__}") is type(layer)


@pytest.mark.parametrize("height,width,channels", [(8, 8, 3), (8, 12, 1), (12, 4, 5)])
def test_patch_embedding_equals_strided_valid_convolution(height, width, channels):
    layer = layers.PatchEmbedding(4, 6)
    images = np.random.default_rng(1).normal(size=(2, height, width, channels)).astype("float32")
    tokens = keras.ops.convert_to_numpy(layer(images))
    layer.bias.assign(np.arange(6, dtype="float32"))
    tokens = keras.ops.convert_to_numpy(layer(images))
    conv = keras.ops.conv(images, layer.kernel, strides=4, padding="valid") + layer.bias
    expected = keras.ops.convert_to_numpy(conv).reshape(2, -1, 6)  # row-major patch order
    assert tokens.shape == (2, (height // 4) * (width // 4), 6)
    np.testing.assert_allclose(tokens, expected, rtol=1e-5, atol=1e-5)


def test_patch_embedding_rejects_image_size_not_divisible_by_patch():
    with pytest.raises(ValueError, match="height 10 is not divisible by patch size 4"):
        layers.PatchEmbedding(4, 8).build((None, 10, 8, 3))


def test_class_token_is_zero_initialised_prepended_and_in_compute_dtype():
    layer = layers.ClassToken(dtype="mixed_bfloat16")
    x = keras.ops.ones((3, 5, 8), dtype="bfloat16")
    y = layer(x)
    assert tuple(y.shape) == (3, 6, 8)
    assert keras.backend.standardize_dtype(y.dtype) == "bfloat16"
    assert layer.cls.shape == (1, 1, 8)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.ops.cast(y[:, 0], "float32")), 0)


def test_position_embedding_is_added_and_initialised_with_stddev_002():
    keras.utils.set_random_seed(0)
    layer = layers.AddPositionEmbs()
    x = np.zeros((2, 400, 32), "float32")
    y = keras.ops.convert_to_numpy(layer(x))
    embedding = keras.ops.convert_to_numpy(layer.pos_embedding)
    np.testing.assert_array_equal(y, np.broadcast_to(embedding, y.shape))
    assert abs(embedding.std() - 0.02) < 0.001


def test_position_embedding_names_a_token_count_mismatch():
    layer = layers.AddPositionEmbs(name="posembed_input")
    layer.build((None, 5, 8))
    with pytest.raises(ValueError, match="position embeddings for 5 tokens but got 7"):
        layer(np.zeros((1, 7, 8), "float32"))


def _numpy_attention(x, layer):
    w = {"/".join(v.path.split("/")[-2:]): keras.ops.convert_to_numpy(v) for v in layer.weights}
    q = np.einsum("btd,dhk->bthk", x, w["query/kernel"]) + w["query/bias"]
    k = np.einsum("btd,dhk->bthk", x, w["key/kernel"]) + w["key/bias"]
    v = np.einsum("btd,dhk->bthk", x, w["value/kernel"]) + w["value/bias"]
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v)
    return np.einsum("bqhd,hdo->bqo", out, w["out/kernel"]) + w["out/bias"], probs


def test_attention_weights_have_the_checkpoint_layout():
    layer = layers.MultiHeadDotProductAttention(4, name="MultiHeadDotProductAttention_1")
    layer.build((None, 7, 32))
    shapes = {v.path: tuple(v.shape) for v in layer.weights}
    assert shapes == {
        "MultiHeadDotProductAttention_1/query/kernel": (32, 4, 8),
        "MultiHeadDotProductAttention_1/query/bias": (4, 8),
        "MultiHeadDotProductAttention_1/key/kernel": (32, 4, 8),
        "MultiHeadDotProductAttention_1/key/bias": (4, 8),
        "MultiHeadDotProductAttention_1/value/kernel": (32, 4, 8),
        "MultiHeadDotProductAttention_1/value/bias": (4, 8),
        "MultiHeadDotProductAttention_1/out/kernel": (4, 8, 32),
        "MultiHeadDotProductAttention_1/out/bias": (32,),
    }


@pytest.mark.parametrize("fused", [False, True], ids=["explicit", "fused"])
def test_fused_and_explicit_attention_kernels_match_a_numpy_reference(fused, monkeypatch):
    """A plain call takes the kernel chosen when the layer was built; a call for attention scores
    the explicit one, whatever was chosen."""
    _force_attention_kernel(monkeypatch, fused)
    layer = layers.MultiHeadDotProductAttention(4)
    layer.build((None, 7, 32))
    assert layer.fused is fused
    randomize_weights(layer, scale=0.3)
    x = np.random.default_rng(2).normal(size=(2, 7, 32)).astype("float32")
    expected, expected_probs = _numpy_attention(x, layer)
    plain = keras.ops.convert_to_numpy(layer(x))
    with_scores, probs = layer(x, return_attention_scores=True)
    np.testing.assert_allclose(plain, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(with_scores), expected, rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(probs), expected_probs, rtol=1e-4,
                               atol=1e-6)


def test_attention_kernel_is_chosen_when_built_for_the_backend_device_and_dtype():
    """torch's own kernel on torch; `keras.ops.dot_product_attention` on JAX unless the XLA:CPU
    workarounds are active when the layer is built; explicit on TensorFlow and for float16 (the
    GPU rows of the table: tests/test_attention.py). (That a built model keeps its kernel when
    the switch changes is checked on JAX in test_xla_cpu.py.)"""
    def built(**kwargs):
        layer = layers.MultiHeadDotProductAttention(4, **kwargs)
        assert layer.attention_kernel is None and layer.fused is False  # chosen in build
        layer.build((None, 7, 32))
        return layer

    backend = keras.backend.backend()
    fused = {"torch": "torch", "jax": "fused", "tensorflow": "explicit"}[backend]
    default = built()
    assert default.attention_kernel == (
        "explicit" if xla_cpu.workarounds_active() else fused)
    assert default.fused is (default.attention_kernel != "explicit")
    with xla_cpu.set_workarounds(False):
        plain = built()
        half = built(dtype="mixed_float16")
    assert plain.attention_kernel == fused
    assert half.attention_kernel == "explicit"


def test_attention_rejects_hidden_size_not_divisible_by_heads():
    with pytest.raises(ValueError, match="Hidden size 30 is not divisible by the number of heads 4"):
        layers.MultiHeadDotProductAttention(4).build((None, 7, 30))


_PROJECTIONS = ("query", "key", "value", "out")


def _force_attention_kernel(monkeypatch, fused):
    """Every backend checks both of its attention kernels: the fused one (torch's own on torch,
    `keras.ops.dot_product_attention` elsewhere, an unfused softmax where no kernel exists) and
    the explicit one its backend may not take. Layers built afterwards take it."""
    choose = attention_kernels.choose_attention

    def forced(compute_dtype, head_dim=None, tokens=None, probabilities=False):
        if fused and not probabilities:
            return attention_kernels.kernel_named(
                "torch" if keras.backend.backend() == "torch" else "fused")
        return choose(compute_dtype, head_dim, tokens, probabilities=True)

    monkeypatch.setattr(attention_kernels, "choose_attention", forced)


def _attention_layers(model):
    return [block.attention for block in transformer_blocks(model)]


@pytest.mark.slow  # over 5 s alone: out of make test-fast
@pytest.mark.parametrize("fused", [False, True], ids=["explicit", "fused"])
def test_int8_quantized_vit_stays_close_to_the_float_model(tiny_config, fused, monkeypatch):
    """int8 rounds each kernel column, and each input row of a projection, to 127 steps of its
    largest magnitude: about 0.4% per operand, a few of them adding up over the projections of
    two blocks and the head to about 1% of the largest logit. The 5% bound leaves room for that
    and still fails by far when a projection multiplies by the int8 values without their scale
    (the largest logit is then off by more than itself)."""
    _force_attention_kernel(monkeypatch, fused)
    model = randomize_weights(tiny_model(tiny_config))
    assert [a.fused for a in _attention_layers(model)] == [fused] * tiny_config["num_layers"]
    images = random_images(4, 8, 8)
    expected = keras.ops.convert_to_numpy(model(images))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per layer that has nothing to quantize
        model.quantize("int8")
    for attention in _attention_layers(model):
        for name in _PROJECTIONS:
            projection = getattr(attention, name)
            assert projection.quantization_mode == "int8", name
            assert keras.backend.standardize_dtype(projection.kernel.dtype) == "int8", name
    logits = keras.ops.convert_to_numpy(model(images))
    error = np.max(np.abs(logits - expected)) / np.max(np.abs(expected))
    assert 1e-4 < error < 0.05, error  # above float32 noise: the int8 arithmetic ran


def _lora_delta(projection):
    a, b = (keras.ops.convert_to_numpy(w) for w in (projection.lora_kernel_a,
                                                     projection.lora_kernel_b))
    # A's last axis against B's first: (hidden, R) x (R, heads, head_dim) for query/key/value,
    # (heads, head_dim, R) x (R, hidden) for out.
    return projection.lora_alpha / projection.lora_rank * np.tensordot(a, b, axes=1)


@pytest.mark.parametrize("fused", [False, True], ids=["explicit", "fused"])
def test_lora_on_attention_projections_adds_its_delta_and_trains_only_itself(
        tiny_config, fused, monkeypatch):
    """With nonzero LoRA weights the logits are those of the model whose kernels have
    `lora_alpha / rank * lora_kernel_a @ lora_kernel_b` added; training moves the LoRA weights
    and leaves the frozen kernels alone."""
    _force_attention_kernel(monkeypatch, fused)
    model = randomize_weights(tiny_model(tiny_config))
    assert [a.fused for a in _attention_layers(model)] == [fused] * tiny_config["num_layers"]
    merged = randomize_weights(tiny_model(tiny_config))  # the same weights
    images = random_images(4, 8, 8)
    without_lora = keras.ops.convert_to_numpy(model(images))
    rng = np.random.default_rng(7)
    for attention, reference in zip(_attention_layers(model), _attention_layers(merged)):
        for name in _PROJECTIONS:
            projection = getattr(attention, name)
            projection.enable_lora(2, lora_alpha=3)
            for weight in (projection.lora_kernel_a, projection.lora_kernel_b):
                weight.assign(rng.normal(0, 0.3, weight.shape).astype("float32"))
            kernel = getattr(reference, name).kernel
            kernel.assign(keras.ops.convert_to_numpy(kernel) + _lora_delta(projection))
    logits = keras.ops.convert_to_numpy(model(images))
    np.testing.assert_allclose(logits, keras.ops.convert_to_numpy(merged(images)),
                               rtol=1e-4, atol=1e-5)
    assert np.max(np.abs(logits - without_lora)) > 0.1 * np.max(np.abs(without_lora))

    projections = [getattr(a, name) for a in _attention_layers(model) for name in _PROJECTIONS]
    for projection in projections:
        assert [w.name for w in projection.non_trainable_weights] == ["kernel"]
        assert sorted(w.name for w in projection.trainable_weights) == [
            "bias", "lora_kernel_a", "lora_kernel_b"]
    before = {id(w): keras.ops.convert_to_numpy(w) for w in model.weights}
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="categorical_crossentropy")
    model.fit(*tiny_data(), batch_size=8, epochs=1, verbose=0)
    for projection in projections:
        (kernel,) = projection.non_trainable_weights
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(kernel), before[id(kernel)])
        for weight in (projection.lora_kernel_a, projection.lora_kernel_b):
            assert np.any(keras.ops.convert_to_numpy(weight) != before[id(weight)]), weight.path


def _numpy_layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta


@pytest.mark.parametrize("approximate", [False, True])
def test_transformer_block_is_pre_layer_norm_attention_and_gelu_mlp_with_residuals(approximate):
    block = layers.TransformerBlock(
        4, 48, mlp_spec=mlp_lib.MlpSpec(gelu="tanh" if approximate else "exact"))
    block.build((None, 7, 32))
    randomize_weights(block, scale=0.2)
    w = {v.path.split("/", 1)[1]: keras.ops.convert_to_numpy(v) for v in block.weights}
    x = np.random.default_rng(3).normal(size=(2, 7, 32)).astype("float64")

    y = _numpy_layer_norm(x, w["LayerNorm_0/gamma"], w["LayerNorm_0/beta"], 1e-6)
    attention = block.attention
    x = x + _numpy_attention(y, attention)[0]
    y = _numpy_layer_norm(x, w["LayerNorm_2/gamma"], w["LayerNorm_2/beta"], 1e-6)
    h = y @ w["MlpBlock_3/Dense_0/kernel"] + w["MlpBlock_3/Dense_0/bias"]
    if approximate:
        h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    else:
        h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    expected = x + h @ w["MlpBlock_3/Dense_1/kernel"] + w["MlpBlock_3/Dense_1/bias"]

    inputs = np.random.default_rng(3).normal(size=(2, 7, 32)).astype("float32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(block(inputs)), expected,
                               rtol=1e-4, atol=1e-4)


def test_exact_gelu_takes_each_backends_fastest_form():
    """jax.nn.gelu and tf.nn.gelu write exact GELU through erfc, which XLA expands into a longer
    sequence of exponentials and selects: on both XLA backends the MLP hands XLA erf instead. On
    torch it is torch's own fused GELU kernel. Which form runs is read from the operations the
    call makes; the numbers are checked against exact GELU in float64."""
    mlp = layers.MlpBlock(8)
    mlp.build((None, 3, 4))
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32")
    backend = keras.backend.backend()
    if backend == "torch":
        operations = _torch_functions_called(mlp, x)
        assert "gelu" in operations and not {"erf", "erfc"} & operations, sorted(operations)
    elif backend == "jax":
        import jax  # pylint: disable=import-outside-toplevel
        operations = {str(equation.primitive) for equation in jax.make_jaxpr(mlp)(x).eqns}
        assert "erf" in operations and "erfc" not in operations, sorted(operations)
    else:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        graph = tf.function(mlp).get_concrete_function(tf.TensorSpec(x.shape, x.dtype)).graph
        operations = {operation.type.lower() for operation in graph.get_operations()}
        assert "erf" in operations and "erfc" not in operations, sorted(operations)
    weights = [keras.ops.convert_to_numpy(w).astype("float64") for w in
               (mlp.dense_0.kernel, mlp.dense_0.bias, mlp.dense_1.kernel, mlp.dense_1.bias)]
    hidden = x.astype("float64") @ weights[0] + weights[1]
    expected = (0.5 * hidden * (1 + scipy.special.erf(hidden / np.sqrt(2)))) @ weights[2] + weights[3]
    # Not bit equality: each backend's product (torch's F.linear adds the bias in the GEMM's
    # epilogue, Keras' Dense after it) rounds its float32 sums of 4 and 8 terms differently on
    # different CPUs' BLAS kernels, by a few ulps (1.3e-7 seen on an AMD EPYC). Exact GELU against
    # the tanh form would differ by up to 1e-3 here, far above this tolerance.
    np.testing.assert_allclose(keras.ops.convert_to_numpy(mlp(x)), expected, rtol=1e-5, atol=1e-6)


def _torch_functions_called(layer, x):
    """The names of the torch functions `layer(x)` calls (torch's `__torch_function__` hook)."""
    from torch.overrides import TorchFunctionMode  # pylint: disable=import-outside-toplevel

    class Recorder(TorchFunctionMode):
        names = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        layer(x)
    return recorder.names


def test_drop_path_drops_whole_residual_branches_per_example_only_in_training():
    block = layers.TransformerBlock(2, 16, drop_path_rate=0.5, seed=1)
    x = np.random.default_rng(4).normal(size=(64, 5, 8)).astype("float32")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(block(x)),
                                  keras.ops.convert_to_numpy(block(x, training=False)))
    branch = keras.ops.ones((64, 5, 8))
    dropped = keras.ops.convert_to_numpy(block._drop_path(branch, training=True))
    per_example = dropped.reshape(64, -1)
    # Each example keeps (scaled by 1 / keep) or drops its entire branch.
    assert set(np.unique(per_example)) <= {0.0, 2.0}
    assert np.all(per_example.min(1) == per_example.max(1))
    assert 0 < (per_example[:, 0] == 0).sum() < 64


def test_token_pooling_takes_class_token_or_mean():
    x = np.random.default_rng(5).normal(size=(2, 5, 3)).astype("float32")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(heads.TokenPooling("token")(x)), x[:, 0])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(heads.TokenPooling("gap")(x)),
                               x.mean(1), rtol=1e-6)
    with pytest.raises(ValueError, match="Unknown pooling mode 'max'"):
        heads.TokenPooling("max")


def test_public_layers_are_exported():
    for name in ("PatchEmbedding", "ClassToken", "AddPositionEmbs", "TransformerBlock"):
        assert getattr(vit_keras, name) is getattr(layers, name)
