"""vit_keras.tools.training: recipe resolution (per objective), the run's model, `run`, the
run folder's finished-run rule."""

import dataclasses
import os

import keras
import numpy as np
import pytest

from vit_keras import build_model
from vit_keras.tools import callbacks, objectives, recipes, training


def test_recipe_choice_follows_weights_and_dataset():
    RunConfig = training.RunConfig
    assert training.resolve_recipe(RunConfig(dataset="cifar10", weights="w.npz"))[0].name == (
        "finetune")
    assert training.resolve_recipe(RunConfig())[0].name == "digits"
    assert training.resolve_recipe(RunConfig(dataset="cifar10"))[0].name == "pretrain"
    recipe, reason = training.resolve_recipe(RunConfig(dataset="cifar10", weights="w.npz",
                                                       learning_rate=0.01, total_steps=500))
    assert (recipe.optimizer, recipe.learning_rate, recipe.total_steps) == ("sgd", 0.01, 500)
    assert "fine-tuning" in reason
    assert "no pretrained weights" in training.resolve_recipe(RunConfig())[1]


def test_masked_patch_prediction_chooses_among_its_own_recipes():
    mpp = objectives.MaskedPatchPrediction()
    RunConfig = training.RunConfig
    assert training.resolve_recipe(RunConfig(), mpp)[0] == recipes.MPP_DIGITS_RECIPE
    assert training.resolve_recipe(RunConfig(dataset="cifar10", weights="w.npz"), mpp)[0] == (
        recipes.MPP_RECIPE)  # weights are an initialisation: no fine-tuning recipe
    recipe, reason = training.resolve_recipe(RunConfig(recipe="mpp", learning_rate=1e-4), mpp)
    assert (recipe.name, recipe.learning_rate, recipe.optimizer) == ("mpp", 1e-4, "adamw")
    assert reason == "recipe mpp (--recipe)"
    with pytest.raises(ValueError, match="expected auto or one of \\['mpp', 'mpp_digits'\\]"):
        training.resolve_recipe(RunConfig(recipe="finetune"), mpp)


@pytest.mark.slow  # over 5 s alone: out of make test-fast
def test_run_raises_a_clear_error_on_nan_loss(tmp_path):
    config = training.RunConfig(
        image_size=8, batch_size=16, epochs=2, steps_per_epoch=2, learning_rate=1e30,
        grad_clip_norm=0.0, warmup_steps=0, output_dir=str(tmp_path), verbose=0)
    with pytest.raises(callbacks.NonFiniteLossError, match="Lower --learning_rate"):
        training.run(config, log=lambda _: None)
    assert not os.path.exists(tmp_path / "finetune_digits_ViT-digits" / "backup")


def test_new_head_is_zero_and_position_embeddings_are_resampled_from_weights(tmp_path,
                                                                            tiny_config):
    from vit_keras import save_npz

    source = build_model(tiny_config, image_size=8, num_classes=7)
    for weight in source.weights:
        weight.assign(np.random.default_rng(0).normal(0, 0.1, weight.shape))
    path = save_npz(source, str(tmp_path / "tiny.npz"))
    recipe = dataclasses.replace(recipes.FINETUNE_RECIPE, image_size=16)
    model = training.build_run_model(training.RunConfig(weights=path), recipe, num_classes=3,
                                     log=lambda _: None)
    head = model.get_layer("head")
    assert head.kernel.shape == (32, 3)
    assert not np.any(keras.ops.convert_to_numpy(head.kernel))
    posemb = model.get_layer("posembed_input").pos_embedding
    assert posemb.shape == (1, 1 + 4 * 4, 32)  # 16 px / patch 4: a 4x4 grid (was 2x2)
    np.testing.assert_allclose(  # the class-token row is carried over unchanged
        keras.ops.convert_to_numpy(posemb)[0, 0],
        keras.ops.convert_to_numpy(source.get_layer("posembed_input").pos_embedding)[0, 0],
        atol=1e-6)


