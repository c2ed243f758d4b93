"""Three workarounds that let the JAX backend train a ViT on CPU as fast as PyTorch does.

Found by profiling a ViT-Ti/16 training step (batch 8, 2 cores) with `jax.profiler`; without
them the step took ~2x as long as timm's (README, "Performance", has the numbers):

1. XLA fuses the elementwise part of each LayerNorm backward, and the residual additions between
   blocks, into *every* consumer of the residual stream's gradient instead of computing that
   gradient once. Each layer's weight-gradient then recomputes the chain from the loss down to
   that layer, a cost that grows with the square of the depth: a third of the step for 12 blocks.
   `materialize_gradient` marks the block boundary: an identity whose cotangent passes through a
   conditional, which XLA does not fuse across. (`jax.lax.optimization_barrier` would say this
   directly, but XLA:CPU removes it before fusion.)
2. XLA:CPU allocates each execution's scratch buffer (557 MB for that step) with `malloc`; glibc
   maps a block that large afresh with `mmap` and unmaps it on `free`, so every step page-faults
   the whole buffer in again (150k faults, 0.3 CPU-seconds per step). `keep_freed_host_memory`
   makes glibc serve large blocks from its heap and keep them, so a step reuses earlier steps'
   pages (on a busy machine some steps still extend the heap by one buffer before it settles).
   `import vit_keras` applies it on the JAX backend unless `VIT_KERAS_KEEP_HOST_MEMORY=0`.
3. Under `mixed_bfloat16`, XLA:CPU runs a bfloat16 product whose result is bfloat16 as a float32
   product: it converts both operands, so mixed precision trained no faster than float32. A
   product of bfloat16 operands with a float32 result stays bfloat16 (1.6-1.9x the float32
   speed on an AVX512-BF16 CPU). `einsum` asks for that, rounds the result to bfloat16, and does
   the same in both gradients, which JAX would otherwise derive as float32 x bfloat16 products.
"""

import ctypes
import functools
import sys

import keras
from keras import ops

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_host_memory(trim_threshold=1 << 30):
    """Makes glibc keep freed memory for reuse instead of returning it to the kernel.

    One malloc arena for the threads that have not allocated yet (other arenas map large blocks
    whatever the settings), no `mmap` for large blocks, and up to `trim_threshold` bytes kept free
    at the top of the heap. It reaches only threads that have not allocated yet, so it must run
    before JAX starts its CPU client. Returns whether it was applied (False off glibc/Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl)
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, int(trim_threshold)))
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)


@functools.cache
def _jax_platform():
    import jax  # pylint: disable=import-outside-toplevel

    return jax.devices()[0].platform


def on_xla_cpu():
    """Whether Keras runs on JAX with a CPU as its device: where these workarounds apply."""
    return keras.backend.backend() == "jax" and _jax_platform() == "cpu"


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


def materialize_gradient(x):
    """Identity on `x`; on JAX on CPU its gradient is computed once, not fused into consumers.

    Elsewhere it is a plain identity: on accelerators a conditional costs a host round trip.
    """
    return _jax_cpu_barrier()(x) if on_xla_cpu() else x


def einsum(equation, a, b):
    """`keras.ops.einsum(equation, a, b)`, with bfloat16 products on JAX on CPU (see item 3).

    `equation` names both operands and the result (no `...`), and every index of an operand
    appears once in it and also in the other operand or the result, so that each gradient is an
    einsum too; anything else raises a `ValueError` on every backend. On JAX on CPU with two
    bfloat16 operands, products accumulate in float32 and the result is rounded to bfloat16, as
    XLA does for bfloat16 elsewhere; otherwise this is `keras.ops.einsum`.
    """
    equation = _checked(equation.replace(" ", ""))
    if not on_xla_cpu():
        return ops.einsum(equation, a, b)
    a, b = ops.convert_to_tensor(a), ops.convert_to_tensor(b)  # variables: their autocast value
    if a.dtype == b.dtype == "bfloat16":
        return _bfloat16_einsum(equation)(a, b)
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
def _bfloat16_einsum(equation):
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
