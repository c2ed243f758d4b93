"""Every feature of the model with the ViT family's switches (issue 34): pooled features against
timm's pre-logits, few-shot features, attention scores and rollout with registers, distillation
and MAP, position embeddings resampled at another size against timm's own resampling, mixed
precision, int8 quantization and LoRA with the MAP head and LayerScale, and the class names of a
backbone release.

The timm models are those of tests/test_family_timm.py (small, every parameter random); the
tolerance is its relative error of 1e-4 unless a test says otherwise.
"""

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.inspection import analysis
from vit_keras.training import fewshot
from vit_keras.weights import labels

from conftest import randomize_weights
import test_family_timm as timm_family
from test_family_timm import FAMILIES, RTOL, relative_error

torch = pytest.importorskip("torch")
timm = pytest.importorskip("timm")

# What comes before the patch tokens in each family's model, in the encoder's order.
PREFIX_TOKENS = {
    "deit_tiny_distilled_patch16_224": ["class", "distillation"],
    "deit3_small_patch16_224": ["class"],
    "vit_small_patch14_dinov2": ["class"],
    "vit_small_patch14_reg4_dinov2": ["class"] + ["register"] * 4,
    "vit_base_patch16_siglip_224": [],
    "vit_base_patch16_clip_quickgelu_224": ["class"],
    "vit_base_patch16_clip_224": ["class"],
    "vit_base_patch16_224.mae": ["class"],
}


