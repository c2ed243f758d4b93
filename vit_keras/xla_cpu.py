"""How the layers compute where the device matters: fused attention where a kernel exists, and the
workarounds that let XLA:CPU train a ViT as fast as PyTorch does.

Each layer chooses its implementation once, when it is built, through the `choose_*` functions
here; `vit_keras.layers` then reads as the model (project, attend, out; Dense, GELU, Dense):

- `choose_attention`: `FusedAttention` (`keras.ops.dot_product_attention`) where that reaches a
  fused kernel, else `ExplicitAttention` (head-major, float32 softmax), which is also the kernel
  for calls that return or drop the attention probabilities.
- `choose_einsum`, `choose_projection`: the encoder's matrix products (item 2 below).
- `choose_gelu`: exact GELU in each backend's fastest form.
- `choose_block_boundary`: each encoder block's gradient barrier (item 1 below).

The workarounds were found by profiling ViT training steps on CPU with `jax.profiler` (the
performance docs have the measurements). Two of them live in the layers and sit behind one
switch; the third changes the process's memory allocator and is an explicit opt-in.

The switch: `VIT_KERAS_XLA_CPU_WORKAROUNDS=0|1` (read when the first layer is built; default 1) or
`set_workarounds(enabled)` (also a context manager), which takes effect for layers built after it
(a model keeps the choices it was built with, whenever it is traced). Switched on, the
workarounds apply where Keras runs on JAX with a CPU device and nowhere else
(`workarounds_active()`); switched off, the layers are plain Keras there too: `keras.ops.einsum`
and `Dense` calls, no gradient barrier and attention through `keras.ops.dot_product_attention`.
Both compute the same function, up to float rounding. (Exact GELU is written through `erf` on
JAX and TensorFlow whatever the switch: `jax.nn.gelu` and `tf.nn.gelu` go through `erfc`, which
XLA expands into exponentials and selects on every device.)

1. XLA fuses the elementwise part of each LayerNorm backward, and the residual additions between
   blocks, into *every* consumer of the residual stream's gradient instead of computing that
   gradient once. Each layer's weight-gradient then recomputes the chain from the loss down to
   that layer, a cost that grows with the square of the depth. `materialize_gradient` marks the
   block boundary: an identity whose cotangent passes through a conditional, which XLA does not
   fuse across. (`jax.lax.optimization_barrier` would say this directly, but XLA:CPU removes it
   before fusion.) Attention takes the explicit head-major path, which XLA:CPU differentiates
   faster than the token-major softmax `keras.ops.dot_product_attention` is on CPU.
2. Under `mixed_bfloat16`, XLA:CPU runs a bfloat16 product whose result is bfloat16 as a float32
   product: it converts both operands, so mixed precision trains no faster than float32. A
   product of bfloat16 operands with a float32 result stays bfloat16. `einsum` asks for that,
   rounds the result to bfloat16, and does the same in both gradients, which JAX would otherwise
   derive as float32 x bfloat16 products.
3. XLA:CPU allocates each execution's scratch buffer with `malloc`, which glibc maps afresh for
   every step unless told to keep freed memory: `vit_keras.host_memory.keep_freed_host_memory`
   (re-exported here), an explicit opt-in since it changes the whole process.
"""

import functools
import math
import os

import keras
from keras import ops

from vit_keras.host_memory import keep_freed_host_memory  # noqa: F401 (item 3, re-exported)

SWITCH = "VIT_KERAS_XLA_CPU_WORKAROUNDS"

# set_workarounds' setting; None: the environment's, read when first needed.
_enabled = None


def _environment_setting():
    value = os.environ.get(SWITCH, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH}={value!r} is not a setting; use 0 (workarounds off) or 1 "
                         f"(on where Keras runs on JAX with a CPU device, the default).")
    return value == "1"


def workarounds_enabled():
    """The switch: `set_workarounds`' setting, else `VIT_KERAS_XLA_CPU_WORKAROUNDS` (default on)."""
    global _enabled  # pylint: disable=global-statement
    if _enabled is None:
        _enabled = _environment_setting()
    return _enabled


