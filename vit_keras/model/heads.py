"""The heads: how a ViT's tokens become one vector per image, and that vector class logits.

Poolings (`classifier=`): the class token (`"token"`), the mean of the patch tokens (`"gap"`),
SigLIP's attention pooling (`"map"`, `MAPHead`), and DeiT's distilled pair (the class and the
distillation token, each read by its own head, the two heads' logits averaged). A `HeadSpec`
(`head_spec(config, classifier)`) makes a model's pooling (`pooling`) and its Dense heads
(`heads`); `classify` joins them.

`MAPHead`'s weight names are big_vision's, so checkpoints map by name:
`MAPHead_0/probe`, `MAPHead_0/MultiHeadDotProductAttention_0/{query,key,value,out}/...`,
`MAPHead_0/LayerNorm_0/...`, `MAPHead_0/MlpBlock_0/Dense_{0,1}/...`.
"""

import dataclasses

import keras
from keras import ops

from vit_keras.model import attention as attention_lib
from vit_keras.model import legacy, norms, specs
from vit_keras.model import mlp as mlp_lib

_PACKAGE = "vit_keras"

CLASSIFIERS = ("token", "gap", "map")
"""Poolings: the class token, the mean of the patch tokens, SigLIP's attention pooling (MAP)."""


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MAPHead(keras.layers.Layer):
    """Multi-head attention pooling: `probe' = attn(probe, tokens)`, then `y + mlp(LN(y))`.

    Input: `(batch, tokens, hidden)`; the first `num_prefix_tokens` (class, distillation, register
    tokens) are left out, as timm does; `valid` `(batch, tokens)` bool (NaFlex: False for
    padding) masks the keys. Output: `(batch, hidden)`.
    Weights: `probe` `(1, 1, hidden)`; the attention's projections in the encoder blocks' layout
    (`query|key|value/kernel` `(hidden, heads, head_dim)`, `out/kernel` `(heads, head_dim,
    hidden)`); `LayerNorm_0` (`norm_spec`'s); `MlpBlock_0` (`mlp_spec`'s) `(hidden, mlp_dim)`,
    `(mlp_dim, hidden)`. Default specs: big_vision's LayerNorm and exact-GELU MLP.
    """

    def __init__(self, num_heads, mlp_dim, num_prefix_tokens=0, norm_spec=None, mlp_spec=None,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.mlp_dim = int(mlp_dim)
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.norm_spec = norms.NormSpec.of(norm_spec) or norms.NormSpec()
        self.mlp_spec = mlp_lib.MlpSpec.of(mlp_spec) or mlp_lib.MlpSpec()
        policy = self.dtype_policy
        self.attention = attention_lib.MultiHeadDotProductAttention(
            self.num_heads, dtype=policy, name="MultiHeadDotProductAttention_0")
        self.norm = self.norm_spec.make(dtype=policy, name="LayerNorm_0")
        self.mlp = self.mlp_spec.make(self.mlp_dim, dtype=policy, name="MlpBlock_0")

    def build(self, input_shape):
        hidden = input_shape[-1]
        # big_vision initialises the probe xavier-uniform; its scale matters only for training.
        self.probe = self.add_weight(name="probe", shape=(1, 1, hidden),
                                     initializer="glorot_uniform")
        self.attention.build(input_shape)
        self.norm.build((input_shape[0], 1, hidden))
        self.mlp.build((input_shape[0], 1, hidden))

    def call(self, x, valid=None):
        if self.num_prefix_tokens:
            x = x[:, self.num_prefix_tokens:]
            valid = None if valid is None else valid[:, self.num_prefix_tokens:]
        probe = ops.broadcast_to(ops.cast(self.probe, x.dtype), (ops.shape(x)[0], 1, x.shape[-1]))
        attention = self.attention
        # Cross-attention through the projections as layers (quantized or LoRA ones included):
        # the probe queries, the tokens are keys and values; (batch, tokens, heads, head_dim).
        q, k, v = attention.query(probe), attention.key(x), attention.value(x)
        mask = None if valid is None else attention_lib.key_mask(valid)  # NaFlex padding out
        y = attention.out(ops.dot_product_attention(q, k, v, mask=mask))
        y = y + self.mlp(self.norm(y))
        return y[:, 0]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "mlp_dim": self.mlp_dim,
                "num_prefix_tokens": self.num_prefix_tokens,
                "norm_spec": self.norm_spec.get_config(), "mlp_spec": self.mlp_spec.get_config()}

    @classmethod
    def from_config(cls, config):
        return cls(**legacy.map_head_config(config))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TokenPooling(keras.layers.Layer):
    """Reduces the token sequence to one vector per image.

    Input: `(batch, tokens, hidden)`, and for NaFlex `valid` `(batch, tokens)` bool. Output:
    `(batch, hidden)`: the class token (`mode="token"`), the mean over the patch tokens after the
    `num_prefix_tokens` class, distillation and register tokens (`mode="gap"`, computed in
    float32; over the valid ones), or DeiT's distillation token, token 1 (`mode="distillation"`).
    """

    MODES = ("token", "gap", "distillation")

    def __init__(self, mode="token", num_prefix_tokens=0, **kwargs):
        super().__init__(**kwargs)
        if mode not in self.MODES:
            raise ValueError(f"Unknown pooling mode {mode!r}; expected one of {self.MODES}.")
        self.mode = mode
        self.num_prefix_tokens = int(num_prefix_tokens)

    def call(self, x, valid=None):
        if self.mode == "token":
            return x[:, 0]
        if self.mode == "distillation":
            return x[:, 1]
        patches = ops.cast(x[:, self.num_prefix_tokens:] if self.num_prefix_tokens else x,
                           "float32")
        if valid is None:
            return ops.cast(ops.mean(patches, axis=1), x.dtype)
        weights = ops.cast(valid[:, self.num_prefix_tokens:], "float32")[..., None]
        total = ops.sum(patches * weights, axis=1)
        return ops.cast(total / ops.maximum(ops.sum(weights, axis=1), 1.0), x.dtype)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        return {**super().get_config(), "mode": self.mode,
                "num_prefix_tokens": self.num_prefix_tokens}


