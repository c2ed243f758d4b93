"""`apps/visualize.py` end to end (a model saved on this backend, read on another), and the
figures of `vit_keras.tools.plots`: valid PNGs of the stated sizes."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
from PIL import Image
import pytest

import vit_keras
from vit_keras.inspection import analysis
from vit_keras.tools import plots

from conftest import NEXT_BACKEND, REPO_ROOT, random_images, randomize_weights

APP = os.path.join(REPO_ROOT, "apps", "visualize.py")


def png_size(path):
    """The size of a PNG file, after checking that it is one (signature, then a full decode)."""
    with open(path, "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()
        return image.size


def run_app(*args, backend=None):
    """Runs the app on `backend` (default: this process's one) and returns the finished process."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    backend = backend or keras.backend.backend()
    return subprocess.run([sys.executable, APP, "--backend", backend, *args], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def write_images(directory):
    """A PNG and a JPEG of other sizes than the model's input (the app resizes them)."""
    rng = np.random.default_rng(0)
    paths = [os.path.join(directory, "a.png"), os.path.join(directory, "b.jpg")]
    Image.fromarray(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(paths[0])
    Image.fromarray(rng.integers(0, 255, (20, 50, 3), dtype=np.uint8)).save(paths[1])
    return paths


@pytest.mark.slow
def test_app_writes_every_figure_for_a_model_saved_on_another_backend(tmp_path, tiny_config):
    model = randomize_weights(
        vit_keras.build_model(tiny_config, image_size=(16, 24), num_classes=3))
    model.save(tmp_path / "tiny.keras")
    images = write_images(tmp_path)
    out = tmp_path / "figures"
    # `--images a.png b.jpg`: the second image is a positional argument after the flag.
    result = run_app("--model", str(tmp_path / "tiny.keras"), "--images", images[0], images[1],
                     "--out", str(out), "--num_components", "12", backend=NEXT_BACKEND)
    assert result.returncode == 0, result.stderr
    assert png_size(out / "rollout.png") == (750, 500)
    assert png_size(out / "attention_distance.png") == (500, 400)
    assert png_size(out / "position_embedding_similarity.png") == (600, 500)
    assert png_size(out / "embedding_filters.png") == (700, 450)
    summary = json.loads((out / "analysis.json").read_text())
    assert summary["grid"] == [4, 6] and summary["token_size_pixels"] == [4.0, 4.0]
    assert np.shape(summary["mean_attention_distance"]) == (2, 4)
    assert len(summary["filter_explained_variance"]) == 12


# The app's choice of grid and figures; every backend runs the app above.
@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")
def test_app_uses_the_feature_map_grid_of_a_hybrid_and_skips_its_filters(tmp_path):
    # The ResNet root alone (stride 4) before a patch-size-1 embedding: 32 px → an 8x8 grid.
    vit_keras.build_model(
        {"name": "hybrid", "patch_size": 1, "hidden_size": 16, "mlp_dim": 32, "num_heads": 2,
         "num_layers": 1, "resnet_layers": ()},
        image_size=32, num_classes=3, classifier="gap").save(tmp_path / "hybrid.keras")
    # An earlier run's files in --out: replaced, or deleted where this run writes none.
    (tmp_path / "out").mkdir()
    for name in ("embedding_filters.png", "analysis.json"):
        (tmp_path / "out" / name).write_text("an earlier run's")
    (tmp_path / "out" / "notes.txt").write_text("not the app's")
    result = run_app("--model", str(tmp_path / "hybrid.keras"), "--images",
                     write_images(tmp_path)[0], "--out", str(tmp_path / "out"), "--overwrite")
    assert result.returncode == 0, result.stderr
    assert "skipping the filter figure" in result.stderr
    assert not (tmp_path / "out" / "embedding_filters.png").exists()
    assert (tmp_path / "out" / "notes.txt").read_text() == "not the app's"
    assert not [name for name in os.listdir(tmp_path / "out") if ".tmp-" in name]
    assert png_size(tmp_path / "out" / "rollout.png") == (750, 250)
    summary = json.loads((tmp_path / "out" / "analysis.json").read_text())
    assert summary["grid"] == [8, 8] and summary["token_size_pixels"] == [4.0, 4.0]


@pytest.mark.slow
@pytest.mark.backend_independent  # the image decoder is the same on every backend
def test_app_names_a_corrupt_image_file(tmp_path):
    corrupt = tmp_path / "broken.jpg"
    corrupt.write_bytes(b"\xff\xd8\xff\xe0 this is not really a JPEG")
    result = run_app("--model", "ViT-Ti/16", "--image_size", "32", "--images", str(corrupt),
                     "--out", str(tmp_path / "out"))
    assert result.returncode == 2  # a user error: one `ERROR:` line
    assert f"Cannot read image file {str(corrupt)!r}" in result.stderr
    assert not (tmp_path / "out").exists()


# --- the figures on their own -------------------------------------------------------------------


def test_rollout_figure_has_one_row_per_image(tmp_path):
    images = random_images(3, 16, 24)
    rollout = np.random.default_rng(0).uniform(size=(3, 4, 6))
    path = plots.rollout_figure(images, rollout, str(tmp_path / "r.png"))
    assert png_size(path) == (750, 750)


def test_rollout_figure_shows_grey_images(tmp_path):
    images = random_images(1, 16, 16, channels=1)
    path = plots.rollout_figure(images, np.ones((1, 4, 4)), str(tmp_path / "r.png"), titles=["x"])
    assert png_size(path) == (750, 250)


def test_similarity_and_distance_figures_have_fixed_sizes(tmp_path):
    similarity = analysis.position_embedding_similarity(
        np.random.default_rng(0).normal(size=(1, 3 * 5 + 1, 8)), (3, 5))
    assert png_size(plots.position_similarity_figure(similarity, str(tmp_path / "s.png"))) == (
        600, 500)
    distances = np.random.default_rng(0).uniform(0, 50, size=(12, 16))
    assert png_size(plots.attention_distance_figure(distances, str(tmp_path / "d.png"))) == (
        500, 400)


@pytest.mark.parametrize("channels", [1, 3])
def test_filter_figure_shows_grey_and_rgb_components(tmp_path, channels):
    components, explained = analysis.embedding_filter_components(
        np.random.default_rng(0).normal(size=(4, 4, channels, 40)))
    path = plots.filter_components_figure(components, str(tmp_path / "f.png"), explained=explained)
    assert png_size(path) == (700, 450)


def test_filter_figure_refuses_feature_map_filters(tmp_path):
    with pytest.raises(ValueError, match="8 input channels cannot be shown"):
        plots.filter_components_figure(np.zeros((4, 1, 1, 8)), str(tmp_path / "f.png"))
