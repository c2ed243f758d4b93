"""`RandAugment`: Keras' `keras.layers.RandAugment` with an equalisation that traces to a small
graph in `tf.data` on every backend.

Keras' `Equalization` (3.15.1) counts its 256-bin histogram with a Python loop of 256 steps
whenever the process's backend is JAX, even inside `tf.data`, where the layer computes with
TensorFlow: about 46,000 graph ops for RandAugment's two equalisations of three channels. On the
JAX backend that made a RandAugment pipeline take 14 s to build and its first batch 4 s more, and
then deliver 23 images/s of 224x224 against torch's 40 on a 2-core CPU. (keras-team/keras#23568,
merged after 3.15.1, makes the loop the only path on every backend.) The histogram here is one
`bincount` when the layer computes with TensorFlow; the counts, and so the images, are the same.
"""

import keras
import tensorflow as tf


class BincountEqualization(keras.layers.Equalization):
    """`keras.layers.Equalization`, its histogram one op where TensorFlow computes it."""

    def _custom_histogram_fixed_width(self, values, value_range, nbins):
        if self.backend.name != "tensorflow":
            return super()._custom_histogram_fixed_width(values, value_range, nbins)
        low, high = (float(bound) for bound in value_range)
        # Keras' binning: scaled to [0, nbins - 1], truncated, clipped.
        scaled = (tf.cast(values, "float32") - low) * (nbins - 1) / (high - low)
        bins = tf.clip_by_value(tf.cast(scaled, "int32"), 0, nbins - 1)
        return tf.math.bincount(tf.reshape(bins, [-1]), minlength=nbins, maxlength=nbins)


class RandAugment(keras.layers.RandAugment):
    """`keras.layers.RandAugment` (same arguments and results) whose equalisation traces to a
    small graph in `tf.data` (see the module's docstring). Images `(batch, height, width,
    channels)` in `value_range` → the same shape. For the input pipelines, not for a model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.equalization = BincountEqualization(
            value_range=self.value_range, data_format=self.data_format, dtype=self.dtype_policy)
