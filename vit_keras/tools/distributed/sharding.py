"""Fully sharded data parallelism (`--distribution fsdp`, JAX): each weight split along one of its
axes over the devices that also split the batch, the optimizer's slots with it, and what each
device then holds.

The rule is big_vision's `fsdp`: a weight is split along its largest axis that the data axis's
device count divides and that no other rule (the `model` axis) has taken; a weight smaller than
`min_bytes` stays whole on every device. It reads each weight's shape, never its name, so it
covers any model; a weight it cannot split (no axis divides) is named in `Placement.uncovered`,
not silently replicated. Imports only Keras and NumPy at module level.
"""

import contextlib
import dataclasses
import math

import keras
import numpy as np

DATA_AXIS = "batch"  # the mesh axis that splits the batch, Keras' `batch_dim_name`


def fsdp_axes(shape, devices, itemsize=4, min_bytes=0, taken=None):
    """The axes (one name or `None` per dimension) of a weight under the FSDP rule.

    Args:
      shape: the weight's shape.
      devices: the data axis's device count.
      itemsize: bytes per value.
      min_bytes: below this size a weight stays whole on every device.
      taken: the axes other rules already gave it (e.g. `(None, "model", None)`); default none.

    Returns:
      `(axes, why)`: `why` is `"sharded"`, `"small"`, `"scalar"`, `"one device"` or
      `"indivisible"` (no free axis that `devices` divides). Among equally long axes the last
      is split (a kernel's output axis).
    """
    axes = tuple(taken) if taken is not None else (None,) * len(shape)
    if not shape:
        return axes, "scalar"
    if devices == 1:
        return axes, "one device"
    if math.prod(shape) * itemsize < min_bytes:
        return axes, "small"
    free = [i for i, size in enumerate(shape) if axes[i] is None and size % devices == 0]
    if not free:
        return axes, "indivisible"
    chosen = max(free, key=lambda i: (shape[i], i))
    return axes[:chosen] + (DATA_AXIS,) + axes[chosen + 1:], "sharded"


class FullyShardedDataParallel(keras.distribution.ModelParallel):
    """Keras' `ModelParallel` whose weights are split over the batch axis too (`fsdp_axes`).

    The batch is split over the mesh's `batch` axis as in data parallelism; every weight is
    split along one axis over the same devices, and XLA gathers it where a layer needs it whole
    (GSPMD). The optimizer's slots take their weight's layout (Keras' `add_variable_from_reference`),
    so parameters, gradients and optimizer state all shrink with the device count. A `(batch,
    model)` mesh with a `layout_map` for the `model` axis combines both: the FSDP rule then
    splits a free axis of each weight.

    Args:
      device_mesh: a `keras.distribution.DeviceMesh` with a `batch` axis (and optionally
        `model`).
      layout_map: the `model` axis's rules (`distribution.model_parallel_layout_map`), or None.
      min_bytes: weights smaller than this stay whole on every device.
    """

    def __init__(self, device_mesh, layout_map=None, min_bytes=0, **kwargs):
        layout_map = layout_map or keras.distribution.LayoutMap(device_mesh)
        super().__init__(layout_map=layout_map, batch_dim_name=DATA_AXIS, **kwargs)
        self.min_bytes = int(min_bytes)

    @property
    def data_devices(self):
        return self.device_mesh.shape[self.device_mesh.axis_names.index(DATA_AXIS)]

    def get_variable_layout(self, variable):
        if getattr(variable, "_layout", None) is not None:  # an optimizer slot: its weight's
            return variable._layout  # pylint: disable=protected-access
        rule = self._layout_map[variable.path]
        axes, _ = fsdp_axes(tuple(variable.shape), self.data_devices,
                            np.dtype(variable.dtype).itemsize, self.min_bytes,
                            rule.axes if rule is not None else None)
        return keras.distribution.TensorLayout(axes, self.device_mesh)


@dataclasses.dataclass(frozen=True)
class Placement:
    """What one device holds of a model and its optimizer (bytes), and the weights the FSDP rule
    left whole though they are large enough to split."""

    parameter_bytes: int
    optimizer_bytes: int
    total_parameter_bytes: int
    total_optimizer_bytes: int
    gradient_bytes: int = 0  # the trainable weights' share: a step's gradients are laid out so
    uncovered: tuple = ()

    @property
    def per_device_fraction(self):
        """Device bytes over the bytes of one whole copy (1.0: replicated)."""
        whole = self.total_parameter_bytes + self.total_optimizer_bytes
        return (self.parameter_bytes + self.optimizer_bytes) / whole if whole else 1.0

    def describe(self):
        line = (f"per device: {_mib(self.parameter_bytes)} of parameters and "
                f"{_mib(self.optimizer_bytes)} of optimizer state ({self.per_device_fraction:.3f}"
                f" of one whole copy, {_mib(self.total_parameter_bytes)} + "
                f"{_mib(self.total_optimizer_bytes)})")
        if self.uncovered:
            line += (f"; {len(self.uncovered)} weight(s) have no axis the device count divides "
                     f"and stay whole on every device: {', '.join(self.uncovered)}")
        return line


