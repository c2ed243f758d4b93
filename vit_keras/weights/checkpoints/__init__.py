"""Checkpoints in and out of vit_keras models: vit_jax and big_vision `.npz`, timm and Hugging Face
state dicts. One module per format; `names.py` alone knows the key names; `loader.py` does the
rest. Building a model from a file is `vit_keras.weights.pretrained`'s job: this package builds
no models."""

from vit_keras.weights.checkpoints.loader import (
    Checkpoint,
    architecture,
    load_pretrained,
    read_checkpoint,
    save_npz,
)

__all__ = ["Checkpoint", "architecture", "load_pretrained", "read_checkpoint", "save_npz"]
