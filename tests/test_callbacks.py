"""vit_keras.tools.runs.callbacks: atomic checkpoints and backups, the NaN guard, atomic JSON."""

import json
import math
import os
import shutil
import sys

import keras
import numpy as np
import pytest

from vit_keras import errors
from vit_keras.tools.runs import callbacks, recipes, run_folder

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


# --- hostile and damaged backups (vit_keras issue 55) ----------------------------------------

# Orbax checkpoints hold JAX arrays: the sharded backups' tests run in the JAX pass.
jax_only = pytest.mark.skipif(keras.backend.backend() != "jax",
                              reason="sharded (Orbax) backups need the JAX backend")


def _backed_up(tmp_path, tiny_config, sharded=False, epochs=1):
    """A compiled tiny model, trained `epochs` epochs with a kept backup in tmp_path/backup."""
    model = tiny_model(tiny_config)
    recipes.compile_model(model, "adam")
    backup = callbacks.AtomicBackupAndRestore(str(tmp_path / "backup"), sharded=sharded,
                                              delete_checkpoint=False)
    x, y = tiny_data()
    model.fit(x, y, epochs=epochs, verbose=0, callbacks=[backup])
    return model, backup


def _name_in_metadata(backup, name):
    metadata = json.load(open(backup / "training_metadata.json"))
    (backup / "training_metadata.json").write_text(json.dumps({**metadata, "weights": name}))


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_backup_naming_a_file_outside_its_folder_is_refused_and_the_file_kept(
        tmp_path, tiny_config, where):
    """A metadata file naming `../x.keras` or `/.../x.keras` as its weights: the run neither
    loads that file nor deletes it as its stale backup at the next epoch."""
    model, _ = _backed_up(tmp_path, tiny_config)
    outside = tmp_path / "users_own_model.keras"
    model.save(outside)
    _name_in_metadata(tmp_path / "backup",
                      "../users_own_model.keras" if where == "relative" else str(outside))
    fresh = tiny_model(tiny_config)
    recipes.compile_model(fresh, "adam")
    x, y = tiny_data()
    with pytest.raises(errors.CheckpointError, match="not a backup name a run writes"):
        fresh.fit(x, y, epochs=3, verbose=0, callbacks=[
            callbacks.AtomicBackupAndRestore(str(tmp_path / "backup"))])
    assert outside.exists()


@jax_only
def test_a_sharded_backup_naming_a_folder_outside_is_refused_and_the_folder_kept(
        tmp_path, tiny_config):
    model, _ = _backed_up(tmp_path / "run", tiny_config, sharded=True)
    outside = tmp_path / "users_folder.orbax"  # an Orbax checkpoint, beside the user's own file
    shutil.copytree(tmp_path / "run" / "backup" / "epoch-1.orbax", outside)
    (outside / "notes.txt").write_text("mine")
    _name_in_metadata(tmp_path / "run" / "backup", str(outside))
    fresh = tiny_model(tiny_config)
    recipes.compile_model(fresh, "adam")
    x, y = tiny_data()
    with pytest.raises(errors.CheckpointError, match="not a backup name a run writes"):
        fresh.fit(x, y, epochs=3, verbose=0, callbacks=[callbacks.AtomicBackupAndRestore(
            str(tmp_path / "run" / "backup"), sharded=True)])
    assert (outside / "notes.txt").read_text() == "mine"


def _largest_file(folder):
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    return max(files, key=os.path.getsize)


def _damage(path, how):
    if how == "flip":  # 4 bytes in the middle: the file keeps its size
        data = bytearray(open(path, "rb").read())
        middle = len(data) // 2
        data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
        open(path, "wb").write(bytes(data))
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        os.remove(path)


@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=jax_only)],
                         ids=["keras", "orbax"])
@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_damaged_backup_is_refused_naming_its_file(tmp_path, tiny_config, sharded, how):
    """Each file a backup wrote is checked against the digest recorded when it was committed:
    4 flipped bytes in an Orbax data file restore without an error of Orbax's own."""
    _backed_up(tmp_path, tiny_config, sharded=sharded)
    name = "epoch-1.orbax" if sharded else "epoch-1.keras"
    damaged = _largest_file(tmp_path / "backup" / name) if sharded else str(
        tmp_path / "backup" / name)
    _damage(damaged, how)
    fresh = tiny_model(tiny_config)
    recipes.compile_model(fresh, "adam")
    backup = callbacks.AtomicBackupAndRestore(str(tmp_path / "backup"), sharded=sharded)
    with pytest.raises((errors.CheckpointError, FileNotFoundError)) as raised:
        backup.restore(fresh)
    message = str(raised.value)
    assert damaged in message and "\n" not in message
    if sharded or how != "delete":  # a missing .keras backup keeps its own error
        assert isinstance(raised.value, errors.CheckpointError)


