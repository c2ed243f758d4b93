"""Patch-size resampling of the patch embedding (FlexiViT's PI-resize), and loading across patch sizes.

The reference is big_vision's `resample_patchemb` formula written out densely: the `(q*q, p*p)`
resize matrix is built by resizing every one-hot `p x p` patch with `jax.image.resize(...,
"bilinear", antialias=False)` (big_vision uses `tf.image.resize` bilinear, whose matrix is the same
to float32 rounding), and the new kernel is `pinv(B.T) @ w` per channel pair. The library builds
one matrix per axis in NumPy instead, so neither shares code with the other.
"""

import logging

import jax
import keras
import numpy as np
import pytest

import vit_keras
from vit_keras import resample_patch_embedding

from conftest import randomize_weights

HIDDEN = 8  # output channels of the kernels in the pure-NumPy tests


def _kernel(patch=(16, 16), channels=3, seed=0):
    """A random HWIO kernel with N(0, 1/fan_in) entries, as initialised patch embeddings."""
    rows, cols = patch
    fan_in = rows * cols * channels
    return np.random.default_rng(seed).normal(0, fan_in ** -0.5, (rows, cols, channels, HIDDEN)
                                              ).astype("float32")


def _jax_resize(patches, size):
    """`(n, h, w, c)` patches resized to `size` by `jax.image.resize`, bilinear, no antialias."""
    n, _, _, c = patches.shape
    out = jax.image.resize(np.asarray(patches, "float32"), (n, *size, c), "bilinear",
                           antialias=False)
    return np.asarray(out, np.float64)


def _big_vision_reference(kernel, new_size):
    """big_vision's formula: B's column k is the resized k-th one-hot patch; pinv(B.T) @ w.

    B is float32: singular values under 1e-5 of the largest are its rounding noise, not signal
    (B is rank-deficient when one axis grows and the other shrinks), and are cut off.
    """
    rows, cols, channels, hidden = kernel.shape
    one_hot = np.eye(rows * cols).reshape(rows * cols, rows, cols, 1)
    resize_matrix = _jax_resize(one_hot, new_size).reshape(rows * cols, -1).T  # (q*q, p*p)
    flat = kernel.reshape(rows * cols, channels * hidden).astype(np.float64)
    inverse = np.linalg.pinv(resize_matrix.T, rcond=1e-5)
    return (inverse @ flat).reshape(*new_size, channels, hidden)


def _embed(patches, kernel):
    """`(n, h, w, c)` patches · an HWIO kernel → `(n, hidden)` token embeddings (without bias)."""
    return np.einsum("nhwc,hwco->no", patches, kernel.astype(np.float64))


def _relative(a, b):
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


@pytest.mark.backend_independent
def test_same_patch_size_is_an_exact_copy():
    kernel = _kernel()
    for size in (16, (16, 16)):
        out = resample_patch_embedding(kernel, size)
        assert out is not kernel and out.dtype == kernel.dtype
        np.testing.assert_array_equal(out, kernel)


@pytest.mark.backend_independent
@pytest.mark.parametrize("old,new", [((16, 16), (8, 8)), ((16, 16), (12, 12)), ((16, 16), (32, 32)),
                                     ((16, 16), (8, 12)), ((12, 8), (16, 6)), ((8, 8), (16, 16))])
def test_matches_big_vision_pinv_of_the_one_hot_resize_matrix(old, new):
    kernel = _kernel(old)
    expected = _big_vision_reference(kernel, new)
    out = resample_patch_embedding(kernel, new)
    assert out.shape == (*new, 3, HIDDEN) and out.dtype == np.float32
    # The reference's resize matrix is float32 (jax), ~1e-7 off where its weights are not exact
    # binary fractions (thirds); seen: <= 8.4e-7.
    assert _relative(out, expected) < 1e-5


@pytest.mark.backend_independent
def test_upsampling_16_to_32_keeps_every_patch_embedding_exactly():
    # q >= p: B has full column rank, so <resize(x), w_new> = <x, w_old> for any patch x.
    kernel = _kernel()
    patches = np.random.default_rng(1).uniform(-1, 1, (32, 16, 16, 3))
    new = resample_patch_embedding(kernel, 32)
    # A float32 kernel and a float32 resize (jax); seen: 4.5e-8.
    assert _relative(_embed(_jax_resize(patches, (32, 32)), new), _embed(patches, kernel)) < 1e-5


