"""vit_keras.tools.plots.plot_history: a run's training curves."""

from PIL import Image
import pytest

from vit_keras.tools import plots

pytestmark = pytest.mark.backend_independent


@pytest.mark.parametrize("history", [
    [{"epoch": 0, "loss": 2.0, "accuracy": 0.3, "val_loss": 1.9, "val_accuracy": 0.35},
     {"epoch": 1, "loss": 1.5, "accuracy": 0.5, "val_loss": 1.6, "val_accuracy": 0.45}],
    [{"epoch": 0, "loss": 6.0}, {"epoch": 1, "loss": 4.0}],   # pre-training: loss only
], ids=["classification", "pretraining"])
def test_training_curves_are_a_1000_by_400_png(history, tmp_path):
    path = plots.plot_history(history, str(tmp_path / "curves.png"))
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (1000, 400)