class set_workarounds:  # pylint: disable=invalid-name  (a function to its callers)
    """Switches the layers' XLA:CPU workarounds on or off for layers built from now on.

    `enabled=None` returns to the environment's setting. A layer keeps the choice it was built
    with: build (or load) the model after switching. `einsum` and `materialize_gradient`, called
    outside a layer, read the switch when called. Also a context manager that restores the
    previous setting:

        with vit_keras.xla_cpu.set_workarounds(False):
            plain_model = vit_keras.build_model("ViT-Ti/16")
    """

    def __init__(self, enabled):
        global _enabled  # pylint: disable=global-statement
        self._previous = _enabled
        _enabled = None if enabled is None else bool(enabled)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        global _enabled  # pylint: disable=global-statement
        _enabled = self._previous


@functools.cache
def _jax_platform():
    import jax  # pylint: disable=import-outside-toplevel

    return jax.devices()[0].platform


def on_xla_cpu():
    """Whether Keras runs on JAX with a CPU as its device, whatever the switch says."""
    return keras.backend.backend() == "jax" and _jax_platform() == "cpu"


def workarounds_active():
    """Whether layers built now apply the workarounds: on XLA:CPU with the switch on."""
    return on_xla_cpu() and workarounds_enabled()


# Attention ---------------------------------------------------------------------------------------

def choose_attention(compute_dtype, *, probabilities=False):
    """The attention kernel for a `MultiHeadDotProductAttention` built now, in `compute_dtype`.

    `FusedAttention` where `keras.ops.dot_product_attention` reaches a fused kernel: on torch
    (scaled_dot_product_attention) and on JAX accelerators (cuDNN flash attention, Splash on TPU).
    On JAX's CPU and on TensorFlow it is an unfused softmax in a token-major layout, which
    differentiates slower than `ExplicitAttention`'s head-major one; JAX's CPU takes it anyway with
    the workarounds switched off. float16 takes the explicit kernel too: the fused kernels
    accumulate float16 products into float32, which XLA on CPU cannot do (jax: "precision
    F16_F16_F32 is not supported"). With `probabilities=True`, the kernel for calls that return or
    drop the probabilities: always the explicit one.
    """
    explicit = ExplicitAttention(choose_einsum())
    if probabilities or compute_dtype == "float16":
        return explicit
    backend = keras.backend.backend()
    if backend == "torch" or (backend == "jax" and not workarounds_active()):
        return FusedAttention()
    return explicit


def _adapted(*projections):
    """Whether a projection is quantized or LoRA-enabled: its `kernel` is then not the weight its
    call multiplies by (int8 values without their scale, no LoRA delta), so it must be called.

    Read where the kernels project, once per trace, not when the attention layer is built:
    `model.quantize` and `enable_lora` change the projections afterwards, on the projections
    themselves, without telling the layer that holds them.
    """
    return any(projection.quantization_mode or projection.lora_enabled
               for projection in projections)


class FusedAttention:
    """`keras.ops.dot_product_attention` over q, k and v in the projections' token-major layout.

    A kernel has three steps, each given the attention layer (its `query`, `key`, `value` and
    `out` projections): `project(layer, x)` → q, k, v; `attend(q, k, v)` → the attended values and
    the float32 probabilities (None here: a fused kernel has none); `out(layer, attended)` →
    `(batch, tokens, hidden)`. The projections are called as layers, so quantized or LoRA-enabled
    ones apply their own arithmetic.
    """

    name = "fused"

    def project(self, layer, x):
        """`(batch, tokens, hidden)` → q, k, v, each `(batch, tokens, heads, head_dim)`."""
        return layer.query(x), layer.key(x), layer.value(x)

    def attend(self, q, k, v, dropout=None):
        """`(batch, tokens, heads, head_dim)` each → the attended values in the same layout, and
        None. No probabilities to drop: the layer takes `ExplicitAttention` for that."""
        if dropout is not None:
            raise ValueError("FusedAttention has no probabilities to drop; attention dropout "
                             "takes ExplicitAttention (choose_attention(..., probabilities=True)).")
        return ops.dot_product_attention(q, k, v), None

    def out(self, layer, attended):
        """`(batch, tokens, heads, head_dim)` → `(batch, tokens, hidden)`."""
        return layer.out(attended)


