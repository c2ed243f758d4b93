"""The ViT family's releases download by name through the local mirror (no network): a hub
repository's `config.json` and `model.safetensors` at their paths below the hub, fetched, checked,
cached and read as one folder; and `apps/finetune.py --weights dinov2` takes the name.

The synthetic DINOv2-small is full size (22M parameters at 518 px: what `read_release` checks), so
these tests are slow.
"""

import json
import os

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.weights import download, releases

from conftest import run_app
from weights_mirror import MirrorServer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Fetching, checking and caching a hub release is vit_keras.download's (no backend): one pass runs
# the module (`make test`). The family's logits against transformers on every backend are
# test_family_hf.py's; each backend's fine-tuning through the app is test_user_journeys.py's.
pytestmark = pytest.mark.backend_independent("torch")

RELEASE = releases.find_release("ViT-S/14", "dinov2")


@pytest.fixture(scope="module")
def hub_mirror(tmp_path_factory):
    """A mirror of the hub holding a random DINOv2-small folder at `RELEASE`'s paths."""
    root = tmp_path_factory.mktemp("hub")
    config = transformers.Dinov2Config(hidden_size=384, num_hidden_layers=12,
                                       num_attention_heads=6, image_size=518, patch_size=14,
                                       layerscale_value=0.5)
    torch.manual_seed(0)
    folder = root / os.path.dirname(RELEASE.path)
    transformers.Dinov2Model(config).save_pretrained(folder)
    server = MirrorServer(root)
    yield server, str(folder)
    server.stop()


@pytest.fixture
def from_hub_mirror(hub_mirror, monkeypatch, tmp_path):
    server, folder = hub_mirror
    monkeypatch.setenv(download.HOME_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setenv(download.MIRROR_VARIABLE, server.url)
    server.behave()
    del server.requests[:]
    yield server, folder
    server.behave()


@pytest.mark.slow
def test_a_family_release_is_fetched_config_first_cached_and_loaded_by_name(from_hub_mirror,
                                                                              tmp_path):
    server, folder = from_hub_mirror
    model = vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    assert [path for path, _ in server.requests] == ["/" + path for path in RELEASE.files]
    assert model.input_shape == (None, 518, 518, 3) and model.output_shape == (None, 384)
    for path in RELEASE.files:  # cached at the hub's paths
        assert os.path.isfile(tmp_path / "cache" / path)
    reference = vit_keras.build_model_from_checkpoint(folder, include_top=False)
    for got, expected in zip(model.weights, reference.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got),
                                      keras.ops.convert_to_numpy(expected))
    scale = next(w for w in model.weights if "LayerScale_1" in w.path or "layer_scale" in w.path)
    assert np.allclose(keras.ops.convert_to_numpy(scale), 0.5)  # the file's LayerScale, loaded
    vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    assert len(server.requests) == len(RELEASE.files)  # the second build reads the cache


@pytest.mark.slow
def test_a_family_release_normalises_raw_pixels_as_its_weights_were_trained(from_hub_mirror):
    """weights="dinov2" normalises with ImageNet's mean and std, as the hub's image processor for
    DINOv2 does (before, it took (x - 127.5) / 127.5: features off by 0.1 relative)."""
    _, folder = from_hub_mirror
    model = vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    assert model.get_layer("rescale").normalization.name == "imagenet"
    pixels = np.random.default_rng(0).integers(0, 256, (1, 518, 518, 3), dtype=np.uint8)
    processor = transformers.BitImageProcessor(image_mean=[0.485, 0.456, 0.406],
                                               image_std=[0.229, 0.224, 0.225])
    inputs = processor(images=list(pixels), do_resize=False, do_center_crop=False,
                       return_tensors="pt")
    reference = transformers.Dinov2Model.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = reference(inputs["pixel_values"]).pooler_output.numpy()
    got = model.predict(pixels, verbose=0)
    assert np.abs(got - expected).max() / np.abs(expected).max() <= 1e-4


