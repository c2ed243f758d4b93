"""vit_keras.tools.runs.recipes: the recipes, the warm-up schedule, the optimizers, compilation."""

import dataclasses
import math

import keras
import numpy as np
import pytest

from vit_keras.tools.runs import recipes

from conftest import tiny_data, tiny_model


def _vit_jax_learning_rate(step, base, total, warmup, decay):
    """vit_jax/utils.py `create_learning_rate_schedule`, transcribed with math only."""
    progress = min(max((step - warmup) / float(total - warmup), 0.0), 1.0)
    if decay == "linear":
        lr = base * (1.0 - progress)
    else:
        lr = base * 0.5 * (1.0 + math.cos(math.pi * progress))
    if warmup:
        lr = lr * min(1.0, step / warmup)
    return lr


def test_finetune_recipe_is_vit_jax_fine_tuning_recipe():
    recipe = recipes.FINETUNE_RECIPE
    assert (recipe.optimizer, recipe.momentum, recipe.weight_decay, recipe.grad_clip_norm) == (
        "sgd", 0.9, 0.0, 1.0)
    assert (recipe.learning_rate, recipe.warmup_steps, recipe.decay, recipe.total_steps) == (
        0.03, 500, "cosine", 10_000)
    assert (recipe.batch_size, recipe.image_size, recipe.zero_head) == (512, 384, True)
    optimizer = recipes.make_optimizer(recipe)
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert optimizer.momentum == 0.9 and not optimizer.nesterov
    assert optimizer.global_clipnorm == 1.0 and optimizer.clipnorm is None
    assert not optimizer.weight_decay
    assert optimizer.gradient_accumulation_steps is None


def test_pretrain_recipe_is_the_papers_adam_with_weight_decay_and_linear_decay():
    recipe = recipes.PRETRAIN_RECIPE
    assert (recipe.optimizer, recipe.beta_1, recipe.beta_2, recipe.weight_decay) == (
        "adamw", 0.9, 0.999, 0.1)
    assert recipe.decay == "linear" and recipe.warmup_steps > 0
    optimizer = recipes.make_optimizer(recipe, total_steps=100)
    assert isinstance(optimizer, keras.optimizers.AdamW)
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.weight_decay) == (0.9, 0.999, 0.1)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_warmup_schedule_matches_vit_jax(decay):
    schedule = recipes.WarmupSchedule(0.03, total_steps=1000, warmup_steps=100, decay=decay)
    for step in (0, 1, 50, 100, 101, 400, 999, 1000, 1500):
        expected = _vit_jax_learning_rate(step, 0.03, 1000, 100, decay)
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-7), step


def test_schedule_counts_optimizer_updates_under_gradient_accumulation():
    plain = recipes.WarmupSchedule(0.1, total_steps=100, warmup_steps=10)
    accumulated = recipes.WarmupSchedule(0.1, total_steps=100, warmup_steps=10,
                                          steps_per_update=4)
    for update in (0, 5, 10, 50, 99):
        for micro in range(4):
            assert float(accumulated(4 * update + micro)) == pytest.approx(float(plain(update)))


def test_schedule_round_trips_through_its_config():
    schedule = recipes.WarmupSchedule(0.5, 20, 3, "linear", steps_per_update=2)
    again = recipes.WarmupSchedule.from_config(schedule.get_config())
    assert again.get_config() == schedule.get_config()


def test_gradient_accumulation_updates_weights_every_accum_steps_batches(tiny_config):
    model = tiny_model(tiny_config)
    recipe = dataclasses.replace(recipes.FINETUNE_RECIPE, warmup_steps=0, learning_rate=0.1)
    recipes.compile_model(model, recipes.make_optimizer(recipe, 10, accum_steps=2))
    x, y = tiny_data()
    model.train_on_batch(x, y)  # builds the optimizer; the first batch only accumulates
    before = [keras.ops.convert_to_numpy(w).copy() for w in model.trainable_weights]
    model.train_on_batch(x, y)  # second batch: the update
    after = [keras.ops.convert_to_numpy(w).copy() for w in model.trainable_weights]
    model.train_on_batch(x, y)  # third batch: accumulates again
    third = [keras.ops.convert_to_numpy(w) for w in model.trainable_weights]
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
    assert all(np.array_equal(a, b) for a, b in zip(after, third))


def test_jit_compile_is_on_for_jax_and_tensorflow_and_off_for_torch():
    assert recipes.use_jit_compile() == (keras.backend.backend() != "torch")


def test_a_compiled_model_saves_jit_compile_auto_unless_it_was_chosen(tiny_config):
    # Keras stores the resolved value; "auto" lets the backend that loads the model choose.
    model = recipes.compile_model(tiny_model(tiny_config), "sgd")
    assert model.jit_compile == recipes.use_jit_compile()  # compiled as the recipe says
    assert model.get_compile_config()["jit_compile"] == "auto"
    forced = recipes.compile_model(tiny_model(tiny_config), "sgd", jit_compile=False)
    assert forced.get_compile_config()["jit_compile"] is False


def test_a_compiled_model_saves_its_optimizer_under_the_public_keras_name(tiny_config, tmp_path):
    # On torch Keras compiles with a torch subclass (keras.src.backend.torch.optimizers...):
    # saved under that name, another backend would import torch to read it.
    optimizer = recipes.make_optimizer(recipes.DIGITS_RECIPE, total_steps=10)
    model = recipes.compile_model(tiny_model(tiny_config), optimizer)
    saved = model.get_compile_config()["optimizer"]
    assert (saved["module"], saved["class_name"], saved["registered_name"]) == (
        "keras.optimizers", "AdamW", None)
    assert saved["config"]["learning_rate"]["registered_name"] == "vit_keras>WarmupSchedule"
    x, y = tiny_data(num_classes=3, size=8)
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")  # compiled, optimizer state too
    assert type(loaded.optimizer) is type(model.optimizer)  # this backend's own class
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 1


def test_importing_vit_keras_alone_registers_the_schedule_without_the_tools():
    from conftest import run_on_backend

    found = run_on_backend(keras.backend.backend(), """
        import sys
        import keras, vit_keras
        schedule = keras.saving.get_registered_object("vit_keras>WarmupSchedule")
        print(json.dumps([schedule is not None,
                          sorted(m for m in sys.modules if m.startswith("vit_keras.tools"))]))
    """)
    assert found == [True, []]
    assert recipes.WarmupSchedule is keras.saving.get_registered_object("vit_keras>WarmupSchedule")
