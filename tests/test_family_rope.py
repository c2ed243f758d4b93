"""The rotary and gated families (issue 44) against timm and transformers: EVA-02, DINOv3 (with
its SwiGLU H+), DINOv2 giant, RoPE-ViT mixed, Perception Encoder and AIMv2 as small random timm
models, and transformers' `DINOv3ViTModel` and `Aimv2VisionModel` saved with `save_pretrained`,
every parameter randomised, read back through `vit_keras.build_model_from_checkpoint`.

Each is compared at the size it was built for and at another, non-square size (rotary
embeddings follow the input's grid; absolute ones are resampled), with a relative error of 1e-4
(max |difference| / max |reference|): float32 on both sides, summed in different orders.
"""

import json
import os

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.model import configs
from vit_keras.model.position_embeddings import RopeSpec

from conftest import NEXT_BACKEND, run_app, run_on_backend
from test_family_timm import _LOAD_ALL, images_for, randomised, relative_error

torch = pytest.importorskip("torch")
timm = pytest.importorskip("timm")

RTOL = 1e-4
SMALL = {"embed_dim": 64, "depth": 2, "num_heads": 2, "num_classes": 7}

# timm architecture → (its small model's overrides, another image size, the switches vit_keras
# must read from the keys and the name, beside the paper's defaults).
FAMILIES = {
    "eva02_base_patch14_224": (
        {"img_size": 28}, (42, 56),
        {"mlp": "swiglu", "mlp_norm": True, "qkv_bias": "qv", "fc_norm": True, "class_token": True,
         "rope": RopeSpec("axial", ref_grid=(16, 16))}),
    "vit_base_patch16_dinov3": (
        {"img_size": 32, "patch_size": 8}, (24, 40),
        {"position_embedding": "none", "num_registers": 4, "layer_scale_init": 1e-5,
         "class_token": True, "qkv_bias": "none", "layer_norm_epsilon": 1e-5,
         "rope": RopeSpec("dinov3", temperature=100.0, rotate_half=True)}),
    "vit_huge_plus_patch16_dinov3": (
        {"img_size": 32, "patch_size": 8}, (24, 40),
        {"position_embedding": "none", "num_registers": 4, "layer_scale_init": 1e-5,
         "class_token": True, "qkv_bias": "none", "mlp": "swiglu", "layer_norm_epsilon": 1e-5,
         "rope": RopeSpec("dinov3", temperature=100.0, rotate_half=True)}),
    "vit_giant_patch14_dinov2": (  # its packed SwiGLU needs an even hidden width
        {"img_size": 28, "embed_dim": 96}, (42, 56), {"mlp": "swiglu", "layer_scale_init": 1e-5}),
    "vit_base_patch16_rope_mixed_224": (
        {"img_size": 32, "patch_size": 8}, (24, 40),
        {"position_embedding": "none", "layer_scale_init": 1e-5,
         "rope": RopeSpec("mixed", temperature=10.0, xy=True)}),
    "vit_pe_core_base_patch16_224": (
        {"img_size": 32, "patch_size": 8}, (24, 40),
        {"pre_norm": True, "patch_bias": False, "layer_norm_epsilon": 1e-5, "class_token": True,
         "map_num_heads": 8, "map_prefix": True,
         "rope": RopeSpec("axial", grid_offset=1.0, xy=True, ref_grid=(14, 14))}),
    "aimv2_large_patch14_224": (
        {"img_size": 28}, (42, 56),
        {"norm": "rms_norm", "mlp": "swiglu", "qkv_bias": "none", "proj_bias": False,
         "mlp_bias": False, "patch_norm": True, "layer_norm_epsilon": 1e-5}),
}


def timm_model(architecture, overrides, seed=0):
    """A small timm model of any image size (`dynamic_img_size`), every parameter random."""
    torch.manual_seed(seed)
    return randomised(timm.create_model(architecture, pretrained=False, dynamic_img_size=True,
                                        **{**SMALL, **overrides}))


def timm_outputs(model, images):
    with torch.no_grad():
        x = torch.from_numpy(images.transpose(0, 3, 1, 2))
        features = model.forward_features(x)
        return model.forward_head(features).numpy(), model.forward_head(
            features, pre_logits=True).numpy()


