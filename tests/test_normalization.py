"""Input normalisation (issue 40): each checkpoint brings its own, and a model built from it with
the default preprocessing takes raw pixels in [0, 255] and gives what the reference gives when it
is called as its users call it: timm with its own data config (`resolve_data_config`), transformers
with the image processor saved beside the weights.

The models are small and random (every parameter randomised, as in test_family_timm.py and
test_family_hf.py), so a wrong mean or std moves the outputs by far more than the tolerance: a
relative error of 1e-4 (max |difference| / max |reference|), float32 on both sides.
"""

import json
import logging

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.model import pixel_normalization as normalization
from vit_keras.weights import families as family_records
from vit_keras.weights import releases
from vit_keras.weights.checkpoints import huggingface
from vit_keras.weights.checkpoints import timm as timm_format

torch = pytest.importorskip("torch")
timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

RTOL = 1e-4
WIDTH = {"embed_dim": 64, "depth": 2, "num_heads": 2, "num_classes": 7}
# timm model (with the pretrained tag whose data config it carries) → small-model overrides.
TIMM_FAMILY = {
    "deit_tiny_distilled_patch16_224.fb_in1k": {"img_size": 32, "patch_size": 8},
    "deit3_small_patch16_224.fb_in22k_ft_in1k": {"img_size": 32, "patch_size": 8},
    "vit_small_patch14_dinov2.lvd142m": {"img_size": 28},
    "vit_small_patch14_reg4_dinov2.lvd142m": {"img_size": 28},
    "vit_base_patch16_siglip_224.webli": {"img_size": 32, "patch_size": 8},
    "vit_base_patch16_clip_224.openai": {"img_size": 32, "patch_size": 8},
    "vit_base_patch16_clip_quickgelu_224.openai": {"img_size": 32, "patch_size": 8},
    "vit_base_patch16_224.mae": {"img_size": 32, "patch_size": 8},
    "vit_base_patch16_224.augreg_in21k_ft_in1k": {"img_size": 32, "patch_size": 8},
}


def relative_error(actual, expected):
    actual = keras.ops.convert_to_numpy(actual)
    assert np.std(expected) > 0.05, "reference outputs are too flat to compare meaningfully"
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def raw_pixels(size, batch=2, seed=0):
    """Whole-number RGB pixels in [0, 255], `(batch, size, size, 3)` uint8."""
    return np.random.default_rng(seed).integers(0, 256, (batch, size, size, 3), dtype=np.uint8)


def randomised_timm_model(name, overrides, seed=0):
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **WIDTH, **overrides)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            is_norm_scale = "norm" in key and key.endswith("weight")
            parameter.copy_(torch.randn_like(parameter) * 0.1 + float(is_norm_scale))
    return model.eval()


