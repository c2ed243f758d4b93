"""apps/export.py end to end: models trained on the JAX and torch backends, exported from the
command line, reproduce the logits of the backend that trained them."""

import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import vit_keras

from conftest import REPO_ROOT, run_on_backend

pytestmark = pytest.mark.slow  # trains in subprocesses, then runs apps/export.py in others

CLASS_NAMES = ["cat", "dog", "bird"]
EXPORT_CONFIG = {"name": "tiny", "patch_size": 8, "hidden_size": 32, "mlp_dim": 64, "num_heads": 4,
                 "num_layers": 2}

# Trains a tiny ViT for two epochs on the backend of the subprocess and saves what the training app
# leaves in saved_models/RUN/: model.keras and class_names.json. Prints the trained model's logits.
TRAIN = """
import json, os
import keras, numpy as np, vit_keras
keras.utils.set_random_seed(0)
model = vit_keras.build_model(ARGS["config"], image_size=32, num_classes=3)
model.compile(keras.optimizers.SGD(0.1),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
images = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3)).astype("float32")
model.fit(images, np.arange(16) % 3, batch_size=8, epochs=2, verbose=0)
os.makedirs(ARGS["run_dir"], exist_ok=True)
model.save(os.path.join(ARGS["run_dir"], "model.keras"))
with open(os.path.join(ARGS["run_dir"], "class_names.json"), "w") as f:
    json.dump(ARGS["class_names"], f)
np.save(os.path.join(ARGS["run_dir"], "images.npy"), images)
np.save(os.path.join(ARGS["run_dir"], "logits.npy"), keras.ops.convert_to_numpy(model(images)))
print(json.dumps({"backend": keras.backend.backend()}))
"""


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory):
    """`{backend: run_dir}` for tiny models trained on jax and torch (in parallel subprocesses)."""
    root = tmp_path_factory.mktemp("saved_models")
    runs = {backend: str(root / f"{backend}_run") for backend in ("jax", "torch")}
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        results = pool.map(
            lambda item: run_on_backend(item[0], TRAIN, config=EXPORT_CONFIG, run_dir=item[1],
                                        class_names=CLASS_NAMES),
            runs.items())
        assert [r["backend"] for r in results] == list(runs)
    return runs


def run_app(*args):
    # KERAS_BACKEND=jax on purpose: the app must switch to TensorFlow by itself.
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, os.path.join("apps", "export.py"), *args],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory):
    """A saved model whose logits are NaN, which no export verification can accept."""
    path = str(tmp_path_factory.mktemp("broken") / "model.keras")
    model = vit_keras.build_model(EXPORT_CONFIG, image_size=32, num_classes=3)
    model.get_layer("head").bias.assign(np.full(3, np.nan, "float32"))
    model.save(path)
    return path


@pytest.fixture(scope="module")
def app_runs(trained_runs, broken_model, tmp_path_factory):
    """The command lines under test, run in parallel: `{case: (CompletedProcess, out_dir)}`."""
    out = {case: str(tmp_path_factory.mktemp(case))
           for case in ("jax", "torch", "broken", "dynamic")}
    labels = os.path.join(out["torch"], "labels.txt")
    with open(labels, "w") as f:
        f.write("ant\nbee\ncow\n")
    command_lines = {
        "jax": ["--model", os.path.join(trained_runs["jax"], "model.keras"),
                "--format", "tflite", "--format", "onnx", "--out", out["jax"]],
        "torch": ["--model", os.path.join(trained_runs["torch"], "model.keras"),
                  "--format", "saved_model", "--out", os.path.join(out["torch"], "serving"),
                  "--name", "vit", "--version", "3", "--class_names", labels],
        "broken": ["--model", broken_model, "--format", "onnx", "--out", out["broken"],
                   "--name", "broken"],
        "dynamic": ["--model", os.path.join(trained_runs["jax"], "model.keras"),
                    "--format", "saved_model", "--dynamic_image_size", "--max_image_size", "64",
                    "--out", out["dynamic"], "--name", "any_size"],
    }
    with concurrent.futures.ThreadPoolExecutor(len(command_lines)) as pool:
        results = dict(zip(command_lines, pool.map(lambda a: run_app(*a), command_lines.values())))
    return {case: (results[case], out[case]) for case in command_lines}