def load(path, architecture, **kwargs):
    """The model of a small timm file; it takes normalised images unless `kwargs` say else."""
    return vit_keras.build_model_from_checkpoint(
        path, timm_architecture=architecture, num_heads=SMALL["num_heads"],
        **{"include_preprocessing": False, **kwargs})


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(architecture, state-dict path, built size, other size, {size: (images, timm's logits,
    timm's pooled features)})."""
    architecture = request.param
    overrides, other, _ = FAMILIES[architecture]
    model = timm_model(architecture, overrides)
    path = tmp_path_factory.mktemp("timm") / f"{architecture}.pth"
    torch.save(model.state_dict(), path)
    built = (overrides["img_size"],) * 2
    outputs = {}
    for size in (built, other):
        images = images_for(size, seed=len(outputs))
        outputs[size] = (images, *timm_outputs(model, images))
    return architecture, str(path), built, other, outputs


def test_logits_and_pooled_features_match_timm_at_the_built_size(family):
    architecture, path, built, _, outputs = family
    images, logits, pooled = outputs[built]
    model = load(path, architecture, image_size=built)
    assert relative_error(model(images), logits) <= RTOL
    features = load(path, architecture, image_size=built, include_top=False)
    assert relative_error(features(images), pooled) <= RTOL


def test_another_size_matches_timm_built_for_it_and_with_dynamic_size(family):
    architecture, path, built, other, outputs = family
    images, logits, _ = outputs[other]
    # Built at the other size: absolute embeddings resampled once, when the weights load.
    assert relative_error(load(path, architecture, image_size=other)(images), logits) <= RTOL
    # Built at its own size, fed the other: the grid follows the input in the forward pass.
    dynamic = load(path, architecture, image_size=built, dynamic_image_size=True)
    assert relative_error(dynamic(images), logits) <= RTOL


def test_switches_are_read_from_the_keys_and_the_architecture_name(family):
    architecture, path, _, _, _ = family
    checkpoint = vit_keras.weights.checkpoints.read_checkpoint(
        path, num_heads=2, timm_architecture=architecture)
    found = vit_keras.weights.checkpoints.architecture(checkpoint)["switches"]
    defaults = {name: getattr(configs.get_config("ViT-B/16"), name) for name in configs.SWITCHES}
    assert found == {**defaults, **FAMILIES[architecture][2]}


@pytest.mark.parametrize("architecture", ["vit_base_patch16_dinov3", "eva02_base_patch14_224"])
def test_a_rotary_timm_file_without_its_architecture_name_asks_for_it(architecture, tmp_path):
    # DINOv3 has no absolute embedding; EVA-02 has one, and would load, wrongly, without RoPE.
    path = tmp_path / "model.pth"
    torch.save(timm_model(architecture, FAMILIES[architecture][0]).state_dict(), path)
    with pytest.raises(vit_keras.errors.CheckpointError, match="timm_architecture"):
        vit_keras.build_model_from_checkpoint(str(path), num_heads=2)


# transformers' models: (constructor, config arguments, built size, other size).
HF_MODELS = {
    "DINOv3ViTModel": ("DINOv3ViT", {"num_register_tokens": 4}, 32, (24, 40)),
    "DINOv3ViTModel gated": ("DINOv3ViT", {"use_gated_mlp": True, "hidden_act": "silu"}, 32,
                             (24, 40)),
    # transformers' AIMv2 adds its learned position embeddings at the built size only.
    "Aimv2VisionModel": ("Aimv2Vision", {"use_head": False}, 28, None),
}


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_transformers_models_saved_with_save_pretrained_match(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    prefix, arguments, size, other = HF_MODELS[name]
    config = getattr(transformers, prefix + "Config")(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=size, patch_size=8 if size == 32 else 14, **arguments)
    torch.manual_seed(0)
    model = randomised(getattr(transformers, prefix + "Model")(config))
    model.save_pretrained(tmp_path)
    for image_size, dynamic in (((size, size), False), (other, True))[:2 if other else 1]:
        images = images_for(image_size)
        with torch.no_grad():
            output = model(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2)))
        ours = vit_keras.build_model_from_checkpoint(
            tmp_path, include_preprocessing=False, include_top=False,
            image_size=size, dynamic_image_size=dynamic)
        tokens = output.last_hidden_state.numpy()
        # DINOv3's pooler output is its class token after the norm; AIMv2's encoder without its
        # head is pooled by the mean of the patch tokens, as timm's aimv2 models are.
        expected = (tokens[:, ours.num_prefix_tokens:].mean(1) if output.pooler_output is None
                    else output.pooler_output.numpy())
        assert relative_error(ours(images), expected) <= RTOL, image_size


IMAGENET = (np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225]))