def timm_logits(model, pixels):
    """timm as its users call it: pixels scaled to [0, 1] and normalised with the model's own
    data config."""
    config = timm.data.resolve_data_config({}, model=model)
    mean = np.asarray(config["mean"], np.float32)
    std = np.asarray(config["std"], np.float32)
    x = (pixels.astype(np.float32) / 255 - mean) / std
    with torch.no_grad():
        return model(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()


def hub_folder(model, path):
    """The folder timm writes for the hub (`save_for_hf`): model.safetensors and a config.json
    with the architecture, its model arguments and the pretrained config's mean and std."""
    from timm.models import _hub

    _hub.save_for_hf(model, str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=list(TIMM_FAMILY))
def timm_family(request, tmp_path_factory):
    name = request.param
    model = randomised_timm_model(name, TIMM_FAMILY[name])
    folder = hub_folder(model, tmp_path_factory.mktemp("timm_hub"))
    pixels = raw_pixels(TIMM_FAMILY[name]["img_size"])
    return name, model, folder, pixels, timm_logits(model, pixels)


def test_a_timm_hub_folder_equals_timm_with_its_data_config_on_raw_pixels(timm_family):
    _, _, folder, pixels, expected = timm_family
    model = vit_keras.build_model_from_checkpoint(str(folder))  # every argument at its default
    assert relative_error(model.predict(pixels, verbose=0), expected) <= RTOL


@pytest.mark.backend_independent("torch")  # tf.image against PIL; the model's numbers: above
def test_predicts_preprocessing_of_a_timm_hub_folder_is_timms_data_config(timm_family, tmp_path):
    """A raw image through apps/predict.py's preprocessing of the model (its `eval_crop`, read from
    timm's config.json, saved with the model) equals timm's `create_transform` of its data config."""
    from PIL import Image

    from vit_keras.tools import data

    _, model, folder, _, _ = timm_family
    built = vit_keras.build_model_from_checkpoint(str(folder))
    assert vit_keras.ViT.from_config(built.get_config()).eval_crop == built.eval_crop
    config = timm.data.resolve_data_config({}, model=model)
    assert built.eval_crop == (config["crop_pct"], config["interpolation"])
    smooth = Image.fromarray(raw_pixels(40, batch=1)[0]).resize((301, 259), Image.BILINEAR)
    smooth.save(tmp_path / "image.png")
    expected = timm.data.create_transform(**config)(Image.open(tmp_path / "image.png"))
    mean, std = (np.array(config[k], np.float32)[:, None, None] for k in ("mean", "std"))
    expected = ((expected.numpy() * std + mean) * 255).transpose(1, 2, 0)
    # At the data config's size (the pretrained one's: the small model's is not in it).
    found = data.load_image_files([str(tmp_path / "image.png")], config["input_size"][1],
                                  built.eval_crop)[0]
    # PIL rounds to uint8 after each pass (test_data.py: within 1.1 of 255 at 224 and 384).
    assert np.abs(found - expected).max() < 1.5


def test_a_timm_state_dict_with_its_architecture_name_equals_timm_on_raw_pixels(timm_family,
                                                                                tmp_path):
    name, model, _, pixels, expected = timm_family
    path = tmp_path / "model.pth"
    torch.save(model.state_dict(), path)
    built = vit_keras.build_model_from_checkpoint(str(path), timm_architecture=name,
                                                  num_heads=WIDTH["num_heads"])
    assert relative_error(built.predict(pixels, verbose=0), expected) <= RTOL


@pytest.mark.parametrize("name", ["vit_base_patch16_clip_224.openai",
                                  "deit_tiny_distilled_patch16_224.fb_in1k"])
def test_keys_that_identify_the_family_decide_its_normalization(name, tmp_path, caplog):
    model = randomised_timm_model(name, TIMM_FAMILY[name])
    path = tmp_path / "model.pth"
    torch.save(model.state_dict(), path)  # no architecture name, no config.json
    pixels = raw_pixels(TIMM_FAMILY[name]["img_size"])
    with caplog.at_level(logging.WARNING, logger="vit_keras"):
        built = vit_keras.build_model_from_checkpoint(str(path), num_heads=WIDTH["num_heads"])
    assert relative_error(built.predict(pixels, verbose=0), timm_logits(model, pixels)) <= RTOL
    assert "does not say how its pixels were normalised" not in caplog.text


def test_clip_keys_decide_the_epsilon_and_say_the_gelu_is_assumed(tmp_path, caplog):
    """A timm CLIP state dict alone: its keys (norm_pre, no patch bias) say CLIP, so LayerNorm
    epsilon 1e-5 (1e-6 gave a 2.1e-3 relative error, silently); they cannot say quick or exact
    GELU, which one warning says, naming the argument and the app flag."""
    name = "vit_base_patch16_clip_224.openai"
    model = randomised_timm_model(name, TIMM_FAMILY[name])
    path = tmp_path / "clip.pth"
    torch.save(model.state_dict(), path)
    with caplog.at_level(logging.WARNING, logger="vit_keras"):
        checkpoint = vit_keras.weights.checkpoints.read_checkpoint(str(path), num_heads=2)
    assert checkpoint.hints["layer_norm_epsilon"] == 1e-5
    assert "GELU cannot be told from the keys" in caplog.text
    assert "--timm_architecture" in caplog.text
    # The architecture name decides the GELU: OpenAI's quick GELU equals timm's quickgelu model.
    quick = randomised_timm_model("vit_base_patch16_clip_quickgelu_224.openai", TIMM_FAMILY[name])
    torch.save(quick.state_dict(), path)
    pixels = raw_pixels(32)
    built = vit_keras.build_model_from_checkpoint(
        str(path), num_heads=2, timm_architecture="vit_base_patch16_clip_quickgelu_224")
    assert relative_error(built.predict(pixels, verbose=0), timm_logits(quick, pixels)) <= RTOL


def test_a_checkpoint_that_does_not_say_is_built_with_the_papers_and_a_warning(tmp_path, caplog):
    model = randomised_timm_model("vit_base_patch16_224.augreg_in21k_ft_in1k",
                                  {"img_size": 32, "patch_size": 8})
    path = tmp_path / "plain.pth"
    torch.save(model.state_dict(), path)  # plain ViT keys: AugReg (0.5), DINO, MAE (ImageNet) ...
    with caplog.at_level(logging.WARNING, logger="vit_keras"):
        built = vit_keras.build_model_from_checkpoint(str(path), num_heads=2)
    assert built.get_layer("rescale").normalization.name == "inception"
    assert "does not say how its pixels were normalised" in caplog.text
    assert "normalization=" in caplog.text and "--normalization" in caplog.text
    chosen = vit_keras.build_model_from_checkpoint(str(path), num_heads=2,
                                                   normalization="imagenet")
    assert chosen.get_layer("rescale").normalization.name == "imagenet"


def test_timm_name_rules_agree_with_every_timm_pretrained_config_they_claim():
    """The architecture-name table against timm's own pretrained configs (the oracle): every
    tagged name, and every untagged architecture (all of whose tags must agree), that the table
    claims normalises as timm says."""
    import re

    claimed, wrong, by_architecture = 0, [], {}
    for name in timm.list_pretrained():
        if not re.match(r"^(vit_|deit)", name):
            continue
        config = timm.models.get_pretrained_cfg(name)
        expected = normalization.get_normalization((config.mean, config.std))
        by_architecture.setdefault(name.split(".")[0], []).append(expected)
        found = timm_format.normalization_for_name(name)
        if found:
            claimed += 1
            wrong += [] if normalization.NORMALIZATIONS[found].matches(expected) else [name]
    for architecture, expected in by_architecture.items():
        found = timm_format.normalization_for_name(architecture)
        if found and not all(normalization.NORMALIZATIONS[found].matches(e) for e in expected):
            wrong.append(architecture)
    assert not wrong
    assert claimed > 200  # the table covers the family (DeiT, DINOv2, CLIP, SigLIP, AugReg, MAE)


@pytest.mark.backend_independent  # timm's pretrained configs against a table of names
def test_timm_eval_crop_rules_agree_with_every_timm_pretrained_config_they_claim():
    """The architecture-name table of evaluation crops against timm's pretrained configs (the
    oracle): every name a rule claims, tagged, and untagged where all its tags agree, has timm's
    centre crop and interpolation; every rule claims some name."""
    import re

    wrong, by_architecture, claimed = [], {}, set()
    for name in timm.list_pretrained():
        if not re.match(r"^(vit_|deit|eva02_|aimv2_|naflexvit_)", name):
            continue
        config = timm.models.get_pretrained_cfg(name)
        # timm's "squash" and other modes are not a centre crop: no eval_crop reproduces them.
        expected = (config.crop_pct, config.interpolation) if config.crop_mode == "center" else 0
        by_architecture.setdefault(name.split(".")[0], set()).add(expected)
        found = timm_format.eval_crop_for_name(name)
        if found is not None:
            claimed.add(name)
            wrong += [] if found == expected else [name]
    for architecture, expected in by_architecture.items():
        found = timm_format.eval_crop_for_name(architecture)
        if found is not None:
            claimed.add(architecture)
            wrong += [] if expected == {found} else [architecture]
    assert not wrong
    # Every rule of a family's record claims some name of that family, and so does every
    # family-wide crop (vit_keras.weights.families).
    records = family_records.FAMILIES
    idle = [(record.name, pattern) for record in records
            for pattern, crop in record.timm_eval_crops
            if crop is not None and not any(re.search(pattern, name) and
                                            family_records.by_timm_name(name) is record
                                            for name in claimed)]
    idle += [record.name for record in records if record.eval_crop is not None
             and not any(family_records.by_timm_name(name) is record for name in claimed)]
    assert not idle
    families = ("_dinov3", "_dinov2", "^vit_pe_", "^aimv2_", r"\.mae$", "^eva02_", "^deit_",
                "^deit3_", "_clip_", "_siglip", "_rope_", r"\.augreg")
    assert all(any(re.search(family, name) for name in claimed) for family in families)


@pytest.mark.backend_independent("torch")  # the crop a name gives a checkpoint: one pass
def test_a_bare_timm_state_dict_gets_the_eval_crop_of_its_tagged_architecture(tmp_path):
    """Without timm's config.json the architecture name with its pretrained tag says the crop:
    EVA-02-S's MIM weights are evaluated at timm's crop_pct 0.9, bicubic."""
    path = tmp_path / "model.pth"
    torch.save(timm.create_model("eva02_small_patch14_224", pretrained=False, img_size=28,
                                 embed_dim=64, depth=1, num_heads=2).state_dict(), path)
    model = vit_keras.build_model_from_checkpoint(
        str(path), timm_architecture="eva02_small_patch14_224.mim_in22k", num_heads=2)
    assert model.eval_crop == (0.9, "bicubic")


@pytest.mark.parametrize("release", [r for r in releases.RELEASES
                                     if any(i.startswith("timm/") for i in
                                            (r.hf_hub_id or "", *r.other_hub_ids))],
                         ids=lambda r: f"{r.variant}-{r.name}-{r.image_size}")
def test_each_release_normalises_as_timms_pretrained_config_of_the_same_weights(release):
    hub_id = next(i for i in (release.hf_hub_id or "", *release.other_hub_ids)
                  if i.startswith("timm/"))
    config = timm.models.get_pretrained_cfg(hub_id[len("timm/"):])
    assert release.normalization.matches(normalization.get_normalization((config.mean,
                                                                         config.std)))


# --- Hugging Face: the folder's image processor, as transformers' users call it -------------------
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 128, "image_size": 28, "patch_size": 14}
IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def _hf_families():
    """family → (model, the processor its published hub folders hold, what the model outputs)."""
    t = transformers
    return {
        "deit": (lambda: t.DeiTModel(t.DeiTConfig(**SMALL), add_pooling_layer=False),
                 lambda: t.DeiTImageProcessor(**IMAGENET), "deit"),
        "dinov2": (lambda: t.Dinov2Model(t.Dinov2Config(**SMALL, layerscale_value=0.1)),
                   lambda: t.BitImageProcessor(**IMAGENET), "pooled"),
        "clip": (lambda: t.CLIPVisionModel(t.CLIPVisionConfig(**SMALL)),
                 lambda: t.CLIPImageProcessor(), "pooled"),
        "siglip": (lambda: t.SiglipVisionModel(t.SiglipVisionConfig(**SMALL)),
                   lambda: t.SiglipImageProcessor(), "pooled"),
        "vit_mae": (lambda: t.ViTMAEModel(t.ViTMAEConfig(**SMALL, mask_ratio=0.0)),
                    lambda: t.ViTImageProcessor(**IMAGENET), "mae"),
        "vit": (lambda: t.ViTModel(t.ViTConfig(**SMALL), add_pooling_layer=False),
                lambda: t.ViTImageProcessor(), "cls"),
    }


