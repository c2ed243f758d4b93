"""Checkpoints: logit parity with timm and transformers on every backend, layouts, heads, errors.

Synthetic checkpoints are written here with the official key names spelled out literally (not
through vit_keras' own name map), so that a mapping bug cannot cancel out between writer and reader.
Weights have realistic statistics: kernels N(0, 1/fan_in) (0.02-0.05 at real widths), LayerNorm
scales near 1, so logits spread well beyond the tolerance.

Tolerance: fp32 with exact GELU on both sides, max|a - b| / max|b| <= 1e-4 (seen: ~3e-7).
"""

import errno
from functools import partial
import json
import logging
import os
import re
import shutil
import struct
import zipfile

import keras
import numpy as np
import pytest
import safetensors.torch
import scipy.ndimage
from timm.models.vision_transformer import VisionTransformer, _load_weights, checkpoint_filter_fn
import torch
from transformers import ViTConfig, ViTForImageClassification, ViTModel

import vit_keras
from vit_keras import errors

from conftest import run_on_backend

P, D, H, M, L = 4, 32, 4, 64, 2  # patch, hidden, heads, MLP, layers
TINY = {"patch_size": P, "hidden_size": D, "mlp_dim": M, "num_heads": H, "num_layers": L}
CLASSES = 5
RTOL = 1e-4


# --- synthetic checkpoints in the official layouts ------------------------------------------------

