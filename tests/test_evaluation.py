"""vit_keras.tools.runs.evaluation: reports and top-k predictions from logits."""

import numpy as np
import pytest

from vit_keras.tools.runs import evaluation, recipes

from conftest import TINY_CONFIG, tiny_model


def test_classification_report_and_top_k():
    logits = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0], [2.0, 0.0, 1.0]])
    labels = np.array([0, 2, 2, 1])
    report = evaluation.classification_report(logits, labels, ["a", "b", "c"])
    assert report["accuracy"] == 0.5 and report["count"] == 4
    assert report["per_class"]["c"] == {"accuracy": 0.5, "count": 2}
    assert report["per_class"]["b"] == {"accuracy": 0.0, "count": 1}
    top = evaluation.top_k_predictions(logits[:1], ["a", "b", "c"], k=2)
    assert [name for name, _ in top[0]] == ["a", "b"]
    assert top[0][0][1] == pytest.approx(np.exp(3) / (np.exp(3) + np.exp(1) + 1))


# The rule, not a backend's numbers: one pass.
@pytest.mark.backend_independent
@pytest.mark.parametrize("num_classes", [3, 5, 6])
def test_top5_is_reported_only_with_more_than_5_classes(num_classes):
    """With 5 classes or fewer every label is in the top 5: 100% would read as a result. The
    report, its headline and a run's compiled metrics follow one rule."""
    logits = np.random.default_rng(0).normal(size=(4, num_classes))
    report = evaluation.classification_report(logits, np.zeros(4, int),
                                              [str(i) for i in range(num_classes)])
    shown = num_classes > 5
    assert (report["top5_accuracy"] is not None) == shown
    assert ("top-5" in evaluation.headline(report)) == shown
    model = tiny_model(dict(TINY_CONFIG), num_classes=num_classes)
    recipes.compile_model(model, "sgd")
    assert ("top5_accuracy" in str(model.get_compile_config()["weighted_metrics"])) == shown
