"""The initializers of vit_jax that Keras has no name for: each weight's own, made when its layer
is built (an initializer made at import would take its seed before `keras.utils.set_random_seed`
runs, and one shared by several weights would give them all the same values)."""

import math

import keras


def mlp_bias():
    """normal(stddev 1e-6), vit_jax's MLP biases."""
    return keras.initializers.RandomNormal(stddev=1e-6)


def xavier_uniform(fan_in, fan_out):
    """Glorot-uniform for a kernel of any rank whose fans are known, as Flax's DenseGeneral uses.

    Keras' `glorot_uniform` would read a (hidden, heads, head_dim) kernel as a convolution and get
    the fans wrong, so the limit is computed from the true fans.
    """
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return keras.initializers.RandomUniform(-limit, limit)