def official_params(grid=4, classes=CLASSES, classifier="token", representation=None, seed=0):
    """vit_jax's published layout (pre-Linen names), as in CHECKPOINTS.md."""
    rng = np.random.default_rng(seed)

    def kernel(*shape, fan_in):
        return rng.normal(0, fan_in ** -0.5, shape).astype("float32")

    def small(*shape, std=0.02):
        return rng.normal(0, std, shape).astype("float32")

    rows, cols = (grid, grid) if isinstance(grid, int) else grid
    tokens = rows * cols + (classifier == "token")
    p = {"embedding/kernel": kernel(P, P, 3, D, fan_in=P * P * 3), "embedding/bias": small(D),
         "Transformer/posembed_input/pos_embedding": small(1, tokens, D, std=0.1)}
    if classifier == "token":
        p["cls"] = small(1, 1, D, std=0.1)
    for i in range(L):
        b = f"Transformer/encoderblock_{i}/"
        for ln in ("LayerNorm_0", "LayerNorm_2"):
            p[f"{b}{ln}/scale"] = 1 + small(D, std=0.1)
            p[f"{b}{ln}/bias"] = small(D, std=0.05)
        for name in ("query", "key", "value"):
            p[f"{b}MultiHeadDotProductAttention_1/{name}/kernel"] = kernel(D, H, D // H, fan_in=D)
            p[f"{b}MultiHeadDotProductAttention_1/{name}/bias"] = small(H, D // H)
        p[f"{b}MultiHeadDotProductAttention_1/out/kernel"] = kernel(H, D // H, D, fan_in=D)
        p[f"{b}MultiHeadDotProductAttention_1/out/bias"] = small(D)
        p[f"{b}MlpBlock_3/Dense_0/kernel"] = kernel(D, M, fan_in=D)
        p[f"{b}MlpBlock_3/Dense_0/bias"] = small(M)
        p[f"{b}MlpBlock_3/Dense_1/kernel"] = kernel(M, D, fan_in=M)
        p[f"{b}MlpBlock_3/Dense_1/bias"] = small(D)
    p["Transformer/encoder_norm/scale"] = 1 + small(D, std=0.1)
    p["Transformer/encoder_norm/bias"] = small(D, std=0.05)
    features = D
    if representation:
        p["pre_logits/kernel"] = kernel(D, representation, fan_in=D)
        p["pre_logits/bias"] = small(representation)
        features = representation
    if classes:
        p["head/kernel"] = kernel(features, classes, fan_in=features)
        p["head/bias"] = small(classes)
    return p


LINEN = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0",
         "LayerNorm_2": "LayerNorm_1", "MlpBlock_3": "MlpBlock_0"}


def in_layout(params, layout):
    """The same arrays in another official layout."""
    if layout == "vit_jax":
        return dict(params)
    if layout == "opt_target":  # old vit_jax files
        return {"opt/target/" + k: v for k, v in params.items()}
    out = {}
    for key, value in params.items():  # Flax Linen numbering
        for old, new in LINEN.items():
            key = key.replace(f"/{old}/", f"/{new}/")
        out[key] = value
    if layout == "linen":
        return out
    out["pos_embedding"] = out.pop("Transformer/posembed_input/pos_embedding")  # big_vision
    if layout == "big_vision_stacked":  # nn.scan: blocks stacked along a leading axis
        first = "Transformer/encoderblock_0/"
        for key in [k for k in out if k.startswith(first)]:
            rest = key[len(first):]
            out["Transformer/encoderblock/" + rest] = np.stack(
                [out.pop(f"Transformer/encoderblock_{i}/{rest}") for i in range(L)])
    return {"params/" + k: v for k, v in out.items()}


def write_npz(path, params):
    np.savez(path, **params)
    return str(path)


def images(height=16, width=16, batch=2, seed=1):
    """Already-normalised images in [-1, 1], NHWC."""
    return np.random.default_rng(seed).uniform(-1, 1, (batch, height, width, 3)).astype("float32")


def keras_logits(model, x):
    if keras.backend.backend() == "jax":
        # Eager JAX compiles op by op for every new shape (~5 s a model here); one jitted program
        # is several times faster. Same operations, same float32 numerics.
        return np.asarray(model.predict_on_batch(x))
    return keras.ops.convert_to_numpy(model(x, training=False))


def torch_logits(module, x, **kwargs):
    with torch.no_grad():
        out = module.eval()(torch.from_numpy(x).permute(0, 3, 1, 2), **kwargs)
    return getattr(out, "logits", out).numpy()


def relative(a, b):
    assert np.std(b) > 0.1, "reference logits are too flat to compare meaningfully"
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def timm_vit(height=16, width=16, classes=CLASSES, classifier="token"):
    # fc_norm=False: vit_jax's GAP applies the final LayerNorm before pooling; timm's default for
    # avg pooling moves it after the pool (fc_norm), which _load_weights does not even load. timm's
    # own ports of the Google GAP models use fc_norm=False too.
    return VisionTransformer(
        img_size=(height, width), patch_size=P, embed_dim=D, depth=L, num_heads=H,
        mlp_ratio=M / D, num_classes=classes, class_token=classifier == "token",
        global_pool="token" if classifier == "token" else "avg", fc_norm=False)


def keras_vit(height=16, width=16, classes=CLASSES, **kwargs):
    return vit_keras.build_model(TINY, image_size=(height, width), num_classes=classes,
                                 include_preprocessing=False, **kwargs)


# --- parity with timm's loader for the original .npz files ----------------------------------------

def test_npz_matches_timm_at_checkpoint_resolution(tmp_path):
    path = write_npz(tmp_path / "vit.npz", official_params())
    reference = timm_vit()
    _load_weights(reference, path)
    model = vit_keras.load_pretrained(keras_vit(), path)
    assert relative(keras_logits(model, images()), torch_logits(reference, images())) < RTOL


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_npz_matches_timm_at_resampled_rectangular_resolution(tmp_path, classifier):
    # timm's _load_weights resamples .npz position embeddings with F.interpolate(bilinear,
    # align_corners=False); asking vit_keras for the same interpolation compares like with like.
    path = write_npz(tmp_path / "vit.npz", official_params(grid=4, classifier=classifier))
    reference = timm_vit(24, 20, classifier=classifier)
    _load_weights(reference, path)
    model = vit_keras.load_pretrained(keras_vit(24, 20, classifier=classifier), path,
                                      interpolation="bilinear")
    x = images(24, 20)
    assert relative(keras_logits(model, x), torch_logits(reference, x)) < RTOL


def test_npz_default_resampling_is_vit_jax_zoom(tmp_path):
    # The default is vit_jax's scipy.ndimage.zoom(order=1). timm cannot resample that way, so the
    # checkpoint is resampled once here with SciPy (as vit_jax does) and timm reads the result at
    # the new size, while vit_keras resamples the original file itself.
    params = official_params(grid=4)
    path = write_npz(tmp_path / "vit.npz", params)
    posemb = params["Transformer/posembed_input/pos_embedding"]
    grid = scipy.ndimage.zoom(posemb[0, 1:].reshape(4, 4, D), (6 / 4, 5 / 4, 1), order=1)
    zoomed = {**params, "Transformer/posembed_input/pos_embedding": np.concatenate(
        [posemb[:, :1], grid.reshape(1, 30, D)], axis=1)}
    reference = timm_vit(24, 20)
    _load_weights(reference, write_npz(tmp_path / "zoomed.npz", zoomed))
    model = vit_keras.load_pretrained(keras_vit(24, 20), path)
    x = images(24, 20)
    assert relative(keras_logits(model, x), torch_logits(reference, x)) < RTOL


def test_gap_npz_matches_timm(tmp_path):
    path = write_npz(tmp_path / "gap.npz", official_params(classifier="gap"))
    reference = timm_vit(classifier="gap")
    _load_weights(reference, path)
    model = vit_keras.load_pretrained(keras_vit(classifier="gap"), path)
    assert relative(keras_logits(model, images()), torch_logits(reference, images())) < RTOL


def test_representation_layer_matches_timm_features(tmp_path):
    # timm dropped the representation layer, so its pooled features (after the final LayerNorm)
    # go through the file's pre_logits (Dense + tanh) and head here, in float64.
    params = official_params(representation=24)
    path = write_npz(tmp_path / "rep.npz", params)
    reference = timm_vit(classes=0)
    _load_weights(reference, path)
    features = torch_logits(reference, images()).astype("float64")
    pre_logits = np.tanh(features @ params["pre_logits/kernel"] + params["pre_logits/bias"])
    expected = pre_logits @ params["head/kernel"] + params["head/bias"]
    model = vit_keras.load_pretrained(keras_vit(representation_size=24), path)
    assert relative(keras_logits(model, images()), expected) < RTOL


def test_npz_layouts_give_the_same_logits(tmp_path):
    params = official_params()
    model = keras_vit()  # one model for all layouts: one compilation
    for layout in ("opt_target", "linen", "big_vision", "big_vision_stacked"):
        path = write_npz(tmp_path / f"{layout}.npz", in_layout(params, layout))
        # timm reads opt/target and big_vision files itself; plain Linen names only vit_jax reads
        # (via flax's convert_pre_linen), so for those the published layout is the reference.
        reference = timm_vit()
        _load_weights(reference, path if layout != "linen" else write_npz(tmp_path / "o.npz", params))
        vit_keras.load_pretrained(model, path)
        assert relative(keras_logits(model, images()), torch_logits(reference, images())) < RTOL, (
            layout)


def test_bfloat16_npz_loads_as_float32(tmp_path):
    # big_vision may store bfloat16, which NumPy writes as 2-byte voids.
    import ml_dtypes  # pylint: disable=import-outside-toplevel

    params = official_params()
    half = {k: v.astype(ml_dtypes.bfloat16) for k, v in in_layout(params, "big_vision").items()}
    model = vit_keras.load_pretrained(keras_vit(), write_npz(tmp_path / "bf16.npz", half))
    kernel = keras.ops.convert_to_numpy(model.get_layer("embedding").kernel)
    assert kernel.dtype == np.float32
    np.testing.assert_allclose(kernel, params["embedding/kernel"], rtol=2 ** -8)


def test_same_size_load_is_exact(tmp_path):
    params = official_params()
    model = vit_keras.load_pretrained(keras_vit(), write_npz(tmp_path / "vit.npz", params))
    loaded = {w.path: keras.ops.convert_to_numpy(w) for w in model.weights}
    np.testing.assert_array_equal(loaded["posembed_input/pos_embedding"],
                                  params["Transformer/posembed_input/pos_embedding"])
    np.testing.assert_array_equal(
        loaded["encoderblock_1/MultiHeadDotProductAttention_1/key/kernel"],
        params["Transformer/encoderblock_1/MultiHeadDotProductAttention_1/key/kernel"])


# --- Hugging Face and timm state dicts ------------------------------------------------------------

def _randomize_torch(module, seed=0):
    """Realistic values for every parameter (zero-initialised ones included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                value = 1 + 0.1 * torch.randn(parameter.shape, generator=generator)
            elif parameter.ndim >= 2 and "embed" not in name and "token" not in name:
                fan_in = parameter[0].numel()
                value = torch.randn(parameter.shape, generator=generator) * fan_in ** -0.5
            else:
                value = 0.05 * torch.randn(parameter.shape, generator=generator)
            parameter.copy_(value)
    return module.eval()


def _hf_config(**kwargs):
    return ViTConfig(hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=M,
                     image_size=16, patch_size=P, num_labels=CLASSES, **kwargs)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    model = _randomize_torch(ViTForImageClassification(_hf_config()))
    model.save_pretrained(folder)  # model.safetensors + config.json (layer_norm_eps 1e-12)
    return str(folder), model


def test_huggingface_folder_matches_transformers(hf_folder):
    folder, reference = hf_folder
    model = vit_keras.build_model_from_checkpoint(folder, include_preprocessing=False)
    assert model.get_layer("encoder_norm").epsilon == 1e-12  # from config.json
    assert relative(keras_logits(model, images()), torch_logits(reference, images())) < RTOL


def test_huggingface_safetensors_file_into_a_built_model(hf_folder):
    folder, reference = hf_folder
    model = keras_vit(layer_norm_epsilon=1e-12)
    vit_keras.load_pretrained(model, os.path.join(folder, "model.safetensors"))
    assert relative(keras_logits(model, images()), torch_logits(reference, images())) < RTOL


def test_huggingface_resampled_matches_interpolate_pos_encoding(hf_folder):
    # Hugging Face resamples at run time (bicubic, align_corners=False): vit_keras' default for
    # this format, applied once at load time.
    folder, reference = hf_folder
    model = vit_keras.build_model_from_checkpoint(folder, image_size=(24, 20),
                                                  include_preprocessing=False)
    x = images(24, 20)
    expected = torch_logits(reference, x, interpolate_pos_encoding=True)
    assert relative(keras_logits(model, x), expected) < RTOL


def test_huggingface_pytorch_bin_and_pooler_as_representation_layer(tmp_path):
    # ViTModel's pooler (Dense + tanh on the class token) is the representation layer. The state
    # dict is saved as it is in memory: transformers >= 5 names (layers.0.attention.q_proj, ...),
    # where save_pretrained (the folder tests above) writes the classic ones.
    reference = _randomize_torch(ViTModel(_hf_config(), add_pooling_layer=True))
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    reference.config.to_json_file(tmp_path / "config.json")
    model = vit_keras.build_model_from_checkpoint(str(tmp_path), include_preprocessing=False)
    assert model.get_layer("pre_logits").units == D
    assert "head" not in [layer.name for layer in model.layers]
    with torch.no_grad():
        expected = reference(torch.from_numpy(images()).permute(0, 3, 1, 2)).pooler_output.numpy()
    assert relative(keras_logits(model, images()), expected) < RTOL


def test_timm_state_dict_matches_timm(tmp_path):
    reference = _randomize_torch(timm_vit())
    torch.save(reference.state_dict(), tmp_path / "timm.pth")
    safetensors.torch.save_file(reference.state_dict(), tmp_path / "timm.safetensors")
    expected = torch_logits(reference, images())
    model = vit_keras.build_model_from_checkpoint(str(tmp_path / "timm.pth"), num_heads=H,
                                                  include_preprocessing=False)
    assert relative(keras_logits(model, images()), expected) < RTOL
    for weight in model.weights:  # wipe, then reload from the other container
        weight.assign(np.zeros(weight.shape, weight.dtype))
    vit_keras.load_pretrained(model, str(tmp_path / "timm.safetensors"))
    assert relative(keras_logits(model, images()), expected) < RTOL


def test_timm_state_dict_resampled_like_timm(tmp_path):
    # timm's checkpoint_filter_fn resamples state dicts bicubic with antialias: vit_keras' default
    # for timm files.
    source = _randomize_torch(timm_vit())
    torch.save(source.state_dict(), tmp_path / "timm.pth")
    reference = timm_vit(24, 20)
    reference.load_state_dict(checkpoint_filter_fn(source.state_dict(), reference))
    model = vit_keras.load_pretrained(keras_vit(24, 20), str(tmp_path / "timm.pth"))
    x = images(24, 20)
    assert relative(keras_logits(model, x), torch_logits(reference, x)) < RTOL


def test_timm_fc_norm_checkpoint_does_not_fit_a_model_without_fc_norm(tmp_path):
    # fc_norm is a switch of the family (tests/test_family_timm.py); a plain GAP model lacks it.
    gap = VisionTransformer(img_size=16, patch_size=P, embed_dim=D, depth=L, num_heads=H,
                            num_classes=CLASSES, class_token=False, global_pool="avg")
    torch.save(gap.state_dict(), tmp_path / "fc_norm.pth")
    with pytest.raises(ValueError, match="unexpected in the checkpoint: fc_norm/"):
        vit_keras.load_pretrained(keras_vit(classifier="gap"), str(tmp_path / "fc_norm.pth"))


# --- save_npz -------------------------------------------------------------------------------------

@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_save_npz_round_trips_through_timm(tmp_path, classifier):
    model = keras_vit(classifier=classifier)
    rng = np.random.default_rng(0)
    for weight in model.weights:
        scale = 0.1 if weight.path.endswith(("gamma", "bias", "beta")) else weight.shape[0] ** -0.5
        offset = 1.0 if weight.path.endswith("gamma") else 0.0
        weight.assign(offset + rng.normal(0, scale, weight.shape))
    path = vit_keras.save_npz(model, str(tmp_path / "out.npz"))
    expected_keys = set(official_params(classifier=classifier))
    assert set(np.load(path).files) == expected_keys  # exactly the official names
    reference = timm_vit(classifier=classifier)
    _load_weights(reference, path)
    assert relative(torch_logits(reference, images()), keras_logits(model, images())) < RTOL


def test_a_save_npz_that_fails_while_writing_leaves_the_file_it_replaces(tmp_path, monkeypatch):
    from vit_keras.weights.checkpoints import npz

    model = keras_vit()
    path = vit_keras.save_npz(model, str(tmp_path / "out.npz"))
    with open(path, "rb") as f:
        before = f.read()

    def fills_the_disk(file, **arrays):
        file.write(before[:100])  # part of a file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(npz.np, "savez", fills_the_disk)
    with pytest.raises(OSError, match="No space left"):
        vit_keras.save_npz(model, path)
    monkeypatch.undo()
    with open(path, "rb") as f:
        assert f.read() == before
    assert os.listdir(tmp_path) == ["out.npz"]  # no temporary file left
    # A link at the path is replaced, not written through.
    os.symlink(path, tmp_path / "link.npz")
    vit_keras.save_npz(model, str(tmp_path / "link.npz"))
    assert not os.path.islink(tmp_path / "link.npz")


def test_hybrid_npz_matches_timm(tmp_path):
    # R+ViT with the ResNet root alone (vit_jax's R+ViT-Ti/16 shape, tiny): published hybrid files
    # store GroupNorm parameters as (1, 1, 1, C). timm standardises weights its own way, so the
    # model uses timm's numerics here.
    from timm.models.vision_transformer_hybrid import HybridEmbed, _resnetv2

    from vit_keras.model.configs import ViTConfig  # pylint: disable=import-outside-toplevel

    config = ViTConfig(name="R+tiny", resnet_layers=(), **{**TINY, "patch_size": 4})
    source = vit_keras.build_model(config, image_size=32, num_classes=CLASSES)
    rng = np.random.default_rng(0)
    for weight in source.weights:
        fan_in = int(np.prod(weight.shape[:-1])) if len(weight.shape) > 1 else 0
        scale = fan_in ** -0.5 if fan_in else 0.05
        offset = 1.0 if weight.path.endswith("gamma") else 0.0
        weight.assign(offset + rng.normal(0, scale, weight.shape))
    params = dict(np.load(vit_keras.save_npz(source, str(tmp_path / "saved.npz"))))
    assert "conv_root/kernel" in params and "gn_root/scale" in params
    params.update({k: v.reshape(1, 1, 1, -1) for k, v in params.items() if k.startswith("gn_")})
    path = write_npz(tmp_path / "hybrid.npz", params)
    reference = VisionTransformer(img_size=32, patch_size=4, embed_dim=D, depth=L, num_heads=H,
                                  mlp_ratio=M / D, num_classes=CLASSES,
                                  embed_layer=partial(HybridEmbed, backbone=_resnetv2(layers=())))
    _load_weights(reference, path)
    model = vit_keras.build_model_from_checkpoint(path, include_preprocessing=False,
                                                  hybrid_numerics="timm")
    assert model.input_shape == (None, 32, 32, 3)  # 2x2 tokens of 4x4 patches on a stride-4 root
    x = images(32, 32)
    assert relative(keras_logits(model, x), torch_logits(reference, x)) < RTOL


# --- heads ----------------------------------------------------------------------------------------

def test_other_class_count_gets_a_zero_head_and_one_log_line(tmp_path, caplog):
    path = write_npz(tmp_path / "vit.npz", official_params(classes=CLASSES))
    model = keras_vit(classes=3)
    randomize = np.random.default_rng(0)
    for weight in model.weights:
        weight.assign(randomize.normal(0, 1, weight.shape))
    with caplog.at_level(logging.INFO, logger="vit_keras"):
        vit_keras.load_pretrained(model, path)
    head_lines = [r.getMessage() for r in caplog.records if "head" in r.getMessage()]
    assert len(head_lines) == 1 and "5 classes" in head_lines[0], head_lines
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.get_layer("head").kernel), 0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.get_layer("head").bias), 0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.get_layer("embedding").kernel),
                                  official_params()["embedding/kernel"])


def test_include_top_false_loads_all_but_the_head(tmp_path):
    path = write_npz(tmp_path / "vit.npz", official_params())
    reference = timm_vit(classes=0)
    _load_weights(reference, path)
    model = vit_keras.load_pretrained(keras_vit(include_top=False), path)
    assert relative(keras_logits(model, images()), torch_logits(reference, images())) < RTOL


def test_representation_layer_is_dropped_with_a_log_line(tmp_path, caplog):
    path = write_npz(tmp_path / "rep.npz", official_params(representation=24))
    with caplog.at_level(logging.INFO, logger="vit_keras"):
        model = vit_keras.load_pretrained(keras_vit(), path)
    assert any("pre_logits" in r.getMessage() for r in caplog.records)
    # The 21k head read the dropped 24-unit layer: it is re-initialised too.
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.get_layer("head").kernel), 0)


def test_model_from_checkpoint_reads_the_architecture(tmp_path):
    params = official_params(grid=(3, 5), classifier="gap", representation=24, classes=7)
    path = write_npz(tmp_path / "vit.npz", params)
    model = vit_keras.build_model_from_checkpoint(path, image_size=(12, 20))
    assert model.input_shape == (None, 12, 20, 3) and model.output_shape == (None, 7)
    assert model.get_layer("pre_logits").units == 24
    assert "cls" not in [layer.name for layer in model.layers]
    square = write_npz(tmp_path / "b16.npz", official_params(grid=6))
    assert vit_keras.build_model_from_checkpoint(square).input_shape == (None, 24, 24, 3)


# --- errors ---------------------------------------------------------------------------------------

def _weights(model):
    return [keras.ops.convert_to_numpy(w).copy() for w in model.weights]


def test_wrong_architecture_lists_each_mismatch_and_loads_nothing(tmp_path):
    path = write_npz(tmp_path / "vit.npz", official_params())
    with pytest.raises(ValueError, match="does not hold a ViT-B/16: patch_size 4"):
        vit_keras.build_model_from_checkpoint(path, variant="ViT-B/16")
    wide = vit_keras.build_model({**TINY, "mlp_dim": 48}, image_size=16, num_classes=CLASSES)
    before = _weights(wide)
    with pytest.raises(ValueError) as error:
        vit_keras.load_pretrained(wide, path)
    message = str(error.value)
    for i in range(L):
        block = f"Transformer/encoderblock_{i}/MlpBlock_3/"
        assert f"shape mismatch: {block}Dense_0/kernel: model (32, 48), checkpoint (32, 64)" in (
            message)
        assert f"shape mismatch: {block}Dense_0/bias: model (48,), checkpoint (64,)" in message
        assert f"shape mismatch: {block}Dense_1/kernel: model (48, 32), checkpoint (64, 32)" in (
            message)
    assert message.count("shape mismatch") == 3 * L
    for old, new in zip(before, _weights(wide)):
        np.testing.assert_array_equal(old, new)  # never a partial load


def test_huggingface_heads_come_from_config_json(hf_folder):
    # A model with other heads but the same width must not take a silently re-split attention.
    folder, _ = hf_folder
    two_heads = vit_keras.build_model({**TINY, "num_heads": 2}, image_size=16,
                                      num_classes=CLASSES, layer_norm_epsilon=1e-12)
    with pytest.raises(vit_keras.errors.CheckpointError,
                       match=r"num_heads=2 was asked for, but .*config.json' says "
                             r"num_attention_heads=4"):
        vit_keras.load_pretrained(two_heads, folder)


def test_missing_key_is_an_error(tmp_path):
    params = official_params()
    del params["Transformer/encoderblock_1/MlpBlock_3/Dense_1/bias"]
    with pytest.raises(ValueError, match=r"missing from the checkpoint: Transformer/encoderblock_1/"
                                         r"MlpBlock_3/Dense_1/bias .*shape \(32,\)"):
        vit_keras.load_pretrained(keras_vit(), write_npz(tmp_path / "vit.npz", params))


def test_unexpected_key_is_an_error_unless_not_strict(tmp_path, caplog):
    params = {**official_params(), "Transformer/encoderblock_2/LayerNorm_0/scale": np.ones(D)}
    path = write_npz(tmp_path / "vit.npz", params)
    with pytest.raises(ValueError, match=r"unexpected in the checkpoint: Transformer/"
                                         r"encoderblock_2/LayerNorm_0/scale \(shape \(32,\)\)"):
        vit_keras.load_pretrained(keras_vit(), path)
    with caplog.at_level(logging.WARNING, logger="vit_keras"):
        model = vit_keras.load_pretrained(keras_vit(), path, strict=False)
    assert any("encoderblock_2" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.get_layer("head").kernel),
                                  params["head/kernel"])


def test_pickled_npz_is_refused(tmp_path):
    params = {**official_params(), "extra": np.array([{"a": 1}], dtype=object)}
    path = write_npz(tmp_path / "pickled.npz", params)
    with pytest.raises(ValueError, match="pickled object array"):
        vit_keras.load_pretrained(keras_vit(), path)


class _Payload:
    """Unpickling this runs os.mkdir(marker): stands in for arbitrary code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_pickled_code_in_a_torch_file_is_refused(tmp_path):
    marker = str(tmp_path / "executed")
    path = str(tmp_path / "evil.pth")
    torch.save({"patch_embed.proj.weight": torch.zeros(D, 3, P, P), "x": _Payload(marker)}, path)
    with pytest.raises(ValueError, match="weights_only"):
        vit_keras.load_pretrained(keras_vit(), path)
    assert not os.path.exists(marker)
    torch.load(path, weights_only=False)  # the payload is live: an unsafe load would run it
    assert os.path.exists(marker)


def test_missing_file_and_unknown_format_are_user_errors(tmp_path):
    # CheckpointNotFoundError is a FileNotFoundError and CheckpointError a ValueError, as before.
    with pytest.raises(errors.CheckpointNotFoundError, match="No checkpoint at"):
        vit_keras.load_pretrained(keras_vit(), str(tmp_path / "nothing.npz"))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(errors.CheckpointError, match="Unrecognised checkpoint format"):
        vit_keras.load_pretrained(keras_vit(), str(tmp_path / "notes.txt"))
    with pytest.raises(errors.CheckpointError, match="not a ViT checkpoint"):
        vit_keras.load_pretrained(keras_vit(), write_npz(tmp_path / "other.npz", {"w": np.ones(3)}))
    with pytest.raises(errors.CheckpointNotFoundError, match="No weights in folder"):
        vit_keras.load_pretrained(keras_vit(), str(tmp_path))


def _flip_last_byte_of_member(path, member):
    """Corrupts the last byte of an `.npz` member's data: only the member's CRC-32 can tell."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26:
                                                          info.header_offset + 30])
    data[info.header_offset + 30 + name_length + extra_length + info.compress_size - 1] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)


def test_a_truncated_or_corrupt_npz_names_the_file_and_the_problem(tmp_path):
    path = write_npz(tmp_path / "vit.npz", official_params())
    with open(path, "rb") as f:
        content = f.read()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(content[:len(content) // 2])
    with pytest.raises(ValueError, match=re.escape(repr(str(cut))) + " is a truncated or corrupt"):
        vit_keras.load_pretrained(keras_vit(), str(cut))
    _flip_last_byte_of_member(path, "head/kernel.npy")
    with pytest.raises(ValueError, match=re.escape(repr(path)) + r" is a truncated or corrupt "
                                         r"\.npz file: array 'head/kernel' .*CRC"):
        vit_keras.load_pretrained(keras_vit(), path)


def test_a_truncated_torch_file_names_the_file(tmp_path):
    path = tmp_path / "vit.pth"
    torch.save(_randomize_torch(timm_vit()).state_dict(), str(path))
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ValueError, match=re.escape(repr(str(path))) + " is a truncated or corrupt"):
        vit_keras.load_pretrained(keras_vit(), str(path))


def test_a_bad_safetensors_header_names_the_file(tmp_path):
    header = b'{"patch_embed.proj.weight": {"dtype": "F32", "shape": [2], "data_offs'  # cut off
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(ValueError, match=re.escape(repr(str(path))) +
                       " is not a valid safetensors file"):
        vit_keras.load_pretrained(keras_vit(), str(path))


def test_a_corrupt_safetensors_file_whose_first_byte_is_0x80_is_not_called_a_pickle(hf_folder,
                                                                                    tmp_path):
    """A safetensors file starts with its header's length: a first byte of 0x80 (any length of
    128 + 256 k bytes) is no pickle. Here the length is corrupt too (beyond the file's end)."""
    data = bytearray(open(os.path.join(hf_folder[0], "model.safetensors"), "rb").read())
    data[0], data[7] = 0x80, 0x01
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(data))
    with pytest.raises(errors.CheckpointError) as refused:
        vit_keras.build_model_from_checkpoint(str(path))
    assert f"{str(path)!r} is not a valid safetensors file" in str(refused.value), refused.value
    assert "pickle" not in str(refused.value) and "Refusing" not in str(refused.value)


def _set_compression_method(path, method):
    """Rewrites the compression method of every member of the zip archive at `path` (in its
    local headers and its central directory), leaving the data as it is."""
    with zipfile.ZipFile(path) as archive:
        offsets = [info.header_offset for info in archive.infolist()]
    data = bytearray(open(path, "rb").read())
    for offset in offsets:
        data[offset + 8:offset + 10] = struct.pack("<H", method)
    central = data.find(b"PK\x01\x02")
    while central != -1:
        data[central + 10:central + 12] = struct.pack("<H", method)
        central = data.find(b"PK\x01\x02", central + 4)
    open(path, "wb").write(bytes(data))


def test_an_npz_of_a_compression_numpy_does_not_write_is_named(tmp_path):
    path = str(tmp_path / "deflate64.npz")
    np.savez_compressed(path, **official_params())
    _set_compression_method(path, 9)  # deflate64: zipfile lists it but cannot read it
    with pytest.raises(errors.CheckpointError) as refused:
        vit_keras.build_model_from_checkpoint(path)
    assert re.search(re.escape(repr(path)) + r" stores array '.*' with zip compression method 9 "
                     r"\(deflate64\), which vit_keras does not read", str(refused.value)), \
        refused.value


def test_a_deep_config_json_beside_a_timm_file_leaves_the_weights_to_decide(tmp_path):
    reference = _randomize_torch(timm_vit())
    safetensors.torch.save_file(reference.state_dict(), tmp_path / "timm.safetensors")
    (tmp_path / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    model = vit_keras.build_model_from_checkpoint(str(tmp_path / "timm.safetensors"),
                                                  num_heads=H, include_preprocessing=False)
    assert relative(keras_logits(model, images()), torch_logits(reference, images())) < RTOL


def _hf_copy(hf_folder, folder, config=None):
    """A copy of the Hugging Face folder, with `config` (a JSON text) as its config.json."""
    os.makedirs(folder)
    shutil.copy(os.path.join(hf_folder[0], "model.safetensors"), folder)
    with open(os.path.join(hf_folder[0], "config.json")) as f:
        original = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(config(original) if callable(config) else config)
    return str(folder)


@pytest.mark.parametrize("config, problem", [
    (lambda c: json.dumps({**c, "patch_size": 0}), "patch_size is 0; expected a positive whole"),
    (lambda c: json.dumps({**c, "image_size": "big"}), "image_size is 'big'; expected"),
    (lambda c: json.dumps({**c, "layer_norm_eps": None}), "layer_norm_eps is None; expected"),
    (lambda c: json.dumps([c]), "holds a JSON list, not an object"),
    (lambda c: json.dumps(c)[:-20], "is not valid JSON"),
    (lambda c: '{"a": ' * 100_000 + "1" + "}" * 100_000, "nests JSON arrays or objects too deep"),
], ids=["zero_patch", "text_size", "null_epsilon", "list", "cut_short", "deep"])
def test_a_malformed_config_json_names_the_file_and_what_is_wrong(hf_folder, tmp_path, config,
                                                                   problem):
    folder = _hf_copy(hf_folder, tmp_path / "hf", config)
    config_path = os.path.join(folder, "config.json")
    with pytest.raises(ValueError, match=re.escape(repr(config_path)) + ".*" + re.escape(problem)):
        vit_keras.build_model_from_checkpoint(folder)


def test_a_shard_index_cannot_name_files_outside_its_folder(hf_folder, tmp_path):
    folder = _hf_copy(hf_folder, tmp_path / "hf", lambda c: json.dumps(c))
    outside = str(tmp_path / "outside.safetensors")
    os.rename(os.path.join(folder, "model.safetensors"), outside)
    keys = safetensors.torch.load_file(outside)
    index = os.path.join(folder, "model.safetensors.index.json")
    for shard in ("../outside.safetensors", outside):
        with open(index, "w") as f:
            json.dump({"metadata": {}, "weight_map": {key: shard for key in keys}}, f)
        with pytest.raises(ValueError, match=re.escape(f"{index!r} names the shard {shard!r}, "
                                                       f"which is not a file in its folder")):
            vit_keras.load_pretrained(keras_vit(layer_norm_epsilon=1e-12), folder)
    with open(index, "w") as f:
        json.dump({"weight_map": {key: "model-00001-of-00002.safetensors" for key in keys}}, f)
    with pytest.raises(FileNotFoundError, match="names the shard 'model-00001-of-00002.safetensors'"
                                                ", which is missing"):
        vit_keras.load_pretrained(keras_vit(layer_norm_epsilon=1e-12), folder)


def test_nan_or_inf_is_refused_with_the_arrays_names_unless_allowed(tmp_path):
    params = official_params()
    params["Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel"][0, 0] = np.nan
    params["embedding/bias"][2] = np.inf
    path = write_npz(tmp_path / "diverged.npz", params)
    model = keras_vit()
    before = _weights(model)
    with pytest.raises(errors.CheckpointError, match=re.escape(
            f"{path!r} holds NaN or Inf values in 2 arrays (Transformer/encoderblock_1/MlpBlock_3/"
            f"Dense_0/kernel, embedding/bias)") + ".*pass allow_non_finite=True"):
        vit_keras.load_pretrained(model, path)
    for old, new in zip(before, _weights(model)):
        np.testing.assert_array_equal(old, new)  # nothing was assigned
    with pytest.raises(ValueError, match="NaN or Inf"):
        vit_keras.build_model_from_checkpoint(path)
    vit_keras.load_pretrained(model, path, allow_non_finite=True)
    assert np.isinf(keras.ops.convert_to_numpy(model.get_layer("embedding").bias)[2])
    model = vit_keras.build_model_from_checkpoint(path, allow_non_finite=True)
    kernel = next(w for w in model.weights if w.path == "encoderblock_1/MlpBlock_3/Dense_0/kernel")
    assert np.isnan(keras.ops.convert_to_numpy(kernel)[0, 0])


def test_many_non_finite_arrays_are_summed_up(tmp_path):
    params = {key: np.full_like(value, np.nan) for key, value in official_params().items()}
    path = write_npz(tmp_path / "nan.npz", params)
    shown = ", ".join(sorted(params)[:10])
    with pytest.raises(ValueError, match=re.escape(f"in {len(params)} arrays ({shown}, and "
                                                   f"{len(params) - 10} more)")):
        vit_keras.load_pretrained(keras_vit(), path)


def test_a_wrong_variant_says_so_first_and_sums_up_the_mismatches(tmp_path):
    tiny = vit_keras.build_model("ViT-Ti/16", image_size=32, num_classes=CLASSES)
    path = vit_keras.save_npz(tiny, str(tmp_path / "ti16.npz"))
    small = vit_keras.build_model("ViT-S/16", image_size=32, num_classes=CLASSES)
    with pytest.raises(errors.CheckpointError) as error:
        vit_keras.load_pretrained(small, path)
    first_line, *listed = str(error.value).splitlines()
    assert first_line.startswith(
        f"Checkpoint {path!r} (vit_jax) does not fit model 'ViT-S_16': it holds a ViT-Ti/16 "
        f"(hidden_size 192, mlp_dim 768, num_heads 3), not the model's ViT-S/16 (hidden_size 384, "
        f"mlp_dim 1536, num_heads 6). Build the model"), first_line
    mismatches = sum(a.shape != b.shape for a, b in zip(tiny.weights, small.weights))
    assert listed[0] == f"{mismatches} differences:"
    assert all(line.startswith("  shape mismatch: ") for line in listed[1:11])  # the first 10
    assert listed[11:] == [f"  and {mismatches - 10} more"]


def test_build_model_weights_argument(tmp_path):
    path = write_npz(tmp_path / "vit.npz", official_params())
    model = keras_vit(weights=path)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.get_layer("head").kernel),
                                  official_params()["head/kernel"])


@pytest.mark.jax_subprocess
def test_reading_imports_neither_tensorflow_nor_torch_on_jax(tmp_path, hf_folder):
    npz = write_npz(tmp_path / "vit.npz", official_params())
    result = run_on_backend("jax", """
        import sys
        import vit_keras
        from vit_keras.weights import checkpoints
        for path in (ARGS["npz"], ARGS["hf"]):
            checkpoints.architecture(checkpoints.read_checkpoint(path))
        print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"tensorflow", "torch"})))
        """, npz=npz, hf=hf_folder[0])
    assert result == []
