"""Intermediate features: the encoder blocks' token activations as a model of their own.

`build_feature_extractor(model, blocks, output, norm)` returns a functional `keras.Model` on the
model's input whose outputs are chosen encoder blocks' activations, as tokens, as a patch grid (for
dense prediction) or pooled as the model's own head pools them (for linear probing).
`intermediate_features` runs it over a batch of images and returns NumPy arrays.

The extractor is made of the model's own layers (no copies): training it trains the model, and it
saves and reloads with `keras.models.load_model` after `import vit_keras`. Its graph stops at the
last block asked for.
"""

import numbers
import re

import keras
from keras import ops
import numpy as np

from vit_keras import model as vit_model
from vit_keras.model import failed_calls, geometry

OUTPUTS = ("tokens", "grid", "pooled")


@keras.saving.register_keras_serializable(package="vit_keras")
class TokensToGrid(keras.layers.Layer):
    """Drops the prefix tokens (the class token) and lays the patch tokens out on their grid.

    Input: `(batch, num_prefix_tokens + rows * cols, hidden)`, patch tokens row-major.
    Output: `(batch, rows, cols, hidden)`.

    With `grid=None` (models of dynamic image size) the grid is read on every call from a second
    input, the patch embedding's `(batch, rows, cols, hidden)` output: `layer(tokens, patch_grid)`.
    """

    def __init__(self, grid=None, num_prefix_tokens=0, **kwargs):
        super().__init__(**kwargs)
        self.grid = None if grid is None else geometry.pair(grid, "token grid")
        self.num_prefix_tokens = int(num_prefix_tokens)
        if self.num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be 0 or more; got {num_prefix_tokens}.")

    def build(self, x_shape, patch_grid_shape=None):
        if self.grid is None:
            return
        rows, cols = self.grid
        expected = self.num_prefix_tokens + rows * cols
        if len(x_shape) != 3 or x_shape[1] not in (None, expected):
            raise ValueError(
                f"{self.name} expects tokens of shape (batch, {expected}, hidden) "
                f"({self.num_prefix_tokens} prefix tokens and a {rows}x{cols} grid); got shape "
                f"{tuple(x_shape)}.")

    def call(self, x, patch_grid=None):
        if self.grid is not None:
            rows, cols = self.grid
        elif patch_grid is None:
            raise ValueError(f"{self.name} has no fixed grid: call it as layer(tokens, patch_grid).")
        else:
            rows, cols = ops.shape(patch_grid)[1], ops.shape(patch_grid)[2]
        return ops.reshape(x[:, self.num_prefix_tokens:], (-1, rows, cols, x.shape[-1]))

    def compute_output_shape(self, x_shape, patch_grid_shape=None):
        grid = self.grid or (patch_grid_shape or (None, None, None))[1:3]
        return (x_shape[0], *grid, x_shape[-1])

    def get_config(self):
        return {**super().get_config(), "grid": None if self.grid is None else list(self.grid),
                "num_prefix_tokens": self.num_prefix_tokens}


def _select_blocks(blocks, count):
    """`blocks` as `build_feature_extractor` takes it → a list of block indices in `[0, count)`."""
    if blocks is None:
        return list(range(count))
    if isinstance(blocks, bool):
        raise ValueError(f"blocks must be None, an int or a list of block indices; got {blocks!r}.")
    if isinstance(blocks, numbers.Integral):
        if not 1 <= blocks <= count:
            raise ValueError(
                f"blocks={blocks} asks for the last {blocks} blocks; the model has {count}, so "
                f"pass an int from 1 to {count}, or a list of indices (e.g. [-1] for the last "
                f"block).")
        return list(range(count - int(blocks), count))
    try:
        indices = list(blocks)
    except TypeError:
        raise ValueError(f"blocks must be None, an int or a list of block indices; got "
                         f"{blocks!r}.") from None
    if not indices:
        raise ValueError("blocks is an empty list; name at least one block index.")
    selected = []
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise ValueError(f"Block indices are ints; got {index!r} in blocks={blocks!r}.")
        if not -count <= index < count:
            raise ValueError(
                f"Block index {index} is out of range for a model with {count} encoder blocks; "
                f"valid indices are {-count} to {count - 1}.")
        selected.append(int(index) % count)
    repeated = sorted({i for i in selected if selected.count(i) > 1})
    if repeated:
        raise ValueError(f"blocks={blocks!r} names block(s) {repeated} more than once.")
    return selected


