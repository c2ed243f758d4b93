"""`vit_keras.fewshot`: big_vision's closed-form least-squares probe against a scikit-learn ridge
regression of the same problem, known answers on separable features, the shot sampling, the
logistic probe and the pre-logits features of every kind of model."""

import keras
import numpy as np
import pytest

from vit_keras import build_model
from vit_keras.training import fewshot
from vit_keras.training import masked_patch_prediction as mpp

from conftest import random_images, randomize_weights


def separable(num_classes=4, per_class=30, dim=None, seed=0):
    """Features whose class is the argmax of their first `num_classes` coordinates, with a margin
    of 4 over noise of standard deviation 0.3 (`dim` > `num_classes` adds pure-noise coordinates,
    which whitening scales up to the signal's size)."""
    dim = num_classes if dim is None else dim
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(num_classes), per_class)
    features = rng.normal(0, 0.3, (len(labels), dim))
    features[np.arange(len(labels)), labels] += 4.0
    return features.astype("float32"), labels


@pytest.mark.backend_independent
@pytest.mark.parametrize("shots", [2, 25])  # fewer points than features, then more (both forms)
def test_least_squares_scores_equal_a_scikit_learn_ridge_regression(shots):
    from sklearn.linear_model import Ridge

    features, labels = separable(num_classes=3, per_class=40, dim=20, seed=1)
    rng = np.random.default_rng(2)
    features = features + rng.normal(0, 1.0, features.shape)  # not separable: errors to match
    chosen = fewshot.sample_shots(labels, shots, seed=0)
    test = rng.normal(0, 2.0, (50, 20))
    scores = fewshot.least_squares_scores(features[chosen], labels[chosen], test, 3, l2_reg=8.0)
    # The reference: the same whitening, bias feature and {-1, 1} targets, solved by scikit-learn.
    x = features[chosen].astype(np.float64)
    mean, std = x.mean(0), x.std(0) + 1e-5
    pad = lambda a: np.hstack([(a - mean) / std, np.full((len(a), 1), 100.0)])  # noqa: E731
    ridge = Ridge(alpha=8.0, fit_intercept=False, solver="cholesky").fit(
        pad(x), 2.0 * np.eye(3)[labels[chosen]] - 1.0)
    np.testing.assert_allclose(scores, ridge.predict(pad(test)), atol=1e-5, rtol=0)


@pytest.mark.backend_independent
def test_separable_features_give_every_test_example_right():
    features, labels = separable()
    test_features, test_labels = separable(seed=1)
    results = fewshot.evaluate(features, labels, test_features, test_labels, shots=(1, 5, 10),
                               seeds=3)
    for count in (1, 5, 10):
        assert results[count]["accuracies"] == [1.0, 1.0, 1.0]
        assert results[count]["mean"] == 1.0 and results[count]["std"] == 0.0


@pytest.mark.backend_independent
def test_random_labels_stay_near_chance():
    """The probe cannot read labels it was not given: random features and labels of 4 classes."""
    rng = np.random.default_rng(0)
    features, labels = rng.normal(size=(400, 32)), rng.integers(0, 4, 400)
    results = fewshot.evaluate(features[:200], labels[:200], features[200:], labels[200:],
                               shots=(10,), seeds=3)
    # 200 test examples at chance 0.25: a binomial standard error of 0.03, so 0.4 is 5 of them.
    assert results[10]["mean"] < 0.4


@pytest.mark.backend_independent
def test_shot_sampling_is_deterministic_given_the_seed_and_extends_with_more_shots():
    _, labels = separable(per_class=30)
    first = fewshot.sample_shots(labels, 5, seed=3)
    assert np.array_equal(first, fewshot.sample_shots(labels, 5, seed=3))
    assert not np.array_equal(first, fewshot.sample_shots(labels, 5, seed=4))
    assert np.bincount(labels[first]).tolist() == [5, 5, 5, 5]
    more = fewshot.sample_shots(labels, 10, seed=3).reshape(4, 10)
    assert np.array_equal(more[:, :5].ravel(), first)


