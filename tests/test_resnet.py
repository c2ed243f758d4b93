"""The hybrids' BiT ResNet: weight standardisation, TF/Flax SAME padding, stage shapes, counts."""

import jax
import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.model import resnet

from conftest import random_images, randomize_weights

# vit_jax models_test.py, 1000 classes, 224 px.
HYBRID_PARAMETER_COUNTS = {
    "R50+ViT-B/16": 98_659_112,
    "R26+ViT-S/32": 36_431_912,
    "R26+ViT-B/32": 101_383_976,
    "R50+ViT-L/32": 328_994_856,
    "R+ViT-Ti/16": 6_337_704,
}


def _lax_conv_same(x, kernel, stride):
    """Flax's nn.Conv(padding="SAME"): the TF/Flax oracle for padding."""
    return np.asarray(jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))


def test_hybrids_are_in_the_variant_table():
    assert set(HYBRID_PARAMETER_COUNTS) <= set(vit_keras.VARIANTS)
    assert vit_keras.VARIANTS["R50+ViT-B/16"].resnet_layers == (3, 4, 9)


@pytest.mark.backend_independent
@pytest.mark.parametrize("variant", list(HYBRID_PARAMETER_COUNTS))
def test_hybrid_parameter_count_equals_vit_jax(variant):
    # Built inside a StatelessScope: Keras defers the weights' initialisation (no memory, seconds).
    with keras.StatelessScope():
        model = vit_keras.build_model(variant)
    assert model.count_params() == HYBRID_PARAMETER_COUNTS[variant]


def test_allocated_hybrid_parameter_count_equals_vit_jax():
    assert (vit_keras.build_model("R+ViT-Ti/16").count_params()
            == HYBRID_PARAMETER_COUNTS["R+ViT-Ti/16"])


@pytest.mark.parametrize("inside_sqrt,epsilon", [(False, 1e-5), (True, 1e-8)])
def test_weight_standardisation_per_output_channel_without_rewriting_the_kernel(inside_sqrt,
                                                                                  epsilon):
    layer = resnet.StdConv2D(4, 3, standardization_epsilon=epsilon,
                             epsilon_inside_sqrt=inside_sqrt)
    layer.build((None, 8, 8, 5))
    stored = np.random.default_rng(0).normal(2.0, 3.0, (3, 3, 5, 4)).astype("float32")
    layer.kernel.assign(stored)
    w = stored.astype("float64")
    mean, var = w.mean((0, 1, 2)), w.var((0, 1, 2))
    expected = (w - mean) / (np.sqrt(var + epsilon) if inside_sqrt else np.sqrt(var) + epsilon)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer.standardized_kernel()), expected,
                               rtol=1e-5, atol=1e-6)
    x = np.random.default_rng(1).normal(size=(2, 8, 8, 5)).astype("float32")
    layer(x)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer.kernel), stored)


@pytest.mark.parametrize("size,kernel_size,stride", [(15, 7, 2), (16, 7, 2), (9, 3, 2), (8, 1, 2),
                                                     (7, 3, 1)])
def test_std_conv_same_padding_equals_tf_and_flax(size, kernel_size, stride):
    layer = resnet.StdConv2D(6, kernel_size, stride)
    x = np.random.default_rng(2).normal(size=(2, size, size + 1, 3)).astype("float32")
    y = keras.ops.convert_to_numpy(layer(x))
    expected = _lax_conv_same(x, keras.ops.convert_to_numpy(layer.standardized_kernel()), stride)
    assert y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", [15, 16])
