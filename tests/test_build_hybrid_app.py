"""apps/build_hybrid.py: a hybrid variant → a `.keras` file, with its sizes printed and verified."""

import dataclasses
import os

import keras
import numpy as np
import pytest
import scipy.ndimage
from test_checkpoints import write_npz
from test_hybrid_checkpoints import official_hybrid_params

import vit_keras

from conftest import run_app


# The app's sizes, flags and weight loading; the hybrid on each backend is test_resnet.py's and
# test_hybrid_checkpoints.py's, its file on each backend test_user_journeys.py's: one pass.
@pytest.mark.slow
@pytest.mark.backend_independent("torch")
def test_build_hybrid_prints_sizes_and_saves_a_reloadable_model(tmp_path):
    out = str(tmp_path / "saved" / "r_ti16_64.keras")
    result = run_app("build_hybrid.py", "--model", "R+ViT-Ti/16", "--image_size", "64",
                     "--num_classes", "10", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    # vit_jax's 6,337,704 at 224 px with 1000 classes, less 45 position embeddings (a 2x2 grid
    # instead of 7x7) of 192 and 990 classes of 193 head parameters.
    assert f"{6_337_704 - 45 * 192 - 990 * 193:,} parameters" in result.stdout
    # The stride-4 root maps 64 px to 16x16x64; 8x8 patches make 2x2 tokens plus the class token.
    assert "feature map 16x16x64; sequence length 5." in result.stdout
    assert f"backend {keras.backend.backend()}" in result.stdout
    loaded = keras.models.load_model(out)
    assert loaded.input_shape == (None, 64, 64, 3) and loaded.output_shape == (None, 10)
    assert loaded.get_layer("resnet").group_norm_epsilon == 1e-6  # vit_jax numerics by default


@pytest.mark.slow
@pytest.mark.backend_independent("torch")  # as above
def test_build_hybrid_loads_weights_resampled_to_the_image_size(tmp_path):
    # A 64 px checkpoint (2x2 grid) built at 96 px: a 24x24 feature map, 3x3 tokens.
    config = dataclasses.asdict(vit_keras.VARIANTS["R+ViT-Ti/16"])
    params = official_hybrid_params(config, grid=2)
    weights = write_npz(tmp_path / "R_Ti_16.npz", params)
    out = str(tmp_path / "r_ti16_96.keras")
    result = run_app("build_hybrid.py", "--model", "R+ViT-Ti/16", "--image_size", "96",
                     "--num_classes", "5", "--weights", weights, "--hybrid_numerics", "timm",
                     "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "feature map 24x24x64; sequence length 10." in result.stdout
    assert f"weights {weights}" in result.stdout
    loaded = {w.path: keras.ops.convert_to_numpy(w) for w in keras.models.load_model(out).weights}
    for path, key in (("resnet/conv_root/kernel", "conv_root/kernel"),
                      ("embedding/kernel", "embedding/kernel"),
                      ("encoderblock_11/MlpBlock_3/Dense_1/kernel",
                       "Transformer/encoderblock_11/MlpBlock_3/Dense_1/kernel"),
                      ("head/kernel", "head/kernel")):  # same class count: the head is loaded
        np.testing.assert_array_equal(loaded[path], params[key])
    np.testing.assert_array_equal(loaded["resnet/gn_root/gamma"], params["gn_root/scale"][0, 0, 0])
    # vit_jax's resampling (scipy.ndimage.zoom, order 1) on the feature-map grid, class token kept.
    posemb = params["Transformer/posembed_input/pos_embedding"]
    grid = scipy.ndimage.zoom(posemb[0, 1:].reshape(2, 2, -1), (3 / 2, 3 / 2, 1), order=1)
    np.testing.assert_allclose(loaded["posembed_input/pos_embedding"],
                               np.concatenate([posemb[:, :1], grid.reshape(1, 9, -1)], axis=1),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.backend_independent  # refused from the variant table, before any model is built
def test_build_hybrid_refuses_a_plain_vit(tmp_path):
    out = str(tmp_path / "vit.keras")
    result = run_app("build_hybrid.py", "--model", "ViT-B/16", "--out", out)
    assert result.returncode != 0
    assert "is not a hybrid" in result.stderr and "R50+ViT-B/16" in result.stderr
    assert not os.path.exists(out)
