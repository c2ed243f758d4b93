"""What the apps share: `apps/_backend.py` (the backend, before Keras; glibc's malloc on JAX) and
`apps/_common.py` (--image_size, class names)."""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from conftest import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "apps"))
from absl import app  # noqa: E402

import _app_output  # noqa: E402
import _backend  # noqa: E402
import _common  # noqa: E402


@pytest.mark.parametrize("argv", [["app", "--backend", "torch", "--out", "x"],
                                  ["app", "--out", "x", "--backend=torch"]])
def test_select_backend_reads_the_flag_anywhere(monkeypatch, argv):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    monkeypatch.setitem(sys.modules, "keras", None)  # as in an app, before keras is imported
    assert _backend.select_backend(argv) == "torch"
    assert os.environ["KERAS_BACKEND"] == "torch"


def test_select_backend_reads_flag_files_where_they_stand(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    monkeypatch.setitem(sys.modules, "keras", None)  # as in an app, before keras is imported
    inner = tmp_path / "inner.txt"
    inner.write_text("--backend=jax\n")
    flags_txt = tmp_path / "flags.txt"
    flags_txt.write_text(f"# a run's flags\n--batch_size=8\n--backend=torch\n--flagfile={inner}\n")
    assert _backend.select_backend(["app", "--flagfile", str(flags_txt)]) == "jax"  # nested, later
    assert _backend.select_backend(["app", f"--flagfile={flags_txt}", "--backend", "torch"]) == (
        "torch")  # a flag after the file overrides it, as in absl
    assert _backend.select_backend(["app", "--backend=torch", "--flagfile", str(inner)]) == "jax"
    assert os.environ["KERAS_BACKEND"] == "jax"


@pytest.mark.parametrize("argv", [["app", "-backend=torch"], ["app", "-backend", "torch"],
                                  ["app", "--backend=torch", "--", "--backend=jax"]])
def test_select_backend_reads_absls_single_dash_form_and_stops_where_absl_does(monkeypatch, argv):
    """absl reads `-backend=torch` as `--backend=torch`: a run must then be on torch, not on
    KERAS_BACKEND's backend while it records torch (vit_keras issue 41, item 10)."""
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    monkeypatch.setitem(sys.modules, "keras", None)  # as in an app, before keras is imported
    assert _backend.select_backend(argv) == "torch"
    assert os.environ["KERAS_BACKEND"] == "torch"


def test_a_flagfile_that_includes_itself_is_refused_naming_the_loop(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "keras", None)
    (tmp_path / "a.txt").write_text(f"--backend=torch\n--flagfile={tmp_path}/b.txt\n")
    (tmp_path / "b.txt").write_text(f"--flagfile={tmp_path}/a.txt\n")
    with pytest.raises(_backend.FlagfileLoopError,
                       match=r"--flagfile .*a.txt includes itself \(.*a.txt -> .*b.txt -> .*a.txt\)"):
        _backend.select_backend(["app", f"--flagfile={tmp_path}/a.txt"])
    (tmp_path / "c.txt").write_text(f"--flagfile={tmp_path}/d.txt\n--flagfile={tmp_path}/d.txt\n")
    (tmp_path / "d.txt").write_text("--backend=torch\n")
    assert _backend.select_backend(["app", f"--flagfile={tmp_path}/c.txt"]) == "torch"  # no loop


@pytest.mark.slow
def test_an_unknown_backend_ends_an_app_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, os.path.join("apps", "finetune.py"), "--backend",
                             "jaxx"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ERROR: Unknown backend 'jaxx'; expected one of jax, tensorflow, torch."]


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
    monkeypatch.setenv(_backend.KEEP_HOST_MEMORY, "0")  # leave this test process's malloc alone
    set_up = []  # and its logging and warnings (test_an_app_prints_only_its_own_lines checks them)
    monkeypatch.setattr(_backend._app_output, "set_up", lambda: set_up.append(True))
    hidden = []
    monkeypatch.setattr(_backend, "keep_tensorflow_off_the_gpus", lambda: hidden.append(True))
    assert _backend.start_app() == keras.backend.backend()
    assert _backend.start_app() == keras.backend.backend()  # a second app module: no duplicate flag
    assert "backend" in flags.FLAGS
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert set_up == [True, True]
    # tf.data's TensorFlow keeps off the GPUs that JAX or torch train on.
    assert hidden == ([True, True] if keras.backend.backend() in ("jax", "torch") else [])


def test_tensorflow_is_shown_no_gpu(monkeypatch):
    """What `keep_tensorflow_off_the_gpus` tells TensorFlow (here, with no GPU, recorded)."""
    tf = pytest.importorskip("tensorflow")
    calls = []
    monkeypatch.setattr(tf.config, "set_visible_devices",
                        lambda devices, device_type=None: calls.append((devices, device_type)))
    _backend.keep_tensorflow_off_the_gpus()
    assert calls == [([], "GPU")]


# Runs apps/predict.py --help with ctypes' mallopt replaced by a recorder that also notes whether
# JAX's CPU client had started: glibc's setting reaches only threads that have not allocated yet.
_MALLOPT_CODE = """
import ctypes, json, runpy, sys

calls = []

def client_started():
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()

class Recording(ctypes.CDLL):
    def __getattr__(self, name):
        if name != "mallopt":
            return super().__getattr__(name)
        def mallopt(parameter, value):
            calls.append({"parameter": parameter, "value": value, "client": client_started(),
                          "vit_keras": "vit_keras" in sys.modules,
                          "numpy": "numpy" in sys.modules})
            return 1
        return mallopt

ctypes.CDLL = Recording
sys.path.insert(0, "apps")  # as Python does for a script
sys.argv = ["apps/predict.py", *sys.argv[1:], "--helpshort"]
try:
    runpy.run_path("apps/predict.py", run_name="__main__")
except SystemExit:  # absl exits after the help
    pass
import keras
print(json.dumps({"calls": calls, "backend": keras.backend.backend()}))
"""


@pytest.mark.jax_subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
@pytest.mark.parametrize("argv, env, backend, applied", [
    (["--backend", "jax"], {"KERAS_BACKEND": "torch"}, "jax", True),  # the flag wins
    ([], {"KERAS_BACKEND": "jax"}, "jax", True),
    ([], {"KERAS_BACKEND": "jax", _backend.KEEP_HOST_MEMORY: "0"}, "jax", False),
    (["--backend", "torch"], {"KERAS_BACKEND": "jax"}, "torch", False),
])
def test_an_app_keeps_freed_host_memory_on_jax_before_its_cpu_client_starts(
        argv, env, backend, applied):
    environment = {name: value for name, value in os.environ.items()
                   if name != _backend.KEEP_HOST_MEMORY}
    environment.update(TF_CPP_MIN_LOG_LEVEL="3", **env)
    result = subprocess.run([sys.executable, "-c", _MALLOPT_CODE, *argv], cwd=REPO_ROOT,
                            env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["backend"] == backend
    if applied:  # keep_freed_host_memory's three settings, all before JAX's CPU client
        assert [(c["parameter"], c["value"]) for c in found["calls"]] == [
            (-8, 1), (-4, 0), (-1, -1)], found
        assert not any(c["client"] for c in found["calls"]), found
        # Before NumPy starts OpenBLAS's threads (and before vit_keras, which imports NumPy):
        # arenas those threads make would keep part of XLA's memory out of the settings' reach.
        assert not any(c["vit_keras"] or c["numpy"] for c in found["calls"]), found
    else:
        assert found["calls"] == [], found


@pytest.mark.backend_independent
def test_parse_image_size():
    assert _common.parse_image_size(["24"]) == 24
    assert _common.parse_image_size(["24", "20"]) == (24, 20)
    for bad in (["24", "20", "3"], ["big"], ["0"], []):
        with pytest.raises(app.UsageError, match="one positive number or height,width"):
            _common.parse_image_size(bad)


@pytest.mark.backend_independent
def test_a_model_file_is_checked_before_anything_loads(tmp_path):
    """`--model` of predict, evaluate and fewshot (each app's one-line error for one of these:
    tests/test_app_errors.py)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "damaged.keras").write_text("not a zip archive")
    refused = {
        tmp_path / "no_such_run" / "model.keras": "no_such_run/model.keras: no such file.",
        tmp_path / "run": "run is a folder; give a .keras model file.",
        tmp_path / "notes.txt": "notes.txt is not a .keras file; give a model saved by model.save",
        tmp_path / "damaged.keras": "damaged.keras is not a Keras model file (a zip archive "
                                    "holding config.json): it is damaged or of another format.",
    }
    for path, message in refused.items():
        with pytest.raises(app.UsageError, match=re.escape(message)) as error:
            _common.check_model_file(str(path))
        assert str(error.value).startswith(f"--model {path}")


@pytest.mark.backend_independent
def test_an_output_file_is_checked_before_any_work(tmp_path):
    """What `--json` (evaluate, predict, fewshot) and `--out` (convert, build_hybrid) write."""
    report, notes = tmp_path / "report.json", tmp_path / "notes.txt"
    report.write_text("{}\n")
    notes.write_text("keep me")
    (tmp_path / "link.json").symlink_to(report)
    refused = {
        str(report): "report.json exists already: pass --overwrite to replace it, or choose "
                     "another --json.",
        str(tmp_path / "link.json"): "link.json is a symbolic link (to ",
        str(tmp_path): "is a folder; give the path of a file.",
        str(notes / "report.json"): "notes.txt is not a folder; choose another --json.",
    }
    for path, message in refused.items():
        with pytest.raises(app.UsageError, match=re.escape(message)):
            _common.check_output_file("--json", path, overwrite=False)
    _common.check_output_file("--json", str(report), overwrite=True)
    _common.check_output_file("--json", str(tmp_path / "new" / "folders" / "r.json"), False)
    assert report.read_text() == "{}\n" and notes.read_text() == "keep me"


@pytest.mark.backend_independent
def test_check_weights_is_the_librarys_check_naming_the_model_flag(monkeypatch):
    from vit_keras import errors
    from vit_keras.weights import download, releases

    def refuse(*args, **kwargs):
        raise AssertionError("check_weights must not download")

    monkeypatch.setattr(download, "fetch", refuse)
    with pytest.raises(errors.ReleaseNeedsVariantError,
                       match=r"^'augreg_in21k' is a release name: give the variant it is for "
                             r"\(--model ViT-B/16, for example\)"):
        _common.check_weights("augreg_in21k", None)
    with pytest.raises(errors.ReleaseNotFoundError, match="ViT-Ti/16 has no release 'imagenet21k'"):
        _common.check_weights("imagenet21k", "ViT-Ti/16")
    assert _common.check_weights("augreg_in21k", "ViT-Ti/16", 384) == releases.find_release(
        "ViT-Ti/16", "augreg_in21k", 384)
    assert _common.check_weights(None, None) is None and _common.check_weights("", None) is None


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


@pytest.mark.backend_independent
def test_run_config_fields_are_the_training_flags():
    from absl import flags

    from vit_keras.tools.runs import config_flags, training

    flag_values = flags.FlagValues()
    config_flags.define_flags(training.RunConfig, flag_values=flag_values,
                              recipe={"default": "pretrain"})
    fields = config_flags.flag_fields(training.RunConfig)
    assert {f.name for f in fields} == set(flag_values) and "flags_text" not in flag_values
    for field in fields:
        flag = flag_values[field.name]
        assert flag.help.endswith(field.metadata["help"]), field.name
        default = tuple(flag.default) if isinstance(field.default, tuple) else flag.default
        assert default == ("pretrain" if field.name == "recipe" else field.default), field.name
    assert flag_values["recipe"].parser.enum_values == ["auto", "finetune", "pretrain", "digits"]
    flag_values(["app", "--batch_size=8", "--noflip", "--learning_rate=0.5", "--decay=linear"])
    config = config_flags.from_flags(training.RunConfig, flag_values, flags_text="x")
    assert (config.optimization.batch_size, config.augmentation.flip,
            config.optimization.learning_rate, config.optimization.decay,
            config.optimization.recipe, config.flags_text) == (8, False, 0.5, "linear",
                                                               "pretrain", "x")
    with pytest.raises(flags.IllegalFlagValueError):
        flag_values["decay"].parse("step")
    with pytest.raises(ValueError, match="no flag fields"):
        config_flags.define_flags(training.RunConfig, flag_values=flags.FlagValues(),
                                  recipes={"default": "x"})


def test_model_image_size_is_the_input_side_or_the_built_side_of_a_dynamic_model(tiny_config):
    import vit_keras

    fixed = vit_keras.build_model(tiny_config, image_size=12, num_classes=3)
    dynamic = vit_keras.build_model(tiny_config, image_size=12, num_classes=3,
                                    dynamic_image_size=True)
    assert _common.model_image_size(fixed) == 12
    assert _common.model_image_size(dynamic) == 12


def test_run_splits_come_from_the_run_that_trained_the_model(tmp_path, monkeypatch):
    from vit_keras.tools import data
    from vit_keras.tools.runs.run_folder import RunFolder

    model_path = str(tmp_path / "run" / "model.keras")
    os.makedirs(os.path.dirname(model_path))
    RunFolder.of_model(model_path).write_metrics({"config": {"run": {
        "dataset": "folder:/photos", "seed": 3, "val_fraction": 0.25, "data_dir": "/tfds"}}})
    calls = []
    monkeypatch.setattr(data, "load_splits", lambda name, **kwargs: calls.append((name, kwargs)))
    assert _common.load_run_splits(model_path)[0] == "folder:/photos"
    _common.load_run_splits(model_path, seed=5, val_fraction=0.5, data_dir="/other")
    _common.load_run_splits(model_path, dataset="digits")  # another dataset: the defaults
    assert calls == [
        ("folder:/photos", {"data_dir": "/tfds", "val_fraction": 0.25, "seed": 3}),
        ("folder:/photos", {"data_dir": "/other", "val_fraction": 0.5, "seed": 5}),
        ("digits", {"data_dir": None, "val_fraction": None, "seed": 0})]


# What a machine without a GPU printed before an app's first line, and absl's prefix of a Python
# log record (`W1126 10:15:42.380702 140145418603392 loader.py:189] `) or a C++ one.
_NOISE = ("oneDNN", "cuInit", "cuda drivers", "absl::InitializeLog", "Unable to initialize backend",
          "rebuild TensorFlow")
_LOG_PREFIX = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\]")


@pytest.mark.slow
def test_an_app_prints_only_its_own_lines_and_one_per_epoch_into_a_log(tmp_path):
    """finetune.py as a user starts it (no TF_CPP_MIN_LOG_LEVEL), its output into pipes: none of
    TensorFlow's or JAX's start-up lines, every warning as `WARNING: ...`, and one line per
    epoch instead of a progress bar redrawn after every step."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        os.makedirs(tmp_path / "images" / name)
        for index in range(6):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(
                tmp_path / "images" / name / f"{index}.png")
    os.makedirs(tmp_path / "images" / "emu")  # an empty class: a warning
    environment = {name: value for name, value in os.environ.items()
                   if name != _app_output.TF_LOG_LEVEL}
    environment["KERAS_BACKEND"] = keras.backend.backend()
    result = subprocess.run(
        [sys.executable, os.path.join("apps", "finetune.py"), "--model=ViT-digits",
         f"--dataset=folder:{tmp_path / 'images'}", "--image_size=8", "--batch_size=4",
         "--epochs=3", f"--output_dir={tmp_path / 'runs'}", "--run_name=run"],
        cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines() + result.stderr.splitlines()
    assert not [line for line in lines if _LOG_PREFIX.match(line)
                or any(noise in line for noise in _NOISE)], result.stderr
    warnings = result.stderr.splitlines()
    assert warnings and all(line.startswith("WARNING: ") for line in warnings), result.stderr
    assert f"WARNING: {tmp_path / 'images' / 'emu'} has no image files" in result.stderr
    assert "\r" not in result.stdout and "\x1b" not in result.stdout  # no progress bar
    assert len(re.findall(r"^Epoch \d/3\n\d+/\d+ - .*loss.*\n", result.stdout, re.M)) == 3
    assert len(result.stdout) < 4000  # progress bars: a line per step, 191 KB for the digits


@pytest.mark.backend_independent
def test_import_noise_is_dropped_below_the_level_in_force():
    """TensorFlow's lines written while it loads, before its logging reads
    TF_CPP_MIN_LOG_LEVEL: those below the level are dropped, with their continuation lines."""
    lines = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        "I0000 00:00:1795692066.059027    4633 port.cc:153] oneDNN custom operations are on.\n",
        "I0000 00:00:1795692066.105642    4633 cpu_feature_guard.cc:227] This TensorFlow binary\n",
        "To enable the following instructions: AVX2 AVX512F, rebuild TensorFlow.\n",
        "E0000 00:00:1795692096.367309    4803 cuda_platform.cc:52] failed call to cuInit\n",
        "WARNING: a Python warning (UserWarning, x.py:1)\n",
    ]
    assert _app_output._HeldBackStderr(3)._kept(lines) == lines[-1:]
    assert _app_output._HeldBackStderr(1)._kept(lines) == lines[4:]
    assert _app_output._HeldBackStderr(0)._kept(lines) == lines


def test_the_normalization_flag_offers_every_named_normalization():
    import vit_keras

    assert _common.NORMALIZATION_NAMES == tuple(vit_keras.NORMALIZATIONS)


def _unraisable(error):
    import types

    return types.SimpleNamespace(exc_type=type(error), exc_value=error, err_msg=None,
                                 exc_traceback=error.__traceback__, object=None)


@pytest.mark.backend_independent
def test_a_runs_failed_checkpoint_write_is_quiet_and_every_other_error_printed(
        monkeypatch, caplog):
    """What Orbax and asyncio print after an fsdp backup's failed write repeats the app's one
    line: left out; another error of theirs, an unraisable of another kind, still print."""
    import asyncio
    import logging

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)  # as TensorStore's callbacks do, after Orbax's save
    except RuntimeError as error:
        closed = error
    try:
        raise RuntimeError("Event loop is closed")  # the same words, raised elsewhere
    except RuntimeError as error:
        elsewhere = error
    full = ValueError("Failed writing: No space left on device [os_error_code='28']")
    unraisables = []
    monkeypatch.setattr(sys, "unraisablehook", unraisables.append)
    for name in ("absl", "asyncio"):  # the filters stay after a failed write: not past this test
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    orbax = "[process=0][thread=t][operation_id=1] _SignalingThread.run() raised an exception: %s"
    with caplog.at_level(logging.ERROR), _app_output.quiet_failed_checkpoint_writes():
        for error in (closed, elsewhere, ValueError("a bug")):
            sys.unraisablehook(_unraisable(error))
        for error in (full, KeyError("a bug")):
            logging.getLogger("absl").error(orbax, error, exc_info=error)
            logging.getLogger("asyncio").error("Task exception was never retrieved",
                                               exc_info=error)
    assert [str(u.exc_value) for u in unraisables] == ["Event loop is closed", "a bug"]
    assert unraisables[0].exc_value is elsewhere
    assert [(r.name, str(r.exc_info[1])) for r in caplog.records] == [
        ("absl", "'a bug'"), ("asyncio", "'a bug'")]


@pytest.mark.backend_independent
def test_a_run_without_a_failed_checkpoint_write_puts_back_the_hook_and_the_loggers():
    import logging

    hook, loggers = sys.unraisablehook, [logging.getLogger(n) for n in ("absl", "asyncio")]
    filters = [list(logger.filters) for logger in loggers]
    with _app_output.quiet_failed_checkpoint_writes():
        assert sys.unraisablehook is not hook
    assert sys.unraisablehook is hook
    assert [logger.filters for logger in loggers] == filters
