"""Position-embedding resampling for a new image size, in NumPy (no SciPy, no torch).

Three interpolations, each reproducing a reference implementation to float precision:

- `"vit_jax"`: the original release (vit_jax `checkpoint.py`): `scipy.ndimage.zoom(grid, zoom,
  order=1)`, i.e. linear interpolation with the corners aligned: output index `i` reads input
  coordinate `i * (in - 1) / (out - 1)`.
- `"bilinear"`, `"bicubic"`: PyTorch's `F.interpolate(..., align_corners=False)` as timm and Hugging
  Face use it (`"bilinear"` is what timm's `.npz` loader uses, `"bicubic"` with `antialias=True` what
  timm uses for its own state dicts, `"bicubic"` without antialias what Hugging Face uses at run time).
  `antialias=True` reproduces PyTorch's antialiased kernels (PIL's: the filter support widens when
  downsampling, and bicubic uses a = -0.5 instead of -0.75, also when upsampling).

Every method is separable: it builds one `(out, in)` weight matrix per axis and applies both in
float64, then casts back to the input dtype.
"""

import math

import numpy as np

from vit_keras.model import geometry

INTERPOLATIONS = ("vit_jax", "bilinear", "bicubic")


def _zoom_linear_weights(in_size, out_size):
    """`scipy.ndimage.zoom(order=1)` along one axis (grid_mode=False, SciPy's default)."""
    # SciPy: zoom = (in - 1) / (out - 1), or 1 when out == 1; output i reads coordinate i * zoom.
    zoom = (in_size - 1) / (out_size - 1) if out_size > 1 else 1.0
    weights = np.zeros((out_size, in_size))
    for i in range(out_size):
        coordinate = min(i * zoom, in_size - 1)
        start = min(int(math.floor(coordinate)), in_size - 1)
        fraction = coordinate - start
        weights[i, start] += 1.0 - fraction
        if fraction > 0:
            weights[i, start + 1] += fraction
    return weights


def _cubic(x, a):
    """Keys' cubic convolution kernel with parameter `a` (PyTorch: -0.75; PIL and antialias: -0.5)."""
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return 0.0


def _torch_weights(in_size, out_size, interpolation):
    """`F.interpolate(mode=interpolation, align_corners=False, antialias=False)` along one axis."""
    scale = in_size / out_size
    weights = np.zeros((out_size, in_size))
    for i in range(out_size):
        source = scale * (i + 0.5) - 0.5
        if interpolation == "bilinear":
            source = max(source, 0.0)
            start = int(source)
            fraction = source - start
            weights[i, start] += 1.0 - fraction
            weights[i, min(start + 1, in_size - 1)] += fraction
        else:  # bicubic: four taps, indices clamped to the border.
            start = int(math.floor(source))
            fraction = source - start
            for tap in range(-1, 3):
                index = min(max(start + tap, 0), in_size - 1)
                weights[i, index] += _cubic(tap - fraction, -0.75)
    return weights


def _torch_antialias_weights(in_size, out_size, interpolation):
    """`F.interpolate(..., align_corners=False, antialias=True)` along one axis (PIL's filters)."""
    scale = in_size / out_size
    taps = 2 if interpolation == "bilinear" else 4
    support = taps * 0.5 * scale if scale >= 1.0 else taps * 0.5
    inverse_scale = 1.0 / scale if scale >= 1.0 else 1.0
    weights = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = scale * (i + 0.5)
        first = max(int(center - support + 0.5), 0)  # int() truncates toward zero, as in C++.
        last = min(int(center + support + 0.5), in_size)
        for j in range(first, last):
            x = (j - center + 0.5) * inverse_scale
            weights[i, j] = max(0.0, 1.0 - abs(x)) if interpolation == "bilinear" else _cubic(x, -0.5)
        total = weights[i].sum()
        if total != 0.0:
            weights[i] /= total
    return weights