@pytest.mark.backend_independent
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_16_to_8_and_back_keeps_the_embedding_of_smooth_patches(seed):
    """Going down to patch 8 loses what a 2x2-pixel block cannot hold, so only smooth patches keep
    their embedding, approximately: bilinear ramps (a random offset and slopes per channel) under
    a random N(0, 1/fan_in) kernel. max|Δ| / max|embedding| over 64 patches x 8 outputs, this
    test run for seeds 0-999: median 0.035, 99th percentile 0.069, max 0.082 (seeds 0-2: 0.048,
    0.031, 0.024); bound 0.1. White-noise patches are not kept (~0.9): a 2x2-pixel block cannot
    hold them at patch 8."""
    rng = np.random.default_rng(seed)
    kernel = _kernel(seed=seed)
    back = resample_patch_embedding(resample_patch_embedding(kernel, 8), 16)
    t = (np.arange(16) + 0.5) / 16
    offset, row_slope, col_slope = rng.normal(size=(3, 64, 1, 1, 3))
    ramps = offset + row_slope * t[:, None, None] + col_slope * t[None, :, None]
    assert _relative(_embed(ramps, back), _embed(ramps, kernel)) < 0.1


@pytest.mark.backend_independent
def test_non_square_target_has_its_shape():
    assert resample_patch_embedding(_kernel(), (8, 12)).shape == (8, 12, 3, HIDDEN)


@pytest.mark.backend_independent
def test_a_kernel_without_four_axes_is_refused_with_its_shape():
    with pytest.raises(ValueError, match=r"got shape \(16, 16, 3\)"):
        resample_patch_embedding(np.zeros((16, 16, 3)), 8)


# --- loading across patch sizes (every backend) --------------------------------------------------

def _tiny_vit(patch_size, name):
    config = {"name": name, "patch_size": patch_size, "hidden_size": 32, "num_heads": 4,
              "mlp_dim": 64, "num_layers": 2}
    return vit_keras.build_model(config, image_size=32, num_classes=3)


def _weights(model):
    return {w.path: keras.ops.convert_to_numpy(w) for w in model.weights}


def test_load_patch_8_npz_into_patch_16_resamples_the_kernel_and_the_grid(tmp_path, caplog):
    source = randomize_weights(_tiny_vit(8, "tiny-8"))
    path = vit_keras.save_npz(source, str(tmp_path / "tiny8.npz"))
    saved = _weights(source)
    model = _tiny_vit(16, "tiny-16-from-8")
    with caplog.at_level(logging.INFO, logger="vit_keras"):
        vit_keras.load_pretrained(model, path)
    loaded = _weights(model)
    np.testing.assert_array_equal(loaded["embedding/kernel"],
                                  resample_patch_embedding(saved["embedding/kernel"], 16))
    posemb = "posembed_input/pos_embedding"
    assert saved[posemb].shape == (1, 1 + 4 * 4, 32) and loaded[posemb].shape == (1, 1 + 2 * 2, 32)
    np.testing.assert_array_equal(loaded[posemb], vit_keras.resample_position_embeddings(
        saved[posemb], 2, interpolation="vit_jax"))
    for key in set(saved) - {"embedding/kernel", posemb}:
        np.testing.assert_array_equal(loaded[key], saved[key], err_msg=key)
    messages = [r.getMessage() for r in caplog.records]
    assert "Resampled the patch embedding from 8x8 to 16x16 patches (PI-resize)." in messages
    assert any("position embeddings from 4x4 to 2x2" in m for m in messages), messages


def test_load_patch_8_npz_into_patch_8_is_exact(tmp_path):
    source = randomize_weights(_tiny_vit(8, "tiny-8"))
    path = vit_keras.save_npz(source, str(tmp_path / "tiny8.npz"))
    model = vit_keras.load_pretrained(_tiny_vit(8, "tiny-8-again"), path)
    saved, loaded = _weights(source), _weights(model)
    assert saved.keys() == loaded.keys()
    for key in saved:
        np.testing.assert_array_equal(loaded[key], saved[key], err_msg=key)


def test_a_hybrid_with_another_patch_size_is_not_resampled(tmp_path):
    # A hybrid's patches tile a ResNet feature map, not pixels: PI-resize does not apply, and the
    # strict load reports the kernel as a mismatch.
    config = {"name": "R+tiny", "patch_size": 4, "hidden_size": 32, "num_heads": 4, "mlp_dim": 64,
              "num_layers": 1, "resnet_layers": ()}
    source = vit_keras.build_model(config, image_size=32, num_classes=3)
    path = vit_keras.save_npz(source, str(tmp_path / "hybrid4.npz"))
    model = vit_keras.build_model({**config, "patch_size": 2}, image_size=32, num_classes=3)
    with pytest.raises(ValueError, match=r"shape mismatch: embedding/kernel: model \(2, 2, 64, 32\), "
                                         r"checkpoint \(4, 4, 64, 32\)"):
        vit_keras.load_pretrained(model, path)