def _dinov3_folder(folder, **arguments):
    """A small random `DINOv3ViTModel` saved with `save_pretrained` in `folder`, of 32 px."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DINOv3ViTConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, **arguments)
    torch.manual_seed(0)
    model = randomised(transformers.DINOv3ViTModel(config))
    model.save_pretrained(folder)
    return model


# The MLP follows `config.json`: its activation from `hidden_act`, whether it is gated from
# `use_gated_mlp` (and the weights); before, both of these loaded as another MLP (relative error
# 0.11 to 0.33).
@pytest.mark.parametrize("gated, activation", [(True, "gelu"), (False, "silu")])
def test_transformers_dinov3_mlp_follows_its_config_on_raw_pixels(gated, activation, tmp_path):
    model = _dinov3_folder(tmp_path, use_gated_mlp=gated, hidden_act=activation)
    # As a user calls it: default arguments, raw pixels (normalised as DINOv3's processors do).
    ours = vit_keras.build_model_from_checkpoint(tmp_path, include_top=False)
    assert ours.vit_config.mlp == {(True, "gelu"): "geglu", (False, "silu"): "silu"}[
        gated, activation]
    pixels = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3)).astype("float32")
    normalized = ((pixels / 255 - IMAGENET[0]) / IMAGENET[1]).astype("float32")
    with torch.no_grad():
        expected = model(pixel_values=torch.from_numpy(normalized.transpose(0, 3, 1, 2)))
    assert relative_error(ours(pixels), expected.pooler_output.numpy()) <= RTOL


def test_a_transformers_config_that_contradicts_its_weights_or_the_caller_is_refused(tmp_path):
    _dinov3_folder(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(vit_keras.errors.CheckpointError, match="num_attention_heads=2"):
        vit_keras.build_model_from_checkpoint(tmp_path, num_heads=4)
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_gated_mlp": True}))
    with pytest.raises(vit_keras.errors.CheckpointError, match="use_gated_mlp=true.*no gate"):
        vit_keras.build_model_from_checkpoint(tmp_path)


def test_a_timm_hub_folder_builds_the_size_and_heads_its_config_json_says(tmp_path):
    # As timm writes it for a hub (`save_for_hf`): the model's arguments beside the weights. Its
    # `pretrained_cfg` says DINOv3's 256 px; its `model_args` the 48 px this model was built for.
    from timm.models import _hub  # pylint: disable=import-outside-toplevel

    arguments = {"img_size": 48, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 2}
    torch.manual_seed(0)
    reference = randomised(timm.create_model("vit_base_patch16_dinov3", **arguments))
    _hub.save_for_hf(reference, tmp_path, model_args=arguments, safe_serialization=True)
    ours = vit_keras.build_model_from_checkpoint(tmp_path / "model.safetensors")
    assert ours.image_size == (48, 48) and ours.vit_config.num_heads == 2
    pixels = np.random.default_rng(0).integers(0, 256, (2, 48, 48, 3)).astype("float32")
    normalized = ((pixels / 255 - IMAGENET[0]) / IMAGENET[1]).astype("float32")
    with torch.no_grad():
        expected = reference(torch.from_numpy(normalized.transpose(0, 3, 1, 2))).numpy()
    assert relative_error(ours(pixels), expected) <= RTOL


@pytest.mark.parametrize("architecture", ["eva02_base_patch14_224", "vit_base_patch16_dinov3",
                                          "vit_giant_patch14_dinov2", "aimv2_large_patch14_224"])
def test_a_timm_file_narrower_than_its_name_needs_its_heads(architecture, tmp_path):
    # 96 wide, 4 heads: neither the name's heads (12, 24, 8) nor the paper's for any width.
    overrides, _, _ = FAMILIES[architecture]
    torch.manual_seed(0)
    reference = randomised(timm.create_model(
        architecture, **{**overrides, "embed_dim": 96, "num_heads": 4, "depth": 1}))
    path = tmp_path / "model.pth"
    torch.save(reference.state_dict(), path)
    with pytest.raises(vit_keras.errors.CheckpointError, match=r"96 wide.*num_heads="):
        vit_keras.build_model_from_checkpoint(path, timm_architecture=architecture)
    # With timm's config.json beside it, its heads are the model_args'; a caller's other heads
    # contradict it.
    (tmp_path / "config.json").write_text(json.dumps(
        {"architecture": architecture, "model_args": {"embed_dim": 96, "num_heads": 4}}))
    with pytest.raises(vit_keras.errors.CheckpointError, match="disagree: num_heads says 2"):
        vit_keras.build_model_from_checkpoint(path, num_heads=2)
    size = (overrides["img_size"],) * 2
    ours = vit_keras.build_model_from_checkpoint(path, image_size=size, include_top=False,
                                                 include_preprocessing=False)
    assert ours.vit_config.num_heads == 4
    images = images_for(size)
    with torch.no_grad():
        expected = reference.forward_head(reference.forward_features(
            torch.from_numpy(images.transpose(0, 3, 1, 2))), pre_logits=True).numpy()
    assert relative_error(ours(images), expected) <= RTOL


@pytest.mark.slow
def test_each_family_saved_as_keras_here_loads_on_the_next_backend(tmp_path):
    models = {}
    for architecture, (overrides, other, _) in FAMILIES.items():
        path = tmp_path / f"{architecture}.pth"
        torch.save(timm_model(architecture, overrides).state_dict(), path)
        # Of dynamic size, fed the other size: the loaded model must follow the grid too.
        model = load(str(path), architecture, image_size=overrides["img_size"],
                     dynamic_image_size=True)
        images = images_for(other)
        stem = tmp_path / architecture
        model.save(f"{stem}.keras")
        np.save(f"{stem}.images.npy", images)
        np.save(f"{stem}.expected.npy", keras.ops.convert_to_numpy(model(images)))
        models[architecture] = (f"{stem}.keras", f"{stem}.images.npy", f"{stem}.expected.npy")
    errors = run_on_backend(NEXT_BACKEND, _LOAD_ALL, models=models)
    assert set(errors) == set(FAMILIES)
    assert max(errors.values()) <= RTOL, errors


# The families whose parts differ most: learned per-block rotary frequencies, SwiGLU with
# DINOv3's rotary embeddings and registers, RMSNorm with projections without biases.
EVERYTHING = ("vit_base_patch16_rope_mixed_224", "vit_huge_plus_patch16_dinov3",
              "aimv2_large_patch14_224")


def _loaded(architecture, tmp_path, **kwargs):
    overrides, _, _ = FAMILIES[architecture]
    path = tmp_path / f"{architecture}.pth"
    torch.save(timm_model(architecture, overrides).state_dict(), path)
    size = (overrides["img_size"],) * 2
    return load(str(path), architecture, image_size=size, **kwargs), images_for(size)


@pytest.mark.parametrize("architecture", EVERYTHING)
def test_lora_layer_decay_int8_and_bfloat16_take_the_new_parts(architecture, tmp_path):
    from vit_keras.tools import finetuning  # pylint: disable=import-outside-toplevel
    from vit_keras.tools.runs import evaluation  # pylint: disable=import-outside-toplevel
    from vit_keras.training import layer_decay  # pylint: disable=import-outside-toplevel

    model, images = _loaded(architecture, tmp_path)
    expected = keras.ops.convert_to_numpy(model(images))
    scale = np.abs(expected).max()
    # Layer decay: every weight in a depth group but the final norm's and the head's.
    scales = layer_decay.layer_decay_scales(model, 0.75)
    grouped = {layer.name for layer in model.layers if layer.name in scales}
    assert {layer.name for layer in model.layers if layer.weights} - grouped <= {
        "encoder_norm", "fc_norm", "head"}
    # int8: every projection of the blocks (SwiGLU's gate too), close to float.
    quantized = evaluation.quantized_copy(model, "int8")
    block = quantized.get_layer("encoderblock_0")
    assert all(layer.quantization_mode == "int8" for layer in block.lora_targets)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(quantized(images)), expected,
                               atol=0.05 * scale)
    # bfloat16: the same model under the mixed policy, close to float32.
    mixed = model.rebuilt(dtype="mixed_bfloat16")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(mixed(images)), expected,
                               atol=0.05 * scale)
    # LoRA: adapters on every projection (the gate included); a fresh one changes nothing.
    finetuning.enable_lora(model, rank=2)
    assert all(layer.lora_enabled for layer in model.get_layer("encoderblock_0").lora_targets)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(images)), expected,
                               rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.slow
@pytest.mark.backend_independent("tensorflow")  # exports run on TensorFlow only
def test_each_family_exports_verified(tmp_path):
    from vit_keras.tools import export  # pylint: disable=import-outside-toplevel

    for index, architecture in enumerate(FAMILIES):
        # Raw pixels in, normalised as the name says (the serving signatures decode images).
        model, _ = _loaded(architecture, tmp_path, include_preprocessing=True)
        # LiteRT converts the SavedModel it writes first and ONNX the function that SavedModel
        # serves: one family's SavedModel is verified on its own, every family's through both.
        for format_ in export.FORMATS if index == 0 else ("tflite", "onnx"):
            _, verifications = export.export(
                model, format_, tmp_path / "exports", name=architecture.replace("_", "-"))
            assert verifications and all(
                check.max_rel_diff <= check.tolerance for check in verifications), (
                architecture, format_, verifications)


@pytest.mark.slow
def test_finetune_app_starts_from_a_local_rotary_timm_file(tmp_path):
    architecture = "vit_base_patch16_dinov3"
    overrides, other, _ = FAMILIES[architecture]
    folder = tmp_path / "hub"
    folder.mkdir()
    torch.save(timm_model(architecture, overrides).state_dict(), folder / "pytorch_model.bin")
    # As the hub's timm repositories hold it: the name and the heads in config.json beside it.
    (folder / "config.json").write_text(json.dumps(
        {"architecture": architecture, "model_args": {"num_heads": SMALL["num_heads"]}}))
    result = run_app("finetune.py", "--weights", str(folder / "pytorch_model.bin"),
                     "--image_size", str(other[0]), "--batch_size", "16",
                     "--steps_per_epoch", "1", "--epochs", "1", "--eval_batch_size", "64",
                     "--output_dir", str(tmp_path / "runs"), "--run_name", "dinov3", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    model = keras.models.load_model(tmp_path / "runs" / "dinov3" / "model.keras", compile=False)
    vit = vit_keras.ViT.of(model)
    assert vit.vit_config.rope.kind == "dinov3" and vit.vit_config.num_registers == 4
    assert model.output_shape == (None, 10)


@pytest.mark.slow
@pytest.mark.backend_independent("torch")  # fetching and checking: no backend; parity: above
def test_a_rotary_release_loads_by_name_from_a_mirror_of_timms_repository(tmp_path, monkeypatch):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from vit_keras.weights import download, releases  # pylint: disable=import-outside-toplevel

    release = releases.find_release("ViT-S/16", "dinov3")
    architecture = "vit_small_patch16_dinov3"
    torch.manual_seed(1)
    reference = timm.create_model(architecture, pretrained=False, num_classes=0).eval()
    folder = tmp_path / "mirror" / os.path.dirname(release.path)
    folder.mkdir(parents=True)
    safetensors_torch.save_file(reference.state_dict(), folder / "model.safetensors")
    # What timm's hub repository holds beside the weights: the name, its tag, the data config.
    (folder / "config.json").write_text(json.dumps({
        "architecture": architecture, "num_features": 384,
        "pretrained_cfg": {"tag": "lvd1689m", "mean": [0.485, 0.456, 0.406],
                           "std": [0.229, 0.224, 0.225]}}))
    monkeypatch.setenv(download.HOME_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setenv(download.MIRROR_VARIABLE, str(tmp_path / "mirror"))
    model = vit_keras.build_model("ViT-S/16", weights="dinov3", image_size=64, include_top=False)
    assert vit_keras.ViT.of(model).vit_config.rope.kind == "dinov3"
    assert model.normalization.name == "imagenet"
    pixels = np.random.default_rng(0).integers(0, 256, (1, 64, 64, 3)).astype("float32")
    normalized = (pixels / 255 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    with torch.no_grad():
        expected = reference(torch.from_numpy(
            normalized.transpose(0, 3, 1, 2).astype("float32"))).numpy()
    assert relative_error(model.predict(pixels, verbose=0), expected) <= RTOL


def _kernels_here():
    """The attention kernels that run on this backend and device (cuDNN's padded one through its
    XLA stand-in, which computes the same padded and masked function)."""
    from vit_keras.model import attention  # pylint: disable=import-outside-toplevel

    backend = keras.backend.backend()
    found = {"explicit": attention.kernel_named("explicit")}
    if backend == "jax":
        found.update(fused=attention.kernel_named("fused"),
                     padded=attention.PaddedAttention("xla"))
    if backend == "torch":
        found["torch"] = attention.kernel_named("torch")
    return found


@pytest.mark.parametrize("rope, rotate_half", [("axial", False), ("dinov3", True),
                                               ("mixed", False)])
def test_every_attention_kernel_turns_queries_and_keys_alike(rope, rotate_half):
    """Each kernel lays q and k out its own way (head-major, token-major, padded): all give the
    explicit kernel's output, with attention probabilities, at an odd token count."""
    from vit_keras.model import attention, layers, mlp, position_embeddings  # pylint: disable=import-outside-toplevel

    block = layers.TransformerBlock(
        2, 32, attention_spec=attention.AttentionSpec("qv", rope=position_embeddings.RopeSpec(
            rope, rotate_half=rotate_half)), mlp_spec=mlp.MlpSpec("swiglu"))
    x = np.random.default_rng(0).normal(size=(2, 13, 16)).astype("float32")
    patches = np.zeros((2, 3, 4, 16), "float32")
    positions = position_embeddings.RotaryPositions(rope, num_prefix_tokens=1, xy=True)(patches)
    block(x, positions)
    for weight in block.weights:  # learned frequencies, the gate and every bias random too
        weight.assign(np.random.default_rng(len(weight.path)).normal(
            size=weight.shape).astype("float32") * 0.3 + (weight.path.endswith("gamma")))
    expected, _ = block(x, positions, return_attention_scores=True)  # the explicit kernel
    expected = keras.ops.convert_to_numpy(expected)
    for name, kernel in _kernels_here().items():
        block.attention._attention_kernel = kernel  # pylint: disable=protected-access
        np.testing.assert_allclose(keras.ops.convert_to_numpy(block(x, positions)), expected,
                                   rtol=1e-4, atol=1e-4, err_msg=name)