def build_feature_extractor(model, blocks=None, output="tokens", norm=True):
    """A `keras.Model` on `model.input` giving the chosen encoder blocks' activations.

    Args:
      model: a model from `build_model` (ViT, GAP or hybrid) or loaded from a vit_keras .keras file.
      blocks: which encoder blocks: `None` for all; an int `n` for the last `n`; or a list of
        indices, negative ones counting from the end (`[-1]` is the last block, `[0, 5, 11]`
        three of ViT-B's twelve). Outputs come in the order given.
      output: `"tokens"` gives `(batch, tokens, hidden)`, the prefix tokens first (class,
        distillation, registers: `vit_keras.inspection.analysis.prefix_tokens(model)`), then the patch
        tokens row-major; `"grid"` gives the patch tokens alone (no registers) as `(batch, rows,
        cols, hidden)` on the model's token grid (`vit_keras.token_grid(model)`; for hybrids the
        ResNet feature map's; for a model of dynamic image size, the input image's); `"pooled"`
        gives `(batch, hidden)`, pooled by the model's own layers as its head's input is: the
        class token (DINOv2, CLIP before its projection), the mean of the patch tokens (GAP,
        MAE), the attention-pooling head's output (SigLIP's MAP), or for DeiT distilled the mean
        of the class and distillation tokens (timm's pre-logits; each head reads one of them).
        A representation layer (`pre_logits`) is not applied.
      norm: apply the model's final LayerNorm, its weights shared: `encoder_norm` to every chosen
        block's tokens, as the model does to the last block's before pooling; for a model with
        `fc_norm` (MAE fine-tuning), which has no LayerNorm on its tokens (timm's `norm` is an
        identity there), `fc_norm` after pooling, and tokens and grids come as the blocks give
        them. With `norm=True` the last block's `"pooled"` output is what the model's head (or
        `pre_logits`) takes in (`include_top=False`'s output).

    Returns:
      A functional `keras.Model` built from the model's own layers: its outputs are a list with one
      tensor per chosen block, or one tensor when one block is chosen. The output layers are named
      `f"{output}_{index}"` (e.g. `tokens_11`). Training it trains `model`.

    Raises:
      ValueError: for a block index out of range, an unknown `output`, or a model without the
        layers an option needs (`encoder_norm` or `fc_norm` for `norm=True`, a `TokenPooling` or
        `MAPHead` for `"pooled"`).
    """
    if output not in OUTPUTS:
        raise ValueError(f"Unknown output {output!r}; expected one of {OUTPUTS}.")
    vit = vit_model.ViT.of(model)
    selected = _select_blocks(blocks, len(vit.blocks))
    # A model has a LayerNorm on its tokens (encoder_norm) or one after pooling (fc_norm).
    fc_norm = vit.fc_norm if norm else None
    encoder_norm = vit.encoder_norm if norm else None
    if output == "grid":
        # Every prefix token: those with position embeddings and registers without.
        prefix = vit.num_prefix_tokens
        grid = None if vit.dynamic_image_size else vit.token_grid
        patch_grid = vit.patch_embedding.output if vit.dynamic_image_size else None

    outputs = []
    for index in selected:
        x = vit.blocks[index].output
        if encoder_norm is not None:
            x = encoder_norm(x)
        if output == "pooled":
            x = vit.pooling.pooled(x)
            if fc_norm is not None:
                x = fc_norm(x)
        # Named outputs, in the dtype they come in (encoder_norm's float32 under mixed precision).
        name, dtype = f"{output}_{index}", x.dtype
        if output == "grid":
            to_grid = TokensToGrid(grid, prefix, dtype=dtype, name=name)
            x = to_grid(x) if grid is not None else to_grid(x, patch_grid)
        else:
            x = keras.layers.Identity(dtype=dtype, name=name)(x)
        outputs.append(x)
    # TensorFlow takes a model's name as a name scope, where "+" (in hybrids' names) is refused.
    extractor_name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{vit.name}_features")
    # Its failing `predict` keeps the weights it shares with `vit` (`failed_calls`).
    return failed_calls.FailSafeModel(vit.input, outputs[0] if len(outputs) == 1 else outputs,
                                      name=extractor_name)


def intermediate_features(model, images, blocks=None, output="tokens", norm=True, batch_size=16):
    """The chosen encoder blocks' activations for a batch of images, as NumPy arrays.

    Args:
      model: a model from `build_model` (or a loaded one).
      images: `(batch, height, width, channels)`, as the model takes them.
      blocks: as in `build_feature_extractor`.
      output: as in `build_feature_extractor`.
      norm: as in `build_feature_extractor`.
      batch_size: images per forward pass.

    Returns:
      One array per chosen block, in a list (or the array alone when one block is chosen):
      `(batch, tokens, hidden)` for `"tokens"`, `(batch, rows, cols, hidden)` for `"grid"`,
      `(batch, hidden)` for `"pooled"`. Computed in inference mode (no dropout).
    """
    images = np.asarray(images)
    if not len(images):
        raise ValueError(f"Expected at least one image; got an array of shape {images.shape}.")
    extractor = build_feature_extractor(model, blocks, output=output, norm=norm)
    chunks = []
    for start in range(0, len(images), batch_size):
        result = extractor.predict_on_batch(images[start:start + batch_size])
        chunks.append(result if isinstance(result, (list, tuple)) else [result])
    arrays = [np.concatenate([np.asarray(chunk[i]) for chunk in chunks])
              for i in range(len(chunks[0]))]
    return arrays if isinstance(extractor.output, (list, tuple)) else arrays[0]
