"""LayerNorm over the last axis for JAX, with its gradient written out.

Keras' LayerNorm differentiates `x * inv + res` (with `inv = rsqrt(var + eps) * gamma`) through
JAX's autodiff. On a GPU XLA turns that gradient into several float32 passes over the
activations, in batch-minor layouts with a transpose between them: in a ViT-B/16 training step on
an H200 about 14 ms of the step's 78 traced to the LayerNorms (timm compiled's: 7).

Here the backward pass is the textbook one: with `xhat = (x - mean) * rstd` recomputed from the
saved input and statistics, and `g = dy * gamma`,

    dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))   (means over the normalised axis)
    dgamma = sum(dy * xhat),   dbeta = sum(dy)               (sums over the other axes)

two row reductions and two column reductions that XLA fuses into few passes. The forward pass
computes in float32 whatever the input's dtype, as Keras' does, and returns the input's dtype; the
residuals are the input itself and two float32 numbers per row.
"""

import functools

import jax
import jax.numpy as jnp


def layer_norm(x, gamma, beta, epsilon):
    """`(..., features)` → the same shape and dtype, normalised over the last axis in float32,
    scaled by `gamma` and shifted by `beta` (each `(features,)`)."""
    return _layer_norm(x, gamma, beta, float(epsilon))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, gamma, beta, epsilon):
    return _forward(x, gamma, beta, epsilon)[0]


def _statistics(x, epsilon):
    """float32 `x`, its mean and 1 / standard deviation over the last axis (kept as size 1)."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return x, mean, jax.lax.rsqrt(variance + epsilon)


def _forward(x, gamma, beta, epsilon):
    x32, mean, rstd = _statistics(x, epsilon)
    y = (x32 - mean) * rstd * gamma.astype(jnp.float32) + beta.astype(jnp.float32)
    return y.astype(x.dtype), (x, mean, rstd, gamma, beta)


def _backward(epsilon, residuals, dy):
    del epsilon  # in rstd
    x, mean, rstd, gamma, beta = residuals
    xhat = (x.astype(jnp.float32) - mean) * rstd
    dy = dy.astype(jnp.float32)
    g = dy * gamma.astype(jnp.float32)
    dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True)
                 - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    batch_axes = tuple(range(x.ndim - 1))
    dgamma = jnp.sum(dy * xhat, axis=batch_axes)
    dbeta = jnp.sum(dy, axis=batch_axes)
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype), dbeta.astype(beta.dtype)


_layer_norm.defvjp(_forward, _backward)
