"""vit_keras: the Vision Transformer (Dosovitskiy et al., ICLR 2021) in Keras 3, on every backend.

Importing this package registers its layers, so `keras.models.load_model` reads vit_keras models
with nothing else imported. It loads no TensorFlow on the JAX and torch backends. On the JAX
backend it also tunes glibc to reuse freed memory (see `vit_keras.xla_cpu`), before JAX starts.
"""

import os as _os

import keras as _keras

if _keras.backend.backend() == "jax" and _os.environ.get("VIT_KERAS_KEEP_HOST_MEMORY") != "0":
    from vit_keras.xla_cpu import keep_freed_host_memory as _keep_freed_host_memory

    _keep_freed_host_memory()

from vit_keras.analysis import (
    attention_rollout,
    embedding_filter_components,
    mean_attention_distance,
    position_embedding_similarity,
    token_grid,
    token_size_pixels,
)
from vit_keras.configs import VARIANTS, ViTConfig, get_config
from vit_keras.layers import (
    AddPositionEmbs,
    ClassToken,
    MlpBlock,
    MultiHeadDotProductAttention,
    PatchEmbedding,
    TokenPooling,
    TransformerBlock,
)
from vit_keras.model import attention_scores, build_model
from vit_keras.resnet import ResidualUnit, ResNetStage, ResNetStem, StdConv2D
from vit_keras.posemb import resample_position_embeddings
from vit_keras.checkpoints import build_model_from_checkpoint, load_pretrained, save_npz

__version__ = "0.1.0"
