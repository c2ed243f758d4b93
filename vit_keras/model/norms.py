"""The norm slot: the normalisation before each residual branch and after the encoder.

`NORMS` names each implementation (`ViTConfig.norm`); `make_norm` builds the one a config names,
a layer over the last axis of `(batch, tokens, hidden)`. A new norm is one entry here, and the
checkpoint readers that hold it name it (`vit_keras.weights.checkpoints.loader` tells RMSNorm by its
missing biases).

- `"layer_norm"`: Keras' `LayerNormalization` (the paper's, with `ViTConfig.layer_norm_epsilon`).
- `"rms_norm"`: Keras' `RMSNormalization`, `x / sqrt(mean(x^2) + epsilon) * scale`, no bias
  (AIMv2's).
"""

import keras


def _layer_norm(epsilon, dtype=None, name=None):
    return keras.layers.LayerNormalization(epsilon=epsilon, dtype=dtype, name=name)


def _rms_norm(epsilon, dtype=None, name=None):
    return keras.layers.RMSNormalization(epsilon=epsilon, dtype=dtype, name=name)


NORMS = {"layer_norm": _layer_norm, "rms_norm": _rms_norm}
"""The norms by the name a `ViTConfig.norm` gives: `(epsilon, dtype, name)` → a layer."""


def make_norm(kind, epsilon, dtype=None, name=None):
    """A norm of `kind` (one of `NORMS`)."""
    if kind not in NORMS:
        raise ValueError(f"Unknown norm {kind!r}; expected one of {sorted(NORMS)}.")
    return NORMS[kind](epsilon, dtype=dtype, name=name)
