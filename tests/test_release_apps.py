"""The apps take a release name wherever `--weights` takes a file: convert.py, build_hybrid.py,
finetune.py and predict.py, against a local mirror of synthetic release files (no network)."""

import json
import os
import re
import time

import keras
import numpy as np
from PIL import Image
import pytest

import vit_keras
from vit_keras.weights import download, releases

from conftest import random_images, run_app
from weights_mirror import MirrorServer, write_release

# What a release name resolves to, downloads, caches and refuses is vit_keras.download's and
# vit_keras.releases' (no backend), and every app starts the same way on each: one pass runs the
# module (`make test`). Loading a checkpoint's weights on each backend is test_checkpoints.py's, and
# each backend's fine-tuning through the app is test_user_journeys.py's.
pytestmark = pytest.mark.backend_independent("torch")

RELEASE = "augreg_in21k_ft_in1k"
# The smallest resolution of each release; images at 32 px take the file nearest to them, this one.
VIT = releases.find_release("ViT-Ti/16", RELEASE)
HYBRID = releases.find_release("R+ViT-Ti/16", "augreg_in21k")  # 21843 classes: not a default


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """A mirror of the bucket holding synthetic files of `VIT` and `HYBRID` at their official paths."""
    root = tmp_path_factory.mktemp("bucket")
    files = {release: write_release(root, release) for release in (VIT, HYBRID)}
    server = MirrorServer(root)
    yield server, files
    server.stop()


@pytest.fixture
def run(monkeypatch, tmp_path):
    """`run(app, mirror_url, *args)`: the app against that mirror, with an empty cache of its own."""
    monkeypatch.setenv(download.HOME_VARIABLE, str(tmp_path / "cache"))

    def run_against(app, url, *args, timeout=300):
        monkeypatch.setenv(download.MIRROR_VARIABLE, url)  # run_app passes os.environ on
        return run_app(app, *args, timeout=timeout)

    return run_against


@pytest.mark.slow
def test_convert_downloads_a_release_by_name(tmp_path, run, mirror):
    server, files = mirror
    out = str(tmp_path / "ti16.keras")
    result = run("convert.py", server.url, "--weights", RELEASE, "--model", "ViT-Ti_16",
                 "--image_size", "32", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("/" + VIT.path, None) in server.requests
    assert os.path.isfile(tmp_path / "cache" / VIT.path)  # cached at the bucket's path
    loaded = keras.models.load_model(out)
    assert loaded.input_shape == (None, 32, 32, 3) and loaded.output_shape == (None, 1000)
    expected = vit_keras.build_model("ViT-Ti/16", weights=files[VIT], image_size=32,
                                     num_classes=1000)
    x = random_images(2, 32, 32)
    logits = keras.ops.convert_to_numpy(expected(x))
    assert np.abs(logits).max() > 0.1  # the loaded head, not a zero one
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loaded(x)), logits, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.slow
def test_a_release_name_needs_the_variant(tmp_path, run, mirror):
    server, _ = mirror
    before = len(server.requests)
    out = tmp_path / "x.keras"
    result = run("convert.py", server.url, "--weights", RELEASE, "--out", str(out))
    assert result.returncode == 2
    assert (f"ERROR: {RELEASE!r} is a release name: give the variant it is for (--model "
            f"ViT-B/16, for example)") in result.stderr
    assert "Traceback" not in result.stderr
    assert len(server.requests) == before and not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--model", "--variant"])
def test_convert_checks_the_variant_given_as_model_or_by_its_old_name(tmp_path, run, mirror,
                                                                       flag):
    """`--variant` is an alias of `--model`: either reaches the check of the file's architecture
    (the ViT-Ti/16 release file is not a ViT-S/16)."""
    server, files = mirror
    out = tmp_path / "x.keras"
    result = run("convert.py", server.url, "--weights", str(files[VIT]), flag, "ViT-S/16",
                 "--out", str(out))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "does not hold a ViT-S/16" in result.stderr and not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--model", "--variant"])
def test_build_hybrid_takes_the_variant_as_model_or_by_its_old_name(tmp_path, run, mirror, flag):
    server, _ = mirror
    result = run("build_hybrid.py", server.url, flag, "ViT-Ti/16", "--out",
                 str(tmp_path / "x.keras"))
    assert result.returncode == 2
    assert "ERROR: --model 'ViT-Ti/16' is not a hybrid; expected one of " in result.stderr


