"""Masked patch prediction: the corruption's statistics, the three targets against NumPy, the
loss on corrupted patches only, training with `fit`, saving, and the hand-over of the pre-trained
encoder to fine-tuning (`apps/finetune.py --weights PRETRAINED.keras`)."""

import keras
import numpy as np
import pytest

from vit_keras import build_model
from vit_keras.training import masked_patch_prediction as mpp

from conftest import random_images, randomize_weights


def numpy_colour_labels(images, patch, grid=1):
    """The 3-bit mean colour of each cell, `r + 8 g + 64 b`, written out with NumPy loops."""
    batch, height, width, _ = images.shape
    cell = patch // grid
    labels = np.zeros((batch, (height // patch) * (width // patch), grid * grid), np.int64)
    for b in range(batch):
        for index, (row, col) in enumerate(np.ndindex(height // patch, width // patch)):
            for k, (i, j) in enumerate(np.ndindex(grid, grid)):
                top, left = row * patch + i * cell, col * patch + j * cell
                means = images[b, top:top + cell, left:left + cell].astype(np.float64).mean((0, 1))
                r, g, bl = np.minimum(np.floor(means / 32.0), 7).astype(int)
                labels[b, index, k] = r + 8 * g + 64 * bl
    return labels


def colour_images():
    """Random pixels, plus patches of one colour on the quantisation's edges (0, 31, 32, 255)."""
    images = random_images(3, 8, 16).round()
    images[0, :4, :4] = [0, 31, 32]
    images[0, :4, 4:8] = [255, 224, 223]
    return images


def test_mean_colour_labels_equal_a_numpy_reference():
    images = colour_images()
    labels = keras.ops.convert_to_numpy(mpp.colour_labels(images, 4))
    expected = numpy_colour_labels(images, 4)
    assert labels.shape == (3, 8, 1)
    np.testing.assert_array_equal(labels, expected)
    assert labels[0, 0, 0] == 0 + 8 * 0 + 64 * 1 and labels[0, 1, 0] == 7 + 8 * 7 + 64 * 6
    assert labels.min() >= 0 and labels.max() < 512


def test_downsampled_colour_labels_equal_a_numpy_reference():
    images = colour_images()
    labels = keras.ops.convert_to_numpy(mpp.colour_labels(images, 8, grid=4))
    assert labels.shape == (3, 2, 16)
    np.testing.assert_array_equal(labels, numpy_colour_labels(images, 8, grid=4))


def test_pixel_targets_are_each_patchs_normalised_pixels():
    images = random_images(2, 8, 12)
    targets = keras.ops.convert_to_numpy(mpp.normalised_patch_pixels(images, 4))
    assert targets.shape == (2, 6, 48)
    # Patch 4 is row 1, column 1 (3 patches per row), flattened in (row, column, channel) order.
    np.testing.assert_allclose(targets[1, 4], (images[1, 4:8, 4:8] / 127.5 - 1).ravel(), atol=1e-6)


def corrupt(batch=500, patches=16, hidden=8, seed=0, **rates):
    tokens = np.random.default_rng(seed).normal(size=(batch, patches, hidden)).astype("float32")
    mask_token = np.full((1, 1, hidden), 7.0, "float32")  # far from every token
    out, mask, source = mpp.corrupt_tokens(tokens, mask_token, keras.random.SeedGenerator(seed),
                                           **rates)
    return tokens, *(keras.ops.convert_to_numpy(a) for a in (out, mask, source))


def test_corruption_hits_half_the_patches_and_splits_them_80_10_10():
    tokens, out, mask, source = corrupt()
    assert mask.shape == (500, 16) and set(np.unique(mask)) == {0.0, 1.0}
    assert (mask.sum(axis=1) == 8).all()  # exactly 50% of each image's patches
    corrupted = mask == 1
    position = np.broadcast_to(np.arange(16), source.shape)
    masked = source == -1
    replaced = (source >= 0) & (source != position)
    kept = corrupted & (source == position)
    assert not (masked & ~corrupted).any() and not (replaced & ~corrupted).any()
    # 4000 corrupted patches: binomial standard errors 0.006 (80%) and 0.005 (10%); 0.025 is
    # about five of them.
    n = corrupted.sum()
    assert masked.sum() / n == pytest.approx(0.8, abs=0.025)
    assert replaced.sum() / n == pytest.approx(0.1, abs=0.025)
    assert kept.sum() / n == pytest.approx(0.1, abs=0.025)
    # Every position holds what `source` says: the [mask] embedding, another patch, or itself.
    np.testing.assert_array_equal(out[masked], np.full((masked.sum(), 8), 7.0))
    rows = np.broadcast_to(np.arange(500)[:, None], source.shape)
    np.testing.assert_array_equal(out[~masked], tokens[rows[~masked], source[~masked]])


def test_a_random_replacement_is_never_the_patch_itself_and_covers_every_other_patch():
    # Only random replacements, on 4 patches of which 2 are corrupted: 2000 replacements.
    _, out, mask, source = corrupt(batch=1000, patches=4, mask_fraction=0.0,
                                   random_fraction=1.0)
    position = np.broadcast_to(np.arange(4), source.shape)
    corrupted = mask == 1
    assert (source[corrupted] != position[corrupted]).all()
    assert (source[~corrupted] == position[~corrupted]).all()
    # The other three are equally likely: 667 each in expectation, standard error 21.
    for patch in range(4):
        sources = source[corrupted & (position == patch)]
        assert sorted(set(sources)) == sorted(set(range(4)) - {patch})


def test_the_corruption_layer_acts_in_training_only_and_draws_anew_each_call():
    layer = mpp.MaskedPatchCorruption(seed=3)
    tokens = np.random.default_rng(0).normal(size=(4, 16, 8)).astype("float32")
    out, mask = layer(tokens, training=False)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out), tokens)
    assert not keras.ops.convert_to_numpy(mask).any()
    first, second = (keras.ops.convert_to_numpy(layer(tokens, training=True)[1])
                     for _ in range(2))
    assert (first.sum(1) == 8).all() and not np.array_equal(first, second)


def test_loss_counts_corrupted_patches_only_and_every_patch_outside_training():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 512)).astype("float32")
    targets = rng.integers(0, 512, (2, 4, 1)).astype("int32")
    mask = np.array([[1, 0, 0, 1], [0, 1, 0, 0]], "float32")
    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    per_patch = -np.take_along_axis(log_p, targets, axis=-1)[..., 0]
    layer = mpp.MaskedPatchPredictionLoss()
    for training, expected in ((True, per_patch[mask == 1].mean()), (False, per_patch.mean())):
        layer([logits, targets, mask], training=training)
        (loss,) = layer.losses
        assert float(keras.ops.convert_to_numpy(loss)) == pytest.approx(expected, rel=1e-5)


def test_pixel_loss_is_the_mean_squared_error_of_corrupted_patches():
    rng = np.random.default_rng(1)
    predictions, targets = rng.normal(size=(2, 2, 2, 48)).astype("float32")
    mask = np.array([[0, 1], [0, 0]], "float32")
    layer = mpp.MaskedPatchPredictionLoss("pixels")
    layer([predictions, targets, mask], training=True)
    expected = ((predictions[0, 1] - targets[0, 1]) ** 2).mean()
    assert float(keras.ops.convert_to_numpy(layer.losses[0])) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("target,width,classifier", [
    ("mean_colour", 512, "token"), ("downsampled_colour", 16 * 512, "gap"), ("pixels", 48, "token")])
def test_pretraining_model_predicts_every_patch_and_trains_with_fit(tiny_config, target, width,
                                                                     classifier):
    vit = build_model(tiny_config, image_size=8, num_classes=3, classifier=classifier)
    model = mpp.build_pretraining_model(vit, target=target, seed=0)
    assert model.output_shape == (None, 4, width)
    assert "pooling" not in {layer.name for layer in model.layers}
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=None)
    mask_token = model.get_layer("mpp_corruption").mask_token
    history = model.fit(random_images(4, 8, 8), np.zeros((4, 1)), batch_size=2, epochs=1,
                        verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert np.abs(keras.ops.convert_to_numpy(mask_token)).max() > 0  # the [mask] token learns


def test_pretraining_model_saves_and_reloads_with_the_same_predictions(tiny_config, tmp_path):
    model = randomize_weights(mpp.build_pretraining_model(
        build_model(tiny_config, image_size=8, num_classes=3), seed=1))
    model.save(tmp_path / "mpp.keras")
    reloaded = keras.saving.load_model(tmp_path / "mpp.keras")
    images = random_images(2, 8, 8)
    np.testing.assert_allclose(reloaded.predict_on_batch(images), model.predict_on_batch(images),
                               atol=1e-5)
    assert mpp.is_pretraining_model(reloaded)


@pytest.mark.parametrize("layer", [
    mpp.MaskedPatchCorruption(0.4, 0.7, 0.2, seed=5),
    mpp.MaskedPatchTargets(8, "downsampled_colour"),
    mpp.PatchTokens(1),
    mpp.MaskedPatchPredictionLoss("pixels"),
], ids=lambda layer: type(layer).__name__)
def test_layer_config_round_trip(layer):
    config = layer.get_config()
    assert type(layer).from_config(config).get_config() == config


def test_corruption_fractions_are_checked():
    with pytest.raises(ValueError, match=r"mask_fraction \(0.9\) \+ random_fraction \(0.2\)"):
        mpp.MaskedPatchCorruption(mask_fraction=0.9, random_fraction=0.2)
    with pytest.raises(ValueError, match="Unknown MPP target 'colour'"):
        mpp.MaskedPatchTargets(4, "colour")


def test_pretraining_needs_the_models_own_preprocessing(tiny_config):
    vit = build_model(tiny_config, image_size=8, include_preprocessing=False)
    with pytest.raises(ValueError, match="include_preprocessing=True"):
        mpp.build_pretraining_model(vit)


def test_finetuning_from_a_pretrained_file_keeps_the_encoder_and_zeroes_a_new_head(tiny_config,
                                                                                   tmp_path):
    from vit_keras.tools.runs import recipes, training

    model = randomize_weights(mpp.build_pretraining_model(
        build_model(tiny_config, image_size=8, num_classes=3, classifier="gap")))
    path = str(tmp_path / "pretrained.keras")
    model.save(path)
    config = training.RunConfig.of(weights=path)
    recipe = dataclasses_replace(recipes.DIGITS_RECIPE, image_size=8)
    logs = []
    finetune = training.build_run_model(config, recipe, num_classes=10, log=logs.append)
    assert "masked patch prediction" in logs[0]
    names = {layer.name for layer in finetune.layers}
    assert "mpp_corruption" not in names and "mpp_head" not in names
    assert finetune.output_shape == (None, 10)
    head = finetune.get_layer("head")
    assert not any(np.any(keras.ops.convert_to_numpy(w)) for w in head.weights)
    pretrained = {w.path: keras.ops.convert_to_numpy(w) for w in model.weights}
    encoder_paths = [w.path for w in finetune.weights if not w.path.startswith("head/")]
    assert len(encoder_paths) == len(pretrained) - 3  # all but mask token and MPP head kernel/bias
    for weight in finetune.weights:
        if weight.path in encoder_paths:
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(weight),
                                          pretrained[weight.path], err_msg=weight.path)
    images = random_images(2, 8, 8)
    features = keras.Model(finetune.input, head.input).predict_on_batch(images)
    np.testing.assert_allclose(features, mpp.pretrained_encoder(model).predict_on_batch(images),
                               atol=1e-5)


