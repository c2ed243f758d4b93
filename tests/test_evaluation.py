"""vit_keras.tools.evaluation: reports and top-k predictions from logits."""

import numpy as np
import pytest

from vit_keras.tools import evaluation


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
