"""The `ViT` model object: its config is its constructor's arguments, it owns its structure, and
models saved before it existed still load and are adopted."""

import os

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.model import ViT, heads, layers

DATA = os.path.join(os.path.dirname(__file__), "data")
TINY = dict(name="tiny", patch_size=8, hidden_size=32, mlp_dim=64, num_heads=2, num_layers=3)


def _images(model, batch=2, seed=0):
    height, width = model.image_size
    return np.random.default_rng(seed).uniform(0, 255, (batch, height, width, 3)).astype("float32")


def _randomized(model, seed=0):
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        weight.assign(rng.normal(0, 0.1, weight.shape).astype("float32"))
    return model


def test_a_keras_file_of_the_functional_model_before_vit_loads_and_is_adopted_alike():
    # Written by main at 21b95ce (a functional keras.Model): a DeiT-like tiny model with a
    # distillation token, a register, LayerScale and position embeddings on the patches only.
    legacy = keras.models.load_model(os.path.join(DATA, "legacy_vit.keras"))
    expected = np.load(os.path.join(DATA, "legacy_vit_logits.npz"))
    np.testing.assert_allclose(legacy.predict(expected["images"], verbose=0), expected["logits"],
                               rtol=1e-5, atol=1e-5)
    adopted = ViT.of(legacy)
    assert isinstance(adopted, ViT) and not isinstance(legacy, ViT)
    assert adopted.prefix_tokens == ["class", "distillation", "register"]
    assert not adopted.vit_config.posemb_prefix and adopted.vit_config.layer_scale_init == 0.1
    np.testing.assert_allclose(adopted.predict(expected["images"], verbose=0), expected["logits"],
                               rtol=1e-5, atol=1e-5)
    # What users do with it: features and a dynamic-size copy work on the loaded model.
    features = vit_keras.intermediate_features(legacy, expected["images"], blocks=[-1],
                                               output="pooled")
    assert features.shape == (2, 32)
    assert vit_keras.with_dynamic_image_size(legacy).dynamic_image_size


def test_a_rotary_vit_saved_with_flat_rope_fields_loads_and_predicts_as_before():
    # Written by main at 17f9db0, when a ViTConfig held its rotary options as flat fields
    # (`rope: "dinov3"`, `rope_temperature`, `rope_rotate_half`, ...): a tiny DINOv3-like model.
    model = keras.models.load_model(os.path.join(DATA, "rope_vit_17f9db0.keras"))
    expected = np.load(os.path.join(DATA, "rope_vit_17f9db0_logits.npz"))
    assert model.vit_config.rope == vit_keras.model.position_embeddings.RopeSpec(
        "dinov3", temperature=100.0, rotate_half=True)
    assert model.rotary_rotation is not None  # now turned once per forward
    np.testing.assert_allclose(model.predict(expected["images"], verbose=0), expected["logits"],
                               rtol=1e-5, atol=1e-5)
    assert ViT.from_config(model.get_config()).vit_config == model.vit_config


@pytest.mark.parametrize("arguments", [
    dict(),
    dict(classifier="gap"),
    dict(classifier="map", dynamic_image_size=True),
    dict(variant={**TINY, "distillation": True, "num_registers": 2}),
    dict(variant={**TINY, "fc_norm": True, "class_token": True}, classifier="gap",
         normalization="imagenet"),
    dict(variant={**TINY, "resnet_layers": (), "patch_size": 1}, image_size=64,
         representation_size=16),
], ids=["token", "gap", "map-dynamic", "distilled-registers", "fc_norm", "hybrid"])
def test_a_vit_saves_and_loads_as_itself_computing_the_same(tmp_path, arguments):
    model = _randomized(ViT(**{"variant": TINY, "image_size": 32, "num_classes": 5,
                               **arguments}))
    images = _images(model)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is ViT
    assert loaded.get_config() == model.get_config()
    np.testing.assert_allclose(loaded.predict(images, verbose=0), model.predict(images, verbose=0),
                               rtol=1e-5, atol=1e-5)


def test_the_config_is_the_constructor_arguments_with_the_overrides_folded_in():
    model = ViT(TINY, image_size=(32, 48), layer_norm_epsilon=1e-5, gelu="tanh")
    config = model.get_config()
    assert config["variant"]["layer_norm_epsilon"] == 1e-5
    assert config["variant"]["gelu"] == "tanh"
    assert config["image_size"] == [32, 48]
    assert ViT.from_config(config).count_params() == model.count_params()


def test_the_model_names_its_parts():
    model = ViT({**TINY, "num_registers": 1, "pre_norm": True}, image_size=32,
                representation_size=8)
    assert [block.name for block in model.blocks] == [f"encoderblock_{i}" for i in range(3)]
    assert model.token_grid == (4, 4) and model.token_pixels == 8
    assert model.prefix_tokens == ["class", "register"] and model.num_prefix_tokens == 2
    assert isinstance(model.patch_embedding, layers.PatchEmbedding)
    assert isinstance(model.pooling.layers[0], heads.TokenPooling)
    assert [layer.name for layer in model.classifier_layers] == ["pre_logits", "head"]
    assert len(model.norms) == 1 + 2 * 3 + 1
    assert len(model.lora_targets) == 6 * 3
    groups = model.layer_groups()
    assert [name for name, _ in groups] == ["embeddings"] + [b.name for b in model.blocks]
    assert {layer.name for layer in groups[0][1]} == {"embedding", "cls", "reg", "posembed_input",
                                                      "pre_norm"}


