"""vit_keras.tools.runs.training: recipe resolution (per objective), the run's model, `run`, the
run folder's finished-run rule."""

import dataclasses
import os
import re
import sys

import keras
import numpy as np
import pytest

from vit_keras import build_model, errors
from vit_keras.tools.runs import callbacks, objectives, recipes, training
from vit_keras.tools.runs.run_folder import (
    RunFolder,
    RunFolderBusyError,
    RunFolderError,
    RunFolderMismatchError,
)


def test_recipe_choice_follows_weights_and_dataset():
    RunConfig = training.RunConfig
    assert training.resolve_recipe(RunConfig.of(dataset="cifar10", weights="w.npz"))[0].name == (
        "finetune")
    assert training.resolve_recipe(RunConfig.of())[0].name == "digits"
    assert training.resolve_recipe(RunConfig.of(dataset="cifar10"))[0].name == "pretrain"
    recipe, reason = training.resolve_recipe(RunConfig.of(dataset="cifar10", weights="w.npz",
                                                          learning_rate=0.01, total_steps=500))
    assert (recipe.optimizer, recipe.learning_rate, recipe.total_steps) == ("sgd", 0.01, 500)
    assert "fine-tuning" in reason
    assert "no pretrained weights" in training.resolve_recipe(RunConfig.of())[1]


def test_masked_patch_prediction_chooses_among_its_own_recipes():
    mpp = objectives.MaskedPatchPrediction()
    RunConfig = training.RunConfig
    assert training.resolve_recipe(RunConfig.of(), mpp)[0] == recipes.MPP_DIGITS_RECIPE
    assert training.resolve_recipe(RunConfig.of(dataset="cifar10", weights="w.npz"), mpp)[0] == (
        recipes.MPP_RECIPE)  # weights are an initialisation: no fine-tuning recipe
    recipe, reason = training.resolve_recipe(RunConfig.of(recipe="mpp", learning_rate=1e-4), mpp)
    assert (recipe.name, recipe.learning_rate, recipe.optimizer) == ("mpp", 1e-4, "adamw")
    assert reason == "recipe mpp (--recipe)"
    with pytest.raises(ValueError, match="expected auto or one of \\['mpp', 'mpp_digits'\\]"):
        training.resolve_recipe(RunConfig.of(recipe="finetune"), mpp)


@pytest.mark.slow  # over 5 s alone: out of make test-fast
def test_run_raises_a_clear_error_on_nan_loss(tmp_path):
    config = training.RunConfig.of(
        image_size=8, batch_size=16, epochs=2, steps_per_epoch=2, learning_rate=1e30,
        grad_clip_norm=0.0, warmup_steps=0, output_dir=str(tmp_path), verbose=0)
    with pytest.raises(callbacks.NonFiniteLossError, match="Lower --learning_rate") as error:
        training.run(config, log=lambda _: None)
    # The first epoch did not end: there is no model.keras to speak of.
    assert "no epoch ended with a finite loss, so no model.keras was written" in str(error.value)
    assert "keeps the last" not in str(error.value)
    run = tmp_path / training.default_run_name(config)
    assert not os.path.exists(run / "model.keras") and not os.path.exists(run / "backup")


