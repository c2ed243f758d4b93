"""NaFlex inputs (`ViT(naflex=True)`): images at their native aspect ratio as a padded batch of
patches `{"patches", "patch_coord", "patch_valid"}`, the position grid resized per image, the
padding masked in every attention kernel and pooling; and SigLIP 2's NaFlex tower from a
transformers folder, against transformers on a batch that mixes aspect ratios."""

import json

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.model import ViT, attention

from conftest import NEXT_BACKEND, run_on_backend

BACKEND = keras.backend.backend()
PATCH = 4
TINY = dict(name="tiny", patch_size=PATCH, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=2)
# Each image's grid (rows, cols) against the model's 4x4: wider, taller, the same, larger.
GRIDS = ((2, 7), (5, 3), (4, 4), (6, 5))
LENGTH = 30  # the padded batch's tokens: every grid above fits


def _randomized(model, seed=0):
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        weight.assign(rng.normal(0, 0.2, weight.shape).astype("float32"))
    return model


def _image_patches(rows, cols, length, seed):
    """One image's NaFlex dict (batch 1) at `length` tokens: its patches row-major, then zeros."""
    rng = np.random.default_rng(seed)
    count = rows * cols
    patches = np.zeros((1, length, PATCH * PATCH * 3), "float32")
    coord = np.zeros((1, length, 2), "int32")
    valid = np.zeros((1, length), bool)
    patches[0, :count] = rng.uniform(0, 255, (count, PATCH * PATCH * 3))
    coord[0, :count] = [(row, col) for row in range(rows) for col in range(cols)]
    valid[0, :count] = True
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def _batch(grids=GRIDS, length=LENGTH):
    images = [_image_patches(rows, cols, length, seed) for seed, (rows, cols) in enumerate(grids)]
    return {key: np.concatenate([image[key] for image in images]) for key in images[0]}, images


def _numpy(x):
    return keras.ops.convert_to_numpy(x)


def _alone(model, images):
    """Each image through the model by itself, cut to its own patches (no padding at all)."""
    outputs = []
    for image in images:
        count = int(image["patch_valid"].sum())
        outputs.append(_numpy(model({key: value[:, :count] for key, value in image.items()})))
    return np.concatenate(outputs)


@pytest.mark.parametrize("classifier, switches", [
    ("token", {}), ("gap", {}), ("map", {}),
    ("token", {"num_registers": 2, "posemb_prefix": False}),
    ("gap", {"class_token": True, "posemb_interpolation": "bilinear"}),
    ("gap", {"posemb_preserve_aspect": True}),
    ("token", {"rope": {"kind": "axial", "ref_grid": (4, 4)}}),
    ("gap", {"rope": {"kind": "dinov3", "rotate_half": True}, "position_embedding": "none"}),
    ("token", {"rope": {"kind": "mixed", "xy": True}, "num_registers": 1}),
])
def test_a_padded_batch_gives_each_image_what_it_gives_alone(classifier, switches):
    model = _randomized(ViT({**TINY, **switches}, image_size=16, num_classes=5, naflex=True,
                            classifier=classifier))
    batch, images = _batch()
    padded = _numpy(model(batch))
    assert padded.shape == (len(GRIDS), 5) and np.std(padded) > 0.05
    np.testing.assert_allclose(padded, _alone(model, images), rtol=1e-5, atol=1e-5)


def _kernels():
    names = {"tensorflow": ["explicit", "fused"], "jax": ["explicit", "fused", "padded"],
             "torch": ["explicit", "torch"]}[BACKEND]
    return names


@pytest.mark.parametrize("kernel", _kernels())
def test_every_attention_kernel_masks_the_padding(kernel, monkeypatch):
    """Padding that changes must change no image's output, and each kernel gives the explicit
    one's outputs; `padded` is the cuDNN kernel's padded, length-masked function, run by XLA."""
    chosen = (attention.PaddedAttention("xla") if kernel == "padded"
              else attention.kernel_named(kernel))
    monkeypatch.setattr(attention, "choose_attention", lambda *a, probabilities=False, **k: (
        attention.kernel_named("explicit") if probabilities else chosen))
    model = _randomized(ViT(TINY, image_size=16, num_classes=5, naflex=True, classifier="map"))
    assert {block.attention.attention_kernel for block in model.blocks} == {chosen.name}
    batch, images = _batch()
    noisy = {**batch, "patches": np.where(batch["patch_valid"][..., None], batch["patches"],
                                          np.float32(1e4))}
    # The padding's coordinates too: a coordinate beyond an image's grid must not count.
    noisy["patch_coord"] = np.where(batch["patch_valid"][..., None], batch["patch_coord"], 9)
    out = _numpy(model(batch))
    np.testing.assert_allclose(_numpy(model(noisy)), out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, _alone(model, images), rtol=1e-4, atol=1e-4)


