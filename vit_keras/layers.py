"""The Vision Transformer's layers, in Keras 3 and nothing else, so they run on every backend.

Layer and weight names follow the original vit_jax modules (`embedding`, `cls`, `posembed_input`,
`encoderblock_{n}/MultiHeadDotProductAttention_1/query/kernel`, ...) and every kernel is stored in the
original checkpoint layout, so a checkpoint maps onto a model by name (see `checkpoints/`).
"""

import functools
import math

import keras
from keras import ops

from vit_keras import attention as attention_kernels
from vit_keras import interpolation_ops, kernels, xla_cpu
from vit_keras.configs import GELUS

_PACKAGE = "vit_keras"


def _mlp_bias_initializer():
    """normal(stddev 1e-6), as vit_jax. One per weight, made when the layer is built: an
    initializer made at import would take its seed before `keras.utils.set_random_seed` runs, and
    one shared by several weights would give them all the same values."""
    return keras.initializers.RandomNormal(stddev=1e-6)


def _xavier_uniform(fan_in, fan_out):
    """Glorot-uniform for a kernel of any rank whose fans are known, as Flax's DenseGeneral uses.

    Keras' `glorot_uniform` would read a (hidden, heads, head_dim) kernel as a convolution and get
    the fans wrong, so the limit is computed from the true fans.
    """
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return keras.initializers.RandomUniform(-limit, limit)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PatchEmbedding(keras.layers.Layer):
    """Cuts an image into non-overlapping patches and projects each one linearly.

    Equivalent to a convolution with kernel = stride = `patch_size` and VALID padding, computed as a
    reshape and one matrix multiply (faster to differentiate than a strided convolution).

    Input: `(batch, height, width, channels)`; height and width multiples of `patch_size`.
    Output: `(batch, (height // patch_size) * (width // patch_size), hidden_size)`, patches row-major;
    with `flatten=False` the grid `(batch, height // patch_size, width // patch_size, hidden_size)`.
    Weights: `kernel` `(patch_size, patch_size, channels, hidden_size)` (HWIO), `bias` `(hidden_size,)`
    (none with `use_bias=False`, as CLIP's).
    """

    def __init__(self, patch_size, hidden_size, kernel_initializer="lecun_normal",
                 bias_initializer="zeros", flatten=True, use_bias=True, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = int(patch_size)
        self.hidden_size = int(hidden_size)
        self.flatten = bool(flatten)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(
                f"{self.name} expects images of shape (batch, height, width, channels); "
                f"got shape {tuple(input_shape)}.")
        _, height, width, channels = input_shape
        for side, size in (("height", height), ("width", width)):
            if size is not None and size % self.patch_size:
                raise ValueError(
                    f"Image {side} {size} is not divisible by patch size {self.patch_size}; "
                    f"use an image size that is a multiple of {self.patch_size}.")
        if channels is None:
            raise ValueError(f"{self.name} needs a known number of channels; got {tuple(input_shape)}.")
        p = self.patch_size
        self.kernel = self.add_weight(
            name="kernel", shape=(p, p, channels, self.hidden_size),
            initializer=self.kernel_initializer)
        self.bias = self.add_weight(
            name="bias", shape=(self.hidden_size,), initializer=self.bias_initializer
        ) if self.use_bias else None
        self._linear = kernels.choose_linear()  # torch's linear; bfloat16 products on XLA:CPU

    def call(self, images):
        _, height, width, channels = images.shape
        p = self.patch_size
        for side, size in (("height", height), ("width", width)):
            # Checked here too for models of dynamic image size, whenever the size is known while
            # tracing (always on JAX and torch); a VALID convolution would crop silently.
            if size is not None and size % p:
                raise ValueError(
                    f"Image {side} {size} is not divisible by patch size {p}; use an image size "
                    f"that is a multiple of {p}.")
        if height is None or width is None:
            # Sizes unknown while tracing (e.g. a SavedModel signature): the equivalent convolution.
            patches = self._add_bias(ops.conv(images, self.kernel, strides=p, padding="valid"))
            if self.flatten:
                return ops.reshape(patches, (ops.shape(patches)[0], -1, self.hidden_size))
            return patches
        rows, cols = height // p, width // p
        x = ops.reshape(images, (-1, rows, p, cols, p, channels))
        x = ops.transpose(x, (0, 1, 3, 2, 4, 5))  # (batch, rows, cols, p, p, channels): HWI order
        x = ops.reshape(x, (-1, rows * cols, p * p * channels))
        kernel = ops.reshape(self.kernel, (p * p * channels, self.hidden_size))
        patches = self._linear(x, kernel, self.bias)
        return patches if self.flatten else ops.reshape(patches, (-1, rows, cols, self.hidden_size))

    def _add_bias(self, patches):
        return patches if self.bias is None else patches + self.bias

    def compute_output_shape(self, input_shape):
        batch, height, width, _ = input_shape
        rows = None if height is None else height // self.patch_size
        cols = None if width is None else width // self.patch_size
        if not self.flatten:
            return (batch, rows, cols, self.hidden_size)
        return (batch, None if rows is None or cols is None else rows * cols, self.hidden_size)

    def get_config(self):
        return {
            **super().get_config(),
            "patch_size": self.patch_size,
            "hidden_size": self.hidden_size,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "flatten": self.flatten,
            "use_bias": self.use_bias,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ClassToken(keras.layers.Layer):
    """Prepends a learnable class token to a sequence.

    Input: `(batch, tokens, hidden)`. Output: `(batch, tokens + 1, hidden)`.
    Weight: `cls` `(1, 1, hidden)`, zero-initialised.
    """

    def build(self, input_shape):
        self.cls = self.add_weight(name="cls", shape=(1, 1, input_shape[-1]), initializer="zeros")

    def call(self, x):
        token = ops.cast(self.cls, x.dtype)
        token = ops.broadcast_to(token, (ops.shape(x)[0], 1, x.shape[-1]))
        return ops.concatenate([token, x], axis=1)

    def compute_output_shape(self, input_shape):
        batch, tokens, hidden = input_shape
        return (batch, None if tokens is None else tokens + 1, hidden)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DistillationToken(keras.layers.Layer):
    """Prepends DeiT's learnable distillation token (the class token goes before it).

    Input: `(batch, tokens, hidden)`. Output: `(batch, tokens + 1, hidden)`.
    Weight: `dist` `(1, 1, hidden)`, normal(stddev 0.02) as DeiT.
    """

    def build(self, input_shape):
        self.dist = self.add_weight(name="dist", shape=(1, 1, input_shape[-1]),
                                    initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        token = ops.broadcast_to(ops.cast(self.dist, x.dtype), (ops.shape(x)[0], 1, x.shape[-1]))
        return ops.concatenate([token, x], axis=1)

    def compute_output_shape(self, input_shape):
        batch, tokens, hidden = input_shape
        return (batch, None if tokens is None else tokens + 1, hidden)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class RegisterTokens(keras.layers.Layer):
    """Inserts `num_tokens` learnable register tokens (Darcet et al.) before token `insert_at`.

    They come after the class and distillation tokens and take no position embedding: the model
    inserts them after adding position embeddings to the tokens before and after them.
    Input: `(batch, tokens, hidden)`. Output: `(batch, tokens + num_tokens, hidden)`.
    Weight: `reg` `(1, num_tokens, hidden)`, normal(stddev 1e-6) as DINOv2.
    """

    def __init__(self, num_tokens, insert_at=0, **kwargs):
        super().__init__(**kwargs)
        self.num_tokens = int(num_tokens)
        self.insert_at = int(insert_at)

    def build(self, input_shape):
        self.reg = self.add_weight(name="reg", shape=(1, self.num_tokens, input_shape[-1]),
                                   initializer=keras.initializers.RandomNormal(stddev=1e-6))

    def call(self, x):
        tokens = ops.broadcast_to(ops.cast(self.reg, x.dtype),
                                  (ops.shape(x)[0], self.num_tokens, x.shape[-1]))
        return ops.concatenate([x[:, :self.insert_at], tokens, x[:, self.insert_at:]], axis=1)

    def compute_output_shape(self, input_shape):
        batch, tokens, hidden = input_shape
        return (batch, None if tokens is None else tokens + self.num_tokens, hidden)

    def get_config(self):
        return {**super().get_config(), "num_tokens": self.num_tokens, "insert_at": self.insert_at}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AddPositionEmbs(keras.layers.Layer):
    """Adds a learnable position embedding to every token.

    Input and output: `(batch, tokens, hidden)`. Weight: `pos_embedding` `(1, tokens, hidden)`,
    normal(stddev 0.02). The token count is fixed when the layer is built; a model for another image
    size gets its embedding through `vit_keras.resample_position_embeddings`.

    With `grid_size=(rows, cols)` the layer takes images of any size (`build_model(...,
    dynamic_image_size=True)`): `pos_embedding` holds `num_prefix_tokens + rows * cols`
    embeddings, and `call(tokens, patch_grid)` resamples their grid part on every call to the
    grid of `patch_grid`, the patch embedding's `(batch, rows', cols', hidden)` output
    (`vit_keras.interpolation_ops`: timm's bicubic, antialiased). At `(rows, cols)` itself the
    embeddings are added unchanged.
    """

    def __init__(self, initializer=None, grid_size=None, num_prefix_tokens=1, **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(
            initializer or keras.initializers.RandomNormal(stddev=0.02))
        self.grid_size = None if grid_size is None else tuple(int(side) for side in grid_size)
        self.num_prefix_tokens = int(num_prefix_tokens)

    def build(self, x_shape, patch_grid_shape=None):
        tokens = x_shape[1]
        if self.grid_size is not None:
            tokens = self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
        if tokens is None:
            raise ValueError(f"{self.name} needs a known number of tokens (or a grid_size); got "
                             f"{tuple(x_shape)}.")
        # Read in float32 whatever the dtype policy: resampling runs in float32, as timm's does.
        self.pos_embedding = self.add_weight(
            name="pos_embedding", shape=(1, tokens, x_shape[2]),
            initializer=self.initializer, autocast=False)

    def call(self, x, patch_grid=None):
        if self.grid_size is None:
            expected = self.pos_embedding.shape[1]
            if x.shape[1] is not None and x.shape[1] != expected:
                raise ValueError(
                    f"{self.name} holds position embeddings for {expected} tokens but got "
                    f"{x.shape[1]} tokens: the input image size differs from the one the model was "
                    f"built for. Build the model at the new size (position embeddings are "
                    f"resampled when weights load), or with dynamic_image_size=True.")
            return x + ops.cast(self.pos_embedding, x.dtype)
        if patch_grid is None:
            raise ValueError(f"{self.name} has a grid_size, so it resamples to the input's patch "
                             f"grid: call it as layer(tokens, patch_grid).")
        shape = ops.shape(patch_grid)
        return x + ops.cast(self.resampled((shape[1], shape[2])), x.dtype)

    def resampled(self, grid):
        """The float32 embeddings `(1, num_prefix_tokens + rows * cols, hidden)` for a patch grid
        `(rows, cols)` (ints, or scalar tensors while tracing with unknown sizes)."""
        embeddings = ops.convert_to_tensor(self.pos_embedding)
        if all(isinstance(side, int) for side in grid) and tuple(grid) == self.grid_size:
            return embeddings
        prefix = embeddings[:, :self.num_prefix_tokens]
        hidden = embeddings.shape[-1]
        built = ops.reshape(embeddings[0, self.num_prefix_tokens:], (*self.grid_size, hidden))
        resized = interpolation_ops.resize_grid(built, grid)
        return ops.concatenate([prefix, ops.reshape(resized, (1, -1, hidden))], axis=1)

    def compute_output_shape(self, x_shape, patch_grid_shape=None):
        return x_shape

    def get_config(self):
        config = {**super().get_config(),
                  "initializer": keras.initializers.serialize(self.initializer)}
        if self.grid_size is not None:
            config.update(grid_size=list(self.grid_size), num_prefix_tokens=self.num_prefix_tokens)
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class HeadsProjection(keras.layers.EinsumDense):
    """The query, key or value projection: `(batch, tokens, hidden)` → `(batch, tokens, heads,
    head_dim)`, kernel `(hidden, heads, head_dim)`.

    An `EinsumDense` whose LoRA (`enable_lora`) adapts the projection as the one `hidden → hidden`
    map it is, as the LoRA paper adapts W_q: `A` `(hidden, rank)`, `B` `(rank, heads, head_dim)`,
    an update of rank <= `rank`. Keras' own factors the kernel's last axis alone (`A` `(hidden,
    heads, rank)`, `B` `(rank, head_dim)`): a separate update per head, of rank up to
    `heads * rank` and `heads` times the parameters.
    """

    def enable_lora(self, rank, lora_alpha=None, a_initializer="he_uniform",
                    b_initializer="zeros"):
        if not self.built:
            raise ValueError("Cannot enable LoRA on a layer that is not built.")
        if self.lora_enabled:
            raise ValueError("LoRA is already enabled on this layer; enable it once.")
        if self.quantization_mode is not None:
            raise NotImplementedError(
                f"LoRA on the {self.quantization_mode}-quantized projection {self.name!r} is not "
                f"supported: enable LoRA before quantizing, and merge it first.")
        hidden, *head_axes = self._kernel.shape
        self._tracker.unlock()
        # float32, as Keras' adapters: a low-precision update would underflow.
        self.lora_kernel_a = self.add_weight(
            name="lora_kernel_a", shape=(hidden, rank),
            initializer=keras.initializers.get(a_initializer), dtype="float32")
        self.lora_kernel_b = self.add_weight(
            name="lora_kernel_b", shape=(rank, *head_axes),
            initializer=keras.initializers.get(b_initializer), dtype="float32")
        self._kernel.trainable = False
        self._tracker.lock()
        self.lora_enabled = True
        self.lora_rank = rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else rank

    @property
    def kernel(self):
        if not self.lora_enabled:
            return super().kernel
        update = ops.tensordot(self.lora_kernel_a, self.lora_kernel_b, axes=1)
        return ops.cast(ops.add(self._kernel, (self.lora_alpha / self.lora_rank) * update),
                        self.compute_dtype)

    def quantize(self, mode=None, type_check=True, config=None):
        if self.lora_enabled:
            raise NotImplementedError(
                f"Quantizing the LoRA-enabled projection {self.name!r} is not supported: merge "
                f"the adapters first (vit_keras.tools.finetuning.merge_lora).")
        # Keras refuses subclasses unless told: this one's quantized arithmetic is EinsumDense's.
        return super().quantize(mode, type_check=False, config=config)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MultiHeadDotProductAttention(keras.layers.Layer):
    """Multi-head self-attention with the vit_jax weight layout.

    Input: `(batch, tokens, hidden)`. Output: `(batch, tokens, hidden)`, and with
    `return_attention_scores=True` also the probabilities `(batch, heads, tokens, tokens)` (float32).
    Weights: `query|key|value/kernel` `(hidden, heads, head_dim)`, `.../bias` `(heads, head_dim)`,
    `out/kernel` `(heads, head_dim, hidden)`, `out/bias` `(hidden,)`.

    How q, k and v are projected, laid out and attended is the kernel's, chosen when the layer is
    built (`vit_keras.attention`: torch's fused attention, cuDNN's on NVIDIA GPUs under JAX,
    `keras.ops.dot_product_attention`, or an explicit float32 softmax, which is also the kernel
    for attention dropout and `return_attention_scores`); `attention_kernel` names it. Quantized
    (`model.quantize`) or LoRA-enabled (`enable_lora`) projections are called as layers by every
    kernel, so their own arithmetic applies.
    """

    def __init__(self, num_heads, attention_dropout=0.0, attention=None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.attention_dropout = float(attention_dropout)
        if attention is not None and attention not in attention_kernels.KERNELS:
            raise ValueError(f"Unknown attention kernel {attention!r}; expected one of "
                             f"{attention_kernels.KERNELS} or None (chosen when built).")
        self.attention = attention
        self._dropout = keras.layers.Dropout(
            self.attention_dropout, dtype=self.dtype_policy, name="attention_dropout")
        self._attention_kernel = self._probabilities_kernel = None  # chosen in build

    def build(self, input_shape):
        hidden = input_shape[-1]
        if hidden % self.num_heads:
            raise ValueError(
                f"Hidden size {hidden} is not divisible by the number of heads {self.num_heads}; "
                f"choose a hidden size that is a multiple of {self.num_heads}.")
        head_dim = hidden // self.num_heads
        init = _xavier_uniform(hidden, hidden)
        for name in ("query", "key", "value"):
            projection = HeadsProjection(
                "btd,dhk->bthk", output_shape=(None, self.num_heads, head_dim), bias_axes="hk",
                kernel_initializer=init, dtype=self.dtype_policy, name=name)
            projection.build(input_shape)
            setattr(self, name, projection)
        self.out = keras.layers.EinsumDense(
            "bthk,hkd->btd", output_shape=(None, hidden), bias_axes="d",
            kernel_initializer=init, dtype=self.dtype_policy, name="out")
        self.out.build((input_shape[0], input_shape[1], self.num_heads, head_dim))
        self._attention_kernel = (
            attention_kernels.kernel_named(self.attention) if self.attention is not None
            else attention_kernels.choose_attention(self.compute_dtype, head_dim, input_shape[1]))
        self._probabilities_kernel = attention_kernels.choose_attention(
            self.compute_dtype, head_dim, input_shape[1], probabilities=True)

    @property
    def attention_kernel(self):
        """The name of the kernel a call without attention scores or attention dropout takes
        (`vit_keras.attention.KERNELS`), chosen when the layer was built; None before."""
        return None if self._attention_kernel is None else self._attention_kernel.name

    @property
    def fused(self):
        """Whether a call without attention scores or attention dropout takes a fused kernel
        (chosen when the layer was built; False before)."""
        return self.attention_kernel not in (None, "explicit")

    def call(self, x, training=None, return_attention_scores=False):
        dropout = training and self.attention_dropout > 0
        kernel = self._attention_kernel
        if return_attention_scores or dropout:  # probabilities to return or to drop
            kernel = self._probabilities_kernel
        y, probabilities = kernel(self, x, dropout=self._dropout if dropout else None)
        return (y, probabilities) if return_attention_scores else y

    def compute_output_spec(self, x, training=None, return_attention_scores=False):
        y = keras.KerasTensor(x.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return y
        batch, tokens = x.shape[0], x.shape[1]
        return y, keras.KerasTensor((batch, self.num_heads, tokens, tokens), dtype="float32")

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads,
                "attention_dropout": self.attention_dropout, "attention": self.attention}


def _dropped(dropout, x, training):
    """`dropout(x, training=training)`, without the layer call where it drops nothing: on torch
    every layer call costs the host time that the GPU then waits for."""
    return dropout(x, training=training) if dropout.rate > 0 else x


def gelu_variant(gelu=None, approximate_gelu=False):
    """The GELU a layer computes: `"exact"` (erf; timm, Hugging Face), `"tanh"` (Flax's
    approximation) or `"quick"` (`x * sigmoid(1.702 x)`, OpenAI CLIP's). `gelu=None` takes the
    older boolean `approximate_gelu` (True: `"tanh"`)."""
    if gelu is None:
        return "tanh" if approximate_gelu else "exact"
    if gelu not in GELUS:
        raise ValueError(f"Unknown gelu {gelu!r}; expected one of {GELUS}.")
    if approximate_gelu and gelu != "tanh":
        raise ValueError(f"approximate_gelu=True asks for the tanh GELU, but gelu={gelu!r}; "
                         f"pass one of the two.")
    return gelu


def _quick_gelu(x):
    return x * ops.sigmoid(1.702 * x)


def _choose_gelu(gelu):
    """The GELU function of a layer built now (exact and tanh in each backend's fastest form)."""
    return _quick_gelu if gelu == "quick" else kernels.choose_gelu(gelu == "tanh")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class LayerScale(keras.layers.Layer):
    """Scales each channel by a learned factor (CaiT's LayerScale, in DeiT III and DINOv2).

    Input and output: `(batch, tokens, hidden)`. Weight: `scale` `(hidden,)`, all `init_value`.
    """

    def __init__(self, init_value=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.init_value = float(init_value)

    def build(self, input_shape):
        self.scale = self.add_weight(name="scale", shape=(input_shape[-1],),
                                     initializer=keras.initializers.Constant(self.init_value))

    def call(self, x):
        return x * ops.cast(self.scale, x.dtype)

    def get_config(self):
        return {**super().get_config(), "init_value": self.init_value}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MlpBlock(keras.layers.Layer):
    """Dense → GELU → dropout → Dense → dropout, as in vit_jax's `MlpBlock`.

    Input and output: `(batch, tokens, hidden)`. Weights: `Dense_0` `(hidden, mlp_dim)`,
    `Dense_1` `(mlp_dim, hidden)`. `gelu`: see `gelu_variant`; `approximate_gelu=True` is the
    older spelling of `gelu="tanh"` (configs saved before `gelu` existed carry it).
    """

    def __init__(self, mlp_dim, dropout=0.0, approximate_gelu=False, gelu=None, **kwargs):
        super().__init__(**kwargs)
        self.mlp_dim = int(mlp_dim)
        self.dropout = float(dropout)
        self.gelu = gelu_variant(gelu, approximate_gelu)
        self._dropout = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy, name="dropout")

    def build(self, input_shape):
        hidden = input_shape[-1]
        self.dense_0 = keras.layers.Dense(
            self.mlp_dim, kernel_initializer=_xavier_uniform(hidden, self.mlp_dim),
            bias_initializer=_mlp_bias_initializer(), dtype=self.dtype_policy, name="Dense_0")
        self.dense_0.build(input_shape)
        self.dense_1 = keras.layers.Dense(
            hidden, kernel_initializer=_xavier_uniform(self.mlp_dim, hidden),
            bias_initializer=_mlp_bias_initializer(), dtype=self.dtype_policy, name="Dense_1")
        self.dense_1.build((*input_shape[:-1], self.mlp_dim))
        # Chosen once for this backend and device (see vit_keras.kernels): `dense(x)`, torch's
        # linear, or on XLA:CPU an einsum with bfloat16 products; GELU in its fastest form.
        self._project = kernels.choose_projection()
        self._gelu = _choose_gelu(self.gelu)

    def call(self, x, training=None):
        x = self._gelu(self._project(self.dense_0, x))
        x = _dropped(self._dropout, x, training)
        return _dropped(self._dropout, self._project(self.dense_1, x), training)

    def get_config(self):
        return {**super().get_config(), "mlp_dim": self.mlp_dim, "dropout": self.dropout,
                "gelu": self.gelu}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TransformerBlock(keras.layers.Layer):
    """One pre-LayerNorm encoder block: `x + attn(LN(x))`, then `x + mlp(LN(x))`.

    Input and output: `(batch, tokens, hidden)`; with `return_attention_scores=True` the call also
    returns the attention probabilities `(batch, heads, tokens, tokens)`.
    `drop_path_rate` drops each residual branch per example (stochastic depth) during training.
    With `layer_scale_init` both branches are scaled per channel (`LayerScale_1` after the
    attention, `LayerScale_3` after the MLP) before they are added. `gelu` as `MlpBlock`'s.
    """

    def __init__(self, num_heads, mlp_dim, dropout=0.0, attention_dropout=0.0, drop_path_rate=0.0,
                 layer_norm_epsilon=1e-6, approximate_gelu=False, seed=None, gelu=None,
                 layer_scale_init=None, attention=None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.mlp_dim = int(mlp_dim)
        self.dropout = float(dropout)
        self.attention_dropout = float(attention_dropout)
        self.drop_path_rate = float(drop_path_rate)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.gelu = gelu_variant(gelu, approximate_gelu)
        self.layer_scale_init = None if layer_scale_init is None else float(layer_scale_init)
        self.seed = seed
        self.attention_kernel_name = attention
        policy = self.dtype_policy
        self.norm_0 = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="LayerNorm_0")
        self.attention = MultiHeadDotProductAttention(
            self.num_heads, self.attention_dropout, attention=attention, dtype=policy,
            name="MultiHeadDotProductAttention_1")
        self._dropout = keras.layers.Dropout(self.dropout, dtype=policy, name="dropout")
        self.norm_2 = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=policy, name="LayerNorm_2")
        self.mlp = MlpBlock(self.mlp_dim, self.dropout, gelu=self.gelu, dtype=policy,
                            name="MlpBlock_3")
        self.scale_1 = self.scale_3 = None
        if self.layer_scale_init is not None:
            self.scale_1 = LayerScale(self.layer_scale_init, dtype=policy, name="LayerScale_1")
            self.scale_3 = LayerScale(self.layer_scale_init, dtype=policy, name="LayerScale_3")
        if self.drop_path_rate > 0:
            self._seed_generator = keras.random.SeedGenerator(seed)

    def build(self, input_shape):
        for sublayer in (self.norm_0, self.attention, self.norm_2, self.mlp, self.scale_1,
                         self.scale_3):
            if sublayer is not None:
                sublayer.build(input_shape)
        # An identity; on XLA:CPU one whose gradient XLA computes once per block instead of fusing
        # it into every consumer (see vit_keras.xla_cpu).
        self._block_boundary = xla_cpu.choose_block_boundary()
        self._norm = kernels.choose_layer_norm()  # torch's own kernel on torch

    def _drop_path(self, branch, training):
        if not (training and self.drop_path_rate > 0):
            return branch
        return keras.random.dropout(branch, self.drop_path_rate,
                                    noise_shape=(ops.shape(branch)[0], 1, 1),
                                    seed=self._seed_generator)

    def call(self, x, training=None, return_attention_scores=False):
        x = self._block_boundary(x)
        y = self.attention(self._norm(self.norm_0, x), training=training,
                           return_attention_scores=return_attention_scores)
        if return_attention_scores:
            y, scores = y
        y = _dropped(self._dropout, y, training)
        if self.scale_1 is not None:
            y = self.scale_1(y)
        x = x + self._drop_path(y, training)
        y = self.mlp(self._norm(self.norm_2, x), training=training)
        if self.scale_3 is not None:
            y = self.scale_3(y)
        x = x + self._drop_path(y, training)
        return (x, scores) if return_attention_scores else x

    def compute_output_spec(self, x, training=None, return_attention_scores=False):
        return self.attention.compute_output_spec(x, return_attention_scores=return_attention_scores)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout": self.dropout,
            "attention_dropout": self.attention_dropout,
            "drop_path_rate": self.drop_path_rate,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "gelu": self.gelu,
            "layer_scale_init": self.layer_scale_init,
            "seed": self.seed,
            "attention": self.attention_kernel_name,
        }

    @property
    def norms(self):
        """The block's two LayerNorms (before the attention, before the MLP)."""
        return [self.norm_0, self.norm_2]

    @property
    def lora_targets(self):
        """The linear layers LoRA adapts: `query`, `key`, `value`, `out` and the MLP's
        `Dense_0`, `Dense_1`."""
        attention, mlp = self.attention, self.mlp
        return [attention.query, attention.key, attention.value, attention.out, mlp.dense_0,
                mlp.dense_1]

    def set_remat(self, enabled=True):
        """Recomputes the block's forward in the backward pass (`keras.remat`:
        `jax.checkpoint`, `tf.recompute_grad`, `torch.utils.checkpoint`), or stops; in place,
        not part of the config.

        Not `keras.RematScope(mode="list_of_layers")`: Keras then passes the call's keyword
        arguments through `jax.checkpoint`, which turns `training=True` into a traced array that
        the layers cannot branch on in Python. Here the call rematerialises a function of its
        input alone, `training` bound. A call returning attention scores (analysis, not
        training) runs as it is."""
        if not enabled:
            self.__dict__.pop("call", None)
        elif "call" not in self.__dict__:
            self.call = _rematerialized_call(self, type(self).call.__get__(self))
        return self

    @property
    def rematerialized(self):
        return "call" in self.__dict__


def _rematerialized_call(block, call):
    """`call` (a block's, same signature) with its forward recomputed in the backward pass.

    The block's random generators (dropout, drop path) advance inside the recomputed function;
    JAX forbids a traced value to leave it but through its outputs, so their states go in and
    come out as arguments (in `fit`'s stateless scope, where assigning records a new value)."""
    weights = {id(weight) for weight in block.weights}
    generators = [variable for variable in block.variables if id(variable) not in weights]

    def forward(x, states, training):
        for variable, state in zip(generators, states):
            variable.assign(state)
        return call(x, training=training), [variable.value for variable in generators]

    def rematerialized_call(x, training=None, return_attention_scores=False):
        if return_attention_scores:
            return call(x, training=training, return_attention_scores=True)
        y, states = keras.remat(functools.partial(forward, training=training))(
            x, [variable.value for variable in generators])
        for variable, state in zip(generators, states):
            variable.assign(state)
        return y

    return rematerialized_call
