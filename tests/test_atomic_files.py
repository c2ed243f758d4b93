"""`vit_keras.atomic_files`: every file vit_keras writes is whole or not there, never written
through a link (checkpoints, adapters, figures, run folders, exported models, the apps' models)."""

import os

import pytest

from vit_keras import atomic_files

pytestmark = pytest.mark.backend_independent


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def test_a_write_replaces_a_link_at_its_path_and_leaves_the_links_target(tmp_path):
    target, path = tmp_path / "elsewhere.npz", tmp_path / "model.npz"
    target.write_bytes(b"someone else's file")
    path.symlink_to(target)
    atomic_files.write_bytes(b"new", str(path))
    assert not path.is_symlink() and _read(path) == b"new"
    assert _read(target) == b"someone else's file"
    assert sorted(os.listdir(tmp_path)) == ["elsewhere.npz", "model.npz"]


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = str(tmp_path / "model.keras")
    atomic_files.write_bytes(b"the last good model", path)
    with pytest.raises(KeyboardInterrupt):
        with atomic_files.replacing(path, ".keras") as temporary:
            with open(temporary, "wb") as f:
                f.write(b"half a mo")
            raise KeyboardInterrupt  # Ctrl-C (or a full disk) before the write finished
    assert _read(path) == b"the last good model"
    assert os.listdir(tmp_path) == ["model.keras"]


def test_a_write_that_cannot_start_names_the_path_not_the_temporary_file(tmp_path):
    missing = str(tmp_path / "no_such_folder" / "model.npz")
    with pytest.raises(FileNotFoundError) as raised:
        atomic_files.write_bytes(b"new", missing)
    assert str(raised.value) == f"[Errno 2] No such file or directory: {missing!r}"
    with pytest.raises(IsADirectoryError) as raised:  # os.replace onto a folder
        atomic_files.write_bytes(b"new", str(tmp_path))
    assert str(raised.value) == f"[Errno 21] Is a directory: {str(tmp_path)!r}"
    assert os.listdir(tmp_path) == []


def test_the_temporary_name_keeps_the_suffix_and_a_link_left_there_is_not_followed(tmp_path):
    """Keras chooses a file's format by its suffix; a link planted at the temporary name (or a
    killed run's leftover) is removed before the writer, which follows links, opens it."""
    path = str(tmp_path / "model.keras")
    temporary = str(tmp_path / f"model.tmp-{os.getpid()}.keras")
    target = tmp_path / "target"
    target.write_bytes(b"untouched")
    os.symlink(target, temporary)
    with atomic_files.replacing(path, ".keras") as name:
        assert name == temporary and not os.path.lexists(name)
        with open(name, "wb") as f:
            f.write(b"model")
    assert _read(path) == b"model" and _read(target) == b"untouched"
    assert sorted(os.listdir(tmp_path)) == ["model.keras", "target"]


def test_a_value_returned_inside_the_block_is_written(tmp_path):
    """`save_checked_model` returns its reload check's result from inside the block."""
    path = str(tmp_path / "out.keras")

    def save():
        with atomic_files.replacing(path, ".keras") as temporary:
            with open(temporary, "wb") as f:
                f.write(b"checked")
            return 0.0

    assert save() == 0.0 and _read(path) == b"checked"
