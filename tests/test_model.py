"""build_model and the variant table: parameter counts, shapes, errors, training behaviour."""

import re

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.training import masked_patch_prediction

from conftest import TINY_CONFIG, random_images, randomize_weights, tiny_data, tiny_model

BACKEND = keras.backend.backend()

# Parameter counts of vit_jax (models_test.py) and the paper, 1000 classes, 224 px; the patch-14
# sizes (DINOv2, CLIP) by the same count: 257 tokens.
PARAMETER_COUNTS = {
    "ViT-Ti/16": 5_717_416,
    "ViT-S/14": 22_004_584,
    "ViT-S/16": 22_050_664,
    "ViT-S/32": 22_878_952,
    "ViT-B/8": 86_576_872,
    "ViT-B/14": 86_475_496,
    "ViT-B/16": 86_567_656,
    "ViT-B/32": 88_224_232,
    "ViT-L/14": 304_203_752,
    "ViT-L/16": 304_326_632,
    "ViT-L/32": 306_535_400,
    "ViT-H/14": 632_045_800,
    "ViT-g/14": 1_012_611_432,  # Zhai et al.'s sizes, counted the same way
    "ViT-G/14": 1_844_440_680,
}


# The rotary and gated families' own sizes: timm's counts (`create_model(name, num_classes=1000)`
# at 224 px), with each family's pooling.
FAMILY_PARAMETER_COUNTS = {
    "EVA02-B/14": (86_527_720, "gap"),  # eva02_base_patch14_224
    "EVA02-L/14": (304_293_800, "gap"),  # eva02_large_patch14_224
    "AIMv2-L/14": (310_222_824, "gap"),  # aimv2_large_patch14_224
    "DINOv2-g/14": (1_136_306_664, "token"),  # vit_giant_patch14_dinov2, img_size=224
    "ViT-So400m/16": (428_971_944, "map"),  # vit_so400m_patch16_siglip_256, img_size=224
}


def test_variant_table_lists_the_papers_vision_transformers_by_exact_name():
    plain = [name for name, config in vit_keras.VARIANTS.items() if not config.is_hybrid]
    assert plain == list(PARAMETER_COUNTS) + list(FAMILY_PARAMETER_COUNTS)


@pytest.mark.backend_independent
@pytest.mark.parametrize("variant", [
    pytest.param(name, marks=pytest.mark.slow) if name == "DINOv2-g/14" else name
    for name in FAMILY_PARAMETER_COUNTS])
def test_parameter_count_of_a_family_size_equals_timms(variant):
    count, classifier = FAMILY_PARAMETER_COUNTS[variant]
    assert _unallocated(variant, classifier=classifier).count_params() == count


def _unallocated(variant, **kwargs):
    """The model built inside a `StatelessScope`: Keras defers every variable's initialisation, so
    even ViT-H/14 takes seconds and no memory for its weights."""
    with keras.StatelessScope(initialize_variables=False):
        return vit_keras.build_model(variant, **kwargs)


@pytest.mark.backend_independent
@pytest.mark.parametrize("variant", [
    pytest.param(name, marks=pytest.mark.slow) if name == "ViT-H/14" else name  # over 5 s alone
    for name in PARAMETER_COUNTS])
def test_parameter_count_equals_vit_jax(variant):
    assert _unallocated(variant).count_params() == PARAMETER_COUNTS[variant]


@pytest.mark.backend_independent
@pytest.mark.parametrize("variant,millions", [("ViT-g/14", 1011), ("ViT-G/14", 1843)])
def test_scaling_vits_count_the_parameters_of_zhai_et_al(variant, millions):
    # Table 2 of "Scaling Vision Transformers" counts the encoder without class token and head.
    count = _unallocated(variant, classifier="gap", include_top=False).count_params()
    assert round(count / 1e6) == millions


def test_parameter_count_of_an_allocated_model_equals_vit_jax():
    # The deferred count above stands for the real one: check that they agree on each backend.
    assert vit_keras.build_model("ViT-Ti/16").count_params() == PARAMETER_COUNTS["ViT-Ti/16"]


@pytest.mark.backend_independent
@pytest.mark.parametrize("variant,count", [("ViT-S/16", 22_049_896), ("ViT-B/16", 86_566_120)])
def test_parameter_count_of_gap_model_has_no_class_token(variant, count):
    assert _unallocated(variant, classifier="gap").count_params() == count


def test_representation_layer_adds_a_dense_of_its_size():
    base = vit_keras.build_model("ViT-Ti/16", num_classes=10).count_params()
    with_representation = vit_keras.build_model(
        "ViT-Ti/16", num_classes=10, representation_size=192).count_params()
    assert with_representation - base == 192 * 192 + 192


