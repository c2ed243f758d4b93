"""Published weights by name: the release table against timm's, the download cache (resume,
atomicity, offline errors) against a local stand-in for the bucket, and models built from
releases. Nothing here reaches the internet: `weights_mirror.MirrorServer` serves synthetic files
at the official paths and `VIT_KERAS_WEIGHTS_MIRROR` points at it."""

import os
import re
import socket
import time
import urllib.parse

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras import errors
from vit_keras.model import geometry
from vit_keras.weights import download, families, pretrained, releases

from conftest import random_images
from weights_mirror import MirrorServer, write_class_names, write_release

backend_independent = pytest.mark.backend_independent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty weights cache for this test."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(download.HOME_VARIABLE, str(folder))
    return folder


@pytest.fixture
def blob_server(tmp_path, monkeypatch, cache):
    """A mirror serving 3 MB of random bytes at a release's official path."""
    release = releases.find_release("ViT-B/16", "augreg_in21k")
    path = tmp_path / "bucket" / release.path
    path.parent.mkdir(parents=True)
    path.write_bytes(np.random.default_rng(0).bytes(3 << 20))
    server = MirrorServer(tmp_path / "bucket")
    monkeypatch.setenv(download.MIRROR_VARIABLE, server.url)
    yield server, release.path, path.read_bytes()
    server.stop()


# --- The table --------------------------------------------------------------------------------

@backend_independent
def test_every_release_names_a_variant_a_well_formed_url_and_a_consistent_head():
    sizes = {"imagenet2012": 1000, "imagenet21k": 21843, None: None}
    seen = set()
    for release in releases.RELEASES:
        config = vit_keras.VARIANTS[release.variant]
        url = urllib.parse.urlparse(release.url)
        if release.name in releases.PAPER_RELEASE_NAMES:
            assert (url.scheme, url.netloc) == ("https", "storage.googleapis.com"), release
            assert url.path.startswith("/vit_models/") and url.path.endswith(".npz"), release
            assert release.files == (release.path,), release
        elif release.name in releases.BIG_VISION_RELEASE_NAMES:  # big_vision's bucket
            assert (url.scheme, url.netloc) == ("https", "storage.googleapis.com"), release
            assert url.path.startswith("/big_vision/") and url.path.endswith(".npz"), release
            assert release.files == (release.path,), release
        else:  # the family's: a hub repository's weights, with its config.json beside them
            assert (url.scheme, url.netloc) == ("https", "huggingface.co"), release
            assert release.path == f"{release.hf_hub_id}/resolve/main/model.safetensors", release
            assert release.files == (release.path.replace("model.safetensors", "config.json"),
                                     release.path), release
        assert not re.search(r"\s|//", url.path), release
        # PE core's head is its projection into the joint space: features, no class names.
        assert release.num_classes == sizes[release.class_names] or (
            (release.name, release.num_classes, release.class_names) == ("pe_core", 1024, None)
        ), release
        assert release.representation_size in (None, config.hidden_size), release
        assert release.image_size % geometry.pixels_per_token(config) == 0, release
        assert (release.variant, release.name, release.image_size) not in seen, release
        seen.add((release.variant, release.name, release.image_size))
    assert len({r.path for r in releases.RELEASES}) == len(releases.RELEASES)


@backend_independent
def test_the_table_covers_the_original_and_augreg_releases_the_paper_and_its_sequel_published():
    def names(variant):
        return {r.name for r in vit_keras.list_weights(variant)}

    for variant in ("ViT-B/16", "ViT-B/32", "ViT-L/16", "ViT-L/32", "R50+ViT-B/16"):
        assert {"imagenet21k", "imagenet21k+imagenet2012"} <= names(variant), variant
    assert names("ViT-H/14") == {"imagenet21k"}  # the only H/14 file released
    for variant in ("ViT-Ti/16", "ViT-S/16", "ViT-S/32", "ViT-B/16", "ViT-B/32", "ViT-B/8",
                    "ViT-L/16", "R+ViT-Ti/16", "R26+ViT-S/32", "R50+ViT-L/32"):
        assert {"augreg_in21k", "augreg_in21k_ft_in1k"} <= names(variant), variant
    for variant in ("ViT-S/16", "ViT-B/16", "ViT-B/32"):
        assert {r.image_size for r in vit_keras.list_weights(variant)
                if r.name == "augreg_in1k"} == {224, 384}
    assert vit_keras.list_weights("ViT-B_16") == vit_keras.list_weights("ViT-B/16")