@pytest.mark.slow
def test_build_hybrid_takes_the_release_size_and_classes(tmp_path, run, mirror):
    server, files = mirror
    out = str(tmp_path / "r_ti16.keras")
    result = run("build_hybrid.py", server.url, "--model", "R+ViT-Ti_16", "--weights",
                 "augreg_in21k", "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    # 224 px: the stride-4 root gives 56x56 (x64), 8x8 patches make 7x7 tokens plus the class token.
    assert "224x224 images, 21843 classes; feature map 56x56x64; sequence length 50." \
        in result.stdout
    assert f"weights augreg_in21k ({HYBRID.path} at 224 px)" in result.stdout
    loaded = keras.models.load_model(out)
    assert loaded.input_shape == (None, 224, 224, 3) and loaded.output_shape == (None, 21843)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded.get_layer("head").kernel),
                                  np.load(files[HYBRID])["head/kernel"])


@pytest.mark.slow
def test_finetune_from_a_release_name(tmp_path, run, mirror):
    server, _ = mirror
    result = run("finetune.py", server.url, "--weights", RELEASE, "--model", "ViT-Ti/16",
                 "--image_size", "32", "--batch_size", "16", "--steps_per_epoch", "2",
                 "--epochs", "1", "--eval_batch_size", "64", "--verbose", "2",
                 "--output_dir", str(tmp_path / "runs"), "--run_name", "release")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"fine-tuning {RELEASE}" in result.stdout
    assert ("/" + VIT.path, None) in server.requests
    metrics = json.loads((tmp_path / "runs" / "release" / "metrics.json").read_text())
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    model = keras.models.load_model(tmp_path / "runs" / "release" / "model.keras", compile=False)
    assert model.input_shape == (None, 32, 32, 3) and model.output_shape == (None, 10)


@pytest.mark.slow
def test_predict_names_imagenet_classes(tmp_path, run, mirror):
    server, _ = mirror
    image = tmp_path / "img.png"
    Image.fromarray(random_images(1, 40, 48)[0].astype("uint8")).save(image)
    result = run("predict.py", server.url, "--model", "ViT-Ti/16", "--weights", RELEASE,
                 "--image_size", "32", "--top_k", "3", str(image))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == str(image)
    names = [re.fullmatch(r"\s+\d\. (.+)  [\d.]+%", line) for line in lines[1:]]
    assert len(names) == 3 and all(names), lines
    assert {m.group(1) for m in names} <= set(vit_keras.class_names("imagenet2012"))


@pytest.mark.slow
def test_apps_fail_fast_and_clearly_offline(tmp_path, run):
    """A mirror that does not answer and an empty cache: every app that takes --weights stops
    with status 2 and the message, no traceback."""
    dead = MirrorServer(tmp_path)
    dead.stop()  # the port now refuses connections
    image = tmp_path / "img.png"
    Image.fromarray(random_images(1, 16, 16)[0].astype("uint8")).save(image)
    commands = {
        "convert.py": ["--weights", RELEASE, "--model", "ViT-Ti/16", "--out",
                       str(tmp_path / "x.keras")],
        "build_hybrid.py": ["--model", "R+ViT-Ti/16", "--weights", RELEASE, "--out",
                            str(tmp_path / "y.keras")],
        "finetune.py": ["--weights", RELEASE, "--model", "ViT-Ti/16", "--image_size", "32",
                        "--epochs", "1", "--output_dir", str(tmp_path / "runs")],
        "predict.py": ["--model", "ViT-Ti/16", "--weights", RELEASE, str(image)],
    }
    for app, args in commands.items():
        started = time.perf_counter()
        result = run(app, dead.url, *args, timeout=120)
        seconds = time.perf_counter() - started
        assert result.returncode == 2, (app, result.stdout[-2000:], result.stderr[-3000:])
        assert "ERROR: Could not download " + dead.url in result.stderr, (app, result.stderr)
        assert download.MIRROR_VARIABLE in result.stderr and "Traceback" not in result.stderr
        # A refused connection fails at once: measured 3 to 6 s per app (jax, torch, tensorflow
        # on a busy 2-core CPU), all of it startup. The bound catches a download without a
        # timeout, which waits for minutes.
        assert seconds < 60, (app, seconds)
