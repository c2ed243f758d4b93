"""vit_keras.tools.distributed.distribution: the model-parallel layout and the engines per backend."""

import keras
import numpy as np
import pytest

from vit_keras.tools.distributed import distribution


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


@pytest.mark.backend_independent
@pytest.mark.parametrize("kind, shards_weights, sharded_backup", [
    ("none", False, False), ("data_parallel", False, False), ("model_parallel", True, False),
    ("fsdp", True, True)])
def test_each_kind_says_whether_it_splits_weights_and_backs_up_in_shards(kind, shards_weights,
                                                                         sharded_backup):
    chosen = distribution.get(kind)
    assert (chosen.kind, chosen.shards_weights, chosen.sharded_backup) == (
        kind, shards_weights, sharded_backup)


@pytest.mark.backend_independent
def test_the_kinds_are_the_flag_values_run_folders_record():
    assert distribution.DISTRIBUTIONS == ("none", "data_parallel", "model_parallel", "fsdp")
    assert distribution.get(None).kind == distribution.get("").kind == "none"


@pytest.mark.backend_independent
def test_an_unknown_distribution_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="Unknown distribution 'pipeline'; choose one of none, "
                                         "data_parallel, model_parallel, fsdp"):
        distribution.get("pipeline")


def test_a_batch_is_split_over_every_device_a_distribution_uses(monkeypatch):
    backend = keras.backend.backend()
    if backend == "jax":  # every device of every process; four named here, none allocated
        monkeypatch.setattr(keras.distribution, "list_devices",
                            lambda: [f"cpu:{i}" for i in range(4)])
        assert [distribution.get(kind).replicas for kind in distribution.DISTRIBUTIONS] == [
            1, 4, 4, 4]
    elif backend == "tensorflow":  # the MirroredStrategy's replicas, the one its scope enters
        import tensorflow as tf

        chosen = distribution.get("data_parallel")
        with chosen.scope():
            assert chosen.replicas == tf.distribute.get_strategy().num_replicas_in_sync
        assert distribution.get("none").replicas == 1
    else:
        assert [distribution.get(kind).replicas for kind in distribution.DISTRIBUTIONS] == [
            1, 1, 1, 1]


@pytest.mark.parametrize("kind", ["none", "data_parallel", "model_parallel", "fsdp"])
def test_each_kind_sets_up_its_engine_in_scope_and_reset_leaves_none(kind):
    backend = keras.backend.backend()
    chosen = distribution.get(kind)
    if backend == "torch" and kind != "none":
        with pytest.raises(ValueError, match="no distribution engine for torch"):
            chosen.scope()
    elif backend == "tensorflow" and kind in ("model_parallel", "fsdp"):
        with pytest.raises(ValueError, match=f"--distribution {kind} needs the JAX backend"):
            chosen.scope()
    elif backend == "tensorflow":
        import tensorflow as tf

        with chosen.scope():
            mirrored = isinstance(tf.distribute.get_strategy(), tf.distribute.MirroredStrategy)
        assert mirrored == (kind == "data_parallel")
        # XLA cannot place mirrored variables: off under MirroredStrategy unless asked for.
        assert bool(chosen.xla_off) == (kind == "data_parallel")
        chosen.reset()
        assert not tf.distribute.has_strategy()
    else:
        from vit_keras.tools.distributed import sharding

        engines = {"none": type(None), "data_parallel": keras.distribution.DataParallel,
                   "model_parallel": keras.distribution.ModelParallel,
                   "fsdp": sharding.FullyShardedDataParallel}
        try:
            with chosen.scope():
                assert type(keras.distribution.distribution()) is engines[kind]
            assert chosen.xla_off is None
            chosen.reset()
            assert keras.distribution.distribution() is None
        finally:
            keras.distribution.set_distribution(None)


# Keras' ModelParallel and the layouts FSDP shards by have no TensorFlow or torch engine.
@pytest.mark.skipif(keras.backend.backend() != "jax", reason="keras.distribution is JAX-only")
def test_the_model_and_optimizer_placement_is_reported_where_weights_are_split(tiny_config):
    """What each device holds, asked of the distribution after compiling in its scope: the
    optimizer's slots are laid out first, so they are counted."""
    from conftest import tiny_model

    for kind in distribution.DISTRIBUTIONS:
        chosen = distribution.get(kind)
        try:
            with chosen.scope():
                model = tiny_model(tiny_config)
                model.compile(keras.optimizers.AdamW(1e-3), "categorical_crossentropy")
            placed = chosen.placement(model)
        finally:
            chosen.reset()
        if not chosen.shards_weights:
            assert placed is None and not model.optimizer.built
            continue
        assert model.optimizer.built
        assert placed.total_parameter_bytes == sum(
            int(np.prod(w.shape)) * 4 for w in model.weights)
        assert placed.optimizer_bytes > 0


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
        distribution.get("none", processes=distribution.Processes(2, 0))


@pytest.mark.parametrize("naflex", [False, True], ids=["images", "naflex"])
def test_padded_evaluation_gives_the_means_over_the_real_examples(tiny_config, naflex):
    """Loss and accuracy of 10 examples in batches of 4, padded to 12 with zero-weight examples
    as several processes (or devices) evaluate them, equal those of the plain batches (4, 4, 2);
    a NaFlex model's dicts of patches too."""
    import tensorflow as tf

    import vit_keras
    from vit_keras.tools.runs import recipes

    from conftest import tiny_data, tiny_model

    if naflex:
        model = vit_keras.build_model(tiny_config, image_size=8, num_classes=3, naflex=True)
        model = recipes.compile_model(model, "sgd")
    else:
        model = recipes.compile_model(tiny_model(tiny_config), "sgd")
    images, labels = tiny_data(n=10)
    if naflex:
        images = vit_keras.naflex_patches(list(images), patch_size=4, max_num_patches=4)
    plain = tf.data.Dataset.from_tensor_slices((images, labels)).batch(4)
    padded = distribution.pad_to_whole_batches(plain, num_examples=10, batch_size=4)
    weights = np.concatenate([w for _, _, w in padded.as_numpy_iterator()])
    assert weights.shape == (12,) and weights[10:].tolist() == [0.0, 0.0]
    expected = model.evaluate(plain, verbose=0, return_dict=True)
    found = model.evaluate(padded, verbose=0, return_dict=True)
    assert found["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert found["accuracy"] == pytest.approx(expected["accuracy"], rel=1e-6)