def _training_logits(run_dir):
    return (np.load(os.path.join(run_dir, "images.npy")),
            np.load(os.path.join(run_dir, "logits.npy")))


def _assert_matches_training_backend(logits, expected):
    # The exporter's bound: 1e-4 of the largest logit (backends differ by ~1e-7 in float32).
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    np.testing.assert_array_equal(logits.argmax(-1), expected.argmax(-1))


def test_app_exports_a_jax_trained_model_to_litert(trained_runs, app_runs):
    from ai_edge_litert.interpreter import Interpreter

    result, out = app_runs["jax"]
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout and "top-1 agreement 100.0%" in result.stdout, result.stdout
    assert os.path.exists(os.path.join(out, "jax_run.tflite"))
    with open(os.path.join(out, "jax_run.labels.txt")) as f:
        assert f.read().split() == CLASS_NAMES  # from class_names.json beside the model
    images, expected = _training_logits(trained_runs["jax"])
    runner = Interpreter(model_path=os.path.join(out, "jax_run.tflite")).get_signature_runner(
        "serving_default")
    _assert_matches_training_backend(runner(images=images)["logits"], expected)


def test_app_exports_a_jax_trained_model_to_onnx(trained_runs, app_runs):
    import onnxruntime

    result, out = app_runs["jax"]
    assert result.returncode == 0, result.stderr
    assert "[onnxruntime]" in result.stdout, result.stdout
    images, expected = _training_logits(trained_runs["jax"])
    session = onnxruntime.InferenceSession(os.path.join(out, "jax_run.onnx"),
                                           providers=["CPUExecutionProvider"])
    _assert_matches_training_backend(session.run(["logits"], {"images": images})[0], expected)


def test_app_exports_a_torch_trained_model_for_tf_serving(trained_runs, app_runs):
    result, out = app_runs["torch"]
    assert result.returncode == 0, result.stderr
    assert "[serving_default]" in result.stdout and "[serving_bytes (PNG)]" in result.stdout
    path = os.path.join(out, "serving", "vit", "3")
    assert f"Wrote {path}" in result.stdout
    images, expected = _training_logits(trained_runs["torch"])
    outputs = tf.saved_model.load(path).signatures["serving_default"](images=tf.constant(images))
    _assert_matches_training_backend(outputs["logits"].numpy(), expected)
    # --class_names wins over the class_names.json beside the model.
    names = [["ant", "bee", "cow"][i] for i in expected.argmax(-1)]
    assert [n.decode() for n in outputs["top_k_names"].numpy()[:, 0]] == names


def test_app_exits_non_zero_when_the_export_does_not_match_keras(app_runs):
    result, out = app_runs["broken"]
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Export verification failed (onnx)" in result.stderr
    assert "does not reproduce the Keras model" in result.stderr
    assert not os.path.exists(os.path.join(out, "broken.onnx"))


def test_app_exports_a_fixed_size_model_to_serve_any_size(trained_runs, app_runs):
    import keras

    result, out = app_runs["dynamic"]
    assert result.returncode == 0, result.stderr
    for size in ("32x32", "48x24", "16x56"):  # the trained size and two others, both signatures
        assert f"[serving_default at {size}]" in result.stdout
        assert f"[serving_bytes (PNG) at {size}]" in result.stdout
    serving = tf.saved_model.load(os.path.join(out, "any_size", "1")).signatures["serving_default"]
    images, expected = _training_logits(trained_runs["jax"])
    _assert_matches_training_backend(
        serving(images=tf.constant(images))["logits"].numpy(), expected)
    # Another size: the logits of the trained model made dynamic in Keras.
    model = vit_keras.with_dynamic_image_size(
        keras.models.load_model(os.path.join(trained_runs["jax"], "model.keras")))
    wide = np.tile(images[:4], (1, 1, 2, 1))[:, :24, :40]  # 24x40 pixels, 3x5 patches
    np.testing.assert_allclose(serving(images=tf.constant(wide))["logits"].numpy(),
                               keras.ops.convert_to_numpy(model(wide)), rtol=1e-4, atol=1e-5)