def test_a_square_models_checkpoint_runs_in_naflex_mode_as_the_square_model(tmp_path):
    """A NaFlex model takes the square model's checkpoint as it is: an image of the built grid,
    cut into patches, gives what the square model gives for the image."""
    square = _randomized(ViT(TINY, image_size=16, num_classes=5))
    path = str(tmp_path / "square.npz")
    vit_keras.save_npz(square, path)
    naflex = vit_keras.build_model(TINY, weights=path, image_size=16, num_classes=5, naflex=True)
    assert naflex.naflex
    image = np.random.default_rng(3).uniform(0, 255, (1, 16, 16, 3)).astype("float32")
    patches = image.reshape(1, 4, PATCH, 4, PATCH, 3).transpose(0, 1, 3, 2, 4, 5).reshape(1, 16, -1)
    coord = np.array([[(row, col) for row in range(4) for col in range(4)]], "int32")
    inputs = {"patches": patches, "patch_coord": coord, "patch_valid": np.ones((1, 16), bool)}
    np.testing.assert_allclose(_numpy(naflex(inputs)), _numpy(square(image)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("switches", [{}, {"rope": {"kind": "axial", "ref_grid": (4, 4)}}],
                         ids=["learned", "rotary"])
def test_a_naflex_model_saves_and_loads_on_another_backend(tmp_path, switches):
    model = _randomized(ViT({**TINY, **switches}, image_size=16, num_classes=5, naflex=True,
                            classifier="map"))
    path = str(tmp_path / "naflex.keras")
    model.save(path)
    batch, _ = _batch()
    np.savez(tmp_path / "batch.npz", **batch)
    found = run_on_backend(NEXT_BACKEND, """
        import keras, numpy as np
        import vit_keras
        model = keras.models.load_model(ARGS["path"])
        batch = dict(np.load(ARGS["batch"]))
        out = np.asarray(model.predict(batch, verbose=0))
        print(json.dumps({"naflex": model.naflex, "out": out.tolist()}))
    """, path=path, batch=str(tmp_path / "batch.npz"))
    assert found["naflex"]
    np.testing.assert_allclose(np.array(found["out"]), _numpy(model(batch)), rtol=1e-4, atol=1e-5)


def test_what_naflex_inputs_cannot_feed_is_refused_by_name():
    with pytest.raises(ValueError, match="hybrid's ResNet reads whole images"):
        ViT("R+ViT-Ti/16", image_size=32, naflex=True)
    with pytest.raises(ValueError, match="without dynamic_image_size"):
        ViT(TINY, image_size=16, naflex=True, dynamic_image_size=True)


# SigLIP 2's NaFlex tower from transformers --------------------------------------------------------

def _siglip2_folder(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_family_hf import _randomize  # pylint: disable=import-outside-toplevel

    model = _randomize(transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        patch_size=PATCH, num_patches=16)))
    folder = str(tmp_path / "siglip2")
    model.save_pretrained(folder)
    return torch, model, folder


def _siglip2_pooled(torch, reference, inputs):
    """transformers' `pooler_output` for NaFlex inputs of raw pixels: SigLIP's `(x - 127.5) /
    127.5`, each image's grid its largest valid coordinate + 1."""
    valid = inputs["patch_valid"]
    grids = np.where(valid[..., None], inputs["patch_coord"], 0).max(axis=1) + 1
    with torch.no_grad():
        return reference(
            pixel_values=torch.from_numpy(inputs["patches"] / 127.5 - 1.0).float(),
            pixel_attention_mask=torch.from_numpy(valid.astype("int64")),
            spatial_shapes=torch.from_numpy(grids)).pooler_output.numpy()


def test_siglip2_naflex_from_transformers_gives_its_pooled_features(tmp_path):
    torch, reference, folder = _siglip2_folder(tmp_path)
    batch, _ = _batch()
    expected = _siglip2_pooled(torch, reference, batch)
    model = vit_keras.build_model_from_checkpoint(folder, include_top=False)
    assert model.naflex and model.vit_config.posemb_interpolation == "bilinear"
    found = np.asarray(model.predict(batch, verbose=0))
    assert np.std(expected) > 0.05
    assert float(np.max(np.abs(found - expected)) / np.max(np.abs(expected))) < 1e-4
    square = vit_keras.build_model_from_checkpoint(folder, include_top=False, naflex=False)
    assert not square.naflex and square.image_size == (16, 16)


def test_a_siglip2_patch_embedding_without_its_patch_size_is_refused():
    from vit_keras.weights.checkpoints import names  # pylint: disable=import-outside-toplevel

    with pytest.raises(vit_keras.errors.CheckpointError, match="must give its patch_size"):
        names.from_huggingface({"embeddings.patch_embedding.weight": np.zeros((32, 50))}, 2,
                               patch_size=4)


# timm's NaFlexVit files (naflexvit_*: SigLIP 2's towers and timm's own) ---------------------------

def _naflexvit_folder(tmp_path, architecture, **model_args):
    """A timm hub folder of `architecture` narrowed to the tiny size: `model.safetensors` and the
    `config.json` timm writes beside it (the name, its tag, the data config, the model_args)."""
    torch = pytest.importorskip("torch")
    timm = pytest.importorskip("timm")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from test_family_hf import _randomize  # pylint: disable=import-outside-toplevel

    args = dict(patch_size=PATCH, embed_dim=32, depth=2, num_heads=2, pos_embed_grid_size=(4, 4),
                **model_args)
    reference = _randomize(timm.create_model(architecture, pretrained=False, num_classes=0, **args))
    folder = tmp_path / architecture
    folder.mkdir()
    safetensors_torch.save_file(reference.state_dict(), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "architecture": architecture, "num_classes": 0,
        "model_args": {key: value for key, value in args.items() if key != "pos_embed_grid_size"},
        "pretrained_cfg": {"tag": "test", "mean": [0.5] * 3, "std": [0.5] * 3,
                           "input_size": [3, 384, 384], "crop_pct": 1.0,
                           "interpolation": "bicubic"}}))
    return torch, reference, folder / "model.safetensors"


