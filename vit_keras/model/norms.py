"""The norm slot: the normalisation before each residual branch and after the encoder.

`NORMS` names each implementation (`ViTConfig.norm`); a `NormSpec` (the norm and its epsilon,
`norm_spec(config)`) makes the one a config names, a layer over the last axis of `(batch, tokens,
hidden)`. A new norm is one entry here, and the
checkpoint readers that hold it name it (`vit_keras.weights.checkpoints.loader` tells RMSNorm by its
missing biases).

- `"layer_norm"`: Keras' `LayerNormalization` (the paper's, with `ViTConfig.layer_norm_epsilon`).
- `"rms_norm"`: Keras' `RMSNormalization`, `x / sqrt(mean(x^2) + epsilon) * scale`, no bias
  (AIMv2's).
"""

import dataclasses

import keras

from vit_keras.model import specs


def _layer_norm(epsilon, dtype=None, name=None):
    return keras.layers.LayerNormalization(epsilon=epsilon, dtype=dtype, name=name)


def _rms_norm(epsilon, dtype=None, name=None):
    return keras.layers.RMSNormalization(epsilon=epsilon, dtype=dtype, name=name)


NORMS = {"layer_norm": _layer_norm, "rms_norm": _rms_norm}
"""The norms by the name a `ViTConfig.norm` gives: `(epsilon, dtype, name)` → a layer."""



@dataclasses.dataclass(frozen=True)
class NormSpec(specs.Spec):
    """The norm slot's options: which norm (`NORMS`) and its epsilon."""

    kind: str = "layer_norm"
    epsilon: float = 1e-6

    def __post_init__(self):
        if self.kind not in NORMS:
            raise ValueError(f"Unknown norm {self.kind!r}; expected one of {sorted(NORMS)}.")
        object.__setattr__(self, "epsilon", float(self.epsilon))

    def make(self, dtype=None, name=None):
        """The norm layer, over the last axis."""
        return NORMS[self.kind](self.epsilon, dtype=dtype, name=name)


def norm_spec(config):
    """The `NormSpec` of a `ViTConfig` (`norm`, `layer_norm_epsilon`)."""
    return NormSpec(config.norm, config.layer_norm_epsilon)