def _rotary_block():
    from vit_keras.model import attention, layers, mlp, norms, position_embeddings  # pylint: disable=import-outside-toplevel

    rms = norms.NormSpec("rms_norm", 1e-5)
    return layers.TransformerBlock(
        2, 32, attention_spec=attention.AttentionSpec(
            "none", False, position_embeddings.RopeSpec("axial", temperature=100.0)),
        mlp_spec=mlp.MlpSpec("swiglu", bias=False, inner_norm=rms), norm_spec=rms)


def test_rotary_layers_round_trip_their_config():
    from vit_keras.model import position_embeddings  # pylint: disable=import-outside-toplevel

    for layer in (position_embeddings.RotaryPositions("dinov3", (3, 4), 5, 0.5, True, (6, 8)),
                  position_embeddings.RotaryEmbedding(4, "mixed", 10.0, False),
                  position_embeddings.RotaryRotation(8, "dinov3", 100.0, True),
                  _rotary_block(),
                  vit_keras.SwiGLUBlock(24, inner_norm="layer_norm", use_bias=False)):
        clone = type(layer).from_config(layer.get_config())
        assert clone.get_config() == layer.get_config(), type(layer).__name__


@pytest.mark.parametrize("rope", ["axial", "dinov3", "mixed"])
def test_fixed_rotary_frequencies_turn_once_per_forward_and_learned_ones_per_block(rope):
    """Axial and DINOv3 angles are the model's: one `RotaryRotation` whose cosine and sine every
    block takes; RoPE-Mixed's are each block's, which take the coordinates."""
    vit = vit_keras.ViT({"patch_size": 8, "hidden_size": 32, "mlp_dim": 64, "num_heads": 2,
                         "num_layers": 3, "rope": rope}, image_size=32, num_classes=3)
    rotary = [block.input[1] for block in vit.blocks]
    if rope == "mixed":
        assert vit.rotary_rotation is None
        assert all(each is vit.rotary_positions.output for each in rotary)
        assert tuple(rotary[0].shape) == (17, 2)
    else:
        assert all(each is vit.rotary_rotation.output for each in rotary)
        assert tuple(rotary[0].shape) == (2, 1, 17, 16)
    images = np.random.default_rng(0).uniform(0, 255, (2, 32, 32, 3)).astype("float32")
    tokens, inputs = vit.tokens_before_blocks()(images)
    for block in vit.blocks:  # the blocks called one by one on their inputs give the model's
        tokens = block(tokens, inputs)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(vit.heads[0](vit.pooling(vit.encoder_norm(tokens)))),
        keras.ops.convert_to_numpy(vit(images)), rtol=1e-5, atol=1e-5)


