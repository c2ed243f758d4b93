"""vit_keras.tools.distribution: the model-parallel layout and the engines per backend."""

import keras
import pytest

from vit_keras.tools import distribution


def test_model_parallel_layout_shards_attention_heads_and_mlp_units():
    class Mesh:  # LayoutMap only stores the mesh; the sharding rules are what is checked
        axis_names = ("batch", "model")

    rules = {key: tuple(layout.axes) for key, layout in
             distribution.model_parallel_layout_map(Mesh())._layout_map.items()}
    assert rules[".*MultiHeadDotProductAttention_1/query/kernel"] == (None, "model", None)
    assert rules[".*MultiHeadDotProductAttention_1/out/kernel"] == ("model", None, None)
    assert rules[".*MlpBlock_3/Dense_0/kernel"] == (None, "model")
    assert rules[".*MlpBlock_3/Dense_1/kernel"] == ("model", None)


def test_distribution_engines_per_backend():
    backend = keras.backend.backend()
    if backend == "torch":
        for kind in ("data_parallel", "model_parallel"):
            with pytest.raises(ValueError, match="no distribution engine for torch"):
                distribution.distribution_scope(kind)
    elif backend == "tensorflow":
        import tensorflow as tf

        with distribution.distribution_scope("data_parallel"):
            assert isinstance(tf.distribute.get_strategy(), tf.distribute.MirroredStrategy)
        with pytest.raises(ValueError, match="needs the JAX backend"):
            distribution.distribution_scope("model_parallel")
    else:
        try:
            distribution.distribution_scope("data_parallel")
            assert isinstance(keras.distribution.distribution(), keras.distribution.DataParallel)
        finally:
            keras.distribution.set_distribution(None)
    with pytest.raises(ValueError, match="Unknown distribution"):
        distribution.distribution_scope("pipeline")
