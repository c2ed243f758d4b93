"""Position-embedding resampling: vit_jax's scipy zoom, and PyTorch's bilinear/bicubic (timm, HF)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.ndimage
from timm.layers import resample_abs_pos_embed
import torch
import torch.nn.functional as F

from vit_keras import resample_position_embeddings
from vit_keras.weights import posemb

from conftest import REPO_ROOT

# Pure NumPy against SciPy and torch oracles: the Keras backend plays no part.
pytestmark = pytest.mark.backend_independent


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Overrides conftest's fixture: these tests touch no Keras state, and its gc.collect() costs
    about a second per test once torch and timm are imported."""
    yield


# (old rows, old cols) → (new rows, new cols): up, down, rectangular, degenerate.
GRIDS = [((7, 7), (12, 12)), ((14, 14), (24, 24)), ((24, 24), (14, 14)), ((14, 14), (20, 24)),
         ((5, 9), (3, 17)), ((16, 16), (7, 5)), ((3, 3), (1, 1)), ((1, 1), (4, 4)), ((2, 2), (3, 3))]


def _posemb(rows, cols, prefix=1, hidden=8, seed=0):
    return np.random.default_rng(seed).normal(0, 0.02, (1, prefix + rows * cols, hidden)).astype(
        "float32")


def _relative(a, b):
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


@pytest.mark.parametrize("old,new", GRIDS)
def test_vit_jax_interpolation_matches_scipy_zoom_order1(old, new):
    pe = _posemb(*old)
    grid = pe[0, 1:].reshape(*old, -1)
    # vit_jax checkpoint.py: scipy.ndimage.zoom(posemb_grid, (new/old, new/old, 1), order=1).
    expected = scipy.ndimage.zoom(grid, (new[0] / old[0], new[1] / old[1], 1), order=1)
    assert expected.shape[:2] == new
    out = resample_position_embeddings(pe, new, old_grid=old)
    assert out.shape == (1, 1 + new[0] * new[1], 8) and out.dtype == np.float32
    np.testing.assert_array_equal(out[:, :1], pe[:, :1])  # the class-token row is kept
    # Both compute in float64 and round to float32 once: equal up to one float32 rounding.
    np.testing.assert_allclose(out[0, 1:].reshape(expected.shape), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("interpolation", posemb.INTERPOLATIONS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_same_grid_is_an_exact_no_op(interpolation, prefix):
    pe = _posemb(6, 6, prefix=prefix)
    out = resample_position_embeddings(pe, 6, num_prefix_tokens=prefix, interpolation=interpolation)
    assert out is pe


@pytest.mark.parametrize("old,new", GRIDS)
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [False, True])
def test_torch_interpolations_match_f_interpolate(old, new, mode, antialias):
    pe = _posemb(*old, prefix=0)
    grid = torch.from_numpy(pe[0].reshape(*old, -1)).permute(2, 0, 1)[None]
    expected = F.interpolate(grid, size=new, mode=mode, align_corners=False, antialias=antialias)
    expected = expected[0].permute(1, 2, 0).reshape(1, -1, 8).numpy()
    out = resample_position_embeddings(pe, new, num_prefix_tokens=0, old_grid=old,
                                       interpolation=mode, antialias=antialias)
    # PyTorch accumulates in float32 (we use float64): a few float32 roundings apart (seen: 2e-6).
    assert _relative(out, expected) < 1e-5


@pytest.mark.parametrize("old,new", [(7, (12, 12)), (14, (9, 11))])
def test_bicubic_antialias_matches_timm_state_dict_resampling(old, new):
    pe = _posemb(old, old)
    # timm's checkpoint_filter_fn resamples state-dict position embeddings this way.
    expected = resample_abs_pos_embed(torch.from_numpy(pe), new_size=new, num_prefix_tokens=1,
                                      interpolation="bicubic", antialias=True).numpy()
    out = resample_position_embeddings(pe, new, interpolation="bicubic", antialias=True)
    np.testing.assert_array_equal(out[:, :1], pe[:, :1])
    assert _relative(out, expected) < 1e-5


def test_vit_jax_differs_from_torch_bilinear():
    # The two linear interpolations differ (corner-aligned vs half-pixel): a loader that mixed them
    # up would fail the parity tests, and this test shows the difference is not negligible.
    pe = _posemb(4, 4)
    a = resample_position_embeddings(pe, 7)
    b = resample_position_embeddings(pe, 7, interpolation="bilinear")
    assert _relative(a, b) > 1e-2


def test_rectangular_old_grid_needs_old_grid():
    pe = _posemb(3, 5)
    with pytest.raises(ValueError, match="not a square; pass old_grid"):
        resample_position_embeddings(pe, 4)
    out = resample_position_embeddings(pe, (6, 10), old_grid=(3, 5))
    assert out.shape == (1, 61, 8)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"\(1, tokens, hidden\)"):
        resample_position_embeddings(np.zeros((17, 8)), 5)
    with pytest.raises(ValueError, match="Unknown interpolation 'nearest'"):
        resample_position_embeddings(_posemb(4, 4), 5, interpolation="nearest")
    with pytest.raises(ValueError, match="does not match"):
        resample_position_embeddings(_posemb(4, 4), 5, old_grid=(3, 4))
    with pytest.raises(ValueError, match="antialias"):
        resample_position_embeddings(_posemb(4, 4), 5, antialias=True)


PACKAGE_DIR = os.path.join(REPO_ROOT, "vit_keras")


def test_module_is_pure_numpy():
    # weights/posemb.py (and model/geometry.py, which it uses) loaded without the package's
    # __init__ (which imports Keras), with Keras, SciPy and torch made unimportable.
    code = (
        "import importlib, sys, types\n"
        "sys.modules['scipy'] = None; sys.modules['torch'] = None; sys.modules['keras'] = None\n"
        "package = types.ModuleType('vit_keras'); package.__path__ = [%r]\n"
        "sys.modules['vit_keras'] = package\n"
        "p = importlib.import_module('vit_keras.weights.posemb')\n"
        "import numpy as np\n"
        "for m in p.INTERPOLATIONS:\n"
        "    p.resample_position_embeddings(np.ones((1, 17, 2), 'float32'), (3, 5), interpolation=m)\n"
        "print('ok')\n") % PACKAGE_DIR
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
