"""vit_keras.tools.plots.plot_history: a run's training curves; every figure written whole."""

import sys

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


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_figure_that_fills_the_disk_leaves_the_one_it_replaces(tmp_path):
    import resource  # POSIX only

    history = [{"epoch": 0, "loss": 2.0}, {"epoch": 1, "loss": 1.5}]
    path = plots.plot_history(history, str(tmp_path / "curves.png"))
    with open(path, "rb") as f:
        before = f.read()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    # Writes past 4 KiB fail with EFBIG, as on a full disk with ENOSPC (Python ignores SIGXFSZ).
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 * 1024, limits[1]))
    try:
        with pytest.raises(OSError, match="File too large"):
            plots.plot_history(history + [{"epoch": 2, "loss": 1.0}], path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    with open(path, "rb") as f:
        assert f.read() == before
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]