def test_root_max_pool_is_tf_same_padded(size):
    stem = resnet.ResNetStem((), group_norm_epsilon=1e-6)
    x = np.random.default_rng(3).normal(size=(1, size, size, 3)).astype("float32")
    stem.build(x.shape)
    randomize_weights(stem, scale=0.5)
    activated = keras.ops.convert_to_numpy(
        keras.ops.relu(stem.gn_root(stem.conv_root(x))))
    expected = np.asarray(jax.lax.reduce_window(
        activated, -np.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(stem(x)), expected, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.slow  # over 5 s alone: out of make test-fast
def test_r50_stages_output_stride_4_8_16():
    stem = resnet.ResNetStem((3, 4, 9))
    x = random_images(1, 64, 96) / 255.0
    stem.build(x.shape)
    shapes = [tuple(stem.root(x).shape)]
    y = stem.root(x)
    for stage in stem.stages:
        y = stage(y)
        shapes.append(tuple(y.shape))
    assert shapes == [(1, 16, 24, 64), (1, 16, 24, 256), (1, 8, 12, 512), (1, 4, 6, 1024)]


def test_group_norm_has_32_groups_and_unit_residual_branch_starts_at_zero():
    unit = resnet.ResidualUnit(32, strides=1)
    unit.build((None, 8, 8, 128))
    assert unit.gn1.groups == 32 and unit.gn1.epsilon == 1e-6
    assert unit.conv_proj is None  # 128 == 4 * 32 channels and stride 1: identity shortcut
    x = np.abs(np.random.default_rng(4).normal(size=(1, 8, 8, 128))).astype("float32")
    # gn3's scale starts at zero, so a fresh unit is relu(identity).
    np.testing.assert_allclose(keras.ops.convert_to_numpy(unit(x)), x, rtol=1e-6)
    projecting = resnet.ResidualUnit(32, strides=2)
    projecting.build((None, 8, 8, 64))
    assert projecting.conv_proj.kernel.shape == (1, 1, 64, 128)


@pytest.mark.parametrize("layer", [
    resnet.StdConv2D(8, 3, 2, standardization_epsilon=1e-8, epsilon_inside_sqrt=True),
    resnet.ResidualUnit(32, strides=2, group_norm_epsilon=1e-5),
    resnet.ResNetStage(2, 32, first_stride=2),
    resnet.ResNetStem((1, 1), width_factor=1),
], ids=lambda layer: type(layer).__name__)
def test_resnet_layer_config_round_trip(layer):
    x = np.random.default_rng(5).normal(size=(1, 16, 16, 64)).astype("float32")
    expected = keras.ops.convert_to_numpy(layer(x))
    clone = type(layer).from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    clone.build(x.shape)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(keras.ops.convert_to_numpy(clone(x)), expected, rtol=1e-5, atol=1e-5)


def test_hybrid_weight_paths_follow_the_checkpoint_names():
    model = vit_keras.build_model("R+ViT-Ti/16", image_size=64, num_classes=3)
    paths = [w.path for w in model.weights]
    assert paths[:3] == ["resnet/conv_root/kernel", "resnet/gn_root/gamma", "resnet/gn_root/beta"]
    assert model.get_layer("embedding").kernel.shape == (8, 8, 64, 192)
    r50 = resnet.ResNetStem((3, 4, 9), name="resnet")
    r50.build((None, 32, 32, 3))
    assert "resnet/block3/unit9/conv3/kernel" in [w.path for w in r50.weights]


def test_hybrid_image_size_must_give_a_feature_map_divisible_by_the_patch():
    with pytest.raises(ValueError, match=r"Image height 40 \(a feature map of 10\) is not "
                                         r"divisible by patch size 8 of R\+ViT-Ti/16"):
        vit_keras.build_model("R+ViT-Ti/16", image_size=(40, 64))


def test_a_hybrid_runs_predict_and_fit_under_its_default_name():
    # TensorFlow refuses "+" in the name scopes predict and fit open: the default name avoids it.
    model = vit_keras.build_model("R+ViT-Ti/16", image_size=32, num_classes=3)
    assert model.name == "R_ViT-Ti_16"
    images = np.random.default_rng(0).uniform(0, 255, (2, 32, 32, 3)).astype("float32")
    assert model.predict(images, verbose=0).shape == (2, 3)
    model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    model.fit(images, np.eye(3, dtype="float32")[[0, 1]], epochs=1, verbose=0)
