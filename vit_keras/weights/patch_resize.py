"""Patch-size resampling of the patch-embedding kernel (FlexiViT's "PI-resize"), in NumPy.

A ViT embeds a `p x p` patch `x` as `<x, w>` (one kernel `w` per input and output channel). Run at
patch size `q`, the same image region reaches the model resized to `q x q`: `resize(x) = B x`, with
`B` the `(q*q, p*p)` matrix of bilinear resizing. FlexiViT (Beyer et al., CVPR 2023) asks for a
kernel `w_new` with `<B x, w_new> = <x, w_old>` for every `x`, i.e. `B.T w_new = w_old`, and takes
the least-squares solution `w_new = pinv(B.T) w_old`:

- `q >= p` (upsampling the patch): `B` has full column rank, the equation has solutions and the
  pseudo-inverse gives one exactly: token embeddings are unchanged for every patch.
- `q < p`: there are more equations than unknowns; `pinv` minimises the error for white-noise
  patches. Smooth (natural-image) patches keep their embedding approximately.

Resizing the kernel itself with `B` would not do this: upsampling 16 → 32 sums 4x as many pixels,
so every embedding would grow about 4x.

`B` is the bilinear resize of `tf.image.resize(..., "bilinear", antialias=False)` (what big_vision's
`resample_patchemb` uses) and of `jax.image.resize(..., "bilinear", antialias=False)`: half-pixel
centres, output `i` reads input coordinate `(i + 0.5) * p / q - 0.5` clamped to `[0, p - 1]`, no
antialiasing. That is PyTorch's `align_corners=False` bilinear, which `posemb` already implements;
it is reused here. Bilinear resizing is separable, `B = R ⊗ C` (rows ⊗ columns), and the
pseudo-inverse of a Kronecker product is the product of the pseudo-inverses, so one small matrix
per axis does the work of the dense `(q*q, p*p)` one.
"""

import numpy as np

from vit_keras.model import geometry
from vit_keras.weights import posemb


def _bilinear_matrix(in_size, out_size):
    """The `(out_size, in_size)` matrix of 1-D bilinear resizing (half-pixel centres, no
    antialias): row `i` holds the weights output `i` gives each input sample."""
    one_hot = np.eye(in_size)[:, None, :]  # `in_size` one-hot signals, as a (in, 1, in) grid
    return posemb.resize_grid(one_hot, (out_size, 1), interpolation="bilinear")[:, 0, :]


def resample_patch_embedding(kernel, new_patch_size):
    """Resamples a patch-embedding kernel to another patch size, keeping token embeddings (PI-resize).

    A checkpoint trained at patch 16 then runs at patch 8 (4x the tokens) or 32: `resize(x)` of a
    patch `x` embedded with the new kernel gives `x`'s embedding under the old one, exactly when the
    patch grows (`new >= old` on both axes), in the least-squares sense when it shrinks. See the
    module docstring for the math and the resize convention.

    Args:
      kernel: `(patch_h, patch_w, in_channels, hidden)`, HWIO (the `.npz` and Keras `Conv2D`
        layout, `embedding/kernel`).
      new_patch_size: `int` or `(height, width)`; non-square patches are fine.

    Returns:
      `(new_h, new_w, in_channels, hidden)` in the kernel's dtype (computed in float64). A copy of
      the kernel, exactly, when the size does not change.
    """
    kernel = np.asarray(kernel)
    if kernel.ndim != 4:
        raise ValueError(f"A patch-embedding kernel has shape (patch_h, patch_w, in_channels, "
                         f"hidden); got shape {kernel.shape}.")
    new_h, new_w = geometry.pair(new_patch_size, "patch size")
    old_h, old_w = kernel.shape[:2]
    if (new_h, new_w) == (old_h, old_w):
        return kernel.copy()
    rows = np.linalg.pinv(_bilinear_matrix(old_h, new_h).T)  # (new_h, old_h)
    cols = np.linalg.pinv(_bilinear_matrix(old_w, new_w).T)  # (new_w, old_w)
    out = np.einsum("ah,bw,hwio->abio", rows, cols, kernel.astype(np.float64))
    return out.astype(kernel.dtype)
