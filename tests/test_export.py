"""vit_keras.tools.export: SavedModel signatures, LiteRT and ONNX parity with Keras, self-verification.

Exports run under the TensorFlow backend (a `.keras` file loads there whatever backend trained it);
models trained on JAX and torch are exported in tests/test_export_app.py. A test that converts a
model (SavedModel, LiteRT, ONNX) is `slow`; the checks made before any conversion are not.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import vit_keras
from vit_keras.tools import export as vit_export
from vit_keras.tools.runs import run_folder

from conftest import randomize_weights

IMAGE_SIZE = 32
NUM_CLASSES = 10
CLASS_NAMES = [f"class_{i}" for i in range(NUM_CLASSES)]
# Patch 8 on 32x32 images: 16 patches, enough to exercise every layer in well under a second.
EXPORT_CONFIG = {"name": "tiny", "patch_size": 8, "hidden_size": 32, "mlp_dim": 64, "num_heads": 4,
                 "num_layers": 2}


def _has_flex_ops(ops):
    return any(op.startswith("Flex") or op == "DELEGATE" for op in ops)


@pytest.fixture(scope="module")
def model():
    model = vit_keras.build_model(EXPORT_CONFIG, image_size=IMAGE_SIZE, num_classes=NUM_CLASSES)
    # Weights of scale 0.5 make logits of order 1, so relative differences are meaningful.
    return randomize_weights(model, seed=1, scale=0.5)


@pytest.fixture(scope="module")
def saved_model(model, tmp_path_factory):
    path, verifications = vit_export.export(
        model, "saved_model", str(tmp_path_factory.mktemp("serving")), name="tiny",
        class_names=CLASS_NAMES, top_k=3)
    return path, verifications


@pytest.fixture(scope="module")
def litert_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("litert"))


@pytest.fixture(scope="module")
def litert_export(model, litert_dir):
    return vit_export.export(model, "tflite", litert_dir, name="tiny")


@pytest.mark.slow
def test_saved_model_uses_the_versioned_serving_layout(saved_model):
    path, _ = saved_model
    assert path.endswith(os.path.join("tiny", "1"))
    assert os.path.isfile(os.path.join(path, "saved_model.pb"))
    assert not os.path.exists(path + ".unverified")


@pytest.mark.slow
def test_saved_model_verifies_both_signatures_within_tolerance(saved_model):
    _, verifications = saved_model
    assert [v.entry_point for v in verifications] == ["serving_default", "serving_bytes (PNG)"]
    for verification in verifications:
        assert verification.passed, verification.summary()
        assert verification.max_rel_diff <= 1e-4
        assert verification.top1_agreement == 1.0


@pytest.mark.slow
def test_saved_model_signatures_have_named_outputs_dtypes_and_dynamic_batch(saved_model, model):
    loaded = tf.saved_model.load(saved_model[0])
    assert set(loaded.signatures) == {"serving_default", "serving_bytes"}
    serving = loaded.signatures["serving_default"]
    (spec,) = serving.structured_input_signature[1].values()
    assert (spec.name, spec.dtype, spec.shape.as_list()) == (
        "images", tf.float32, [None, IMAGE_SIZE, IMAGE_SIZE, 3])
    bytes_spec = loaded.signatures["serving_bytes"].structured_input_signature[1]["image_bytes"]
    assert (bytes_spec.dtype, bytes_spec.shape.as_list()) == (tf.string, [None])
    for batch in (1, 3):
        images = vit_export.verification_images(model, batch_size=batch)
        outputs = serving(images=tf.constant(images))
        assert set(outputs) == {"logits", "probabilities", "top_k_indices", "top_k_names"}
        assert outputs["logits"].dtype == tf.float32
        assert outputs["probabilities"].dtype == tf.float32
        assert outputs["top_k_indices"].dtype == tf.int32
        assert outputs["top_k_names"].dtype == tf.string
        assert outputs["logits"].shape == (batch, NUM_CLASSES)
        assert outputs["top_k_names"].shape == (batch, 3)
        np.testing.assert_allclose(outputs["probabilities"].numpy().sum(-1), 1.0, rtol=1e-5)
        top1 = outputs["top_k_indices"].numpy()[:, 0]
        np.testing.assert_array_equal(top1, outputs["logits"].numpy().argmax(-1))
        assert [n.decode() for n in outputs["top_k_names"].numpy()[:, 0]] == [
            CLASS_NAMES[i] for i in top1]


@pytest.mark.slow
def test_saved_model_cli_shows_both_signatures(saved_model):
    cli = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    result = subprocess.run(
        [cli, "show", "--dir", saved_model[0], "--all"], capture_output=True, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=120, check=True)
    shown = result.stdout
    for expected in ("signature_def['serving_default']", "signature_def['serving_bytes']",
                     "inputs['images']", f"shape: (-1, {IMAGE_SIZE}, {IMAGE_SIZE}, 3)",
                     "inputs['image_bytes']", "dtype: DT_STRING", "outputs['logits']",
                     "outputs['probabilities']", "outputs['top_k_names']",
                     f"shape: (-1, {NUM_CLASSES})", "Method name is: tensorflow/serving/predict"):
        assert expected in shown, f"{expected!r} missing from saved_model_cli output:\n{shown}"


@pytest.mark.slow
def test_serving_bytes_decodes_and_resizes_real_photos(saved_model, model):
    skimage_data = pytest.importorskip("skimage.data")
    photos = [skimage_data.chelsea(), skimage_data.astronaut()]  # 300x451 and 512x512 RGB
    encoded = tf.stack([tf.io.encode_png(photos[0]), tf.io.encode_jpeg(photos[1], quality=95)])
    outputs = tf.saved_model.load(saved_model[0]).signatures["serving_bytes"](
        image_bytes=encoded)
    decoded = [photos[0], tf.io.decode_jpeg(tf.io.encode_jpeg(photos[1], quality=95)).numpy()]
    # The documented preprocessing: bilinear resize to the model's size, then the model.
    expected = np.concatenate([
        keras.ops.convert_to_numpy(model(keras.ops.image.resize(
            photo.astype("float32")[None], (IMAGE_SIZE, IMAGE_SIZE), interpolation="bilinear")))
        for photo in decoded])
    np.testing.assert_allclose(outputs["logits"].numpy(), expected, rtol=1e-4, atol=1e-4)
    assert outputs["top_k_names"].shape == (2, 3)


@pytest.mark.slow
def test_litert_float32_matches_keras_with_builtin_ops_only(litert_export):
    path, (verification,) = litert_export
    assert verification.passed and verification.max_rel_diff <= 1e-4, verification.summary()
    ops = vit_export.litert_ops(path)
    assert not _has_flex_ops(ops), ops
    # Exact GELU (x * erfc(-x / sqrt 2) / 2) is fused by the converter into the builtin GELU op.
    assert "GELU" in ops


@pytest.mark.slow
def test_litert_runs_with_a_dynamic_batch(model, litert_export):
    runner = vit_export.litert_interpreter(litert_export[0]).get_signature_runner(
        "serving_default")
    for batch in (1, 5):
        images = vit_export.verification_images(model, batch_size=batch, seed=batch)
        outputs = runner(images=images)
        assert set(outputs) == {"logits", "probabilities"}
        assert outputs["logits"].shape == outputs["probabilities"].shape == (batch, NUM_CLASSES)
        assert outputs["logits"].dtype == outputs["probabilities"].dtype == np.float32
        expected = keras.ops.convert_to_numpy(model(images))
        np.testing.assert_allclose(outputs["logits"], expected, rtol=1e-4,
                                   atol=1e-4 * np.abs(expected).max())


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["dynamic_int8", "float16"])
def test_litert_quantized_export_reports_top1_agreement(model, litert_dir, quantize):
    path, (verification,) = vit_export.export(
        model, "tflite", litert_dir, name="tiny", quantize=quantize)
    assert path.endswith(f"tiny_{quantize}.tflite")
    assert verification.tolerance is None and verification.passed
    assert 0.0 <= verification.top1_agreement <= 1.0
    assert not _has_flex_ops(vit_export.litert_ops(path))
    # The model and the verification images are seeded, so this measures one fixed number:
    # 0.013 for dynamic_int8 and 0.0005 for float16 (TF 2.x, measured 2026-11-25); the bound
    # leaves room for converter releases, and fails when quantisation stops being per-channel.
    assert verification.max_rel_diff < 0.1, verification.summary()


@pytest.fixture(scope="module")
def onnx_export(model, tmp_path_factory):
    return vit_export.export(model, "onnx", str(tmp_path_factory.mktemp("onnx")), name="tiny")


@pytest.mark.slow
def test_onnx_matches_keras_with_a_dynamic_batch(model, onnx_export):
    import onnxruntime

    path, (verification,) = onnx_export
    assert verification.passed and verification.max_rel_diff <= 1e-4, verification.summary()
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    (images_input,) = session.get_inputs()
    assert (images_input.name, images_input.shape, images_input.type) == (
        "images", ["batch", IMAGE_SIZE, IMAGE_SIZE, 3], "tensor(float)")
    assert [(o.name, o.type) for o in session.get_outputs()] == [
        ("logits", "tensor(float)"), ("probabilities", "tensor(float)")]
    for batch in (1, 4):
        images = vit_export.verification_images(model, batch_size=batch, seed=batch)
        logits, probabilities = session.run(None, {"images": images})
        expected = keras.ops.convert_to_numpy(model(images))
        assert logits.shape == probabilities.shape == (batch, NUM_CLASSES)
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.slow
def test_onnx_export_computes_exact_gelu_with_erf(onnx_export):
    import onnx

    op_types = {node.op_type for node in onnx.load(onnx_export[0]).graph.node}
    # TensorFlow's exact GELU uses Erfc, which ONNX lacks; the exporter writes 1 - Erf instead.
    assert "Erf" in op_types and "Erfc" not in op_types


@pytest.mark.slow
def test_saved_model_versions_increment_and_an_existing_one_is_replaced_only_on_request(
        model, tmp_path):
    for existing in ("1", "7", "backup"):  # TF Serving only loads numeric version folders
        os.makedirs(tmp_path / "m" / existing)
    (tmp_path / "m" / "7" / "old.txt").write_text("version 7 as it was")
    path, _ = vit_export.export(model, "saved_model", str(tmp_path), name="m", verify=False)
    assert os.path.basename(path) == "8"
    with pytest.raises(FileExistsError, match="m/7 already exists"):
        vit_export.export(model, "saved_model", str(tmp_path), name="m", version=7)
    assert os.listdir(tmp_path / "m" / "7") == ["old.txt"]
    path, _ = vit_export.export(model, "saved_model", str(tmp_path), name="m", version=7,
                                overwrite=True, verify=False)
    assert "saved_model.pb" in os.listdir(path) and "old.txt" not in os.listdir(path)
    assert sorted(os.listdir(tmp_path / "m")) == ["1", "7", "8", "backup"]  # nothing left over


@pytest.mark.slow
@pytest.mark.parametrize("export_format", ["tflite", "onnx"])
def test_an_existing_tflite_or_onnx_file_is_replaced_only_on_request(model, tmp_path,
                                                                     export_format):
    path = vit_export.export_path(export_format, str(tmp_path), "tiny")
    with open(path, "wb") as f:
        f.write(b"an earlier export")
    with pytest.raises(FileExistsError, match="tiny." + export_format + " already exists"):
        vit_export.export(model, export_format, str(tmp_path), name="tiny", verify=False)
    with open(path, "rb") as f:
        assert f.read() == b"an earlier export"
    vit_export.export(model, export_format, str(tmp_path), name="tiny", overwrite=True)
    assert os.path.getsize(path) > 10_000  # the new model: verified, then moved into place


def test_labels_of_other_class_names_are_replaced_only_on_request(model, tmp_path):
    labels = tmp_path / "tiny.labels.txt"
    labels.write_text("".join(f"{name}\n" for name in CLASS_NAMES))
    # The same names: the file is the new export's too, nothing is replaced.
    assert vit_export.existing_outputs("onnx", str(tmp_path), "tiny",
                                       class_names=CLASS_NAMES) == []
    other = [f"other_{i}" for i in range(NUM_CLASSES)]
    with pytest.raises(FileExistsError, match="tiny.labels.txt already exists"):
        vit_export.export(model, "onnx", str(tmp_path), name="tiny", class_names=other)
    assert not os.path.exists(tmp_path / "tiny.onnx")


def test_an_export_folder_that_is_a_file_is_refused(model, tmp_path):
    (tmp_path / "exports").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="exports is a file"):
        vit_export.export(model, "onnx", str(tmp_path / "exports"), name="tiny")


@pytest.mark.slow
def test_failed_verification_raises_and_leaves_the_artifact_unpublished(model, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setattr(vit_export, "RELATIVE_TOLERANCE", -1.0)  # no difference can pass
    with pytest.raises(vit_export.ExportVerificationError, match="does not reproduce"):
        vit_export.export(model, "onnx", str(tmp_path), name="tiny")
    assert not os.path.exists(tmp_path / "tiny.onnx")
    assert os.path.exists(tmp_path / "tiny.onnx.unverified")


def test_quantization_applies_to_tflite_only(model, tmp_path):
    with pytest.raises(ValueError, match="tflite format only"):
        vit_export.export(model, "onnx", str(tmp_path), name="tiny", quantize="float16")


def test_class_names_must_match_the_number_of_classes(model, tmp_path):
    with pytest.raises(ValueError, match="3 class names for a model with 10 outputs"):
        vit_export.export(model, "saved_model", str(tmp_path), name="tiny",
                          class_names=["a", "b", "c"])


def test_class_names_load_from_json_beside_the_model_or_a_text_file(tmp_path):
    (tmp_path / "class_names.json").write_text('["cat", "dog"]')
    (tmp_path / "labels.txt").write_text("cat\ndog\n\n")
    assert vit_export.find_class_names(str(tmp_path / "model.keras")) == ["cat", "dog"]
    assert run_folder.load_class_names(str(tmp_path / "labels.txt")) == ["cat", "dog"]
    assert vit_export.find_class_names(str(tmp_path / "elsewhere" / "model.keras")) is None


# --- a backbone without head ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def backbone():
    model = vit_keras.build_model(EXPORT_CONFIG, image_size=IMAGE_SIZE, include_top=False)
    return randomize_weights(model, seed=5, scale=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("export_format", vit_export.FORMATS)
def test_a_backbone_without_head_exports_features_verified_as_features(backbone, tmp_path,
                                                                       export_format):
    path, verifications = vit_export.export(backbone, export_format, str(tmp_path),
                                            name="backbone")
    assert verifications
    for verification in verifications:
        assert verification.passed and verification.output == "features"
        assert verification.top1_agreement is None  # features have no classes to agree on
        summary = verification.summary()
        assert "diff to Keras features" in summary and "top-1" not in summary, summary
    images = vit_export.verification_images(backbone, batch_size=2)
    expected = keras.ops.convert_to_numpy(backbone(images))
    if export_format == "saved_model":
        outputs = tf.saved_model.load(path).signatures["serving_default"](
            images=tf.constant(images))
    elif export_format == "tflite":
        outputs = vit_export.litert_interpreter(path).get_signature_runner(
            "serving_default")(images=images)
    else:
        import onnxruntime

        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        outputs = dict(zip([o.name for o in session.get_outputs()],
                           session.run(None, {"images": images})))
    assert set(outputs) == {"features"}  # no logits, no softmax over features
    np.testing.assert_allclose(np.asarray(outputs["features"]), expected, rtol=1e-4, atol=1e-5)


def test_class_names_for_a_backbone_without_head_are_refused(backbone, tmp_path):
    with pytest.raises(ValueError, match="no classification head"):
        vit_export.export(backbone, "saved_model", str(tmp_path), name="backbone",
                          class_names=[f"c{i}" for i in range(32)])
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_mixed_precision_model_exports_in_float32_with_builtin_ops(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    mixed = vit_keras.build_model(EXPORT_CONFIG, image_size=IMAGE_SIZE, num_classes=NUM_CLASSES)
    keras.config.set_dtype_policy("float32")
    randomize_weights(mixed, seed=2, scale=0.5)
    path, (verification,) = vit_export.export(mixed, "tflite", str(tmp_path), name="mixed")
    assert verification.passed and verification.max_rel_diff <= 1e-4, verification.summary()
    assert not _has_flex_ops(vit_export.litert_ops(path))


@pytest.mark.slow
def test_hybrid_model_exports_to_every_format(tmp_path):
    # A ResNet stem (root + one stage, stride 4) before the patch embedding: 8x8 feature map.
    hybrid = vit_keras.build_model(
        {**EXPORT_CONFIG, "name": "tiny-hybrid", "patch_size": 2, "resnet_layers": (1,)},
        image_size=IMAGE_SIZE, num_classes=NUM_CLASSES)
    randomize_weights(hybrid, seed=3, scale=0.1)
    for export_format in vit_export.FORMATS:
        path, verifications = vit_export.export(hybrid, export_format, str(tmp_path), name="hybrid")
        for verification in verifications:
            assert verification.passed and verification.max_rel_diff <= 1e-4, (
                verification.summary())
        if export_format == "tflite":
            assert not _has_flex_ops(vit_export.litert_ops(path))


# The ViT family's switches (issue 34): SigLIP's MAP head on tokens without a class token (tanh
# GELU), and DINOv2 with registers, LayerScale and patch-only position embeddings, served at any
# size as DINOv2 is used.
FAMILY_EXPORTS = {
    "siglip": ({**EXPORT_CONFIG, "name": "siglip-like", "gelu": "tanh"}, "map", False),
    "dinov2_reg": ({**EXPORT_CONFIG, "name": "dinov2-reg-like", "layer_scale_init": 0.5,
                    "num_registers": 4, "posemb_prefix": False}, "token", True),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILY_EXPORTS))
def test_family_saved_model_verifies_both_signatures(family, tmp_path):
    config, classifier, dynamic = FAMILY_EXPORTS[family]
    model = randomize_weights(vit_keras.build_model(
        config, image_size=IMAGE_SIZE, num_classes=NUM_CLASSES, classifier=classifier,
        dynamic_image_size=dynamic), seed=5, scale=0.5)
    path, verifications = vit_export.export(model, "saved_model", str(tmp_path), name=family,
                                            class_names=CLASS_NAMES, top_k=3)
    # Both signatures, at the built size (and two others for the dynamic model).
    assert len(verifications) == (6 if dynamic else 2)
    for verification in verifications:
        assert verification.passed, verification.summary()
        assert verification.max_rel_diff <= 1e-4 and verification.top1_agreement == 1.0
    serving = tf.saved_model.load(path).signatures["serving_default"]
    images = vit_export.verification_images(model, batch_size=2)
    np.testing.assert_allclose(serving(images=tf.constant(images))["logits"].numpy(),
                               keras.ops.convert_to_numpy(model(images)), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILY_EXPORTS))
def test_family_exports_to_litert_and_onnx_with_builtin_ops(family, tmp_path):
    config, classifier, dynamic = FAMILY_EXPORTS[family]
    model = randomize_weights(vit_keras.build_model(
        config, image_size=IMAGE_SIZE, num_classes=NUM_CLASSES, classifier=classifier,
        dynamic_image_size=dynamic), seed=6, scale=0.5)
    for export_format in ("tflite", "onnx"):
        path, verifications = vit_export.export(model, export_format, str(tmp_path), name=family)
        assert len(verifications) == (3 if dynamic else 1)
        for verification in verifications:
            assert verification.passed and verification.max_rel_diff <= 1e-4, (
                verification.summary())
        if export_format == "tflite":
            assert not _has_flex_ops(vit_export.litert_ops(path))


# --- models of dynamic image size -----------------------------------------------------------------

@pytest.fixture(scope="module")
def dynamic_model():
    model = vit_keras.build_model(EXPORT_CONFIG, image_size=IMAGE_SIZE, num_classes=NUM_CLASSES,
                                  dynamic_image_size=True)
    return randomize_weights(model, seed=4, scale=0.5)


# Room for a 300x451 photo rounded to 304x448 (the default cap is 4 x 32 = 128 pixels a side).
DYNAMIC_MAX_IMAGE_SIZE = 512


@pytest.fixture(scope="module")
def dynamic_saved_model(dynamic_model, tmp_path_factory):
    return vit_export.export(dynamic_model, "saved_model", str(tmp_path_factory.mktemp("dynamic")),
                             name="dynamic", class_names=CLASS_NAMES, top_k=3,
                             max_image_size=DYNAMIC_MAX_IMAGE_SIZE)


@pytest.mark.slow
def test_dynamic_size_saved_model_takes_any_size_and_is_verified_at_three(dynamic_saved_model,
                                                                          dynamic_model):
    path, verifications = dynamic_saved_model
    sizes = vit_export.verification_sizes(dynamic_model)
    assert sizes == [(32, 32), (48, 24), (16, 56)]
    assert [v.entry_point for v in verifications] == [
        f"{entry} at {h}x{w}" for h, w in sizes for entry in ("serving_default",
                                                               "serving_bytes (PNG)")]
    assert all(v.passed and v.max_rel_diff <= 1e-4 for v in verifications)
    serving = tf.saved_model.load(path).signatures["serving_default"]
    (spec,) = serving.structured_input_signature[1].values()
    assert spec.shape.as_list() == [None, None, None, 3]
    # A fourth size, served directly: the same logits as the Keras model.
    images = vit_export.verification_images(dynamic_model, batch_size=2, size=(40, 64))
    expected = keras.ops.convert_to_numpy(dynamic_model(images))
    np.testing.assert_allclose(serving(images=tf.constant(images))["logits"].numpy(), expected,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_dynamic_size_serving_bytes_rounds_the_first_photos_size_to_whole_patches(
        dynamic_saved_model, dynamic_model):
    skimage_data = pytest.importorskip("skimage.data")
    photo = skimage_data.chelsea()  # 300x451 → 304x448, the nearest multiples of 8
    outputs = tf.saved_model.load(dynamic_saved_model[0]).signatures["serving_bytes"](
        image_bytes=tf.stack([tf.io.encode_png(photo)] * 2))
    resized = keras.ops.image.resize(photo.astype("float32")[None], (304, 448),
                                     interpolation="bilinear")
    expected = keras.ops.convert_to_numpy(dynamic_model(resized))
    np.testing.assert_allclose(outputs["logits"].numpy()[:1], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("export_format", ["tflite", "onnx"])
def test_dynamic_size_litert_and_onnx_serve_three_sizes(dynamic_model, tmp_path, export_format):
    path, verifications = vit_export.export(dynamic_model, export_format, str(tmp_path),
                                            name="dynamic")
    assert len(verifications) == 3
    for verification in verifications:
        assert verification.passed and verification.max_rel_diff <= 1e-4, verification.summary()
    if export_format == "tflite":
        assert not _has_flex_ops(vit_export.litert_ops(path))


@pytest.mark.slow
@pytest.mark.parametrize("height, width", [
    (17, 17),  # not a multiple of the patch: its 16x16 crop's logits, silently
    (40, 20),  # a side of 2.5 patches
    (0, 0),  # an empty image: NaN
    (4, 8),  # less than one patch high
    (DYNAMIC_MAX_IMAGE_SIZE + 8, 8),  # beyond the export's max_image_size
], ids=["17x17", "40x20", "0x0", "4x8", "over_the_cap"])
def test_dynamic_size_saved_model_refuses_a_size_it_cannot_serve(dynamic_saved_model, height,
                                                                 width):
    serving = tf.saved_model.load(dynamic_saved_model[0]).signatures["serving_default"]
    images = tf.zeros((1, height, width, 3))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"multiples of 8 pixels from 8 to {DYNAMIC_MAX_IMAGE_SIZE}"):
        serving(images=images)


@pytest.mark.slow
def test_dynamic_size_serving_bytes_refuses_a_small_file_of_a_large_image(dynamic_saved_model):
    # 1024x1024 of one colour: a few KB of PNG that would ask for 16,384 tokens, and attention
    # scores of 4 heads x 16,384^2 floats (4 GiB) per image per block.
    png = tf.io.encode_png(tf.zeros((1024, 1024, 3), tf.uint8))
    assert len(png.numpy()) < 10_000
    by_bytes = tf.saved_model.load(dynamic_saved_model[0]).signatures["serving_bytes"]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"more than {DYNAMIC_MAX_IMAGE_SIZE} pixels a side"):
        by_bytes(image_bytes=tf.stack([png]))


def test_dynamic_size_exports_cap_the_image_size_at_four_times_the_built_one(dynamic_model,
                                                                             tmp_path):
    assert vit_export.default_max_image_size(dynamic_model) == 4 * IMAGE_SIZE
    with pytest.raises(ValueError, match="no smaller than the size the model was built for"):
        vit_export.export(dynamic_model, "saved_model", str(tmp_path), name="dynamic",
                          max_image_size=IMAGE_SIZE - 8)
    assert not os.listdir(tmp_path)
    # Verification stays within a cap that is given.
    assert vit_export.verification_sizes(dynamic_model, max_image_size=IMAGE_SIZE) == [
        (32, 32), (32, 24), (16, 32)]


def test_a_model_without_a_fixed_size_or_a_built_grid_is_refused():
    images = keras.Input((None, None, 3))
    flat = keras.Model(images, keras.layers.GlobalAveragePooling2D()(images))
    with pytest.raises(ValueError, match="dynamic_image_size=True"):
        vit_export.image_shape(flat)


@pytest.mark.slow
def test_exports_of_a_dinov2_checkpoint_equal_timm_with_its_data_config_on_raw_pixels(tmp_path):
    """The checkpoint's own normalisation (ImageNet's mean and std for DINOv2, read from timm's
    config.json) travels into the exports: `serving_bytes` on the PNG of some pixels and LiteRT on
    the pixels give timm's logits with its data config (issue 40: before, every export rescaled
    to [-1, 1])."""
    torch = pytest.importorskip("torch")
    timm = pytest.importorskip("timm")
    from timm.models import _hub

    torch.manual_seed(0)
    reference = timm.create_model("vit_small_patch14_reg4_dinov2.lvd142m", pretrained=False,
                                  embed_dim=64, depth=2, num_heads=2, num_classes=7, img_size=28)
    with torch.no_grad():
        for key, parameter in reference.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.1 + float(
                "norm" in key and key.endswith("weight")))
    reference.eval()
    _hub.save_for_hf(reference, str(tmp_path / "hub"), safe_serialization=True)
    model = vit_keras.build_model_from_checkpoint(str(tmp_path / "hub"))
    pixels = np.random.default_rng(0).integers(0, 256, (2, 28, 28, 3), dtype=np.uint8)
    config = timm.data.resolve_data_config({}, model=reference)
    x = (pixels / 255 - np.asarray(config["mean"])) / np.asarray(config["std"])
    with torch.no_grad():
        expected = reference(torch.from_numpy(x.transpose(0, 3, 1, 2)).float()).numpy()

    def relative(got):
        return float(np.abs(got - expected).max() / np.abs(expected).max())

    path, _ = vit_export.export(model, "saved_model", str(tmp_path / "serving"), name="dinov2")
    serving = tf.saved_model.load(path).signatures["serving_bytes"]
    logits = serving(image_bytes=tf.stack([tf.io.encode_png(p) for p in pixels]))["logits"]
    assert relative(logits.numpy()) <= 1e-4
    path, _ = vit_export.export(model, "tflite", str(tmp_path / "litert"), name="dinov2")
    runner = vit_export.litert_interpreter(path).get_signature_runner("serving_default")
    assert relative(runner(images=pixels.astype("float32"))["logits"]) <= 1e-4


def test_a_rotary_naflex_model_exports_and_verifies_in_every_format(tmp_path):
    """DINOv3's centred rotary coordinates on each image's own grid, computed in the serving
    graph: SavedModel (any length up to the budget), LiteRT (the budget) and ONNX, each checked
    against Keras on square, wide and tall images."""
    config = {**EXPORT_CONFIG, "rope": {"kind": "dinov3", "rotate_half": True},
              "position_embedding": "none"}
    model = randomize_weights(vit_keras.build_model(
        config, image_size=IMAGE_SIZE, num_classes=NUM_CLASSES, naflex=True, classifier="gap"),
        seed=2, scale=0.5)
    for format in ("saved_model", "tflite", "onnx"):
        _, verifications = vit_export.export(model, format, str(tmp_path / format), name="rope",
                                             max_num_patches=24)
        sizes = {verification.entry_point.split(" at ")[-1] for verification in verifications}
        assert len(sizes) == 3, sizes  # square, wide, tall
        assert all(verification.passed for verification in verifications), verifications
