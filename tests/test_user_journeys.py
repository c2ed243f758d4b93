"""User journeys, each step in a fresh process as a user would run it: every `.keras` file an app
writes loads anywhere with `import keras, vit_keras` alone; a pre-trained model fine-tunes with
no extra flags; a finished run is never redone; a killed run resumes where it stopped; two runs
never share a folder. The apps run on this pass's backend; their models load on all three.

The runs are tiny (one epoch of two steps on the digits) and shared by the tests through
module-scoped fixtures. What only the run folder decides (a busy, read-only or finished folder)
runs in one pass of `make test` (`backend_independent`); every app is launched in a subprocess, so
the whole module is `slow`."""

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.tools.runs.run_folder import RunFolder

from conftest import (
    BACKENDS,
    REPO_ROOT,
    TINY_CONFIG,
    randomize_weights,
    run_killed_after_training,
    run_on_backend,
)

pytestmark = pytest.mark.slow

BACKEND = keras.backend.backend()
OTHER_BACKEND = "torch" if BACKEND != "torch" else "jax"
# One epoch of two steps: the cheapest run that trains, evaluates and writes every file.
SHORT = ["--epochs", "1", "--steps_per_epoch", "2", "--verbose", "2"]
# What `fit(verbose=2)` prints at the end of each epoch ("2/2 - 1s - 50ms/step - ... loss: ...").
EPOCH_LINE = re.compile(r"^\d+/\d+ - .* loss: ", re.M)


def _env(**extra):
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": OTHER_BACKEND, **extra}


def _command(app, *args):
    return [sys.executable, os.path.join("apps", app), *args]


def _run(command, env=None, check=True, **kwargs):
    result = subprocess.run(command, cwd=REPO_ROOT, env=env or _env(), capture_output=True,
                            text=True, timeout=600, **kwargs)
    if check and result.returncode:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}:\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def _saved_model(stdout):
    return re.search(r"^Saved model: (.+)$", stdout, re.M).group(1)


def _snapshot(folder):
    """`{relative path: (mtime_ns, sha256)}` of every file under `folder`."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            found[os.path.relpath(path, folder)] = (os.stat(path).st_mtime_ns, digest)
    return found


def _one_line_error(result):
    """The `ERROR: ...` line of a user error: exit status 2, that one line last on stderr, no
    traceback (TensorFlow's and JAX's own start-up logs may come before it)."""
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("ERROR: "), result.stderr
    assert [line for line in lines if "ERROR" in line] == lines[-1:], result.stderr
    return lines[-1]


def _history_epochs(folder):
    with open(os.path.join(folder, "history.csv")) as f:
        return [line.split(",")[0] for line in f.read().splitlines()[1:]]


# --- the runs the journeys share -------------------------------------------------------------

@pytest.fixture(scope="module")
def output_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("saved_models")


@pytest.fixture(scope="module")
def pretrain_run(output_dir):
    result = _run(_command("pretrain.py", "--backend", BACKEND, *SHORT, "--fewshot_shots=",
                           "--output_dir", str(output_dir)))
    return {"model": _saved_model(result.stdout)}


@pytest.fixture(scope="module")
def finetune_run(output_dir, pretrain_run):
    """apps/finetune.py on the digits from the pre-trained model, with no size or recipe flag."""
    command = _command("finetune.py", "--backend", BACKEND, "--weights", pretrain_run["model"],
                       *SHORT, "--output_dir", str(output_dir))
    result = _run(command)
    model = _saved_model(result.stdout)
    return {"command": command, "model": model, "folder": os.path.dirname(model),
            "stdout": result.stdout}


@pytest.fixture(scope="module")
def killed_and_resumed_train_run(output_dir):
    """apps/train.py killed (SIGKILL, from outside) once its training has ended, before its
    metrics.json, with the temporary files of an interrupted save planted in its folder, then
    run again with the same command."""
    command = _command("train.py", "--backend", BACKEND, *SHORT, "--output_dir",
                       str(output_dir), "--run_name", "killed")
    folder = RunFolder(output_dir / "killed")
    first = run_killed_after_training(command, folder.path, _env())
    assert first.returncode == -signal.SIGKILL, first.stdout[-3000:] + first.stderr[-3000:]
    assert not os.path.exists(folder.metrics)
    # Resumed with other settings first: refused, the folder as the kill left it.
    # (The lock file aside: each process that opens the folder writes its pid there.)
    before = {name: found for name, found in _snapshot(folder.path).items() if name != "lock"}
    other_flags = _run(command + ["--learning_rate", "0.03", "--layer_decay", "0.5",
                                  "--lora_rank", "4"], check=False)
    other_flags_after = {name: found for name, found in _snapshot(folder.path).items()
                         if name != "lock"}
    stale = [os.path.join(folder.path, "model.tmp-999999.keras"),
             os.path.join(folder.backup, "saving-999999.weights.h5")]
    for path in stale:
        with open(path, "wb") as f:
            f.write(b"half a file")
    second = _run(command)
    return {"first": first.stdout, "second": second.stdout, "folder": folder, "stale": stale,
            "model": folder.model, "other_flags": other_flags, "before": before,
            "other_flags_after": other_flags_after}


@pytest.fixture(scope="module")
def converted_model(output_dir):
    model = randomize_weights(vit_keras.build_model(TINY_CONFIG, image_size=16, num_classes=5))
    checkpoint = vit_keras.save_npz(model, str(output_dir / "tiny.npz"))
    out = str(output_dir / "converted.keras")
    _run(_command("convert.py", "--backend", BACKEND, "--weights", checkpoint, "--out", out,
                  "--num_classes", "7"))
    return out


@pytest.fixture(scope="module")
def hybrid_model(output_dir):
    out = str(output_dir / "hybrid.keras")
    _run(_command("build_hybrid.py", "--backend", BACKEND, "--model", "R+ViT-Ti/16",
                  "--image_size", "32", "--num_classes", "3", "--out", out))
    return out


# --- every app's model loads anywhere --------------------------------------------------------

_LOAD_CODE = """
import keras, vit_keras
import numpy as np