class ExplicitAttention:
    """Softmax attention written out, in a head-major layout, with a float32 softmax.

    q, k and v come from one matrix multiply in the layout `(batch, heads, tokens, head_dim)`,
    which XLA:CPU (JAX and TensorFlow) differentiates faster than the token-major softmax of
    `keras.ops.dot_product_attention`; the products go through `einsum` (`choose_einsum`: bfloat16
    products on XLA:CPU, item 2). The kernel for attention scores, attention dropout and float16.
    Quantized or LoRA-enabled projections are called as layers, so their own arithmetic applies.
    The three steps are `FusedAttention`'s.
    """

    name = "explicit"

    def __init__(self, einsum):
        self.einsum = einsum

    def project(self, layer, x):
        """`(batch, tokens, hidden)` → q, k, v, each `(batch, heads, tokens, head_dim)`.

        One matrix multiply with the three kernels side by side: on CPU a few large products use
        the cores better than many small ones.
        """
        projections = (layer.query, layer.key, layer.value)
        if _adapted(*projections, layer.out):
            return [ops.transpose(projection(x), (0, 2, 1, 3)) for projection in projections]
        kernel = ops.concatenate([projection.kernel for projection in projections], axis=1)
        bias = ops.concatenate([projection.bias for projection in projections], axis=0)
        qkv = self.einsum("btd,dhk->bhtk", x, kernel) + ops.expand_dims(bias, 1)
        return ops.split(qkv, 3, axis=1)

    def attend(self, q, k, v, dropout=None):
        """`(batch, heads, tokens, head_dim)` each → the attended values in the same layout, and
        the probabilities `(batch, heads, tokens, tokens)` in float32. `dropout`, a Dropout layer,
        drops probabilities (called with `training=True`)."""
        # Scaling q before the product keeps float16 logits in range; softmax runs in float32.
        logits = self.einsum("bhqd,bhkd->bhqk", q * (1.0 / math.sqrt(q.shape[-1])), k)
        probabilities = ops.softmax(ops.cast(logits, "float32"), axis=-1)
        weights = ops.cast(probabilities, q.dtype)
        if dropout is not None:
            weights = dropout(weights, training=True)
        return self.einsum("bhqk,bhkd->bhqd", weights, v), probabilities

    def out(self, layer, attended):
        """`(batch, heads, tokens, head_dim)` → `(batch, tokens, hidden)`."""
        if _adapted(layer.query, layer.key, layer.value, layer.out):
            return layer.out(ops.transpose(attended, (0, 2, 1, 3)))
        return self.einsum("bhtk,hkd->btd", attended, layer.out.kernel) + layer.out.bias


# The MLP: projections and GELU -------------------------------------------------------------------

def choose_projection():
    """How a layer built now applies a `Dense` layer to `(batch, tokens, features)`: a function
    `(dense, x) -> dense(x)`.

    With the workarounds active, an einsum with the layer's kernel, for its bfloat16 products
    (item 2), unless the layer is quantized or LoRA-enabled; elsewhere the layer's own call.
    """
    return _einsum_projection if workarounds_active() else _dense_call


def _dense_call(dense, x):
    return dense(x)


def _einsum_projection(dense, x):
    if _adapted(dense):
        return dense(x)
    return _bfloat16_einsum("btd,dn->btn", x, dense.kernel) + dense.bias


