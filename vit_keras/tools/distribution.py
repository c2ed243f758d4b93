"""`--distribution`: data and model parallelism (Keras' JAX distribution API, TensorFlow's
MirroredStrategy). Imports only Keras at module level; TensorFlow inside the functions."""

import contextlib

import keras


DISTRIBUTIONS = ("none", "data_parallel", "model_parallel")
_mirrored_strategy = None  # the last MirroredStrategy distribution_scope made (TensorFlow)


def model_parallel_layout_map(device_mesh):
    """Shards attention (over heads) and MLP kernels (over the hidden MLP units) on the mesh's
    `model` axis; everything else is replicated."""
    from keras import distribution

    layout_map = distribution.LayoutMap(device_mesh)
    for projection in ("query", "key", "value"):
        layout_map[f".*MultiHeadDotProductAttention_1/{projection}/kernel"] = (None, "model", None)
        layout_map[f".*MultiHeadDotProductAttention_1/{projection}/bias"] = ("model", None)
    layout_map[".*MultiHeadDotProductAttention_1/out/kernel"] = ("model", None, None)
    layout_map[".*MlpBlock_3/Dense_0/kernel"] = (None, "model")
    layout_map[".*MlpBlock_3/Dense_0/bias"] = ("model",)
    layout_map[".*MlpBlock_3/Dense_1/kernel"] = ("model", None)
    return layout_map


def distribution_scope(kind="none", model_parallel_size=None):
    """Sets up `--distribution` and returns the context to build and compile the model in.

    - `data_parallel`: `keras.distribution.DataParallel` over all local devices on JAX;
      `tf.distribute.MirroredStrategy` on TensorFlow. Batches are split across devices.
    - `model_parallel`: `keras.distribution.ModelParallel` on JAX with a (data, model) mesh and
      `model_parallel_layout_map`; `model_parallel_size` devices on the model axis (default: all).
    The torch backend has no such engine in Keras; other combinations raise `ValueError`.
    """
    backend = keras.backend.backend()
    if kind in (None, "", "none"):
        return contextlib.nullcontext()
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"Unknown distribution {kind!r}; expected one of {DISTRIBUTIONS}.")
    if backend == "jax":
        from keras import distribution

        devices = distribution.list_devices()
        if kind == "data_parallel":
            distribution.set_distribution(distribution.DataParallel(devices=devices))
        else:
            model_size = int(model_parallel_size or len(devices))
            if len(devices) % model_size:
                raise ValueError(f"model_parallel_size {model_size} does not divide the "
                                 f"{len(devices)} devices.")
            mesh = distribution.DeviceMesh((len(devices) // model_size, model_size),
                                           ("batch", "model"), devices)
            distribution.set_distribution(distribution.ModelParallel(
                layout_map=model_parallel_layout_map(mesh), batch_dim_name="batch"))
        return contextlib.nullcontext()
    if backend == "tensorflow" and kind == "data_parallel":
        import tensorflow as tf

        global _mirrored_strategy
        _mirrored_strategy = tf.distribute.MirroredStrategy()
        return _mirrored_strategy.scope()
    if backend == "tensorflow":
        raise ValueError("--distribution model_parallel needs the JAX backend: Keras' ModelParallel "
                         "is implemented for JAX only, and TensorFlow's DTensor path is not "
                         "supported here. Use --backend jax, or data_parallel on TensorFlow.")
    raise ValueError(f"--distribution {kind} is not available on the {backend} backend: Keras has "
                     f"no distribution engine for torch. Use --backend jax (data_parallel, "
                     f"model_parallel) or --backend tensorflow (data_parallel).")


def num_replicas(kind="none"):
    """How many devices a batch is split over under `kind`."""
    if kind in (None, "", "none"):
        return 1
    if keras.backend.backend() == "jax":
        from keras import distribution

        return len(distribution.list_devices())
    return _mirrored_strategy.num_replicas_in_sync if _mirrored_strategy else 1
