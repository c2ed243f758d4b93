"""Two workarounds that let the JAX backend train a ViT on CPU as fast as PyTorch does.

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
"""

import ctypes
import functools
import sys

import keras

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