found = {}
for path in ARGS["paths"]:
    model = keras.models.load_model(path)  # compile=True, safe_mode=True: the defaults
    images = np.random.default_rng(0).uniform(0, 255, (2, *model.input_shape[1:]))
    names = {layer.name for layer in model.layers}
    # The features under a head too: a zero-initialised head hides them from the logits.
    probe = keras.Model(model.input, [model.output, *(
        [model.get_layer("head").input] if "head" in names else [])])
    outputs = probe.predict(images.astype("float32"), verbose=0)
    found[path] = {"outputs": [np.asarray(o, "float64").tolist() for o in outputs],
                   "compiled": model.compiled,
                   "jit_compile": model.jit_compile if model.compiled else None}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def loaded_everywhere(finetune_run, pretrain_run, killed_and_resumed_train_run, converted_model,
                      hybrid_model):
    paths = {"finetune": finetune_run["model"], "pretrain": pretrain_run["model"],
             "train": killed_and_resumed_train_run["model"], "convert": converted_model,
             "build_hybrid": hybrid_model}
    loads = {backend: run_on_backend(backend, _LOAD_CODE, paths=list(paths.values()))
             for backend in BACKENDS}
    return {app: {backend: loads[backend][path] for backend in BACKENDS}
            for app, path in paths.items()}


@pytest.mark.parametrize("app", ["finetune", "train", "pretrain", "convert", "build_hybrid"])
def test_every_apps_model_loads_with_only_vit_keras_and_predicts_alike_on_every_backend(
        loaded_everywhere, app):
    loads = loaded_everywhere[app]
    reference = [np.asarray(o) for o in loads[BACKEND]["outputs"]]
    for backend in BACKENDS:
        found = [np.asarray(o) for o in loads[backend]["outputs"]]
        for expected, actual in zip(reference, found, strict=True):
            # The same float32 computation on another backend's kernels (as tests/test_saving.py).
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{app} loaded on {backend}")
    if app in ("finetune", "train", "pretrain"):  # written compiled: reloaded compiled
        assert all(loads[backend]["compiled"] for backend in BACKENDS)


def test_a_model_trained_with_xla_loads_on_torch_without_torch_compile(loaded_everywhere):
    # The training apps compile with XLA on JAX and TensorFlow; each backend that loads the
    # model decides for itself (torch: eager, Keras' "auto").
    for app in ("finetune", "train", "pretrain"):
        assert loaded_everywhere[app]["torch"]["jit_compile"] is False, app
        assert loaded_everywhere[app]["jax"]["jit_compile"] is True, app