def _randomize(module, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, parameter in module.named_parameters():
            if ("norm" in key or "lambda1" in key) and key.endswith(("weight", "lambda1")):
                value = 1 + 0.1 * torch.randn(parameter.shape, generator=generator)
            elif parameter.ndim >= 2 and "embed" not in key and "token" not in key:
                value = torch.randn(parameter.shape, generator=generator) * parameter[0].numel() ** -0.5
            else:
                value = 0.1 * torch.randn(parameter.shape, generator=generator)
            parameter.copy_(value)
    return module.eval()


def _transformers_features(model, kind, pixel_values):
    with torch.no_grad():
        if kind == "mae":  # increasing noise keeps the patches in order; the class token's output
            noise = torch.arange(4, dtype=torch.float32).expand(len(pixel_values), -1)
            return model(pixel_values, noise=noise).last_hidden_state[:, 0].numpy()
        out = model(pixel_values)
        if kind == "pooled":
            return out.pooler_output.numpy()
        tokens = out.last_hidden_state
        if kind == "deit":  # the mean of the class and distillation tokens, as DeiT pools
            return ((tokens[:, 0] + tokens[:, 1]) / 2).numpy()
        return tokens[:, 0].numpy()


@pytest.fixture(scope="module", params=list(_hf_families()))
def hf_family(request, tmp_path_factory):
    make_model, make_processor, kind = _hf_families()[request.param]
    torch.manual_seed(0)
    model = _randomize(make_model())
    processor = make_processor()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    pixels = raw_pixels(SMALL["image_size"])
    inputs = processor(images=list(pixels), do_resize=False, do_center_crop=False,
                       return_tensors="pt")
    expected = _transformers_features(model, kind, inputs["pixel_values"])
    return request.param, folder, processor, pixels, expected


def test_a_hugging_face_folder_with_its_image_processor_equals_transformers(hf_family, tmp_path):
    family, folder, processor, pixels, expected = hf_family
    with_processor = tmp_path / family
    with_processor.mkdir()
    for item in folder.iterdir():
        (with_processor / item.name).write_bytes(item.read_bytes())
    processor.save_pretrained(with_processor)
    model = vit_keras.build_model_from_checkpoint(str(with_processor), include_top=False)
    assert relative_error(model.predict(pixels, verbose=0), expected) <= RTOL


def test_a_hugging_face_folder_without_a_processor_normalises_as_its_family_publishes(
        hf_family, caplog):
    family, folder, _, pixels, expected = hf_family
    with caplog.at_level(logging.WARNING, logger="vit_keras"):
        model = vit_keras.build_model_from_checkpoint(str(folder), include_top=False)
    if family == "vit":  # Google's ViTs take 0.5, DINO's ImageNet's: the folder must say
        assert "does not say how its pixels were normalised" in caplog.text
    else:
        assert "does not say how its pixels were normalised" not in caplog.text
    assert relative_error(model.predict(pixels, verbose=0), expected) <= RTOL


# (family, its processor as published, its preprocessor_config.json's resizing fields, the
# eval_crop they say): DINOv2's resizes the shorter side to 256 and crops 224, bicubic; ViT's
# resizes to 224 x 224 without a crop (none: vit_keras resizes).
HF_EVAL_CASES = [
    ("dinov2", "BitImageProcessor",
     {"size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224},
      "do_center_crop": True, "resample": 3}, (0.875, "bicubic", "floor")),
    ("vit", "ViTImageProcessor", {"size": {"height": 224, "width": 224}, "resample": 2}, None),
]


@pytest.mark.backend_independent("torch")  # tf.image against transformers; the model: above
@pytest.mark.parametrize("family, processor, fields, expected", HF_EVAL_CASES)
def test_predicts_preprocessing_of_a_hugging_face_folder_is_its_image_processors(
        family, processor, fields, expected, tmp_path):
    """A raw image through the model's `eval_crop`, read from the folder's
    preprocessor_config.json, equals transformers' image processor of that file."""
    from PIL import Image

    from vit_keras.tools import data

    torch.manual_seed(0)
    _hf_families()[family][0]().save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": processor, **IMAGENET, **fields}))
    model = vit_keras.build_model_from_checkpoint(str(tmp_path), include_top=False)
    assert model.eval_crop == expected
    assert vit_keras.ViT.from_config(model.get_config()).eval_crop == expected
    # DINOv2's: the longer side resized to 299 leaves 75 to crop, whose half transformers rounds
    # down (timm: to even, one pixel further). ViT's: enlarged (shrinking, transformers antialiases
    # where vit_keras' bilinear resize does not).
    shape = (352, 301) if expected else (160, 203)
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (shape[0] // 8 + 1, shape[1] // 8 + 1, 3), dtype=np.uint8)
    Image.fromarray(small).resize(shape[::-1], Image.BILINEAR).save(tmp_path / "image.png")
    image = Image.open(tmp_path / "image.png")
    pixels = getattr(transformers, processor)(**fields)(
        images=image, do_rescale=False, do_normalize=False, return_tensors="np")["pixel_values"]
    found = data.load_image_files([str(tmp_path / "image.png")], 224, model.eval_crop)[0]
    # Rounded to uint8 after resizing (as PIL, in test_data.py): within 1.1 of 255 measured.
    assert np.abs(found - pixels[0].transpose(1, 2, 0)).max() < 1.5


@pytest.mark.backend_independent  # JSON read in Python
@pytest.mark.parametrize("fields", [
    {"resample": [3]}, {"resample": True}, {"resample": 1}, {"crop_size": 257},
    {"crop_size": {"height": 224, "width": 200}}, {"size": {"shortest_edge": 10 ** 400}},
    {"size": 256}, {"size": {"height": 256, "width": 256}}, {"do_center_crop": False}])
def test_a_crop_that_vit_keras_does_not_reproduce_is_resized(fields, tmp_path):
    """Lanczos, a crop larger than the image or not square, a size too large for any image, a
    bare number (the processor class's meaning), a squashing resize: no eval_crop, no error."""
    config = {"size": {"shortest_edge": 256}, "crop_size": 224, "do_center_crop": True,
              "resample": 3, **fields}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    assert huggingface.read_eval_crop(str(tmp_path)) is None


# --- The normalisation travels with the model -----------------------------------------------------
def test_the_layer_computes_x_over_255_minus_mean_over_std_per_channel():
    layer = normalization.PixelNormalization(*normalization.NORMALIZATIONS["clip"].for_channels(3))
    pixels = raw_pixels(4).astype("float32")
    clip = normalization.NORMALIZATIONS["clip"]
    expected = (pixels / 255 - np.asarray(clip.mean)) / np.asarray(clip.std)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(pixels)), expected, rtol=1e-5,
                               atol=1e-5)
    assert type(layer).from_config(layer.get_config()).get_config() == layer.get_config()