@pytest.mark.slow  # two tiny runs: over 5 s
@pytest.mark.backend_independent  # the run loop's rule, not a backend's
def test_a_nan_after_a_resume_keeps_the_backup_it_resumed_from(tmp_path, monkeypatch):
    config = training.RunConfig.of(image_size=8, batch_size=16, epochs=2, steps_per_epoch=1,
                                   output_dir=str(tmp_path), run_name="run", verbose=0)
    backup = RunFolder(tmp_path / "run").backup

    def killed_after_the_first_epoch(self, epoch, logs=None):
        if epoch == 1:
            raise KeyboardInterrupt  # stands in for a kill once epoch 1 is backed up

    with monkeypatch.context() as patch:
        patch.setattr(callbacks.StopOnNaN, "on_epoch_begin", killed_after_the_first_epoch)
        with pytest.raises(KeyboardInterrupt):
            training.run(config, log=lambda _: None)
    kept = sorted(os.listdir(backup))

    def nan_at_once(self, batch, logs=None):
        self.bad_step = (1, batch, float("nan"))
        self.model.stop_training = True

    monkeypatch.setattr(callbacks.StopOnNaN, "on_train_batch_end", nan_at_once)
    with pytest.raises(callbacks.NonFiniteLossError):
        training.run(config, log=lambda _: None)
    assert kept == ["epoch-1.keras", "training_metadata.json"]
    assert sorted(os.listdir(backup)) == kept  # the epoch before the NaN is not lost