# --- defaults follow the weights and the data ------------------------------------------------

def test_finetuning_a_pretrained_digits_model_keeps_its_size_and_the_digits_recipe(
        finetune_run, pretrain_run):
    metrics = RunFolder(finetune_run["folder"]).read_metrics()
    pretrained = RunFolder.of_model(pretrain_run["model"]).read_metrics()
    assert metrics["config"]["recipe"]["name"] == "digits"
    assert metrics["config"]["recipe"]["image_size"] == pretrained["config"]["recipe"][
        "image_size"] == 16
    assert "masked patch prediction model" in finetune_run["stdout"]


# The estimate and the check are vit_keras.tools.distributed.memory's, run before the first step on every
# backend by test_memory.py; what this adds is the app's one-line error: one pass.
@pytest.mark.backend_independent("tensorflow")
def test_a_configuration_too_large_for_memory_is_refused_before_the_first_step(pretrain_run,
                                                                                tmp_path):
    # 384 px with 4-pixel patches: 9,216 tokens; attention alone needs terabytes at batch 512.
    result = _run(_command("finetune.py", "--backend", BACKEND, "--weights",
                           pretrain_run["model"], "--image_size", "384", "--batch_size", "512",
                           "--output_dir", str(tmp_path)), check=False)
    error = _one_line_error(result)
    assert re.search(r"\d+(\.\d+)? [GTP]iB", error)
    assert "--image_size" in error and "--batch_size" in error
    assert not EPOCH_LINE.search(result.stdout)


# --- a finished run stays finished -----------------------------------------------------------

# The run folder decides before any backend work (vit_keras.tools.runs.run_folder): one pass suffices.
@pytest.mark.backend_independent("tensorflow")  # where an app starts fastest
def test_rerunning_a_finished_run_says_it_is_complete_and_changes_nothing(finetune_run):
    before = _snapshot(finetune_run["folder"])
    assert {"model.keras", "metrics.json"} <= set(before)
    result = _run(finetune_run["command"])
    assert "is complete" in result.stdout, result.stdout[-3000:]
    assert "--overwrite" in result.stdout
    assert not EPOCH_LINE.search(result.stdout)
    assert _snapshot(finetune_run["folder"]) == before


@pytest.fixture(scope="module")
def replayed_from_flagfile(finetune_run, tmp_path_factory):
    """A copy of the finished fine-tuning run replayed from its flags.txt with `--overwrite`,
    with KERAS_BACKEND naming another backend than the file's."""
    output = tmp_path_factory.mktemp("replayed")
    copy = output / os.path.basename(finetune_run["folder"])
    shutil.copytree(finetune_run["folder"], copy)
    before = _snapshot(copy)
    result = _run(_command("finetune.py", "--flagfile", str(copy / "flags.txt"),
                           "--output_dir", str(output), "--overwrite"),
                  env=_env(KERAS_BACKEND=OTHER_BACKEND))
    return {"folder": copy, "before": before, "stdout": result.stdout}


# --overwrite and a flagfile's --backend are the run folder's and the apps' flag parsing, the same
# whatever the backend (each backend's own training is finetune_run's): one pass, which trains
# the replay.
@pytest.mark.backend_independent("torch")
def test_overwrite_starts_a_finished_run_over(replayed_from_flagfile):
    folder = replayed_from_flagfile["folder"]
    assert "is complete" not in replayed_from_flagfile["stdout"]
    assert EPOCH_LINE.search(replayed_from_flagfile["stdout"])
    assert _history_epochs(folder) == ["0"]  # trained afresh, not appended to the old history
    after = _snapshot(folder)
    for name in ("model.keras", "metrics.json"):
        assert after[name] != replayed_from_flagfile["before"][name], name


