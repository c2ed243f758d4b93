"""vit_keras.training: the recipes, the schedule, the optimizers, the callbacks, distribution."""

import dataclasses
import json
import math
import os

import keras
import numpy as np
import pytest

from vit_keras import build_model
from vit_keras import training


def _vit_jax_learning_rate(step, base, total, warmup, decay):
    """vit_jax/utils.py `create_learning_rate_schedule`, transcribed with math only."""
    progress = min(max((step - warmup) / float(total - warmup), 0.0), 1.0)
    if decay == "linear":
        lr = base * (1.0 - progress)
    else:
        lr = base * 0.5 * (1.0 + math.cos(math.pi * progress))
    if warmup:
        lr = lr * min(1.0, step / warmup)
    return lr


def test_finetune_recipe_is_vit_jax_fine_tuning_recipe():
    recipe = training.FINETUNE_RECIPE
    assert (recipe.optimizer, recipe.momentum, recipe.weight_decay, recipe.grad_clip_norm) == (
        "sgd", 0.9, 0.0, 1.0)
    assert (recipe.learning_rate, recipe.warmup_steps, recipe.decay, recipe.total_steps) == (
        0.03, 500, "cosine", 10_000)
    assert (recipe.batch_size, recipe.image_size, recipe.zero_head) == (512, 384, True)
    optimizer = training.make_optimizer(recipe)
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert optimizer.momentum == 0.9 and not optimizer.nesterov
    assert optimizer.global_clipnorm == 1.0 and optimizer.clipnorm is None
    assert not optimizer.weight_decay
    assert optimizer.gradient_accumulation_steps is None


def test_pretrain_recipe_is_the_papers_adam_with_weight_decay_and_linear_decay():
    recipe = training.PRETRAIN_RECIPE
    assert (recipe.optimizer, recipe.beta_1, recipe.beta_2, recipe.weight_decay) == (
        "adamw", 0.9, 0.999, 0.1)
    assert recipe.decay == "linear" and recipe.warmup_steps > 0
    optimizer = training.make_optimizer(recipe, total_steps=100)
    assert isinstance(optimizer, keras.optimizers.AdamW)
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.weight_decay) == (0.9, 0.999, 0.1)


def test_recipe_choice_follows_weights_and_dataset():
    RunConfig = training.RunConfig
    assert training.resolve_recipe(RunConfig(weights="w.npz"))[0].name == "finetune"
    assert training.resolve_recipe(RunConfig())[0].name == "digits"
    assert training.resolve_recipe(RunConfig(dataset="cifar10"))[0].name == "pretrain"
    recipe, reason = training.resolve_recipe(RunConfig(dataset="cifar10", weights="w.npz",
                                                       learning_rate=0.01, total_steps=500))
    assert (recipe.optimizer, recipe.learning_rate, recipe.total_steps) == ("sgd", 0.01, 500)
    assert "fine-tuning" in reason
    assert "no pretrained weights" in training.resolve_recipe(RunConfig())[1]


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_warmup_schedule_matches_vit_jax(decay):
    schedule = training.WarmupSchedule(0.03, total_steps=1000, warmup_steps=100, decay=decay)
    for step in (0, 1, 50, 100, 101, 400, 999, 1000, 1500):
        expected = _vit_jax_learning_rate(step, 0.03, 1000, 100, decay)
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-7), step


def test_schedule_counts_optimizer_updates_under_gradient_accumulation():
    plain = training.WarmupSchedule(0.1, total_steps=100, warmup_steps=10)
    accumulated = training.WarmupSchedule(0.1, total_steps=100, warmup_steps=10,
                                          steps_per_update=4)
    for update in (0, 5, 10, 50, 99):
        for micro in range(4):
            assert float(accumulated(4 * update + micro)) == pytest.approx(float(plain(update)))


def test_schedule_round_trips_through_its_config():
    schedule = training.WarmupSchedule(0.5, 20, 3, "linear", steps_per_update=2)
    again = training.WarmupSchedule.from_config(schedule.get_config())
    assert again.get_config() == schedule.get_config()


def _tiny_model(tiny_config, num_classes=3, size=8):
    return build_model(tiny_config, image_size=size, num_classes=num_classes)


def _tiny_data(n=8, size=8, num_classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 255, (n, size, size, 3)).astype("float32")
    y = np.eye(num_classes, dtype="float32")[rng.integers(0, num_classes, n)]
    return x, y


