"""The input pipelines' RandAugment (`vit_keras.tools.data.rand_augment`): Keras' layer, whose
equalisation counts its histogram in one op inside `tf.data`, where Keras' unrolled a 256-step
loop on the JAX backend (23,042 graph ops for one RandAugment, 15 s to trace)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from vit_keras.tools.data import rand_augment


def _in_tf_data(layer, *batches):
    """`layer` applied to each of `batches` in a `tf.data` map, as the pipelines apply it: the
    outputs stacked."""
    dataset = tf.data.Dataset.from_tensor_slices(tf.stack(batches))
    return np.stack([x.numpy() for x in dataset.map(lambda x: layer(x, training=True))])


def test_the_equalisation_gives_what_kerass_gives():
    # One channel: Keras' equalisation unrolls its loop per channel (on JAX 256 steps each).
    rng = np.random.default_rng(0)
    images = rng.integers(60, 120, (2, 8, 8, 1)).astype("float32")
    ours = _in_tf_data(rand_augment.BincountEqualization(value_range=(0, 255)), images)
    kerass = _in_tf_data(keras.layers.Equalization(value_range=(0, 255)), images)
    assert np.abs(ours - images).max() > 50  # it stretched the narrow range
    np.testing.assert_array_equal(ours, kerass)


def test_rand_augment_traces_to_a_graph_of_few_ops():
    layer = rand_augment.RandAugment(value_range=(0, 255), num_ops=2, factor=0.5, seed=0)
    images = tf.zeros((2, 8, 8, 3))
    graph = tf.function(lambda x: layer(x, training=True)).get_concrete_function(images).graph
    # About 1,600 on every backend; Keras' own: the same on TensorFlow and torch, 23,042 on JAX.
    assert len(graph.get_operations()) < 4000


@pytest.mark.backend_independent("tensorflow")  # Keras' own traces in 15 s on JAX
def test_rand_augment_draws_and_transforms_as_kerass_with_the_same_seed():
    rng = np.random.default_rng(0)
    batches = rng.uniform(0, 255, (3, 4, 8, 8, 3)).astype("float32")
    arguments = {"value_range": (0, 255), "num_ops": 2, "factor": 0.5, "seed": 7}
    ours = _in_tf_data(rand_augment.RandAugment(**arguments), *batches)
    assert not np.array_equal(ours, batches)
    np.testing.assert_array_equal(ours, _in_tf_data(keras.layers.RandAugment(**arguments), *batches))
