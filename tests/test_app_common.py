"""What the apps share: `apps/_backend.py` (the backend, before Keras) and `apps/_common.py`
(--image_size, class names)."""

import os
import sys

import keras
import pytest

from conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "apps"))
import _backend  # noqa: E402
import _common  # noqa: E402
from absl import app  # noqa: E402


@pytest.mark.parametrize("argv", [["app", "--backend", "torch", "--out", "x"],
                                  ["app", "--out", "x", "--backend=torch"]])
def test_select_backend_reads_the_flag_anywhere(monkeypatch, argv):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    monkeypatch.setitem(sys.modules, "keras", None)  # as in an app, before keras is imported
    assert _backend.select_backend(argv) == "torch"
    assert os.environ["KERAS_BACKEND"] == "torch"


def test_select_backend_errors(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    assert _backend.select_backend(["app"]) is None
    assert os.environ["KERAS_BACKEND"] == "tensorflow"
    with pytest.raises(ValueError, match="Unknown backend 'mxnet'"):
        _backend.select_backend(["app", "--backend", "mxnet"])
    other = "jax" if keras.backend.backend() != "jax" else "torch"
    with pytest.raises(ValueError, match="before importing keras"):
        _backend.select_backend(["app", "--backend", other])  # keras is already imported here


def test_start_app_defines_the_backend_flag_once_and_sets_defaults(monkeypatch):
    from absl import flags

    monkeypatch.setattr(sys, "argv", ["app", "--backend", keras.backend.backend()])
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _backend.start_app() == keras.backend.backend()
    assert _backend.start_app() == keras.backend.backend()  # a second app module: no duplicate flag
    assert "backend" in flags.FLAGS
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.backend_independent
def test_parse_image_size():
    assert _common.parse_image_size(["24"]) == 24
    assert _common.parse_image_size(["24", "20"]) == (24, 20)
    for bad in (["24", "20", "3"], ["big"], ["0"], []):
        with pytest.raises(app.UsageError, match="one positive number or height,width"):
            _common.parse_image_size(bad)


@pytest.mark.backend_independent
def test_read_class_names_from_the_flag_then_the_run_folder(tmp_path):
    model = tmp_path / "run" / "model.keras"
    assert _common.read_class_names(None, str(model)) is None  # numbered classes
    model.parent.mkdir()
    (model.parent / "class_names.json").write_text('["cat", "dog"]')
    assert _common.read_class_names(None, str(model)) == ["cat", "dog"]
    (tmp_path / "names.txt").write_text("bird\nfish\n")
    assert _common.read_class_names(str(tmp_path / "names.txt"), str(model)) == ["bird", "fish"]
    with pytest.raises(app.UsageError, match="--class_names .*missing.txt is not a file"):
        _common.read_class_names(str(tmp_path / "missing.txt"), str(model))