def test_gradient_accumulation_updates_weights_every_accum_steps_batches(tiny_config):
    model = _tiny_model(tiny_config)
    recipe = dataclasses.replace(training.FINETUNE_RECIPE, warmup_steps=0, learning_rate=0.1)
    training.compile_model(model, training.make_optimizer(recipe, 10, accum_steps=2))
    x, y = _tiny_data()
    model.train_on_batch(x, y)  # builds the optimizer; the first batch only accumulates
    before = [keras.ops.convert_to_numpy(w).copy() for w in model.trainable_weights]
    model.train_on_batch(x, y)  # second batch: the update
    after = [keras.ops.convert_to_numpy(w).copy() for w in model.trainable_weights]
    model.train_on_batch(x, y)  # third batch: accumulates again
    third = [keras.ops.convert_to_numpy(w) for w in model.trainable_weights]
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
    assert all(np.array_equal(a, b) for a, b in zip(after, third))


def test_atomic_model_checkpoint_writes_a_loadable_model_and_no_temporary_files(tmp_path,
                                                                                tiny_config):
    model = _tiny_model(tiny_config)
    training.compile_model(model, "sgd")
    path = str(tmp_path / "model.keras")
    x, y = _tiny_data()
    model.fit(x, y, epochs=2, verbose=0, callbacks=[training.AtomicModelCheckpoint(path)])
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]
    loaded = keras.saving.load_model(path, compile=False)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loaded(x)),
                               keras.ops.convert_to_numpy(model(x)), atol=1e-5)


def test_backup_and_restore_resumes_after_the_last_completed_epoch(tmp_path, tiny_config):
    x, y = _tiny_data()

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise KeyboardInterrupt  # stands in for a kill after epoch 2 was backed up

    model = _tiny_model(tiny_config)
    training.compile_model(model, "adam")
    backup = training.AtomicBackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=5, verbose=0, callbacks=[backup, Crash()])
    assert backup.resume_epoch == 2
    assert not [f for f in os.listdir(tmp_path / "backup") if "saving" in f]
    saved = [keras.ops.convert_to_numpy(w).copy() for w in model.weights]

    fresh = _tiny_model(tiny_config)
    training.compile_model(fresh, "adam")
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append([keras.ops.convert_to_numpy(w).copy() for w in self.model.weights])

        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

    history = fresh.fit(x, y, epochs=5, verbose=0,
                        callbacks=[training.AtomicBackupAndRestore(str(tmp_path / "backup")),
                                   Record()])
    assert seen[1:] == [2, 3, 4] and history.epoch == [2, 3, 4]
    for restored, original in zip(seen[0], saved):
        np.testing.assert_array_equal(restored, original)
    assert not os.path.exists(tmp_path / "backup")  # removed once the run completed


def test_nan_loss_stops_training_at_that_batch(tiny_config):
    model = _tiny_model(tiny_config)
    training.compile_model(model, "sgd")
    x, y = _tiny_data(n=16)
    x[8:] = np.nan  # the second batch of 8 makes the loss NaN
    guard = training.StopOnNaN()
    batches = []
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[guard, keras.callbacks.LambdaCallback(
                  on_train_batch_end=lambda batch, logs: batches.append(batch))])
    assert guard.bad_step[:2] == (0, 1) and math.isnan(guard.bad_step[2])
    assert batches == [0, 1]


def test_run_raises_a_clear_error_on_nan_loss(tmp_path):
    config = training.RunConfig(
        image_size=8, batch_size=16, epochs=2, steps_per_epoch=2, learning_rate=1e30,
        grad_clip_norm=0.0, warmup_steps=0, output_dir=str(tmp_path), verbose=0)
    with pytest.raises(training.NonFiniteLossError, match="Lower --learning_rate"):
        training.run(config, log=lambda _: None)
    assert not os.path.exists(tmp_path / "finetune_digits_ViT-digits" / "backup")


def test_new_head_is_zero_and_position_embeddings_are_resampled_from_weights(tmp_path,
                                                                            tiny_config):
    from vit_keras import save_npz

    source = build_model(tiny_config, image_size=8, num_classes=7)
    for weight in source.weights:
        weight.assign(np.random.default_rng(0).normal(0, 0.1, weight.shape))
    path = save_npz(source, str(tmp_path / "tiny.npz"))
    recipe = dataclasses.replace(training.FINETUNE_RECIPE, image_size=16)
    model = training.build_run_model(training.RunConfig(weights=path), recipe, num_classes=3,
                                     log=lambda _: None)
    head = model.get_layer("head")
    assert head.kernel.shape == (32, 3)
    assert not np.any(keras.ops.convert_to_numpy(head.kernel))
    posemb = model.get_layer("posembed_input").pos_embedding
    assert posemb.shape == (1, 1 + 4 * 4, 32)  # 16 px / patch 4: a 4x4 grid (was 2x2)
    np.testing.assert_allclose(  # the class-token row is carried over unchanged
        keras.ops.convert_to_numpy(posemb)[0, 0],
        keras.ops.convert_to_numpy(source.get_layer("posembed_input").pos_embedding)[0, 0],
        atol=1e-6)


