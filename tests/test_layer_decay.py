"""vit_keras.layer_decay: the BEiT/MAE scale table and the optimizers that apply it, on every
backend (plain steps and the compiled train step)."""

import keras
import numpy as np
import pytest

from vit_keras import errors
from vit_keras.tools.runs import recipes
from vit_keras.training import layer_decay

from conftest import NEXT_BACKEND, randomize_weights, run_on_backend, tiny_data, tiny_model

DECAY = 0.5  # a coarse factor: each block's scale differs from its neighbour's by 2x


def _model(tiny_config, num_layers=3):
    model = tiny_model({**tiny_config, "num_layers": num_layers})
    return randomize_weights(model)  # zero-initialised head and class token get values too


def test_scales_follow_the_beit_convention(tiny_config):
    scales = layer_decay.layer_decay_scales(_model(tiny_config, num_layers=3), DECAY)
    # L = 3: embeddings F^(L+1), block i F^(L-i); the final norm and head are not in the table.
    assert scales == {"embedding": DECAY ** 4, "cls": DECAY ** 4, "posembed_input": DECAY ** 4,
                      "encoderblock_0": DECAY ** 3, "encoderblock_1": DECAY ** 2,
                      "encoderblock_2": DECAY ** 1}


def test_scale_table_groups_layers_by_scale_and_ends_with_the_head(tiny_config):
    scales = layer_decay.layer_decay_scales(_model(tiny_config, num_layers=2), DECAY)
    assert layer_decay.scale_table(scales) == [
        (["embedding", "cls", "posembed_input"], DECAY ** 3), (["encoderblock_0"], DECAY ** 2),
        (["encoderblock_1"], DECAY), (["everything else"], 1.0)]
    assert layer_decay.describe_scales(scales).endswith("everything else x1")


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5])
def test_a_layer_decay_outside_0_1_is_a_user_error(value):
    with pytest.raises(errors.UserError, match=r"--layer_decay must be in \(0, 1\]"):
        layer_decay.check_layer_decay(value)


def test_a_model_without_blocks_is_refused():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(inputs))
    with pytest.raises(errors.UserError, match="needs a model with encoder blocks"):
        layer_decay.layer_decay_scales(model, 0.75)


def _scale_of(path, scales):
    first = path.split("/")[0]
    return scales.get(first, 1.0)


def _one_apply(optimizer, model, gradients):
    before = [np.array(v) for v in model.trainable_variables]
    optimizer.apply([keras.ops.convert_to_tensor(g) for g in gradients],
                    model.trainable_variables)
    return before, [np.array(v) for v in model.trainable_variables]


def _known_gradients(model, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1, v.shape).astype("float32") for v in model.trainable_variables]


def test_sgd_steps_scale_each_layers_update_momentum_included(tiny_config):
    model = _model(tiny_config)
    scales = layer_decay.layer_decay_scales(model, DECAY)
    lr, momentum = 0.1, 0.9
    optimizer = layer_decay.LayerDecaySGD(learning_rate=lr, momentum=momentum, layer_scales=scales)
    gradients = _known_gradients(model)
    start, after_one = _one_apply(optimizer, model, gradients)
    _, after_two = _one_apply(optimizer, model, gradients)
    for v, g, w0, w1, w2 in zip(model.trainable_variables, gradients, start, after_one, after_two):
        step = lr * _scale_of(v.path, scales) * g
        # rtol 1e-5: float32 weights of size ~0.1 minus steps ~1e-2.
        np.testing.assert_allclose(w1, w0 - step, rtol=1e-5, atol=1e-6, err_msg=v.path)
        # The velocity after two equal gradients is step * (1 + momentum).
        np.testing.assert_allclose(w2, w1 - step * (1 + momentum), rtol=1e-5, atol=1e-6,
                                   err_msg=v.path)


def test_adamw_step_scales_the_learning_rate_and_the_weight_decay(tiny_config):
    model = _model(tiny_config)
    scales = layer_decay.layer_decay_scales(model, DECAY)
    lr, wd, beta_1, beta_2, epsilon = 1e-2, 0.1, 0.9, 0.999, 1e-7
    optimizer = layer_decay.LayerDecayAdamW(learning_rate=lr, weight_decay=wd, beta_1=beta_1,
                                            beta_2=beta_2, epsilon=epsilon, layer_scales=scales)
    gradients = _known_gradients(model)
    start, after = _one_apply(optimizer, model, gradients)
    for v, g, w0, w1 in zip(model.trainable_variables, gradients, start, after):
        scaled_lr = lr * _scale_of(v.path, scales)
        # Keras' Adam, first step: m = (1 - b1) g, v = (1 - b2) g^2, bias-corrected step size.
        alpha = scaled_lr * np.sqrt(1 - beta_2) / (1 - beta_1)
        adam = alpha * (1 - beta_1) * g / (np.sqrt((1 - beta_2) * g * g) + epsilon)
        expected = w0 - scaled_lr * wd * w0 - adam
        np.testing.assert_allclose(w1, expected, rtol=1e-5, atol=1e-7, err_msg=v.path)


