"""Hybrid (ResNet + ViT) checkpoints: R50+ViT-B/16 logit parity with timm's own loader on every
backend, timm hybrid state dicts, position embeddings resampled on the feature-map grid, and a
hybrid `.keras` file read on another backend.

The official `.npz` is written here with the key names spelled out literally (not through
vit_keras' name map), GroupNorm parameters stored `(1, 1, 1, C)` as in the published files, and
realistic statistics: conv kernels N(0, 1/fan_in), GroupNorm scales N(1, 0.1) — gn3 included: a
zero gn3 scale (the training initialisation) would turn every residual branch into a constant
(gn3's bias) and leave conv1 to conv3 untested.

Tolerances, max|a - b| / max|b| in float32:
- `hybrid_numerics="timm"`: the same weight standardisation (w - mean) / sqrt(var + 1e-8) and
  GroupNorm epsilon 1e-5 as timm, so only float32 rounding through 16 residual units and 2
  encoder blocks differs: RTOL 1e-4 (seen: 1.1e-5 jax, 1.5e-5 tensorflow, 2e-5 torch).
- `hybrid_numerics="vit_jax"` (the default, the original models' numerics): (w - mean) /
  (std + 1e-5) and GroupNorm epsilon 1e-6 against timm's; each GroupNorm renormalises most of the
  difference away: RTOL_VIT_JAX 1e-3 (seen: 3.0e-4 to 3.2e-4 on all three backends — above RTOL,
  so the tight test also tells the two numerics apart).
"""

import dataclasses
from functools import partial

import keras
import numpy as np
import pytest
import safetensors.torch
import scipy.ndimage
from test_checkpoints import images, keras_logits, relative, torch_logits, write_npz
import timm
from timm.models.vision_transformer import VisionTransformer, _load_weights, checkpoint_filter_fn
from timm.models.vision_transformer_hybrid import HybridEmbed, _resnetv2
import torch

import vit_keras
from vit_keras.weights import checkpoints

from conftest import NEXT_BACKEND, run_on_backend

RTOL = 1e-4
RTOL_VIT_JAX = 1e-3
CLASSES = 5

# R50+ViT-B/16 with its real ResNet-50 (3, 4, 9) and width, but 2 encoder blocks at 64 px (a 4x4
# grid of 1x1 patches on the stride-16 feature map): timm's vit_base_r50_s16_384 with depth=2.
R50_B16 = {"name": "R50+ViT-B/16-depth2", "patch_size": 1, "hidden_size": 768, "mlp_dim": 3072,
           "num_heads": 12, "num_layers": 2, "resnet_layers": (3, 4, 9)}
# A cheap staged hybrid with the same stride 16 (one unit per stage), for resampling tests.
SMALL = {"name": "R-small", "patch_size": 1, "hidden_size": 32, "mlp_dim": 64, "num_heads": 4,
         "num_layers": 2, "resnet_layers": (1, 1, 1)}


