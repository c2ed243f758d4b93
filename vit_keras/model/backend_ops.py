"""How the encoder's projections, LayerNorms and GELU compute on each backend and device, chosen
once when a layer is built (attention has its own table: `vit_keras.model.attention`).

| chooses               | torch                        | JAX's CPU, workarounds on | elsewhere   |
|-----------------------|------------------------------|---------------------------|-------------|
| `choose_projection`   | `F.linear`, bias in product  | bfloat16 einsum           | Dense call  |
| `choose_linear`       | `F.linear`, bias in product  | bfloat16 einsum           | einsum      |
| `choose_layer_norm`   | `F.layer_norm`, input dtype  | layer call                | layer call  |
| `choose_gelu` (exact) | torch's fused GELU           | erf                       | erf         |

On torch a Keras `Dense` is a matrix product and a separate bias kernel, and Keras' LayerNorm
casts a bfloat16 input to float32 and its output back (two copies); `torch.nn.functional`'s
`linear` puts the bias in the product's epilogue, and its `layer_norm` normalises a bfloat16
input in float32 itself (its weights cast to bfloat16, which CUDA's kernel asks for).
The XLA:CPU column is `vit_keras.model.xla_cpu`'s workaround for bfloat16 products.
"""

import math

import keras
from keras import ops

from vit_keras.model import xla_cpu


def adapted(*layers):
    """Whether a projection layer is quantized or LoRA-enabled: its `kernel` is then not the weight
    its call multiplies by (int8 values without their scale, no LoRA delta), so it must be called.

    Read on every call (once per trace where the backend traces), not when the layer that holds
    the projections is built: `model.quantize` and `enable_lora` change the projections
    afterwards, on the projections themselves, without telling the layer that holds them.
    """
    return any(layer.quantization_mode or layer.lora_enabled for layer in layers)


def choose_projection():
    """How a layer built now applies a `Dense` layer to `(batch, tokens, features)`: a function
    `(dense, x) -> dense(x)`, computed as the table above says."""
    if keras.backend.backend() == "torch":
        return _torch_linear
    return _einsum_projection if xla_cpu.workarounds_active() else _dense_call


def _dense_call(dense, x):
    return dense(x)


def _einsum_projection(dense, x):
    if adapted(dense) or dense.activation is not keras.activations.linear:
        return dense(x)
    y = xla_cpu.bfloat16_einsum("btd,dn->btn", x, dense.kernel)
    return y if dense.bias is None else y + dense.bias


def _torch_linear(dense, x):
    if adapted(dense) or dense.activation is not keras.activations.linear:
        return dense(x)
    return torch_linear(x, dense.kernel, dense.bias)


def choose_linear():
    """`(x, kernel, bias) -> x @ kernel + bias` for a layer built now, `x` `(batch, tokens, in)`,
    `kernel` `(in, out)`, `bias` `(out,)` or None: torch's `F.linear` on torch, else an einsum
    (`vit_keras.model.xla_cpu.choose_einsum`: bfloat16 products on XLA:CPU) and an addition."""
    if keras.backend.backend() == "torch":
        return torch_linear
    einsum = xla_cpu.choose_einsum()

    def linear(x, kernel, bias):
        y = einsum("btd,dn->btn", x, kernel)
        return y if bias is None else y + bias
    return linear


def torch_linear(x, kernel, bias):
    """`x @ kernel + bias` as `torch.nn.functional.linear`: one product with the bias in its
    epilogue; `kernel` `(in, out)` (a variable or tensor, read as the caller's autocast asks)."""
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

    bias = None if bias is None else ops.convert_to_tensor(bias)
    return F.linear(x, ops.convert_to_tensor(kernel).T, bias)


def choose_layer_norm():
    """How a layer built now applies a `keras.layers.LayerNormalization` over the last axis of
    `(batch, tokens, hidden)`: a function `(norm, x) -> norm(x)`, computed as the table says."""
    return _torch_layer_norm if keras.backend.backend() == "torch" else _layer_call


def _layer_call(layer, x):
    return layer(x)


def _torch_layer_norm(norm, x):
    rank = len(x.shape)
    if not isinstance(norm, keras.layers.LayerNormalization):  # RMSNorm: its own call
        return norm(x)
    axes = [norm.axis] if isinstance(norm.axis, int) else list(norm.axis)
    if norm.rms_scaling or [axis % rank for axis in axes] != [rank - 1]:
        return norm(x)
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

    # torch normalises a bfloat16 or float16 input in float32 itself; on CUDA its weights must
    # have the input's dtype ("expected scalar type BFloat16 but found Float"), so the float32
    # weights (Keras' LayerNorm does not autocast them) are cast: two small copies, where Keras'
    # own call copies the whole input to float32 and its output back.
    x = ops.convert_to_tensor(x, norm.compute_dtype)
    weight = None if norm.gamma is None else ops.cast(norm.gamma, x.dtype)
    bias = None if norm.beta is None else ops.cast(norm.beta, x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, norm.epsilon)


def choose_gelu(approximate):
    """GELU for a layer built now: a function of `x` (any shape).

    Exact GELU is x·Φ(x) written through erf on JAX and TensorFlow: `jax.nn.gelu` and
    `tf.nn.gelu` go through erfc, which XLA expands into exponentials and selects (8% more HLO in
    a ViT-Ti/16 training step). On torch it is torch's one fused kernel; `approximate=True` is the
    tanh form (Flax's) everywhere.
    """
    if approximate:
        return _tanh_gelu
    return _torch_gelu if keras.backend.backend() == "torch" else _erf_gelu


def _tanh_gelu(x):
    return ops.gelu(x, approximate=True)


def _torch_gelu(x):
    return ops.gelu(x, approximate=False)


def _erf_gelu(x):
    return 0.5 * x * (1.0 + ops.erf(x * (1.0 / math.sqrt(2.0))))


def dropped(dropout, x, training):
    """`dropout(x, training=training)`, without the layer call where it drops nothing: on torch
    every layer call costs the host time that the GPU then waits for."""
    return dropout(x, training=training) if dropout.rate > 0 else x
