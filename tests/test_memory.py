"""vit_keras.tools.distributed.memory: the activation estimate and the check before the first step."""

import keras
import numpy as np
import pytest

from vit_keras import build_model
from vit_keras.tools.distributed import memory


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
    assert memory.host_ram_bytes() > 2 ** 30
    assert memory.saving_shortfall(2 ** 30, available=2 ** 31) is None
    memory.check_host_memory_for_saving(2 ** 30, 2 ** 28, "ckpt", available=2 ** 31)
    with pytest.raises(memory.HostMemoryError) as error:  # ViT-g/14 with AdamW
        memory.check_host_memory_for_saving(12_151_337_184, 4_050_445_728,
                                            "run/backup/epoch-3.orbax", available=8 * 2 ** 30)
    message = str(error.value)
    assert "11.3 GiB, more than its 8.0 GiB of memory" in message and "\n" not in message
    assert "sharded checkpoint run/backup/epoch-3.orbax" in message
    assert "weights alone (3.8 GiB)" in message and "with_optimizer=False" in message


@pytest.mark.backend_independent("jax")
@pytest.mark.skipif(keras.backend.backend() != "jax",
                    reason="reads XLA's memory analysis of a compiled JAX step; its pass is JAX's")
def test_the_estimate_bounds_what_xla_keeps_and_counts_a_gate_as_xla_does():
    import jax  # pylint: disable=import-outside-toplevel

    def xla_temporary_bytes(model, batch):
        trainable = [v.value for v in model.trainable_variables]
        fixed = [v.value for v in model.non_trainable_variables]
        images = np.zeros((batch, *model.image_size, 3), "float32")

        def loss(weights):
            logits, _ = model.stateless_call(weights, fixed, images, training=True)
            return (logits ** 2).sum()

        step = jax.jit(jax.grad(loss)).lower(trainable).compile()
        return step.memory_analysis().temp_size_in_bytes

    found = {}
    for mlp in ("gelu", "swiglu"):
        model = build_model({"name": mlp, "patch_size": 4, "hidden_size": 64, "mlp_dim": 256,
                             "num_heads": 4, "num_layers": 2, "mlp": mlp}, image_size=32,
                            num_classes=10, include_preprocessing=False)
        found[mlp] = memory.training_activation_bytes(model, 8), xla_temporary_bytes(model, 8)
        assert found[mlp][0] <= found[mlp][1], (mlp, found)  # a lower bound
    # The gate's two extra (tokens, mlp_dim) activations per block, as XLA keeps them.
    estimated, kept = (found["swiglu"][i] - found["gelu"][i] for i in (0, 1))
    assert estimated > 0 and abs(estimated - kept) <= 0.05 * kept, found