# Wider and taller than the built 4x4 grid too: the aspect-preserving grid resizes to 9x9.
NAFLEX_GRIDS = GRIDS + ((9, 2),)


@pytest.mark.parametrize("architecture, switches", [
    ("naflexvit_base_patch16_siglip", {"posemb_interpolation": "bilinear", "gelu": "tanh"}),
    ("naflexvit_base_patch16_par_gap", {"posemb_preserve_aspect": True, "num_registers": 4}),
    ("naflexvit_base_patch16_map", {"posemb_interpolation": "bicubic", "num_registers": 1}),
])
def test_a_timm_naflexvit_file_gives_timms_pooled_features(tmp_path, architecture, switches):
    """SigLIP 2's tower as timm holds it, and timm's own NaFlexViTs (registers, LayerScale, mean
    or attention pooling, the aspect-preserving grid): a batch mixing aspect ratios, raw pixels
    against timm's normalised patches."""
    torch, reference, path = _naflexvit_folder(tmp_path, architecture)
    batch, _ = _batch(NAFLEX_GRIDS, 40)
    with torch.no_grad():
        expected = reference({
            "patches": torch.from_numpy(batch["patches"] / 127.5 - 1.0).float(),
            "patch_coord": torch.from_numpy(batch["patch_coord"]).long(),
            "patch_valid": torch.from_numpy(batch["patch_valid"])}).numpy()
    model = vit_keras.build_model_from_checkpoint(str(path), include_top=False)
    assert model.naflex and model.image_size == (16, 16)
    assert {key: getattr(model.vit_config, key) for key in switches} == switches
    found = np.asarray(model.predict(batch, verbose=0))
    assert np.std(expected) > 0.05
    assert float(np.max(np.abs(found - expected)) / np.max(np.abs(expected))) < 1e-4