@backend_independent
def test_augreg_files_classes_and_sizes_match_timms_default_cfgs():
    from timm.models import get_pretrained_cfg, list_pretrained

    timm_augreg = set()
    for name in list_pretrained():
        cfg = get_pretrained_cfg(name)
        if cfg is not None and cfg.url and "/vit_models/augreg/" in cfg.url:
            timm_augreg.add(cfg.url)
    ours = {r.url for r in releases.RELEASES if r.name.startswith("augreg")}
    assert ours == timm_augreg  # the same 35 files, byte for byte in their names
    for release in releases.RELEASES:
        if not (release.hf_hub_id or "").startswith("timm/") or (
                release.name not in releases.PAPER_RELEASE_NAMES):
            continue
        cfg = get_pretrained_cfg(release.hf_hub_id[len("timm/"):])
        assert cfg is not None, release.hf_hub_id
        if "/vit_models/" in (cfg.url or ""):
            assert cfg.url == release.url, release
        assert cfg.num_classes == release.num_classes, release
        assert cfg.input_size[1:] == (release.image_size, release.image_size), release


@backend_independent
def test_the_family_releases_sizes_and_heads_match_timms_default_cfgs():
    from timm.models import get_pretrained_cfg

    for release in releases.RELEASES:
        if release.name in releases.PAPER_RELEASE_NAMES:
            continue
        (timm_id,) = [hub_id for hub_id in (release.hf_hub_id, *release.other_hub_ids)
                      if hub_id.startswith("timm/")]
        cfg = get_pretrained_cfg(timm_id[len("timm/"):])
        assert cfg is not None and cfg.hf_hub_id in ("timm/", timm_id), release
        if release.name not in releases.BIG_VISION_RELEASE_NAMES:  # NaFlex: any size, 16x16 grid
            assert cfg.input_size[1:] == (release.image_size, release.image_size), release
        if "clip" in timm_id:  # timm's CLIP files keep the projection into the joint space as a head
            assert cfg.num_classes in (512, 768) and release.num_classes is None, release
        else:
            assert (cfg.num_classes or None) == release.num_classes, release
        config = vit_keras.VARIANTS[release.variant]
        assert f"patch{config.patch_size}" in timm_id, release
        sizes = {384: "small", 768: "base", 1024: "large", 1536: "giant", 1152: "so400m"}
        assert sizes[config.hidden_size] in timm_id + " ".join(release.other_hub_ids), release


@backend_independent
def test_each_family_release_states_the_epsilon_and_gelu_its_repository_computes_with():
    """What the release table says is what the loader reads from each repository: transformers'
    config class defaults for its folders, the timm architecture name for timm's."""
    import transformers

    from vit_keras.weights.checkpoints import huggingface, timm

    configs = {"dinov2": transformers.Dinov2Config(),
               "dinov2_reg4": transformers.Dinov2WithRegistersConfig(),
               "siglip_webli": transformers.SiglipVisionConfig(),
               "clip_openai": transformers.CLIPVisionConfig(),
               "siglip2_naflex": transformers.Siglip2VisionConfig()}
    family_releases = releases.FAMILY_RELEASE_NAMES + releases.BIG_VISION_RELEASE_NAMES
    assert set(releases.FAMILY_NUMERICS) == set(family_releases)
    for release in releases.RELEASES:
        if release.name not in family_releases:
            continue
        assert releases.FAMILY_NUMERICS[release.name] == families.by_release(release.name).numerics
        if release.hf_hub_id.startswith("timm/"):
            said = timm.architecture_hints(release.hf_hub_id[len("timm/"):])
        else:
            config = configs[release.name]
            said = huggingface.hints({"model_type": config.model_type,
                                      "layer_norm_eps": config.layer_norm_eps,
                                      "hidden_act": config.hidden_act})
        numerics = releases.FAMILY_NUMERICS[release.name]
        # A family's numerics name the kind of its rotary embeddings, the name says their spec.
        said = {**said, "rope": getattr(said.get("rope"), "kind", None)}
        assert {name: said.get(name) for name in numerics} == numerics, release


