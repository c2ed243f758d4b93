"""vit_keras.tools.memory: the activation estimate and the check before the first step."""

import pytest

from vit_keras import build_model
from vit_keras.tools import memory


def test_activation_estimate_grows_with_batch_and_tokens(tiny_config):
    small = build_model(tiny_config, image_size=8, num_classes=3)     # 2x2 patches + class token
    large = build_model(tiny_config, image_size=16, num_classes=3)    # 4x4 patches + class token
    one = memory.training_activation_bytes(small, 1)
    assert one > 0 and memory.training_activation_bytes(small, 8) == 8 * one
    # 17 tokens against 5: at least linear, and quadratic where attention is not fused.
    assert memory.training_activation_bytes(large, 1) >= one * 17 / 5


def test_a_step_that_cannot_fit_in_memory_is_refused_with_the_flags_to_change(tiny_config):
    model = build_model(tiny_config, image_size=16, num_classes=3)
    needed = memory.training_activation_bytes(model, 64)
    assert memory.check_activation_memory(model, 64, 16, memory=(needed, "test")) == needed
    with pytest.raises(memory.ActivationMemoryError) as error:
        memory.check_activation_memory(model, 64, 16, memory=(needed - 1, "a test device"))
    message = str(error.value)
    assert "--image_size 16" in message and "--batch_size 64" in message
    assert "of a test device" in message and "GiB" in message and "\n" not in message
    assert memory.check_activation_memory(model, 64, 16, memory=(None, "unknown")) == needed


def test_the_check_counts_what_a_device_keeps_between_steps(tiny_config):
    """Under a sharding distribution the run passes each device's parameters, gradients and
    optimizer state (`sharding.Placement`); too much of them is refused with fsdp as a way out."""
    model = build_model(tiny_config, image_size=16, num_classes=3)
    needed = memory.training_activation_bytes(model, 8)
    resident = 3 * 2 ** 30
    assert memory.check_activation_memory(model, 8, 16, memory=(needed + resident, "test"),
                                          resident_bytes=resident) == needed + resident
    with pytest.raises(memory.ActivationMemoryError) as error:
        memory.check_activation_memory(model, 8, 16, memory=(needed + resident - 1, "a GPU"),
                                       resident_bytes=resident)
    message = str(error.value)
    assert "on top of 3.0 GiB of parameters, gradients and optimizer state per device" in message
    assert "--distribution fsdp" in message and "\n" not in message


def test_an_fsdp_model_too_big_to_gather_names_its_sharded_checkpoint_and_the_ways_out():
    """fsdp trains and backs up without gathering; only model.keras gathers the weights and
    optimizer state whole on each host."""
    assert memory.host_memory() > 2 ** 30
    assert memory.saving_shortfall(2 ** 30, available=2 ** 31) is None
    memory.check_host_memory_for_saving(2 ** 30, 2 ** 28, "ckpt", available=2 ** 31)
    with pytest.raises(memory.HostMemoryError) as error:  # ViT-g/14 with AdamW
        memory.check_host_memory_for_saving(12_151_337_184, 4_050_445_728,
                                            "run/backup/epoch-3.orbax", available=8 * 2 ** 30)
    message = str(error.value)
    assert "11.3 GiB, more than its 8.0 GiB of memory" in message and "\n" not in message
    assert "sharded checkpoint run/backup/epoch-3.orbax" in message
    assert "weights alone (3.8 GiB)" in message and "with_optimizer=False" in message
