"""vit_keras.tools.callbacks: atomic checkpoints and backups, the NaN guard, atomic JSON."""

import json
import math
import os

import keras
import numpy as np
import pytest

from vit_keras.tools import callbacks, recipes, run_folder

from conftest import tiny_data, tiny_model


def test_atomic_model_checkpoint_writes_a_loadable_model_and_no_temporary_files(tmp_path,
                                                                                tiny_config):
    model = tiny_model(tiny_config)
    recipes.compile_model(model, "sgd")
    path = str(tmp_path / "model.keras")
    x, y = tiny_data()
    model.fit(x, y, epochs=2, verbose=0, callbacks=[callbacks.AtomicModelCheckpoint(path)])
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]
    loaded = keras.saving.load_model(path, compile=False)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loaded(x)),
                               keras.ops.convert_to_numpy(model(x)), atol=1e-5)


def test_backup_and_restore_resumes_after_the_last_completed_epoch(tmp_path, tiny_config):
    x, y = tiny_data()

    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise KeyboardInterrupt  # stands in for a kill after epoch 2 was backed up

    model = tiny_model(tiny_config)
    recipes.compile_model(model, "adam")
    backup = callbacks.AtomicBackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=5, verbose=0, callbacks=[backup, Crash()])
    assert backup.resume_epoch == 2
    assert not [f for f in os.listdir(tmp_path / "backup") if "saving" in f]
    saved = [keras.ops.convert_to_numpy(w).copy() for w in model.weights]

    fresh = tiny_model(tiny_config)
    recipes.compile_model(fresh, "adam")
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append([keras.ops.convert_to_numpy(w).copy() for w in self.model.weights])

        def on_epoch_begin(self, epoch, logs=None):
            seen.append(epoch)

    history = fresh.fit(x, y, epochs=5, verbose=0,
                        callbacks=[callbacks.AtomicBackupAndRestore(str(tmp_path / "backup")),
                                   Record()])
    assert seen[1:] == [2, 3, 4] and history.epoch == [2, 3, 4]
    for restored, original in zip(seen[0], saved):
        np.testing.assert_array_equal(restored, original)
    assert not os.path.exists(tmp_path / "backup")  # removed once the run completed


def test_nan_loss_stops_training_at_that_batch(tiny_config):
    model = tiny_model(tiny_config)
    recipes.compile_model(model, "sgd")
    x, y = tiny_data(n=16)
    x[8:] = np.nan  # the second batch of 8 makes the loss NaN
    guard = callbacks.StopOnNaN()
    batches = []
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[guard, keras.callbacks.LambdaCallback(
                  on_train_batch_end=lambda batch, logs: batches.append(batch))])
    assert guard.bad_step[:2] == (0, 1) and math.isnan(guard.bad_step[2])
    assert batches == [0, 1]


def test_metrics_json_is_written_atomically(tmp_path):
    path = str(tmp_path / "metrics.json")
    run_folder.atomic_write_json({"test_accuracy": np.float32(0.5), "shape": (1, 2)}, path)
    assert json.load(open(path)) == {"test_accuracy": 0.5, "shape": [1, 2]}
    assert os.listdir(tmp_path) == ["metrics.json"]


def _dropout_model(tiny_config, seed):
    from vit_keras import build_model

    keras.utils.set_random_seed(seed)
    model = build_model(tiny_config, image_size=8, num_classes=3, dropout=0.3)
    recipes.compile_model(model, recipes.make_optimizer(recipes.DIGITS_RECIPE, 8))
    return model


