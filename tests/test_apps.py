"""End-to-end runs of apps/finetune.py, train.py, evaluate.py and predict.py in subprocesses on the
backend of this pytest process (KERAS_BACKEND)."""

import json
import os
import re
import subprocess
import sys

import keras
import pytest

from conftest import REPO_ROOT, run_killed_after_first_backup, xla_cpu_devices

BACKEND = keras.backend.backend()
# Small enough for a few seconds per epoch on a busy 2-core CPU: ViT-digits at 8 px (4 tokens).
TINY = ["--image_size", "8", "--batch_size", "16", "--steps_per_epoch", "3", "--verbose", "2"]


def _env(**extra):
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "", **extra}


def _app(name, *args, env=None, timeout=600, check=True):
    result = subprocess.run([sys.executable, os.path.join("apps", name), *args], cwd=REPO_ROOT,
                            env=env or _env(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode:
        raise AssertionError(f"{name} {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def _resume_command(output):
    """12 tiny epochs of finetune.py on digits. `--backend` stands last on purpose."""
    return [sys.executable, "apps/finetune.py", *TINY, "--epochs", "12", "--output_dir",
            str(output), "--run_name", "resume", "--backend", BACKEND]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A fine-tuning run killed with SIGKILL after its first backed-up epoch, then started again
    with the same command."""
    output = tmp_path_factory.mktemp("runs")
    command = _resume_command(output)
    run_dir = output / "resume"
    first_output, killed_after = run_killed_after_first_backup(command, run_dir, _env())
    second = subprocess.run(command, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    return {"dir": run_dir, "killed_after": killed_after, "first": first_output,
            "second": second.stdout, "metrics": json.loads((run_dir / "metrics.json").read_text())}


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    """`resumed_run`'s command (in another output folder) run once without interruption."""
    output = tmp_path_factory.mktemp("uninterrupted")
    result = subprocess.run(_resume_command(output), cwd=REPO_ROOT, env=_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return {"dir": output / "resume",
            "metrics": json.loads((output / "resume" / "metrics.json").read_text())}


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_backed_up_epoch(resumed_run):
    killed_after, second = resumed_run["killed_after"], resumed_run["second"]
    assert 1 <= killed_after < 12
    assert f"from its backup after epoch {killed_after} of 12" in second
    epochs_run = [int(n) for n in re.findall(r"^Epoch (\d+)/12$", second, re.M)]
    assert epochs_run == list(range(killed_after + 1, 13))  # nothing before the backup is redone
    assert resumed_run["metrics"]["resumed_from_epoch"] == killed_after
    history = resumed_run["metrics"]["history"]
    assert [row["epoch"] for row in history] == list(range(12))
    assert not (resumed_run["dir"] / "backup").exists()


@pytest.mark.slow
def test_killed_and_resumed_run_reproduces_the_uninterrupted_run_exactly(resumed_run,
                                                                         uninterrupted_run):
    """Bit for bit on all three backends: the input stream is a function of (seed, example
    index), the backup holds weights, optimizer and dropout-generator states, and a training step
    on the CPU is deterministic. The SIGKILL lands after any of the 12 epochs' backups. Equal in
    every run so far: 3 on JAX, 2 on TensorFlow, 2 on torch (plus one by hand on each)."""
    from vit_keras.tools.runs.run_folder import read_history

    resumed = read_history(resumed_run["dir"] / "history.csv")
    reference = read_history(uninterrupted_run["dir"] / "history.csv")
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert [row[key] for row in resumed] == [row[key] for row in reference], key
    for key in ("test_accuracy", "test_loss", "val_accuracy", "val_loss", "train_loss"):
        assert resumed_run["metrics"][key] == uninterrupted_run["metrics"][key], key


@pytest.mark.slow
def test_run_folder_holds_model_metrics_flags_logs_and_curves(resumed_run):
    run_dir, metrics = resumed_run["dir"], resumed_run["metrics"]
    for key in ("test_accuracy", "val_accuracy", "test_loss", "val_loss", "train_loss",
                "images_per_second", "wall_time_s"):
        assert isinstance(metrics[key], float), key
    assert metrics["config"]["backend"] == BACKEND  # --backend was read from the end of argv
    assert metrics["config"]["recipe"]["name"] == "digits"
    assert metrics["config"]["recipe"]["image_size"] == 8
    assert metrics["config"]["jit_compile"] == (BACKEND != "torch")
    assert "--epochs=12" in (run_dir / "flags.txt").read_text()
    assert json.loads((run_dir / "class_names.json").read_text()) == [str(d) for d in range(10)]
    assert (run_dir / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = [f for _, _, files in os.walk(run_dir / "logs") for f in files]
    assert any(f.startswith("events.out.tfevents") for f in events)
    assert "Saved model: " + str(run_dir / "model.keras") in resumed_run["second"]
    assert "| test accuracy" in resumed_run["second"]
    assert not [f for f in os.listdir(run_dir) if ".tmp" in f]
    # 12 short epochs on 4-token images: far from the default run's 97%, but clearly learning.
    # Deterministic for a backend and CPU. Over --seed 0..7 on each backend (24 runs) the test
    # accuracy was 0.36 to 0.59 (mean 0.44, sd 0.07). Chance is 0.1.
    assert metrics["test_accuracy"] > 0.2


@pytest.mark.slow
# The evaluate app's reading of the test split against the run's: every backend's inference of a
# reloaded model is test_user_journeys.py's, so one pass, where an app starts fastest.
@pytest.mark.backend_independent("tensorflow")
def test_reloaded_model_reproduces_the_reported_test_accuracy(resumed_run, tmp_path):
    out = tmp_path / "eval.json"
    _app("evaluate.py", "--backend", BACKEND, "--model", str(resumed_run["dir"] / "model.keras"),
         "--json", str(out))
    report = json.loads(out.read_text())
    assert report["dataset"] == "digits" and report["split"] == "test" and report["count"] == 360
    assert report["accuracy"] == pytest.approx(resumed_run["metrics"]["test_accuracy"], abs=1e-6)
    assert set(report["per_class"]) == {str(d) for d in range(10)}
    assert report["top5_accuracy"] >= report["accuracy"]


@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")  # the app's decoding and listing, as above
def test_predict_lists_top_k_class_names(resumed_run, tmp_path):
    from PIL import Image

    from vit_keras.tools import data

    images, labels = data.digits_arrays()["test"]
    Image.fromarray(images[0]).save(tmp_path / "digit.png")
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    model = str(resumed_run["dir"] / "model.keras")
    result = _app("predict.py", "--backend", BACKEND, "--model", model, "--top_k", "3",
                  str(tmp_path / "digit.png"))
    lines = result.stdout.strip().splitlines()
    assert lines[0].endswith("digit.png")
    assert [re.match(r"\s+\d\. (\d)\s+[\d.]+%", line) is not None for line in lines[1:]] == [
        True] * 3
    bad = _app("predict.py", "--backend", BACKEND, "--model", model, str(tmp_path / "broken.jpg"),
               check=False)
    assert bad.returncode == 2 and "broken.jpg" in bad.stderr


@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")  # absl's --help, before any backend work
@pytest.mark.parametrize("app", ["finetune.py", "train.py", "evaluate.py", "predict.py"])
def test_help_documents_every_flag(app):
    text = _app(app, "--help", check=False).stdout  # absl exits 1 after --help
    expected = {
        "evaluate.py": ["backend", "model", "dataset", "data_dir", "split", "val_fraction", "seed",
                        "batch_size", "json", "overwrite", "resize_only"],
        "predict.py": ["backend", "model", "top_k", "class_names", "json", "overwrite",
                       "resize_only"],
    }
    if app in ("finetune.py", "train.py"):
        from vit_keras.tools.runs import config_flags, training

        names = ["backend", *(field.name for field in config_flags.flag_fields(training.RunConfig))]
    else:
        names = expected[app]
    for name in names:
        match = re.search(rf"^\s+--(\[no\])?{name}: (\S.*)$", text, re.M)
        assert match, f"{app} --help does not document --{name}"


@pytest.mark.slow
@pytest.mark.backend_independent("torch")  # the recipe a flag picks: vit_keras.tools.runs.recipes
def test_train_app_uses_the_pretraining_recipe(tmp_path):
    result = _app("train.py", "--backend", BACKEND, *TINY, "--epochs", "1", "--dataset", "digits",
                  "--recipe", "pretrain", "--warmup_steps", "1", "--output_dir", str(tmp_path))
    assert "recipe pretrain" in result.stdout
    assert re.search(r", 1 epoch of \d+ steps?, ", result.stdout), result.stdout  # not "1 epochs"
    metrics = json.loads((tmp_path / f"train_digits_ViT-digits_{BACKEND}" / "metrics.json")
                         .read_text())
    recipe = metrics["config"]["recipe"]
    assert (recipe["optimizer"], recipe["weight_decay"], recipe["decay"]) == ("adamw", 0.1, "linear")


@pytest.mark.slow
def test_data_parallel_run_on_a_4_device_cpu_mesh(tmp_path):
    flags = [*TINY, "--epochs", "1", "--batch_size", "16", "--distribution", "data_parallel",
             "--output_dir", str(tmp_path), "--run_name", "dp"]
    if BACKEND == "torch":
        result = _app("finetune.py", "--backend", "torch", *flags, check=False)
        assert result.returncode != 0
        assert "no distribution engine for torch" in result.stderr
        return
    if BACKEND == "jax":
        _app("finetune.py", "--backend", "jax", *flags,
             env=_env(XLA_FLAGS=xla_cpu_devices(4)))
    else:
        # MirroredStrategy over 4 logical CPU devices, configured before TensorFlow starts.
        code = (
            "import sys, tensorflow as tf\n"
            "cpu = tf.config.list_physical_devices('CPU')[0]\n"
            "tf.config.set_logical_device_configuration(cpu, "
            "[tf.config.LogicalDeviceConfiguration()] * 4)\n"
            "sys.argv = ['finetune.py', *sys.argv[1:]]\n"
            "sys.path.insert(0, 'apps')\n"
            "import runpy; runpy.run_path('apps/finetune.py', run_name='__main__')\n")
        result = subprocess.run([sys.executable, "-c", code, "--backend", "tensorflow", *flags],
                                cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    metrics = json.loads((tmp_path / "dp" / "metrics.json").read_text())
    assert metrics["config"]["replicas"] == 4
    assert metrics["config"]["distribution"] == "data_parallel"
    assert 0.0 <= metrics["test_accuracy"] <= 1.0 and metrics["num_examples"]["test"] == 360


@pytest.mark.slow
def test_model_parallel_shards_kernels_on_jax_and_is_refused_elsewhere(tmp_path):
    flags = [*TINY, "--epochs", "1", "--distribution", "model_parallel", "--output_dir",
             str(tmp_path), "--run_name", "mp"]
    if BACKEND != "jax":
        result = _app("finetune.py", "--backend", BACKEND, *flags, check=False)
        assert result.returncode != 0
        assert "model_parallel" in result.stderr and "jax" in result.stderr.lower()
        return
    code = (
        "import sys; sys.path.insert(0, 'apps'); sys.argv = ['finetune.py', *sys.argv[1:]]\n"
        "import finetune, keras\n"
        "from vit_keras.tools.runs import recipes\n"
        "original = recipes.compile_model\n"
        "def spy(model, *args, **kwargs):\n"
        "    kernel = model.get_layer('encoderblock_0').mlp.dense_0.kernel\n"
        "    print('SHARDING', len(kernel.value.sharding.device_set),\n"
        "          kernel.value.addressable_shards[0].data.shape)\n"
        "    return original(model, *args, **kwargs)\n"
        "recipes.compile_model = spy\n"
        "from absl import app; app.run(finetune.main)\n")
    result = subprocess.run([sys.executable, "-c", code, "--backend", "jax", *flags],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env=_env(XLA_FLAGS=xla_cpu_devices(4)))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # Dense_0 (64, 128) split over the 4-device model axis: each device holds (64, 32).
    assert "SHARDING 4 (64, 32)" in result.stdout
    metrics = json.loads((tmp_path / "mp" / "metrics.json").read_text())
    assert metrics["config"]["distribution"] == "model_parallel"
