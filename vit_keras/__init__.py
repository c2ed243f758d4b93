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

import importlib as _importlib
import sys as _sys

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
)
from vit_keras.model.mlp import GeGLUBlock, SiLUMlpBlock, SwiGLUBlock
from vit_keras.model.normalization import NORMALIZATIONS, Normalization, PixelNormalization
from vit_keras.model.position_embeddings import RotaryEmbedding, RotaryPositions, RotaryRotation
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

# Where the core's modules lived before the sub-packages (the API page's names of 21b95ce):
# `import vit_keras.layers` and `from vit_keras.checkpoints import timm` keep working, each the
# one module it now is (tests/test_public_api.py).
_MOVED = {
    **{name: f"vit_keras.model.{name}" for name in (
        "attention", "configs", "geometry", "heads", "interpolation_ops", "kernels", "layers",
        "normalization", "resnet", "xla_cpu")},
    **{name: f"vit_keras.weights.{name}" for name in (
        "checkpoints", "download", "download_http", "keras_files", "labels", "patch_resize",
        "posemb", "pretrained", "release_files", "releases")},
    **{name: f"vit_keras.weights.checkpoints.{name}" for name in (
        "files", "huggingface", "loader", "names", "npz", "timm")},
    **{name: f"vit_keras.inspection.{name}" for name in ("analysis", "features")},
    **{name: f"vit_keras.training.{name}" for name in (
        "fewshot", "layer_decay", "masked_patch_prediction", "schedules")},
}
for _old, _new in _MOVED.items():
    _module = _importlib.import_module(_new)
    if _new.startswith("vit_keras.weights.checkpoints."):
        _sys.modules[f"vit_keras.checkpoints.{_old}"] = _module
    else:
        _sys.modules[f"vit_keras.{_old}"] = _module
        globals().setdefault(_old, _module)
del _old, _new, _module

__all__ = [
    "ViT",
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