def test_the_compiled_train_step_scales_each_update(tiny_config):
    """Through `fit`'s step (XLA on JAX and TensorFlow): each variable's change is the plain SGD
    change times its layer's scale."""
    x, y = tiny_data(n=8, size=8, num_classes=3)
    plain = _model(tiny_config)
    decayed = plain.rebuilt()
    scales = layer_decay.layer_decay_scales(decayed, DECAY)
    start = [np.array(v) for v in plain.trainable_variables]
    for model, optimizer in (
            (plain, keras.optimizers.SGD(0.1)),
            (decayed, layer_decay.LayerDecaySGD(0.1, layer_scales=scales))):
        recipes.compile_model(model, optimizer)
        model.train_on_batch(x, y)
    for v_plain, v_decayed, w0 in zip(plain.trainable_variables, decayed.trainable_variables,
                                      start):
        scale = _scale_of(v_decayed.path, scales)
        # atol 1e-6: the two steps compute the same gradient in float32.
        np.testing.assert_allclose(np.array(v_decayed) - w0, scale * (np.array(v_plain) - w0),
                                   rtol=1e-4, atol=1e-6, err_msg=v_decayed.path)
    assert any(s < 1 for s in scales.values())


def test_the_optimizer_round_trips_its_config(tiny_config):
    scales = layer_decay.layer_decay_scales(_model(tiny_config), 0.75)
    optimizer = layer_decay.LayerDecayAdamW(1e-3, weight_decay=0.05, layer_scales=scales)
    config = optimizer.get_config()
    rebuilt = layer_decay.LayerDecayAdamW.from_config(config)
    assert rebuilt.get_config() == config and rebuilt.layer_scales == scales
    serialized = keras.saving.serialize_keras_object(optimizer)
    assert serialized["registered_name"] == "vit_keras>LayerDecayAdamW"


def test_make_optimizer_with_layer_scales_gives_the_layer_decay_optimizer(tiny_config):
    scales = layer_decay.layer_decay_scales(_model(tiny_config), 0.75)
    sgd = recipes.make_optimizer(recipes.FINETUNE_RECIPE, 100, layer_scales=scales)
    adamw = recipes.make_optimizer(recipes.DIGITS_RECIPE, 100, layer_scales=scales)
    assert isinstance(sgd, layer_decay.LayerDecaySGD) and sgd.momentum == 0.9
    assert isinstance(adamw, layer_decay.LayerDecayAdamW) and adamw.layer_scales == scales
    plain = recipes.make_optimizer(recipes.DIGITS_RECIPE, 100)  # torch: Keras' torch subclass
    assert isinstance(plain, keras.optimizers.AdamW)
    assert not isinstance(plain, layer_decay.LayerDecayAdamW)


def test_a_saved_model_reloads_with_its_layer_decay_optimizer(tiny_config, tmp_path):
    model = _model(tiny_config)
    scales = layer_decay.layer_decay_scales(model, 0.75)
    recipes.compile_model(model, recipes.make_optimizer(recipes.DIGITS_RECIPE, 10,
                                                        layer_scales=scales))
    x, y = tiny_data(num_classes=3, size=8)
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert isinstance(loaded.optimizer, layer_decay.LayerDecayAdamW)
    assert loaded.optimizer.layer_scales == scales
    assert int(loaded.optimizer.iterations) == 1


@pytest.mark.slow
def test_a_model_saved_on_this_backend_trains_on_the_next(tiny_config, tmp_path):
    """`import vit_keras` alone registers the optimizer; `portable_compile_config` leaves its
    recorded class alone (it is no backend's private subclass)."""
    model = _model(tiny_config)
    scales = layer_decay.layer_decay_scales(model, 0.75)
    recipes.compile_model(model, recipes.make_optimizer(recipes.FINETUNE_RECIPE, 10,
                                                        layer_scales=scales))
    x, y = tiny_data(num_classes=3, size=8)
    model.fit(x, y, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    found = run_on_backend(NEXT_BACKEND, """
        import keras, numpy as np, vit_keras
        model = keras.saving.load_model(ARGS["path"])
        x = np.zeros((2, 8, 8, 3), "float32"); y = np.eye(3, dtype="float32")[[0, 1]]
        model.train_on_batch(x, y)
        print(json.dumps([type(model.optimizer).__name__, model.optimizer.layer_scales,
                          int(model.optimizer.iterations)]))
    """, path=path)
    assert found == ["LayerDecaySGD", scales, 2], NEXT_BACKEND