def _axis_weights(in_size, out_size, interpolation, antialias):
    if interpolation == "vit_jax":
        if antialias:
            raise ValueError('antialias applies to "bilinear" and "bicubic", not to "vit_jax".')
        return _zoom_linear_weights(in_size, out_size)
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"Unknown interpolation {interpolation!r}; expected one of {INTERPOLATIONS}.")
    if antialias:
        return _torch_antialias_weights(in_size, out_size, interpolation)
    return _torch_weights(in_size, out_size, interpolation)


def resize_grid(grid, new_grid, *, interpolation="vit_jax", antialias=False):
    """Resizes a `(rows, cols, channels)` array to `new_grid` (`int` or `(rows, cols)`).

    Same-size input is returned unchanged (the very same array). The result has the input's dtype.
    """
    grid = np.asarray(grid)
    if grid.ndim != 3:
        raise ValueError(f"resize_grid expects (rows, cols, channels); got shape {grid.shape}.")
    rows, cols = geometry.pair(new_grid, "token grid")
    if rows < 1 or cols < 1:
        raise ValueError(f"The new grid must be at least 1x1; got {rows}x{cols}.")
    if (rows, cols) == grid.shape[:2]:
        return grid
    row_weights = _axis_weights(grid.shape[0], rows, interpolation, antialias)
    col_weights = _axis_weights(grid.shape[1], cols, interpolation, antialias)
    out = np.einsum("ah,hwc,bw->abc", row_weights, grid.astype(np.float64), col_weights)
    return out.astype(grid.dtype)


def resample_position_embeddings(posemb, new_grid, *, num_prefix_tokens=1, old_grid=None,
                                 interpolation="vit_jax", antialias=False):
    """Resamples position embeddings to another patch grid, keeping the prefix (class-token) rows.

    Args:
      posemb: `(1, num_prefix_tokens + rows * cols, hidden)`, patches row-major (the layout of
        vit_jax, timm and Hugging Face).
      new_grid: the target patch grid, `int` or `(rows, cols)` (`image_size // patch_size`);
        rectangular grids are fine.
      num_prefix_tokens: leading rows copied unchanged: the tokens the position embeddings cover
        before the patches (1 with a class token, 2 for DeiT distilled, 0 for a GAP model and
        where they cover the patches only: DeiT III, DINOv2 with registers). Register tokens
        never have a row.
      old_grid: the checkpoint's grid `(rows, cols)`; inferred when it is square.
      interpolation: `"vit_jax"` (default: `scipy.ndimage.zoom(order=1)`, corner-aligned linear,
        as the original release), `"bilinear"` or `"bicubic"` (PyTorch `align_corners=False`).
      antialias: with `"bilinear"`/`"bicubic"`, PyTorch's `antialias=True` kernels.

    Returns:
      `(1, num_prefix_tokens + new_rows * new_cols, hidden)`, the input's dtype. The input itself
      when the grid does not change (an exact no-op).
    """
    posemb = np.asarray(posemb)
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(f"Position embeddings must have shape (1, tokens, hidden); got {posemb.shape}.")
    num_grid_tokens = posemb.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = math.isqrt(max(num_grid_tokens, 0))
        if side * side != num_grid_tokens or side == 0:
            raise ValueError(
                f"Cannot infer the grid of {posemb.shape[1]} position embeddings with "
                f"{num_prefix_tokens} prefix token(s): {num_grid_tokens} is not a square; pass "
                f"old_grid=(rows, cols).")
        old_grid = (side, side)
    old_rows, old_cols = geometry.pair(old_grid, "token grid")
    if old_rows * old_cols != num_grid_tokens:
        raise ValueError(
            f"old_grid {old_rows}x{old_cols} does not match {num_grid_tokens} position embeddings "
            f"(shape {posemb.shape}, {num_prefix_tokens} prefix token(s)).")
    new_rows, new_cols = geometry.pair(new_grid, "token grid")
    if (new_rows, new_cols) == (old_rows, old_cols):
        return posemb
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
    grid = grid.reshape(old_rows, old_cols, -1)
    grid = resize_grid(grid, (new_rows, new_cols), interpolation=interpolation, antialias=antialias)
    return np.concatenate([prefix, grid.reshape(1, new_rows * new_cols, -1)], axis=1)
