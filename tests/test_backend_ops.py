"""`vit_keras.model.backend_ops`' paths for JAX off the CPU (a GPU): projections as 2-D products
and, in training, the LayerNorm whose gradient `vit_keras.model.jax_layer_norm` writes out. On
the test machine they run with the XLA:CPU workarounds switched off."""

import keras
import numpy as np
import pytest

from vit_keras.model import attention, backend_ops, layers, xla_cpu

from conftest import randomize_weights

jax_only = pytest.mark.skipif(keras.backend.backend() != "jax",
                              reason="jax_layer_norm and the choice of it are JAX's")


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")))


@jax_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_written_layer_norm_gradient_is_autodiffs_of_keras_layer_norm(dtype):
    import jax
    import jax.numpy as jnp

    from vit_keras.model import jax_layer_norm

    rng = np.random.default_rng(0)
    # Off-centre rows of unequal scale: the mean and variance terms of the gradient both count.
    x = jnp.asarray(rng.normal(size=(3, 5, 16)) * rng.uniform(0.5, 4, (3, 5, 1)) + 2, dtype)
    gamma = jnp.asarray(rng.normal(1, 0.5, 16), "float32")
    beta = jnp.asarray(rng.normal(0, 0.5, 16), "float32")
    dy = jnp.asarray(rng.normal(size=(3, 5, 16)), dtype)

    def keras_layer_norm(x, gamma, beta):
        return keras.ops.layer_normalization(x, gamma, beta, epsilon=1e-6)

    def written(x, gamma, beta):
        return jax_layer_norm.layer_norm(x, gamma, beta, 1e-6)

    expected, expected_vjp = jax.vjp(keras_layer_norm, x, gamma, beta)
    y, vjp = jax.vjp(written, x, gamma, beta)
    assert y.dtype == x.dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(_numpy(y), _numpy(expected), **tolerance)
    for name, got, want in zip(("x", "gamma", "beta"), vjp(dy), expected_vjp(dy)):
        assert got.dtype == want.dtype, name
        scale = max(1.0, float(np.abs(_numpy(want)).max()))
        np.testing.assert_allclose(_numpy(got) / scale, _numpy(want) / scale, **tolerance,
                                   err_msg=f"the gradient of {name}")


def _projections(hidden=12, heads=3):
    """A `Dense`, the attention's query projection and its output projection, built."""
    dense = keras.layers.Dense(20, name="dense")
    dense.build((None, 7, hidden))
    block = layers.MultiHeadDotProductAttention(heads)
    block.build((None, 7, hidden))
    randomize_weights(block, scale=0.3)
    randomize_weights(dense, scale=0.3)
    return dense, block


def test_a_matrix_projection_is_the_layer_call():
    """`(batch, tokens, *in)` flattened to one 2-D product gives the layer's own output: a Dense,
    a head projection `btd,dhk->bthk` and the output projection `bthk,hkd->btd`, each with its
    bias; a layer it does not know (another equation, a bias over part of the output, LoRA) is
    called."""
    dense, block = _projections()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 7, 12)).astype("float32")
    heads = rng.normal(size=(2, 7, 3, 4)).astype("float32")
    for layer, inputs in ((dense, x), (block.query, x), (block.out, heads)):
        got = backend_ops.matrix_projection(layer, inputs)
        assert tuple(got.shape) == tuple(layer(inputs).shape)
        np.testing.assert_allclose(_numpy(got), _numpy(layer(inputs)), rtol=1e-5, atol=1e-5,
                                   err_msg=layer.name)
    pooled = keras.layers.EinsumDense("btd,dn->bn", output_shape=(5,))
    pooled.build((None, 7, 12))
    np.testing.assert_allclose(_numpy(backend_ops.matrix_projection(pooled, x)),
                               _numpy(pooled(x)), rtol=1e-6)
    assert not backend_ops._contracts_leading_axes(pooled)  # pylint: disable=protected-access
    per_head_dim = keras.layers.EinsumDense("btd,dhk->bthk", output_shape=(None, 3, 4),
                                            bias_axes="k", bias_initializer="ones")
    per_head_dim.build((None, 7, 12))  # its bias (4,) is broadcast over the heads: called
    np.testing.assert_allclose(_numpy(backend_ops.matrix_projection(per_head_dim, x)),
                               _numpy(per_head_dim(x)), rtol=1e-6)
    dense.enable_lora(2, b_initializer="ones")  # the call adds LoRA's delta; a 2-D product would not
    np.testing.assert_allclose(_numpy(backend_ops.matrix_projection(dense, x)), _numpy(dense(x)),
                               rtol=1e-6)


@jax_only
def test_a_jax_accelerators_block_trains_through_its_own_paths_to_keras_values():
    """With the XLA:CPU workarounds off (JAX on a GPU), a block takes the 2-D products and, in
    training, the written LayerNorm gradient: its output and every weight's gradient are those of
    the same block through Keras' layer calls."""
    import jax
    import jax.numpy as jnp

    with xla_cpu.set_workarounds(False):
        block = layers.TransformerBlock(num_heads=3, mlp_dim=24)
        block.build((None, 7, 12))
    assert block._norm is backend_ops._jax_layer_norm  # pylint: disable=protected-access
    assert block.mlp._project is backend_ops.matrix_projection  # pylint: disable=protected-access
    randomize_weights(block, scale=0.3)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 7, 12)), "float32")
    trainable = [v.value for v in block.trainable_variables]

    def loss(values):
        y, _ = block.stateless_call(values, [], x, training=True)
        return jnp.sum(jnp.sin(y)), y

    grad = jax.jit(jax.grad(loss, has_aux=True))
    gradients, y = grad(trainable)
    own_norm, own_project = block._norm, block.mlp._project  # pylint: disable=protected-access
    try:
        block._norm = backend_ops._layer_call  # pylint: disable=protected-access
        block.mlp._project = backend_ops._dense_call  # pylint: disable=protected-access
        attention.matrix_projection = lambda layer, inputs: layer(inputs)
        expected_gradients, expected = jax.jit(jax.grad(loss, has_aux=True))(trainable)
    finally:
        block._norm, block.mlp._project = own_norm, own_project  # pylint: disable=protected-access
        attention.matrix_projection = backend_ops.matrix_projection
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-5)
    for variable, got, want in zip(block.trainable_variables, gradients, expected_gradients):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5,
                                   err_msg=variable.path)
