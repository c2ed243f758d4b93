"""SigLIP's attention-pooling head (big_vision's `MAPHead`, timm's `AttentionPoolLatent`).

A learned probe token attends once over the patch tokens; the result passes a LayerNorm and an
MLP with a residual connection. Weight names are big_vision's, so checkpoints map by name:
`MAPHead_0/probe`, `MAPHead_0/MultiHeadDotProductAttention_0/{query,key,value,out}/...`,
`MAPHead_0/LayerNorm_0/...`, `MAPHead_0/MlpBlock_0/Dense_{0,1}/...`.
"""

import keras
from keras import ops

from vit_keras import layers

_PACKAGE = "vit_keras"


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
        self.gelu = layers.gelu_variant(gelu)
        self.num_prefix_tokens = int(num_prefix_tokens)
        policy = self.dtype_policy
        self.attention = layers.MultiHeadDotProductAttention(
            self.num_heads, dtype=policy, name="MultiHeadDotProductAttention_0")
        self.norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="LayerNorm_0")
        self.mlp = layers.MlpBlock(self.mlp_dim, gelu=self.gelu, dtype=policy, name="MlpBlock_0")

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
