"""The ViT family (DeiT, DeiT III, DINOv2 with and without registers, SigLIP, CLIP, MAE) against
timm: small random timm models, every parameter randomised, saved as timm state dicts and read
back through `vit_keras.build_model_from_checkpoint` (issue 34).

The tolerance is a relative error of 1e-4 (max |difference| / max |timm|): float32 on both sides,
summed in different orders; a missing switch (LayerScale, a register, quick GELU, ...) changes
the outputs by orders of magnitude more.
"""

import json

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.model import configs, heads, layers, mlp, norms
from vit_keras.weights.checkpoints import timm as timm_format

from conftest import NEXT_BACKEND, run_app, run_on_backend

torch = pytest.importorskip("torch")
timm = pytest.importorskip("timm")

RTOL = 1e-4
WIDTH = {"embed_dim": 64, "depth": 2, "num_heads": 2, "num_classes": 7}

# timm architecture → the small model's overrides, and the switches vit_keras must infer.
FAMILIES = {
    "deit_tiny_distilled_patch16_224": (
        {"img_size": 32, "patch_size": 8}, {"distillation": True}),
    "deit3_small_patch16_224": (
        {"img_size": 32, "patch_size": 8}, {"layer_scale_init": 1e-5, "posemb_prefix": False}),
    "vit_small_patch14_dinov2": ({"img_size": 28}, {"layer_scale_init": 1e-5}),
    "vit_small_patch14_reg4_dinov2": (
        {"img_size": 28}, {"layer_scale_init": 1e-5, "num_registers": 4, "posemb_prefix": False}),
    "vit_base_patch16_siglip_224": ({"img_size": 32, "patch_size": 8}, {}),
    "vit_base_patch16_clip_quickgelu_224": (
        {"img_size": 32, "patch_size": 8},
        {"pre_norm": True, "patch_bias": False, "gelu": "quick", "layer_norm_epsilon": 1e-5}),
    "vit_base_patch16_clip_224": (
        {"img_size": 32, "patch_size": 8},
        {"pre_norm": True, "patch_bias": False, "layer_norm_epsilon": 1e-5}),
    # MAE fine-tuned as its paper does: mean pooling of the patches, then fc_norm.
    "vit_base_patch16_224.mae": (
        {"img_size": 32, "patch_size": 8, "global_pool": "avg"},
        {"fc_norm": True, "class_token": True}),
}


def relative_error(actual, expected):
    actual = keras.ops.convert_to_numpy(actual)
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def randomised_timm_model(architecture, overrides, seed=0, **kwargs):
    """A small timm model whose every parameter (LayerScale, tokens, norms too) is random."""
    torch.manual_seed(seed)
    return randomised(timm.create_model(architecture, pretrained=False, **WIDTH, **overrides,
                                        **kwargs))


