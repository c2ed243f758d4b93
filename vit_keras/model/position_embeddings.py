"""The position-encoding slot: how a ViT tells its tokens where they are.

`POSITION_EMBEDDINGS` names each implementation (`ViTConfig.position_embedding`);
`make_position_embedding` builds the one a config names. A new encoding (rotary embeddings,
which act on the attention's queries and keys) is one class here and one entry in the table.

- `"learned"`: `AddPositionEmbs`, the paper's learned absolute embedding added to the tokens.
"""

import keras
from keras import ops

from vit_keras.model import interpolation_ops

_PACKAGE = "vit_keras"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AddPositionEmbs(keras.layers.Layer):
    """Adds a learnable position embedding to every token.

    Input and output: `(batch, tokens, hidden)`. Weight: `pos_embedding` `(1, tokens, hidden)`,
    normal(stddev 0.02). The token count is fixed when the layer is built; a model for another image
    size gets its embedding through `vit_keras.resample_position_embeddings`.

    With `grid_size=(rows, cols)` the layer takes images of any size (`build_model(...,
    dynamic_image_size=True)`): `pos_embedding` holds `num_prefix_tokens + rows * cols`
    embeddings, and `call(tokens, patch_grid)` resamples their grid part on every call to the
    grid of `patch_grid`, the patch embedding's `(batch, rows', cols', hidden)` output
    (`vit_keras.model.interpolation_ops`: timm's bicubic, antialiased). At `(rows, cols)` itself the
    embeddings are added unchanged.
    """

    def __init__(self, initializer=None, grid_size=None, num_prefix_tokens=1, **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(
            initializer or keras.initializers.RandomNormal(stddev=0.02))
        self.grid_size = None if grid_size is None else tuple(int(side) for side in grid_size)
        self.num_prefix_tokens = int(num_prefix_tokens)

    def build(self, x_shape, patch_grid_shape=None):
        tokens = x_shape[1]
        if self.grid_size is not None:
            tokens = self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
        if tokens is None:
            raise ValueError(f"{self.name} needs a known number of tokens (or a grid_size); got "
                             f"{tuple(x_shape)}.")
        # Read in float32 whatever the dtype policy: resampling runs in float32, as timm's does.
        self.pos_embedding = self.add_weight(
            name="pos_embedding", shape=(1, tokens, x_shape[2]),
            initializer=self.initializer, autocast=False)

    def call(self, x, patch_grid=None):
        if self.grid_size is None:
            expected = self.pos_embedding.shape[1]
            if x.shape[1] is not None and x.shape[1] != expected:
                raise ValueError(
                    f"{self.name} holds position embeddings for {expected} tokens but got "
                    f"{x.shape[1]} tokens: the input image size differs from the one the model was "
                    f"built for. Build the model at the new size (position embeddings are "
                    f"resampled when weights load), or with dynamic_image_size=True.")
            return x + ops.cast(self.pos_embedding, x.dtype)
        if patch_grid is None:
            raise ValueError(f"{self.name} has a grid_size, so it resamples to the input's patch "
                             f"grid: call it as layer(tokens, patch_grid).")
        shape = ops.shape(patch_grid)
        return x + ops.cast(self.resampled((shape[1], shape[2])), x.dtype)

    def resampled(self, grid):
        """The float32 embeddings `(1, num_prefix_tokens + rows * cols, hidden)` for a patch grid
        `(rows, cols)` (ints, or scalar tensors while tracing with unknown sizes)."""
        embeddings = ops.convert_to_tensor(self.pos_embedding)
        if all(isinstance(side, int) for side in grid) and tuple(grid) == self.grid_size:
            return embeddings
        prefix = embeddings[:, :self.num_prefix_tokens]
        hidden = embeddings.shape[-1]
        built = ops.reshape(embeddings[0, self.num_prefix_tokens:], (*self.grid_size, hidden))
        resized = interpolation_ops.resize_grid(built, grid)
        return ops.concatenate([prefix, ops.reshape(resized, (1, -1, hidden))], axis=1)

    def compute_output_shape(self, x_shape, patch_grid_shape=None):
        return x_shape

    def get_config(self):
        config = {**super().get_config(),
                  "initializer": keras.initializers.serialize(self.initializer)}
        if self.grid_size is not None:
            config.update(grid_size=list(self.grid_size), num_prefix_tokens=self.num_prefix_tokens)
        return config


POSITION_EMBEDDINGS = {"learned": AddPositionEmbs}
"""The position encodings by the name a `ViTConfig.position_embedding` gives."""


def make_position_embedding(kind, grid_size=None, num_prefix_tokens=1, dtype=None,
                            name="posembed_input"):
    """The model's position encoding of `kind` (one of `POSITION_EMBEDDINGS`); `grid_size` for a
    model of dynamic image size (see `AddPositionEmbs`)."""
    if kind not in POSITION_EMBEDDINGS:
        raise ValueError(f"Unknown position embedding {kind!r}; expected one of "
                         f"{sorted(POSITION_EMBEDDINGS)}.")
    if grid_size is None:
        return POSITION_EMBEDDINGS[kind](dtype=dtype, name=name)
    return POSITION_EMBEDDINGS[kind](grid_size=grid_size, num_prefix_tokens=num_prefix_tokens,
                                     dtype=dtype, name=name)