def test_the_rotary_input_stays_float32_under_mixed_precision():
    """Keras casts a layer's float inputs to its compute dtype; a bfloat16 cosine and sine would
    turn q and k by angles off by up to 2**-9. The block keeps them float32: a rotation rounded to
    bfloat16 first gives another output."""
    from vit_keras.model import position_embeddings  # pylint: disable=import-outside-toplevel

    block = _rotary_block()
    block = type(block).from_config({**block.get_config(), "dtype": "mixed_bfloat16"})
    x = np.random.default_rng(0).normal(size=(2, 13, 16)).astype("float32")
    coordinates = np.random.default_rng(1).uniform(0, 40, size=(13, 2)).astype("float32")
    rotation = position_embeddings.RotaryRotation(8, temperature=100.0)(coordinates)
    rounded = keras.ops.cast(keras.ops.cast(rotation, "bfloat16"), "float32")
    exact, coarse = (keras.ops.convert_to_numpy(keras.ops.cast(block(x, each), "float32"))
                     for each in (rotation, rounded))
    assert keras.ops.convert_to_numpy(block(x, rotation)).dtype.name == "bfloat16"
    assert not np.array_equal(exact, coarse)
    np.testing.assert_allclose(exact, keras.ops.convert_to_numpy(
        keras.ops.cast(block(x, coordinates), "float32")), rtol=1e-2, atol=1e-2)


