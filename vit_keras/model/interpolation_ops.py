"""Position-embedding resampling inside the forward pass, for token grids known only at run time.

`vit_keras.weights.posemb` resamples in NumPy when weights load; a model built with
`dynamic_image_size=True` resamples on every call instead, to whatever grid the input image gives,
so the computation must be made of `keras.ops` that accept a symbolic output size (a SavedModel
signature of `[None, None, None, 3]` traces it once for every size).

The interpolation is timm's for `dynamic_img_size=True` models: PyTorch's
`F.interpolate(mode="bicubic", align_corners=False, antialias=True)` (PIL's bicubic filter, a = -0.5,
whose support widens when downsampling). `keras.ops.image.resize` is not used: its bicubic differs
between backends and has no antialiased upsampling. At the grid the weights were built for, the
weight matrices are the identity exactly, so the embeddings come out bit for bit unchanged.
"""

from keras import ops

_CUBIC_A = -0.5  # PyTorch's antialiased kernels use PIL's a = -0.5, not the -0.75 of plain bicubic.


def _cubic(x):
    """Keys' cubic convolution kernel at `x` (any shape), a = -0.5; zero beyond |x| >= 2."""
    x = ops.abs(x)
    a = _CUBIC_A
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return ops.where(x < 1.0, near, ops.where(x < 2.0, far, ops.zeros_like(x)))


def _triangle(x):
    """The linear interpolation kernel at `x`: 1 - |x|, zero beyond |x| >= 1."""
    return ops.maximum(1.0 - ops.abs(x), 0.0)


# PyTorch's antialiased filters: the kernel and its half-width in input cells (at scale 1).
_FILTERS = {"bicubic": (_cubic, 2.0), "bilinear": (_triangle, 1.0)}
INTERPOLATIONS = tuple(_FILTERS)


def antialiased_weights(in_size, out_size, index, interpolation="bicubic"):
    """The weights `(..., in_size)` float32 by which output cell `index` of an axis resized from
    `in_size` to `out_size` cells reads the input cells, as PyTorch's `F.interpolate(mode=...,
    align_corners=False, antialias=True)` computes them (`"bicubic"`: PIL's filter, a = -0.5;
    `"bilinear"`: the triangle, as transformers and big_vision resize SigLIP 2's grid).

    Args:
      in_size: the axis' length before resizing, a Python int.
      out_size: its length after: an int, or an integer tensor broadcasting against `index`
        (NaFlex: each image's own, `(batch, 1)`).
      index: the output cells, an integer tensor (`(out,)`, or NaFlex's `(batch, tokens)`).
    """
    kernel, half_width = _FILTERS[interpolation]
    in_size = int(in_size)
    scale = in_size / ops.cast(out_size, "float32")  # input cells per output cell
    downsampling = scale >= 1.0
    # expand_dims, not `[..., None]`: tf2onnx has no StridedSlice with an ellipsis and a new axis
    # (ONNX exports of dynamic-size models resize with these weights).
    support = ops.expand_dims(ops.where(downsampling, half_width * scale, half_width), -1)
    inverse_scale = ops.expand_dims(ops.where(downsampling, 1.0 / scale, 1.0), -1)
    center = ops.expand_dims(scale * (ops.cast(index, "float32") + 0.5), -1)  # (..., 1)
    # PyTorch's window of taps [first, last): C++ truncation, which equals floor after the clamp.
    first = ops.maximum(ops.floor(center - support + 0.5), 0.0)
    last = ops.minimum(ops.floor(center + support + 0.5), float(in_size))
    source = ops.cast(ops.arange(in_size), "float32")  # (in,)
    in_window = ops.logical_and(source >= first, source < last)
    weights = ops.where(in_window, kernel((source - center + 0.5) * inverse_scale), 0.0)
    return weights / ops.sum(weights, axis=-1, keepdims=True)


def antialiased_bicubic_weights(in_size, out_size):
    """The `(out_size, in_size)` float32 matrix that resizes one axis as PyTorch's antialiased
    bicubic does (`vit_keras.weights.posemb._torch_antialias_weights` in NumPy, which the tests hold to
    PyTorch itself).

    Args:
      in_size: the axis' length before resizing, a Python int.
      out_size: its length after, a Python int or a scalar integer tensor.
    """
    return antialiased_weights(in_size, out_size, ops.arange(out_size))


def resize_grid(grid, new_grid, interpolation="bicubic", preserve_aspect=False):
    """Resizes a `(rows, cols, hidden)` float32 grid of static shape to `new_grid` `(rows, cols)`
    (ints or scalar tensors), separably: `rows' x cols' x hidden`. With `preserve_aspect`, to a
    square of the longer side, of which the top-left `rows x cols` (timm's
    `pos_embed_ar_preserving`)."""
    rows, cols = new_grid
    row_size, col_size = (ops.maximum(rows, cols),) * 2 if preserve_aspect else (rows, cols)
    row_weights = antialiased_weights(grid.shape[0], row_size, ops.arange(rows), interpolation)
    col_weights = antialiased_weights(grid.shape[1], col_size, ops.arange(cols), interpolation)
    return ops.einsum("ar,rcd,bc->abd", row_weights, grid, col_weights)
