"""Models of dynamic image size (`build_model(..., dynamic_image_size=True)`): timm's
`dynamic_img_size=True` model as the oracle, exactness at the built size, training, saving, and
attention scores. Their export is tested in test_export.py."""

import keras
import numpy as np
import pytest
from test_checkpoints import TINY, H, L, _randomize_torch, images, keras_logits, relative, torch_logits
from timm.models.vision_transformer import VisionTransformer
import torch
import torch.nn.functional as F

import vit_keras
from vit_keras.model import interpolation_ops
from vit_keras.model import layers as vit_layers
from vit_keras.weights import posemb

from conftest import NEXT_BACKEND, random_images, randomize_weights, run_on_backend

D = TINY["hidden_size"]
CLASSES = 5
BUILT = 16  # image side the tiny models are built for: a 4x4 patch grid
SIZES = [(24, 20), (12, 28)]  # two non-square sizes, one upsampling, one mixed


def dynamic_model(config=TINY, image_size=BUILT, **kwargs):
    return vit_keras.build_model(config, image_size=image_size, num_classes=CLASSES,
                                 dynamic_image_size=True, **kwargs)


@pytest.mark.parametrize("sizes", [(4, 4), (4, 6), (4, 9), (6, 4), (14, 3), (5, 1), (1, 3)])
def test_in_graph_weights_equal_pytorchs_antialiased_bicubic(sizes):
    in_size, out_size = sizes
    weights = keras.ops.convert_to_numpy(
        interpolation_ops.antialiased_bicubic_weights(in_size, out_size))
    # posemb's NumPy weights are held to torch in test_posemb; torch itself as well, here.
    reference = posemb._axis_weights(in_size, out_size, "bicubic", antialias=True)
    np.testing.assert_allclose(weights, reference, atol=1e-6)  # float32 against float64
    grid = np.random.default_rng(0).normal(size=(in_size, 5, 3)).astype("float32")
    resized = keras.ops.convert_to_numpy(
        interpolation_ops.resize_grid(keras.ops.convert_to_tensor(grid), (out_size, 5)))
    expected = F.interpolate(torch.from_numpy(grid).permute(2, 0, 1)[None], size=(out_size, 5),
                             mode="bicubic", align_corners=False, antialias=True)
    np.testing.assert_allclose(resized, expected[0].permute(1, 2, 0).numpy(), atol=1e-6)


def test_the_built_grid_gives_identity_weights_exactly():
    for size in (1, 4, 7, 24):
        weights = keras.ops.convert_to_numpy(
            interpolation_ops.antialiased_bicubic_weights(size, size))
        assert np.array_equal(weights, np.eye(size, dtype="float32"))


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_equals_the_fixed_size_model_exactly_at_the_built_size(classifier):
    dynamic = randomize_weights(dynamic_model(image_size=(16, 12), classifier=classifier))
    fixed = vit_keras.build_model(TINY, image_size=(16, 12), num_classes=CLASSES,
                                  classifier=classifier)
    fixed.set_weights(dynamic.get_weights())
    assert [w.shape for w in fixed.weights] == [w.shape for w in dynamic.weights]
    x = random_images(2, 16, 12)
    assert np.array_equal(keras_logits(dynamic, x), keras_logits(fixed, x))
    # The embeddings themselves, also on the path that resamples (a size known only at run time).
    layer = dynamic.get_layer("posembed_input")
    same = layer.resampled((keras.ops.convert_to_tensor(4), keras.ops.convert_to_tensor(3)))
    assert np.array_equal(keras.ops.convert_to_numpy(same),
                          keras.ops.convert_to_numpy(layer.pos_embedding))


@pytest.fixture(scope="module")
def timm_dynamic(tmp_path_factory):
    """timm's `dynamic_img_size=True` ViT with random weights, saved as a timm state dict."""
    reference = _randomize_torch(VisionTransformer(
        img_size=BUILT, patch_size=TINY["patch_size"], embed_dim=D, depth=L, num_heads=H,
        mlp_ratio=TINY["mlp_dim"] / D, num_classes=CLASSES, dynamic_img_size=True))
    path = tmp_path_factory.mktemp("timm") / "dynamic.pth"
    torch.save(reference.state_dict(), path)
    return reference, str(path)


@pytest.mark.parametrize("size", [(BUILT, BUILT), *SIZES])
def test_matches_timm_dynamic_img_size_on_the_same_weights(timm_dynamic, size):
    reference, path = timm_dynamic
    model = vit_keras.build_model_from_checkpoint(path, num_heads=H, include_preprocessing=False,
                                                  dynamic_image_size=True)
    assert tuple(model.input.shape) == (None, None, None, 3)
    x = images(*size)
    error = relative(keras_logits(model, x), torch_logits(reference, x))
    print(f"dynamic size {size} vs timm, {keras.backend.backend()}: relative error {error:.2g}")
    assert error < 1e-4