def randomised(model):
    """`model` (a torch module) in eval mode, every parameter normal(0.1), norm scales about 1."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            is_norm_scale = "norm" in name and name.endswith("weight")
            parameter.copy_(torch.randn_like(parameter) * 0.1 + float(is_norm_scale))
    return model.eval()


def images_for(size, seed=0):
    """Normalised images (the models are built without preprocessing), NHWC."""
    return np.random.default_rng(seed).uniform(-1, 1, (2, *size, 3)).astype("float32")


def timm_outputs(model, images):
    with torch.no_grad():
        x = torch.from_numpy(images.transpose(0, 3, 1, 2))
        tokens = model.forward_features(x)
        return {"logits": model(x).numpy(), "tokens": tokens.numpy(),
                "pooled": model.forward_head(tokens, pre_logits=True).numpy()}


def last_tokens(model):
    """The model's `forward_features`: the final LayerNorm's output (the last block's with
    fc_norm, where timm's `norm` is an identity)."""
    names = [layer.name for layer in model.layers]
    last = "encoder_norm" if "encoder_norm" in names else [
        n for n in names if n.startswith("encoderblock_")][-1]
    return keras.Model(model.input, model.get_layer(last).output)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(architecture, state-dict path, images, timm's outputs, expected switches, the loaded
    vit_keras model): one load per family, shared by the tests that only run it."""
    architecture = request.param
    overrides, switches = FAMILIES[architecture]
    model = randomised_timm_model(architecture, overrides)
    path = tmp_path_factory.mktemp("timm") / f"{architecture}.pth"
    torch.save(model.state_dict(), path)
    size = (overrides["img_size"],) * 2
    images = images_for(size)
    return (architecture, str(path), images, timm_outputs(model, images), switches,
            load(str(path), architecture))


def load(path, architecture, **kwargs):
    return vit_keras.build_model_from_checkpoint(
        path, timm_architecture=architecture, num_heads=WIDTH["num_heads"],
        include_preprocessing=False, **kwargs)


def test_logits_match_timm(family):
    _, _, images, expected, _, model = family
    # DeiT distilled: the class and distillation heads averaged, as timm's inference does.
    assert relative_error(model(images), expected["logits"]) <= RTOL


def test_pooled_output_matches_timms_pre_logits(family):
    architecture, path, images, expected, _, _ = family
    model = load(path, architecture, include_top=False)
    assert relative_error(model(images), expected["pooled"]) <= RTOL


def test_last_layer_tokens_match_timms_forward_features(family):
    _, _, images, expected, _, model = family
    tokens = last_tokens(model)(images)
    assert tokens.shape == expected["tokens"].shape  # [cls, dist, registers..., patches]
    assert relative_error(tokens, expected["tokens"]) <= RTOL


def test_switches_are_read_from_the_keys_and_the_architecture_name(family):
    architecture, path, _, _, switches, _ = family
    checkpoint = vit_keras.weights.checkpoints.read_checkpoint(
        path, num_heads=2, timm_architecture=architecture)
    found = vit_keras.weights.checkpoints.architecture(checkpoint)["switches"]
    defaults = {name: getattr(configs.get_config("ViT-B/16"), name) for name in configs.SWITCHES}
    assert found == {**defaults, **switches}


def test_feature_extractor_returns_patch_tokens_without_prefix(family):
    _, _, images, expected, _, model = family
    norm = any(layer.name == "encoder_norm" for layer in model.layers)  # none with fc_norm
    features = vit_keras.build_feature_extractor(model, [-1], output="grid", norm=norm)(images)
    rows = images.shape[1] // model.get_layer("embedding").patch_size
    grid = expected["tokens"][:, -rows * rows:].reshape(2, rows, rows, -1)
    assert relative_error(features, grid) <= RTOL


def test_dinov2_dynamic_image_size_matches_timm():
    # Built at 28 px (2x2 patches of 14), fed 42x56 (3x4): timm resamples bicubic, antialiased.
    architecture = "vit_small_patch14_reg4_dinov2"
    model = randomised_timm_model(architecture, {"img_size": 28}, dynamic_img_size=True)
    state = {k: v for k, v in model.state_dict().items()}
    images = images_for((42, 56), seed=3)
    expected = timm_outputs(model, images)
    keras_model = vit_keras.build_model_from_checkpoint(
        _saved(state, architecture), timm_architecture=architecture, num_heads=2,
        include_preprocessing=False, dynamic_image_size=True)
    assert relative_error(keras_model(images), expected["logits"]) <= RTOL


def _saved(state, name):
    import tempfile  # pylint: disable=import-outside-toplevel

    path = f"{tempfile.mkdtemp()}/{name}.pth"
    torch.save(state, path)
    return path


def test_a_missing_switch_is_a_precise_strict_load_error():
    architecture = "vit_small_patch14_reg4_dinov2"
    overrides, switches = FAMILIES[architecture]
    path = _saved(randomised_timm_model(architecture, overrides).state_dict(), architecture)
    # The model has every switch of the file but LayerScale.
    plain = vit_keras.build_model(
        {"name": "plain", "patch_size": 14, "hidden_size": 64, "mlp_dim": 256, "num_heads": 2,
         "num_layers": 2, **{k: v for k, v in switches.items() if k != "layer_scale_init"}},
        image_size=28, num_classes=7, include_preprocessing=False)
    with pytest.raises(vit_keras.errors.CheckpointError,
                       match=r"unexpected in the checkpoint: Transformer/encoderblock_0/"
                             r"LayerScale_1/scale"):
        vit_keras.load_pretrained(plain, path)


def test_timm_architecture_names_decide_epsilon_gelu_heads_family_and_normalization():
    def hints(name):
        found = timm_format.architecture_hints(name)
        normalization = found.pop("normalization", None)
        found.pop("normalization_source", None)
        found.pop("eval_crop", None)  # its own table's test: tests/test_normalization.py
        return found, normalization and normalization.name

    # Heads by width: a name's heads hold at the width its size has (B: 768, and timm's B+ 896).
    size = {"image_size": (224, 224)}
    assert hints("vit_base_patch16_clip_quickgelu_224.openai") == (
        {"layer_norm_epsilon": 1e-5, "gelu": "quick", "heads_by_width": {768: 12, 896: 14},
         "family": "CLIP", **size}, "clip")
    assert hints("vit_large_patch16_clip_224.laion2b") == (
        {"layer_norm_epsilon": 1e-5, "gelu": "exact", "heads_by_width": {1024: 16},
         "family": "CLIP", **size}, "clip")
    assert hints("deit3_small_patch16_224") == (
        {"layer_norm_epsilon": 1e-6, "gelu": "exact", "heads_by_width": {384: 6},
         "family": "DeiT3", **size}, "imagenet")
    assert hints("vit_base_patch16_224") == (  # the paper's
        {"layer_norm_epsilon": 1e-6, "gelu": "exact", "heads_by_width": {768: 12, 896: 14},
         **size}, None)
    assert hints("vit_base_patch16_224.mae")[0]["family"] == "MAE"
    # Where a name's heads are not its size's; DINOv3's 256 px from its family, not its name.
    assert hints("vit_pe_core_gigantic_patch14_448")[0]["heads_by_width"] == {1536: 16}
    assert hints("aimv2_large_patch14_224")[0]["heads_by_width"] == {1024: 8}
    assert hints("vit_huge_plus_patch16_dinov3.lvd1689m")[0]["heads_by_width"] == {1280: 20}
    assert hints("vit_base_patch16_dinov3")[0]["image_size"] == (256, 256)


def test_timm_config_json_beside_the_file_names_the_architecture(tmp_path):
    model = randomised_timm_model("vit_base_patch16_clip_quickgelu_224",
                                  {"img_size": 32, "patch_size": 8})
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(
        {"architecture": "vit_base_patch16_clip_quickgelu_224", "num_classes": 7}))
    checkpoint = vit_keras.weights.checkpoints.read_checkpoint(
        tmp_path / "pytorch_model.bin", num_heads=2)
    assert checkpoint.hints["gelu"] == "quick"
    assert checkpoint.hints["layer_norm_epsilon"] == 1e-5


def test_timm_config_jsons_model_size_must_fit_the_weights_its_data_size_need_not(tmp_path):
    model = randomised_timm_model("vit_base_patch16_224", {"img_size": 32, "patch_size": 8})
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    # pretrained_cfg's input_size is the data's (timm keeps the name's 224 for a model built
    # smaller): the position embeddings say the model's.
    (tmp_path / "config.json").write_text(json.dumps(
        {"architecture": "vit_base_patch16_224", "pretrained_cfg": {"input_size": [3, 224, 224]},
         "model_args": {"num_heads": 2}}))
    assert vit_keras.build_model_from_checkpoint(tmp_path / "pytorch_model.bin").image_size == (
        32, 32)
    (tmp_path / "config.json").write_text(json.dumps(
        {"architecture": "vit_base_patch16_224", "model_args": {"num_heads": 2, "img_size": 64}}))
    with pytest.raises(vit_keras.errors.CheckpointError,
                       match=r"model_args.img_size\) says the model takes 64x64 images"):
        vit_keras.build_model_from_checkpoint(tmp_path / "pytorch_model.bin")


def test_build_arguments_override_the_configs_epsilon_and_gelu():
    config = {"name": "clip-like", "patch_size": 8, "hidden_size": 32, "mlp_dim": 64,
              "num_heads": 2, "num_layers": 1, "gelu": "quick", "layer_norm_epsilon": 1e-5}
    kept = vit_keras.build_model(config, image_size=16)
    assert kept.get_layer("encoderblock_0").gelu == "quick"
    assert kept.get_layer("encoder_norm").epsilon == pytest.approx(1e-5)
    overridden = vit_keras.build_model(config, image_size=16, gelu="tanh",
                                       layer_norm_epsilon=1e-6)
    assert overridden.get_layer("encoderblock_0").gelu == "tanh"
    assert overridden.get_layer("encoder_norm").epsilon == pytest.approx(1e-6)
    with pytest.warns(DeprecationWarning, match="approximate_gelu.*2027-06-01.*gelu="):
        deprecated = vit_keras.build_model(config, image_size=16, approximate_gelu=True)
    assert deprecated.get_layer("encoderblock_0").gelu == "tanh"
    with pytest.raises(ValueError, match="approximate_gelu=False asks for the exact GELU"), \
            pytest.warns(DeprecationWarning):
        vit_keras.build_model(config, image_size=16, approximate_gelu=False, gelu="tanh")


def test_a_block_config_of_before_gelu_existed_still_loads():
    # .keras files written before `gelu` carry approximate_gelu in their block configs.
    block = layers.TransformerBlock.from_config(
        {"name": "encoderblock_0", "num_heads": 2, "mlp_dim": 8, "approximate_gelu": True})
    assert block.gelu == "tanh"
    mlp = layers.MlpBlock.from_config({"name": "MlpBlock_3", "mlp_dim": 8, "dropout": 0.0,
                                       "approximate_gelu": True})
    assert mlp.gelu == "tanh" and "approximate_gelu" not in mlp.get_config()


def test_a_map_head_config_of_before_specs_still_loads():
    # .keras files written before the specs carry the MAP head's epsilon and GELU flat.
    head = heads.MAPHead.from_config({"name": "MAPHead_0", "num_heads": 2, "mlp_dim": 8,
                                      "layer_norm_epsilon": 1e-5, "gelu": "quick",
                                      "num_prefix_tokens": 1})
    assert head.norm.epsilon == pytest.approx(1e-5) and head.mlp.gelu == "quick"
    assert head.get_config()["norm_spec"] == {"kind": "layer_norm", "epsilon": 1e-5}
    assert "gelu" not in head.get_config() and head.num_prefix_tokens == 1


@pytest.mark.parametrize("layer, shape", [
    (layers.LayerScale(1e-6), (2, 5, 8)),
    (layers.RegisterTokens(3, insert_at=1), (2, 5, 8)),
    (layers.DistillationToken(), (2, 5, 8)),
    (heads.TokenPooling("gap", num_prefix_tokens=2), (2, 5, 8)),
    (heads.MAPHead(2, 16, num_prefix_tokens=1, norm_spec=norms.NormSpec(epsilon=1e-5),
                   mlp_spec=mlp.MlpSpec(gelu="quick")), (2, 5, 8)),
    (layers.TransformerBlock(2, 16, layer_scale_init=0.1, mlp_spec=mlp.MlpSpec(gelu="quick")),
     (2, 5, 8)),
])
def test_new_layers_round_trip_their_config(layer, shape):
    x = np.random.default_rng(0).normal(size=shape).astype("float32")
    out = keras.ops.convert_to_numpy(layer(x))
    clone = type(layer).from_config(layer.get_config())
    clone(x)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(keras.ops.convert_to_numpy(clone(x)), out, rtol=1e-6, atol=1e-6)
    assert clone.get_config() == layer.get_config()


_LOAD_ALL = """
import keras, numpy as np
import vit_keras
errors = {}
for name, (path, images, expected) in ARGS["models"].items():
    out = keras.models.load_model(path).predict(np.load(images), verbose=0)
    errors[name] = float(np.abs(out - np.load(expected)).max() / np.abs(np.load(expected)).max())
print(json.dumps(errors))
"""


@pytest.mark.slow
def test_each_family_saved_as_keras_here_loads_on_the_next_backend(tmp_path):
    models = {}
    for architecture, (overrides, _) in FAMILIES.items():
        state = randomised_timm_model(architecture, overrides).state_dict()
        model = load(_saved(state, architecture), architecture)
        images = images_for((overrides["img_size"],) * 2)
        stem = tmp_path / architecture
        model.save(f"{stem}.keras")
        np.save(f"{stem}.images.npy", images)
        np.save(f"{stem}.expected.npy", keras.ops.convert_to_numpy(model(images)))
        models[architecture] = (f"{stem}.keras", f"{stem}.images.npy", f"{stem}.expected.npy")
    errors = run_on_backend(NEXT_BACKEND, _LOAD_ALL, models=models)
    assert set(errors) == set(FAMILIES)
    assert max(errors.values()) <= RTOL, errors


def test_feature_grid_of_a_dynamic_size_model_leaves_out_registers():
    config = {"name": "reg", "patch_size": 8, "hidden_size": 32, "mlp_dim": 64, "num_heads": 2,
              "num_layers": 1, "num_registers": 4, "posemb_prefix": False}
    model = vit_keras.build_model(config, image_size=16, dynamic_image_size=True)
    images = np.random.default_rng(0).uniform(0, 255, (1, 24, 32, 3)).astype("float32")
    grid = vit_keras.build_feature_extractor(model, [-1], output="grid")(images)
    tokens = vit_keras.build_feature_extractor(model, [-1], output="tokens")(images)
    assert grid.shape == (1, 3, 4, 32)
    grid, tokens = keras.ops.convert_to_numpy(grid), keras.ops.convert_to_numpy(tokens)
    np.testing.assert_allclose(grid.reshape(1, 12, 32), tokens[:, 5:])


UNSUPPORTED = {  # timm model → its overrides, and what the one-line error must name
    "vit_small_patch16_224": ({"img_size": 32, "patch_size": 8, "qk_norm": True}, "qk-norm"),
    "eva02_tiny_patch14_224": ({"img_size": 28, "scale_attn_inner": True},
                               "a norm inside attention"),
}


@pytest.mark.parametrize("architecture", list(UNSUPPORTED))
def test_a_timm_variant_vit_keras_cannot_hold_is_named_in_one_line(architecture, tmp_path):
    overrides, named = UNSUPPORTED[architecture]
    torch.manual_seed(0)
    model = timm.create_model(architecture, pretrained=False, **overrides)
    path = tmp_path / "model.pth"
    torch.save(model.state_dict(), path)
    with pytest.raises(vit_keras.errors.CheckpointError) as error:
        vit_keras.build_model_from_checkpoint(str(path))
    message = str(error.value)
    assert named in message and "does not support" in message and "\n" not in message
    assert "strict=False" not in message  # no advice that cannot help


@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")  # refused from the state dict's keys, before any model
def test_convert_names_an_unsupported_timm_variant_in_one_line(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32,
                              patch_size=8, qk_norm=True)
    path = tmp_path / "qknorm.pth"
    torch.save(model.state_dict(), path)
    result = run_app("convert.py", "--weights", str(path), "--out", str(tmp_path / "out.keras"))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "qk-norm" in errors[0] and "does not support" in errors[0]
    assert "Traceback" not in result.stderr and "difference" not in result.stderr