def test_a_block_and_an_attention_layer_saved_before_specs_load_as_the_same_layers():
    # Their configs as vit_keras wrote them before the slots took specs (main 4188c77).
    from vit_keras.model import attention, layers  # pylint: disable=import-outside-toplevel

    block = _rotary_block()
    old_block = {"name": block.name, "trainable": True, "dtype": "float32", "num_heads": 2,
                 "mlp_dim": 32, "dropout": 0.0, "attention_dropout": 0.0, "drop_path_rate": 0.0,
                 "layer_norm_epsilon": 1e-5, "gelu": "exact", "layer_scale_init": None,
                 "seed": None, "attention": None, "mlp": "swiglu", "norm": "rms_norm",
                 "mlp_bias": False, "mlp_norm": True, "qkv_bias": "none", "rope": "axial",
                 "rope_temperature": 100.0, "rope_rotate_half": False, "proj_bias": False}
    loaded = layers.TransformerBlock.from_config(old_block)
    assert loaded.get_config() == {**block.get_config(), "dtype": loaded.get_config()["dtype"]}
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype("float32")
    positions = np.random.default_rng(1).normal(size=(5, 2)).astype("float32")
    block(x, positions)
    loaded(x, positions)
    loaded.set_weights(block.get_weights())
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(x, positions)),
                                  keras.ops.convert_to_numpy(block(x, positions)))
    old_attention = {"name": "MultiHeadDotProductAttention_1", "num_heads": 2,
                     "attention_dropout": 0.0, "attention": None, "qkv_bias": "qv",
                     "out_bias": True, "rope": "dinov3", "rope_temperature": 100.0,
                     "rope_rotate_half": True}
    spec = attention.MultiHeadDotProductAttention.from_config(old_attention).spec
    assert (spec.qkv_bias, spec.rope.kind, spec.rope.temperature, spec.rope.rotate_half) == (
        "qv", "dinov3", 100.0, True)


