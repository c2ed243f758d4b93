"""The position-encoding slot: how a ViT tells its tokens where they are.

`POSITION_EMBEDDINGS` names each absolute embedding (`ViTConfig.position_embedding`); a
`PositionSpec` (`position_spec(config)`) makes the one a config names.

- `"learned"`: `AddPositionEmbs`, the paper's learned absolute embedding added to the tokens.
- `"none"`: no absolute embedding (the model has rotary embeddings alone).

Rotary position embeddings (RoPE; Su et al., "RoFormer"; for images Heo et al., "Rotary Position
Embedding for Vision Transformer") act on the attention's queries and keys instead, beside an
absolute embedding or without one (`ViTConfig.rope`). As the data flows: `RotaryPositions` (one
per model) gives each token its coordinates on the patch grid of the input; the angles they turn
by are the coordinates times frequencies, and their cosine and sine (the *rotation*) are computed
once per forward by the model's `RotaryRotation` where the frequencies are fixed (axial,
DINOv3), or by each attention layer's `RotaryEmbedding` where it learns its own (RoPE-Mixed).
`RotaryEmbedding` turns the layer's queries and keys by the rotation. Prefix tokens get the
coordinates (0, 0), an angle of 0: they are left as they are, as timm leaves them.
"""

import dataclasses
import math

import keras
from keras import ops
import numpy as np

from vit_keras.model import interpolation_ops, specs

_PACKAGE = "vit_keras"