@backend_independent
def test_the_family_releases_are_found_by_name_and_by_either_hub_id():
    release = releases.find_release("ViT-S/14", "dinov2")
    assert (release.hf_hub_id, release.image_size, release.num_classes) == (
        "facebook/dinov2-small", 518, None)
    assert releases.release_for_hub_id("timm/vit_small_patch14_dinov2.lvd142m") == release
    assert releases.release_for_hub_id("facebook/dinov2-small") == release
    assert releases.find_release("ViT-B/16", "siglip_webli").classifier == "map"
    assert {r.variant for r in vit_keras.list_weights() if r.name == "clip_openai"} == {
        "ViT-B/16", "ViT-B/32", "ViT-L/14"}
    with pytest.raises(errors.ReleaseNotFoundError, match="ViT-S/14 has no release 'clip_openai'; "
                                                          "its releases are: dinov2, dinov2_reg4"):
        releases.find_release("ViT-S/14", "clip_openai")


@backend_independent
def test_hugging_face_ids_name_the_same_size_patch_and_resolution():
    widths = {"base": 768, "large": 1024, "huge": 1280}
    for release in releases.RELEASES:
        match = re.fullmatch(r"google/vit-(\w+)-patch(\d+)-(\d+)", release.hf_hub_id or "")
        if match:
            config = vit_keras.VARIANTS[release.variant]
            assert widths[match[1]] == config.hidden_size, release
            assert int(match[2]) == config.patch_size and int(match[3]) == release.image_size
            assert release.num_classes == 1000  # the google/ ids in the table carry the 1k head


@backend_independent
def test_a_release_is_found_by_name_at_the_nearest_resolution():
    def size(**kwargs):
        return releases.find_release("ViT-B/16", "imagenet21k+imagenet2012", **kwargs).image_size

    assert size() == 224  # the smallest
    assert (size(image_size=224), size(image_size=384), size(image_size=300)) == (224, 384, 224)
    assert size(image_size=320) == 384 and size(image_size=(256, 512)) == 384  # sqrt(256*512)=362
    assert releases.find_release("ViT-B_32", "imagenet21k+imagenet2012").image_size == 384
    assert releases.release_for_hub_id("google/vit-base-patch16-384").image_size == 384


@backend_independent
def test_a_release_the_variant_does_not_have_lists_the_variants_releases():
    with pytest.raises(errors.ReleaseNotFoundError,
                       match="ViT-Ti/16 has no release 'imagenet21k'; its releases are: "
                             "augreg_in21k, augreg_in21k_ft_in1k"):
        vit_keras.build_model("ViT-Ti/16", weights="imagenet21k")
    with pytest.raises(errors.ReleaseNotFoundError, match="no weights are published for it"):
        releases.find_release("R26+ViT-B/32", "augreg_in21k")


@backend_independent
def test_a_release_name_without_a_variant_is_one_user_error_naming_the_argument():
    with pytest.raises(errors.ReleaseNeedsVariantError,
                       match=re.escape("'augreg_in21k' is a release name: give the variant it is "
                                       "for (variant='ViT-B/16', for example)")):
        vit_keras.build_model_from_checkpoint("augreg_in21k")
    # The apps name their flag instead of the argument, in the same sentence.
    assert "(--model ViT-B/16, for example)" in str(
        errors.ReleaseNeedsVariantError("augreg_in21k", variant_flag="--model"))


@backend_independent
def test_a_name_that_is_neither_a_file_nor_a_release_lists_the_releases():
    with pytest.raises(errors.ReleaseNotFoundError,
                       match="weights='augreg' is neither a file nor a release name; the "
                             "releases are imagenet21k, imagenet21k\\+imagenet2012, "):
        vit_keras.build_model("ViT-Ti/16", weights="augreg")


@backend_independent
def test_a_missing_checkpoint_path_is_a_user_error():
    with pytest.raises(errors.CheckpointNotFoundError, match="No checkpoint at 'missing.npz'"):
        vit_keras.build_model("ViT-Ti/16", weights="missing.npz")


