"""How the encoder's projections, LayerNorms and GELU compute on each backend and device, chosen
once when a layer is built (attention has its own table: `vit_keras.model.attention`).

| chooses               | torch                       | JAX's CPU, workarounds | other JAX   | TF      |
|-----------------------|-----------------------------|------------------------|-------------|---------|
| `choose_projection`   | `F.linear`, bias in product | bfloat16 einsum        | 2-D product | Dense   |
| `choose_linear`       | `F.linear`, bias in product | bfloat16 einsum        | einsum      | einsum  |
| `choose_layer_norm`   | `F.layer_norm`, input dtype | layer call             | own VJP     | layer   |
| `choose_gelu` (exact) | torch's fused GELU          | erf                    | erf         | erf     |

On torch a Keras `Dense` is a matrix product and a separate bias kernel, and Keras' LayerNorm
casts a bfloat16 input to float32 and its output back (two copies); `torch.nn.functional`'s
`linear` puts the bias in the product's epilogue, and its `layer_norm` normalises a bfloat16
input in float32 itself (its weights cast to bfloat16, which CUDA's kernel asks for).
The XLA:CPU column is `vit_keras.model.xla_cpu`'s workaround for bfloat16 products. On JAX's
other devices (a GPU) a projection is one product of 2-D matrices, `(batch * tokens, in)` by
`(in, out)`, whose weight gradient contracts one axis (Keras' rank-3 product contracts batch and
tokens, for which XLA wrote transposed copies of the activations), and a LayerNorm is
`vit_keras.model.jax_layer_norm`'s, whose backward pass is written out.
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
    if xla_cpu.workarounds_active():
        return _einsum_projection
    return matrix_projection if keras.backend.backend() == "jax" else _dense_call


def _dense_call(dense, x):
    return dense(x)


def _einsum_projection(dense, x):
    if adapted(dense) or dense.activation is not keras.activations.linear:
        return dense(x)
    y = xla_cpu.bfloat16_einsum("btd,dn->btn", x, dense.kernel)
    return y if dense.bias is None else y + dense.bias


def matrix_projection(layer, x):
    """`layer(x)` for a `Dense` or `EinsumDense` that contracts the last axes of
    `(batch, tokens, *in)` with the first of its kernel `(*in, *out)`, as one product of 2-D
    matrices: `(batch * tokens, prod(in))` by `(prod(in), prod(out))`, then `(batch, tokens,
    *out)`. Any other layer (quantized, LoRA, an activation, another contraction, a bias over
    some of the output's axes) is called."""
    kernel = getattr(layer, "kernel", None)
    contracted = tuple(x.shape[2:])
    out = () if kernel is None else tuple(kernel.shape[len(contracted):])
    bias = getattr(layer, "bias", None)
    if (kernel is None or adapted(layer) or getattr(layer, "activation", None) not in (
            None, keras.activations.linear) or tuple(kernel.shape[:len(contracted)]) != contracted
            or (bias is not None and tuple(bias.shape) != out)
            or not _contracts_leading_axes(layer)):
        return layer(x)
    batch, tokens = ops.shape(x)[0], x.shape[1]
    y = ops.matmul(ops.reshape(x, (-1, math.prod(contracted))),
                   ops.reshape(ops.convert_to_tensor(kernel), (math.prod(contracted), -1)))
    if bias is not None:
        y = y + ops.reshape(ops.convert_to_tensor(bias), (-1,))
    return ops.reshape(y, (batch, tokens, *out))


def _contracts_leading_axes(layer):
    """Whether the layer is a `Dense`, or an `EinsumDense` whose equation contracts its input's
    last axes with its kernel's first, in order, and keeps the other axes in order
    (`"btd,dhk->bthk"`, `"bthk,hkd->btd"`)."""
    if isinstance(layer, keras.layers.Dense):
        return True
    equation = getattr(layer, "equation", None)
    if not isinstance(layer, keras.layers.EinsumDense) or not equation:
        return False
    inputs, output = equation.replace(" ", "").split("->")
    x_axes, kernel_axes = inputs.split(",")
    shared = [axis for axis in x_axes if axis in kernel_axes]
    kept = x_axes[:len(x_axes) - len(shared)]
    own = kernel_axes[len(shared):]
    return (x_axes.endswith("".join(shared)) and kernel_axes.startswith("".join(shared))
            and output == kept + own and kept == x_axes[:2])


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
    `(batch, tokens, hidden)`: a function `(norm, x, training) -> norm(x)`, computed as the table
    says. JAX's written gradient serves training calls only: at inference XLA fuses Keras' own
    forward pass better (2-4% of a ViT-B/16 forward pass on an H200, docs/performance.md)."""
    if keras.backend.backend() == "torch":
        return _torch_layer_norm
    if keras.backend.backend() == "jax" and not xla_cpu.workarounds_active():
        return _jax_layer_norm
    return _layer_call


def _layer_call(layer, x, training=None):
    del training  # a LayerNorm computes the same in training
    return layer(x)


def _plain_layer_norm(norm, x):
    """Whether `norm` is a Keras LayerNorm (not RMS-scaled) over the last axis of `x`."""
    if not isinstance(norm, keras.layers.LayerNormalization) or norm.rms_scaling:
        return False
    axes = [norm.axis] if isinstance(norm.axis, int) else list(norm.axis)
    return [axis % len(x.shape) for axis in axes] == [len(x.shape) - 1]


def _jax_layer_norm(norm, x, training=None):
    if not (training and _plain_layer_norm(norm, x) and norm.center and norm.scale):
        return norm(x)
    from vit_keras.model import jax_layer_norm  # pylint: disable=import-outside-toplevel

    return jax_layer_norm.layer_norm(ops.convert_to_tensor(x, norm.compute_dtype),
                                     ops.convert_to_tensor(norm.gamma),
                                     ops.convert_to_tensor(norm.beta), norm.epsilon)


def _torch_layer_norm(norm, x, training=None):
    del training
    if not _plain_layer_norm(norm, x):  # RMSNorm: its own call
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