def test_a_timm_aspect_preserving_grid_holds_for_images_of_any_size_too(tmp_path):
    """The square model of a `_par` file with `dynamic_image_size=True` resizes its grid as timm's
    does for a whole image of another aspect ratio."""
    torch, reference, path = _naflexvit_folder(tmp_path, "naflexvit_base_patch16_par_gap")
    image = np.random.default_rng(5).uniform(0, 255, (1, 12, 28, 3)).astype("float32")
    with torch.no_grad():
        expected = reference(torch.from_numpy(
            (image / 127.5 - 1.0).transpose(0, 3, 1, 2).copy())).numpy()
    model = vit_keras.build_model_from_checkpoint(str(path), include_top=False, naflex=False,
                                                  dynamic_image_size=True)
    found = _numpy(model(image))
    assert float(np.max(np.abs(found - expected)) / np.max(np.abs(expected))) < 1e-4


def test_what_a_timm_naflexvit_file_does_not_say_or_vit_keras_lacks_is_refused(tmp_path):
    _, _, path = _naflexvit_folder(tmp_path, "naflexvit_base_patch16_parfac_gap")
    with pytest.raises(vit_keras.errors.CheckpointError, match="factorized position embeddings"):
        vit_keras.build_model_from_checkpoint(str(path), include_top=False)
    _, _, path = _naflexvit_folder(tmp_path, "naflexvit_base_patch16_gap")
    (path.parent / "config.json").unlink()
    with pytest.raises(vit_keras.errors.CheckpointError, match="timm_architecture="):
        vit_keras.build_model_from_checkpoint(str(path), include_top=False)
    with pytest.raises(vit_keras.errors.CheckpointError, match="RADIO"):
        vit_keras.build_model_from_checkpoint(
            str(path), include_top=False,
            timm_architecture="naflexvit_base_patch16_radio_v3.c_radio")


# The rotary families in NaFlex mode ----------------------------------------------------------------

@pytest.mark.parametrize("architecture", [
    "eva02_tiny_patch14_224.mim_in22k", "vit_small_patch16_dinov3",
    "vit_base_patch16_rope_mixed_224", "vit_pe_core_base_patch16_224"])
def test_a_rotary_family_in_naflex_mode_gives_timms_naflex_outputs(tmp_path, architecture):
    """Each image's rotary coordinates on its own grid (EVA-02's rescaled to its reference grid,
    DINOv3's in [-1, 1], RoPE-Mixed's learned frequencies, PE's from 1 on its own grid), as timm's
    NaFlexVit computes them for the same weights (`use_naflex=True`)."""
    torch = pytest.importorskip("torch")
    timm = pytest.importorskip("timm")
    from test_family_hf import _randomize  # pylint: disable=import-outside-toplevel
    from timm.models import naflexvit  # pylint: disable=import-outside-toplevel

    args = dict(patch_size=PATCH, embed_dim=32, depth=2, num_heads=2, img_size=16, num_classes=0)
    classic = _randomize(timm.create_model(architecture, pretrained=False, **args))
    # PE pools over its class token too; timm's NaFlex mode of it must be told so.
    pooling = {"pool_include_prefix": True} if "_pe_" in architecture else {}
    reference = timm.create_model(architecture, pretrained=False, use_naflex=True, **args,
                                  **pooling).eval()
    # timm's filter adds the class token's position embedding to the token in place: a copy.
    reference.load_state_dict(naflexvit.checkpoint_filter_fn(
        {key: value.clone() for key, value in classic.state_dict().items()}, reference))
    path = tmp_path / "classic.pth"
    torch.save(classic.state_dict(), path)
    batch, _ = _batch(NAFLEX_GRIDS, 40)
    with torch.no_grad():
        expected = reference({"patches": torch.from_numpy(batch["patches"]).float(),
                              "patch_coord": torch.from_numpy(batch["patch_coord"]).long(),
                              "patch_valid": torch.from_numpy(batch["patch_valid"])}).numpy()
    model = vit_keras.build_model_from_checkpoint(
        str(path), timm_architecture=architecture, num_heads=2, include_top=False, naflex=True,
        include_preprocessing=False)
    assert model.naflex and model.vit_config.rope is not None
    found = np.asarray(model.predict(batch, verbose=0))
    assert np.std(expected) > 0.05
    assert float(np.max(np.abs(found - expected)) / np.max(np.abs(expected))) < 1e-4


# big_vision's NaFlex .npz ------------------------------------------------------------------------

