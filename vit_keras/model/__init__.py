"""The architecture: the `ViT` model and its parts, in Keras 3 and nothing else (no TensorFlow,
JAX or torch at import), so one model runs on every backend.

- `vit.py`: `ViT`, the model that owns its structure; `with_dynamic_image_size`,
  `attention_scores`. `failed_calls.py`: `FailSafeModel`, its base, whose failing `fit`,
  `evaluate` or `predict` keeps the weights.
- `configs.py`: the variant table.
- `layers.py`: the token layers and the encoder block; the block's slots, each a table of
  implementations: `attention.py` (and its kernels per device), `mlp.py`, `norms.py`,
  `position_embeddings.py`; the poolings and heads in `heads.py`.
- `resnet.py`: the hybrids' BiT ResNet; `pixel_normalization.py`: input pixel normalisation;
  `naflex_patches.py`: images of any sizes as NaFlex inputs (padded sequences of patches).
- `geometry.py`, `initializers.py`, `interpolation_ops.py`; `backend_ops.py` and `xla_cpu.py`:
  how the layers compute on each backend and device.
"""

import sys as _sys

from vit_keras import _moved

# The model's names, imported from vit.py when first asked for.
_FROM_VIT = ("CLASSIFIERS", "ViT", "attention_scores", "transformer_blocks",
             "with_dynamic_image_size")


def __getattr__(name):
    if name in _FROM_VIT:
        from vit_keras.model import vit

        return getattr(vit, name)
    raise AttributeError(f"module 'vit_keras.model' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_FROM_VIT])


_moved.register(_sys.modules[__name__])  # kernels.py and normalization.py, renamed
