"""vit_keras.tools.runs.run_parts: the parts a run's flags ask for, chosen once and checked then."""

import pytest

from vit_keras import errors
from vit_keras.tools.runs import objectives, run_parts
from vit_keras.tools.runs.training import RunConfig

pytestmark = pytest.mark.backend_independent


def _kinds(**flags):
    return [type(part) for part in run_parts.choose(RunConfig.of(**flags))]


def test_a_run_without_options_has_no_parts():
    assert run_parts.choose(RunConfig.of()) == []


def test_the_parts_come_in_the_order_the_run_applies_them():
    # The probe copies the model; remat and LoRA then change the copy in place.
    assert _kinds(linear_probe=True, remat=True, layer_decay=0.75, ema_decay=0.999) == [
        run_parts.LinearProbe, run_parts.Remat, run_parts.LayerDecay, run_parts.Ema]
    assert _kinds(remat=True, lora_rank=4) == [run_parts.Remat, run_parts.Lora]
    assert _kinds(lora_rank=0) == []  # rank 0 is no LoRA


def test_only_the_fine_tuning_methods_name_the_run():
    parts = run_parts.choose(RunConfig.of(lora_rank=4, remat=True, layer_decay=0.75,
                                          ema_decay=0.9))
    assert [part.run_name for part in parts] == [None, "lora4", "layer-decay0.75", None]


def test_a_parts_flags_are_checked_when_it_is_chosen():
    with pytest.raises(errors.UserError, match="--layer_decay must be in"):
        run_parts.choose(RunConfig.of(layer_decay=1.5))
    with pytest.raises(errors.UserError, match="--lora_alpha 8 scales LoRA adapters"):
        run_parts.choose(RunConfig.of(lora_alpha=8.0))
    with pytest.raises(errors.UserError, match="needs a validation split"):
        run_parts.choose(RunConfig.of(ema_decay=0.9), objectives.MaskedPatchPrediction())
    with pytest.raises(errors.UserError, match="MaskedPatchPrediction"):
        run_parts.choose(RunConfig.of(lora_rank=4), objectives.MaskedPatchPrediction())


def test_lora_and_ema_carry_what_the_run_asks_of_them():
    lora, ema = run_parts.choose(RunConfig.of(lora_rank=4, lora_alpha=8.0, ema_decay=0.99))
    assert lora.checkpoint is not None and (lora.rank, lora.alpha, lora.pretrained) == (
        4, 8.0, False)
    assert ema.optimizer_options(None, print) == {"ema_decay": 0.99}