def _big_vision_naflex_npz(model, path, heads):
    """`model`'s (a transformers `Siglip2VisionModel`) weights in big_vision's NaFlex layout, as
    SigLIP 2's image-text `.npz` holds its image tower: `params/img/`, the blocks scanned along a
    leading axis with Flax Linen's names, the patch embedding a `Dense` over flattened (row,
    column, channel) patches, the grid `(rows, cols, width)`; a text tower beside it."""
    weights = {key: value.detach().numpy() for key, value in model.state_dict().items()}
    layers = model.config.num_hidden_layers
    width = model.config.hidden_size
    head_dim = width // heads

    def get(name):
        return weights[name]

    def stacked(name, transform):
        return np.stack([transform(get(f"encoder.layers.{i}.{name}")) for i in range(layers)])

    side = int(round(get("embeddings.position_embedding.weight").shape[0] ** 0.5))
    arrays = {"embedding/kernel": get("embeddings.patch_embedding.weight").T,
              "embedding/bias": get("embeddings.patch_embedding.bias"),
              "pos_embedding": get("embeddings.position_embedding.weight").reshape(side, side, -1),
              "Transformer/encoder_norm/scale": get("post_layernorm.weight"),
              "Transformer/encoder_norm/bias": get("post_layernorm.bias")}
    block = "Transformer/encoderblock/"
    for ours, theirs in (("LayerNorm_0", "layer_norm1"), ("LayerNorm_1", "layer_norm2")):
        arrays[f"{block}{ours}/scale"] = stacked(f"{theirs}.weight", lambda w: w)
        arrays[f"{block}{ours}/bias"] = stacked(f"{theirs}.bias", lambda w: w)
    for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        arrays[f"{block}MultiHeadDotProductAttention_0/{ours}/kernel"] = stacked(
            f"self_attn.{theirs}.weight", lambda w: w.T.reshape(width, heads, head_dim))
        arrays[f"{block}MultiHeadDotProductAttention_0/{ours}/bias"] = stacked(
            f"self_attn.{theirs}.bias", lambda b: b.reshape(heads, head_dim))
    arrays[f"{block}MultiHeadDotProductAttention_0/out/kernel"] = stacked(
        "self_attn.out_proj.weight", lambda w: w.T.reshape(heads, head_dim, width))
    arrays[f"{block}MultiHeadDotProductAttention_0/out/bias"] = stacked(
        "self_attn.out_proj.bias", lambda b: b)
    for index in (0, 1):
        for kind, transform in (("weight", lambda w: w.T), ("bias", lambda b: b)):
            arrays[f"{block}MlpBlock_0/Dense_{index}/{'kernel' if kind == 'weight' else 'bias'}"] = (
                stacked(f"mlp.fc{index + 1}.{kind}", transform))
    head = "MAPHead_0/"
    arrays[head + "probe"] = get("head.probe")
    in_weight, in_bias = get("head.attention.in_proj_weight"), get("head.attention.in_proj_bias")
    for index, name in enumerate(("query", "key", "value")):
        part = slice(index * width, (index + 1) * width)
        arrays[f"{head}MultiHeadDotProductAttention_0/{name}/kernel"] = (
            in_weight[part].T.reshape(width, heads, head_dim))
        arrays[f"{head}MultiHeadDotProductAttention_0/{name}/bias"] = (
            in_bias[part].reshape(heads, head_dim))
    arrays[f"{head}MultiHeadDotProductAttention_0/out/kernel"] = (
        get("head.attention.out_proj.weight").T.reshape(heads, head_dim, width))
    arrays[f"{head}MultiHeadDotProductAttention_0/out/bias"] = get("head.attention.out_proj.bias")
    arrays[head + "LayerNorm_0/scale"] = get("head.layernorm.weight")
    arrays[head + "LayerNorm_0/bias"] = get("head.layernorm.bias")
    for index in (0, 1):
        arrays[f"{head}MlpBlock_0/Dense_{index}/kernel"] = get(f"head.mlp.fc{index + 1}.weight").T
        arrays[f"{head}MlpBlock_0/Dense_{index}/bias"] = get(f"head.mlp.fc{index + 1}.bias")
    arrays = {f"params/img/{key}": value for key, value in arrays.items()}
    arrays.update({"params/txt/Embed_0/embedding": np.zeros((8, 4), "float32"),
                   "params/t": np.zeros((1,), "float32"), "params/b": np.zeros((1,), "float32")})
    np.savez(path, **arrays)
    return path