def test_the_papers_normalization_is_exactly_the_former_rescaling():
    pixels = raw_pixels(4).astype("float32")
    rescaled = keras.layers.Rescaling(1 / 127.5, offset=-1.0)(pixels)
    normalised = normalization.PixelNormalization()(pixels)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(normalised),
                                  keras.ops.convert_to_numpy(rescaled))


def test_the_normalization_is_saved_in_keras_files_and_npz(tmp_path, tiny_config):
    model = vit_keras.build_model(tiny_config, image_size=8, num_classes=3, normalization="clip")
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.get_layer("rescale").normalization.name == "clip"
    vit_keras.save_npz(model, tmp_path / "model.npz")
    rebuilt = vit_keras.build_model_from_checkpoint(str(tmp_path / "model.npz"))
    assert vit_keras.ViT.of(rebuilt).normalization.name == "clip"
    pixels = raw_pixels(8).astype("float32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(rebuilt(pixels)),
                               keras.ops.convert_to_numpy(model(pixels)), rtol=1e-5, atol=1e-6)


def test_an_official_npz_gets_the_original_normalization_without_a_warning(tmp_path, tiny_config,
                                                                           caplog):
    vit_keras.save_npz(vit_keras.build_model(tiny_config, image_size=8, num_classes=3),
                       tmp_path / "paper.npz")
    with caplog.at_level(logging.WARNING, logger="vit_keras"):
        model = vit_keras.build_model_from_checkpoint(str(tmp_path / "paper.npz"))
    assert vit_keras.ViT.of(model).normalization.name == "inception"
    assert "normalised" not in caplog.text


