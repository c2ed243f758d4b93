"""Parity with transformers for the ViT family's Hugging Face folders: DeiT (with its teacher head),
DINOv2 (with and without registers), SigLIP, CLIP and MAE.

Each family's model is built from a small random config (hidden 64, 2 layers, 2 heads, a 3x3 grid
of 14-pixel patches) with every parameter randomised (LayerScale, registers, the distillation token
and the MAP head's probe included, so a switch vit_keras misses changes the outputs), written with
`save_pretrained`, and read back by `vit_keras.build_model_from_checkpoint(folder)` alone: the folder's
`config.json` must say everything. Compared: the pooled output (`pooler_output`; DeiT with its
teacher: the averaged logits) and the last layer's tokens (`last_hidden_state`).
"""

import numpy as np
import pytest

import vit_keras
from vit_keras.inspection import features

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RTOL = 1e-4
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 128, "image_size": 42, "patch_size": 14}
CLASSES = 5


def relative(a, b):
    assert np.std(b) > 0.05, "reference outputs are too flat to compare meaningfully"
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _randomize(module, seed=0):
    """Realistic random values for every parameter, the zero- or one-initialised ones included."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if ("norm" in name or "lambda1" in name) and name.endswith(("weight", "lambda1")):
                value = 1 + 0.1 * torch.randn(parameter.shape, generator=generator)
            elif parameter.ndim >= 2 and "embed" not in name and "token" not in name:
                value = torch.randn(parameter.shape, generator=generator) * parameter[0].numel() ** -0.5
            else:
                value = 0.1 * torch.randn(parameter.shape, generator=generator)
            parameter.copy_(value)
    return module.eval()


def _images(size=SMALL["image_size"], seed=1):
    return np.random.default_rng(seed).normal(size=(2, size, size, 3)).astype("float32")


def _nchw(images):
    return torch.from_numpy(images).permute(0, 3, 1, 2)


# family: (the transformers model, its reference outputs: (pooled, tokens) from NCHW pixels)
def _deit_with_teacher():
    model = transformers.DeiTForImageClassificationWithTeacher(
        transformers.DeiTConfig(**SMALL, num_labels=CLASSES))
    return model, lambda x: (model(x).logits, model.deit(x).last_hidden_state)


def _deit():
    # DeiTModel's pooler (Dense + tanh on the class token) is dropped on loading, as no published
    # DeiT checkpoint trained one: vit_keras pools a distilled model by the mean of the class and
    # distillation tokens, as DeiT and timm do (`forward_head(pre_logits=True)`).
    model = transformers.DeiTModel(transformers.DeiTConfig(**SMALL), add_pooling_layer=True)

    def outputs(x):
        tokens = model(x).last_hidden_state
        return (tokens[:, 0] + tokens[:, 1]) / 2, tokens
    return model, outputs


def _dinov2():
    model = transformers.Dinov2Model(transformers.Dinov2Config(**SMALL, layerscale_value=0.1))
    return model, lambda x: (model(x).pooler_output, model(x).last_hidden_state)


def _dinov2_with_registers():
    model = transformers.Dinov2WithRegistersModel(transformers.Dinov2WithRegistersConfig(
        **SMALL, layerscale_value=0.1, num_register_tokens=4))
    return model, lambda x: (model(x).pooler_output, model(x).last_hidden_state)


def _siglip():
    model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SMALL))
    return model, lambda x: (model(x).pooler_output, model(x).last_hidden_state)


def _clip():
    model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SMALL))

    def outputs(x):
        out = model(x)
        # CLIP's last_hidden_state is the encoder's output before `post_layernorm`, which it applies
        # to the pooled class token only; vit_keras normalises every token (its encoder_norm), so
        # the tokens are compared after the same LayerNorm.
        return out.pooler_output, model.post_layernorm(out.last_hidden_state)
    return model, outputs


def _mae():
    model = transformers.ViTMAEModel(transformers.ViTMAEConfig(**SMALL, mask_ratio=0.0))

    def outputs(x):
        # ViTMAEModel shuffles the patches by argsort(noise) before dropping mask_ratio of them:
        # with no patch dropped and increasing noise the order is the identity. It has no pooled
        # output; vit_keras pools its class token (after the final LayerNorm), as MAE's encoder
        # hands it on.
        noise = torch.arange(SMALL["image_size"] ** 2 // SMALL["patch_size"] ** 2,
                             dtype=torch.float32).expand(x.shape[0], -1)
        tokens = model(x, noise=noise).last_hidden_state
        return tokens[:, 0], tokens
    return model, outputs


FAMILIES = {"deit_with_teacher": _deit_with_teacher, "deit": _deit, "dinov2": _dinov2,
            "dinov2_with_registers": _dinov2_with_registers, "siglip": _siglip, "clip": _clip,
            "mae": _mae}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """`(name, save_pretrained folder, reference pooled output, reference tokens)` for `_images()`."""
    model, outputs = FAMILIES[request.param]()
    _randomize(model)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    with torch.no_grad():
        pooled, tokens = outputs(_nchw(_images()))
    return request.param, str(folder), pooled.numpy(), tokens.numpy()


def test_pooled_output_matches_transformers(family):
    name, folder, pooled, _ = family
    # DeiT with its teacher: the classifier's logits (the two heads averaged); the others' pooled
    # representation, without a head (none of them has one).
    model = vit_keras.build_model_from_checkpoint(folder, include_preprocessing=False)
    assert (name == "deit_with_teacher") == (len(model.output.shape) == 2 and
                                             model.output.shape[-1] == CLASSES)
    assert relative(np.asarray(model.predict(_images(), verbose=0)), pooled) < RTOL


def test_last_layer_tokens_match_transformers(family):
    _, folder, _, tokens = family
    model = vit_keras.build_model_from_checkpoint(folder, include_top=False,
                                                  include_preprocessing=False)
    extractor = features.build_feature_extractor(model, blocks=[-1], output="tokens")
    found = np.asarray(extractor.predict(_images(), verbose=0))
    assert found.shape == tokens.shape  # [cls, dist, registers..., patches], as transformers' order
    assert relative(found, tokens) < RTOL


def test_a_full_clip_folder_loads_its_image_tower(tmp_path):
    # The hub's openai/clip-* folders are whole CLIPModels: vit_keras reads `vision_config` and the
    # `vision_model.` keys, and leaves the text tower and both projections out.
    model = _randomize(transformers.CLIPModel(transformers.CLIPConfig(
        vision_config=dict(SMALL), text_config={"hidden_size": 32, "num_hidden_layers": 1,
                                                    "num_attention_heads": 2,
                                                    "intermediate_size": 64})))
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        pooled = model.vision_model(_nchw(_images())).pooler_output.numpy()
    loaded = vit_keras.build_model_from_checkpoint(str(tmp_path), include_preprocessing=False)
    assert relative(np.asarray(loaded.predict(_images(), verbose=0)), pooled) < RTOL


def test_an_mae_pretraining_folder_loads_its_encoder(tmp_path):
    # The hub's facebook/vit-mae-* folders are ViTMAEForPreTraining: the decoder is left out.
    model = _randomize(transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(
        **SMALL, mask_ratio=0.0, decoder_hidden_size=32, decoder_num_hidden_layers=1,
        decoder_num_attention_heads=2, decoder_intermediate_size=64)))
    model.save_pretrained(tmp_path)
    noise = torch.arange(9, dtype=torch.float32).expand(2, -1)  # the identity order, see _mae
    with torch.no_grad():
        cls = model.vit(_nchw(_images()), noise=noise).last_hidden_state[:, 0].numpy()
    loaded = vit_keras.build_model_from_checkpoint(str(tmp_path), include_preprocessing=False)
    assert relative(np.asarray(loaded.predict(_images(), verbose=0)), cls) < RTOL
