"""`build_feature_extractor` and `intermediate_features`: the blocks' activations against a
block-by-block re-run of the model, the pooled features against the head's input, the grid layout,
hybrids, saving, training and the errors."""

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.inspection import features
from vit_keras.model import transformer_blocks

from conftest import random_images, randomize_weights, tiny_model

# float32 on CPU; the extractor and the reference run the same layers, possibly compiled apart.
ATOL = 1e-5


def reference_tokens(model, images, norm):
    """Every block's output, running the blocks one by one as `attention_scores` does."""
    blocks = transformer_blocks(model)
    x = keras.Model(model.input, blocks[0].input)(images, training=False)
    outputs = []
    for block in blocks:
        x = block(x, training=False)
        outputs.append(model.get_layer("encoder_norm")(x) if norm else x)
    return [keras.ops.convert_to_numpy(output) for output in outputs]


def tiny_hybrid(tiny_config):
    """A ResNet root (stride 4) and 2x2 patches: 32x48 images give a 4x6 token grid."""
    config = {**tiny_config, "name": "R+tiny", "patch_size": 2, "resnet_layers": ()}
    return vit_keras.build_model(config, image_size=(32, 48), num_classes=3)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("block", [0, -1])
def test_tokens_of_a_block_equal_running_the_blocks_one_by_one(tiny_config, block, norm):
    model = randomize_weights(tiny_model(tiny_config))
    images = random_images(3, 8, 8)
    extracted = vit_keras.intermediate_features(model, images, blocks=[block], norm=norm,
                                                batch_size=2)
    expected = reference_tokens(model, images, norm)[block]
    assert extracted.shape == (3, 2 * 2 + 1, 32)
    np.testing.assert_allclose(extracted, expected, atol=ATOL)


def test_all_blocks_by_default_in_order(tiny_config):
    model = randomize_weights(tiny_model(tiny_config))
    images = random_images(2, 8, 8)
    extracted = vit_keras.intermediate_features(model, images, norm=False)
    assert isinstance(extracted, list) and len(extracted) == 2
    for got, expected in zip(extracted, reference_tokens(model, images, norm=False)):
        np.testing.assert_allclose(got, expected, atol=ATOL)


def test_an_int_asks_for_the_last_blocks_and_a_list_keeps_its_order(tiny_config):
    model = tiny_model({**tiny_config, "num_layers": 4})
    last_two = vit_keras.build_feature_extractor(model, blocks=2)
    assert last_two.output_names == ["tokens_2", "tokens_3"]
    chosen = vit_keras.build_feature_extractor(model, blocks=[-1, 0], output="pooled")
    assert chosen.output_names == ["pooled_3", "pooled_0"]
    one = vit_keras.build_feature_extractor(model, blocks=1, output="grid")
    assert not isinstance(one.output, (list, tuple)) and one.output.shape == (None, 2, 2, 32)


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_pooled_last_block_with_norm_is_the_heads_input(tiny_config, classifier):
    model = randomize_weights(vit_keras.build_model(tiny_config, image_size=8, num_classes=3,
                                                    classifier=classifier))
    images = random_images(3, 8, 8)
    pooled = vit_keras.intermediate_features(model, images, blocks=[-1], output="pooled")
    head_input = keras.Model(model.input, model.get_layer("head").input).predict_on_batch(images)
    assert pooled.shape == (3, 32)
    np.testing.assert_allclose(pooled, head_input, atol=ATOL)


def test_grid_of_a_gap_model_keeps_every_token(tiny_config):
    model = randomize_weights(vit_keras.build_model(tiny_config, image_size=8, num_classes=3,
                                                    classifier="gap"))
    images = random_images(2, 8, 8)
    tokens, grid = (vit_keras.intermediate_features(model, images, blocks=[0], output=output)
                    for output in ("tokens", "grid"))
    assert tokens.shape == (2, 4, 32) and grid.shape == (2, 2, 2, 32)
    np.testing.assert_array_equal(grid, tokens.reshape(2, 2, 2, 32))


def test_grid_of_a_rectangular_image_is_the_patch_tokens_row_major(tiny_config):
    model = randomize_weights(vit_keras.build_model(tiny_config, image_size=(32, 48),
                                                    num_classes=3))
    images = random_images(2, 32, 48)
    tokens, grid = (vit_keras.intermediate_features(model, images, blocks=[-1], output=output)
                    for output in ("tokens", "grid"))
    assert tokens.shape == (2, 1 + 8 * 12, 32) and grid.shape == (2, 8, 12, 32)
    np.testing.assert_array_equal(grid, tokens[:, 1:].reshape(2, 8, 12, 32))