@pytest.mark.backend_independent("tensorflow")  # where an app starts fastest
def test_rerunning_a_finished_run_with_other_flags_is_refused_naming_them(finetune_run):
    """A run folder is the record of one run: its flags.txt says how the model was trained
    (vit_keras issue 40, items 6 and 7)."""
    before = _snapshot(finetune_run["folder"])
    result = _run(finetune_run["command"] + ["--learning_rate", "0.5", "--label_smoothing", "0"],
                  check=False)
    error = _one_line_error(result)
    assert "holds a run made with other flags" in error
    assert "--learning_rate unset there, 0.5 now" in error
    assert "--label_smoothing unset there, 0.0 now" in error
    assert "--run_name" in error and "--overwrite" in error
    assert "is complete" not in result.stdout
    assert _snapshot(finetune_run["folder"]) == before


@pytest.mark.backend_independent("tensorflow")  # where an app starts fastest
def test_rerunning_a_finished_run_may_change_how_much_it_prints(finetune_run):
    before = _snapshot(finetune_run["folder"])
    result = _run(finetune_run["command"] + ["--verbose", "1"])
    assert "is complete" in result.stdout
    assert _snapshot(finetune_run["folder"]) == before


@pytest.mark.backend_independent
def test_the_demo_on_another_backend_trains_its_own_run_not_the_first_ones(finetune_run):
    """`make demo BACKEND=torch` after `make demo`: the default run name carries the backend,
    so the second command trains on its backend instead of reporting the first run (vit_keras
    issue 40, item 6). Written in absl's single-dash form, `-backend=`, which must choose the
    backend as `--backend` does, KERAS_BACKEND naming another (issue 41, item 10)."""
    command = [arg for arg in finetune_run["command"] if arg not in ("--backend", BACKEND)]
    result = _run(command + [f"-backend={OTHER_BACKEND}"], env=_env(KERAS_BACKEND=BACKEND))
    assert "is complete" not in result.stdout
    assert EPOCH_LINE.search(result.stdout)
    folder = os.path.dirname(_saved_model(result.stdout))
    first_name = os.path.basename(finetune_run["folder"])  # ..._BACKEND
    assert os.path.basename(folder) == first_name.removesuffix(BACKEND) + OTHER_BACKEND
    assert RunFolder(folder).read_metrics()["config"]["backend"] == OTHER_BACKEND
    with open(os.path.join(folder, "flags.txt")) as f:
        assert f"--backend={OTHER_BACKEND}\n" in f.read()
    assert RunFolder(finetune_run["folder"]).read_metrics()["config"]["backend"] == BACKEND


@pytest.mark.backend_independent("torch")  # as test_overwrite_starts_a_finished_run_over
def test_a_flagfile_replays_its_backend_whatever_keras_backend_says(replayed_from_flagfile):
    metrics = RunFolder(replayed_from_flagfile["folder"]).read_metrics()
    assert metrics["config"]["backend"] == BACKEND != OTHER_BACKEND


def test_flags_txt_holds_only_the_apps_flags(finetune_run):
    from vit_keras.tools.runs import config_flags, training

    with open(os.path.join(finetune_run["folder"], "flags.txt")) as f:
        lines = f.read().splitlines()
    app_flags = {"backend", *(field.name for field in config_flags.flag_fields(training.RunConfig))}
    written = set()
    for line in lines:
        name = line.split("=", 1)[0].removeprefix("--")
        written.add(name[2:] if name not in app_flags and name.startswith("no") else name)
    assert written and written <= app_flags, sorted(written - app_flags)  # no absl or TF flags
    assert "overwrite" not in written  # replaying the file must not erase the run it describes
    assert f"--backend={BACKEND}" in lines


# --- a killed run resumes where it stopped ---------------------------------------------------

def test_a_run_killed_during_its_final_evaluation_resumes_at_the_evaluation(
        killed_and_resumed_train_run):
    run = killed_and_resumed_train_run
    assert EPOCH_LINE.search(run["first"])  # the first process trained ...
    assert not EPOCH_LINE.search(run["second"]), run["second"][-3000:]  # ... the second did not
    assert "evaluating" in run["second"]
    folder = run["folder"]
    metrics = folder.read_metrics()
    assert metrics["resumed_from_epoch"] == metrics["epochs"] == 1
    assert _history_epochs(folder.path) == ["0"]
    assert not os.path.exists(folder.backup)


