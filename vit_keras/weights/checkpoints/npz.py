"""vit_jax and big_vision `.npz` checkpoints: read into the canonical layout, write the official one.

big_vision's NaFlex ViT (`models/proj/image_text/naflex_vit.py`, SigLIP 2's NaFlex towers) stores
its patch embedding as a `Dense` over flattened (row, column, channel) RGB patches, `(patch *
patch * 3, width)`, and its position grid as `(rows, cols, width)`; it resizes the grid per image
bilinearly with antialiasing (`jax.image.scale_and_translate`) and its MLPs compute Flax's
(tanh) GELU. Such a file reads as a NaFlex model with those settings (`_naflex`)."""


import numpy as np

from vit_keras import atomic_files, errors
from vit_keras.model import pixel_normalization
from vit_keras.weights.checkpoints import files, names

NORMALIZATION = "vit_keras/input_normalization/"
"""The prefix of the two arrays (`mean`, `std`) that keep a model's input normalisation in an
`.npz` `save_npz` writes, when it is not the original weights' `(x - 127.5) / 127.5`."""


def read(path):
    """`(canonical params, info)` from a vit_jax (pre-Linen or Linen names, `opt/target/`) or
    big_vision (`params/`, stacked blocks) `.npz`."""
    arrays = files.read_npz(path)
    if not any(p + names.EMBEDDING_KERNEL in arrays for p in ("",) + names.NPZ_PREFIXES):
        raise errors.CheckpointError(
            f"{path!r} is an .npz file but not a ViT checkpoint: no `embedding/kernel` (with or "
            f"without an {'/'.join(names.NPZ_PREFIXES)} prefix). First keys: {sorted(arrays)[:5]}.")
    stored = {which: arrays.pop(NORMALIZATION + which, None) for which in ("mean", "std")}
    params, fmt = names.from_npz(arrays)
    # vit_jax resamples position embeddings with scipy.ndimage.zoom(order=1).
    info = {"format": fmt, "interpolation": "vit_jax", "antialias": False}
    if np.ndim(params[names.EMBEDDING_KERNEL]) == 2:
        params, grid = _naflex(params, path)
        info.update(naflex=True, posemb_interpolation="bilinear", gelu="tanh", grid=grid)
    if stored["mean"] is not None and stored["std"] is not None:
        try:
            stored = pixel_normalization.get_normalization((stored["mean"], stored["std"]))
        except ValueError as error:
            raise errors.CheckpointError(f"{path!r}: its {NORMALIZATION}* arrays: {error}") \
                from None
        info.update(normalization=stored,
                    normalization_source=f"the {NORMALIZATION}* arrays of the .npz")
    else:  # vit_jax's and big_vision's files: the original weights' convention
        info.update(normalization=pixel_normalization.PAPER,
                    normalization_source="the .npz format (the original weights' convention)")
    return params, info


def _naflex(params, path):
    """`(params, grid)`: big_vision's NaFlex patch embedding as a conv kernel `(patch, patch, 3,
    width)` and its `(rows, cols, width)` grid as `(1, rows * cols, width)` (see the module)."""
    params = dict(params)
    kernel = np.asarray(params[names.EMBEDDING_KERNEL])
    patch = int(round((kernel.shape[0] / 3) ** 0.5))
    if patch * patch * 3 != kernel.shape[0]:
        raise errors.CheckpointError(
            f"{path!r}: its patch embedding is a Dense of {kernel.shape[0]} inputs, not the "
            f"patch x patch x 3 values of an RGB patch of big_vision's NaFlex ViT.")
    params[names.EMBEDDING_KERNEL] = kernel.reshape(patch, patch, 3, kernel.shape[1])
    grid = None
    position = params.get(names.POSEMB)
    if position is not None and np.ndim(position) == 3 and position.shape[0] != 1:
        grid = tuple(int(side) for side in position.shape[:2])
        params[names.POSEMB] = np.asarray(position).reshape(1, grid[0] * grid[1], -1)
    return params, grid


def write(path, params, input_normalization=None):
    """Writes canonical params as an uncompressed `.npz` at exactly `path` (the official layout),
    atomically, with the model's input normalisation as two extra arrays where it is not the
    original weights' (vit_jax and timm read the arrays they know and leave these)."""
    arrays = {key: np.asarray(value) for key, value in params.items()}
    if input_normalization is not None and not input_normalization.matches(pixel_normalization.PAPER):
        arrays[NORMALIZATION + "mean"] = np.asarray(input_normalization.mean, np.float64)
        arrays[NORMALIZATION + "std"] = np.asarray(input_normalization.std, np.float64)
    with atomic_files.replacing(path) as temporary, open(temporary, "wb") as f:
        np.savez(f, **arrays)