def dataclasses_replace(recipe, **changes):
    import dataclasses

    return dataclasses.replace(recipe, **changes)


# --- apps/pretrain.py end to end, and apps/finetune.py from its model ----------------------------

BACKEND = keras.backend.backend()
# The apps' runs below check what the run records (objective, few-shot table, layout, resume,
# hand-over), the same on every backend: one pass runs them (`make test`). The MPP model trains,
# saves and reloads on every backend in the tests above, and pretrain.py then finetune.py run on
# every backend in test_user_journeys.py, their models loaded on all three.
ONE_PASS = pytest.mark.backend_independent("torch")
# As tests/test_apps.py: ViT-digits at 8 px (4 patches), a few steps per epoch.
TINY = ["--image_size", "8", "--batch_size", "16", "--steps_per_epoch", "3", "--verbose", "2"]


def _app(name, *args, check=True, kill_after_training=None):
    """Runs apps/`name` on this pass's backend; with `kill_after_training` (its run folder),
    SIGKILLed once its training has ended (`conftest.run_killed_after_training`)."""
    import os
    import subprocess
    import sys

    from conftest import REPO_ROOT, run_killed_after_training

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": ""}
    command = [sys.executable, os.path.join("apps", name), *args, "--backend", BACKEND]
    if kill_after_training is not None:
        return run_killed_after_training(command, str(kill_after_training), env)
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    if check and result.returncode:
        raise AssertionError(f"{name} {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="module")
def pretrain_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("pretrain")
    result = _app("pretrain.py", *TINY, "--epochs", "2", "--fewshot_shots", "1,3",
                  "--fewshot_seeds", "2", "--pretrain_splits", "train,val", "--output_dir",
                  str(output))
    return {"dir": output / f"pretrain_digits_ViT-digits_{BACKEND}", "stdout": result.stdout}


@pytest.mark.slow
@ONE_PASS
def test_pretrain_app_trains_the_mpp_model_and_reports_few_shot_accuracy(pretrain_run):
    import json

    metrics = json.loads((pretrain_run["dir"] / "metrics.json").read_text())
    assert metrics["config"]["recipe"]["name"] == "mpp_digits"
    assert metrics["config"]["objective"] == {
        "target": "mean_colour", "corruption_rate": 0.5, "mask_fraction": 0.8,
        "random_fraction": 0.1, "pretrain_splits": ["train", "val"], "fewshot_shots": [1, 3],
        "fewshot_seeds": 2}
    assert metrics["num_examples"]["train"] == 1257 + 180  # the digits' train and val splits
    assert [row["epoch"] for row in metrics["history"]] == [0, 1]
    assert all(np.isfinite(row["loss"]) for row in metrics["history"])
    assert set(metrics["fewshot"]) == {"1", "3"}
    assert len(metrics["fewshot"]["3"]["accuracies"]) == 2
    assert "| 3 | " in pretrain_run["stdout"] and "Saved model: " in pretrain_run["stdout"]
    model = keras.saving.load_model(pretrain_run["dir"] / "model.keras", compile=False)
    assert mpp.is_pretraining_model(model) and model.output_shape == (None, 4, 512)


@pytest.mark.slow
@ONE_PASS
def test_pretrain_run_folder_has_the_training_runs_layout(pretrain_run):
    import os

    files = set(os.listdir(pretrain_run["dir"]))
    assert {"model.keras", "metrics.json", "flags.txt", "class_names.json", "history.csv",
            "training_curves.png", "logs"} <= files
    assert "backup" not in files and not [name for name in files if ".tmp" in name]
    flags_text = (pretrain_run["dir"] / "flags.txt").read_text()
    assert "--pretrain_splits=train,val\n" in flags_text and "--fewshot_shots=1,3\n" in flags_text


@pytest.mark.slow
@ONE_PASS
def test_pretrain_run_killed_after_training_resumes_at_the_few_shot_evaluation(tmp_path):
    import json
    import os
    import signal

    args = (*TINY, "--epochs", "1", "--fewshot_shots", "1", "--fewshot_seeds", "1",
            "--output_dir", str(tmp_path), "--run_name", "killed")
    first = _app("pretrain.py", *args, kill_after_training=tmp_path / "killed")
    assert first.returncode == -signal.SIGKILL, first.stdout[-3000:] + first.stderr[-3000:]
    assert not os.path.exists(tmp_path / "killed" / "metrics.json")
    second = _app("pretrain.py", *args)
    assert "its training ended (epoch 1 of 1) before the few-shot evaluation" in second.stdout
    assert "Epoch 1/1" not in second.stdout  # nothing trained again
    metrics = json.loads((tmp_path / "killed" / "metrics.json").read_text())
    assert metrics["resumed_from_epoch"] == 1 and set(metrics["fewshot"]) == {"1"}
    third = _app("pretrain.py", *args)
    assert "is complete (its metrics.json is written): nothing to do" in third.stdout


@pytest.mark.slow
@ONE_PASS
def test_finetune_app_fine_tunes_the_pretrained_encoder(pretrain_run, tmp_path):
    import json

    result = _app("finetune.py", *TINY, "--epochs", "1", "--recipe", "digits", "--weights",
                  str(pretrain_run["dir"] / "model.keras"), "--output_dir", str(tmp_path),
                  "--run_name", "from_mpp")
    assert "is a masked patch prediction model: fine-tuning its encoder" in result.stdout
    metrics = json.loads((tmp_path / "from_mpp" / "metrics.json").read_text())
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    model = keras.saving.load_model(tmp_path / "from_mpp" / "model.keras", compile=False)
    assert model.output_shape == (None, 10) and not mpp.is_pretraining_model(model)


LABEL_FLAGS = ("label_smoothing", "mixup", "cutmix", "representation_size")


@pytest.mark.slow
@pytest.mark.backend_independent
def test_pretrain_help_documents_the_flags_that_apply_with_pretrainings_defaults():
    import re

    from vit_keras.tools.runs import config_flags, training

    text = _app("pretrain.py", "--help", check=False).stdout
    names = ["backend", *(field.name for field in config_flags.flag_fields(training.RunConfig)
                          if field.name not in LABEL_FLAGS),
             "target", "corruption_rate", "mask_fraction", "random_fraction", "pretrain_splits",
             "fewshot_shots", "fewshot_seeds"]
    for name in names:
        assert re.search(rf"^\s+--(\[no\])?{name}: (\S.*)$", text, re.M), name
    for name in LABEL_FLAGS:  # not defined (the docstring at the top may name them)
        assert not re.search(rf"^\s+--{name}: ", text, re.M), name
    assert re.search(r"--recipe: <auto\|mpp\|mpp_digits>", text)
    assert "2e-4 mpp, 1e-3" in text and "0.03" not in text  # no fine-tuning defaults
    # The example commands keep their line breaks.
    assert "\n    python apps/pretrain.py --backend jax                 # digits" in text


@pytest.mark.slow
@pytest.mark.backend_independent
def test_pretrain_refuses_a_flag_of_labels():
    result = _app("pretrain.py", "--label_smoothing=0.1", check=False)
    assert result.returncode != 0
    assert "Unknown command line flag 'label_smoothing'" in result.stderr


# --- benchmarks/mpp_digits.py's pieces (the benchmark itself takes minutes) ---------------------

def _benchmark():
    import os
    import sys

    from conftest import REPO_ROOT

    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    try:
        return __import__("mpp_digits")
    finally:
        sys.path.remove(os.path.join(REPO_ROOT, "benchmarks"))


@pytest.mark.backend_independent
def test_benchmark_labelled_subset_holds_k_train_images_per_class_with_the_digits_pixels(tmp_path):
    from PIL import Image

    from vit_keras.tools import data

    dataset = _benchmark().labelled_subset(str(tmp_path), per_class=3, seed=1)
    assert dataset == f"folder:{tmp_path}"
    arrays = data.digits_arrays()
    for split, (images, labels) in arrays.items():
        files = sorted((tmp_path / split).glob("*/*.png"))
        assert len(files) == (30 if split == "train" else len(labels)), split
        for file in files[:5]:  # PNG is lossless: the folder pipeline reads the same pixels
            index = int(file.stem)
            assert int(file.parent.name) == labels[index]
            np.testing.assert_array_equal(np.asarray(Image.open(file)), images[index])
    train_labels = [int(f.parent.name) for f in (tmp_path / "train").glob("*/*.png")]
    assert np.bincount(train_labels).tolist() == [3] * 10


@pytest.mark.slow  # over 5 s alone: out of make test-fast
# The benchmark's plumbing (its numbers are no test); the steps on each backend are tested above.
@pytest.mark.backend_independent("torch")
def test_benchmark_masking_cost_times_both_steps():
    seconds = _benchmark().masking_cost(8, 4, "ViT-digits", rounds=2, steps=1)
    assert set(seconds) == {"with corruption", "without"}
    assert all(value > 0 for value in seconds.values())  # physical, not a speed bound
