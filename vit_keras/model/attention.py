"""How `MultiHeadDotProductAttention` attends: one kernel per backend and device, chosen once when
the layer is built from what is known then, never by trying a kernel and catching its failure.

`choose_attention(compute_dtype, head_dim, tokens)` reads this table, first row that applies:

1. a call that returns or drops the probabilities: `explicit`;
2. torch, not float16: `torch`;
3. JAX on an NVIDIA GPU with cuDNN's flash attention (compute capability 8.0 or later), bfloat16
   or float16, heads of a multiple of 8 up to 128 (256 from compute capability 9.0), and at least
   `CUDNN_MIN_TOKENS` tokens (or a token count unknown when built): `cudnn`;
4. JAX, not float16, unless on a CPU with the XLA:CPU workarounds active: `fused`;
5. everything else (TensorFlow, JAX's CPU, float16): `explicit`.

- `torch`: the projections as `torch.nn.functional.linear` (one matrix product with the bias in
  its epilogue, no layout copies) and `scaled_dot_product_attention` (flash or memory-efficient
  attention on GPUs, the fused CPU kernel on CPU) in the head-major layout it takes.
- `cudnn` (`PaddedAttention`): cuDNN's fused attention through `jax.nn.dot_product_attention`.
  cuDNN trains at a token count only in some lengths (ViT's 197 tokens: forward yes, backward
  "Unsupported sequence length"), so the sequence is padded to a multiple of `PAD_MULTIPLE` tokens
  and the padding is masked through the sequence-length arguments: the same function, fused in
  both directions, and no attention matrix is kept for the backward pass.
- `fused`: `keras.ops.dot_product_attention`, Splash attention on TPU, XLA's attention elsewhere
  (`flash_attention=False` on GPUs: Keras would otherwise try cuDNN, log its refusal with a
  traceback on every trace, and fall back).
- `explicit`: softmax attention written out, head-major, with a float32 softmax; XLA:CPU (JAX and
  TensorFlow) differentiates it faster than the token-major one. The kernel for attention scores,
  attention dropout and float16 (whose fused kernels accumulate float16 products in float32,
  which XLA:CPU cannot do: jax: "precision F16_F16_F32 is not supported").

A kernel is called as `kernel(layer, x, dropout, rotary, valid)` → `(batch, tokens, hidden)` and
the float32 probabilities (None for a fused kernel), given the attention layer (its `query`,
`key`, `value` and `out` projections, and `rope` with rotary embeddings). `valid`, `(batch,
tokens)` bool or None, marks the real tokens of a padded NaFlex batch: every kernel masks the
other keys, so padding never reaches a real token (the padded queries compute what they
compute; nothing reads them). Most are three steps:
`project(layer, x)` → q, k, v in the kernel's layout (`head_major` or token-major), q and k then
turned by `layer.rope` where there is a `rotary` input (the tokens' coordinates or their
rotation, see `vit_keras.model.position_embeddings`);
`attend(q, k, v, valid=...)` → the attended values in that layout and the probabilities;
`out(layer, attended)` → `(batch, tokens, hidden)`. Quantized or LoRA-enabled projections are
called as layers by every kernel, so their own arithmetic applies.
"""

import dataclasses
import functools
import math

import keras
from keras import ops

from vit_keras.model import initializers, legacy, position_embeddings, specs, xla_cpu
from vit_keras.model.backend_ops import adapted, matrix_projection, torch_linear

_PACKAGE = "vit_keras"

# cuDNN's fused attention trains at a multiple of 16 tokens where it refuses ViT-B/16's 197; the
# padding is 11 tokens (measured in docs/performance.md, "cuDNN's fused attention in training").
PAD_MULTIPLE = 16
# Below it XLA's attention is faster than cuDNN's padded one, and the attention matrix it keeps is
# small (the same section of docs/performance.md).
CUDNN_MIN_TOKENS = 128


