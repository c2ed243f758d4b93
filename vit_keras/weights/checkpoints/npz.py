"""vit_jax and big_vision `.npz` checkpoints: read into the canonical layout, write the official one."""

import numpy as np

from vit_keras import errors
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


def write(path, params, input_normalization=None):
    """Writes canonical params as an uncompressed `.npz` at exactly `path` (the official layout),
    with the model's input normalisation as two extra arrays where it is not the original
    weights' (vit_jax and timm read the arrays they know and leave these)."""
    arrays = {key: np.asarray(value) for key, value in params.items()}
    if input_normalization is not None and not input_normalization.matches(pixel_normalization.PAPER):
        arrays[NORMALIZATION + "mean"] = np.asarray(input_normalization.mean, np.float64)
        arrays[NORMALIZATION + "std"] = np.asarray(input_normalization.std, np.float64)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