@pytest.mark.slow
def test_finetune_takes_a_family_release_name(from_hub_mirror, tmp_path):
    server, _ = from_hub_mirror
    result = run_app("finetune.py", "--weights", "dinov2", "--model", "ViT-S/14",
                     "--image_size", "28", "--batch_size", "16", "--steps_per_epoch", "1",
                     "--epochs", "1", "--eval_batch_size", "64", "--verbose", "2",
                     "--output_dir", str(tmp_path / "runs"), "--run_name", "dinov2",
                     timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("/" + RELEASE.path, None) in server.requests
    metrics = json.loads((tmp_path / "runs" / "dinov2" / "metrics.json").read_text())
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    model = keras.models.load_model(tmp_path / "runs" / "dinov2" / "model.keras", compile=False)
    assert model.input_shape == (None, 28, 28, 3) and model.output_shape == (None, 10)


@pytest.mark.slow
def test_fewshot_evaluates_a_family_release_as_a_frozen_backbone(from_hub_mirror, tmp_path):
    server, _ = from_hub_mirror
    out = tmp_path / "fewshot.json"
    result = run_app("fewshot.py", "--model", "ViT-S/14", "--weights", "dinov2",
                     "--image_size", "28", "--shots", "1", "--seeds", "1", "--json", str(out),
                     timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("/" + RELEASE.path, None) in server.requests
    report = json.loads(out.read_text())
    assert (report["model"], report["weights"], report["feature_dimension"]) == (
        "ViT-S/14", "dinov2", 384)
    assert 0.0 <= report["results"]["1"]["mean"] <= 1.0


# --- The files of a release are checked against the table, together, before any is cached -------

def _config(folder, **changes):
    with open(os.path.join(folder, "config.json")) as f:
        return json.dumps({**json.load(f), **changes}).encode()


def _cache(tmp_path, path):
    return tmp_path / "cache" / path


def _assert_nothing_cached(tmp_path):
    for path in RELEASE.files:
        assert not os.path.lexists(_cache(tmp_path, path)), path
        assert not os.path.lexists(str(_cache(tmp_path, path)) + ".part"), path


@pytest.mark.slow
def test_a_config_json_of_an_impossible_image_size_is_refused_before_the_weights(from_hub_mirror,
                                                                                 tmp_path):
    """The config is what the error names, the weights are not downloaded for it, nothing is
    cached, and the next call through a good mirror loads."""
    server, folder = from_hub_mirror
    server.serve_instead(RELEASE.config_path, _config(folder, image_size=10 ** 6))
    with pytest.raises(download.InvalidFileError) as refused:
        vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    message = str(refused.value)
    assert f"The file downloaded from {server.url}{RELEASE.config_path} is not a valid" in message
    assert "image_size 1000000 (expected 518)" in message and "not cached" in message, message
    assert [path for path, _ in server.requests] == ["/" + RELEASE.config_path]
    _assert_nothing_cached(tmp_path)
    server.behave()
    model = vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    assert model.output_shape == (None, 384)


@pytest.mark.slow
def test_a_config_json_of_another_epsilon_and_activation_is_refused(from_hub_mirror, tmp_path):
    """transformers reads both from config.json: the weights alone would load, and compute
    other features."""
    server, folder = from_hub_mirror
    server.serve_instead(RELEASE.config_path,
                         _config(folder, layer_norm_eps=0.5, hidden_act="quick_gelu"))
    with pytest.raises(download.InvalidFileError) as refused:
        vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    message = str(refused.value)
    assert "layer_norm_eps 0.5 (expected 1e-06)" in message, message
    assert "hidden_act 'quick_gelu' (expected the exact GELU)" in message, message
    _assert_nothing_cached(tmp_path)


@pytest.mark.slow
def test_a_bad_config_json_in_the_cache_is_named_before_anything_is_downloaded(from_hub_mirror,
                                                                               tmp_path):
    server, folder = from_hub_mirror
    cached = _cache(tmp_path, RELEASE.config_path)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(_config(folder, image_size=10 ** 6))  # cached by an older version
    with pytest.raises(download.InvalidFileError) as refused:
        vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    message = str(refused.value)
    assert f"The cached file {cached} is not a valid '{RELEASE.config_path}'" in message, message
    assert "image_size 1000000 (expected 518)" in message and "Delete it" in message, message
    assert server.requests == []


@pytest.mark.slow
def test_no_file_of_a_release_is_cached_until_all_pass_together(from_hub_mirror, tmp_path):
    server, _ = from_hub_mirror
    server.serve_instead(RELEASE.path, b"\0" * 4096)
    with pytest.raises(download.InvalidFileError) as refused:
        vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    assert f"{server.url}{RELEASE.path} is not a valid" in str(refused.value), refused.value
    _assert_nothing_cached(tmp_path)  # the config.json, good on its own, is not kept either


@pytest.mark.slow
def test_the_hashes_the_hub_publishes_are_checked_for_both_files(from_hub_mirror, tmp_path):
    """The hub sends a small file (config.json) with its git blob sha1 as ETag, and redirects a
    large one to its storage with its sha256 in X-Linked-Etag."""
    server, folder = from_hub_mirror
    server.publish_hashes("hub")
    same_fields = _config(folder) + b"\n"  # what the table can check is the same; the hash is not
    server.serve_instead(RELEASE.config_path, same_fields)
    with pytest.raises(download.InvalidFileError,
                       match=r"git-sha1 is [0-9a-f]{40}, not the [0-9a-f]{40} the server "
                             r"published in ETag"):
        vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    _assert_nothing_cached(tmp_path)
    server.serve_instead(RELEASE.config_path, open(os.path.join(folder, "config.json"),
                                                   "rb").read())
    model = vit_keras.build_model("ViT-S/14", weights="dinov2", include_top=False)
    assert model.output_shape == (None, 384)
    assert [path for path, _ in server.requests][-3:] == [
        "/" + RELEASE.config_path, "/" + RELEASE.path, "/cdn/" + RELEASE.path]