def test_build_model_with_a_checkpoint_file_takes_its_normalization(tmp_path):
    name = "vit_small_patch14_dinov2.lvd142m"
    model = randomised_timm_model(name, {"img_size": 28})
    folder = hub_folder(model, tmp_path / "hub")
    built = vit_keras.build_model(
        {"name": "small", "patch_size": 14, "hidden_size": 64, "mlp_dim": 256, "num_heads": 2,
         "num_layers": 2, "layer_scale_init": 1e-5},
        weights=str(folder / "model.safetensors"), image_size=28, num_classes=7)
    assert vit_keras.ViT.of(built).normalization.name == "imagenet"
    pixels = raw_pixels(28)
    assert relative_error(built.predict(pixels, verbose=0), timm_logits(model, pixels)) <= RTOL


def test_build_model_with_a_checkpoint_file_takes_its_eval_crop_and_family(tmp_path):
    folder = hub_folder(randomised_timm_model("vit_small_patch14_dinov2.lvd142m", {"img_size": 28}),
                        tmp_path / "hub")
    built = vit_keras.build_model(
        {"name": "small", "patch_size": 14, "hidden_size": 64, "mlp_dim": 256, "num_heads": 2,
         "num_layers": 2, "layer_scale_init": 1e-5},
        weights=str(folder / "model.safetensors"), image_size=28, num_classes=7)
    assert built.eval_crop == (1.0, "bicubic")  # timm's pretrained_cfg in its config.json
    assert built.name.startswith("DINOv2")