@backend_independent
def test_release_of_checks_weights_without_reading_or_downloading(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("release_of must not download")

    monkeypatch.setattr(download, "fetch", refuse)
    monkeypatch.setattr(download, "fetch_hub", refuse)
    assert pretrained.release_of("augreg_in21k_ft_in1k", "ViT-Ti/16", 384) == \
        releases.find_release("ViT-Ti/16", "augreg_in21k_ft_in1k", 384)
    release = releases.find_release("ViT-B/16", "augreg_in21k")
    assert pretrained.release_of("hf-hub:" + release.hf_hub_id) == release
    assert pretrained.release_of("hf-hub:someone/own-vit") is None
    file = tmp_path / "augreg_in21k"  # a file wins over the release of that name
    file.write_bytes(b"")
    assert pretrained.release_of(str(file)) is None and pretrained.release_of(file) is None
    with pytest.raises(errors.ReleaseNeedsVariantError):
        pretrained.release_of("augreg_in21k")


# --- The download cache ----------------------------------------------------------------------

@backend_independent
def test_a_download_is_cached_and_a_second_call_touches_no_network(blob_server, cache, capsys):
    server, path, content = blob_server
    local = download.fetch(path)
    progress = capsys.readouterr()
    assert progress.out == ""  # stdout is the caller's; the progress goes to stderr
    assert server.url in progress.err and "3.1 / 3.1 MB (100%)" in progress.err
    assert local == download.cache_path(path) and local.startswith(str(cache))
    assert open(local, "rb").read() == content
    assert os.listdir(os.path.dirname(local)) == [os.path.basename(local)]  # no .part left
    server.stop()
    assert download.fetch(path, progress=False) == local
    assert len(server.requests) == 1


@backend_independent
def test_a_download_cut_off_mid_file_is_not_trusted_and_resumes(blob_server, cache):
    server, path, content = blob_server
    server.cut_next_response_after(1 << 20)
    with pytest.raises(download.WeightsUnavailableError, match=r"after 1048576 of 3145728 bytes"):
        download.fetch(path, progress=False)
    assert not os.path.exists(download.cache_path(path))
    assert os.path.getsize(download.cache_path(path) + ".part") == 1 << 20
    local = download.fetch(path, progress=False)
    assert server.requests[-1][1] == "bytes=1048576-"  # only the missing part was asked for
    assert open(local, "rb").read() == content
    assert not os.path.exists(local + ".part")


@backend_independent
def test_a_server_that_ignores_range_restarts_the_download(blob_server, cache):
    server, path, content = blob_server
    server.cut_next_response_after(1 << 20)
    with pytest.raises(download.WeightsUnavailableError):
        download.fetch(path, progress=False)
    server.ignore_range()
    assert open(download.fetch(path, progress=False), "rb").read() == content


@backend_independent
def test_a_mirror_folder_is_read_in_place(tmp_path, monkeypatch, cache):
    path = "vit_models/augreg/example.npz"
    (tmp_path / "vit_models" / "augreg").mkdir(parents=True)
    (tmp_path / path).write_bytes(b"weights")
    monkeypatch.setenv(download.MIRROR_VARIABLE, str(tmp_path))
    assert download.fetch(path) == str(tmp_path / path)
    assert not cache.exists()
    with pytest.raises(download.WeightsUnavailableError, match="has no 'vit_models/x.npz'"):
        download.fetch("vit_models/x.npz")


def _assert_names_where_to_go(message, path, url):
    assert url in message
    assert download.cache_path(path) in message and download.MIRROR_VARIABLE in message


@pytest.mark.slow  # over 5 s alone: out of make test-fast
@backend_independent
def test_an_unreachable_source_fails_within_seconds_with_what_to_do(monkeypatch, cache):
    path = releases.find_release("ViT-B/16", "imagenet21k").path
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there once closed
    monkeypatch.setenv(download.MIRROR_VARIABLE, f"http://127.0.0.1:{port}/")
    started = time.monotonic()
    with pytest.raises(download.WeightsUnavailableError) as refused:
        download.fetch(path)
    assert time.monotonic() - started < 10
    _assert_names_where_to_go(str(refused.value), path, f"http://127.0.0.1:{port}/{path}")

    # A host that accepts the connection and never answers (a black hole, a captive proxy).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setenv(download.MIRROR_VARIABLE, f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(download.WeightsUnavailableError, match="timed out"):
            download.fetch(path)
        assert time.monotonic() - started < 10
    assert not os.path.exists(download.cache_path(path))
    assert not os.path.exists(download.cache_path(path) + ".part")  # nothing arrived, no clutter


@backend_independent
def test_a_missing_file_on_the_server_names_the_url(blob_server):
    server, _, _ = blob_server
    with pytest.raises(download.WeightsUnavailableError, match=r"HTTP 404.*place the file by hand"):
        download.fetch("vit_models/imagenet21k/ViT-X_1.npz")


@backend_independent
def test_the_official_bucket_is_the_default_source(monkeypatch):
    monkeypatch.delenv(download.MIRROR_VARIABLE, raising=False)
    release = releases.find_release("ViT-B/16", "imagenet21k+imagenet2012", image_size=384)
    assert download.url_for(release.path) == release.url
    monkeypatch.setenv(download.MIRROR_VARIABLE, "https://mirror.example/vit")
    assert download.url_for(release.path) == f"https://mirror.example/vit/{release.path}"


# --- Class names -------------------------------------------------------------------------------

@backend_independent
def test_imagenet2012_class_names_ship_in_wordnet_order():
    names = vit_keras.class_names("imagenet2012")
    synsets = vit_keras.weights.labels.imagenet2012_synsets()
    assert len(names) == len(set(synsets)) == 1000 and list(synsets) == sorted(synsets)
    assert names[0] == "tench, Tinca tinca" and names[207] == "golden retriever"
    assert vit_keras.class_names(releases.find_release("ViT-B/16", "augreg_in1k")) == names


@backend_independent
def test_a_release_name_picks_the_class_names_of_its_head():
    for name in releases.RELEASE_NAMES:  # so the name alone, without a variant, decides the list
        assert len({r.class_names for r in releases.RELEASES if r.name == name}) == 1, name
    imagenet2012 = vit_keras.class_names("imagenet2012")
    for name in ("imagenet21k+imagenet2012", "augreg_in21k_ft_in1k", "augreg_in1k"):
        assert vit_keras.class_names(name) == imagenet2012, name
    with pytest.raises(ValueError, match="No class names for 'augreg'; known: imagenet2012, "
                                         "imagenet21k, and the release names imagenet21k, "):
        vit_keras.class_names("augreg")


@backend_independent
def test_imagenet21k_class_names_come_through_the_mirror_and_are_checked(tmp_path, monkeypatch,
                                                                         cache):
    path = write_class_names(tmp_path, "imagenet21k", 21843)
    monkeypatch.setenv(download.MIRROR_VARIABLE, str(tmp_path))
    names = vit_keras.class_names(releases.find_release("ViT-Ti/16", "augreg_in21k"))
    assert len(names) == 21843 and names[5] == "imagenet21k class 5"
    assert vit_keras.class_names("imagenet21k") == vit_keras.class_names("augreg_in21k") == names
    write_class_names(tmp_path, "imagenet21k", 100)
    with pytest.raises(download.InvalidFileError,
                       match=f"{re.escape(path)} .*has 100 names, not the 21843.*Replace it"):
        vit_keras.class_names("imagenet21k")
    assert os.path.exists(path)  # a mirror folder is the user's: never deleted


# --- Models from releases (every backend) ------------------------------------------------------

TINY_RELEASES = [("ViT-Ti/16", "augreg_in21k", 224), ("ViT-Ti/16", "augreg_in21k_ft_in1k", 224),
                 ("ViT-Ti/16", "augreg_in21k_ft_in1k", 384)]


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """The ViT-Ti/16 releases as synthetic files at their official paths, served on 127.0.0.1."""
    root = tmp_path_factory.mktemp("bucket")
    files = {}
    for seed, (variant, name, size) in enumerate(TINY_RELEASES):
        release = releases.find_release(variant, name, size)
        files[release] = write_release(root, release, seed=seed)
    server = MirrorServer(root)
    yield server, files
    server.stop()


@pytest.fixture
def from_bucket(bucket, monkeypatch, cache):
    server, files = bucket
    monkeypatch.setenv(download.MIRROR_VARIABLE, server.url)
    del server.requests[:]
    return server, files


def _logits(model, size, seed=0):
    return keras.ops.convert_to_numpy(model(random_images(2, size, size, seed=seed)))


def test_a_release_decides_image_size_and_classes_and_loads_the_same_weights(from_bucket):
    server, files = from_bucket
    release = releases.find_release("ViT-Ti/16", "augreg_in21k")
    model = vit_keras.build_model("ViT-Ti_16", weights="augreg_in21k")
    assert model.input_shape == (None, 224, 224, 3) and model.output_shape == (None, 21843)
    assert [path for path, _ in server.requests] == ["/" + release.path]
    reference = vit_keras.load_pretrained(
        vit_keras.build_model("ViT-Ti/16", num_classes=21843), files[release])
    np.testing.assert_array_equal(_logits(model, 224), _logits(reference, 224))


def test_image_size_picks_the_releases_file_at_that_resolution(from_bucket):
    server, files = from_bucket
    release = releases.find_release("ViT-Ti/16", "augreg_in21k_ft_in1k", 384)
    model = vit_keras.build_model("ViT-Ti/16", weights="augreg_in21k_ft_in1k", image_size=384)
    assert model.output_shape == (None, 1000)
    assert server.requests[-1][0] == "/" + release.path
    stored = np.load(files[release])["Transformer/posembed_input/pos_embedding"]
    np.testing.assert_array_equal(  # no resampling at the file's own resolution
        keras.ops.convert_to_numpy(model.get_layer("posembed_input").weights[0]), stored)


def test_explicit_image_size_and_classes_resample_the_nearest_file_and_add_a_zero_head(
        from_bucket):
    server, _ = from_bucket
    model = vit_keras.build_model("ViT-Ti/16", weights="augreg_in21k_ft_in1k", image_size=256,
                                  num_classes=10)
    assert server.requests[-1][0].endswith("res_224.npz")  # 224 is nearer to 256 than 384
    assert model.get_layer("posembed_input").weights[0].shape == (1, 1 + 16 * 16, 192)
    assert model.output_shape == (None, 10) and not np.any(_logits(model, 256))
    features = keras.Model(model.input, model.get_layer("head").input)
    assert np.std(keras.ops.convert_to_numpy(features(random_images(2, 256, 256)))) > 1e-3


def test_a_release_file_is_read_once_per_model(from_bucket, monkeypatch):
    from vit_keras.weights.checkpoints import files as checkpoint_files

    vit_keras.build_model("ViT-Ti/16", weights="augreg_in21k")  # downloads and caches the file
    reads = []
    read_npz = checkpoint_files.read_npz
    monkeypatch.setattr(checkpoint_files, "read_npz", lambda path: reads.append(path) or
                        read_npz(path))
    vit_keras.build_model("ViT-Ti/16", weights="augreg_in21k")
    assert len(reads) == 1, reads


def test_build_model_from_checkpoint_takes_a_release_name(from_bucket):
    model = vit_keras.build_model_from_checkpoint("augreg_in21k_ft_in1k", variant="ViT-Ti/16",
                                                  image_size=384)
    assert model.input_shape == (None, 384, 384, 3) and model.output_shape == (None, 1000)
    with pytest.raises(errors.CheckpointError, match="does not hold a ViT-S/16"):
        vit_keras.build_model_from_checkpoint(
            download.fetch(releases.find_release("ViT-Ti/16", "augreg_in21k_ft_in1k").path),
            variant="ViT-S/16")


def test_a_hub_id_loads_through_huggingface_hub_with_its_releases_size(tmp_path, monkeypatch):
    """huggingface_hub's download is replaced by a folder holding what the hub repository holds
    (a timm state dict); the rest (release lookup by hub id, format, logits) is the real path,
    checked against timm's own model as the oracle."""
    import huggingface_hub
    import safetensors.torch
    import timm
    import torch

    hub_id = "timm/vit_tiny_patch16_384.augreg_in21k_ft_in1k"
    torch.manual_seed(0)
    oracle = timm.create_model(hub_id[len("timm/"):].split(".")[0], pretrained=False).eval()
    safetensors.torch.save_file(oracle.state_dict(), str(tmp_path / "model.safetensors"))
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kwargs: asked.append(repo_id) or str(tmp_path))
    model = vit_keras.build_model("ViT-Ti/16", weights="hf-hub:" + hub_id)
    assert asked == [hub_id] and model.input_shape == (None, 384, 384, 3)
    images = random_images(1, 384, 384)
    with torch.no_grad():
        expected = oracle(torch.from_numpy(images / 127.5 - 1).permute(0, 3, 1, 2)).numpy()
    np.testing.assert_allclose(_logits_of(model, images), expected, rtol=1e-4, atol=1e-4)