def test_one_model_takes_several_sizes_in_one_process():
    model = randomize_weights(dynamic_model())
    for size in [(16, 16), *SIZES, (4, 4), (16, 16)]:
        logits = keras_logits(model, random_images(2, *size))
        assert logits.shape == (2, CLASSES) and np.all(np.isfinite(logits))


@pytest.mark.slow  # over 5 s alone: out of make test-fast
def test_a_hybrid_takes_other_sizes_and_gives_attention_scores(tiny_config):
    hybrid = dict(tiny_config, patch_size=1, resnet_layers=(1,), resnet_width=1)
    model = randomize_weights(dynamic_model(hybrid, image_size=32), scale=0.05)
    assert model.get_layer("posembed_input").grid_size == (8, 8)
    scores = vit_keras.attention_scores(model, random_images(2, 24, 40))
    assert len(scores) == tiny_config["num_layers"]
    assert scores[0].shape == (2, tiny_config["num_heads"], 1 + 6 * 10, 1 + 6 * 10)
    np.testing.assert_allclose(scores[-1].sum(-1), 1.0, rtol=1e-5)


def test_attention_scores_at_another_size_are_the_probabilities_of_that_size():
    model = randomize_weights(dynamic_model())
    x = random_images(2, 12, 20)
    scores = vit_keras.attention_scores(model, x)
    assert scores[0].shape == (2, H, 1 + 3 * 5, 1 + 3 * 5)
    # Recomputed from the first block's input: tokens plus the embeddings resampled to 3x5.
    stem = keras.Model(model.input, model.get_layer("cls").output)
    tokens = keras.ops.convert_to_numpy(stem(x))
    embeddings = posemb.resample_position_embeddings(
        keras.ops.convert_to_numpy(model.get_layer("posembed_input").pos_embedding), (3, 5),
        interpolation="bicubic", antialias=True)
    block = model.get_layer("encoderblock_0")
    _, expected = block(keras.ops.convert_to_tensor(tokens + embeddings),
                        return_attention_scores=True)
    np.testing.assert_allclose(scores[0], keras.ops.convert_to_numpy(expected), atol=2e-6)


def test_trains_on_another_size_and_the_embeddings_learn():
    model = dynamic_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    before = keras.ops.convert_to_numpy(model.get_layer("posembed_input").pos_embedding)
    rng = np.random.default_rng(0)
    x = random_images(8, 24, 20)
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, 8)]
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][-1] < history.history["loss"][0]
    after = keras.ops.convert_to_numpy(model.get_layer("posembed_input").pos_embedding)
    assert not np.allclose(before, after)