def test_app_max_image_size_caps_the_sizes_the_saved_model_serves(app_runs):
    result, out = app_runs["dynamic"]
    assert result.returncode == 0, result.stderr
    serving = tf.saved_model.load(os.path.join(out, "any_size", "1")).signatures["serving_default"]
    assert serving(images=tf.zeros((1, 64, 64, 3)))["logits"].shape == (1, 3)
    for height, width in ((72, 8), (8, 72), (20, 20)):  # over the cap, or not whole patches
        with pytest.raises(tf.errors.InvalidArgumentError, match="multiples of 8 pixels from 8 to "
                                                                 "64"):
            serving(images=tf.zeros((1, height, width, 3)))


# --- an export that exists already --------------------------------------------------------------

def _digests(folder):
    """`{relative path: sha256}` of every file under `folder`."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(
                    f.read()).hexdigest()
    return found


def _assert_one_line_error(result, *expected):
    """Exit status 2 and one `ERROR: ...` line, last on stderr, holding `expected`; no traceback."""
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("ERROR: "), result.stderr
    assert [line for line in lines if "ERROR" in line] == lines[-1:], result.stderr
    for text in expected:
        assert text in lines[-1], lines[-1]


@pytest.fixture(scope="module")
def repeated_runs(trained_runs, app_runs, tmp_path_factory):
    """The jax and torch command lines again, into the folders they wrote: as they were, and with
    --overwrite into copies; and --out naming a file. `{case: (CompletedProcess, out, before)}`,
    `before` the digests of `out` before the run."""
    jax_model = os.path.join(trained_runs["jax"], "model.keras")
    torch_model = os.path.join(trained_runs["torch"], "model.keras")
    jax_out, torch_out = app_runs["jax"][1], app_runs["torch"][1]
    copies = {name: str(tmp_path_factory.mktemp(name)) for name in ("jax_copy", "torch_copy")}
    shutil.copytree(jax_out, copies["jax_copy"], dirs_exist_ok=True)
    shutil.copytree(torch_out, copies["torch_copy"], dirs_exist_ok=True)
    a_file = os.path.join(str(tmp_path_factory.mktemp("file")), "exports.txt")
    with open(a_file, "w") as f:
        f.write("not a folder")
    labels = os.path.join(torch_out, "labels.txt")
    saved_model = ["--format", "saved_model", "--name", "vit", "--version", "3", "--class_names",
                   labels]
    cases = {
        "files_again": (["--model", jax_model, "--format", "tflite", "--format", "onnx", "--out",
                         jax_out], jax_out),
        "version_again": (["--model", torch_model, *saved_model, "--out",
                           os.path.join(torch_out, "serving")], torch_out),
        "files_overwritten": (["--model", jax_model, "--format", "tflite", "--format", "onnx",
                               "--out", copies["jax_copy"], "--overwrite"], copies["jax_copy"]),
        "version_overwritten": (["--model", torch_model, *saved_model, "--out",
                                 os.path.join(copies["torch_copy"], "serving"), "--overwrite"],
                                copies["torch_copy"]),
        "out_is_a_file": (["--model", jax_model, "--format", "onnx", "--out", a_file],
                          os.path.dirname(a_file)),
    }
    before = {case: _digests(out) for case, (_, out) in cases.items()}
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        results = dict(zip(cases, pool.map(lambda case: run_app(*case[0]), cases.values())))
    return {case: (results[case], cases[case][1], before[case]) for case in cases}


def test_a_second_tflite_and_onnx_export_is_refused_with_one_line(repeated_runs):
    result, out, before = repeated_runs["files_again"]
    _assert_one_line_error(result, "jax_run.tflite", "jax_run.onnx", "already exist",
                           "--overwrite")
    assert _digests(out) == before  # nothing written


def test_a_second_export_of_a_saved_model_version_is_refused_with_one_line(repeated_runs):
    result, out, before = repeated_runs["version_again"]
    _assert_one_line_error(result, os.path.join("vit", "3"), "already exists", "--overwrite",
                           "leave out --version")
    assert _digests(out) == before


@pytest.mark.parametrize("case", ["files_overwritten", "version_overwritten"])
def test_overwrite_replaces_an_existing_export_once_verified(repeated_runs, case):
    result, out, before = repeated_runs[case]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK" in result.stdout and "Wrote" in result.stdout
    written = {"files_overwritten": ["jax_run.tflite", "jax_run.onnx"],
               "version_overwritten": [os.path.join("serving", "vit", "3")]}[case]
    for path in written:
        assert f"Wrote {os.path.join(out, path)}\n" in result.stdout, result.stdout
    after = _digests(out)
    assert sorted(after) == sorted(before)  # the same files: replaced, nothing left beside them


def test_an_out_that_is_a_file_is_a_one_line_error(repeated_runs):
    result, out, before = repeated_runs["out_is_a_file"]
    _assert_one_line_error(result, "--out", "exports.txt is a file")
    assert _digests(out) == before


# --- the export folder after a kill, and links planted in it (vit_keras issue 41, items 2, 10) --

@pytest.fixture(scope="module")
def export_folder_runs(trained_runs, tmp_path_factory):
    """Two exports into folders prepared as a kill or a hostile user left them, run in parallel:
    `{case: (CompletedProcess, out, planted)}`.

    - `killed_while_replacing`: version 3 of `vit` moved aside to `3.replaced-PID` by an export
      killed between its two renames (the place of version 3 empty), then the next export.
    - `planted_links`: the labels file and the ONNX file's staging name are links to files
      outside, then an export with --overwrite (the labels there are other class names).
    """
    killed = str(tmp_path_factory.mktemp("killed_while_replacing"))
    aside = os.path.join(killed, "vit", "3.replaced-4242")
    os.makedirs(aside)
    with open(os.path.join(aside, "saved_model.pb"), "w") as f:
        f.write("the version being served")
    linked = str(tmp_path_factory.mktemp("planted_links"))
    outside = str(tmp_path_factory.mktemp("outside"))
    planted = {}
    for name, text in (("jax_run.labels.txt", "ant\nbee\ncow\n"),
                       ("jax_run.onnx.unverified", "someone's file\n")):
        planted[name] = os.path.join(outside, name)
        with open(planted[name], "w") as f:
            f.write(text)
        os.symlink(planted[name], os.path.join(linked, name))
    cases = {
        "killed_while_replacing": ["--model", os.path.join(trained_runs["torch"], "model.keras"),
                                   "--format", "saved_model", "--name", "vit", "--out", killed],
        "planted_links": ["--model", os.path.join(trained_runs["jax"], "model.keras"),
                          "--format", "onnx", "--out", linked, "--overwrite"],
    }
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        results = dict(zip(cases, pool.map(lambda args: run_app(*args), cases.values())))
    return {"killed_while_replacing": (results["killed_while_replacing"], killed, {}),
            "planted_links": (results["planted_links"], linked, planted)}


def test_an_export_killed_while_replacing_a_version_is_repaired_by_the_next(export_folder_runs):
    result, out, _ = export_folder_runs["killed_while_replacing"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The version moved aside is served again, and the new export is the next version.
    assert sorted(os.listdir(os.path.join(out, "vit"))) == ["3", "4"]
    with open(os.path.join(out, "vit", "3", "saved_model.pb")) as f:
        assert f.read() == "the version being served"
    assert f"Wrote {os.path.join(out, 'vit', '4')}\n" in result.stdout


def test_an_export_never_writes_through_a_link_planted_in_its_folder(export_folder_runs):
    result, out, planted = export_folder_runs["planted_links"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(planted["jax_run.labels.txt"]) as f:
        assert f.read() == "ant\nbee\ncow\n"
    with open(planted["jax_run.onnx.unverified"]) as f:
        assert f.read() == "someone's file\n"
    for name in ("jax_run.labels.txt", "jax_run.onnx"):
        assert not os.path.islink(os.path.join(out, name)), name
    with open(os.path.join(out, "jax_run.labels.txt")) as f:
        assert f.read() == "".join(f"{name}\n" for name in CLASS_NAMES)
    assert sorted(os.listdir(out)) == ["jax_run.labels.txt", "jax_run.onnx"]
