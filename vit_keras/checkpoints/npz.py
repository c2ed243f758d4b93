"""vit_jax and big_vision `.npz` checkpoints: read into the canonical layout, write the official one."""

import numpy as np

from vit_keras import errors
from vit_keras.checkpoints import files, names


def read(path):
    """`(canonical params, info)` from a vit_jax (pre-Linen or Linen names, `opt/target/`) or
    big_vision (`params/`, stacked blocks) `.npz`."""
    arrays = files.read_npz(path)
    if not any(p + names.EMBEDDING_KERNEL in arrays for p in ("",) + names.NPZ_PREFIXES):
        raise errors.CheckpointError(
            f"{path!r} is an .npz file but not a ViT checkpoint: no `embedding/kernel` (with or "
            f"without an {'/'.join(names.NPZ_PREFIXES)} prefix). First keys: {sorted(arrays)[:5]}.")
    params, fmt = names.from_npz(arrays)
    # vit_jax resamples position embeddings with scipy.ndimage.zoom(order=1).
    return params, {"format": fmt, "interpolation": "vit_jax", "antialias": False}


def write(path, params):
    """Writes canonical params as an uncompressed `.npz` at exactly `path` (the official layout)."""
    with open(path, "wb") as f:
        np.savez(f, **{key: np.asarray(value) for key, value in params.items()})
