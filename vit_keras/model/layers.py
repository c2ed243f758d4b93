"""The Vision Transformer's token layers and its encoder block, in Keras 3 and nothing else, so
they run on every backend. The block's parts come from the slots: `attention.py`
(`MultiHeadDotProductAttention`), `mlp.py` (`MlpBlock`), `norms.py`; the position encoding from
`position_embeddings.py`; the heads from `heads.py` (all in `vit_keras.model`).

Layer and weight names follow the original vit_jax modules (`embedding`, `cls`, `posembed_input`,
`encoderblock_{n}/MultiHeadDotProductAttention_1/query/kernel`, ...) and every kernel is stored in the
original checkpoint layout, so a checkpoint maps onto a model by name (see `checkpoints/`).
"""

import dataclasses
import functools

import keras
from keras import ops

from vit_keras.model import attention as attention_lib
from vit_keras.model import backend_ops, legacy, norms, position_embeddings, specs, xla_cpu
from vit_keras.model import mlp as mlp_lib

# Where they were defined before their slot modules; `vit_keras.model.layers.X` keeps importing them.
from vit_keras.model.attention import HeadsProjection, MultiHeadDotProductAttention  # noqa: F401
from vit_keras.model.mlp import MlpBlock, gelu_variant  # noqa: F401
from vit_keras.model.position_embeddings import AddPositionEmbs  # noqa: F401

