"""The heads: how a ViT's tokens become one vector per image, and that vector class logits.

Poolings (`classifier=`): the class token (`"token"`), the mean of the patch tokens (`"gap"`),
SigLIP's attention pooling (`"map"`, `MAPHead`), and DeiT's distilled pair (the class and the
distillation token, each read by its own head, the two heads' logits averaged). `pooling_for`
builds a model's pooling, `classifier_heads` its Dense heads and `classify` joins them.

`MAPHead`'s weight names are big_vision's, so checkpoints map by name:
`MAPHead_0/probe`, `MAPHead_0/MultiHeadDotProductAttention_0/{query,key,value,out}/...`,
`MAPHead_0/LayerNorm_0/...`, `MAPHead_0/MlpBlock_0/Dense_{0,1}/...`.
"""

import keras
from keras import ops

from vit_keras.model import attention as attention_lib
from vit_keras.model import mlp as mlp_lib

_PACKAGE = "vit_keras"

CLASSIFIERS = ("token", "gap", "map")
"""Poolings: the class token, the mean of the patch tokens, SigLIP's attention pooling (MAP)."""


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MAPHead(keras.layers.Layer):
    """Multi-head attention pooling: `probe' = attn(probe, tokens)`, then `y + mlp(LN(y))`.

    Input: `(batch, tokens, hidden)`; the first `num_prefix_tokens` (class, distillation, register
    tokens) are left out, as timm does. Output: `(batch, hidden)`.
    Weights: `probe` `(1, 1, hidden)`; the attention's projections in the encoder blocks' layout
    (`query|key|value/kernel` `(hidden, heads, head_dim)`, `out/kernel` `(heads, head_dim,
    hidden)`); `LayerNorm_0`; `MlpBlock_0` `(hidden, mlp_dim)`, `(mlp_dim, hidden)`.
    """

    def __init__(self, num_heads, mlp_dim, layer_norm_epsilon=1e-6, gelu="exact",
                 num_prefix_tokens=0, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.mlp_dim = int(mlp_dim)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.gelu = mlp_lib.gelu_variant(gelu)
        self.num_prefix_tokens = int(num_prefix_tokens)
        policy = self.dtype_policy
        self.attention = attention_lib.MultiHeadDotProductAttention(
            self.num_heads, dtype=policy, name="MultiHeadDotProductAttention_0")
        self.norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="LayerNorm_0")
        self.mlp = mlp_lib.MlpBlock(self.mlp_dim, gelu=self.gelu, dtype=policy, name="MlpBlock_0")

    def build(self, input_shape):
        hidden = input_shape[-1]
        # big_vision initialises the probe xavier-uniform; its scale matters only for training.
        self.probe = self.add_weight(name="probe", shape=(1, 1, hidden),
                                     initializer="glorot_uniform")
        self.attention.build(input_shape)
        self.norm.build((input_shape[0], 1, hidden))
        self.mlp.build((input_shape[0], 1, hidden))

    def call(self, x):
        if self.num_prefix_tokens:
            x = x[:, self.num_prefix_tokens:]
        probe = ops.broadcast_to(ops.cast(self.probe, x.dtype), (ops.shape(x)[0], 1, x.shape[-1]))
        attention = self.attention
        # Cross-attention through the projections as layers (quantized or LoRA ones included):
        # the probe queries, the tokens are keys and values; (batch, tokens, heads, head_dim).
        q, k, v = attention.query(probe), attention.key(x), attention.value(x)
        y = attention.out(ops.dot_product_attention(q, k, v))
        y = y + self.mlp(self.norm(y))
        return y[:, 0]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "mlp_dim": self.mlp_dim,
                "layer_norm_epsilon": self.layer_norm_epsilon, "gelu": self.gelu,
                "num_prefix_tokens": self.num_prefix_tokens}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TokenPooling(keras.layers.Layer):
    """Reduces the token sequence to one vector per image.

    Input: `(batch, tokens, hidden)`. Output: `(batch, hidden)`: the class token (`mode="token"`),
    the mean over the patch tokens after the `num_prefix_tokens` class, distillation and register
    tokens (`mode="gap"`, computed in float32), or DeiT's distillation token, token 1
    (`mode="distillation"`).
    """

    MODES = ("token", "gap", "distillation")

    def __init__(self, mode="token", num_prefix_tokens=0, **kwargs):
        super().__init__(**kwargs)
        if mode not in self.MODES:
            raise ValueError(f"Unknown pooling mode {mode!r}; expected one of {self.MODES}.")
        self.mode = mode
        self.num_prefix_tokens = int(num_prefix_tokens)

    def call(self, x):
        if self.mode == "token":
            return x[:, 0]
        if self.mode == "distillation":
            return x[:, 1]
        patches = x[:, self.num_prefix_tokens:] if self.num_prefix_tokens else x
        return ops.cast(ops.mean(ops.cast(patches, "float32"), axis=1), x.dtype)

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

    def __call__(self, tokens):
        if self.distilled:
            return [layer(tokens) for layer in self.layers]
        return self.layers[0](tokens)

    def pooled(self, tokens, name=None):
        if not self.distilled:
            return self.layers[0](tokens)
        pair = self(tokens)
        return keras.layers.Average(dtype=pair[0].dtype, name=name)(pair)


def pooling_for(config, classifier, dtype=None):
    """The `Pooling` of a model of `config` pooling with `classifier` (one of `CLASSIFIERS`)."""
    num_prefix = config.num_prefix_tokens(classifier)
    if classifier == "map":
        # SigLIP's head reads the patch tokens; PE's (map_prefix) every token.
        return Pooling(MAPHead(config.map_num_heads or config.num_heads, config.mlp_dim,
                               layer_norm_epsilon=config.layer_norm_epsilon, gelu=config.gelu,
                               num_prefix_tokens=0 if config.map_prefix else num_prefix,
                               dtype=dtype, name="MAPHead_0"))
    if config.distillation:
        return Pooling(TokenPooling("token", dtype=dtype, name="pooling"),
                       TokenPooling("distillation", dtype=dtype, name="pooling_dist"))
    return Pooling(TokenPooling(classifier, num_prefix_tokens=num_prefix, dtype=dtype,
                                name="pooling"))


def classifier_heads(config, num_classes, dtype=None):
    """The Dense heads, zero-initialised: `head`, and DeiT's `head_dist` for the distillation
    token."""
    names = ("head", "head_dist") if config.distillation else ("head",)
    return [keras.layers.Dense(num_classes, kernel_initializer="zeros", dtype=dtype, name=name)
            for name in names]


def classify(heads, pooled, dtype=None):
    """The logits of `pooled` (a tensor, or DeiT's pair) through `heads` (DeiT's two averaged,
    as timm does at inference); without heads, the pooled features (DeiT's pair averaged)."""
    if not isinstance(pooled, (list, tuple)):
        return heads[0](pooled) if heads else pooled
    if heads:
        pooled = [head(x) for head, x in zip(heads, pooled)]
    return keras.layers.Average(dtype=dtype, name="distilled_average")(pooled)