def test_a_big_vision_naflex_npz_gives_the_towers_pooled_features(tmp_path):
    """SigLIP 2's image tower as big_vision's `.npz` holds it reads as a NaFlex model (bilinear
    grid, tanh GELU, the MAP head over the valid patches) and gives what transformers' copy of
    the same weights gives, on a batch mixing aspect ratios."""
    torch, reference, _ = _siglip2_folder(tmp_path)
    path = _big_vision_naflex_npz(reference, str(tmp_path / "siglip2_naflex.npz"), heads=2)
    batch, _ = _batch()
    expected = _siglip2_pooled(torch, reference, batch)
    model = vit_keras.build_model_from_checkpoint(path, include_top=False)
    assert model.naflex and model.image_size == (16, 16)
    assert (model.vit_config.posemb_interpolation, model.vit_config.gelu) == ("bilinear", "tanh")
    found = np.asarray(model.predict(batch, verbose=0))
    assert np.std(expected) > 0.05
    assert float(np.max(np.abs(found - expected)) / np.max(np.abs(expected))) < 1e-4


@pytest.mark.backend_independent("jax")
def test_the_bilinear_grid_is_resized_as_big_visions_scale_and_translate():
    """big_vision resizes the grid of each image with `jax.image.scale_and_translate(bilinear,
    antialias=True)` and gathers it by coordinate: the same numbers, shrinking and growing."""
    jax = pytest.importorskip("jax")
    from vit_keras.model.position_embeddings import NaFlexPositionEmbs  # pylint: disable=import-outside-toplevel

    layer = NaFlexPositionEmbs((6, 5), num_prefix_tokens=0, interpolation="bilinear")
    layer.build((None, None, 8))
    grid = np.random.default_rng(4).normal(size=(6, 5, 8)).astype("float32")
    layer.pos_embedding.assign(grid.reshape(1, 30, 8))
    for rows, cols in ((2, 3), (6, 5), (11, 4), (3, 13)):
        coord = np.array([[(row, col) for row in range(rows) for col in range(cols)]], "int32")
        resized = jax.image.scale_and_translate(
            grid, (rows, cols, 8), (0, 1), np.array([rows / 6, cols / 5], "float32"),
            np.zeros(2, "float32"), method="bilinear", antialias=True)
        found = _numpy(layer.at(coord))[0]
        np.testing.assert_allclose(found, np.asarray(resized).reshape(rows * cols, 8), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.slow
@pytest.mark.backend_independent("torch")  # fetching and checking: no backend; parity: above
def test_siglip2_naflex_loads_by_name_from_a_mirror_of_big_visions_bucket(tmp_path, monkeypatch):
    """`weights="siglip2_naflex"`: the B/16 tower's `.npz` at its path below the bucket, fetched
    with the MD5 the bucket publishes, checked as the release's (its grid, MAP head, tanh GELU)
    and built as a NaFlex model that gives transformers' pooled features."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_family_hf import _randomize  # pylint: disable=import-outside-toplevel

    from vit_keras.weights import download, releases  # pylint: disable=import-outside-toplevel

    from weights_mirror import MirrorServer  # pylint: disable=import-outside-toplevel

    release = releases.find_release("ViT-B/16", "siglip2_naflex")
    reference = _randomize(transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(
        num_patches=256)))
    path = tmp_path / "bucket" / release.path
    path.parent.mkdir(parents=True)
    _big_vision_naflex_npz(reference, str(path), heads=12)
    server = MirrorServer(tmp_path / "bucket")
    try:
        server.publish_hashes("gcs")
        monkeypatch.setenv(download.HOME_VARIABLE, str(tmp_path / "cache"))
        monkeypatch.setenv(download.MIRROR_VARIABLE, server.url)
        model = vit_keras.build_model("ViT-B/16", weights="siglip2_naflex", include_top=False)
    finally:
        server.stop()
    assert model.naflex and model.output_shape == (None, 768)
    assert (model.vit_config.posemb_interpolation, model.vit_config.gelu) == ("bilinear", "tanh")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (48, 200, 3)).astype("uint8"),
              rng.integers(0, 256, (300, 90, 3)).astype("uint8")]
    inputs = vit_keras.naflex_patches(images, patch_size=16, max_num_patches=64)
    expected = _siglip2_pooled(torch, reference, inputs)
    found = np.asarray(model.predict(inputs, verbose=0))
    assert float(np.max(np.abs(found - expected)) / np.max(np.abs(expected))) < 1e-4