def _mib(count):
    return f"{count / 2 ** 20:,.1f} MiB"


def shard_bytes(shape, dtype, axes, mesh_shape):
    """Bytes one device holds of a `shape` tensor laid out along `axes` (names of `mesh_shape`,
    a dict axis name -> devices; `None` for a whole dimension)."""
    shard = [size // mesh_shape[axis] if axis else size for size, axis in zip(shape, axes)]
    return math.prod(shard) * np.dtype(dtype).itemsize


def slot_weight(variable, weights):
    """The weight among `weights` whose optimizer slot `variable` is (Keras names a slot
    `<weight path with _ for />_<slot>`, e.g. `adam_w/encoderblock_0_LayerNorm_0_gamma_momentum`),
    or None."""
    name = variable.path.split("/")[-1]
    return next((w for w in weights if name.startswith(w.path.replace("/", "_") + "_")), None)


def placement(model, min_bytes=0):
    """`Placement` of a compiled model's weights and optimizer variables under the current
    distribution, read from their layouts. A model built under the distribution holds them on
    devices already; one built under `keras.StatelessScope` (its variables not yet created:
    `estimate`) holds nothing, and its layouts are asked of the distribution as creating them
    would.

    Under `FullyShardedDataParallel`, a weight of at least `min_bytes` without the data axis in
    its layout is `uncovered` (on a mesh whose data axis has one device, nothing is)."""
    distribution = keras.distribution.distribution()
    mesh_shape = (dict(zip(distribution.device_mesh.axis_names, distribution.device_mesh.shape))
                  if distribution is not None else {})
    weights = model.weights

    def axes_of(variable):
        layout = getattr(variable, "_layout", None)
        if layout is None and distribution is not None:
            # Not created yet: the weight an optimizer slot copies, else the variable itself.
            reference = slot_weight(variable, model.trainable_weights)
            reference = variable if reference is None else reference
            layout = getattr(reference, "_layout", None)
            if layout is None:
                layout = distribution.get_variable_layout(reference)
        return tuple(layout.axes) if layout is not None else (None,) * len(variable.shape)

    def device_bytes(variable):
        return shard_bytes(tuple(variable.shape), variable.dtype, axes_of(variable), mesh_shape)

    def whole_bytes(variable):
        return math.prod(variable.shape) * np.dtype(variable.dtype).itemsize

    slots = model.optimizer.variables if getattr(model, "optimizer", None) is not None else []
    slots = [v for v in slots if len(v.shape)]  # the step count, the learning rate: scalars
    uncovered = ()
    if isinstance(distribution, FullyShardedDataParallel) and mesh_shape[DATA_AXIS] > 1:
        uncovered = tuple(w.path for w in weights if len(w.shape)
                          and whole_bytes(w) >= max(min_bytes, 1)
                          and DATA_AXIS not in axes_of(w))
    return Placement(sum(map(device_bytes, weights)), sum(map(device_bytes, slots)),
                     sum(map(whole_bytes, weights)), sum(map(whole_bytes, slots)),
                     sum(map(device_bytes, model.trainable_weights)), uncovered)


@contextlib.contextmanager
def whole_values(model):
    """While open, each variable of `model` and its optimizer whose JAX array is split over
    other processes' devices holds its whole value, gathered to this host, so that Keras can
    save it (`model.save` reads every value on one host); afterwards the split arrays are back.

    A collective when any variable is split across processes: every process must enter (they
    share the layouts, so they agree on it). A no-op otherwise, and off JAX. The whole model and
    its optimizer state must then fit in each host's memory; `docs/distributed.md` says what to
    do when they do not.
    """
    if keras.backend.backend() != "jax":
        yield
        return
    import jax

    optimizer = getattr(model, "optimizer", None)
    variables = [*model.variables, *(optimizer.variables if optimizer is not None else [])]
    split = [v for v in variables if isinstance(v.value, jax.Array)
             and not v.value.is_fully_addressable]
    if not split:
        yield
        return
    from jax.experimental import multihost_utils

    arrays = [v.value for v in split]
    gathered = multihost_utils.process_allgather(arrays, tiled=True)
    # pylint: disable=protected-access
    # `assign` would lay a whole value out again over the devices: swap the stored array.
    for variable, value in zip(split, gathered):
        variable._value = np.asarray(value)
    try:
        yield
    finally:
        for variable, array in zip(split, arrays):
            variable._value = array