class Pooling:
    """A model's pooling: its pooling layers, and `__call__(tokens)` → what its heads read.

    `tokens` `(batch, tokens, hidden)` → `(batch, hidden)`; for DeiT distilled a pair (class
    token, distillation token), one per head. `pooled(tokens)` is always one `(batch, hidden)`:
    the pair's mean for DeiT (timm's pre-logits)."""

    def __init__(self, *pooling_layers):
        self.layers = list(pooling_layers)

    @property
    def distilled(self):
        return len(self.layers) == 2

    def __call__(self, tokens, valid=None):
        if self.distilled:
            return [layer(tokens) for layer in self.layers]
        return self.layers[0](tokens) if valid is None else self.layers[0](tokens, valid=valid)

    def pooled(self, tokens, name=None):
        if not self.distilled:
            return self.layers[0](tokens)
        pair = self(tokens)
        return keras.layers.Average(dtype=pair[0].dtype, name=name)(pair)


@dataclasses.dataclass(frozen=True)
class HeadSpec(specs.Spec):
    """The head slot's options: the pooling (`classifier`, one of `CLASSIFIERS`), DeiT's two
    heads (`distilled`: the class and the distillation token, each read by its own head), a norm
    after the pooling instead of before it (`fc_norm`: MAE's, BEiT's), and the MAP head's heads
    (`map_num_heads`, None: the blocks') and whether it reads the prefix tokens too
    (`map_prefix`: PE's)."""

    classifier: str = "token"
    distilled: bool = False
    fc_norm: bool = False
    map_num_heads: int | None = None
    map_prefix: bool = False

    def __post_init__(self):
        if self.classifier not in CLASSIFIERS:
            raise ValueError(f"Unknown classifier {self.classifier!r}; expected one of "
                             f"{CLASSIFIERS}.")

    def pooling(self, num_heads, mlp_dim, num_prefix_tokens, norm_spec, mlp_spec, dtype=None):
        """The `Pooling` of a model of `num_heads` heads and `num_prefix_tokens` tokens before
        the patches. The MAP head is big_vision's (a LayerNorm and a GELU MLP) with the epsilon
        and GELU of the blocks' `norm_spec` and `mlp_spec`."""
        if self.classifier == "map":
            return Pooling(MAPHead(
                self.map_num_heads or num_heads, mlp_dim,
                num_prefix_tokens=0 if self.map_prefix else num_prefix_tokens,
                norm_spec=norms.NormSpec("layer_norm", norm_spec.epsilon),
                mlp_spec=mlp_lib.MlpSpec("gelu", mlp_spec.gelu), dtype=dtype, name="MAPHead_0"))
        if self.distilled:
            return Pooling(TokenPooling("token", dtype=dtype, name="pooling"),
                           TokenPooling("distillation", dtype=dtype, name="pooling_dist"))
        return Pooling(TokenPooling(self.classifier, num_prefix_tokens=num_prefix_tokens,
                                    dtype=dtype, name="pooling"))

    def heads(self, num_classes, dtype=None):
        """The Dense heads, zero-initialised: `head`, and DeiT's `head_dist` for the
        distillation token."""
        names = ("head", "head_dist") if self.distilled else ("head",)
        return [keras.layers.Dense(num_classes, kernel_initializer="zeros", dtype=dtype,
                                   name=name) for name in names]


def head_spec(config, classifier):
    """The `HeadSpec` of a `ViTConfig` pooled with `classifier` (`distillation`, `fc_norm`,
    `map_num_heads`, `map_prefix`)."""
    return HeadSpec(classifier, config.distillation, config.fc_norm, config.map_num_heads,
                    config.map_prefix)


def classify(heads, pooled, dtype=None):
    """The logits of `pooled` (a tensor, or DeiT's pair) through `heads` (DeiT's two averaged,
    as timm does at inference); without heads, the pooled features (DeiT's pair averaged)."""
    if not isinstance(pooled, (list, tuple)):
        return heads[0](pooled) if heads else pooled
    if heads:
        pooled = [head(x) for head, x in zip(heads, pooled)]
    return keras.layers.Average(dtype=dtype, name="distilled_average")(pooled)