@pytest.mark.backend_independent
def test_evaluate_is_deterministic_given_the_seeds():
    features, labels = separable(dim=8)
    noisy = features + np.random.default_rng(5).normal(0, 2.0, features.shape)
    runs = [fewshot.evaluate(noisy, labels, noisy, labels, shots=(1, 5), seeds=3)
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0][1]["accuracies"])) > 1  # the seeds draw different examples


@pytest.mark.backend_independent
def test_too_many_shots_are_refused_naming_the_short_classes():
    labels = np.array([0, 0, 0, 1])
    with pytest.raises(ValueError, match=r"classes \[1\] have only \[1\]"):
        fewshot.sample_shots(labels, 2, seed=0)


def test_logistic_probe_separates_separable_features_and_is_deterministic():
    features, labels = separable(per_class=5)
    test_features, test_labels = separable(seed=1)
    # 100 full-batch steps (not the default 300): enough for this margin, and fast on torch.
    accuracies = [fewshot.logistic_probe(features, labels, test_features, test_labels, 4,
                                         steps=100) for _ in range(2)]
    assert accuracies == [1.0, 1.0]


def test_evaluate_runs_the_logistic_probe_when_asked():
    features, labels = separable(per_class=2)
    results = fewshot.evaluate(features, labels, features, labels, shots=(1,), seeds=1,
                               probe="logistic")
    assert results[1]["accuracies"] == [1.0]
    with pytest.raises(ValueError, match="Unknown probe 'ridge'"):
        fewshot.evaluate(features, labels, features, labels, probe="ridge")


@pytest.mark.parametrize("representation_size", [None, 8])
def test_features_of_a_classifier_are_its_heads_input(tiny_config, representation_size):
    model = randomize_weights(build_model(tiny_config, image_size=8, num_classes=3,
                                          representation_size=representation_size))
    images = random_images(3, 8, 8)
    expected = keras.Model(model.input, model.get_layer("head").input).predict_on_batch(images)
    features = fewshot.extract_features(model, images, batch_size=2)
    assert features.shape == (3, representation_size or 32)
    np.testing.assert_allclose(features, expected, atol=1e-6)


def test_features_of_a_pretraining_model_are_its_encoders_pooled_output(tiny_config):
    vit = randomize_weights(build_model(tiny_config, image_size=8, include_top=False))
    images = random_images(3, 8, 8)
    pretraining = mpp.build_pretraining_model(vit)
    # The ViT and the pre-training model share their layers: the same pooled features.
    np.testing.assert_allclose(fewshot.extract_features(pretraining, images),
                               vit.predict_on_batch(images), atol=1e-6)


@pytest.mark.slow
# The app's plumbing around `fewshot.evaluate`; features on each backend are tested above.
@pytest.mark.backend_independent("torch")
def test_fewshot_app_reports_mean_and_spread_over_seeds(tiny_config, tmp_path):
    """apps/fewshot.py on a tiny random classifier of the digits, in a subprocess on this pass's
    backend; its numbers equal `fewshot.evaluate` on the same features in this process."""
    import json
    import os
    import subprocess
    import sys

    from vit_keras.tools import data

    from conftest import REPO_ROOT

    model = randomize_weights(build_model(tiny_config, image_size=8, num_classes=10))
    model.save(tmp_path / "model.keras")
    command = [sys.executable, os.path.join("apps", "fewshot.py"), "--model",
               str(tmp_path / "model.keras"), "--shots", "1,2", "--seeds", "2", "--json",
               str(tmp_path / "fewshot.json"), "--backend", keras.backend.backend()]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "fewshot.json").read_text())
    assert report["dataset"] == "digits" and report["feature_dimension"] == 32
    splits = data.load_splits("digits", log=lambda _: None)
    features = {split: fewshot.dataset_features(model, data.make_pipeline(
        splits, split, image_size=8, batch_size=256).as_numpy_iterator())
        for split in ("train", "test")}
    expected = fewshot.evaluate(*features["train"], *features["test"], shots=(1, 2), seeds=2)
    for count in (1, 2):
        assert report["results"][str(count)]["accuracies"] == pytest.approx(
            expected[count]["accuracies"], abs=1 / 360)  # one test image: features to ~1e-6
    assert "| 2 | " in result.stdout