def timm_pre_logits_of_block(model, images, index):
    """timm's pre-logits computed on block `index`'s tokens instead of the last block's:
    `forward_head(norm(tokens), pre_logits=True)` (`norm` is an identity with fc_norm)."""
    with torch.no_grad():
        x = model.patch_embed(torch.from_numpy(images.transpose(0, 3, 1, 2)))
        x = model.norm_pre(model._pos_embed(x))  # pylint: disable=protected-access
        for block in model.blocks[:index % len(model.blocks) + 1]:
            x = block(x)
        return model.forward_head(model.norm(x), pre_logits=True).numpy()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(architecture, timm model, images, timm's outputs, the loaded vit_keras classifier)."""
    architecture = request.param
    overrides, _ = FAMILIES[architecture]
    model = timm_family.randomised_timm_model(architecture, overrides)
    path = tmp_path_factory.mktemp("timm") / f"{architecture}.pth"
    torch.save(model.state_dict(), path)
    images = timm_family.images_for((overrides["img_size"],) * 2)
    expected = timm_family.timm_outputs(model, images)
    return architecture, model, images, expected, timm_family.load(str(path), architecture)


def test_pooled_features_are_timms_pre_logits(family):
    # DINOv2/CLIP: the normed class token; SigLIP: the MAP head's output; MAE: fc_norm of the
    # patches' mean; DeiT distilled: the mean of the class and distillation tokens.
    _, _, images, expected, model = family
    pooled = vit_keras.build_feature_extractor(model, [-1], output="pooled")(images)
    assert relative_error(pooled, expected["pooled"]) <= RTOL


def test_pooled_features_of_an_earlier_block_are_pooled_as_the_last(family):
    _, timm_model, images, _, model = family
    first, last = vit_keras.build_feature_extractor(model, [0, -1], output="pooled")(images)
    assert relative_error(first, timm_pre_logits_of_block(timm_model, images, 0)) <= RTOL
    assert relative_error(last, timm_pre_logits_of_block(timm_model, images, -1)) <= RTOL


def test_few_shot_features_of_a_family_classifier_are_timms_pre_logits(family):
    _, _, images, expected, model = family
    features = fewshot.extract_features(model, images)
    assert features.shape == expected["pooled"].shape
    assert relative_error(features, expected["pooled"]) <= RTOL


def test_attention_scores_cover_every_prefix_token_and_the_grid(family):
    architecture, _, images, _, model = family
    prefix = analysis.prefix_tokens(model)
    assert prefix == PREFIX_TOKENS[architecture]
    rows, cols = analysis.token_grid(model)  # DeiT's two position-embedded prefix tokens too
    scores = vit_keras.attention_scores(model, images)
    tokens = len(prefix) + rows * cols  # 2 images, 2 heads, 2 blocks
    assert [s.shape for s in scores] == [(2, 2, tokens, tokens)] * 2
    rollout = analysis.attention_rollout(scores, (rows, cols), class_token="class" in prefix)
    assert rollout.shape == (2, rows, cols) and np.all(rollout > 0)
    assert np.all(rollout.sum(axis=(1, 2)) <= 1 + 1e-6)


# --- attention rollout with registers, in NumPy -----------------------------------------------------

def _attention(rows):
    """One layer, one image, one head: `(1, 1, tokens, tokens)` from a list of rows."""
    return [np.asarray(rows, dtype=np.float64)[None, None]]


def test_rollout_reads_the_class_token_and_leaves_out_registers():
    # Tokens [cls, reg, reg, p0, p1, p2, p3]: the class token draws on p2 and on a register.
    rows = np.eye(7)
    rows[0] = [0, 0.5, 0, 0, 0, 0.5, 0]
    rollout = analysis.attention_rollout(_attention(rows), (2, 2))
    # (A + I) / 2, row 0: 0.5 on itself, 0.25 on the register, 0.25 on p2 = cell (1, 0).
    np.testing.assert_allclose(rollout[0], [[0, 0], [0.25, 0]])


def test_rollout_without_a_class_token_averages_over_the_patches_not_the_registers():
    # Tokens [reg, reg, p0, p1, p2, p3]: registers look at p0 only, patches at themselves.
    rows = np.eye(6)
    rows[:2] = [0, 0, 1, 0, 0, 0]
    rollout = analysis.attention_rollout(_attention(rows), (2, 2), class_token=False)
    # Each patch query keeps its own token: (1 + 1) / 2 / 4 patches on every cell.
    np.testing.assert_allclose(rollout[0], np.full((2, 2), 0.25))


def test_rollout_refuses_a_class_token_that_is_not_there():
    with pytest.raises(ValueError, match="no prefix token to be the class token"):
        analysis.attention_rollout(_attention(np.eye(4)), (2, 2), class_token=True)


def test_registers_and_an_uncovered_class_token_take_no_position_embedding():
    model = vit_keras.build_model(
        {"name": "reg", "patch_size": 8, "hidden_size": 16, "mlp_dim": 32, "num_heads": 2,
         "num_layers": 1, "num_registers": 2, "posemb_prefix": False},
        image_size=16, include_preprocessing=False)
    assert analysis.prefix_tokens(model) == ["class", "register", "register"]
    assert analysis.token_grid(model) == (2, 2)
    # 4 patches: neither the registers nor the class token (posemb_prefix=False) take one.
    assert analysis.position_embedding(model).shape == (4, 16)


# --- position embeddings resampled at another size --------------------------------------------------

@pytest.mark.parametrize("architecture, size", [
    ("deit_tiny_distilled_patch16_224", 48),  # class and distillation tokens take one each
    ("deit3_small_patch16_224", 24),  # posemb_prefix=False; downsampled (antialiasing matters)
    ("vit_small_patch14_dinov2", 42),
    ("vit_small_patch14_reg4_dinov2", (42, 56)),  # registers take none; a rectangular grid
])
def test_loading_at_another_size_resamples_as_timms_checkpoint_filter(architecture, size,
                                                                      tmp_path):
    # timm's own path to another size: create_model(img_size=...) + checkpoint_filter_fn, which
    # resamples bicubic with antialiasing, the prefix rows (if any) kept; vit_keras's timm loader
    # defaults to the same interpolation.
    from timm.models.vision_transformer import checkpoint_filter_fn  # pylint: disable=import-outside-toplevel

    overrides, _ = FAMILIES[architecture]
    state = timm_family.randomised_timm_model(architecture, overrides).state_dict()
    path = tmp_path / f"{architecture}.pth"
    torch.save(state, path)
    resized = timm_family.randomised_timm_model(architecture, {**overrides, "img_size": size},
                                                seed=1)
    resized.load_state_dict(checkpoint_filter_fn(state, resized))
    images = timm_family.images_for(size if isinstance(size, tuple) else (size, size), seed=2)
    expected = timm_family.timm_outputs(resized, images)["logits"]
    model = timm_family.load(str(path), architecture, image_size=size)
    assert relative_error(model(images), expected) <= RTOL


# --- mixed precision, int8 and LoRA with the MAP head and LayerScale ------------------------------

MAP_CONFIG = {"name": "map-ls", "patch_size": 8, "hidden_size": 32, "mlp_dim": 64,
              "num_heads": 2, "num_layers": 2, "layer_scale_init": 0.5, "num_registers": 2,
              "posemb_prefix": False}
DISTILLED_CONFIG = {"name": "deit-ls", "patch_size": 8, "hidden_size": 32, "mlp_dim": 64,
                    "num_heads": 2, "num_layers": 2, "layer_scale_init": 0.5,
                    "distillation": True}
FAMILY_CONFIGS = {"map": (MAP_CONFIG, "map"), "distilled": (DISTILLED_CONFIG, "token")}


def _family_model(name, seed=0):
    config, classifier = FAMILY_CONFIGS[name]
    model = vit_keras.build_model(config, image_size=16, num_classes=5, classifier=classifier)
    return randomize_weights(model, seed=seed, scale=0.3)


def _images(seed=0):
    return np.random.default_rng(seed).uniform(0, 255, (4, 16, 16, 3)).astype("float32")


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_mixed_bfloat16_computes_what_float32_does(name):
    float_model = _family_model(name)
    keras.config.set_dtype_policy("mixed_bfloat16")  # conftest restores float32 afterwards
    config, classifier = FAMILY_CONFIGS[name]
    mixed = vit_keras.build_model(config, image_size=16, num_classes=5, classifier=classifier)
    keras.config.set_dtype_policy("float32")
    mixed.set_weights(float_model.get_weights())
    assert mixed.get_layer("encoderblock_0").compute_dtype == "bfloat16"
    images = _images()
    for extract in (lambda m: m, lambda m: vit_keras.build_feature_extractor(m, output="pooled",
                                                                             blocks=[-1])):
        expected = keras.ops.convert_to_numpy(extract(float_model)(images))
        found = keras.ops.convert_to_numpy(extract(mixed)(images))
        assert found.dtype == np.float32  # the head (MAP included) runs in float32
        # bfloat16 keeps 8 bits of mantissa: two blocks of it stay within a few percent.
        assert relative_error(found, expected) <= 0.05


def test_int8_quantizes_the_map_head_and_stays_close_to_float():
    model = _family_model("map")
    images = _images()
    expected = keras.ops.convert_to_numpy(model(images))
    model.quantize("int8")
    head = model.get_layer("MAPHead_0")
    projections = [head.attention.query, head.attention.key, head.attention.value,
                   head.attention.out, head.mlp.dense_0, head.mlp.dense_1]
    assert [layer.quantization_mode for layer in projections] == ["int8"] * 6
    found = keras.ops.convert_to_numpy(model(images))
    assert not np.array_equal(found, expected)
    # Per-channel int8 weights and per-token int8 inputs, as tests/test_quantize.py.
    assert relative_error(found, expected) <= 0.05


def test_lora_on_the_map_heads_projections_starts_as_the_model_and_then_adapts_it():
    model = _family_model("map")
    images = _images()
    expected = keras.ops.convert_to_numpy(model(images))
    head = model.get_layer("MAPHead_0")
    adapted = [head.attention.query, head.attention.key, head.attention.value, head.attention.out,
               head.mlp.dense_0, head.mlp.dense_1]
    for layer in adapted:
        layer.enable_lora(2)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(images)), expected, rtol=1e-5,
                               atol=1e-6)  # B starts at zero
    assert all(not layer._kernel.trainable for layer in adapted)  # pylint: disable=protected-access
    rng = np.random.default_rng(1)
    for layer in adapted:
        layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape) * 0.5)
    assert relative_error(model(images), expected) > 1e-3  # the head's call reads the adapters


# --- class names ------------------------------------------------------------------------------------

def test_class_names_of_a_backbone_release_say_it_has_no_head():
    with pytest.raises(labels.NoClassNamesError,
                       match=r"Release 'dinov2' has no classifier head.*include_top=False.*"
                             r"deit_in1k"):
        vit_keras.class_names("dinov2")
    assert len(vit_keras.class_names("deit_in1k")) == 1000
    with pytest.raises(vit_keras.errors.UserError, match="No class names for 'imagenet3k'"):
        vit_keras.class_names("imagenet3k")


def test_a_family_model_made_dynamic_gives_its_logits_at_the_built_size(family):
    # with_dynamic_image_size: position embeddings resampled per input (prefix rows as the
    # family has them: none for DeiT III and DINOv2-reg, two for DeiT distilled).
    _, _, images, expected, model = family
    dynamic = vit_keras.with_dynamic_image_size(model)
    assert dynamic.input.shape[1:3] == (None, None)
    assert relative_error(dynamic(images), expected["logits"]) <= RTOL