_PACKAGE = "vit_keras"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PatchEmbedding(keras.layers.Layer):
    """Cuts an image into non-overlapping patches and projects each one linearly.

    Equivalent to a convolution with kernel = stride = `patch_size` and VALID padding, computed as a
    reshape and one matrix multiply (faster to differentiate than a strided convolution).

    Input: `(batch, height, width, channels)`; height and width multiples of `patch_size`.
    Output: `(batch, (height // patch_size) * (width // patch_size), hidden_size)`, patches row-major;
    with `flatten=False` the grid `(batch, height // patch_size, width // patch_size, hidden_size)`.
    Or NaFlex's patches already cut, `(batch, tokens, patch_size * patch_size * channels)`, each
    flattened (row, column, channel) → `(batch, tokens, hidden_size)`.
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
        p = self.patch_size
        if len(input_shape) == 3 and input_shape[-1] and input_shape[-1] % (p * p) == 0:
            input_shape = (input_shape[0], p, p, input_shape[-1] // (p * p))  # NaFlex patches
        if len(input_shape) != 4:
            raise ValueError(
                f"{self.name} expects images of shape (batch, height, width, channels) or NaFlex "
                f"patches (batch, tokens, {p}*{p}*channels); got shape {tuple(input_shape)}.")
        _, height, width, channels = input_shape
        for side, size in (("height", height), ("width", width)):
            if size is not None and size % self.patch_size:
                raise ValueError(
                    f"Image {side} {size} is not divisible by patch size {self.patch_size}; "
                    f"use an image size that is a multiple of {self.patch_size}.")
        if channels is None:
            raise ValueError(f"{self.name} needs a known number of channels; got {tuple(input_shape)}.")
        self.kernel = self.add_weight(
            name="kernel", shape=(p, p, channels, self.hidden_size),
            initializer=self.kernel_initializer)
        self.bias = self.add_weight(
            name="bias", shape=(self.hidden_size,), initializer=self.bias_initializer
        ) if self.use_bias else None
        self._linear = backend_ops.choose_linear()  # torch's linear; bfloat16 products on XLA:CPU

    def call(self, images):
        p = self.patch_size
        if len(images.shape) == 3:  # NaFlex patches, flattened in the kernel's (row, col, in) order
            kernel = ops.reshape(self.kernel, (-1, self.hidden_size))
            return self._linear(images, kernel, self.bias)
        _, height, width, channels = images.shape
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
        if len(input_shape) == 3:
            return (*input_shape[:2], self.hidden_size)
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


@dataclasses.dataclass(frozen=True)
class TokenSpec(specs.Spec):
    """The tokens before the patches, in the order they stand: a class token, DeiT's distillation
    token (after the class token), `registers` register tokens (DINOv2-reg's, after both)."""

    class_token: bool = True
    distillation: bool = False
    registers: int = 0

    def __post_init__(self):
        if self.registers < 0:
            raise ValueError(f"registers must be 0 or more; got {self.registers}.")
        if self.distillation and not self.class_token:
            raise ValueError("A distillation token needs a class token (DeiT reads both).")

    @property
    def count(self):
        """Tokens before the patches."""
        return int(self.class_token) + int(self.distillation) + self.registers

    @property
    def named(self):
        """The class and distillation tokens: those an absolute position embedding may cover."""
        return int(self.class_token) + int(self.distillation)

    @property
    def kinds(self):
        """`"class"`, `"distillation"`, one `"register"` per register token, in order."""
        return (["class"] * self.class_token + ["distillation"] * self.distillation
                + ["register"] * self.registers)

    def make(self, dtype=None):
        """`(named, registers)`: the layers that prepend the class and distillation tokens, in
        the order they are applied (each prepends, so the distillation token's first), and the
        `RegisterTokens` layer that inserts the registers after them, or None."""
        named = ([DistillationToken(dtype=dtype, name="dist")] if self.distillation else []) + (
            [ClassToken(dtype=dtype, name="cls")] if self.class_token else [])
        registers = (RegisterTokens(self.registers, insert_at=self.named, dtype=dtype, name="reg")
                     if self.registers else None)
        return named, registers


def token_spec(config, classifier):
    """The `TokenSpec` of a `ViTConfig` pooled with `classifier` (`class_token`, which None
    leaves to the classifier, `distillation`, `num_registers`)."""
    return TokenSpec(config.has_class_token(classifier), config.distillation,
                     config.num_registers)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ValidTokens(keras.layers.Layer):
    """Which tokens of a NaFlex batch are real: `(batch, tokens)` bool, the patches' own validity
    after `num_prefix_tokens` prefix tokens (class, distillation, registers), always real.

    Input: `patch_valid` `(batch, patches)` bool. Output: `(batch, num_prefix_tokens + patches)`
    bool.
    """

    def __init__(self, num_prefix_tokens=0, **kwargs):
        super().__init__(**kwargs)
        self.num_prefix_tokens = int(num_prefix_tokens)

    def call(self, patch_valid):
        valid = ops.cast(patch_valid, "bool")
        if not self.num_prefix_tokens:
            return valid
        prefix = ops.ones((ops.shape(valid)[0], self.num_prefix_tokens), "bool")
        return ops.concatenate([prefix, valid], axis=1)

    def compute_output_spec(self, patch_valid):
        batch, patches = patch_valid.shape
        tokens = None if patches is None else patches + self.num_prefix_tokens
        return keras.KerasTensor((batch, tokens), dtype="bool")

    def get_config(self):
        return {**super().get_config(), "num_prefix_tokens": self.num_prefix_tokens}


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
class TransformerBlock(position_embeddings.TakesRotary, keras.layers.Layer):
    """One pre-LayerNorm encoder block: `x + attn(LN(x))`, then `x + mlp(LN(x))`.

    Input and output: `(batch, tokens, hidden)`; with `return_attention_scores=True` the call also
    returns the attention probabilities `(batch, heads, tokens, tokens)`.
    `drop_path_rate` drops each residual branch per example (stochastic depth) during training.
    With `layer_scale_init` both branches are scaled per channel (`LayerScale_1` after the
    attention, `LayerScale_3` after the MLP) before they are added. The slots take their specs
    whole: `attention_spec` (`vit_keras.model.attention.AttentionSpec`: its biases and rotary
    embeddings; with these a call takes the tokens' coordinates or rotation, `block(x, rotary)`,
    see `vit_keras.model.position_embeddings`),
    `mlp_spec` (`vit_keras.model.mlp.MlpSpec`) and `norm_spec` (`vit_keras.model.norms.NormSpec`,
    the two norms'); `attention` names the attention kernel (`vit_keras.model.attention.KERNELS`;
    None: chosen when built).
    """

    ATTENTION, MLP = "MultiHeadDotProductAttention_1", "MlpBlock_3"  # vit_jax's names

    @classmethod
    def model_parallel_layout(cls):
        """Its weights' layouts over a mesh's `model` axis, by path inside the block (its
        attention's and MLP's `MODEL_PARALLEL`, every MLP class's alike)."""
        return {**{f"{cls.ATTENTION}/{path}": axes
                   for path, axes in MultiHeadDotProductAttention.MODEL_PARALLEL.items()},
                **{f"{cls.MLP}/{path}": axes for path, axes in mlp_lib.MlpBlock.MODEL_PARALLEL.items()}}

    def __init__(self, num_heads, mlp_dim, dropout=0.0, attention_dropout=0.0, drop_path_rate=0.0,
                 seed=None, layer_scale_init=None, attention=None, attention_spec=None,
                 mlp_spec=None, norm_spec=None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.mlp_dim = int(mlp_dim)
        self.dropout = float(dropout)
        self.attention_dropout = float(attention_dropout)
        self.drop_path_rate = float(drop_path_rate)
        self.layer_scale_init = None if layer_scale_init is None else float(layer_scale_init)
        self.seed = seed
        self.attention_kernel_name = attention
        self.attention_spec = attention_lib.AttentionSpec.of(attention_spec) or (
            attention_lib.AttentionSpec())
        self.mlp_spec = mlp_lib.MlpSpec.of(mlp_spec) or mlp_lib.MlpSpec()
        self.norm_spec = norms.NormSpec.of(norm_spec) or norms.NormSpec()
        policy = self.dtype_policy
        self.norm_0 = self.norm_spec.make(dtype=policy, name="LayerNorm_0")
        self.attention = MultiHeadDotProductAttention(
            self.num_heads, self.attention_dropout, attention=attention,
            spec=self.attention_spec, dtype=policy, name=self.ATTENTION)
        self._dropout = keras.layers.Dropout(self.dropout, dtype=policy, name="dropout")
        self.norm_2 = self.norm_spec.make(dtype=policy, name="LayerNorm_2")
        self.mlp = self.mlp_spec.make(self.mlp_dim, self.dropout, dtype=policy, name=self.MLP)
        self.scale_1 = self.scale_3 = None
        if self.layer_scale_init is not None:
            self.scale_1 = LayerScale(self.layer_scale_init, dtype=policy, name="LayerScale_1")
            self.scale_3 = LayerScale(self.layer_scale_init, dtype=policy, name="LayerScale_3")
        if self.drop_path_rate > 0:
            self._seed_generator = keras.random.SeedGenerator(seed)
        position_embeddings.keep_rotary_float32(self)

    @property
    def gelu(self):
        """The MLP's GELU (`vit_keras.model.mlp.gelu_variant`)."""
        return self.mlp_spec.gelu

    @property
    def layer_norm_epsilon(self):
        return self.norm_spec.epsilon

    def build(self, input_shape):
        for sublayer in (self.norm_0, self.attention, self.norm_2, self.mlp, self.scale_1,
                         self.scale_3):
            if sublayer is not None:
                sublayer.build(input_shape)
        # An identity; on XLA:CPU one whose gradient XLA computes once per block instead of fusing
        # it into every consumer (see vit_keras.model.xla_cpu).
        self._block_boundary = xla_cpu.choose_block_boundary()
        # torch's own kernel on torch; on a JAX GPU a training step's LayerNorm has its gradient
        # written out
        self._norm = backend_ops.choose_layer_norm()

    def _drop_path(self, branch, training):
        if not (training and self.drop_path_rate > 0):
            return branch
        return keras.random.dropout(branch, self.drop_path_rate,
                                    noise_shape=(ops.shape(branch)[0], 1, 1),
                                    seed=self._seed_generator)

    def call(self, x, rotary=None, training=None, return_attention_scores=False, valid=None):
        x = self._block_boundary(ops.cast(x, self.compute_dtype))
        y = self.attention(self._norm(self.norm_0, x, training), rotary, training=training,
                           return_attention_scores=return_attention_scores, valid=valid)
        if return_attention_scores:
            y, scores = y
        y = backend_ops.dropped(self._dropout, y, training)
        if self.scale_1 is not None:
            y = self.scale_1(y)
        x = x + self._drop_path(y, training)
        y = self.mlp(self._norm(self.norm_2, x, training), training=training)
        if self.scale_3 is not None:
            y = self.scale_3(y)
        x = x + self._drop_path(y, training)
        return (x, scores) if return_attention_scores else x

    def compute_output_spec(self, x, rotary=None, training=None, return_attention_scores=False,
                            valid=None):
        return self.attention.compute_output_spec(x, return_attention_scores=return_attention_scores)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "mlp_dim": self.mlp_dim,
                "dropout": self.dropout, "attention_dropout": self.attention_dropout,
                "drop_path_rate": self.drop_path_rate, "seed": self.seed,
                "layer_scale_init": self.layer_scale_init, "attention": self.attention_kernel_name,
                "attention_spec": self.attention_spec.get_config(),
                "mlp_spec": self.mlp_spec.get_config(), "norm_spec": self.norm_spec.get_config()}

    @classmethod
    def from_config(cls, config):
        return cls(**legacy.block_config(config))

    @property
    def norms(self):
        """The block's two LayerNorms (before the attention, before the MLP)."""
        return [self.norm_0, self.norm_2]

    def activation_bytes(self, tokens):
        """A lower bound of the bytes per image of `tokens` tokens that a training step keeps for
        this block's backward pass: in the compute dtype, the inputs of the two norms, of the
        q/k/v and output projections and the MLP's (`activation_values`); in float32 the
        attention logits and probabilities, unless the attention runs through a fused kernel,
        which keeps none."""
        hidden = self.attention.query.kernel.shape[0]
        value_bytes = 2 if self.compute_dtype in ("float16", "bfloat16") else 4
        linear = (8 * tokens * hidden + self.mlp.activation_values(tokens)) * value_bytes
        # `fused`: the layer's own answer to whether keras.ops.dot_product_attention reaches a
        # fused kernel here (attention dropout takes the explicit path).
        fused = getattr(self.attention, "fused", False) and not self.attention_dropout
        return linear + (0 if fused else 2 * self.num_heads * tokens * tokens * 4)

    @property
    def lora_targets(self):
        """The linear layers LoRA adapts: `query`, `key`, `value`, `out` and the MLP's
        `Dense_0`, `Dense_1`."""
        return self.attention.lora_targets + self.mlp.lora_targets

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

    def forward(x, states, rotary, training, valid):
        for variable, state in zip(generators, states):
            variable.assign(state)
        return (call(x, rotary, training=training, valid=valid),
                [variable.value for variable in generators])

    def rematerialized_call(x, rotary=None, training=None, return_attention_scores=False,
                            valid=None):
        if return_attention_scores:
            return call(x, rotary, training=training, return_attention_scores=True, valid=valid)
        # The rotary input and the valid tokens are bound, not passed: constants of the input's
        # geometry, with no gradient (learned frequencies are the block's weights).
        y, states = keras.remat(functools.partial(forward, rotary=rotary, training=training,
                                                  valid=valid))(
            x, [variable.value for variable in generators])
        for variable, state in zip(generators, states):
            variable.assign(state)
        return y

    return rematerialized_call
