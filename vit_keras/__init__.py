"""vit_keras: the Vision Transformer (Dosovitskiy et al., ICLR 2021) in Keras 3, on every backend.

Importing this package registers its layers and the learning-rate schedule the training apps
save, so `keras.models.load_model` reads vit_keras models, compiled ones included, with nothing
else imported. It loads no TensorFlow on the JAX and torch backends and changes no
process-wide state.

The library core is four sub-packages: `model` (the `ViT` and its parts), `weights` (releases,
checkpoints, `build_model`), `inspection` (analysis, intermediate features) and `training` (the
Keras objects a trained model carries). The application half (data pipelines, recipes, training
runs, export, figures) is `vit_keras.tools`, which the core never imports.
"""

import sys as _sys

from vit_keras import _moved
from vit_keras.host_memory import keep_freed_host_memory
from vit_keras.inspection.analysis import (
    attention_rollout,
    embedding_filter_components,
    mean_attention_distance,
    position_embedding_similarity,
    token_grid,
    token_size_pixels,
)
from vit_keras.inspection.features import build_feature_extractor, intermediate_features
from vit_keras.model.configs import VARIANTS, ViTConfig, get_config
from vit_keras.model.failed_calls import FailSafeModel
from vit_keras.model.heads import MAPHead, TokenPooling
from vit_keras.model.layers import (
    AddPositionEmbs,
    ClassToken,
    DistillationToken,
    HeadsProjection,
    LayerScale,
    MlpBlock,
    MultiHeadDotProductAttention,
    PatchEmbedding,
    RegisterTokens,
    TransformerBlock,
    ValidTokens,
)
from vit_keras.model.mlp import GeGLUBlock, SiLUMlpBlock, SwiGLUBlock
from vit_keras.model.naflex_patches import naflex_patches, naflex_size
from vit_keras.model.pixel_normalization import NORMALIZATIONS, Normalization, PixelNormalization
from vit_keras.model.position_embeddings import (
    NaFlexPositionEmbs,
    RotaryEmbedding,
    RotaryPositions,
    RotaryRotation,
)
from vit_keras.model.resnet import ResidualUnit, ResNetStage, ResNetStem, StdConv2D
from vit_keras.model.vit import ViT, attention_scores, with_dynamic_image_size

# Imported for what they register with Keras' serialization: the MPP layers, the training
# recipes' WarmupSchedule and layer-decay optimizers, so that `import vit_keras` is all a saved
# model needs.
from vit_keras.training import fewshot, layer_decay, masked_patch_prediction, schedules  # noqa: F401
from vit_keras.training.masked_patch_prediction import build_pretraining_model, pretrained_encoder
from vit_keras.weights.checkpoints import load_pretrained, save_npz
from vit_keras.weights.keras_files import check_keras_file
from vit_keras.weights.labels import class_names
from vit_keras.weights.patch_resize import resample_patch_embedding
from vit_keras.weights.posemb import resample_position_embeddings
from vit_keras.weights.pretrained import build_model, build_model_from_checkpoint
from vit_keras.weights.releases import Release, list_weights

__version__ = "0.1.0"

# The old module paths (`vit_keras.layers`, `vit_keras.checkpoints.timm`, ...), each a stand-in for
# the module it now is, behind a dated DeprecationWarning.
_moved.register(_sys.modules[__name__])

__all__ = [
    "ViT",
    "FailSafeModel",
    "build_model",
    "build_model_from_checkpoint",
    "with_dynamic_image_size",
    "list_weights",
    "Release",
    "class_names",
    "load_pretrained",
    "save_npz",
    "VARIANTS",
    "ViTConfig",
    "get_config",
    "PatchEmbedding",
    "ClassToken",
    "AddPositionEmbs",
    "NaFlexPositionEmbs",
    "naflex_patches",
    "naflex_size",
    "ValidTokens",
    "MultiHeadDotProductAttention",
    "MlpBlock",
    "SwiGLUBlock",
    "GeGLUBlock",
    "SiLUMlpBlock",
    "RotaryPositions",
    "RotaryEmbedding",
    "RotaryRotation",
    "TransformerBlock",
    "TokenPooling",
    "DistillationToken",
    "RegisterTokens",
    "LayerScale",
    "HeadsProjection",
    "MAPHead",
    "PixelNormalization",
    "Normalization",
    "NORMALIZATIONS",
    "StdConv2D",
    "ResidualUnit",
    "ResNetStage",
    "ResNetStem",
    "resample_position_embeddings",
    "resample_patch_embedding",
    "attention_scores",
    "build_feature_extractor",
    "intermediate_features",
    "build_pretraining_model",
    "pretrained_encoder",
    "masked_patch_prediction",
    "fewshot",
    "attention_rollout",
    "mean_attention_distance",
    "position_embedding_similarity",
    "embedding_filter_components",
    "token_grid",
    "token_size_pixels",
    "keep_freed_host_memory",
    "check_keras_file",
]
