"""Saving and loading across backends, and what `import vit_keras` pulls in."""

import keras
import numpy as np
import pytest

import vit_keras

from conftest import BACKENDS, random_images, randomize_weights, run_on_backend

_LOAD_AND_PREDICT = """
import keras, numpy as np
import vit_keras  # the only import a user needs to read a vit_keras model
model = keras.models.load_model(ARGS["path"])  # default safe_mode
np.save(ARGS["out"], model.predict(np.load(ARGS["images"]), verbose=0))
print(json.dumps({"backend": keras.backend.backend()}))
"""


@pytest.fixture(scope="module")
def saved_here(tmp_path_factory):
    """A randomly weighted model saved on this process's backend, with its inputs and logits."""
    keras.utils.clear_session()
    keras.utils.set_random_seed(1)
    folder = tmp_path_factory.mktemp("saved")
    config = {"name": "tiny", "patch_size": 4, "hidden_size": 32, "mlp_dim": 64, "num_heads": 4,
              "num_layers": 2}
    model = randomize_weights(vit_keras.build_model(
        config, image_size=(16, 12), num_classes=5, representation_size=16, dropout=0.1,
        drop_path_rate=0.1), scale=0.2)
    path = str(folder / f"{keras.backend.backend()}.keras")
    model.save(path)
    images = random_images(4, 16, 12, seed=7)
    np.save(folder / "images.npy", images)
    return path, str(folder / "images.npy"), model.predict(images, verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize("load_backend", BACKENDS)
def test_model_saved_here_loads_in_a_fresh_process_on_every_backend(saved_here, load_backend,
                                                                     tmp_path):
    path, images, expected = saved_here
    out = str(tmp_path / "logits.npy")
    report = run_on_backend(load_backend, _LOAD_AND_PREDICT, path=path, images=images, out=out)
    assert report["backend"] == load_backend
    # Same weights, same logits on TF, JAX and torch (float32 kernels differ in summation order).
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-5, atol=1e-5)
    assert np.abs(expected).max() > 0.1  # the comparison is not between zero heads


def test_loaded_model_keeps_every_layer_config(saved_here):
    path, _, _ = saved_here
    loaded = keras.models.load_model(path)
    block = loaded.get_layer("encoderblock_1")
    assert isinstance(block, vit_keras.TransformerBlock)
    assert block.drop_path_rate == pytest.approx(0.1)
    assert loaded.get_layer("pre_logits").units == 16
    assert tuple(loaded.input.shape) == (None, 16, 12, 3)


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_importing_vit_keras_loads_no_tensorflow(backend):
    report = run_on_backend(backend, """
import sys, vit_keras
print(json.dumps({"tensorflow": sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow")[:3]}))
""")
    assert report["tensorflow"] == []