@pytest.mark.parametrize("image_size,classifier,representation_size,channels,tokens", [
    (16, "token", None, 3, 17),
    ((16, 24), "token", None, 3, 25),
    ((24, 16), "gap", None, 1, 24),
    (16, "gap", 20, 3, 16),
    (16, "token", 20, 1, 17),
])
def test_output_shapes(tiny_config, image_size, classifier, representation_size, channels, tokens):
    model = vit_keras.build_model(tiny_config, image_size=image_size, num_classes=7,
                                  classifier=classifier, representation_size=representation_size,
                                  channels=channels)
    height, width = vit_keras.model.geometry.pair(image_size)
    logits = model.predict(random_images(2, height, width, channels), verbose=0)
    assert logits.shape == (2, 7)
    assert model.get_layer("posembed_input").pos_embedding.shape == (1, tokens, 32)
    features = vit_keras.build_model(tiny_config, image_size=image_size, include_top=False,
                                     classifier=classifier, representation_size=representation_size,
                                     channels=channels)
    assert features.output.shape == (None, representation_size or 32)


def test_head_is_zero_initialised_so_a_new_model_predicts_uniformly(tiny_config):
    model = vit_keras.build_model(tiny_config, image_size=16, num_classes=5)
    np.testing.assert_array_equal(model.predict(random_images(2, 16, 16), verbose=0), 0.0)


def test_preprocessing_maps_pixels_0_255_to_minus_one_one(tiny_config):
    raw = randomize_weights(vit_keras.build_model(tiny_config, image_size=16))
    normalised = vit_keras.build_model(tiny_config, image_size=16, include_preprocessing=False)
    normalised.set_weights(raw.get_weights())
    images = random_images(2, 16, 16)
    np.testing.assert_allclose(raw.predict(images, verbose=0),
                               normalised.predict((images - 127.5) / 127.5, verbose=0),
                               rtol=1e-5, atol=1e-5)


def test_custom_config_builds_through_the_same_function():
    config = vit_keras.ViTConfig("ViT-custom", patch_size=2, hidden_size=12, mlp_dim=20,
                                 num_heads=3, num_layers=3)
    model = vit_keras.build_model(config, image_size=(6, 8), num_classes=2)
    assert len(vit_keras.model.transformer_blocks(model)) == 3
    assert model.get_layer("embedding").kernel.shape == (2, 2, 3, 12)


def test_unknown_variant_lists_the_known_ones():
    # Every variant of the table, in its order: a variant added to the table is listed too.
    known = ", ".join(re.escape(name) for name in vit_keras.VARIANTS)
    assert "ViT-Ti/16" in vit_keras.VARIANTS and "R50+ViT-B/16" in vit_keras.VARIANTS
    with pytest.raises(ValueError, match=rf"Unknown variant 'ViT-X/16'; known variants: {known}\."):
        vit_keras.build_model("ViT-X/16")


def test_image_size_not_divisible_by_patch_is_refused():
    with pytest.raises(ValueError, match="Image width 230 is not divisible by patch size 16"):
        vit_keras.build_model("ViT-B/16", image_size=(224, 230))


def test_hidden_size_not_divisible_by_heads_is_refused(tiny_config):
    with pytest.raises(ValueError, match="hidden size 30 is not divisible by the number of heads 4"):
        vit_keras.build_model({**tiny_config, "hidden_size": 30})


def test_unknown_classifier_is_refused(tiny_config):
    with pytest.raises(ValueError, match="Unknown classifier 'max'"):
        vit_keras.build_model(tiny_config, image_size=16, classifier="max")


# Without absolute position embeddings (rotary ones alone), JAX's predict ran on another size.
@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_wrong_input_image_size_is_named_in_the_error(tiny_config, position):
    rotary = {"rope": {"kind": "dinov3", "rotate_half": True}, "position_embedding": "none"}
    model = vit_keras.build_model({**tiny_config, **(rotary if position == "rotary" else {})},
                                  image_size=16)
    with pytest.raises(ValueError, match="takes 16x16 images; got 24x24"):
        model.predict(random_images(1, 24, 24), verbose=0)


# Checked before Keras runs: TensorFlow retraced a trained model's `fit` for any size, to fail in
# the graph.
def test_images_of_another_shape_are_named_by_predict_evaluate_and_fit_alike():
    model = _compiled_tiny_model()
    images, labels = tiny_data(4, size=8)
    model.fit(images, labels, verbose=0)
    for shape, message in [
            ((4, 16, 16, 3), r"takes 8x8 images; got 16x16\. Resize the images"),
            ((8, 8, 3), r"takes a batch of images, shape \(batch, 8, 8, 3\); got shape "
                        r"\(8, 8, 3\)\. One image: add a batch axis"),
            ((4, 8, 8, 4), r"takes images of 3 channels; got 4")]:
        wrong = np.zeros(shape, "float32")
        for call in (lambda: model.predict(wrong, verbose=0),
                     lambda: model.evaluate(x=wrong, y=labels, verbose=0),
                     lambda: model.fit(wrong, labels, verbose=0)):
            with pytest.raises(ValueError, match=message):
                call()