def test_keras_file_weights_get_a_new_zero_head_and_resampled_position_embeddings(tmp_path,
                                                                                  tiny_config):
    source = build_model(tiny_config, image_size=8, num_classes=7)
    for weight in source.weights:
        weight.assign(np.random.default_rng(1).normal(0, 0.1, weight.shape))
    path = str(tmp_path / "source.keras")
    source.save(path)
    recipe = dataclasses.replace(recipes.FINETUNE_RECIPE, image_size=16)
    model = training.build_run_model(training.RunConfig(weights=path), recipe, num_classes=3,
                                     log=lambda _: None)
    assert model.output_shape == (None, 3) and model.input_shape == (None, 16, 16, 3)
    assert not np.any(keras.ops.convert_to_numpy(model.get_layer("head").kernel))
    np.testing.assert_allclose(  # the encoder weights are the file's
        keras.ops.convert_to_numpy(model.get_layer("encoderblock_1").mlp.dense_0.kernel),
        keras.ops.convert_to_numpy(source.get_layer("encoderblock_1").mlp.dense_0.kernel))
    same = training.build_run_model(training.RunConfig(weights=path),
                                    dataclasses.replace(recipe, image_size=8), num_classes=7,
                                    log=lambda _: None)
    np.testing.assert_allclose(  # same classes and size: the model continues as it was
        keras.ops.convert_to_numpy(same.get_layer("head").kernel),
        keras.ops.convert_to_numpy(source.get_layer("head").kernel))


@pytest.mark.backend_independent
def test_run_names_tell_apart_variants_fine_tuned_from_one_release():
    def name(**fields):
        return training.default_run_name(training.RunConfig(dataset="cifar10", **fields))

    assert name(model="ViT-B/16", weights="augreg_in21k") == "finetune_cifar10_ViT-B_16_augreg_in21k"
    assert name(model="ViT-S/16", weights="augreg_in21k") == "finetune_cifar10_ViT-S_16_augreg_in21k"
    assert name(weights="/data/ViT-B_16.npz") == "finetune_cifar10_ViT-B_16"


def test_weights_on_the_digits_get_the_digits_recipe_at_their_own_size():
    recipe, reason = training.resolve_recipe(training.RunConfig(weights="run/model.keras"))
    assert recipe.name == "digits" and "digits recipe" in reason
    assert recipe.image_size is None  # the weights' own, read once the model is built
    given = training.resolve_recipe(training.RunConfig(weights="run/model.keras", image_size=32))
    assert given[0].image_size == 32
    assert training.resolve_recipe(training.RunConfig())[0].image_size == 16


def test_a_pretrained_digits_model_is_fine_tuned_at_its_own_size(tmp_path, tiny_config):
    from vit_keras import masked_patch_prediction as mpp

    source = mpp.build_pretraining_model(build_model(tiny_config, image_size=12, num_classes=3,
                                                     classifier="gap"))
    path = str(tmp_path / "pretrain_digits_tiny" / "model.keras")
    os.makedirs(os.path.dirname(path))
    source.save(path)
    config = training.RunConfig(weights=path)
    recipe, _ = training.resolve_recipe(config)
    model = training.build_run_model(config, recipe, num_classes=10, log=lambda _: None)
    assert model.input_shape == (None, 12, 12, 3) and model.output_shape == (None, 10)
    assert training.default_run_name(config) == "finetune_digits_pretrain_digits_tiny"


def test_a_finished_run_is_returned_as_it_is_and_overwrite_clears_it(tmp_path):
    from vit_keras.tools.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run").create()
    folder.write_metrics({"test_accuracy": 0.5})
    open(os.path.join(folder.path, "model.tmp-7.keras"), "wb").close()
    logs = []
    with folder.locked():
        finished = training.finished_run(folder, log=logs.append)
        assert finished == {"test_accuracy": 0.5, "already_complete": True}
        assert "is complete" in logs[0] and "--overwrite" in logs[0]
        assert os.path.exists(os.path.join(folder.path, "model.tmp-7.keras"))  # untouched
        assert training.finished_run(folder, overwrite=True, log=logs.append) is None
        assert os.listdir(folder.path) == ["lock"]


def test_an_unfinished_run_loses_only_its_temporary_files(tmp_path):
    from vit_keras.tools.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run").create()
    for name in ("model.keras", "history.csv", "model.tmp-7.keras"):
        open(os.path.join(folder.path, name), "wb").close()
    with folder.locked():
        assert training.finished_run(folder, log=lambda _: None) is None
    assert sorted(os.listdir(folder.path)) == ["history.csv", "model.keras"]