class _Crash(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt  # stands in for a kill after the epoch before was backed up


@pytest.mark.slow  # over 5 s alone: out of make test-fast
def test_resumed_fit_continues_exactly_where_the_backup_left_off(tmp_path, tiny_config):
    """Weights, optimizer state (AdamW moments, step count) and dropout generators come back:
    epochs after the resume have the uninterrupted run's losses to the bit, on every backend."""
    x, y = tiny_data(n=32)

    def fit(model, backup, epochs_seen=None):
        callbacks_list = [callbacks.AtomicBackupAndRestore(str(tmp_path / backup))]
        if epochs_seen is not None:
            callbacks_list.append(_Crash(epochs_seen))
        return model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                         callbacks=callbacks_list).history["loss"]

    uninterrupted = fit(_dropout_model(tiny_config, 0), "a")
    with pytest.raises(KeyboardInterrupt):
        fit(_dropout_model(tiny_config, 0), "b", epochs_seen=2)
    metadata = json.load(open(tmp_path / "b" / "training_metadata.json"))
    assert metadata["epoch"] == 2 and metadata["weights"] == "epoch-2.keras"
    # The dropout after the embedding and, in each of the 2 blocks, after attention and in the MLP.
    assert len(metadata["seed_generators"]) == 1 + 2 * 2
    # Another seed: every value the continuation uses must come from the backup.
    resumed = fit(_dropout_model(tiny_config, 1), "b")
    assert resumed == uninterrupted[2:]


def test_a_kill_between_the_weights_and_the_metadata_keeps_the_previous_backup(
        tmp_path, tiny_config, monkeypatch):
    x, y = tiny_data()
    model = tiny_model(tiny_config)
    recipes.compile_model(model, "adam")
    weights = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: weights.append(
        [keras.ops.convert_to_numpy(w).copy() for w in model.weights]))
    commits = []

    def commit_or_die(data, path):
        if commits:  # the second epoch: its weights file is written, its metadata is not
            raise KeyboardInterrupt
        commits.append(data)
        run_folder.atomic_write_json(data, path)

    monkeypatch.setattr(callbacks, "atomic_write_json", commit_or_die)
    backup = callbacks.AtomicBackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=3, verbose=0, callbacks=[record, backup])
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "backup")) == [
        "epoch-1.keras", "epoch-2.keras", "training_metadata.json"]
    assert backup.resume_epoch == 1
    fresh = tiny_model(tiny_config)
    recipes.compile_model(fresh, "adam")
    restored = []
    fresh.fit(x, y, epochs=1, verbose=0, callbacks=[
        callbacks.AtomicBackupAndRestore(str(tmp_path / "backup")),
        keras.callbacks.LambdaCallback(on_train_begin=lambda logs: restored.extend(
            keras.ops.convert_to_numpy(w).copy() for w in fresh.weights))])
    for value, expected in zip(restored, weights[0]):  # epoch 1's weights, not epoch 2's
        np.testing.assert_array_equal(value, expected)


def test_a_backup_without_its_weights_file_is_an_error_not_a_fresh_start(tmp_path, tiny_config):
    backup = tmp_path / "backup"
    backup.mkdir()
    (backup / "training_metadata.json").write_text(
        json.dumps({"epoch": 3, "batch": 0, "weights": "epoch-3.weights.h5"}))
    model = tiny_model(tiny_config)
    recipes.compile_model(model, "sgd")
    x, y = tiny_data()
    with pytest.raises(FileNotFoundError, match="epoch-3.weights.h5 is missing"):
        model.fit(x, y, epochs=5, verbose=0,
                  callbacks=[callbacks.AtomicBackupAndRestore(str(backup))])


def test_restore_loads_a_kept_backup_into_a_model_without_training(tmp_path, tiny_config):
    x, y = tiny_data()
    model = tiny_model(tiny_config)
    recipes.compile_model(model, "adam")
    backup = callbacks.AtomicBackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)
    model.fit(x, y, epochs=2, verbose=0, callbacks=[backup])
    assert backup.resume_epoch == 2  # kept after fit

    keras.utils.set_random_seed(1)  # other initial weights
    fresh = tiny_model(tiny_config)
    recipes.compile_model(fresh, "adam")
    callbacks.AtomicBackupAndRestore(str(tmp_path / "backup")).restore(fresh)
    for restored, trained in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(restored),
                                      keras.ops.convert_to_numpy(trained))
    assert int(fresh.optimizer.iterations) == int(model.optimizer.iterations) == 2