def test_a_rematerialized_rotary_model_takes_the_same_training_step(tmp_path):
    """Remat recomputes each block with its coordinates bound: the step (RoPE-Mixed's learned
    frequencies included) equals the one without it."""
    model, images = _loaded("vit_base_patch16_rope_mixed_224", tmp_path)
    remat = model.rebuilt().set_remat(True)
    before = [keras.ops.convert_to_numpy(w) for w in model.weights
              if w.path.endswith("rope/frequencies")]
    labels = np.array([1, 3])
    for each in (model, remat):
        each.compile(optimizer=keras.optimizers.SGD(0.1),
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        each.train_on_batch(images, labels)
    frequencies = [w for w in model.weights if w.path.endswith("rope/frequencies")]
    assert len(frequencies) == SMALL["depth"]
    assert not np.allclose(keras.ops.convert_to_numpy(frequencies[0]), before[0])  # trained
    for trained, recomputed in zip(model.weights, remat.weights):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(recomputed),
                                   keras.ops.convert_to_numpy(trained), rtol=1e-5, atol=1e-6,
                                   err_msg=trained.path)


@pytest.mark.parametrize("architecture", ["vit_base_patch16_dinov3", "aimv2_large_patch14_224"])
def test_the_keras_file_check_passes_a_rotary_or_gated_model(architecture, tmp_path):
    # Its lower bound on the weights a file must hold counts no position table for RoPE alone.
    model, _ = _loaded(architecture, tmp_path)
    model.save(tmp_path / "model.keras")
    vit_keras.check_keras_file(tmp_path / "model.keras")


