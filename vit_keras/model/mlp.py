"""The MLP slot of the encoder block: which MLP a `TransformerBlock` runs after its attention.

`MLPS` names each implementation (`ViTConfig.mlp`); an `MlpSpec` (`mlp_spec(config)`) makes the
one a config names.
Each takes `(batch, tokens, hidden)` to `(batch, tokens, hidden)` and is built with the block.
A new MLP is one class here and one entry in `MLPS`, and the readers of the checkpoints that
hold it name it (`vit_keras.weights.checkpoints`).

- `"gelu"`: `MlpBlock`, the paper's Dense → GELU → Dense (vit_jax's weight names); the GELU is
  `ViTConfig.gelu`'s.
- `"silu"`: `SiLUMlpBlock`, Dense → SiLU → Dense (transformers' DINOv3 with `hidden_act="silu"`).
- `"swiglu"`: `SwiGLUBlock`, `Dense_1(silu(gate(x)) * Dense_0(x))` (EVA-02, DINOv2 giant, DINOv3's
  large sizes, AIMv2). timm packs `gate` and `Dense_0` into one `fc1` (DINOv2 giant) or keeps
  them apart (`fc1_g`, `fc1_x`); the checkpoint converters unpack, so one class holds both.
- `"geglu"`: `GeGLUBlock`, the same gated MLP with `ViTConfig.gelu`'s GELU as the gate
  (transformers' DINOv3 with `use_gated_mlp=True, hidden_act="gelu"`).

All take `use_bias` (AIMv2's have none) and an optional norm before the output projection
(`inner_norm`, a `vit_keras.model.norms.NORMS` name: EVA-02's `scale_mlp`).
"""

import dataclasses

import keras
from keras import ops

from vit_keras.model import backend_ops, initializers, legacy, norms, specs
from vit_keras.model.configs import GELUS

_PACKAGE = "vit_keras"


def gelu_variant(gelu=None):
    """The GELU a layer computes: `"exact"` (erf; timm, Hugging Face; also for None), `"tanh"`
    (Flax's approximation) or `"quick"` (`x * sigmoid(1.702 x)`, OpenAI CLIP's)."""
    if gelu is None:
        return "exact"
    if gelu not in GELUS:
        raise ValueError(f"Unknown gelu {gelu!r}; expected one of {GELUS}.")
    return gelu


def _quick_gelu(x):
    return x * ops.sigmoid(1.702 * x)