def test_loading_into_a_model_built_for_other_pixels_warns(tmp_path, caplog):
    model = randomised_timm_model("vit_small_patch14_dinov2.lvd142m", {"img_size": 28})
    folder = hub_folder(model, tmp_path / "hub")
    plain = vit_keras.build_model(
        {"name": "small", "patch_size": 14, "hidden_size": 64, "mlp_dim": 256, "num_heads": 2,
         "num_layers": 2, "layer_scale_init": 1e-5}, image_size=28, num_classes=7)
    with caplog.at_level(logging.WARNING, logger="vit_keras"):
        vit_keras.load_pretrained(plain, str(folder / "model.safetensors"))
    assert "normalization='imagenet'" in caplog.text


def test_a_normalization_without_preprocessing_is_refused(tiny_config):
    with pytest.raises(ValueError, match="needs include_preprocessing=True"):
        vit_keras.build_model(tiny_config, image_size=8, include_preprocessing=False,
                              normalization="imagenet")


@pytest.mark.parametrize("value", ["imagenett", ((0.4, 0.5), (0.5, 0.5)), ((0.5,), (0.0,)),
                                   ((0.5, 0.5), (0.5, 0.5, 0.5))])
def test_a_malformed_normalization_is_refused_with_what_was_expected(value, tiny_config):
    with pytest.raises(ValueError, match="ormali"):
        vit_keras.build_model(tiny_config, image_size=8, normalization=value)