def test_feature_tokens_and_attention_scores_follow_the_rotary_blocks(family):
    architecture, path, built, _, outputs = family
    images = outputs[built][0]
    model = load(path, architecture, image_size=built)
    vit = vit_keras.ViT.of(model)
    model_torch = timm_model(architecture, FAMILIES[architecture][0])
    with torch.no_grad():
        expected = model_torch.forward_features(
            torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
    # The last block's tokens after the final norm are timm's forward_features (with fc_norm
    # timm's `norm` is an identity: the block's own output).
    norm = vit.encoder_norm is not None
    tokens = vit_keras.build_feature_extractor(model, [-1], output="tokens", norm=norm)(images)
    assert relative_error(tokens, expected) <= RTOL
    scores = vit_keras.attention_scores(model, images)
    tokens_count = expected.shape[1]
    assert [s.shape for s in scores] == [(2, SMALL["num_heads"], tokens_count, tokens_count)] * 2
    np.testing.assert_allclose(np.stack(scores).sum(-1), 1.0, rtol=1e-5)


# The family and size a checkpoint names, not its numbers: one pass.
@pytest.mark.backend_independent("torch")
@pytest.mark.parametrize("architecture, overrides, expected", [
    ("vit_base_patch16_dinov3", {"img_size": 32}, "DINOv3-B/16"),
    ("eva02_small_patch14_224", {"img_size": 28}, "EVA02-S/14"),
])
def test_a_family_file_is_named_by_its_family_and_size(architecture, overrides, expected,
                                                       tmp_path):
    """Not the paper's `ViT-B/16` of the same width, nor `custom`: the run line and the logs
    name the model."""
    path = tmp_path / "model.pth"
    torch.save(timm.create_model(architecture, pretrained=False, depth=1, **overrides)
               .state_dict(), path)
    model = vit_keras.build_model_from_checkpoint(str(path), timm_architecture=architecture)
    assert model.vit_config.name == expected and model.name == expected.replace("/", "_")


@pytest.mark.backend_independent("torch")
def test_a_transformers_dinov3_folder_is_named_by_its_family_and_size(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.DINOv3ViTConfig(num_hidden_layers=1, image_size=32, patch_size=16)
    assert config.hidden_size == 384  # transformers' default: ViT-S's width
    transformers.DINOv3ViTModel(config).save_pretrained(tmp_path)
    model = vit_keras.build_model_from_checkpoint(tmp_path, include_top=False)
    assert model.vit_config.name == "DINOv3-S/16"