def _logits_of(model, images):
    return keras.ops.convert_to_numpy(model(images))


# --- The documentation shows the table as it is ------------------------------------------------

def _weights_matrix(names=releases.PAPER_RELEASE_NAMES):
    """The README's tables: a row per variant, a column per release, the resolutions in a cell;
    the paper's releases (the default) or the family's."""
    lines = ["| variant | " + " | ".join(f"`{name}`" for name in names) + " |",
             "|---" * (1 + len(names)) + "|"]
    for variant in dict.fromkeys(r.variant for r in releases.RELEASES if r.name in names):
        sizes = {name: [str(r.image_size) for r in vit_keras.list_weights(variant) if r.name == name]
                 for name in names}
        lines.append(f"| {variant} | " + " | ".join(", ".join(sizes[n]) or "–"
                                                   for n in names) + " |")
    return "\n".join(lines)


_CLASSIC_FAMILY = tuple(name for name in releases.FAMILY_RELEASE_NAMES
                        if name not in releases.ROTARY_RELEASE_NAMES)


def _family_list():
    """The weights page's table of the family's releases: files' repository, pooling, other ids."""
    lines = ["| variant | release | px | classes | pooling | files (`<repository>/resolve/main/`) "
             "| also on the hub |", "|---|---|---|---|---|---|---|"]
    for r in releases.RELEASES:
        if r.name in releases.FAMILY_RELEASE_NAMES:
            lines.append(f"| {r.variant} | `{r.name}` | {r.image_size} | {r.num_classes or '–'} | "
                         f"{r.classifier} | `{r.hf_hub_id}` | "
                         f"{', '.join(f'`{i}`' for i in r.other_hub_ids) or '–'} |")
    return "\n".join(lines)


