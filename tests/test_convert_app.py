"""apps/convert.py: any supported checkpoint → a `.keras` file that `keras.models.load_model` reads."""

import os
import sys

import keras
import numpy as np
import pytest

import vit_keras
from conftest import REPO_ROOT, TINY_CONFIG, random_images, randomize_weights, run_app

sys.path.insert(0, os.path.join(REPO_ROOT, "apps"))
import _backend  # noqa: E402


@pytest.fixture
def checkpoint(tmp_path):
    model = vit_keras.build_model(TINY_CONFIG, image_size=16, num_classes=5)
    randomize_weights(model)
    return vit_keras.save_npz(model, str(tmp_path / "tiny.npz"))


def test_convert_writes_a_loadable_model_at_a_new_size(tmp_path, checkpoint):
    out = str(tmp_path / "saved" / "tiny_24.keras")
    result = run_app("convert.py", "--weights", checkpoint, "--out", out, "--image_size", "24,20",
                     "--num_classes", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"backend {keras.backend.backend()}" in result.stdout
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


def test_convert_refuses_a_wrong_variant(tmp_path, checkpoint):
    result = run_app("convert.py", "--weights", checkpoint, "--out", str(tmp_path / "x.keras"),
                     "--variant", "ViT-B/16")
    assert result.returncode != 0
    assert "does not hold a ViT-B/16" in result.stderr
    assert not os.path.exists(tmp_path / "x.keras")


@pytest.mark.parametrize("argv", [["app", "--backend", "torch", "--out", "x"],
                                  ["app", "--out", "x", "--backend=torch"]])
def test_select_backend_reads_the_flag_anywhere(monkeypatch, argv):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    monkeypatch.setitem(sys.modules, "keras", None)  # as in an app, before keras is imported
    assert _backend.select_backend(argv) == "torch"
    assert os.environ["KERAS_BACKEND"] == "torch"


def test_select_backend_errors(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    assert _backend.select_backend(["app"]) is None
    assert os.environ["KERAS_BACKEND"] == "tensorflow"
    with pytest.raises(ValueError, match="Unknown backend 'mxnet'"):
        _backend.select_backend(["app", "--backend", "mxnet"])
    other = "jax" if keras.backend.backend() != "jax" else "torch"
    with pytest.raises(ValueError, match="before importing keras"):
        _backend.select_backend(["app", "--backend", other])  # keras is already imported here


def test_start_app_defines_the_backend_flag_once_and_sets_defaults(monkeypatch):
    from absl import flags

    monkeypatch.setattr(sys, "argv", ["app", "--backend", keras.backend.backend()])
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _backend.start_app() == keras.backend.backend()
    assert _backend.start_app() == keras.backend.backend()  # a second app module: no duplicate flag
    assert "backend" in flags.FLAGS
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