def official_hybrid_params(config, grid, classes=CLASSES, seed=0):
    """A hybrid checkpoint in vit_jax's published layout (`R50+ViT-B_16.npz`), literal names.

    `config`: a dict of `ViTConfig` fields; `grid`: the side of the square patch grid."""
    rng = np.random.default_rng(seed)
    d, m, h = config["hidden_size"], config["mlp_dim"], config["num_heads"]

    def kernel(*shape):
        return rng.normal(0, np.prod(shape[:-1]) ** -0.5, shape).astype("float32")

    def small(*shape, std=0.02):
        return rng.normal(0, std, shape).astype("float32")

    def group_norm(prefix, channels):
        p[prefix + "/scale"] = 1 + small(1, 1, 1, channels, std=0.1)
        p[prefix + "/bias"] = small(1, 1, 1, channels, std=0.1)

    p = {"conv_root/kernel": kernel(7, 7, 3, 64)}
    group_norm("gn_root", 64)
    channels = 64
    for s, units in enumerate(config["resnet_layers"]):
        width = 64 * 2 ** s
        for u in range(units):
            b = f"block{s + 1}/unit{u + 1}/"
            if u == 0:  # the shape (and, after stage 1, the stride) changes: projection shortcut
                p[b + "conv_proj/kernel"] = kernel(1, 1, channels, 4 * width)
                group_norm(b + "gn_proj", 4 * width)
            p[b + "conv1/kernel"] = kernel(1, 1, channels, width)
            group_norm(b + "gn1", width)
            p[b + "conv2/kernel"] = kernel(3, 3, width, width)
            group_norm(b + "gn2", width)
            p[b + "conv3/kernel"] = kernel(1, 1, width, 4 * width)
            group_norm(b + "gn3", 4 * width)
            channels = 4 * width
    patch = config["patch_size"]
    p["embedding/kernel"] = kernel(patch, patch, channels, d)
    p["embedding/bias"] = small(d)
    p["cls"] = small(1, 1, d, std=0.1)
    p["Transformer/posembed_input/pos_embedding"] = small(1, grid * grid + 1, d, std=0.1)
    for i in range(config["num_layers"]):
        b = f"Transformer/encoderblock_{i}/"
        for ln in ("LayerNorm_0", "LayerNorm_2"):
            p[f"{b}{ln}/scale"] = 1 + small(d, std=0.1)
            p[f"{b}{ln}/bias"] = small(d, std=0.05)
        for name in ("query", "key", "value"):
            p[f"{b}MultiHeadDotProductAttention_1/{name}/kernel"] = kernel(d, h, d // h)
            p[f"{b}MultiHeadDotProductAttention_1/{name}/bias"] = small(h, d // h)
        p[f"{b}MultiHeadDotProductAttention_1/out/kernel"] = rng.normal(
            0, d ** -0.5, (h, d // h, d)).astype("float32")
        p[f"{b}MultiHeadDotProductAttention_1/out/bias"] = small(d)
        p[f"{b}MlpBlock_3/Dense_0/kernel"] = kernel(d, m)
        p[f"{b}MlpBlock_3/Dense_0/bias"] = small(m)
        p[f"{b}MlpBlock_3/Dense_1/kernel"] = kernel(m, d)
        p[f"{b}MlpBlock_3/Dense_1/bias"] = small(d)
    p["Transformer/encoder_norm/scale"] = 1 + small(d, std=0.1)
    p["Transformer/encoder_norm/bias"] = small(d, std=0.05)
    p["head/kernel"] = kernel(d, classes)
    p["head/bias"] = small(classes)
    return p


def timm_small(image_size):
    """timm's hybrid ViT around a (1, 1, 1) ResNetV2, the peer of SMALL."""
    return VisionTransformer(
        img_size=image_size, patch_size=1, embed_dim=SMALL["hidden_size"],
        depth=SMALL["num_layers"], num_heads=SMALL["num_heads"],
        mlp_ratio=SMALL["mlp_dim"] / SMALL["hidden_size"], num_classes=CLASSES,
        embed_layer=partial(HybridEmbed, backbone=_resnetv2(layers=SMALL["resnet_layers"])))


def keras_hybrid(config, image_size, **kwargs):
    return vit_keras.build_model(config, image_size=image_size, num_classes=CLASSES,
                                 include_preprocessing=False, **kwargs)


def randomize_timm(module, seed=0):
    """Realistic values for every parameter of a timm (hybrid) ViT, norms' scales near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                value = 1 + 0.1 * torch.randn(parameter.shape, generator=generator)
            elif parameter.ndim >= 2 and name not in ("pos_embed", "cls_token"):
                value = torch.randn(parameter.shape, generator=generator) * parameter[0].numel() ** -0.5
            else:
                value = 0.05 * torch.randn(parameter.shape, generator=generator)
            parameter.copy_(value)
    return module


# --- R50+ViT-B/16: the official .npz through timm's loader and through vit_keras --------------

@pytest.fixture(scope="module")
def r50_checkpoint(tmp_path_factory):
    """`(npz path, timm model loaded from it by timm's _load_weights, its logits on images(64, 64))`."""
    path = write_npz(tmp_path_factory.mktemp("r50") / "R50+ViT-B_16.npz",
                     official_hybrid_params(R50_B16, grid=4))
    reference = timm.create_model("vit_base_r50_s16_384", pretrained=False, img_size=64, depth=2,
                                  num_classes=CLASSES)
    _load_weights(reference, path)  # its `hybrid` branch: conv_root, gn_root, block{s}/unit{u}
    return path, reference, torch_logits(reference, images(64, 64))


@pytest.fixture(scope="module")
def r50_timm_numerics():
    """One vit_keras R50+ViT-B/16 (2 blocks, 64 px) with timm's numerics, shared: building and
    compiling the ResNet-50 is most of this file's time."""
    return keras_hybrid(R50_B16, 64, hybrid_numerics="timm")


@pytest.mark.slow  # over 5 s alone: out of make test-fast
def test_r50_vit_b16_npz_matches_timm_with_timm_numerics(r50_checkpoint, r50_timm_numerics):
    path, _, expected = r50_checkpoint
    model = vit_keras.load_pretrained(r50_timm_numerics, path)
    assert model.get_layer("resnet").output.shape == (None, 4, 4, 1024)
    error = relative(keras_logits(model, images(64, 64)), expected)
    print(f"R50+ViT-B/16 npz, timm numerics, {keras.backend.backend()}: relative error {error:.2g}")
    assert error < RTOL


@pytest.mark.slow  # over 5 s alone: out of make test-fast
def test_r50_vit_b16_npz_matches_timm_loosely_with_vit_jax_numerics(r50_checkpoint):
    path, _, expected = r50_checkpoint
    model = vit_keras.load_pretrained(keras_hybrid(R50_B16, 64), path)  # hybrid_numerics="vit_jax"
    error = relative(keras_logits(model, images(64, 64)), expected)
    print(f"R50+ViT-B/16 npz, vit_jax numerics, {keras.backend.backend()}: relative error "
          f"{error:.2g}")
    assert error < RTOL_VIT_JAX


def test_timm_r50_hybrid_state_dict_matches_timm(r50_checkpoint, r50_timm_numerics, tmp_path):
    # timm's own names (patch_embed.backbone.stem.conv, stages.{s}.blocks.{u}.conv1, downsample,
    # OIHW convs), saved with safetensors.
    _, reference, expected = r50_checkpoint
    path = str(tmp_path / "vit_base_r50_s16.safetensors")
    safetensors.torch.save_file(reference.state_dict(), path)
    arch = checkpoints.architecture(checkpoints.read_checkpoint(path))
    assert arch["config"] == {"patch_size": 1, "hidden_size": 768, "mlp_dim": 3072,
                              "num_heads": 12, "num_layers": 2, "resnet_layers": (3, 4, 9),
                              "resnet_width": 1}
    assert arch["grid"] == (4, 4) and arch["num_classes"] == CLASSES
    model = r50_timm_numerics
    for weight in model.weights:  # wipe what an earlier test loaded
        weight.assign(np.zeros(weight.shape, weight.dtype))
    vit_keras.load_pretrained(model, path)
    assert relative(keras_logits(model, images(64, 64)), expected) < RTOL


def test_timm_root_only_hybrid_state_dict_matches_timm(tmp_path):
    # vit_tiny_r_s16_p8_224: the backbone is the ResNet root itself (patch_embed.backbone.conv).
    reference = randomize_timm(timm.create_model("vit_tiny_r_s16_p8_224", pretrained=False,
                                                 img_size=64, depth=2, num_classes=CLASSES))
    path = str(tmp_path / "vit_tiny_r.safetensors")
    safetensors.torch.save_file(reference.state_dict(), path)
    config = dataclasses.replace(vit_keras.VARIANTS["R+ViT-Ti/16"], num_layers=2)
    model = vit_keras.load_pretrained(keras_hybrid(config, 64, hybrid_numerics="timm"), path)
    x = images(64, 64)
    assert relative(keras_logits(model, x), torch_logits(reference, x)) < RTOL


# --- position embeddings resample on the feature-map grid (64 px → 96 px: 4x4 → 6x6) -----------

@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    params = official_hybrid_params(SMALL, grid=4)
    return params, write_npz(tmp_path_factory.mktemp("small") / "small.npz", params)


def test_hybrid_npz_resamples_position_embeddings_on_the_feature_map_grid(small_checkpoint):
    # timm's _load_weights resamples to model.patch_embed.grid_size (the feature map's 6x6), bilinear.
    _, path = small_checkpoint
    reference = timm_small(96)
    _load_weights(reference, path)
    model = vit_keras.load_pretrained(keras_hybrid(SMALL, 96, hybrid_numerics="timm"), path,
                                      interpolation="bilinear")
    assert model.get_layer("posembed_input").output.shape == (None, 37, SMALL["hidden_size"])
    x = images(96, 96)
    assert relative(keras_logits(model, x), torch_logits(reference, x)) < RTOL


def test_hybrid_npz_default_resampling_is_vit_jax_zoom_on_the_feature_map_grid(small_checkpoint,
                                                                               tmp_path):
    # vit_jax zooms the 4x4 grid to 6x6 with scipy.ndimage.zoom(order=1); done here once, timm
    # reads the result at the new size, vit_keras resamples the original file itself.
    params, path = small_checkpoint
    posemb = params["Transformer/posembed_input/pos_embedding"]
    d = SMALL["hidden_size"]
    grid = scipy.ndimage.zoom(posemb[0, 1:].reshape(4, 4, d), (6 / 4, 6 / 4, 1), order=1)
    zoomed = {**params, "Transformer/posembed_input/pos_embedding": np.concatenate(
        [posemb[:, :1], grid.reshape(1, 36, d)], axis=1)}
    reference = timm_small(96)
    _load_weights(reference, write_npz(tmp_path / "zoomed.npz", zoomed))
    model = vit_keras.load_pretrained(keras_hybrid(SMALL, 96, hybrid_numerics="timm"), path)
    x = images(96, 96)
    assert relative(keras_logits(model, x), torch_logits(reference, x)) < RTOL


def test_timm_hybrid_state_dict_resampled_like_timm(tmp_path):
    # timm's checkpoint_filter_fn resamples state dicts bicubic with antialias to the new feature
    # grid: vit_keras' default for timm files.
    source = randomize_timm(timm_small(64))
    path = str(tmp_path / "small.safetensors")
    safetensors.torch.save_file(source.state_dict(), path)
    reference = timm_small(96)
    reference.load_state_dict(checkpoint_filter_fn(source.state_dict(), reference))
    model = vit_keras.load_pretrained(keras_hybrid(SMALL, 96, hybrid_numerics="timm"), path)
    x = images(96, 96)
    assert relative(keras_logits(model, x), torch_logits(reference, x)) < RTOL


# --- a hybrid .keras file on another backend --------------------------------------------------

@pytest.mark.slow
def test_hybrid_keras_file_gives_the_same_logits_on_another_backend(small_checkpoint, tmp_path):
    _, path = small_checkpoint
    model = vit_keras.load_pretrained(keras_hybrid(SMALL, 64), path)
    saved = str(tmp_path / "small_hybrid.keras")
    model.save(saved)
    x = images(64, 64)
    np.save(tmp_path / "x.npy", x)
    expected = keras_logits(model, x)
    result = run_on_backend(NEXT_BACKEND, """
        import keras
        import numpy as np
        import vit_keras  # registers the layers
        model = keras.models.load_model(ARGS["path"])
        x = np.load(ARGS["x"])
        print(json.dumps({"logits": np.asarray(model.predict_on_batch(x)).tolist(),
                          "numerics": model.get_layer("resnet").group_norm_epsilon}))
        """, path=saved, x=str(tmp_path / "x.npy"))
    assert result["numerics"] == 1e-6  # vit_jax numerics survive the round trip
    # Two backends' float32 kernels (convolution, GroupNorm, attention) round differently.
    error = relative(np.asarray(result["logits"]), expected)
    print(f"hybrid .keras, {keras.backend.backend()} → {NEXT_BACKEND}: relative error {error:.2g}")
    assert error < RTOL