@pytest.mark.backend_independent  # Python floats
@pytest.mark.parametrize("mean,std", [(0.5, 1e-40), (0.5, 1e-300), (1e38, 0.5), (1e38, 1e38),
                                      (1e5, 1e5), (0.5, 1e30)])
def test_a_normalization_that_overflows_or_loses_the_image_in_float32_is_refused(mean, std):
    """Each of these loaded and predicted NaN logits without a word (or an image that float32
    rounding reduced to one value)."""
    with pytest.raises(ValueError, match=r"would overflow or lose the image in float32"):
        normalization.Normalization(mean, std)


@pytest.mark.backend_independent  # Python floats
def test_raw_pixels_and_the_published_normalizations_pass_the_float32_check():
    published = [(known.mean, known.std) for known in normalization.NORMALIZATIONS.values()]
    # A model trained on [0, 255] pixels, one trained on [0, 1] pixels.
    for mean, std in [(0.0, 1 / 255), (0.0, 1.0), *published]:
        normalization.Normalization(mean, std)


@pytest.mark.backend_independent  # JSON and Python floats
@pytest.mark.parametrize("fields", ['"rescale_factor": 1e300, "image_mean": [0.5], '
                                    '"image_std": [0.5]',
                                    '"image_mean": [0.5], "image_std": [1e-42]'])
def test_a_preprocessor_config_that_overflows_float32_is_refused(tmp_path, fields):
    (tmp_path / "preprocessor_config.json").write_text("{" + fields + "}")
    with pytest.raises(vit_keras.errors.CheckpointError,
                       match=r"preprocessor_config.json.*would overflow or lose the image"):
        huggingface.read_normalization(str(tmp_path), "vit")


@pytest.mark.backend_independent  # the npz's arrays, read with NumPy
def test_an_npz_whose_stored_normalization_overflows_float32_is_refused(tmp_path, tiny_config):
    from vit_keras.weights.checkpoints import npz

    model = vit_keras.build_model(tiny_config, image_size=8, num_classes=3, normalization="clip")
    vit_keras.save_npz(model, tmp_path / "model.npz")
    with np.load(tmp_path / "model.npz") as archive:
        arrays = {key: archive[key] for key in archive.files}
    arrays[npz.NORMALIZATION + "std"] = np.array([1e-40, 1e-40, 1e-40])
    np.savez(tmp_path / "hostile.npz", **arrays)
    with pytest.raises(vit_keras.errors.CheckpointError,
                       match=r"hostile.npz.*would overflow or lose the image in float32"):
        npz.read(str(tmp_path / "hostile.npz"))


