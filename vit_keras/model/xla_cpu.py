"""The workarounds that let XLA:CPU train a ViT as fast as PyTorch does, and their switch.

Layers choose how they compute once, when they are built (`vit_keras.model.attention` for attention,
`vit_keras.model.backend_ops` for projections, LayerNorms and GELU); on XLA:CPU those tables take the
pieces here:

- `choose_einsum`: the encoder's matrix products (item 2 below).
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
Both compute the same function, up to float rounding.

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

        with vit_keras.model.xla_cpu.set_workarounds(False):
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
    return bfloat16_einsum if workarounds_active() else _keras_einsum


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


def bfloat16_einsum(equation, a, b):
    """`einsum` with bfloat16 products for two bfloat16 operands (item 2), `keras.ops.einsum`
    otherwise, whatever the switch says: the einsum of layers built with the workarounds active."""
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