def test_jit_compile_is_on_for_jax_and_tensorflow_and_off_for_torch():
    assert training.use_jit_compile() == (keras.backend.backend() != "torch")


def test_model_parallel_layout_shards_attention_heads_and_mlp_units():
    class Mesh:  # LayoutMap only stores the mesh; the sharding rules are what is checked
        axis_names = ("batch", "model")

    rules = {key: tuple(layout.axes) for key, layout in
             training.model_parallel_layout_map(Mesh())._layout_map.items()}
    assert rules[".*MultiHeadDotProductAttention_1/query/kernel"] == (None, "model", None)
    assert rules[".*MultiHeadDotProductAttention_1/out/kernel"] == ("model", None, None)
    assert rules[".*MlpBlock_3/Dense_0/kernel"] == (None, "model")
    assert rules[".*MlpBlock_3/Dense_1/kernel"] == ("model", None)


def test_distribution_engines_per_backend():
    backend = keras.backend.backend()
    if backend == "torch":
        for kind in ("data_parallel", "model_parallel"):
            with pytest.raises(ValueError, match="no distribution engine for torch"):
                training.distribution_scope(kind)
    elif backend == "tensorflow":
        import tensorflow as tf

        with training.distribution_scope("data_parallel"):
            assert isinstance(tf.distribute.get_strategy(), tf.distribute.MirroredStrategy)
        with pytest.raises(ValueError, match="needs the JAX backend"):
            training.distribution_scope("model_parallel")
    else:
        try:
            training.distribution_scope("data_parallel")
            assert isinstance(keras.distribution.distribution(), keras.distribution.DataParallel)
        finally:
            keras.distribution.set_distribution(None)
    with pytest.raises(ValueError, match="Unknown distribution"):
        training.distribution_scope("pipeline")


def test_metrics_json_is_written_atomically(tmp_path):
    path = str(tmp_path / "metrics.json")
    training.atomic_write_json({"test_accuracy": np.float32(0.5), "shape": (1, 2)}, path)
    assert json.load(open(path)) == {"test_accuracy": 0.5, "shape": [1, 2]}
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_classification_report_and_top_k():
    logits = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0], [2.0, 0.0, 1.0]])
    labels = np.array([0, 2, 2, 1])
    report = training.classification_report(logits, labels, ["a", "b", "c"])
    assert report["accuracy"] == 0.5 and report["count"] == 4
    assert report["per_class"]["c"] == {"accuracy": 0.5, "count": 2}
    assert report["per_class"]["b"] == {"accuracy": 0.0, "count": 1}
    top = training.top_k_predictions(logits[:1], ["a", "b", "c"], k=2)
    assert [name for name, _ in top[0]] == ["a", "b"]
    assert top[0][0][1] == pytest.approx(np.exp(3) / (np.exp(3) + np.exp(1) + 1))


def test_keras_file_weights_get_a_new_zero_head_and_resampled_position_embeddings(tmp_path,
                                                                                  tiny_config):
    source = build_model(tiny_config, image_size=8, num_classes=7)
    for weight in source.weights:
        weight.assign(np.random.default_rng(1).normal(0, 0.1, weight.shape))
    path = str(tmp_path / "source.keras")
    source.save(path)
    recipe = dataclasses.replace(training.FINETUNE_RECIPE, image_size=16)
    model = training.build_run_model(training.RunConfig(weights=path), recipe, num_classes=3,
                                     log=lambda _: None)
    assert model.output_shape == (None, 3) and model.input_shape == (None, 16, 16, 3)
    assert not np.any(keras.ops.convert_to_numpy(model.get_layer("head").kernel))
    np.testing.assert_allclose(  # the encoder weights are the file's
        keras.ops.convert_to_numpy(model.get_layer("encoderblock_1").mlp.dense_0.kernel),
        keras.ops.convert_to_numpy(source.get_layer("encoderblock_1").mlp.dense_0.kernel))
    same = training.build_run_model(training.RunConfig(weights=path),
                                    dataclasses.replace(recipe, image_size=8), num_classes=7,
                                    log=lambda _: None)
    np.testing.assert_allclose(  # same classes and size: the model continues as it was
        keras.ops.convert_to_numpy(same.get_layer("head").kernel),
        keras.ops.convert_to_numpy(source.get_layer("head").kernel))