@pytest.mark.backend_independent  # JSON and Python floats
def test_a_preprocessor_config_number_of_thousands_of_digits_is_refused(tmp_path):
    """Python refuses to read an integer of more than 4,300 digits (a ValueError that escaped as
    a traceback)."""
    (tmp_path / "preprocessor_config.json").write_text(
        '{"image_mean": [0.5], "image_std": [0.5], "rescale_factor": ' + "9" * 5000 + "}")
    with pytest.raises(vit_keras.errors.CheckpointError,
                       match=r"preprocessor_config.json.* number too large"):
        huggingface.read_normalization(str(tmp_path), "vit")


def test_old_models_with_a_rescaling_layer_still_say_their_normalization():
    # Models saved before PixelNormalization normalised with a Rescaling layer named `rescale`;
    # ViT.of reads their normalisation from it when it adopts them.
    from vit_keras.model.vit import _legacy_normalization

    paper = keras.layers.Rescaling(1 / 127.5, offset=-1.0, name="rescale")
    assert _legacy_normalization(paper).name == "inception"
    other = _legacy_normalization(keras.layers.Rescaling(1 / 255.0, name="rescale"))
    assert other.mean == (0.0,) and other.std == (1.0,)


def test_timm_config_json_is_read_as_timm_writes_it(tmp_path):
    model = randomised_timm_model("vit_small_patch14_reg4_dinov2.lvd142m", {"img_size": 28})
    folder = hub_folder(model, tmp_path / "hub")
    found = timm_format.config_beside(str(folder / "model.safetensors"))
    assert found["architecture"] == "vit_small_patch14_reg4_dinov2.lvd142m"
    assert found["num_heads"] == 2 and found["normalization"].name == "imagenet"
    (folder / "config.json").write_text(json.dumps({"architecture": 3, "pretrained_cfg": []}))
    assert timm_format.config_beside(str(folder / "model.safetensors")) == {}


# --- The apps: what a checkpoint file cannot say, as flags ----------------------------------------
@pytest.mark.slow
# The flags reach the converter the same way on every backend; the converted logits against timm
# on every backend are the tests above (in process): one pass.
@pytest.mark.backend_independent("tensorflow")
def test_convert_takes_the_timm_architecture_and_the_normalization_as_flags(tmp_path):
    from conftest import run_app

    quick = randomised_timm_model("vit_base_patch16_clip_quickgelu_224.openai",
                                  {"img_size": 32, "patch_size": 8})
    torch.save(quick.state_dict(), tmp_path / "clip.pth")
    result = run_app("convert.py", "--weights", str(tmp_path / "clip.pth"), "--num_heads", "2",
                     "--timm_architecture", "vit_base_patch16_clip_quickgelu_224",
                     "--out", str(tmp_path / "clip.keras"))
    assert result.returncode == 0, result.stderr
    assert "GELU cannot be told" not in result.stderr
    pixels = raw_pixels(32)
    model = keras.saving.load_model(tmp_path / "clip.keras")
    assert relative_error(model.predict(pixels, verbose=0), timm_logits(quick, pixels)) <= RTOL

    plain = randomised_timm_model("vit_base_patch16_224.mae", {"img_size": 32, "patch_size": 8})
    torch.save(plain.state_dict(), tmp_path / "mae.pth")
    result = run_app("convert.py", "--weights", str(tmp_path / "mae.pth"), "--num_heads", "2",
                     "--normalization", "imagenet", "--out", str(tmp_path / "mae.keras"))
    assert result.returncode == 0, result.stderr
    assert "does not say how its pixels were normalised" not in result.stderr
    model = keras.saving.load_model(tmp_path / "mae.keras")
    assert relative_error(model.predict(pixels, verbose=0), timm_logits(plain, pixels)) <= RTOL