def test_a_grey_batch_is_read_as_rgb_where_the_normalisation_broadcasts():
    model = randomize_weights(tiny_model(TINY_CONFIG))
    grey = random_images(2, 8, 8, channels=1)
    np.testing.assert_allclose(model.predict(grey, verbose=0),
                               model.predict(np.repeat(grey, 3, axis=-1), verbose=0), atol=1e-5)
    without_normalisation = tiny_model(TINY_CONFIG).rebuilt(include_preprocessing=False)
    with pytest.raises(ValueError, match="takes images of 3 channels; got 1|found shape"):
        without_normalisation.predict(grey, verbose=0)


# Keras' JAX trainer takes the weights off the model while these run, and TensorFlow's keeps a
# training step traced once: a first step that failed left the model without its weights, or
# unable to train again (vit_keras.model.failed_calls).
def _compiled_tiny_model():
    model = randomize_weights(tiny_model(TINY_CONFIG))
    model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    return model


def _run(model, method, images, labels, **arguments):
    if method == "predict":
        return model.predict(images, verbose=0, **arguments)
    return getattr(model, method)(images, labels, verbose=0, **arguments)


# Mistakes the data's shape does not show, found as the step is traced: labels of another number
# of classes, images of another size from a generator. Made twice: on a model that has not run
# (Keras' symbolic build may fail first), then on one that has (the step's own trace fails).
@pytest.mark.parametrize("method", ["predict", "evaluate", "fit"])
def test_a_call_that_fails_at_its_first_step_leaves_the_model_its_weights(method):
    model = _compiled_tiny_model()
    images, labels = tiny_data(4, size=8)
    for _ in ("new", "has run"):
        before = [np.array(weight) for weight in model.get_weights()]
        # (TensorFlow's retrace of a step that ran finds the labels only as the graph runs.)
        with pytest.raises(Exception, match="takes 8x8 images; got 16x16|found shape|must have "
                                            "the same shape|logits and labels must be broadcastable"):
            if method == "predict":
                model.predict(((random_images(2, 16, 16),) for _ in range(2)), verbose=0)
            else:
                _run(model, method, images, np.eye(5, dtype="float32")[:4])
        for weight, value in zip(model.get_weights(), before):
            np.testing.assert_array_equal(weight, value)
        _run(model, method, images, labels, batch_size=2)  # the same call runs now


def _wrong_size_batches(method):
    batch = random_images(2, 16, 16)
    return ((batch,) if method == "predict" else (batch, np.zeros((2, 1))) for _ in range(2))


# The models vit_keras builds around a ViT's layers share its variables: on JAX their failing
# call took the ViT's weights away.
@pytest.mark.parametrize("wrapper,method", [("feature_extractor", "predict"),
                                            ("pretraining_model", "fit")])
def test_a_failing_call_of_a_model_around_a_vits_layers_leaves_the_vit_its_weights(wrapper,
                                                                                    method):
    vit = randomize_weights(tiny_model(TINY_CONFIG))
    images = random_images(2, 8, 8)
    expected = vit.predict(images, verbose=0)
    if wrapper == "feature_extractor":
        model = vit_keras.build_feature_extractor(vit)
    else:
        model = masked_patch_prediction.build_pretraining_model(vit, seed=0)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss=None)
    for _ in ("new", "has run"):
        with pytest.raises(Exception, match="found shape|position embeddings for"):
            getattr(model, method)(_wrong_size_batches(method), verbose=0)
        np.testing.assert_array_equal(vit.predict(images, verbose=0), expected)
        # The same call runs now (a learning rate of 0 leaves the ViT's outputs as they were).
        getattr(model, method)(images, *([np.zeros((2, 1))] if method == "fit" else []),
                               verbose=0)