def _choose_gelu(gelu):
    """The GELU function of a layer built now (exact and tanh in each backend's fastest form)."""
    return _quick_gelu if gelu == "quick" else backend_ops.choose_gelu(gelu == "tanh")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MlpBlock(keras.layers.Layer):
    """Dense → GELU → dropout → Dense → dropout, as in vit_jax's `MlpBlock`.

    Input and output: `(batch, tokens, hidden)`. Weights: `Dense_0` `(hidden, mlp_dim)`,
    `Dense_1` `(mlp_dim, hidden)`. `gelu`: see `gelu_variant`.
    """

    MODEL_PARALLEL = {"Dense_0/kernel": (None, "model"), "Dense_0/bias": ("model",),
                      "gate/kernel": (None, "model"), "gate/bias": ("model",),
                      "Dense_1/kernel": ("model", None)}
    """Its weights' layouts over a mesh's `model` axis (by path inside the layer): split over the
    hidden units (a gated MLP's gate as its `Dense_0`); the rest replicated."""

    def __init__(self, mlp_dim, dropout=0.0, gelu=None, use_bias=True, inner_norm=None,
                 norm_epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.mlp_dim = int(mlp_dim)
        self.dropout = float(dropout)
        self.gelu = gelu_variant(gelu)
        self.use_bias = bool(use_bias)
        self.inner_norm, self.norm_epsilon = inner_norm, float(norm_epsilon)
        self._dropout = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy, name="dropout")
        self.norm = None if inner_norm is None else norms.NormSpec(
            inner_norm, self.norm_epsilon).make(dtype=self.dtype_policy, name="norm")

    def _dense(self, units, fan_in, name):
        return keras.layers.Dense(
            units, use_bias=self.use_bias,
            kernel_initializer=initializers.xavier_uniform(fan_in, units),
            bias_initializer=initializers.mlp_bias(), dtype=self.dtype_policy, name=name)

    def build(self, input_shape):
        hidden = input_shape[-1]
        inner = (*input_shape[:-1], self.mlp_dim)
        self.dense_0 = self._dense(self.mlp_dim, hidden, "Dense_0")
        self.dense_0.build(input_shape)
        self.dense_1 = self._dense(hidden, self.mlp_dim, "Dense_1")
        self.dense_1.build(inner)
        if self.norm is not None:
            self.norm.build(inner)
        # Chosen once for this backend and device (see vit_keras.model.backend_ops): `dense(x)`, torch's
        # linear, or on XLA:CPU an einsum with bfloat16 products; GELU in its fastest form.
        self._project = backend_ops.choose_projection()
        self._activation = ops.silu if self.activation == "silu" else _choose_gelu(self.gelu)

    activation = "gelu"
    """The activation: `"gelu"` (the variant `gelu` names) or `"silu"`."""

    def _hidden(self, x):
        """`(batch, tokens, hidden)` → the activations before the output projection."""
        return self._activation(self._project(self.dense_0, x))

    def call(self, x, training=None):
        x = backend_ops.dropped(self._dropout, self._hidden(x), training)
        if self.norm is not None:
            x = self.norm(x)
        return backend_ops.dropped(self._dropout, self._project(self.dense_1, x), training)

    def activation_values(self, tokens):
        """Values per image that a training step keeps for the backward pass: the two layers'
        outputs (the activation's input and output), and with `inner_norm` its input."""
        return (2 + int(self.norm is not None)) * tokens * self.mlp_dim

    @property
    def lora_targets(self):
        """The linear layers LoRA adapts: `Dense_0`, `Dense_1`."""
        return [self.dense_0, self.dense_1]

    def get_config(self):
        config = {**super().get_config(), "mlp_dim": self.mlp_dim, "dropout": self.dropout,
                  "gelu": self.gelu}
        if not self.use_bias or self.inner_norm is not None:  # configs saved before keep loading
            config.update(use_bias=self.use_bias, inner_norm=self.inner_norm,
                          norm_epsilon=self.norm_epsilon)
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**legacy.mlp_config(config))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SwiGLUBlock(MlpBlock):
    """The gated MLP of Shazeer's "GLU Variants Improve Transformer": `Dense_1(silu(gate(x)) *
    Dense_0(x))`, with dropout after the product and the output as `MlpBlock`'s.

    Input and output: `(batch, tokens, hidden)`. Weights: `gate` and `Dense_0` `(hidden,
    mlp_dim)`, `Dense_1` `(mlp_dim, hidden)`, and with `inner_norm` a norm `norm` over `mlp_dim`
    (EVA-02). `mlp_dim` is the width of each branch (timm's `fc1_g`, `fc1_x`; half of a packed
    `fc1`). `gelu` is kept for the config's sake; the gate is SiLU.
    """

    activation = "silu"

    def build(self, input_shape):
        self.gate = self._dense(self.mlp_dim, input_shape[-1], "gate")
        self.gate.build(input_shape)
        super().build(input_shape)

    def _hidden(self, x):
        return self._activation(self._project(self.gate, x)) * self._project(self.dense_0, x)

    def activation_values(self, tokens):
        """`MlpBlock`'s, and the gate's output and its activation."""
        return super().activation_values(tokens) + 2 * tokens * self.mlp_dim

    @property
    def lora_targets(self):
        """The linear layers LoRA adapts: `gate`, `Dense_0`, `Dense_1`."""
        return [self.gate, self.dense_0, self.dense_1]


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SiLUMlpBlock(MlpBlock):
    """`MlpBlock` with SiLU in place of GELU (`gelu` is kept for the config's sake)."""

    activation = "silu"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GeGLUBlock(SwiGLUBlock):
    """`SwiGLUBlock` with the GELU that `gelu` names as the gate: `Dense_1(gelu(gate(x)) *
    Dense_0(x))`."""

    activation = "gelu"


MLPS = {"gelu": MlpBlock, "silu": SiLUMlpBlock, "swiglu": SwiGLUBlock, "geglu": GeGLUBlock}
"""The MLP implementations by the name a `ViTConfig.mlp` gives."""


@dataclasses.dataclass(frozen=True)
class MlpSpec(specs.Spec):
    """The MLP slot's options: which MLP (`MLPS`), its GELU (`gelu_variant`), whether its
    projections have biases, and the norm inside it before the output projection (EVA-02's), if
    any."""

    NESTED = {"inner_norm": norms.NormSpec}

    kind: str = "gelu"
    gelu: str = "exact"
    bias: bool = True
    inner_norm: norms.NormSpec | None = None

    def __post_init__(self):
        if self.kind not in MLPS:
            raise ValueError(f"Unknown MLP {self.kind!r}; expected one of {sorted(MLPS)}.")
        gelu_variant(self.gelu)

    def make(self, mlp_dim, dropout=0.0, dtype=None, name="MlpBlock_3"):
        """The MLP layer, `(batch, tokens, hidden)` → the same."""
        norm = self.inner_norm
        return MLPS[self.kind](mlp_dim, dropout, gelu=self.gelu, use_bias=self.bias,
                               inner_norm=None if norm is None else norm.kind,
                               norm_epsilon=1e-6 if norm is None else norm.epsilon,
                               dtype=dtype, name=name)


def mlp_spec(config):
    """The `MlpSpec` of a `ViTConfig` (`mlp`, `gelu`, `mlp_bias`, `mlp_norm` with its `norm`)."""
    return MlpSpec(config.mlp, config.gelu, config.mlp_bias,
                   norms.norm_spec(config) if config.mlp_norm else None)