_LOAD_AT_SIZES = """
import keras, numpy as np
import vit_keras
model = keras.models.load_model(ARGS["path"])
assert tuple(model.input.shape) == (None, None, None, 3), model.input.shape
out = {}
for name in ARGS["images"]:
    out[name] = model.predict(np.load(ARGS["images"][name]), verbose=0).tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_saved_here_loads_on_the_next_backend_and_runs_at_several_sizes(tmp_path):
    model = randomize_weights(dynamic_model(), scale=0.2)
    path = str(tmp_path / "dynamic.keras")
    model.save(path)
    inputs, expected = {}, {}
    for size in [(BUILT, BUILT), *SIZES]:
        name = f"{size[0]}x{size[1]}"
        x = random_images(3, *size, seed=size[0])
        np.save(tmp_path / f"{name}.npy", x)
        inputs[name] = str(tmp_path / f"{name}.npy")
        expected[name] = model.predict(x, verbose=0)
    logits = run_on_backend(NEXT_BACKEND, _LOAD_AT_SIZES, path=path, images=inputs)
    for name in inputs:
        np.testing.assert_allclose(np.array(logits[name]), expected[name], rtol=1e-5, atol=1e-5)
    assert max(np.abs(v).max() for v in expected.values()) > 0.1


def test_an_image_not_divisible_by_the_patch_size_is_refused():
    model = dynamic_model()
    with pytest.raises(ValueError, match="Image height 18 is not divisible by patch size 4"):
        model(random_images(1, 18, 16))


def test_resampling_layer_config_round_trip():
    layer = vit_layers.AddPositionEmbs(grid_size=(2, 3), num_prefix_tokens=1)
    tokens = np.random.default_rng(0).normal(size=(2, 1 + 4 * 5, 8)).astype("float32")
    grid = np.zeros((2, 4, 5, 8), "float32")
    expected = keras.ops.convert_to_numpy(layer(tokens, grid))
    clone = vit_layers.AddPositionEmbs.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    clone.build((None, None, 8))
    clone.set_weights(layer.get_weights())
    assert layer.pos_embedding.shape == (1, 7, 8)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(clone(tokens, grid)), expected)


def test_patch_grid_is_the_flat_patches_laid_out_row_major():
    flat = vit_layers.PatchEmbedding(4, 8)
    x = random_images(2, 12, 20)
    grid = vit_layers.PatchEmbedding(4, 8, flatten=False)
    grid.build(x.shape)
    flat.build(x.shape)
    grid.set_weights(flat.get_weights())
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(grid(x)).reshape(2, 15, 8), keras.ops.convert_to_numpy(flat(x)))


def test_resampling_layer_called_without_the_patch_grid_says_how_to_call_it():
    layer = vit_layers.AddPositionEmbs(grid_size=(2, 2))
    layer.build((None, None, 8))
    with pytest.raises(ValueError, match=r"layer\(tokens, patch_grid\)"):
        layer(keras.ops.zeros((1, 5, 8)))


def test_fixed_size_model_at_another_size_points_to_dynamic_image_size():
    model = vit_keras.build_model(TINY, image_size=BUILT, num_classes=CLASSES)
    with pytest.raises(ValueError, match="dynamic_image_size=True"):
        model.get_layer("posembed_input")(keras.ops.zeros((1, 10, D)))


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_features_of_another_size_are_laid_out_on_that_sizes_grid(classifier):
    model = randomize_weights(dynamic_model(classifier=classifier))
    x = random_images(2, 12, 20)
    tokens, grid = (vit_keras.intermediate_features(model, x, blocks=[-1], output=output)
                    for output in ("tokens", "grid"))
    prefix = int(classifier == "token")
    assert tokens.shape == (2, prefix + 3 * 5, D) and grid.shape == (2, 3, 5, D)
    np.testing.assert_array_equal(grid.reshape(2, 15, D), tokens[:, prefix:])



def test_grid_feature_extractor_saves_reloads_and_serves_another_size(tmp_path):
    model = randomize_weights(dynamic_model())
    extractor = vit_keras.build_feature_extractor(model, blocks=[-1], output="grid")
    assert tuple(extractor.output.shape) == (None, None, None, D)
    extractor.save(tmp_path / "grid.keras")
    reloaded = keras.models.load_model(tmp_path / "grid.keras")
    x = random_images(2, 20, 8)
    np.testing.assert_allclose(keras_logits(reloaded, x), keras_logits(extractor, x), atol=1e-6)
    assert keras_logits(reloaded, x).shape == (2, 5, 2, D)


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_a_trained_fixed_size_model_becomes_dynamic_with_the_same_weights(classifier, tmp_path):
    fixed = randomize_weights(vit_keras.build_model(
        TINY, image_size=(16, 12), num_classes=CLASSES, classifier=classifier,
        representation_size=8))
    fixed.save(tmp_path / "fixed.keras")
    dynamic = vit_keras.with_dynamic_image_size(keras.models.load_model(tmp_path / "fixed.keras"))
    built = randomize_weights(vit_keras.build_model(
        TINY, image_size=(16, 12), num_classes=CLASSES, classifier=classifier,
        representation_size=8, dynamic_image_size=True))
    assert [layer.name for layer in dynamic.layers] == [layer.name for layer in built.layers]
    assert dynamic.get_layer("posembed_input").get_config() == \
        built.get_layer("posembed_input").get_config()
    x = random_images(2, 16, 12)
    assert np.array_equal(keras_logits(dynamic, x), keras_logits(fixed, x))
    built.set_weights(dynamic.get_weights())
    y = random_images(2, 20, 24)
    np.testing.assert_array_equal(keras_logits(dynamic, y), keras_logits(built, y))
    assert vit_keras.with_dynamic_image_size(dynamic) is dynamic


def test_a_fixed_size_hybrid_becomes_dynamic(tiny_config):
    hybrid = dict(tiny_config, patch_size=1, resnet_layers=(1,), resnet_width=1)
    fixed = randomize_weights(vit_keras.build_model(hybrid, image_size=32, num_classes=CLASSES),
                              scale=0.05)
    dynamic = vit_keras.with_dynamic_image_size(fixed)
    x = random_images(2, 32, 32)
    assert np.array_equal(keras_logits(dynamic, x), keras_logits(fixed, x))
    assert keras_logits(dynamic, random_images(1, 24, 48)).shape == (1, CLASSES)


def test_token_grid_and_token_pixels_of_a_dynamic_model_are_the_built_ones():
    model = dynamic_model(image_size=(16, 12))
    assert vit_keras.token_grid(model) == (4, 3)
    assert vit_keras.token_size_pixels(model) == (4.0, 4.0)


def test_mixed_precision_resamples_in_float32_and_stays_close_to_float32():
    model = randomize_weights(dynamic_model(), scale=0.3)
    x = random_images(2, 24, 20)
    expected = keras_logits(model, x)
    keras.config.set_dtype_policy("mixed_bfloat16")
    mixed = dynamic_model()
    keras.config.set_dtype_policy("float32")
    mixed.set_weights(model.get_weights())
    layer = mixed.get_layer("posembed_input")
    assert keras.backend.standardize_dtype(layer.resampled((6, 5)).dtype) == "float32"
    logits = keras_logits(mixed, x)
    assert logits.dtype == np.float32
    assert relative(logits, expected) < 0.05  # bfloat16 activations: about 3 significant digits
