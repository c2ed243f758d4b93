"""apps/convert.py: any supported checkpoint → a `.keras` file that `keras.models.load_model` reads."""

import os
import sys

import keras
import numpy as np
import pytest

import vit_keras

from conftest import REPO_ROOT, TINY_CONFIG, random_images, randomize_weights, run_app

sys.path.insert(0, os.path.join(REPO_ROOT, "apps"))
import _common  # noqa: E402


@pytest.fixture
def checkpoint(tmp_path):
    model = vit_keras.build_model(TINY_CONFIG, image_size=16, num_classes=5)
    randomize_weights(model)
    return vit_keras.save_npz(model, str(tmp_path / "tiny.npz"))


# The converter reads the checkpoint with NumPy; building and loading on each backend is
# test_checkpoints.py's, the converted file on each backend test_user_journeys.py's: one pass.
@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")
def test_convert_writes_a_loadable_model_at_a_new_size(tmp_path, checkpoint):
    out = str(tmp_path / "saved" / "tiny_24.keras")
    result = run_app("convert.py", "--weights", checkpoint, "--out", out, "--image_size", "24,20",
                     "--num_classes", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"backend {keras.backend.backend()}" in result.stdout
    assert "(reloaded: max difference" in result.stdout
    loaded = keras.models.load_model(out)
    assert loaded.input_shape == (None, 24, 20, 3) and loaded.output_shape == (None, 10)
    expected = vit_keras.build_model_from_checkpoint(checkpoint, image_size=(24, 20),
                                                     num_classes=10)
    for a, b in zip(loaded.weights, expected.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    head = keras.ops.convert_to_numpy(loaded.get_layer("head").kernel)
    assert not head.any()  # 5 → 10 classes: a zero-initialised head
    x = random_images(1, 24, 20)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loaded(x)),
                               keras.ops.convert_to_numpy(expected(x)), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.backend_independent  # the checkpoint's shapes against the variant's: NumPy only
def test_convert_refuses_a_wrong_variant(tmp_path, checkpoint):
    result = run_app("convert.py", "--weights", checkpoint, "--out", str(tmp_path / "x.keras"),
                     "--model", "ViT-B/16")
    assert result.returncode != 0
    assert "does not hold a ViT-B/16" in result.stderr
    assert not os.path.exists(tmp_path / "x.keras")


@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")  # the app's file handling; each backend converts above
def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path, checkpoint):
    out = tmp_path / "tiny.keras"
    first = run_app("convert.py", "--weights", checkpoint, "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    written = out.read_bytes()
    again = run_app("convert.py", "--weights", checkpoint, "--out", str(out), "--num_classes", "3")
    assert again.returncode == 2, again.stderr[-3000:]
    assert again.stderr.strip().splitlines()[-1] == (
        f"ERROR: {out} exists already: pass --overwrite to replace it, or choose another --out.")
    assert out.read_bytes() == written
    replaced = run_app("convert.py", "--weights", checkpoint, "--out", str(out), "--num_classes",
                       "3", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert keras.models.load_model(str(out)).output_shape == (None, 3)
    assert sorted(os.listdir(tmp_path)) == ["tiny.keras", "tiny.npz"]  # no temporary file left


def test_reload_verification_sees_the_features_under_a_zero_head(tmp_path):
    """A new head is zeros, so the logits of any two models with it agree; the check must also
    compare what the head takes, or a reload that lost the converted weights would pass."""
    converted = randomize_weights(vit_keras.build_model(TINY_CONFIG, image_size=16, num_classes=7))
    head = converted.get_layer("head")
    head.set_weights([np.zeros_like(w) for w in head.get_weights()])
    good, corrupted = str(tmp_path / "good.keras"), str(tmp_path / "corrupted.keras")
    converted.save(good)
    assert _common.verify_reload(converted, good) <= 1e-5
    other = randomize_weights(vit_keras.build_model(TINY_CONFIG, image_size=16, num_classes=7),
                              seed=1)
    other.get_layer("head").set_weights(head.get_weights())
    other.save(corrupted)
    x = random_images(1, 16, 16)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(converted(x)),  # the old check
                                  keras.ops.convert_to_numpy(other(x)))
    with pytest.raises(_common.ReloadMismatchError, match="features under the head"):
        _common.verify_reload(converted, corrupted)