def test_a_hybrid_gives_the_feature_map_grid(tiny_config):
    model = randomize_weights(tiny_hybrid(tiny_config))
    assert vit_keras.token_grid(model) == (4, 6)
    images = random_images(2, 32, 48)
    grid = vit_keras.intermediate_features(model, images, blocks=[-1], output="grid", norm=False)
    assert grid.shape == (2, 4, 6, 32)
    expected = reference_tokens(model, images, norm=False)[-1]
    np.testing.assert_allclose(grid, expected[:, 1:].reshape(2, 4, 6, 32), atol=ATOL)


def test_the_extractor_shares_the_models_weights(tiny_config):
    model = tiny_model(tiny_config)
    extractor = vit_keras.build_feature_extractor(model, output="pooled")
    # Everything up to the last block plus encoder_norm: only the head is left out.
    shared = {id(weight) for weight in model.weights}
    assert extractor.weights and all(id(weight) in shared for weight in extractor.weights)
    assert len(extractor.weights) == len(model.weights) - 2


def test_the_extractor_saves_and_reloads(tiny_config, tmp_path):
    model = randomize_weights(tiny_hybrid(tiny_config))
    extractor = vit_keras.build_feature_extractor(model, blocks=[0, -1], output="grid")
    extractor.save(tmp_path / "features.keras")
    reloaded = keras.models.load_model(tmp_path / "features.keras")
    images = random_images(2, 32, 48)
    for got, expected in zip(reloaded.predict_on_batch(images), extractor.predict_on_batch(images)):
        np.testing.assert_array_equal(got, expected)


def test_training_on_the_pooled_features_trains_the_model(tiny_config):
    model = randomize_weights(tiny_model(tiny_config))
    extractor = vit_keras.build_feature_extractor(model, blocks=[-1], output="pooled")
    probe = keras.Model(extractor.input, keras.layers.Dense(3, name="probe")(extractor.output))
    probe.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    kernel = model.get_layer("encoderblock_0").mlp.dense_0.kernel
    before = keras.ops.convert_to_numpy(kernel).copy()
    images = random_images(4, 8, 8)
    probe.fit(images, np.eye(3, dtype="float32")[[0, 1, 2, 0]], batch_size=4, epochs=1, verbose=0)
    assert not np.allclose(keras.ops.convert_to_numpy(kernel), before)


@pytest.mark.parametrize("blocks", [[2], [-3], [0, 5], 3, 0, -1])
def test_blocks_out_of_range_are_refused_naming_the_valid_range(tiny_config, blocks):
    model = tiny_model(tiny_config)
    expected = "-2 to 1" if isinstance(blocks, list) else "from 1 to 2"
    with pytest.raises(ValueError, match=expected):
        vit_keras.build_feature_extractor(model, blocks=blocks)


def test_a_block_named_twice_is_refused(tiny_config):
    with pytest.raises(ValueError, match=r"block\(s\) \[1\] more than once"):
        vit_keras.build_feature_extractor(tiny_model(tiny_config), blocks=[1, -1])


def test_an_unknown_output_is_refused_naming_the_choices(tiny_config):
    with pytest.raises(ValueError, match=r"'cls'.*\('tokens', 'grid', 'pooled'\)"):
        vit_keras.build_feature_extractor(tiny_model(tiny_config), output="cls")


def test_tokens_to_grid_rebuilds_from_its_config_and_checks_the_token_count():
    layer = features.TokensToGrid((2, 3), num_prefix_tokens=1, name="grid")
    rebuilt = features.TokensToGrid.from_config(layer.get_config())
    assert rebuilt.get_config() == layer.get_config()
    x = keras.ops.reshape(keras.ops.arange(2 * 7 * 4, dtype="float32"), (2, 7, 4))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(rebuilt(x)),
                                  keras.ops.convert_to_numpy(x)[:, 1:].reshape(2, 2, 3, 4))
    with pytest.raises(ValueError, match=r"\(batch, 7, hidden\).*got shape \(2, 8, 4\)"):
        features.TokensToGrid((2, 3), num_prefix_tokens=1)(keras.ops.zeros((2, 8, 4)))


def test_under_mixed_precision_normed_features_stay_float32(tiny_config):
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = tiny_model(tiny_config)
    normed = vit_keras.build_feature_extractor(model, blocks=[0], output="grid")
    raw = vit_keras.build_feature_extractor(model, blocks=[0], output="grid", norm=False)
    # encoder_norm runs in float32 under mixed precision, as in the model; the blocks in bfloat16.
    assert normed.output.dtype == "float32" and raw.output.dtype == "bfloat16"
    assert normed.predict_on_batch(random_images(1, 8, 8)).dtype == np.float32
