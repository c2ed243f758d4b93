"""Whether a training step fits: a lower bound of its activations' bytes
(`training_activation_bytes`), the memory of the device it runs on (`device_memory`), and the
check a run makes before its first step (`check_activation_memory`); whether an fsdp run's
model.keras can be gathered on its host (`check_host_memory_for_saving`)."""

import os

import keras

from vit_keras import errors
from vit_keras.model import ViT


class ActivationMemoryError(errors.UserError, ValueError):
    """A training step's activations cannot fit in the memory of the device it runs on."""


class HostMemoryError(errors.UserError, MemoryError):
    """An fsdp run's weights and optimizer state, gathered whole to write model.keras, cannot
    fit in its host's memory."""


def training_activation_bytes(model, batch_size, image_size=None):
    """A lower bound of the bytes of activations one training step of `model` keeps for its
    backward pass, at `batch_size` images per device of `image_size` pixels a side (default: the
    model's; a model of dynamic image size may be fed another).

    Per image, each Transformer block's own count (`TransformerBlock.activation_bytes`: its
    norms' and projections' inputs, its MLP's, a gate's included, and the attention
    probabilities unless fused). Embeddings, a hybrid's ResNet, the head, gradients and the
    optimizer come on top.
    """
    if not isinstance(model, ViT):  # e.g. the MPP model: counted by the ViT it was built from
        return 0
    if image_size is None:
        rows, cols = model.token_grid
    else:
        rows = cols = int(image_size) // model.token_pixels
    tokens = rows * cols + model.num_prefix_tokens
    return sum(block.activation_bytes(tokens) for block in model.blocks) * int(batch_size)


def device_memory():
    """`(bytes, name)` of the memory a training step runs in: the first accelerator's where the
    backend reports it, else the host's RAM (within a cgroup's limit); `(None, name)` when
    unknown (TensorFlow on a GPU)."""
    backend = keras.backend.backend()
    # Each framework is imported in its branch: only the running backend's is loaded.
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform != "cpu":
            limit = (device.memory_stats() or {}).get("bytes_limit")
            return limit, f"{device.device_kind} ({device.platform})"
    elif backend == "torch":
        import torch

        if torch.cuda.is_available():
            return (torch.cuda.get_device_properties(0).total_memory,
                    torch.cuda.get_device_name(0))
    elif backend == "tensorflow":
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            return None, "GPU"
    return host_ram_bytes(), "host memory (RAM)"


def host_ram_bytes():
    """Bytes of this host's RAM, within a cgroup's limit."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        physical = min(physical, int(limit)) if limit.isdigit() else physical
    except OSError:
        pass
    return physical


def saving_shortfall(whole_bytes, available=None):
    """`None` when a sharded run's weights and optimizer state, `whole_bytes` gathered whole,
    fit in this host's RAM (`host_ram_bytes()` unless `available`); else a sentence saying so."""
    available = host_ram_bytes() if available is None else available
    if whole_bytes <= available:
        return None
    return (f"writing model.keras gathers this run's weights and optimizer state whole on each "
            f"host, {_binary_size(whole_bytes)}, more than its {_binary_size(available)} of "
            f"memory")


def check_host_memory_for_saving(whole_bytes, weight_bytes, checkpoint, available=None):
    """Raises `HostMemoryError` (one line) when an fsdp run's model.keras cannot be gathered on
    this host (`saving_shortfall`), naming the sharded Orbax `checkpoint` that holds the trained
    state and the two ways to a model.keras from it (docs/distributed.md)."""
    shortfall = saving_shortfall(whole_bytes, available)
    if shortfall is None:
        return
    raise HostMemoryError(
        f"The run trained, but {shortfall}. Its trained state stays in the sharded checkpoint "
        f"{checkpoint}: run the same command on hosts with at least {_binary_size(whole_bytes)} "
        f"of memory (it resumes at its final evaluation and writes model.keras), or load the "
        f"weights alone ({_binary_size(weight_bytes)}) into the model with "
        f"vit_keras.tools.distributed.sharded_checkpoint.restore(model, path, with_optimizer=False) and "
        f"save or export it (docs/distributed.md).")


def _binary_size(count):
    value, unit = count / 1024 ** 3, "GiB"
    for larger in ("TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:,.1f} {unit}"


def check_activation_memory(model, batch_size, image_size, memory=None, resident_bytes=0):
    """Raises `ActivationMemoryError` (one line: the estimate, the memory, the flags to change)
    when `training_activation_bytes` plus `resident_bytes` (what a device keeps between steps:
    its parameters, gradients and optimizer state, `sharding.Placement`) exceeds the device's
    memory (`device_memory()` unless `memory`, a `(bytes, name)` pair, is given); returns the
    estimate otherwise."""
    activations = training_activation_bytes(model, batch_size, image_size)
    needed = activations + int(resident_bytes)
    available, where = memory or device_memory()
    if available and needed > available:
        resident = (f" on top of {_binary_size(resident_bytes)} of parameters, gradients and "
                    f"optimizer state per device" if resident_bytes else "")
        more = (", or split the weights over more devices (--distribution fsdp)"
                if resident_bytes else "")
        raise ActivationMemoryError(
            f"A training step at --image_size {image_size} and --batch_size {batch_size} "
            f"(per device) keeps at least {_binary_size(activations)} of activations for "
            f"{model.name}{resident}, more than the {_binary_size(available)} of {where}: lower "
            f"--image_size or --batch_size (with --accum_steps to keep the batch per "
            f"update){more}.")
    return needed
