"""apps/finetune.py --max_num_patches: a NaFlex run on the digits, killed after an epoch and run
again, ends as the uninterrupted run does; its model.keras then takes `naflex_patches` of images
of any shape on the next backend, with only `import vit_keras`."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import vit_keras

from conftest import (
    NEXT_BACKEND,
    REPO_ROOT,
    run_app,
    run_killed_after_first_backup,
    run_on_backend,
    xla_cpu_devices,
)

BACKEND = keras.backend.backend()
# ViT-digits at 8 px (a 2 x 2 grid), buckets of 2 and 4 patches: seconds per epoch.
NAFLEX = ["--image_size", "8", "--max_num_patches", "4", "--naflex_seq_lens", "2,4",
          "--batch_size", "8", "--steps_per_epoch", "3", "--epochs", "4", "--verbose", "2"]


def _command(output):
    return [sys.executable, "apps/finetune.py", *NAFLEX, "--output_dir", str(output),
            "--run_name", "naflex", "--backend", BACKEND]


def _env():
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": ""}


def _run(output):
    result = subprocess.run(_command(output), cwd=REPO_ROOT, env=_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """The command run once through: the run whose model the other tests take."""
    output = tmp_path_factory.mktemp("whole")
    return {"folder": output / "naflex", "output": _run(output)}


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """The command in another folder, SIGKILLed after its first backed-up epoch and started over
    with the same command."""
    output = tmp_path_factory.mktemp("resumed")
    _, killed_after = run_killed_after_first_backup(_command(output), output / "naflex", _env())
    return {"folder": output / "naflex", "second": _run(output), "killed_after": killed_after}


# Where a resumed NaFlex run starts in its buckets is the tf.data pipeline's, the same on every
# backend; each backend's own resumption of `fit` is test_apps.py's killed and resumed run. One
# pass: torch's, where the app runs fastest.
@pytest.mark.slow
@pytest.mark.backend_independent("torch")
def test_a_killed_naflex_run_resumes_to_the_uninterrupted_runs_result(whole_run, resumed_run):
    from vit_keras.tools.runs.run_folder import read_history

    assert "NaFlex: up to 4 patches, buckets 2/4 of 16/8 images" in whole_run["output"]
    assert f"from its backup after epoch {resumed_run['killed_after']} of 4" in resumed_run["second"]
    whole = json.loads((whole_run["folder"] / "metrics.json").read_text())
    resumed = json.loads((resumed_run["folder"] / "metrics.json").read_text())
    assert whole["config"]["naflex"] == {"max_num_patches": 4, "seq_lens": [2, 4],
                                         "batch_sizes": [16, 8]}
    reference = read_history(whole_run["folder"] / "history.csv")
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert [row[key] for row in read_history(resumed_run["folder"] / "history.csv")] == \
            [row[key] for row in reference], key
    for key in ("test_accuracy", "test_loss", "train_loss"):
        assert resumed[key] == whole[key], key
    assert np.isfinite(whole["test_loss"])


@pytest.mark.slow
def test_the_naflex_runs_model_takes_any_images_on_the_next_backend(whole_run, tmp_path):
    """What a user does with the run's model.keras: images of other shapes than the digits'
    squares, through `naflex_patches`, on another backend; the same logits as here."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size, dtype=np.uint8)
              for size in ((8, 8, 3), (5, 17, 3), (30, 6, 3))]
    batch = vit_keras.naflex_patches(images, patch_size=4, max_num_patches=4)
    np.savez(tmp_path / "batch.npz", **batch)
    path = str(whole_run["folder"] / "model.keras")
    model = keras.models.load_model(path)
    here = keras.ops.convert_to_numpy(model(batch))
    found = run_on_backend(NEXT_BACKEND, """
        import sys
        import keras, numpy as np
        import vit_keras
        model = keras.models.load_model(ARGS["path"])
        out = np.asarray(model.predict(dict(np.load(ARGS["batch"])), verbose=0))
        print(json.dumps({"naflex": model.naflex, "out": out.tolist(),
                          "tensorflow": "tensorflow" in sys.modules}))
    """, path=path, batch=str(tmp_path / "batch.npz"))
    assert found["naflex"] and here.shape == (3, 10)
    assert found["tensorflow"] == (NEXT_BACKEND == "tensorflow")
    np.testing.assert_allclose(np.array(found["out"]), here, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.backend_independent  # apps/evaluate.py and predict.py on the pass's own run
def test_evaluate_and_predict_feed_the_naflex_runs_model_its_own_budget(whole_run, tmp_path):
    """Without --max_num_patches both apps take the run's from metrics.json: evaluate.py
    repeats the run's test accuracy, predict.py gives what the model gives the files' patches."""
    from PIL import Image

    from vit_keras.tools.data import naflex

    model_path = str(whole_run["folder"] / "model.keras")
    evaluated = run_app("evaluate.py", "--model", model_path, "--json", str(tmp_path / "e.json"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    metrics = json.loads((whole_run["folder"] / "metrics.json").read_text())
    assert json.loads((tmp_path / "e.json").read_text())["accuracy"] == pytest.approx(
        metrics["test_accuracy"], abs=1e-6)  # of 360 images: 1/360 apart

    files = []
    for index, size in enumerate(((9, 31), (40, 12))):
        files.append(str(tmp_path / f"image{index}.png"))
        Image.fromarray(np.random.default_rng(index).integers(0, 256, (*size, 3), np.uint8)).save(
            files[-1])
    predicted = run_app("predict.py", "--model", model_path, "--top_k", "10", "--json",
                        str(tmp_path / "p.json"), *files)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    found = json.loads((tmp_path / "p.json").read_text())
    model = keras.models.load_model(model_path)
    features = naflex.load_image_files(files, naflex.NaFlexBatching(4, patch_size=4))
    probabilities = keras.ops.convert_to_numpy(keras.ops.softmax(model(features)))
    for file, row in zip(files, probabilities):
        by_class = {int(entry["class"]): entry["probability"] for entry in found[file]}
        np.testing.assert_allclose([by_class[c] for c in range(10)], row, rtol=1e-4, atol=1e-6)

    square = str(tmp_path / "square.keras")
    vit_keras.build_model(dict(name="square", patch_size=4, hidden_size=8, mlp_dim=16, num_heads=1,
                               num_layers=1), image_size=8, num_classes=10).save(square)
    refused = run_app("predict.py", "--model", square, "--max_num_patches", "4", files[0])
    assert refused.returncode == 2 and "--max_num_patches is for NaFlex models" in refused.stderr


# TensorFlow's MirroredStrategy over 2 logical CPU devices, configured before TensorFlow starts.
_MIRRORED = ("import sys, tensorflow as tf\n"
             "cpu = tf.config.list_physical_devices('CPU')[0]\n"
             "tf.config.set_logical_device_configuration(cpu, "
             "[tf.config.LogicalDeviceConfiguration()] * 2)\n"
             "sys.argv = ['finetune.py', *sys.argv[1:]]\n"
             "sys.path.insert(0, 'apps')\n"
             "import runpy; runpy.run_path('apps/finetune.py', run_name='__main__')\n")


@pytest.mark.slow
@pytest.mark.skipif(BACKEND == "torch", reason="Keras has no distribution engine for torch")
def test_a_naflex_run_splits_every_bucket_over_2_devices(whole_run, tmp_path):
    """--distribution data_parallel, the run's first epoch: each bucket's batch rounded down to
    a multiple of the 2 devices (34 tokens: 17 images of 2 patches become 16, 8 of 4 stay 8: the
    single-device run's batches), the validation's last batch (180 images in 256s) padded at
    weight 0. On JAX the epoch equals the single-device run's. TensorFlow's MirroredStrategy
    does not reproduce its one-device run for square models either (test loss 2.2544 against
    2.2592 after 6 steps of ViT-digits), so there the epoch trains and validates, finite."""
    from vit_keras.tools.runs.run_folder import read_history

    command = [*_command(tmp_path), "--tokens_per_batch", "34", "--distribution",
               "data_parallel"]
    command[command.index("--run_name") + 1] = "dp"
    if BACKEND == "tensorflow":
        command[1:2] = ["-c", _MIRRORED]  # apps/finetune.py behind the devices' configuration
    env = {**_env(), "XLA_FLAGS": xla_cpu_devices(2)}
    output, _ = run_killed_after_first_backup(command, tmp_path / "dp", env, timeout=600)
    assert "NaFlex: up to 4 patches, buckets 2/4 of 16/8 images" in output, output[-3000:]
    (found, *_), (whole, *_) = (read_history(run / "history.csv")
                                for run in (tmp_path / "dp", whole_run["folder"]))
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        if BACKEND == "jax":
            assert found[key] == pytest.approx(whole[key], rel=1e-5), key
        else:
            assert np.isfinite(found[key]), key


@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")  # the export runs on TensorFlow whatever trained
def test_the_naflex_runs_model_exports_to_tf_serving_and_litert(whole_run, tmp_path):
    """apps/export.py verifies each artifact on square, wide and tall images; then, as a
    server's client: the SavedModel takes any sequence length up to the run's budget and
    refuses a longer one by name, its bytes signature resizes an image at its own aspect ratio,
    and the LiteRT file takes the budget's length."""
    model_path = str(whole_run["folder"] / "model.keras")
    result = subprocess.run(  # on TensorFlow whatever this pass's backend
        [sys.executable, "apps/export.py", "--model", model_path, "--format", "saved_model",
         "--format", "tflite", "--out", str(tmp_path / "exports"), "--name", "naflex"],
        cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    verified = [line for line in result.stdout.splitlines() if line.startswith("OK ")]
    assert len(verified) == 9 and " at 4x24]" in result.stdout  # 6 SavedModel, 3 LiteRT
    found = run_on_backend("tensorflow", """
        import io
        import keras, numpy as np, tensorflow as tf
        from PIL import Image
        import vit_keras
        from ai_edge_litert.interpreter import Interpreter
        model = keras.models.load_model(ARGS["model"])
        serving = tf.saved_model.load(ARGS["saved_model"])
        image = np.random.default_rng(1).integers(0, 256, (6, 30, 3), np.uint8)
        short = vit_keras.naflex_patches([image], patch_size=4, max_num_patches=3)
        got = serving.signatures["serving_default"](**{k: tf.constant(v) for k, v in short.items()})
        png = io.BytesIO()
        Image.fromarray(image).save(png, format="PNG")
        by_bytes = serving.signatures["serving_bytes"](image_bytes=tf.constant([png.getvalue()]))
        budget = vit_keras.naflex_patches([image], patch_size=4, max_num_patches=4)
        try:
            serving.signatures["serving_default"](**{k: tf.constant(v) for k, v in
                vit_keras.naflex_patches([image], patch_size=4, max_num_patches=5).items()})
            refused = ""
        except tf.errors.InvalidArgumentError as error:
            refused = str(error)
        runner = Interpreter(model_path=ARGS["tflite"]).get_signature_runner("serving_default")
        print(json.dumps({
            "short": [got["logits"].numpy().tolist(), np.asarray(model(short)).tolist()],
            "bytes": [by_bytes["logits"].numpy().tolist(), np.asarray(model(budget)).tolist()],
            "litert": [runner(**budget)["logits"].tolist(), np.asarray(model(budget)).tolist()],
            "refused": refused}))
    """, model=model_path, saved_model=str(tmp_path / "exports" / "naflex" / "1"),
        tflite=str(tmp_path / "exports" / "naflex.tflite"))
    for key in ("short", "bytes", "litert"):
        np.testing.assert_allclose(*found[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert "from 1 to 4 patches" in found["refused"] and "got" in found["refused"]