def _big_vision_list():
    """The weights page's table of big_vision's NaFlex files."""
    lines = ["| variant | release | grid | pooling | file (below `big_vision/`) | also on the hub |",
             "|---|---|---|---|---|---|"]
    for r in releases.RELEASES:
        if r.name in releases.BIG_VISION_RELEASE_NAMES:
            side = r.image_size // vit_keras.VARIANTS[r.variant].patch_size
            lines.append(f"| {r.variant} | `{r.name}` | {side}x{side} | {r.classifier} | "
                         f"`{r.path[len('big_vision/'):]}` | "
                         + ", ".join(f"`{i}`" for i in (r.hf_hub_id, *r.other_hub_ids)) + " |")
    return "\n".join(lines)


def _weights_list():
    """The weights page's table: every file of the paper's releases with its classes, URL path
    and hub id."""
    lines = ["| variant | release | px | classes | pre-logits | file (below `vit_models/`) | "
             "Hugging Face hub |", "|---|---|---|---|---|---|---|"]
    for r in releases.RELEASES:
        if r.name not in releases.PAPER_RELEASE_NAMES:
            continue
        lines.append(f"| {r.variant} | `{r.name}` | {r.image_size} | {r.num_classes} | "
                     f"{r.representation_size or '–'} | `{r.path[len('vit_models/'):]}` | "
                     f"{f'`{r.hf_hub_id}`' if r.hf_hub_id else '–'} |")
    return "\n".join(lines)