def naflex_grids(patch_coord, valid=None):
    """`(coord, sizes)` of NaFlex inputs, int32: `coord` `(batch, tokens, 2)` with padding at
    (0, 0), and each image's grid `sizes` `(batch, 1, 2)` (rows, cols): its largest valid
    coordinate + 1, as `naflex_patches.naflex_grid_shapes` reads it in NumPy."""
    coord = ops.cast(patch_coord, "int32")
    if valid is not None:
        coord = ops.where(ops.expand_dims(ops.cast(valid, "bool"), -1), coord, 0)
    return coord, ops.max(coord, axis=1, keepdims=True) + 1


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
    embeddings are added unchanged. With `preserve_aspect` a grid is resized as a square of its
    longer side, of which it keeps the top-left `rows' x cols'` (timm's `pos_embed_ar_preserving`).
    """

    def __init__(self, initializer=None, grid_size=None, num_prefix_tokens=1,
                 interpolation="bicubic", preserve_aspect=False, **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(
            initializer or keras.initializers.RandomNormal(stddev=0.02))
        self.grid_size = None if grid_size is None else tuple(int(side) for side in grid_size)
        self.num_prefix_tokens = int(num_prefix_tokens)
        if interpolation not in interpolation_ops.INTERPOLATIONS:
            raise ValueError(f"Unknown interpolation {interpolation!r}; expected one of "
                             f"{interpolation_ops.INTERPOLATIONS}.")
        self.interpolation = interpolation
        self.preserve_aspect = bool(preserve_aspect)

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
        resized = interpolation_ops.resize_grid(built, grid, self.interpolation,
                                                self.preserve_aspect)
        return ops.concatenate([prefix, ops.reshape(resized, (1, -1, hidden))], axis=1)

    def compute_output_shape(self, x_shape, patch_grid_shape=None):
        return x_shape

    def get_config(self):
        config = {**super().get_config(),
                  "initializer": keras.initializers.serialize(self.initializer)}
        if self.grid_size is not None:
            config.update(grid_size=list(self.grid_size), num_prefix_tokens=self.num_prefix_tokens,
                          interpolation=self.interpolation)
            if self.preserve_aspect:  # files written before the option load as they were
                config["preserve_aspect"] = True
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class NaFlexPositionEmbs(AddPositionEmbs):
    """`AddPositionEmbs` for NaFlex inputs: each image's patches at their own coordinates on a
    grid of their own size.

    The weight is `AddPositionEmbs`'s at `grid_size` (the same checkpoint loads into either).
    Each image's grid, `(rows, cols)` = its largest valid coordinate + 1, is resized from
    `grid_size` with `interpolation` (antialiased, as PyTorch's: `"bilinear"` for SigLIP 2 as
    big_vision and transformers resize it, `"bicubic"` as timm's NaFlex does), and each patch
    takes the embedding at its coordinate: one `(tokens, rows_built * cols_built)` weight matrix
    per image, applied as a product, so no image's grid is ever materialised.

    Call: `layer(x, patch_coord, valid)`: `x` `(batch, num_prefix_tokens + tokens, hidden)`,
    `patch_coord` `(batch, tokens, 2)` integer (row, column), `valid` `(batch, tokens)` bool or
    None (all valid). Output: as `x`, its padded tokens zeros.
    """

    def __init__(self, grid_size, num_prefix_tokens=1, interpolation="bicubic",
                 preserve_aspect=False, **kwargs):
        super().__init__(grid_size=grid_size, num_prefix_tokens=num_prefix_tokens,
                         interpolation=interpolation, preserve_aspect=preserve_aspect, **kwargs)

    def build(self, x_shape, patch_coord_shape=None, valid_shape=None):
        super().build(x_shape)

    def call(self, x, patch_coord, valid=None):
        x = x + ops.cast(self.at(patch_coord, valid), x.dtype)
        if valid is None:
            return x
        # Padding leaves as zeros whatever it held, so no value of it (or of its coordinates)
        # can reach a real token through a masked attention's zero weights (0 * inf is NaN).
        valid = ops.cast(valid, "bool")
        if self.num_prefix_tokens:
            valid = ops.concatenate(
                [ops.ones((ops.shape(valid)[0], self.num_prefix_tokens), "bool"), valid], axis=1)
        return ops.where(ops.expand_dims(valid, -1), x, ops.zeros_like(x))

    def at(self, patch_coord, valid=None):
        """The float32 embeddings `(batch, num_prefix_tokens + tokens, hidden)` of the prefix
        and of patches at `patch_coord` (see the class; padding counts as coordinate (0, 0))."""
        embeddings = ops.convert_to_tensor(self.pos_embedding)
        coord, sizes = naflex_grids(patch_coord, valid)
        if self.preserve_aspect:  # a square of the longer side, read at the image's cells
            sizes = ops.max(sizes, axis=-1, keepdims=True) * ops.ones_like(sizes)
        rows, cols = self.grid_size
        row_weights = interpolation_ops.antialiased_weights(
            rows, sizes[..., 0], coord[..., 0], self.interpolation)  # (batch, tokens, rows)
        col_weights = interpolation_ops.antialiased_weights(
            cols, sizes[..., 1], coord[..., 1], self.interpolation)  # (batch, tokens, cols)
        weights = ops.reshape(ops.expand_dims(row_weights, -1) * ops.expand_dims(col_weights, -2),
                              (ops.shape(coord)[0], ops.shape(coord)[1], rows * cols))
        patches = ops.matmul(weights, embeddings[0, self.num_prefix_tokens:])
        if not self.num_prefix_tokens:
            return patches
        prefix = ops.broadcast_to(embeddings[:, :self.num_prefix_tokens],
                                  (ops.shape(coord)[0], self.num_prefix_tokens,
                                   embeddings.shape[-1]))
        return ops.concatenate([prefix, patches], axis=1)

    def compute_output_shape(self, x_shape, patch_coord_shape=None, valid_shape=None):
        return x_shape


@dataclasses.dataclass(frozen=True)
class RopeSpec(specs.Spec):
    """The rotary embeddings' options (see `RotaryPositions`, which uses `kind`, `grid_offset`,
    `xy` and `ref_grid`, and `RotaryEmbedding`, which uses `kind`, `temperature` and
    `rotate_half`): the kind (`"axial"`, `"dinov3"`, `"mixed"`), the frequencies' base, an offset
    added to each patch index (PE: 1), the (column, row) coordinate order (PE, RoPE-ViT), EVA's
    reference grid the positions are rescaled to, and rotating the pairs (i, i + d/2) rather than
    (2i, 2i + 1) (DINOv3)."""

    kind: str = "axial"
    temperature: float = 10000.0
    grid_offset: float = 0.0
    xy: bool = False
    ref_grid: tuple | None = None
    rotate_half: bool = False

    def __post_init__(self):
        if self.kind not in RotaryPositions.KINDS:
            raise ValueError(f"Unknown rotary embedding {self.kind!r}; expected one of "
                             f"{RotaryPositions.KINDS}.")
        if self.ref_grid is not None:
            object.__setattr__(self, "ref_grid", tuple(int(side) for side in self.ref_grid))

    def positions(self, grid_size=None, num_prefix_tokens=0, dtype="float32",
                  name="rope_positions", naflex=False):
        """The model's `RotaryPositions` layer."""
        return RotaryPositions(self.kind, grid_size, num_prefix_tokens, self.grid_offset, self.xy,
                               self.ref_grid, naflex=naflex, dtype=dtype, name=name)

    @property
    def learned(self):
        """Whether each attention layer learns its frequencies (RoPE-Mixed): the rotation is then
        the layer's, else computed once per forward by the model's `RotaryRotation`."""
        return self.kind == "mixed"

    def embedding(self, num_heads, dtype=None, name="rope"):
        """An attention layer's `RotaryEmbedding`."""
        return RotaryEmbedding(num_heads, self.kind, self.temperature, self.rotate_half,
                               dtype=dtype, name=name)

    def rotation(self, head_dim, name="rope_rotation"):
        """The model's `RotaryRotation` (fixed frequencies only)."""
        return RotaryRotation(head_dim, self.kind, self.temperature, self.rotate_half,
                              dtype="float32", name=name)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class RotaryPositions(keras.layers.Layer):
    """Each token's coordinates for the rotary embeddings of the attention layers.

    Input: the patch embeddings, `(batch, rows, cols, hidden)` (a model of dynamic image size:
    the grid follows the input) or `(batch, rows * cols, hidden)` on the built `grid_size`.
    Output: float32 `(num_prefix_tokens + rows * cols, 2)`, no batch axis: `(0, 0)` for each
    prefix token, then per patch, row-major, its (row, column), or (column, row) with `xy`:

    - `kind="axial"` or `"mixed"`: the index plus `grid_offset`, rescaled to `ref_grid` (EVA-02's
      `ref_feat_shape`: `index * ref_rows / rows`) when one is given;
    - `kind="dinov3"`: the patch centre in [-1, 1], `2 * (index + 0.5 + grid_offset) / rows - 1`.

    With `naflex=True` the layer takes NaFlex inputs instead, `layer(patch_coord, valid)`
    (`(batch, tokens, 2)` integer (row, column), `(batch, tokens)` bool or None), and gives
    float32 `(batch, num_prefix_tokens + tokens, 2)`: each patch's coordinates as above on its
    own image's grid (`rows, cols` = its largest valid coordinate + 1), as timm's NaFlexVit
    computes each image's at its own grid size; padding counts as the cell (0, 0).
    """

    KINDS = ("axial", "dinov3", "mixed")

    def __init__(self, kind="axial", grid_size=None, num_prefix_tokens=0, grid_offset=0.0,
                 xy=False, ref_grid=None, naflex=False, **kwargs):
        super().__init__(**kwargs)
        if kind not in self.KINDS:
            raise ValueError(f"Unknown rotary embedding {kind!r}; expected one of {self.KINDS}.")
        self.kind = kind
        self.grid_size = None if grid_size is None else tuple(int(side) for side in grid_size)
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.grid_offset = float(grid_offset)
        self.xy = bool(xy)
        self.ref_grid = None if ref_grid is None else tuple(int(side) for side in ref_grid)
        self.naflex = bool(naflex)

    def call(self, patches, valid=None):
        if self.naflex:
            return self._naflex(patches, valid)
        if len(patches.shape) == 4:
            shape = ops.shape(patches)
            rows, cols = shape[1], shape[2]
        else:
            rows, cols = self.grid_size
        ref_rows, ref_cols = self.ref_grid or (None, None)
        row = ops.broadcast_to(self._axis(rows, ref_rows)[:, None], (rows, cols))
        col = ops.broadcast_to(self._axis(cols, ref_cols)[None, :], (rows, cols))
        grid = ops.stack([col, row] if self.xy else [row, col], axis=-1)
        prefix = ops.zeros((self.num_prefix_tokens, 2), dtype="float32")
        return ops.concatenate([prefix, ops.reshape(grid, (-1, 2))], axis=0)

    def _naflex(self, patch_coord, valid):
        coord, sizes = naflex_grids(patch_coord, valid)
        ref_rows, ref_cols = self.ref_grid or (None, None)
        row = self._axis(sizes[..., 0], ref_rows, coord[..., 0])
        col = self._axis(sizes[..., 1], ref_cols, coord[..., 1])
        grid = ops.stack([col, row] if self.xy else [row, col], axis=-1)
        prefix = ops.zeros((ops.shape(grid)[0], self.num_prefix_tokens, 2), dtype="float32")
        return ops.concatenate([prefix, grid], axis=1)

    def _axis(self, size, ref, index=None):
        """The coordinates along an axis of `size` patches, float32 `(size,)` (or at `index`, of
        a shape `size` broadcasts to), in timm's order of operations (so that they round as
        timm's)."""
        index = ops.cast(ops.arange(size) if index is None else index, "float32")
        size = ops.cast(size, "float32")
        if self.kind == "dinov3":
            return 2.0 * ((index + (0.5 + self.grid_offset)) / size) - 1.0
        index = index + self.grid_offset
        return index if ref is None else index / size * float(ref)

    def compute_output_spec(self, patches, valid=None):
        if self.naflex:
            tokens = patches.shape[1]
            tokens = None if tokens is None else self.num_prefix_tokens + tokens
            return keras.KerasTensor((patches.shape[0], tokens, 2), dtype="float32")
        if len(patches.shape) == 4:
            rows, cols = patches.shape[1], patches.shape[2]
        else:
            rows, cols = self.grid_size
        tokens = None if rows is None or cols is None else self.num_prefix_tokens + rows * cols
        return keras.KerasTensor((tokens, 2), dtype="float32")

    def get_config(self):
        return {**super().get_config(), "kind": self.kind,
                "grid_size": None if self.grid_size is None else list(self.grid_size),
                "num_prefix_tokens": self.num_prefix_tokens, "grid_offset": self.grid_offset,
                "xy": self.xy, "ref_grid": None if self.ref_grid is None else list(self.ref_grid),
                "naflex": self.naflex}


class TakesRotary:
    """For a layer called as `layer(x, rotary, ...)` (a block, an attention layer): Keras casts
    every float input to the compute dtype, and the rotary input (coordinates, or a cosine and
    sine) must stay float32. The layer's `__init__` calls `keep_rotary_float32(self)`, and its
    `call` casts `x` to its compute dtype."""

    def __call__(self, x, *args, **kwargs):
        if isinstance(x, np.ndarray):  # Keras finds the input's shape on tensors only
            x = ops.convert_to_tensor(x)
        return super().__call__(x, *args, **kwargs)


def keep_rotary_float32(layer):
    """Turns off Keras' casting of `layer`'s inputs (see `TakesRotary`)."""
    layer._convert_input_args = False  # pylint: disable=protected-access
    layer._allow_non_tensor_positional_args = True  # pylint: disable=protected-access


def _fixed_frequencies(kind, temperature, head_dim):
    """The frequencies of `"axial"` and `"dinov3"`, `(2, 1, head_dim / 2)` float32 values: the bands
    `temperature ** -(k / (head_dim / 4))`, `k < head_dim / 4` (times 2π for DINOv3, whose periods
    are `temperature ** (k / (head_dim / 4))`), the first half of the angles turning with the
    first coordinate, the second half with the other."""
    bands = _bands(temperature, head_dim)
    bands = bands * np.float32(2 * math.pi) if kind == "dinov3" else bands
    zeros = np.zeros_like(bands)
    frequencies = np.stack([np.concatenate([bands, zeros]), np.concatenate([zeros, bands])])[:, None]
    # Nested tuples, not the array: torch.compile cannot read a NumPy attribute's dtype, which
    # Keras' convert_to_tensor does (a graph break in every compiled forward pass).
    return tuple(tuple(tuple(row) for row in plane) for plane in frequencies.tolist())


def _bands(temperature, head_dim):
    return temperature ** -(np.arange(head_dim // 4, dtype="float32") / (head_dim // 4))


def _rotation(positions, frequencies, rotate_half):
    """`(tokens, 2)` coordinates (NaFlex: `(batch, tokens, 2)`) and frequencies `(2, heads or
    1, head_dim / 2)` → the rotation, float32 `(2, heads or 1, tokens, head_dim)` (NaFlex: `(2,
    batch, heads or 1, tokens, head_dim)`): the cosine and the sine of the angles `x * F[0] + y *
    F[1]`, each repeated over its pair of channels, `(2i, 2i + 1)` or with `rotate_half` `(i, i +
    head_dim / 2)`."""
    frequencies = ops.convert_to_tensor(frequencies, "float32")
    positions = ops.expand_dims(ops.cast(positions, "float32"), -3)  # (..., 1, tokens, 2)
    angles = (positions[..., 0:1] * frequencies[0][:, None, :]
              + positions[..., 1:2] * frequencies[1][:, None, :])
    if rotate_half:
        angles = ops.concatenate([angles, angles], axis=-1)
    else:
        angles = ops.repeat(angles, 2, axis=-1)
    return ops.stack([ops.cos(angles), ops.sin(angles)])


@keras.saving.register_keras_serializable(package=_PACKAGE)
class RotaryRotation(keras.layers.Layer):
    """The rotation of fixed rotary frequencies (`"axial"`, `"dinov3"`), once per forward for
    every attention layer: `(tokens, 2)` coordinates (`RotaryPositions`) → float32 `(2, 1,
    tokens, head_dim)`, the cosine and the sine of each channel's angle (see `RotaryEmbedding`);
    NaFlex's `(batch, tokens, 2)` → `(2, batch, 1, tokens, head_dim)`. No weights."""

    def __init__(self, head_dim, kind="axial", temperature=10000.0, rotate_half=False, **kwargs):
        super().__init__(**kwargs)
        if kind not in RotaryPositions.KINDS or kind == "mixed":
            raise ValueError(f"RotaryRotation computes fixed frequencies (\"axial\", "
                             f"\"dinov3\"); got {kind!r} (RoPE-Mixed's are each attention "
                             f"layer's own).")
        self.head_dim = int(head_dim)
        self.kind = kind
        self.temperature = float(temperature)
        self.rotate_half = bool(rotate_half)
        self._frequencies = _fixed_frequencies(kind, self.temperature, self.head_dim)

    def call(self, positions):
        return _rotation(positions, self._frequencies, self.rotate_half)

    def compute_output_spec(self, positions):
        return keras.KerasTensor((2, *positions.shape[:-2], 1, positions.shape[-2], self.head_dim),
                                 dtype="float32")

    def get_config(self):
        return {**super().get_config(), "head_dim": self.head_dim, "kind": self.kind,
                "temperature": self.temperature, "rotate_half": self.rotate_half}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class RotaryEmbedding(keras.layers.Layer):
    """Rotates an attention layer's queries or keys by angles of their tokens' coordinates.

    Angles `(heads or 1, tokens, head_dim / 2)`: `x * F[0] + y * F[1]` for the coordinates `(x,
    y)` of `RotaryPositions` and the frequencies `F` `(2, heads or 1, head_dim / 2)`:

    - `"axial"`: `bands = temperature ** -(k / (head_dim / 4))`, `k < head_dim / 4`; the first
      half of the angles turns with the first coordinate, the second with the other (EVA-02, PE,
      RoPE-ViT axial; timm's `RotaryEmbeddingCat`);
    - `"dinov3"`: the same bands times 2π (DINOv3's periods `temperature ** (k / (head_dim / 4))`);
    - `"mixed"`: learned per head, the weight `frequencies` `(2, heads, head_dim / 2)`, initialised
      as RoPE-Mixed does (the axial magnitudes, each head turned by a random angle).

    Each pair of channels, `(2i, 2i + 1)` or with `rotate_half` `(i, i + head_dim / 2)`, turns by
    its angle: `x * cos + rotated(x) * sin`, in float32 whatever the compute dtype. The layer takes
    the coordinates `(tokens, 2)`, or with fixed frequencies the rotation `(2, 1, tokens,
    head_dim)` the model's `RotaryRotation` computed from them once for every layer; a NaFlex
    model's have a batch axis before the tokens (`(batch, tokens, 2)`, `(2, batch, 1, tokens,
    head_dim)`), each image's own.
    """

    def __init__(self, num_heads, kind="axial", temperature=10000.0, rotate_half=False, **kwargs):
        super().__init__(**kwargs)
        if kind not in RotaryPositions.KINDS:
            raise ValueError(f"Unknown rotary embedding {kind!r}; expected one of "
                             f"{RotaryPositions.KINDS}.")
        self.num_heads = int(num_heads)
        self.kind = kind
        self.temperature = float(temperature)
        self.rotate_half = bool(rotate_half)

    def build(self, head_shape):
        """`head_shape`: `(..., head_dim)` of the queries."""
        head_dim = head_shape[-1]
        if self.kind == "mixed":
            self.frequencies = self.add_weight(
                name="frequencies", shape=(2, self.num_heads, head_dim // 2),
                initializer=_MixedFrequencies(_bands(self.temperature, head_dim)),
                autocast=False)
        else:
            self._frequencies = _fixed_frequencies(self.kind, self.temperature, head_dim)

    def rotation(self, positions):
        """`(tokens, 2)` coordinates → the rotation, float32 `(2, heads or 1, tokens,
        head_dim)` (cosine and sine); NaFlex's `(batch, tokens, 2)` → `(2, batch, heads or 1,
        tokens, head_dim)`."""
        frequencies = self.frequencies if self.kind == "mixed" else self._frequencies
        return _rotation(positions, frequencies, self.rotate_half)

    def call(self, x, rotary, head_major=True):
        """`x`: queries or keys, `(batch, heads, tokens, head_dim)` (`head_major`) or `(batch,
        tokens, heads, head_dim)`; `rotary`: the tokens' coordinates or their rotation. Tokens
        past those (padding) stay as they are."""
        return self.turn([x], rotary, head_major)[0]

    def turn(self, tensors, rotary, head_major=True):
        """`call` for several tensors of one layout (an attention's q and k), one rotation."""
        # Coordinates are `(tokens, 2)` or NaFlex's `(batch, tokens, 2)`; a rotation has 4 or 5 axes.
        rotation = self.rotation(rotary) if len(rotary.shape) <= 3 else rotary
        cos, sin = rotation[0], rotation[1]  # ([batch,] heads or 1, tokens, head_dim)
        x = tensors[0]
        tokens = x.shape[2] if head_major else x.shape[1]
        if tokens is not None and cos.shape[-2] is not None and tokens > cos.shape[-2]:
            padding = ((0, 0),) * (len(cos.shape) - 2) + ((0, tokens - cos.shape[-2]), (0, 0))
            cos, sin = ops.pad(cos, padding, constant_values=1.0), ops.pad(sin, padding)
        if not head_major:  # ([batch,] tokens, heads or 1, head_dim)
            cos, sin = ops.swapaxes(cos, -3, -2), ops.swapaxes(sin, -3, -2)
        turned = []
        for x in tensors:
            x32 = ops.cast(x, "float32")
            turned.append(ops.cast(x32 * cos + self._turned(x32) * sin, x.dtype))
        return turned

    def _turned(self, x):
        """Each pair `(a, b)` → `(-b, a)`."""
        if self.rotate_half:
            first, second = ops.split(x, 2, axis=-1)
            return ops.concatenate([-second, first], axis=-1)
        pairs = ops.reshape(x, (*ops.shape(x)[:-1], x.shape[-1] // 2, 2))
        return ops.reshape(ops.stack([-pairs[..., 1], pairs[..., 0]], axis=-1), ops.shape(x))

    def compute_output_spec(self, x, rotary, head_major=True):
        return keras.KerasTensor(x.shape, dtype=x.dtype)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "kind": self.kind,
                "temperature": self.temperature, "rotate_half": self.rotate_half}


class _MixedFrequencies(keras.initializers.Initializer):
    """RoPE-Mixed's start `(2, heads, head_dim / 2)`: per head, the axial magnitudes turned by a
    random angle θ, `[m cos θ, m cos(θ + π/2)]` along x and `[m sin θ, m sin(θ + π/2)]` along y."""

    def __init__(self, magnitudes):
        self.magnitudes = np.asarray(magnitudes, "float32")

    def __call__(self, shape, dtype=None):
        theta = keras.random.uniform((shape[1], 1), 0.0, 2 * math.pi)
        m = ops.convert_to_tensor(self.magnitudes)[None, :]
        along_x = ops.concatenate([m * ops.cos(theta), m * ops.cos(theta + math.pi / 2)], -1)
        along_y = ops.concatenate([m * ops.sin(theta), m * ops.sin(theta + math.pi / 2)], -1)
        return ops.cast(ops.stack([along_x, along_y]), dtype or "float32")

    def get_config(self):
        return {"magnitudes": self.magnitudes.tolist()}


POSITION_EMBEDDINGS = {"learned": AddPositionEmbs}
"""The position encodings by the name a `ViTConfig.position_embedding` gives."""


@dataclasses.dataclass(frozen=True)
class PositionSpec(specs.Spec):
    """The absolute position embedding's options: which (`"learned"`, one of
    `POSITION_EMBEDDINGS`, or `"none"`: rotary embeddings alone), whether it covers the class
    and distillation tokens (`covers_prefix`, the paper's) or the patches alone (register tokens
    never take one), and how the forward pass resizes its grid (`interpolation`, antialiased
    `"bicubic"` or `"bilinear"`; `preserve_aspect`: as a square of the longer side, see
    `AddPositionEmbs`) for a dynamic image size or NaFlex inputs."""

    kind: str = "learned"
    covers_prefix: bool = True
    interpolation: str = "bicubic"
    preserve_aspect: bool = False

    def __post_init__(self):
        if self.kind != "none" and self.kind not in POSITION_EMBEDDINGS:
            raise ValueError(f"Unknown position embedding {self.kind!r}; expected one of "
                             f"{sorted(POSITION_EMBEDDINGS) + ['none']}.")
        if self.interpolation not in interpolation_ops.INTERPOLATIONS:
            raise ValueError(f"Unknown interpolation {self.interpolation!r}; expected one of "
                             f"{interpolation_ops.INTERPOLATIONS}.")

    def make(self, grid_size=None, num_prefix_tokens=0, dtype=None, name="posembed_input",
             naflex=False):
        """The layer (None for `"none"`); `grid_size` for a model of dynamic image size, which
        resamples to each input's grid, or of NaFlex inputs (`naflex=True`,
        `NaFlexPositionEmbs`), with `num_prefix_tokens` the tokens it covers before the patches
        (see `AddPositionEmbs`)."""
        if self.kind == "none":
            return None
        if grid_size is None:
            return POSITION_EMBEDDINGS[self.kind](dtype=dtype, name=name)
        layer = NaFlexPositionEmbs if naflex else POSITION_EMBEDDINGS[self.kind]
        return layer(grid_size=grid_size,
                     num_prefix_tokens=num_prefix_tokens if self.covers_prefix else 0,
                     interpolation=self.interpolation, preserve_aspect=self.preserve_aspect,
                     dtype=dtype, name=name)


def position_spec(config):
    """The `PositionSpec` of a `ViTConfig` (`position_embedding`, `posemb_prefix`,
    `posemb_interpolation`, `posemb_preserve_aspect`)."""
    return PositionSpec(config.position_embedding, config.posemb_prefix,
                        config.posemb_interpolation, config.posemb_preserve_aspect)