def test_new_head_is_zero_and_position_embeddings_are_resampled_from_weights(tmp_path,
                                                                            tiny_config):
    from vit_keras import save_npz

    source = build_model(tiny_config, image_size=8, num_classes=7)
    for weight in source.weights:
        weight.assign(np.random.default_rng(0).normal(0, 0.1, weight.shape))
    path = save_npz(source, str(tmp_path / "tiny.npz"))
    recipe = dataclasses.replace(recipes.FINETUNE_RECIPE, image_size=16)
    model = training.build_run_model(training.RunConfig.of(weights=path), recipe, num_classes=3,
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


def test_keras_file_weights_for_another_head_keep_the_models_name_and_eval_crop(tmp_path,
                                                                               tiny_config):
    """The new head goes through the npz layout, which holds neither: the run line and
    apps/evaluate.py would name a `custom` model and resize."""
    source = build_model(tiny_config, image_size=8, num_classes=7, eval_crop=(0.9, "bicubic"),
                         name="EVA02-tiny")
    path = str(tmp_path / "source.keras")
    source.save(path)
    recipe = dataclasses.replace(recipes.FINETUNE_RECIPE, image_size=8)
    model = training.build_run_model(training.RunConfig.of(weights=path), recipe, num_classes=3,
                                     log=lambda _: None)
    assert model.output_shape == (None, 3)
    assert (model.name, model.eval_crop) == ("EVA02-tiny", (0.9, "bicubic"))


def test_keras_file_weights_get_a_new_zero_head_and_resampled_position_embeddings(tmp_path,
                                                                                  tiny_config):
    source = build_model(tiny_config, image_size=8, num_classes=7)
    for weight in source.weights:
        weight.assign(np.random.default_rng(1).normal(0, 0.1, weight.shape))
    path = str(tmp_path / "source.keras")
    source.save(path)
    recipe = dataclasses.replace(recipes.FINETUNE_RECIPE, image_size=16)
    model = training.build_run_model(training.RunConfig.of(weights=path), recipe, num_classes=3,
                                     log=lambda _: None)
    assert model.output_shape == (None, 3) and model.input_shape == (None, 16, 16, 3)
    assert not np.any(keras.ops.convert_to_numpy(model.get_layer("head").kernel))
    np.testing.assert_allclose(  # the encoder weights are the file's
        keras.ops.convert_to_numpy(model.get_layer("encoderblock_1").mlp.dense_0.kernel),
        keras.ops.convert_to_numpy(source.get_layer("encoderblock_1").mlp.dense_0.kernel))
    same = training.build_run_model(training.RunConfig.of(weights=path),
                                    dataclasses.replace(recipe, image_size=8), num_classes=7,
                                    log=lambda _: None)
    np.testing.assert_allclose(  # same classes and size: the model continues as it was
        keras.ops.convert_to_numpy(same.get_layer("head").kernel),
        keras.ops.convert_to_numpy(source.get_layer("head").kernel))


@pytest.mark.backend_independent
def test_run_names_tell_apart_variants_fine_tuned_from_one_release():
    def name(**fields):
        return training.default_run_name(training.RunConfig.of(dataset="cifar10", **fields),
                                         backend="jax")

    assert name(model="ViT-B/16", weights="augreg_in21k") == (
        "finetune_cifar10_ViT-B_16_augreg_in21k_jax")
    assert name(model="ViT-S/16", weights="augreg_in21k") == (
        "finetune_cifar10_ViT-S_16_augreg_in21k_jax")
    assert name(weights="/data/ViT-B_16.npz") == "finetune_cifar10_ViT-B_16_jax"


def test_run_names_tell_apart_backends_and_fine_tuning_methods():
    """`make demo BACKEND=torch` after `make demo`, or a layer-decay run after a LoRA run, must not
    find the other's finished run under its name (vit_keras issue 40, item 6)."""
    config = training.RunConfig.of()
    assert training.default_run_name(config) == (
        f"finetune_digits_ViT-digits_{keras.backend.backend()}")
    names = {training.default_run_name(config.replace(**fields), backend=backend)
             for backend in ("jax", "tensorflow", "torch")
             for fields in ({}, {"lora_rank": 4}, {"lora_rank": 8}, {"linear_probe": True},
                            {"layer_decay": 0.75}, {"layer_decay": 0.5})}
    assert len(names) == 18
    assert training.default_run_name(config.replace(lora_rank=4), backend="torch") == (
        "finetune_digits_ViT-digits_lora4_torch")
    assert training.default_run_name(config.replace(lora_rank=0), backend="jax") == (
        "finetune_digits_ViT-digits_jax")  # rank 0 is no LoRA


def test_weights_on_the_digits_get_the_digits_recipe_at_their_own_size():
    recipe, reason = training.resolve_recipe(training.RunConfig.of(weights="run/model.keras"))
    assert recipe.name == "digits" and "digits recipe" in reason
    assert recipe.image_size is None  # the weights' own, read once the model is built
    given = training.resolve_recipe(training.RunConfig.of(weights="run/model.keras", image_size=32))
    assert given[0].image_size == 32
    assert training.resolve_recipe(training.RunConfig.of())[0].image_size == 16


def test_a_pretrained_digits_model_is_fine_tuned_at_its_own_size(tmp_path, tiny_config):
    from vit_keras.training import masked_patch_prediction as mpp

    source = mpp.build_pretraining_model(build_model(tiny_config, image_size=12, num_classes=3,
                                                     classifier="gap"))
    path = str(tmp_path / "pretrain_digits_tiny" / "model.keras")
    os.makedirs(os.path.dirname(path))
    source.save(path)
    config = training.RunConfig.of(weights=path)
    recipe, _ = training.resolve_recipe(config)
    model = training.build_run_model(config, recipe, num_classes=10, log=lambda _: None)
    assert model.input_shape == (None, 12, 12, 3) and model.output_shape == (None, 10)
    assert training.default_run_name(config, backend="jax") == (
        "finetune_digits_pretrain_digits_tiny_jax")


def test_a_finished_run_is_returned_as_it_is_and_overwrite_clears_it(tmp_path):
    from vit_keras.tools.runs.run_folder import RunFolder

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
    from vit_keras.tools.runs.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run").create()
    for name in ("model.keras", "history.csv", "model.tmp-7.keras"):
        open(os.path.join(folder.path, name), "wb").close()
    with folder.locked():
        assert training.finished_run(folder, log=lambda _: None) is None
    assert sorted(os.listdir(folder.path)) == ["history.csv", "model.keras"]


# --- what a run does to a folder it is pointed at (vit_keras issue 41, items 1 and 2) ----------

def _quiet(config, **kwargs):
    return training.run(config, log=lambda _: None, **kwargs)


@pytest.mark.backend_independent
@pytest.mark.parametrize("run_name", ["..", ".", "a/b", "../out", "x/"])
def test_a_run_name_that_is_not_one_folder_name_is_refused(tmp_path, run_name):
    parent = tmp_path / "parent"
    (parent / "out").mkdir(parents=True)
    (parent / "unrelated.txt").write_text("keep me")
    config = training.RunConfig.of(output_dir=str(parent / "out"), run_name=run_name,
                                   overwrite=True)
    with pytest.raises(RunFolderError, match="is not a folder name: a run name is one path "):
        _quiet(config)
    assert sorted(os.listdir(parent)) == ["out", "unrelated.txt"]
    assert os.listdir(parent / "out") == []
    assert (parent / "unrelated.txt").read_text() == "keep me"


# What a NaFlex run (--max_num_patches) does not do, each refused in one line before the run
# folder is made (apps/finetune.py and apps/pretrain.py print the line: tests/test_app_errors.py).
NAFLEX_REFUSALS = {
    "mixup": (dict(max_num_patches=16, mixup=0.2), None,
              ["--max_num_patches (NaFlex)", "cannot take --mixup"]),
    "bucket_too_long": (dict(max_num_patches=16, naflex_seq_lens=("8", "32")), None,
                        ["--naflex_seq_lens 8,32", "from 1 to --max_num_patches 16"]),
    "bucket_not_a_number": (dict(max_num_patches=16, naflex_seq_lens=("8", "x")), None,
                            ["--naflex_seq_lens takes whole numbers", "got 8,x"]),
    "pretraining": (dict(max_num_patches=16, tokens_per_batch=64), "mpp",
                    ["--max_num_patches (NaFlex)", "an objective other than classification"]),
    "tokens_without_naflex": (dict(tokens_per_batch=64), None,
                              ["--tokens_per_batch sizes NaFlex batches", "needs --max_num_patches"]),
}


@pytest.mark.backend_independent
@pytest.mark.parametrize("case", NAFLEX_REFUSALS)
def test_what_a_naflex_run_cannot_take_is_refused_before_the_run_folder(tmp_path, case):
    settings, objective, words = NAFLEX_REFUSALS[case]
    config = training.RunConfig.of(output_dir=str(tmp_path / "runs"), **settings)
    objective = {"objective": objectives.MaskedPatchPrediction()} if objective else {}
    with pytest.raises(training.NaFlexOptionError) as refused:
        _quiet(config, **objective)
    message = str(refused.value)
    assert "\n" not in message and all(text in message for text in words), message
    assert isinstance(refused.value, errors.UserError)  # what the apps print as one line
    assert os.listdir(tmp_path) == []


@pytest.mark.backend_independent
def test_overwrite_deletes_nothing_from_a_folder_that_is_not_a_run_folder(tmp_path):
    documents = tmp_path / "Documents"
    (documents / "photos").mkdir(parents=True)
    (documents / "thesis.tex").write_text("years of work")
    (documents / "model.keras").write_text("a name a run writes")
    config = training.RunConfig.of(output_dir=str(tmp_path), run_name="Documents", overwrite=True)
    with pytest.raises(RunFolderError, match="holds photos, thesis.tex, which no run writes"):
        _quiet(config)
    assert sorted(os.listdir(documents)) == ["model.keras", "photos", "thesis.tex"]


@pytest.mark.backend_independent
def test_overwrite_never_deletes_a_run_folder_another_process_is_running_in(tmp_path):
    outer = RunFolder(tmp_path / "outer").create()
    outer.write_metrics({"test_accuracy": 0.5})
    inner = RunFolder(os.path.join(outer.logs, "live"))  # a run nested in another's folder
    config = training.RunConfig.of(output_dir=str(tmp_path), run_name="outer", overwrite=True)
    with inner.locked():  # flock is per open file: this process counts as another holder
        with pytest.raises(RunFolderBusyError, match=re.escape(
                f"another process is running in (lock file {inner.lock})")):
            _quiet(config)
        assert os.path.exists(inner.lock) and outer.is_complete()


@pytest.mark.backend_independent
@pytest.mark.skipif(sys.platform == "win32", reason="symbolic links")
@pytest.mark.parametrize("name", ["lock", "history.csv", "training_curves.png", "logs",
                                  "backup"])
def test_a_link_planted_in_a_run_folder_is_refused_and_its_target_untouched(tmp_path, name):
    target = tmp_path / "elsewhere"
    target.write_text("not the run's")
    folder = tmp_path / "runs" / "run"
    folder.mkdir(parents=True)
    os.symlink(target, folder / name)
    config = training.RunConfig.of(output_dir=str(folder.parent), run_name="run")
    with pytest.raises(RunFolderError, match="is a symbolic link: a run writes its files only "):
        _quiet(config)
    assert target.read_text() == "not the run's"
    assert os.path.islink(folder / name)


@pytest.mark.backend_independent
def test_a_rerun_with_other_flags_is_refused_naming_them_and_changes_nothing(tmp_path):
    """A folder's flags.txt says how its run was made: another learning rate, layer decay or
    LoRA rank there is another run (vit_keras issue 40, item 7)."""
    config = training.RunConfig.of(output_dir=str(tmp_path), run_name="run", epochs=3)
    folder = RunFolder(tmp_path / "run").create()
    folder.write_flags(training.run_flags_text(config))  # an unfinished run of `config`
    recorded = open(folder.flags).read()
    other = config.replace(learning_rate=0.03, layer_decay=0.5, lora_rank=4)
    with pytest.raises(RunFolderMismatchError) as error:
        _quiet(other)
    message = str(error.value)
    assert "\n" not in message
    for expected in ("--layer_decay unset there, 0.5 now", "--learning_rate unset there, 0.03 now",
                     "--lora_rank unset there, 4 now", "--run_name", "--overwrite"):
        assert expected in message, message
    assert open(folder.flags).read() == recorded
    assert sorted(os.listdir(folder.path)) == ["flags.txt"]


@pytest.mark.backend_independent
def test_a_rerun_may_change_only_where_the_run_is_and_what_it_prints(tmp_path):
    config = training.RunConfig.of(output_dir=str(tmp_path), run_name="run", verbose=2)
    folder = RunFolder(tmp_path / "run").create()
    folder.write_flags(training.run_flags_text(config))
    folder.write_metrics({"test_accuracy": 0.5})
    moved = config.replace(output_dir=str(tmp_path / "." / ""), verbose=0,
                           download=False, peer_timeout=5)
    assert _quiet(moved) == {"test_accuracy": 0.5, "already_complete": True}
    assert training.differing_flags(training.run_flags_text(config),
                                    training.run_flags_text(moved)) == []
    assert training.differing_flags(
        training.run_flags_text(config),
        training.run_flags_text(config.replace(linear_probe=True))) == [
        ("linear_probe", "false", "true")]


def test_the_first_train_step_is_traced_once(tiny_config):
    """On TensorFlow Keras creates the optimizer's and the metrics' variables inside the first
    traced step, which a `tf.function` then traces again; `build_before_tracing` creates them
    first, from the dataset's element spec. Elsewhere it leaves the model as it is."""
    import tensorflow as tf

    model = build_model(tiny_config, image_size=8, num_classes=3)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.TopKCategoricalAccuracy(2)],
                  jit_compile=False)
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (8, 8, 8, 3)).astype("float32")
    labels = np.eye(3, dtype="float32")[rng.integers(0, 3, 8)]
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(4)
    training.build_before_tracing(model, dataset)
    assert model.optimizer.built == (keras.backend.backend() == "tensorflow")
    if keras.backend.backend() != "tensorflow":
        return  # JAX and torch trace (or run) the step as they do without it
    traced = []
    train_step = model.train_step
    model.train_step = lambda data: traced.append(1) or train_step(data)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    assert len(traced) == 1