def choose_attention(compute_dtype, head_dim=None, tokens=None, *, probabilities=False):
    """The kernel (one of `KERNELS`, as an object) for an attention layer built now, whose calls
    compute in `compute_dtype` with heads of `head_dim` (None: unknown, then no kernel that
    depends on it) over `tokens` tokens (None: unknown, any size). `probabilities=True`: the
    kernel for calls that return or drop the attention probabilities, always `explicit`. The
    table is in this module's docstring."""
    if probabilities:
        return kernel_named("explicit")
    backend = keras.backend.backend()
    if backend == "torch":
        return kernel_named("explicit" if compute_dtype == "float16" else "torch")
    if backend == "jax":
        if _cudnn_takes(compute_dtype, head_dim) and (tokens is None
                                                      or tokens >= CUDNN_MIN_TOKENS):
            return kernel_named("cudnn")
        if compute_dtype != "float16" and not xla_cpu.workarounds_active():
            return kernel_named("fused")
    return kernel_named("explicit")


def kernel_named(name):
    """The kernel called `name` (one of `KERNELS`), whatever this backend and device would choose:
    for tests that check each kernel where it runs (`cudnn` runs only on a GPU; `PaddedAttention`
    with `implementation="xla"` computes the same padded and masked function anywhere on JAX)."""
    if name not in KERNELS:
        raise ValueError(f"Unknown attention kernel {name!r}; expected one of {list(KERNELS)}.")
    return KERNELS[name]()


def _cudnn_takes(compute_dtype, head_dim):
    """Whether JAX's first device is an NVIDIA GPU whose cuDNN has fused (flash) attention for
    heads of `head_dim` in `compute_dtype`: jax's own conditions (`check_is_flash_attention`)."""
    if compute_dtype not in ("bfloat16", "float16") or head_dim is None or head_dim % 8:
        return False
    capability = _gpu_compute_capability()
    if capability is None or capability < (8, 0):
        return False
    return head_dim <= (256 if capability >= (9, 0) else 128)