def choose_gelu(approximate):
    """GELU for a layer built now: a function of `x` (any shape).

    Exact GELU is x·Φ(x) written through erf on JAX and TensorFlow, whatever the switch:
    `jax.nn.gelu` and `tf.nn.gelu` go through erfc, which XLA expands into exponentials and
    selects (8% more HLO in a ViT-Ti/16 training step). On torch it is torch's one fused kernel;
    `approximate=True` is the tanh form (Flax's) everywhere.
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


# The gradient barrier ----------------------------------------------------------------------------

def choose_block_boundary():
    """The identity an encoder block built now applies to its input `(batch, tokens, hidden)`:
    with the workarounds active one whose gradient is computed once, not fused into every
    consumer (item 1); elsewhere a plain identity (on accelerators a conditional costs a host
    round trip)."""
    return _barrier if workarounds_active() else _identity


def materialize_gradient(x):
    """Identity on `x` (any shape); with the workarounds active (read now) its gradient is computed
    once, not fused into every consumer (item 1). The barrier `choose_block_boundary` gives."""
    return choose_block_boundary()(x)


def _identity(x):
    return x


def _barrier(x):
    return _jax_cpu_barrier()(x)


@functools.cache
def _jax_cpu_barrier():
    import jax  # pylint: disable=import-outside-toplevel

    @jax.custom_vjp
    def barrier(x):
        return x

    def backward(_, cotangent):
        first = cotangent.ravel()[0]
        # Both branches keep the cotangent's meaning (a NaN stays NaN); they differ so that XLA
        # cannot fold the conditional away.
        return (jax.lax.cond(first == first, lambda g: g, lambda g: g + first, cotangent),)

    barrier.defvjp(lambda x: (x, None), backward)
    return barrier


# bfloat16 products -------------------------------------------------------------------------------

def choose_einsum():
    """The einsum a layer built now multiplies with, `(equation, a, b) -> product`: with the
    workarounds active one with bfloat16 products (item 2), elsewhere `keras.ops.einsum`. Both
    take the equations `einsum` takes."""
    return _bfloat16_einsum if workarounds_active() else _keras_einsum


def einsum(equation, a, b):
    """`keras.ops.einsum(equation, a, b)`, with bfloat16 products where the workarounds are active
    (read now; item 2).

    `equation` names both operands and the result (no `...`), and every index of an operand
    appears once in it and also in the other operand or the result, so that each gradient is an
    einsum too; anything else raises a `ValueError` on every backend. With the workarounds active
    and two bfloat16 operands, products accumulate in float32 and the result is rounded to
    bfloat16, as XLA does for bfloat16 elsewhere; otherwise this is `keras.ops.einsum`.
    """
    return choose_einsum()(equation, a, b)


def _keras_einsum(equation, a, b):
    return ops.einsum(_checked(equation.replace(" ", "")), a, b)


def _bfloat16_einsum(equation, a, b):
    equation = _checked(equation.replace(" ", ""))
    a, b = ops.convert_to_tensor(a), ops.convert_to_tensor(b)  # variables: their autocast value
    if a.dtype == b.dtype == "bfloat16":
        return _bfloat16_product(equation)(a, b)
    return ops.einsum(equation, a, b)


@functools.cache
def _checked(equation):
    operands, _, result = equation.partition("->")
    indices = operands.split(",")
    if len(indices) == 2:
        (a, b), result = indices, set(result)
        if all(len(set(x)) == len(x) and set(x) <= set(y) | result for x, y in ((a, b), (b, a))):
            return equation
    raise ValueError(
        f"einsum {equation!r}: name two operands and the result, each index of an operand once in "
        "it and also in the other operand or the result (its gradients are then einsums too).")


@functools.cache
def _bfloat16_product(equation):
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    operands, result = equation.split("->")
    a_indices, b_indices = operands.split(",")

    def product(equation, x, y):
        return jnp.einsum(equation, x, y, preferred_element_type=jnp.float32).astype(x.dtype)

    @jax.custom_vjp
    def bfloat16_einsum(a, b):
        return product(equation, a, b)

    def backward(operands, cotangent):
        a, b = operands
        cotangent = cotangent.astype(a.dtype)
        return (product(f"{result},{b_indices}->{a_indices}", cotangent, b),
                product(f"{a_indices},{result}->{b_indices}", a, cotangent))

    bfloat16_einsum.defvjp(lambda a, b: (bfloat16_einsum(a, b), (a, b)), backward)
    return bfloat16_einsum
