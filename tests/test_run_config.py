"""vit_keras.tools.runs.run_config: the training apps' flags, grouped by concern, set and read back by
their flag names."""

import pytest

from vit_keras.tools.runs import config_flags
from vit_keras.tools.runs.run_config import RunConfig

pytestmark = pytest.mark.backend_independent


def test_of_sets_each_flag_in_its_group_and_flags_reads_them_back():
    config = RunConfig.of(dataset="cifar10", weights="w.npz", epochs=5, lora_rank=4, remat=True,
                          seed=7, flags_text="--x\n")
    assert (config.data.dataset, config.model.weights, config.optimization.epochs,
            config.finetuning.lora_rank, config.compute.remat, config.seed) == (
        "cifar10", "w.npz", 5, 4, True, 7)
    assert config.flags_text == "--x\n" and "flags_text" not in config.flags()
    assert [name for name in config.flags()] == [
        field.name for field in config_flags.flag_fields(RunConfig)]
    assert config.flags()["epochs"] == 5 and config.flags()["dataset"] == "cifar10"


def test_replace_changes_a_copy():
    config = RunConfig.of(epochs=5)
    changed = config.replace(epochs=6, verbose=0)
    assert (config.optimization.epochs, changed.optimization.epochs) == (5, 6)
    assert changed.output.verbose == 0 and changed.data == config.data
    with pytest.raises(TypeError, match="has no field epoch"):
        config.replace(epoch=6)
