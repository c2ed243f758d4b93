"""The architecture: the `ViT` model and its parts, in Keras 3 and nothing else (no TensorFlow,
JAX or torch at import), so one model runs on every backend.

- `vit.py`: `ViT`, the model that owns its structure; `with_dynamic_image_size`,
  `attention_scores`.
- `configs.py`: the variant table.
- `layers.py`: the token layers and the encoder block; the block's slots, each a table of
  implementations: `attention.py` (and its kernels per device), `mlp.py`, `norms.py`,
  `position_embeddings.py`; the poolings and heads in `heads.py`.
- `resnet.py`: the hybrids' BiT ResNet; `normalization.py`: input pixel normalisation.
- `geometry.py`, `initializers.py`, `interpolation_ops.py`; `kernels.py` and `xla_cpu.py`: how
  the layers compute on each backend and device.
"""

from vit_keras.model.vit import (  # noqa: F401
    CLASSIFIERS,
    ViT,
    attention_scores,
    build_vit,
    transformer_blocks,
    with_dynamic_image_size,
)
