"""The MLP slot of the encoder block: which MLP a `TransformerBlock` runs after its attention.

`MLPS` names each implementation (`ViTConfig.mlp`); `make_mlp` builds the one a config names.
Each takes `(batch, tokens, hidden)` to `(batch, tokens, hidden)` and is built with the block.
A new MLP (a gated SwiGLU) is one class here and one entry in `MLPS`.

- `"gelu"`: `MlpBlock`, the paper's Dense → GELU → Dense (vit_jax's weight names).
"""

import keras
from keras import ops

from vit_keras.model import initializers, kernels
from vit_keras.model.configs import GELUS

_PACKAGE = "vit_keras"


def gelu_variant(gelu=None, approximate_gelu=False):
    """The GELU a layer computes: `"exact"` (erf; timm, Hugging Face), `"tanh"` (Flax's
    approximation) or `"quick"` (`x * sigmoid(1.702 x)`, OpenAI CLIP's). `gelu=None` takes the
    older boolean `approximate_gelu` (True: `"tanh"`)."""
    if gelu is None:
        return "tanh" if approximate_gelu else "exact"
    if gelu not in GELUS:
        raise ValueError(f"Unknown gelu {gelu!r}; expected one of {GELUS}.")
    if approximate_gelu and gelu != "tanh":
        raise ValueError(f"approximate_gelu=True asks for the tanh GELU, but gelu={gelu!r}; "
                         f"pass one of the two.")
    return gelu


def _quick_gelu(x):
    return x * ops.sigmoid(1.702 * x)


def _choose_gelu(gelu):
    """The GELU function of a layer built now (exact and tanh in each backend's fastest form)."""
    return _quick_gelu if gelu == "quick" else kernels.choose_gelu(gelu == "tanh")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MlpBlock(keras.layers.Layer):
    """Dense → GELU → dropout → Dense → dropout, as in vit_jax's `MlpBlock`.

    Input and output: `(batch, tokens, hidden)`. Weights: `Dense_0` `(hidden, mlp_dim)`,
    `Dense_1` `(mlp_dim, hidden)`. `gelu`: see `gelu_variant`; `approximate_gelu=True` is the
    older spelling of `gelu="tanh"` (configs saved before `gelu` existed carry it).
    """

    def __init__(self, mlp_dim, dropout=0.0, approximate_gelu=False, gelu=None, **kwargs):
        super().__init__(**kwargs)
        self.mlp_dim = int(mlp_dim)
        self.dropout = float(dropout)
        self.gelu = gelu_variant(gelu, approximate_gelu)
        self._dropout = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy, name="dropout")

    def build(self, input_shape):
        hidden = input_shape[-1]
        self.dense_0 = keras.layers.Dense(
            self.mlp_dim, kernel_initializer=initializers.xavier_uniform(hidden, self.mlp_dim),
            bias_initializer=initializers.mlp_bias(), dtype=self.dtype_policy, name="Dense_0")
        self.dense_0.build(input_shape)
        self.dense_1 = keras.layers.Dense(
            hidden, kernel_initializer=initializers.xavier_uniform(self.mlp_dim, hidden),
            bias_initializer=initializers.mlp_bias(), dtype=self.dtype_policy, name="Dense_1")
        self.dense_1.build((*input_shape[:-1], self.mlp_dim))
        # Chosen once for this backend and device (see vit_keras.model.kernels): `dense(x)`, torch's
        # linear, or on XLA:CPU an einsum with bfloat16 products; GELU in its fastest form.
        self._project = kernels.choose_projection()
        self._gelu = _choose_gelu(self.gelu)

    def call(self, x, training=None):
        x = self._gelu(self._project(self.dense_0, x))
        x = kernels.dropped(self._dropout, x, training)
        return kernels.dropped(self._dropout, self._project(self.dense_1, x), training)

    @property
    def lora_targets(self):
        """The linear layers LoRA adapts: `Dense_0`, `Dense_1`."""
        return [self.dense_0, self.dense_1]

    def get_config(self):
        return {**super().get_config(), "mlp_dim": self.mlp_dim, "dropout": self.dropout,
                "gelu": self.gelu}


MLPS = {"gelu": MlpBlock}
"""The MLP implementations by the name a `ViTConfig.mlp` gives."""


def make_mlp(kind, mlp_dim, dropout=0.0, gelu="exact", dtype=None, name="MlpBlock_3"):
    """The block's MLP of `kind` (one of `MLPS`)."""
    if kind not in MLPS:
        raise ValueError(f"Unknown MLP {kind!r}; expected one of {sorted(MLPS)}.")
    return MLPS[kind](mlp_dim, dropout, gelu=gelu, dtype=dtype, name=name)
