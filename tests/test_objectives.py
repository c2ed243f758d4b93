"""vit_keras.tools.runs.objectives: what classification and masked patch prediction each give the one
training loop (recipes, training images, model, loss, evaluation, summary)."""

import keras
import numpy as np
import pytest

from vit_keras import build_model
from vit_keras.tools import data
from vit_keras.tools.runs import objectives, recipes
from vit_keras.training import masked_patch_prediction as mpp


def test_masked_patch_prediction_trains_on_the_pooled_splits_it_names():
    splits = data.digits_splits(seed=0)
    pooled = objectives.MaskedPatchPrediction(pretrain_splits=["train", "val"]).training_splits(
        splits)
    assert pooled.num_examples["train"] == 1257 + 180
    assert sum(1 for _ in pooled.encoded_source("train")) == 1257 + 180
    assert pooled.num_examples["test"] == splits.num_examples["test"]  # the rest as it was
    assert objectives.Classification().training_splits(splits) is splits


def test_an_unknown_pretraining_split_is_a_user_error_naming_the_splits_there_are():
    objective = objectives.MaskedPatchPrediction(pretrain_splits=["train", "unlabelled"])
    with pytest.raises(objectives.ObjectiveOptionError, match=r"no split \['unlabelled'\]; it "
                       r"has \['test', 'train', 'val'\]"):
        objective.training_splits(data.digits_splits(seed=0))


def test_few_shot_counts_are_whole_numbers_and_recorded_with_the_other_options():
    objective = objectives.MaskedPatchPrediction(fewshot_shots=["1", "5"], pretrain_splits=["train"])
    assert objective.options() == {
        "target": "mean_colour", "corruption_rate": 0.5, "mask_fraction": 0.8,
        "random_fraction": 0.1, "pretrain_splits": ("train",), "fewshot_shots": (1, 5),
        "fewshot_seeds": 3}
    with pytest.raises(objectives.ObjectiveOptionError, match="whole numbers"):
        objectives.MaskedPatchPrediction(fewshot_shots=["five"])
    assert objectives.Classification().options() is None  # metrics.json as before


def test_masked_patch_prediction_builds_and_compiles_the_mpp_model_with_its_own_loss(
        tiny_config):
    objective = objectives.MaskedPatchPrediction(target="pixels", corruption_rate=0.25)
    model = objective.build_model(build_model(tiny_config, image_size=8, num_classes=3), seed=0)
    assert mpp.is_pretraining_model(model)
    assert model.get_layer("mpp_corruption").corruption_rate == 0.25
    objective.compile(model, keras.optimizers.Adam(1e-3), recipes.MPP_DIGITS_RECIPE, None)
    images = np.random.default_rng(0).uniform(0, 255, (4, 8, 8, 3)).astype("float32")
    history = model.fit(images, np.zeros(4), epochs=1, verbose=0)  # labels unused
    assert np.isfinite(history.history["loss"][0])


def test_masked_patch_prediction_scores_few_shot_accuracy_of_the_frozen_features(tiny_config):
    splits = data.digits_splits(seed=0)
    objective = objectives.MaskedPatchPrediction(fewshot_shots=[1, 2], fewshot_seeds=2)
    model = objective.build_model(build_model(tiny_config, image_size=8, num_classes=10), seed=0)

    def pipeline(split, whole_batches=False):
        return data.make_pipeline(splits, split, image_size=8, batch_size=512)

    results = objective.evaluate(model, splits, pipeline, [{"epoch": 0, "loss": 2.5}])
    assert results["train_loss"] == 2.5 and set(results["fewshot"]) == {1, 2}
    assert len(results["fewshot"][2]["accuracies"]) == 2
    assert all(0.0 <= row["mean"] <= 1.0 for row in results["fewshot"].values())
    summary = objective.summary({**results, "epochs": 1, "fit_time_s": 3.0,
                                 "images_per_second": 100.0,
                                 "config": {"backend": "jax", "dataset": "digits"}})
    assert summary.startswith("Masked patch prediction loss (last epoch): 2.5000; 1 epoch in")
    assert "Few-shot linear accuracy of the frozen features (digits test)" in summary
    assert "| 2 | " in summary


@pytest.mark.backend_independent
def test_pretraining_leaves_out_the_flags_of_labels_and_names_its_own_defaults():
    objective = objectives.MaskedPatchPrediction
    assert set(objective.left_out_flags) == {"label_smoothing", "mixup", "cutmix",
                                            "representation_size"}
    overrides = objective.flag_overrides
    assert overrides["recipe"]["choices"] == ("auto", "mpp", "mpp_digits")
    assert "2e-4 mpp, 1e-3 mpp_digits" in overrides["learning_rate"]["help"]
    assert "0.03" not in " ".join(setting["help"] for setting in overrides.values())
    assert objectives.Classification.left_out_flags == ()