@jax_only
@pytest.mark.parametrize("when", ["before", pytest.param("during", marks=pytest.mark.skipif(
    sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX"))])
def test_a_full_disk_at_a_sharded_backup_is_one_line_and_leaves_no_partial_checkpoint(
        tmp_path, tiny_config, monkeypatch, when):
    """Before: too little space for the checkpoint, refused before Orbax writes anything.
    During: a write that fails (a quota, or another writer filling the disk meanwhile)."""
    from collections import namedtuple

    from vit_keras.tools.distributed import sharded_checkpoint

    save = sharded_checkpoint.save

    def save_on_a_full_disk(model, path):
        # Writes past 16 KiB fail with EFBIG, as on a full disk with ENOSPC (Python ignores
        # SIGXFSZ); the limit is this process's, put back as soon as the backup has failed.
        import resource  # POSIX only

        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, limits[1]))
        try:
            save(model, path)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)

    if when == "before":
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2 ** 30, 2 ** 30, 4096))
    else:
        monkeypatch.setattr(sharded_checkpoint, "save", save_on_a_full_disk)
    with pytest.raises(run_folder.RunFolderWriteError) as raised:
        _backed_up(tmp_path, tiny_config, sharded=True)
    message = str(raised.value)
    reason = "No space left on device" if when == "before" else "File too large"
    assert message.startswith(f"Cannot write {tmp_path / 'backup' / 'epoch-1.orbax'}: {reason}")
    assert "Free space on its disk" in message and "\n" not in message
    assert os.listdir(tmp_path / "backup") == []  # no partial *.orbax-checkpoint-tmp


@jax_only
def test_a_failed_sharded_save_whose_orbax_thread_reraises_at_join_is_still_one_oserror(
        tmp_path, tiny_config, monkeypatch):
    """Orbax's writing threads re-raise their own error when joined (`_SignalingThread.join`):
    one still running when the save gives up made the app end in a traceback, its temporary
    folder left on the full disk."""
    import threading

    import orbax.checkpoint as ocp

    from vit_keras.tools.distributed import sharded_checkpoint

    full = ValueError("Failed writing: No space left on device [os_error_code='28']")

    class Thread(threading.Thread):
        def join(self, timeout=None):
            super().join(timeout)
            raise full

    class Checkpointer:
        def save(self, path, tree, force):
            os.makedirs(path + ".orbax-checkpoint-tmp-0")
            Thread(target=threading.Event().wait, args=(0.2,)).start()
            raise full

    monkeypatch.setattr(ocp, "PyTreeCheckpointer", Checkpointer)
    model = tiny_model(tiny_config)
    recipes.compile_model(model, "adam")
    with pytest.raises(OSError, match="No space left on device"):
        sharded_checkpoint.save(model, str(tmp_path / "epoch-1.orbax"))
    assert os.listdir(tmp_path) == []


@jax_only
def test_a_write_landing_after_a_failed_sharded_save_gave_up_is_removed_too(
        tmp_path, tiny_config, monkeypatch):
    """TensorStore's writes still under way end on threads of its own, after Orbax's: one of
    them left its file, and so the temporary folder, behind on the full disk."""
    import threading

    import orbax.checkpoint as ocp

    from vit_keras.tools.distributed import sharded_checkpoint

    path = tmp_path / "epoch-1.orbax"
    temporary = tmp_path / "epoch-1.orbax.orbax-checkpoint-tmp-0"
    failed = threading.Event()

    def late_write():  # a thread not started by the save, as TensorStore's are not
        failed.wait()
        threading.Event().wait(0.1)
        os.makedirs(temporary / "ocdbt.process_0", exist_ok=True)
        (temporary / "ocdbt.process_0" / "manifest.ocdbt").write_bytes(b"late")

    class Checkpointer:
        def save(self, path, tree, force):
            os.makedirs(temporary)
            failed.set()
            raise ValueError("Failed writing: No space left on device [os_error_code='28']")

    writer = threading.Thread(target=late_write)
    writer.start()
    monkeypatch.setattr(ocp, "PyTreeCheckpointer", Checkpointer)
    model = tiny_model(tiny_config)
    recipes.compile_model(model, "adam")
    with pytest.raises(OSError, match="No space left on device"):
        sharded_checkpoint.save(model, str(path))
    writer.join()
    assert os.listdir(tmp_path) == []