def test_rebuilt_keeps_the_weights_and_refuses_unknown_arguments():
    model = _randomized(ViT(TINY, image_size=32, num_classes=5, dropout=0.1))
    images = _images(model)
    copy = model.rebuilt(dropout=0.0)
    assert copy.get_config()["dropout"] == 0.0
    np.testing.assert_allclose(copy.predict(images, verbose=0), model.predict(images, verbose=0),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Unknown ViT arguments"):
        model.rebuilt(dropuot=0.0)
    with pytest.raises(ValueError, match="no counterpart|is"):
        model.rebuilt(num_classes=7)


def test_an_attention_kernel_named_as_an_argument_is_every_blocks():
    model = ViT(TINY, image_size=32, attention="explicit")
    assert {block.attention.attention_kernel for block in model.blocks} == {"explicit"}
    with pytest.raises(ValueError, match="Unknown attention kernel"):
        ViT(TINY, image_size=32, attention="flash")


def test_a_model_that_is_no_vit_is_refused_by_name():
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="mlp")
    with pytest.raises(ValueError, match="'mlp' is not a vit_keras ViT"):
        ViT.of(other)


def test_a_new_mlp_is_one_class_and_one_config_value(monkeypatch):
    # What the slots promise the next family (a gated MLP): register one class, name it in the
    # config, and the model builds, runs, saves and loads with it; nothing else changes.
    from vit_keras.model import mlp

    @keras.saving.register_keras_serializable(package="vit_keras_tests")
    class DoubledMlp(mlp.MlpBlock):
        def call(self, x, training=None):
            return 2.0 * super().call(x, training=training)

    monkeypatch.setitem(mlp.MLPS, "doubled", DoubledMlp)
    plain = _randomized(ViT(TINY, image_size=32, num_classes=5))
    doubled = ViT({**TINY, "mlp": "doubled"}, image_size=32, num_classes=5)
    assert {type(block.mlp) for block in doubled.blocks} == {DoubledMlp}
    doubled.set_weights(plain.get_weights())  # the same weights: only the MLP's call differs
    images = _images(plain)
    assert not np.allclose(doubled.predict(images, verbose=0), plain.predict(images, verbose=0))
    assert ViT.from_config(doubled.get_config()).get_config()["variant"]["mlp"] == "doubled"


def test_an_unknown_slot_value_is_refused_by_name():
    with pytest.raises(ValueError, match="Unknown MLP 'reglu'"):
        ViT({**TINY, "mlp": "reglu"}, image_size=32)
    with pytest.raises(ValueError, match="Unknown norm 'rms'"):
        ViT({**TINY, "norm": "rms"}, image_size=32)
    with pytest.raises(ValueError, match="unknown position_embedding 'rope'"):
        ViT({**TINY, "position_embedding": "rope"}, image_size=32)
    with pytest.raises(ValueError, match="Unknown rotary embedding 'spiral'"):
        ViT({**TINY, "rope": "spiral"}, image_size=32)


class _Reading:
    """A `ViTConfig` that records which of its fields are read (its methods' reads included)."""

    def __init__(self, config):
        self._config, self.read = config, set()

    def __getattr__(self, name):
        value = getattr(type(self._config), name, None)
        if callable(value):  # a method: bound to this recorder, so its reads count too
            return value.__get__(self)
        self.read.add(name)
        return getattr(self._config, name)


def test_every_switch_of_the_config_is_read_by_a_slots_spec_or_the_model_itself():
    # A new ViTConfig switch is a slot's option unless the model's own embedding stage reads it;
    # one read by nobody would be saved and loaded and never change the model.
    from vit_keras.model import attention, configs, mlp, norms, position_embeddings
    config = _Reading(configs.get_config(TINY))
    for reader in (norms.norm_spec, mlp.mlp_spec, attention.attention_spec,
                   position_embeddings.position_spec):
        reader(config)
    layers.token_spec(config, "token")
    heads.head_spec(config, "token")
    by_the_model = {"layer_scale_init", "pre_norm", "patch_bias", "patch_norm"}
    assert set(configs.SWITCHES) - config.read == by_the_model
    source = open(os.path.join(os.path.dirname(vit_keras.__file__), "model", "vit.py")).read()
    assert all(f"config.{name}" in source for name in by_the_model)


@pytest.mark.parametrize("spec", [
    layers.TokenSpec(class_token=True, distillation=True, registers=4),
    heads.HeadSpec("map", map_num_heads=8, map_prefix=True),
    heads.HeadSpec("token", distilled=True, fc_norm=False),
])
def test_the_new_specs_round_trip_their_config(spec):
    assert type(spec).of(spec.get_config()) == spec


def test_a_spec_refuses_what_its_slot_cannot_build():
    from vit_keras.model import position_embeddings
    with pytest.raises(ValueError, match="Unknown classifier 'cls'"):
        heads.HeadSpec("cls")
    with pytest.raises(ValueError, match="distillation token needs a class token"):
        layers.TokenSpec(class_token=False, distillation=True)
    with pytest.raises(ValueError, match="Unknown position embedding 'sincos'"):
        position_embeddings.PositionSpec("sincos")


def test_the_token_spec_orders_the_prefix_as_the_model_does():
    model = ViT({**TINY, "num_registers": 2, "distillation": True}, image_size=32)
    assert model.prefix_tokens == ["class", "distillation", "register", "register"]
    assert [layer.name for layer in model.prefix_layers] == ["dist", "cls", "reg"]
    assert model.get_layer("reg").insert_at == 2
