"""The BiT ResNet of the paper's hybrids: weight-standardised convolutions, GroupNorm, no pre-activation.

Names follow vit_jax (`conv_root`, `gn_root`, `block{s}/unit{u}/conv{1,2,3}`, `gn{1,2,3}`,
`conv_proj`, `gn_proj`) so checkpoints map by name. SAME padding is computed here, TF/Flax style
(the extra pixel of an odd total goes after), and applied explicitly, so every backend gives the
TF/Flax result; stride-2 SAME padding is asymmetric.
"""

import keras
from keras import ops

_PACKAGE = "vit_keras"

# Weight standardisation and GroupNorm epsilons of the two reference implementations.
NUMERICS = {
    # vit_jax: (w - mean) / (std + 1e-5); flax GroupNorm eps 1e-6.
    "vit_jax": {"standardization_epsilon": 1e-5, "epsilon_inside_sqrt": False,
                "group_norm_epsilon": 1e-6},
    # timm: (w - mean) / sqrt(var + 1e-8); GroupNormAct eps 1e-5.
    "timm": {"standardization_epsilon": 1e-8, "epsilon_inside_sqrt": True,
             "group_norm_epsilon": 1e-5},
}


def same_padding(size, kernel_size, stride):
    """TF/Flax SAME padding of one spatial axis: `(before, after)`."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel_size - size, 0)
    return total // 2, total - total // 2


def _pad_same(x, kernel_size, stride, value=0.0):
    """Pads `(batch, height, width, channels)` so a VALID window op gives the SAME result."""
    pads = [same_padding(size, kernel_size, stride) for size in x.shape[1:3]]
    if not any(before or after for before, after in pads):
        return x
    return ops.pad(x, [(0, 0), *pads, (0, 0)], constant_values=value)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class StdConv2D(keras.layers.Layer):
    """A bias-free convolution whose kernel is standardised at every forward pass, SAME padding.

    Standardisation is per output channel over (height, width, input channels):
    `(w - mean) / (std + eps)` (vit_jax) or `(w - mean) / sqrt(var + eps)` with
    `epsilon_inside_sqrt=True` (timm). The stored kernel is never rewritten.

    Input: `(batch, height, width, in_channels)`.
    Output: `(batch, ceil(height / strides), ceil(width / strides), filters)`.
    Weight: `kernel` `(kernel_size, kernel_size, in_channels, filters)`.
    """

    def __init__(self, filters, kernel_size, strides=1, standardization_epsilon=1e-5,
                 epsilon_inside_sqrt=False, kernel_initializer="lecun_normal", **kwargs):
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.kernel_size = int(kernel_size)
        self.strides = int(strides)
        self.standardization_epsilon = float(standardization_epsilon)
        self.epsilon_inside_sqrt = bool(epsilon_inside_sqrt)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        k = self.kernel_size
        self.kernel = self.add_weight(name="kernel", shape=(k, k, input_shape[-1], self.filters),
                                      initializer=self.kernel_initializer)

    def standardized_kernel(self):
        """The kernel as the convolution uses it, float32: `(k, k, in_channels, filters)`."""
        kernel = ops.convert_to_tensor(self.kernel, "float32")
        mean = ops.mean(kernel, axis=(0, 1, 2), keepdims=True)
        var = ops.var(kernel, axis=(0, 1, 2), keepdims=True)
        if self.epsilon_inside_sqrt:
            return (kernel - mean) / ops.sqrt(var + self.standardization_epsilon)
        return (kernel - mean) / (ops.sqrt(var) + self.standardization_epsilon)

    def call(self, x):
        kernel = ops.cast(self.standardized_kernel(), x.dtype)
        x = _pad_same(x, self.kernel_size, self.strides)
        return ops.conv(x, kernel, strides=self.strides, padding="valid")

    def compute_output_shape(self, input_shape):
        batch, height, width, _ = input_shape
        size = lambda s: None if s is None else -(-s // self.strides)  # noqa: E731
        return (batch, size(height), size(width), self.filters)

    def get_config(self):
        return {
            **super().get_config(),
            "filters": self.filters,
            "kernel_size": self.kernel_size,
            "strides": self.strides,
            "standardization_epsilon": self.standardization_epsilon,
            "epsilon_inside_sqrt": self.epsilon_inside_sqrt,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
        }


def _std_conv_kwargs(layer):
    return {"standardization_epsilon": layer.standardization_epsilon,
            "epsilon_inside_sqrt": layer.epsilon_inside_sqrt, "dtype": layer.dtype_policy}


class _ResNetLayer(keras.layers.Layer):
    """Shared numerics arguments of the units, stages and stem."""

    def __init__(self, standardization_epsilon=1e-5, epsilon_inside_sqrt=False,
                 group_norm_epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.standardization_epsilon = float(standardization_epsilon)
        self.epsilon_inside_sqrt = bool(epsilon_inside_sqrt)
        self.group_norm_epsilon = float(group_norm_epsilon)

    def _group_norm(self, name, zero_scale=False):
        return keras.layers.GroupNormalization(
            groups=32, epsilon=self.group_norm_epsilon,
            gamma_initializer="zeros" if zero_scale else "ones", dtype=self.dtype_policy, name=name)

    def _numerics(self):
        return {"standardization_epsilon": self.standardization_epsilon,
                "epsilon_inside_sqrt": self.epsilon_inside_sqrt,
                "group_norm_epsilon": self.group_norm_epsilon}

    def get_config(self):
        return {**super().get_config(), **self._numerics()}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ResidualUnit(_ResNetLayer):
    """Bottleneck unit without pre-activation: 1x1 → 3x3 (strided) → 1x1 (4x features), GroupNorm
    after each, ReLU after the sum with the (projected, when shape or stride changes) input.

    Input: `(batch, height, width, channels)`.
    Output: `(batch, ceil(height / strides), ceil(width / strides), 4 * features)`.
    """

    def __init__(self, features, strides=1, **kwargs):
        super().__init__(**kwargs)
        self.features = int(features)
        self.strides = int(strides)
        conv = _std_conv_kwargs(self)
        self.conv1 = StdConv2D(self.features, 1, name="conv1", **conv)
        self.gn1 = self._group_norm("gn1")
        self.conv2 = StdConv2D(self.features, 3, self.strides, name="conv2", **conv)
        self.gn2 = self._group_norm("gn2")
        self.conv3 = StdConv2D(4 * self.features, 1, name="conv3", **conv)
        # Zero scale: each unit starts as the identity on its residual path (vit_jax, BiT).
        self.gn3 = self._group_norm("gn3", zero_scale=True)
        self.conv_proj = self.gn_proj = None

    def build(self, input_shape):
        if input_shape[-1] != 4 * self.features or self.strides != 1:
            self.conv_proj = StdConv2D(4 * self.features, 1, self.strides, name="conv_proj",
                                       **_std_conv_kwargs(self))
            self.gn_proj = self._group_norm("gn_proj")
            self.conv_proj.build(input_shape)
            self.gn_proj.build(self.conv_proj.compute_output_shape(input_shape))
        shape = input_shape
        for conv, norm in ((self.conv1, self.gn1), (self.conv2, self.gn2), (self.conv3, self.gn3)):
            conv.build(shape)
            shape = conv.compute_output_shape(shape)
            norm.build(shape)

    def call(self, x):
        residual = x if self.conv_proj is None else self.gn_proj(self.conv_proj(x))
        y = ops.relu(self.gn1(self.conv1(x)))
        y = ops.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return ops.relu(residual + y)

    def compute_output_shape(self, input_shape):
        return self.conv2.compute_output_shape(input_shape)[:3] + (4 * self.features,)

    def get_config(self):
        return {**super().get_config(), "features": self.features, "strides": self.strides}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ResNetStage(_ResNetLayer):
    """`num_units` residual units of width `features`; the first one strides by `first_stride`.

    Input: `(batch, height, width, channels)`.
    Output: `(batch, ceil(height / first_stride), ceil(width / first_stride), 4 * features)`.
    """

    def __init__(self, num_units, features, first_stride=1, **kwargs):
        super().__init__(**kwargs)
        self.num_units = int(num_units)
        self.features = int(features)
        self.first_stride = int(first_stride)
        self.units = [
            ResidualUnit(self.features, strides=self.first_stride if index == 0 else 1,
                         dtype=self.dtype_policy, name=f"unit{index + 1}", **self._numerics())
            for index in range(self.num_units)]

    def build(self, input_shape):
        for unit in self.units:
            unit.build(input_shape)
            input_shape = unit.compute_output_shape(input_shape)

    def call(self, x):
        for unit in self.units:
            x = unit(x)
        return x

    def compute_output_shape(self, input_shape):
        for unit in self.units:
            input_shape = unit.compute_output_shape(input_shape)
        return input_shape

    def get_config(self):
        return {**super().get_config(), "num_units": self.num_units, "features": self.features,
                "first_stride": self.first_stride}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ResNetStem(_ResNetLayer):
    """The hybrids' ResNet: root (7x7/2 conv, GroupNorm, ReLU, 3x3/2 max-pool) and stages.

    Stage `s` (1-based) has `num_layers[s - 1]` units of width `64 * width_factor * 2**(s - 1)`;
    every stage but the first halves the resolution. With `num_layers=()` only the root runs.

    Input: `(batch, height, width, channels)`.
    Output: `(batch, height / 2**(2 + stages - 1), ..., 256 * width_factor * 2**(stages - 1))`, i.e.
    stride 4 after the root, then 4/8/16/32 after stages 1/2/3/4 (64 channels with no stage).
    """

    def __init__(self, num_layers, width_factor=1, **kwargs):
        super().__init__(**kwargs)
        self.num_layers = tuple(int(n) for n in num_layers)
        self.width_factor = int(width_factor)
        width = 64 * self.width_factor
        self.conv_root = StdConv2D(width, 7, 2, name="conv_root", **_std_conv_kwargs(self))
        self.gn_root = self._group_norm("gn_root")
        self.stages = [
            ResNetStage(units, width * 2 ** index, first_stride=2 if index else 1,
                        dtype=self.dtype_policy, name=f"block{index + 1}", **self._numerics())
            for index, units in enumerate(self.num_layers)]

    def build(self, input_shape):
        self.conv_root.build(input_shape)
        shape = self.conv_root.compute_output_shape(input_shape)
        self.gn_root.build(shape)
        shape = self._pooled_shape(shape)
        for stage in self.stages:
            stage.build(shape)
            shape = stage.compute_output_shape(shape)

    @staticmethod
    def _pooled_shape(shape):
        size = lambda s: None if s is None else -(-s // 2)  # noqa: E731
        return (shape[0], size(shape[1]), size(shape[2]), shape[3])

    def root(self, x):
        """Root block: `(batch, H, W, C)` → `(batch, ceil(H / 4), ceil(W / 4), 64 * width)`."""
        x = ops.relu(self.gn_root(self.conv_root(x)))
        # Padding with -inf keeps TF's SAME max-pool on every backend.
        return ops.max_pool(_pad_same(x, 3, 2, value=float("-inf")), 3, strides=2, padding="valid")

    def call(self, x):
        x = self.root(x)
        for stage in self.stages:
            x = stage(x)
        return x

    def compute_output_shape(self, input_shape):
        shape = self._pooled_shape(self.conv_root.compute_output_shape(input_shape))
        for stage in self.stages:
            shape = stage.compute_output_shape(shape)
        return shape

    def get_config(self):
        return {**super().get_config(), "num_layers": list(self.num_layers),
                "width_factor": self.width_factor}