@backend_independent
@pytest.mark.parametrize("document, table", [
    ("README.md", _weights_matrix), ("docs/weights.md", _weights_list),
    ("README.md", lambda: _weights_matrix(_CLASSIC_FAMILY)),
    ("docs/weights.md", lambda: _weights_matrix(_CLASSIC_FAMILY)),
    ("docs/weights.md", lambda: _weights_matrix(releases.ROTARY_RELEASE_NAMES)),
    ("docs/weights.md", _family_list), ("docs/weights.md", _big_vision_list)],
    ids=["readme", "weights", "readme_family", "family_matrix", "rotary_matrix", "family_list",
         "big_vision_list"])
def test_the_documented_weights_tables_are_the_release_table(document, table):
    from conftest import REPO_ROOT

    with open(os.path.join(REPO_ROOT, document), encoding="utf-8") as f:
        text = f.read()
    assert table() in text, f"regenerate the table in {document}:\n{table()}"


@backend_independent
def test_a_timm_release_config_naming_an_architecture_of_other_heads_is_refused(tmp_path):
    from vit_keras.weights import release_files  # pylint: disable=import-outside-toplevel

    release = releases.find_release("ViT-S/16", "dinov3")
    path = tmp_path / "config.json"
    path.write_text('{"architecture": "vit_small_patch16_dinov3", "num_features": 384}')
    release_files.check_config(str(path), release)  # its own: accepted
    path.write_text('{"architecture": "vit_base_patch16_dinov3", "num_features": 384}')
    with pytest.raises(errors.CheckpointError, match="is not 384 wide with 6 heads"):
        release_files.check_config(str(path), release)