def test_resuming_a_killed_run_with_other_flags_is_refused_and_keeps_its_record(
        killed_and_resumed_train_run):
    """Another learning rate, layer decay or LoRA rank would train the remaining epochs of
    another run and rewrite flags.txt; with LoRA, Keras could not even load the backup (vit_keras
    issue 40, item 7). The same command then resumes as if nothing happened."""
    run = killed_and_resumed_train_run
    error = _one_line_error(run["other_flags"])
    for text in ("--layer_decay unset there, 0.5 now", "--learning_rate unset there, 0.03 now",
                 "--lora_rank unset there, 4 now"):
        assert text in error, error
    assert not EPOCH_LINE.search(run["other_flags"].stdout)
    assert run["other_flags_after"] == run["before"]  # flags.txt and the backup as they were
    assert "evaluating" in run["second"]


def test_temporary_files_of_an_interrupted_save_are_removed_on_resume(
        killed_and_resumed_train_run):
    for path in killed_and_resumed_train_run["stale"]:
        assert not os.path.exists(path), path
    assert not [name for name in os.listdir(killed_and_resumed_train_run["folder"].path)
                if ".tmp" in name]


# --- a full disk -----------------------------------------------------------------------------

def _limit_file_size():
    # Writes past 256 KiB fail with EFBIG, as they would with ENOSPC on a full disk (Python
    # ignores SIGXFSZ, so the write returns the error instead of killing the process).
    import resource  # POSIX only

    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


@pytest.mark.backend_independent
@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_full_disk_ends_a_run_with_one_line_naming_the_file(tmp_path):
    """The model of the first epoch (1.8 MB) cannot be written: one line naming it and saying
    what to do, status 2, no traceback and no crash at exit (vit_keras issue 41, item 10)."""
    command = _command("finetune.py", "--backend", BACKEND, *SHORT, "--output_dir",
                       str(tmp_path), "--run_name", "full")
    result = _run(command, check=False, preexec_fn=_limit_file_size)
    error = _one_line_error(result)
    model = RunFolder(tmp_path / "full").model
    assert f"Cannot write {model}: File too large. Free space on its disk" in error
    assert not os.path.exists(model) and not os.path.exists(RunFolder(tmp_path / "full").metrics)
    assert not [name for name in os.listdir(tmp_path / "full") if ".tmp-" in name]


# --- one run per folder ----------------------------------------------------------------------

# The lock and the folder checks are vit_keras.tools.runs.run_folder's, the same on every backend.
@pytest.mark.backend_independent("tensorflow")  # where an app starts fastest
def test_a_second_process_into_a_busy_run_folder_stops_at_once_naming_the_first(tmp_path):
    command = _command("finetune.py", "--backend", BACKEND, *SHORT, "--output_dir",
                       str(tmp_path), "--run_name", "busy")
    lock = RunFolder(tmp_path / "busy").lock
    holder = subprocess.Popen(command, cwd=REPO_ROOT, env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        # Until the lock holds the holder's pid (written once it is locked), then freeze it there.
        while holder.poll() is None and time.monotonic() < deadline:
            if os.path.exists(lock) and f'"pid": {holder.pid}' in open(lock).read():
                break
            time.sleep(0.02)
        assert holder.poll() is None, "the first run ended before it was seen holding the lock"
        os.kill(holder.pid, signal.SIGSTOP)
        second = _run(command, check=False)
    finally:
        holder.kill()
        holder.wait()
    assert f"process {holder.pid}" in _one_line_error(second)
    assert not EPOCH_LINE.search(second.stdout)


# As root, the command runs without the capabilities that let root write into a read-only folder:
# dropped from the bounding set, which a root exec takes its permitted set from.
_AS_WRITE_CHECKED = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for capability in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
    if libc.prctl(24, capability, 0, 0, 0):  # PR_CAPBSET_DROP
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


@pytest.mark.backend_independent("tensorflow")  # where an app starts fastest
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
def test_a_read_only_run_folder_is_a_one_line_error(tmp_path):
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    command = _command("finetune.py", "--backend", BACKEND, *SHORT, "--output_dir",
                       str(tmp_path), "--run_name", "read_only")
    if os.geteuid() == 0:
        command = [sys.executable, "-c", _AS_WRITE_CHECKED, *command[1:]]
    try:
        result = _run(command, check=False)
    finally:
        folder.chmod(0o755)
    assert str(folder) in _one_line_error(result)
