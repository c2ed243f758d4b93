"""vit_keras.tools.distribution: the model-parallel layout and the engines per backend."""

import keras
import numpy as np
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
    assert rules[".*MlpBlock_3/gate/kernel"] == (None, "model")  # SwiGLU's


def test_distribution_engines_per_backend():
    backend = keras.backend.backend()
    if backend == "torch":
        for kind in ("data_parallel", "model_parallel", "fsdp"):
            with pytest.raises(ValueError, match="no distribution engine for torch"):
                distribution.distribution_scope(kind)
    elif backend == "tensorflow":
        import tensorflow as tf

        with distribution.distribution_scope("data_parallel"):
            assert isinstance(tf.distribute.get_strategy(), tf.distribute.MirroredStrategy)
        for kind in ("model_parallel", "fsdp"):
            with pytest.raises(ValueError, match=f"--distribution {kind} needs the JAX backend"):
                distribution.distribution_scope(kind)
    else:
        try:
            distribution.distribution_scope("data_parallel")
            assert isinstance(keras.distribution.distribution(), keras.distribution.DataParallel)
        finally:
            keras.distribution.set_distribution(None)
    with pytest.raises(ValueError, match="Unknown distribution"):
        distribution.distribution_scope("pipeline")


def test_process_settings_come_from_the_flags_then_keras_environment_variables():
    env = {distribution.ADDRESSES_ENV: "10.0.0.1:1234,10.0.0.2:2345",
           distribution.NUM_PROCESSES_ENV: "2", distribution.PROCESS_ID_ENV: "1"}
    assert distribution.resolve_processes(environ=env) == (
        ["10.0.0.1:1234", "10.0.0.2:2345"], 2, 1)
    assert distribution.resolve_processes("h:1", 4, 3, environ=env) == (["h:1"], 4, 3)
    assert distribution.resolve_processes(environ={}) == (None, 1, None)  # one process
    assert distribution.resolve_processes(num_processes=0, environ={}) == (None, 0, None)


@pytest.mark.parametrize("arguments, message", [
    ({"num_processes": 2, "process_id": 0}, "needs --coordinator_address"),
    ({"num_processes": 2, "coordinator_address": "h:1"}, "needs --process_id"),
    ({"num_processes": 2, "coordinator_address": "h:1", "process_id": 2}, "outside 0..1"),
    ({"num_processes": 3, "coordinator_address": "a:1,b:1", "process_id": 0}, "2 addresses"),
    ({"num_processes": -1}, "negative"),
])
def test_incomplete_process_settings_say_what_is_missing(arguments, message):
    with pytest.raises(distribution.MultiProcessError, match=message):
        distribution.resolve_processes(**arguments, environ={})


def test_several_processes_are_refused_off_jax_with_the_reason(monkeypatch):
    """On JAX, `initialize_processes` would join this pytest process to a cluster: the JAX half
    is tests/test_multiprocess.py's, with real processes."""
    backend = keras.backend.backend()
    if backend == "jax":
        assert distribution.initialize_processes(num_processes=1) == distribution.Processes()
        return
    match = "keras-team/keras#20585" if backend == "tensorflow" else "no distribution engine"
    with pytest.raises(distribution.MultiProcessError, match=match):
        distribution.initialize_processes("127.0.0.1:1", 2, 0)
    if backend == "tensorflow":  # a TF_CONFIG of several workers, without the flags
        monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1", "b:1"]}, '
                                        '"task": {"type": "worker", "index": 0}}')
        with pytest.raises(distribution.MultiProcessError, match="MultiWorkerMirroredStrategy"):
            distribution.initialize_processes()
    with pytest.raises(distribution.MultiProcessError, match="need --distribution"):
        distribution.distribution_scope("none", processes=distribution.Processes(2, 0))


def test_padded_evaluation_gives_the_means_over_the_real_examples(tiny_config):
    """Loss and accuracy of 10 examples in batches of 4, padded to 12 with zero-weight images as
    several processes evaluate them, equal those of the plain batches (4, 4, 2)."""
    import tensorflow as tf

    from vit_keras.tools import recipes

    from conftest import tiny_data, tiny_model

    model = recipes.compile_model(tiny_model(tiny_config), "sgd")
    images, labels = tiny_data(n=10)
    plain = tf.data.Dataset.from_tensor_slices((images, labels)).batch(4)
    padded = distribution.pad_to_whole_batches(plain, num_examples=10, batch_size=4)
    weights = np.concatenate([w for _, _, w in padded.as_numpy_iterator()])
    assert weights.shape == (12,) and weights[10:].tolist() == [0.0, 0.0]
    expected = model.evaluate(plain, verbose=0, return_dict=True)
    found = model.evaluate(padded, verbose=0, return_dict=True)
    assert found["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert found["accuracy"] == pytest.approx(expected["accuracy"], rel=1e-6)