@functools.cache
def _gpu_compute_capability():
    """(major, minor) of JAX's first device if it is an NVIDIA GPU, else None."""
    import jax  # pylint: disable=import-outside-toplevel

    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    try:  # NVIDIA's "9.0"; ROCm's devices name their architecture ("gfx90a") or nothing
        return tuple(int(part) for part in str(device.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):
        return None


class _Kernel:
    """project, attend, out: `(batch, tokens, hidden)` → `(batch, tokens, hidden)` and the
    probabilities (or None)."""

    head_major = False  # q, k, v `(batch, heads, tokens, head_dim)`, else `(batch, tokens, ...)`

    def __call__(self, layer, x, dropout=None, rotary=None, valid=None):
        q, k, v = self.rotated(layer, *self.project(layer, x), rotary)
        attended, probabilities = self.attend(q, k, v, dropout=dropout, valid=valid)
        return self.out(layer, attended), probabilities

    def rotated(self, layer, q, k, v, rotary):
        """q and k turned by the layer's rotary embedding (`rotary` None: as they are)."""
        if rotary is None:
            return q, k, v
        q, k = layer.rope.turn([q, k], rotary, head_major=self.head_major)
        return q, k, v


class FusedAttention(_Kernel):
    """`keras.ops.dot_product_attention` over q, k and v in the projections' token-major layout
    `(batch, tokens, heads, head_dim)`."""

    name = "fused"

    def project(self, layer, x):
        """`(batch, tokens, hidden)` → q, k, v, each `(batch, tokens, heads, head_dim)`: each one
        product of 2-D matrices (`backend_ops.matrix_projection`)."""
        return [matrix_projection(projection, x) for projection in (layer.query, layer.key, layer.value)]

    def attend(self, q, k, v, dropout=None, valid=None):
        """`(batch, tokens, heads, head_dim)` each → the attended values in the same layout, and
        None. No probabilities to drop: the layer takes `explicit` for that."""
        _no_dropout(self, dropout)
        # On a GPU Keras would try cuDNN first and log its refusal with a traceback.
        flash = False if _gpu_compute_capability() is not None else None
        mask = None if valid is None else key_mask(valid)
        return ops.dot_product_attention(q, k, v, mask=mask, flash_attention=flash), None

    def out(self, layer, attended):
        """`(batch, tokens, heads, head_dim)` → `(batch, tokens, hidden)`."""
        return matrix_projection(layer.out, attended)


class PaddedAttention(FusedAttention):
    """`jax.nn.dot_product_attention` with `implementation` (`"cudnn"`: the fused kernel) over a
    sequence padded to a multiple of `PAD_MULTIPLE` tokens, the padded keys and queries masked
    through the sequence-length arguments. Layouts as `FusedAttention`'s (token-major).

    The layer's input is padded, not q, k and v (one pad and one cut a block where there would be
    four copies; the projections compute the padded rows, 2% more products); on a GPU both ways
    measure the same within noise (docs/performance.md).

    `implementation="xla"` computes the same padded and masked function with XLA's attention on
    any JAX device: the tests' stand-in for cuDNN.
    """

    name = "cudnn"

    def __init__(self, implementation="cudnn"):
        self.implementation = implementation

    def __call__(self, layer, x, dropout=None, rotary=None, valid=None):
        import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

        _no_dropout(self, dropout)
        tokens = x.shape[1]
        padded = -(-tokens // PAD_MULTIPLE) * PAD_MULTIPLE
        if padded != tokens:
            x = ops.pad(x, ((0, 0), (0, padded - tokens), (0, 0)))
        q, k, v = self.rotated(layer, *self.project(layer, x), rotary)
        # NaFlex's real tokens come first in each sequence (the prefix, then its valid patches;
        # `naflex_patches` and timm's collator pad at the end), so their count is the length.
        lengths = (jnp.full((x.shape[0],), tokens, jnp.int32) if valid is None
                   else jnp.sum(valid, axis=1, dtype=jnp.int32))
        attended = self.attend(q, k, v, lengths=lengths)
        return self.out(layer, attended)[:, :tokens], None

    def attend(self, q, k, v, dropout=None, *, lengths):
        """`(batch, padded tokens, heads, head_dim)` each, of which the first `lengths[i]` are
        the sequence of image i → the attended values in the same layout."""
        import jax  # pylint: disable=import-outside-toplevel

        _no_dropout(self, dropout)
        return jax.nn.dot_product_attention(
            q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            implementation=self.implementation)


class TorchAttention(_Kernel):
    """The projections as `torch.nn.functional.linear` and `scaled_dot_product_attention` in the
    head-major layout `(batch, heads, tokens, head_dim)` it takes, as views of the projections'
    outputs: five matrix products with their biases in them and one fused attention kernel, where
    Keras' `EinsumDense` and `dot_product_attention` add a bias kernel per projection and copy
    q, k, v and the output between layouts."""

    name = "torch"
    head_major = True

    def project(self, layer, x):
        """`(batch, tokens, hidden)` → q, k, v, each `(batch, heads, tokens, head_dim)`."""
        projections = (layer.query, layer.key, layer.value)
        if adapted(*projections, layer.out):
            return [ops.transpose(projection(x), (0, 2, 1, 3)) for projection in projections]
        batch, tokens, hidden = x.shape
        q_k_v = []
        for projection in projections:
            weight = ops.convert_to_tensor(projection.kernel)  # (hidden, heads, head_dim)
            heads, head_dim = weight.shape[1], weight.shape[2]
            bias = None if projection.bias is None else ops.convert_to_tensor(
                projection.bias).reshape(heads * head_dim)
            y = torch_linear(x, weight.reshape(hidden, heads * head_dim), bias)
            q_k_v.append(y.view(batch, tokens, heads, head_dim).transpose(1, 2))
        return q_k_v

    def attend(self, q, k, v, dropout=None, valid=None):
        """`(batch, heads, tokens, head_dim)` each → the attended values in the same layout, and
        None."""
        import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

        _no_dropout(self, dropout)
        mask = None if valid is None else key_mask(valid)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None

    def out(self, layer, attended):
        """`(batch, heads, tokens, head_dim)` → `(batch, tokens, hidden)`."""
        batch, heads, tokens, head_dim = attended.shape
        if adapted(layer.query, layer.key, layer.value, layer.out):
            return layer.out(ops.transpose(attended, (0, 2, 1, 3)))
        weight = ops.convert_to_tensor(layer.out.kernel)  # (heads, head_dim, hidden)
        merged = attended.transpose(1, 2).reshape(batch, tokens, heads * head_dim)
        return torch_linear(merged, weight.reshape(heads * head_dim, -1), layer.out.bias)


class ExplicitAttention(_Kernel):
    """Softmax attention written out, in a head-major layout, with a float32 softmax.

    q, k and v come from one matrix multiply in the layout `(batch, heads, tokens, head_dim)`,
    which XLA:CPU (JAX and TensorFlow) differentiates faster than the token-major softmax of
    `keras.ops.dot_product_attention`; the products go through `einsum`
    (`vit_keras.model.xla_cpu.choose_einsum`: bfloat16 products on XLA:CPU). The kernel for attention
    scores, attention dropout and float16.
    """

    name = "explicit"
    head_major = True

    def __init__(self, einsum):
        self.einsum = einsum

    def project(self, layer, x):
        """`(batch, tokens, hidden)` → q, k, v, each `(batch, heads, tokens, head_dim)`.

        One matrix multiply with the three kernels side by side: on CPU a few large products use
        the cores better than many small ones.
        """
        projections = (layer.query, layer.key, layer.value)
        if adapted(*projections, layer.out):
            return [ops.transpose(projection(x), (0, 2, 1, 3)) for projection in projections]
        weight = ops.concatenate([projection.kernel for projection in projections], axis=1)
        qkv = self.einsum("btd,dhk->bhtk", x, weight)
        if any(projection.bias is not None for projection in projections):
            # A projection without a bias (EVA's key) adds zeros.
            bias = ops.concatenate([
                ops.zeros(projection.kernel.shape[1:], qkv.dtype) if projection.bias is None
                else ops.cast(projection.bias, qkv.dtype) for projection in projections], axis=0)
            qkv = qkv + ops.expand_dims(bias, 1)
        return ops.split(qkv, 3, axis=1)

    def attend(self, q, k, v, dropout=None, valid=None):
        """`(batch, heads, tokens, head_dim)` each → the attended values in the same layout, and
        the probabilities `(batch, heads, tokens, tokens)` in float32. `dropout`, a Dropout layer,
        drops probabilities (called with `training=True`)."""
        # Scaling q before the product keeps float16 logits in range; softmax runs in float32.
        logits = self.einsum("bhqd,bhkd->bhqk", q * (1.0 / math.sqrt(q.shape[-1])), k)
        logits = ops.cast(logits, "float32")
        if valid is not None:  # finite: a row of padding alone gets uniform weights, not NaN
            logits = ops.where(key_mask(valid), logits, -1e9)
        probabilities = ops.softmax(logits, axis=-1)
        weights = ops.cast(probabilities, q.dtype)
        if dropout is not None:
            weights = dropout(weights, training=True)
        return self.einsum("bhqk,bhkd->bhqd", weights, v), probabilities

    def out(self, layer, attended):
        """`(batch, heads, tokens, head_dim)` → `(batch, tokens, hidden)`."""
        if adapted(layer.query, layer.key, layer.value, layer.out):
            return layer.out(ops.transpose(attended, (0, 2, 1, 3)))
        y = self.einsum("bhtk,hkd->btd", attended, layer.out.kernel)
        return y if layer.out.bias is None else y + layer.out.bias


def key_mask(valid):
    """`(batch, tokens)` bool → `(batch, 1, 1, tokens)`: each query attends to the real keys."""
    return ops.expand_dims(ops.expand_dims(ops.cast(valid, "bool"), 1), 1)


def _no_dropout(kernel, dropout):
    if dropout is not None:
        raise ValueError(f"The {kernel.name} attention kernel has no probabilities to drop; "
                         "attention dropout takes the explicit kernel "
                         "(choose_attention(..., probabilities=True)).")


KERNELS = {
    "explicit": lambda: ExplicitAttention(xla_cpu.choose_einsum()),
    "fused": FusedAttention,
    "cudnn": lambda: PaddedAttention("cudnn"),
    "torch": TorchAttention,
}
"""The attention implementations by name: each makes a kernel, called as `kernel(layer, x, dropout,
rotary)` (`rotary`: the tokens' coordinates or rotation for rotary embeddings, else None; see the
module's docstring). A new one is one class and one entry here."""


# The attention layer and its projections ---------------------------------------------------------------

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
            # Not `super().kernel` where it would read `_kernel`: torch.compile cannot trace a
            # property through `super()`, and a graph break in every projection would compile
            # each block on its own.
            return self._kernel if self.quantization_mode is None else super().kernel
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
class MultiHeadDotProductAttention(position_embeddings.TakesRotary, keras.layers.Layer):
    """Multi-head self-attention with the vit_jax weight layout.

    Input: `(batch, tokens, hidden)`. Output: `(batch, tokens, hidden)`, and with
    `return_attention_scores=True` also the probabilities `(batch, heads, tokens, tokens)` (float32).
    Weights: `query|key|value/kernel` `(hidden, heads, head_dim)`, `.../bias` `(heads, head_dim)`,
    `out/kernel` `(heads, head_dim, hidden)`, `out/bias` `(hidden,)`.

    How q, k and v are projected, laid out and attended is the kernel's, chosen when the layer is
    built (`vit_keras.model.attention`: torch's fused attention, cuDNN's on NVIDIA GPUs under JAX,
    `keras.ops.dot_product_attention`, or an explicit float32 softmax, which is also the kernel
    for attention dropout and `return_attention_scores`); `attention_kernel` names it. Quantized
    (`model.quantize`) or LoRA-enabled (`enable_lora`) projections are called as layers by every
    kernel, so their own arithmetic applies.

    `spec`: its `AttentionSpec` (which projections have biases; with rotary embeddings the layer
    has a `RotaryEmbedding` `rope`, see `vit_keras.model.position_embeddings`, and a call takes the
    tokens' coordinates `(tokens, 2)` or, with fixed frequencies, the rotation the model computed
    from them once for every layer, `layer(x, rotary)`). `attention` names the kernel (None:
    chosen when built).
    """

    MODEL_PARALLEL = {**{f"{name}/kernel": (None, "model", None) for name in ("query", "key", "value")},
                      **{f"{name}/bias": ("model", None) for name in ("query", "key", "value")},
                      "out/kernel": ("model", None, None)}
    """Its weights' layouts over a mesh's `model` axis (by path inside the layer): split over
    heads; the rest replicated."""

    def __init__(self, num_heads, attention_dropout=0.0, attention=None, spec=None, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = int(num_heads)
        self.attention_dropout = float(attention_dropout)
        if attention is not None and attention not in KERNELS:
            raise ValueError(f"Unknown attention kernel {attention!r}; expected one of "
                             f"{list(KERNELS)} or None (chosen when built).")
        self.attention = attention
        self.spec = AttentionSpec.of(spec) or AttentionSpec()
        self._dropout = keras.layers.Dropout(
            self.attention_dropout, dtype=self.dtype_policy, name="attention_dropout")
        self.rope = None if self.spec.rope is None else self.spec.rope.embedding(
            self.num_heads, dtype=self.dtype_policy)
        self._attention_kernel = self._probabilities_kernel = None  # chosen in build
        position_embeddings.keep_rotary_float32(self)

    @property
    def qkv_bias(self):
        return self.spec.qkv_bias

    @property
    def out_bias(self):
        return self.spec.out_bias

    def build(self, input_shape):
        hidden = input_shape[-1]
        if hidden % self.num_heads:
            raise ValueError(
                f"Hidden size {hidden} is not divisible by the number of heads {self.num_heads}; "
                f"choose a hidden size that is a multiple of {self.num_heads}.")
        head_dim = hidden // self.num_heads
        init = initializers.xavier_uniform(hidden, hidden)
        for name in ("query", "key", "value"):
            projection = HeadsProjection(
                "btd,dhk->bthk", output_shape=(None, self.num_heads, head_dim),
                bias_axes="hk" if name[0] in _BIASES[self.qkv_bias] else None,
                kernel_initializer=init, dtype=self.dtype_policy, name=name)
            projection.build(input_shape)
            setattr(self, name, projection)
        self.out = keras.layers.EinsumDense(
            "bthk,hkd->btd", output_shape=(None, hidden), bias_axes="d" if self.out_bias else None,
            kernel_initializer=init, dtype=self.dtype_policy, name="out")
        self.out.build((input_shape[0], input_shape[1], self.num_heads, head_dim))
        if self.rope is not None:
            self.rope.build((None, self.num_heads, None, head_dim))
        self._attention_kernel = (
            kernel_named(self.attention) if self.attention is not None
            else choose_attention(self.compute_dtype, head_dim, input_shape[1]))
        self._probabilities_kernel = choose_attention(
            self.compute_dtype, head_dim, input_shape[1], probabilities=True)

    @property
    def attention_kernel(self):
        """The name of the kernel a call without attention scores or attention dropout takes
        (`vit_keras.model.attention.KERNELS`), chosen when the layer was built; None before."""
        return None if self._attention_kernel is None else self._attention_kernel.name

    @property
    def lora_targets(self):
        """The projections LoRA adapts: `query`, `key`, `value`, `out`."""
        return [self.query, self.key, self.value, self.out]

    @property
    def fused(self):
        """Whether a call without attention scores or attention dropout takes a fused kernel
        (chosen when the layer was built; False before)."""
        return self.attention_kernel not in (None, "explicit")

    def call(self, x, rotary=None, training=None, return_attention_scores=False, valid=None):
        if (rotary is None) != (self.rope is None):
            raise ValueError(f"{self.name}: " + (
                "a layer with rotary embeddings is called with the tokens' coordinates or "
                "rotation, layer(x, rotary)." if rotary is None else
                "a rotary input is given, but the layer has no rotary embeddings (rope=None)."))
        x = ops.cast(x, self.compute_dtype)
        dropout = training and self.attention_dropout > 0
        kernel = self._attention_kernel
        if return_attention_scores or dropout:  # probabilities to return or to drop
            kernel = self._probabilities_kernel
        y, probabilities = kernel(self, x, dropout=self._dropout if dropout else None,
                                  rotary=rotary, valid=valid)
        return (y, probabilities) if return_attention_scores else y

    def compute_output_spec(self, x, rotary=None, training=None,
                            return_attention_scores=False, valid=None):
        y = keras.KerasTensor(x.shape, dtype=self.compute_dtype)
        if not return_attention_scores:
            return y
        batch, tokens = x.shape[0], x.shape[1]
        return y, keras.KerasTensor((batch, self.num_heads, tokens, tokens), dtype="float32")

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads,
                "attention_dropout": self.attention_dropout, "attention": self.attention,
                "spec": self.spec.get_config()}

    @classmethod
    def from_config(cls, config):
        return cls(**legacy.attention_config(config))


_BIASES = {"qkv": "qkv", "qv": "qv", "none": ""}
"""`qkv_bias` → the initials of the projections that have a bias."""


@dataclasses.dataclass(frozen=True)
class AttentionSpec(specs.Spec):
    """The attention slot's options: which of the query, key and value projections have a bias
    (`"qkv"`, `"qv"`: EVA's, none on the key; `"none"`), whether the output projection has one,
    and the rotary embeddings (`position_embeddings.RopeSpec`) or None."""

    NESTED = {"rope": position_embeddings.RopeSpec}

    qkv_bias: str = "qkv"
    out_bias: bool = True
    rope: position_embeddings.RopeSpec | None = None

    def __post_init__(self):
        if self.qkv_bias not in _BIASES:
            raise ValueError(f"Unknown qkv_bias {self.qkv_bias!r}; expected one of "
                             f"{list(_BIASES)}.")


def attention_spec(config):
    """The `AttentionSpec` of a `ViTConfig` (`qkv_bias`, `proj_bias` and its `rope`)."""
    return AttentionSpec(config.qkv_bias, config.proj_bias, config.rope)