class _RaisesAtBatch(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_predict_batch_end(self, batch, logs=None):
        if batch == self.batch:
            raise KeyboardInterrupt

    on_test_batch_end = on_train_batch_end = on_predict_batch_end


@pytest.mark.parametrize("method", ["predict", "evaluate", "fit"])
def test_a_call_interrupted_after_a_step_leaves_the_model_the_weights_of_its_last_step(method):
    model = _compiled_tiny_model()
    images, labels = tiny_data(8, size=8)
    before = [np.array(weight) for weight in model.get_weights()]
    expected = model.predict(images, verbose=0)
    with pytest.raises(KeyboardInterrupt):
        _run(model, method, images, labels, batch_size=2, callbacks=[_RaisesAtBatch(1)])
    if method == "fit":  # two steps ran: the weights are theirs
        expected = None
        assert any(not np.array_equal(weight, value)
                   for weight, value in zip(model.get_weights(), before))
    outputs = model.predict(images, verbose=0)
    assert np.isfinite(outputs).all()
    if expected is not None:
        np.testing.assert_array_equal(outputs, expected)


@pytest.mark.skipif(BACKEND != "jax", reason="Keras' JAX trainer alone takes the weights away")
def test_kerass_own_predict_still_loses_the_weights_when_its_first_step_fails():
    """The reason for `failed_calls` on JAX. When this fails, Keras keeps the weights itself: drop
    that part of it (and this test)."""
    model = tiny_model(TINY_CONFIG)
    with pytest.raises(ValueError):
        keras.Model.predict(model, random_images(1, 16, 16), verbose=0)
    with pytest.raises(TypeError, match="'NoneType' object is not callable"):
        keras.Model.predict(model, random_images(1, 8, 8), verbose=0)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's tf.function alone")
def test_kerass_own_fit_still_cannot_train_again_after_its_first_step_failed():
    """The reason for `failed_calls` on TensorFlow. When this fails, Keras traces the step anew
    itself: drop that part of it (and this test)."""
    model = _compiled_tiny_model()
    images, labels = tiny_data(4, size=8)
    with pytest.raises(ValueError):
        keras.Model.fit(model, random_images(4, 16, 16), labels, verbose=0)
    with pytest.raises(ValueError, match="Creating variables on a non-first call"):
        keras.Model.fit(model, images, labels, verbose=0)


def test_attention_scores_are_row_stochastic_per_block_and_head(tiny_config):
    model = randomize_weights(vit_keras.build_model(tiny_config, image_size=(16, 12)))
    scores = vit_keras.attention_scores(model, random_images(3, 16, 12), batch_size=2)
    assert [s.shape for s in scores] == [(3, 4, 13, 13)] * 2
    assert all(s.dtype == np.float32 for s in scores)
    np.testing.assert_allclose(scores[1].sum(-1), 1.0, rtol=1e-5)


def test_attention_scores_do_not_change_the_models_own_outputs(tiny_config):
    model = randomize_weights(vit_keras.build_model(tiny_config, image_size=16))
    images = random_images(2, 16, 16)
    before = model.predict(images, verbose=0)
    vit_keras.attention_scores(model, images)
    np.testing.assert_array_equal(model.predict(images, verbose=0), before)


def _fit_twice_with_zero_learning_rate(model, images, labels):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile="auto")
    return [float(model.train_on_batch(images, labels)) for _ in range(2)]


@pytest.mark.parametrize("regulariser", ["dropout", "drop_path_rate"])
def test_dropout_and_stochastic_depth_masks_differ_between_compiled_training_steps(
        tiny_config, regulariser):
    # With a zero learning rate the weights never move, so two losses differ only by their masks.
    model = randomize_weights(vit_keras.build_model(
        tiny_config, image_size=16, num_classes=3, **{regulariser: 0.5}))
    images, labels = random_images(8, 16, 16), np.arange(8) % 3
    first, second = _fit_twice_with_zero_learning_rate(model, images, labels)
    assert first != second
    deterministic = randomize_weights(vit_keras.build_model(tiny_config, image_size=16,
                                                            num_classes=3))
    first, second = _fit_twice_with_zero_learning_rate(deterministic, images, labels)
    assert first == pytest.approx(second, rel=1e-6)


@pytest.mark.slow  # over 5 s alone: out of make test-fast
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains_and_predicts_finite_values(tiny_config, policy):
    keras.config.set_dtype_policy(policy)
    model = vit_keras.build_model(tiny_config, image_size=16, num_classes=4, dropout=0.1)
    assert model.get_layer("encoderblock_0").compute_dtype == policy.split("_")[1]
    assert model.get_layer("encoder_norm").compute_dtype == "float32"
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Raw pixels at full scale, and far beyond it for a model without the rescaling layer.
    images = random_images(8, 16, 16)
    history = model.fit(images, np.arange(8) % 4, epochs=3, batch_size=4, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    logits = model.predict(images, verbose=0)
    assert logits.dtype == np.float32 and np.all(np.isfinite(logits))
    # Unnormalised pixels up to 1020 fed to a model without the rescaling layer (a common mistake):
    # float16 holds up to 65504, and LayerNorm (float32 statistics) bounds every attention logit.
    loud = vit_keras.build_model(tiny_config, image_size=16, include_preprocessing=False)
    loud.get_layer("head").kernel.assign(np.ones((32, 1000), "float32"))
    loud_images = random_images(2, 16, 16) * 4
    logits = loud.predict(loud_images, verbose=0)
    assert np.all(np.isfinite(logits)) and np.abs(logits).max() > 0
    scores = vit_keras.attention_scores(loud, loud_images)
    assert scores[0].dtype == np.float32 and np.all(np.isfinite(scores[0]))
