"""The attention kernels' table (`vit_keras.attention.choose_attention`) on every device it names,
and the padded, masked attention that cuDNN runs on GPUs computing the same function as the
explicit kernel, at ViT's token counts, forward and gradients, float32 and bfloat16.

cuDNN itself runs only on an NVIDIA GPU: here the same padded and masked call goes through XLA's
attention (`PaddedAttention("xla")`), and `benchmarks/gpu_attention.py` runs the cuDNN one
against XLA's on a GPU. The torch kernel's count of dispatched operations is checked against
timm's here too (torch's dispatcher counts the same on CPU as on a GPU).
"""

import collections

import keras
import numpy as np
import pytest

from vit_keras.model import attention, layers, xla_cpu

from conftest import randomize_weights

BACKEND = keras.backend.backend()


@pytest.fixture
def gpu(monkeypatch):
    """Pretends JAX's first device is an NVIDIA GPU of the compute capability the test sets (None:
    the CPU it is); on a GPU the XLA:CPU workarounds are not active."""
    def set_capability(capability):
        monkeypatch.setattr(attention, "_gpu_compute_capability", lambda: capability)
        if capability is not None:
            monkeypatch.setattr(xla_cpu, "workarounds_active", lambda: False)
    return set_capability


@pytest.mark.skipif(BACKEND != "jax", reason="the GPU rows are JAX's")
@pytest.mark.parametrize("capability, dtype, head_dim, kernel, tokens", [
    ((9, 0), "bfloat16", 64, "cudnn", 197),      # ViT-B/16 on an H100
    ((9, 0), "bfloat16", 64, "cudnn", None),     # dynamic image size: any count
    ((9, 0), "bfloat16", 64, "fused", 50),       # ViT-B/32: XLA's is faster below 128 tokens
    ((9, 0), "bfloat16", 64, "cudnn", 128),
    ((9, 0), "float16", 64, "cudnn", 197),
    ((9, 0), "bfloat16", 256, "cudnn", 197),     # Hopper takes heads up to 256
    ((8, 0), "bfloat16", 256, "fused", 197),     # Ampere up to 128
    ((8, 0), "bfloat16", 128, "cudnn", 197),
    ((9, 0), "bfloat16", 60, "fused", 197),      # not a multiple of 8
    ((7, 5), "bfloat16", 64, "fused", 197),      # no flash attention before Ampere
    ((9, 0), "float32", 64, "fused", 197),       # cuDNN's fused attention is 16-bit only
    ((9, 0), "float16", 60, "explicit", 197),    # float16 without cuDNN: explicit, as on CPU
    (None, "bfloat16", 64, None, 197),           # JAX's CPU: fused or explicit by the switch
])
def test_jax_chooses_cudnn_where_its_fused_attention_trains(gpu, capability, dtype, head_dim,
                                                            kernel, tokens):
    gpu(capability)
    if kernel is None:
        kernel = "explicit" if xla_cpu.workarounds_active() else "fused"
    assert attention.choose_attention(dtype, head_dim, tokens).name == kernel
    assert attention.choose_attention(dtype, head_dim, tokens,
                                      probabilities=True).name == "explicit"
    layer = layers.MultiHeadDotProductAttention(2, dtype=keras.DTypePolicy(
        "mixed_" + dtype if dtype != "float32" else dtype))
    layer.build((None, tokens, 2 * head_dim))
    assert layer.attention_kernel == kernel


def test_every_kernel_has_a_name_and_an_unknown_one_is_refused():
    assert list(attention.KERNELS) == ["explicit", "fused", "cudnn", "torch"]
    with pytest.raises(ValueError, match="Unknown attention kernel 'flash'"):
        attention.kernel_named("flash")


def test_a_fused_kernel_refuses_attention_dropout():
    with pytest.raises(ValueError, match="no probabilities to drop"):
        attention.kernel_named("fused").attend(None, None, None, dropout=object())


def _explicit_and_padded(tokens, dtype, heads=2, head_dim=8, batch=2):
    """Outputs and q/k/v gradients of the explicit kernel and of the padded, masked one (XLA's
    attention standing in for cuDNN) on the same random q, k, v `(batch, tokens, heads,
    head_dim)` in `dtype`, as float32 arrays."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(tokens)
    q, k, v = (jnp.asarray(rng.normal(0, 1, (batch, tokens, heads, head_dim)), dtype)
               for _ in range(3))
    cotangent = jnp.asarray(rng.normal(0, 1, (batch, tokens, heads, head_dim)), dtype)
    explicit = attention.kernel_named("explicit")

    def explicit_attention(q, k, v):  # the explicit kernel is head-major
        attended, _ = explicit.attend(*(jnp.transpose(t, (0, 2, 1, 3)) for t in (q, k, v)))
        return jnp.transpose(attended, (0, 2, 1, 3))

    def padded_attention(q, k, v):  # padded here as the kernel pads the layer's input
        padded = -(-tokens // attention.PAD_MULTIPLE) * attention.PAD_MULTIPLE
        q, k, v = (jnp.pad(t, ((0, 0), (0, padded - tokens), (0, 0), (0, 0))) for t in (q, k, v))
        lengths = jnp.full((batch,), tokens, jnp.int32)
        return attention.PaddedAttention("xla").attend(q, k, v, lengths=lengths)[:, :tokens]

    results = []
    for function in (explicit_attention, padded_attention):
        out, pullback = jax.vjp(function, q, k, v)
        results.append([np.asarray(t, np.float32) for t in (out, *pullback(cotangent))])
    return results


@pytest.mark.skipif(BACKEND != "jax", reason="PaddedAttention is JAX's kernel")
@pytest.mark.parametrize("tokens", [197, 257, 577, 50, 65, 198, 201, 16, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_masked_attention_is_the_explicit_kernels_function(tokens, dtype):
    """ViT-B/16 at 224 (197), 256 (257) and 384 px (577); ViT-B/32 at 224 (50) and 256 (65);
    with a distillation token (198) and 4 registers (201); a multiple of the padding (16) and a
    single token. Padded keys must get no weight and padded queries no gradient."""
    explicit, padded = _explicit_and_padded(tokens, dtype)
    tolerance = {"float32": 2e-5, "bfloat16": 3e-2}[dtype]
    for name, a, b in zip(("output", "dq", "dk", "dv"), explicit, padded):
        assert a.shape == b.shape, name
        scale = max(float(np.max(np.abs(a))), 1e-3)
        assert float(np.max(np.abs(a - b))) / scale < tolerance, (name, tokens, dtype)


@pytest.mark.skipif(BACKEND != "jax", reason="PaddedAttention is JAX's kernel")
def test_a_vit_attention_layer_with_the_padded_kernel_matches_the_explicit_one(monkeypatch):
    """The whole layer (projections, padded attention, output projection) against the explicit
    kernel's layer with the same weights, at an odd token count."""
    explicit = layers.MultiHeadDotProductAttention(4)
    explicit.build((None, 13, 32))
    randomize_weights(explicit, scale=0.3)
    monkeypatch.setattr(attention, "choose_attention", lambda dtype, head_dim=None, tokens=None, **kw: (
        attention.kernel_named("explicit") if kw.get("probabilities")
        else attention.PaddedAttention("xla")))
    padded = layers.MultiHeadDotProductAttention(4)
    padded.build((None, 13, 32))
    padded.set_weights(explicit.get_weights())
    assert padded.attention_kernel == "cudnn" and explicit.attention_kernel != "cudnn"
    x = np.random.default_rng(0).normal(size=(2, 13, 32)).astype("float32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(padded(x)),
                               keras.ops.convert_to_numpy(explicit(x, return_attention_scores=True)[0]),
                               rtol=1e-4, atol=1e-5)


# The torch backend's kernel count ---------------------------------------------------------------

def _dispatched_operations(step):
    """Counts of the operations torch's dispatcher runs for one call of `step` (views, which
    launch no kernel, left out), after two calls to warm up."""
    import torch  # pylint: disable=import-outside-toplevel
    from torch.utils._python_dispatch import TorchDispatchMode  # pylint: disable=import-outside-toplevel

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket is not torch.ops.aten.detach:
                self.counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    step()
    step()
    with Counting() as counting:
        step()
    return counting.counts


@pytest.mark.skipif(BACKEND != "torch", reason="counts torch's dispatched operations")
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_torch_runs_about_as_many_operations_a_step_as_timm(mode):
    """vit_keras on Keras' torch backend and timm, the same ViT under bfloat16 autocast/mixed
    precision: every projection one matrix product with its bias in it (`addmm`: q, k, v, out and
    the MLP's two, 6 a block; no separate bias additions, no einsum layout copies), and no more
    than 1.25x timm's operations a step (fused q/k/v in timm: 4 products a block, so 2 more weight
    casts per block here). Before the torch kernels: 2.0x (inference), 1.55x (training)."""
    torch = pytest.importorskip("torch")
    vision_transformer = pytest.importorskip("timm.models.vision_transformer")
    import vit_keras  # pylint: disable=import-outside-toplevel

    depth, hidden, heads, image, patch = 4, 64, 4, 32, 8
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = vit_keras.build_model(
            dict(name="tiny", patch_size=patch, num_layers=depth, hidden_size=hidden,
                 num_heads=heads, mlp_dim=4 * hidden),
            image_size=image, num_classes=10)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    reference = vision_transformer.VisionTransformer(
        img_size=image, patch_size=patch, embed_dim=hidden, depth=depth, num_heads=heads,
        num_classes=10)
    images = torch.rand(2, image, image, 3) * 255
    labels = torch.zeros(2, dtype=torch.long)

    def ours():
        if mode == "inference":
            with torch.no_grad():
                return model(images, training=False)
        logits = model(images, training=True)
        torch.nn.functional.cross_entropy(logits.float(), labels).backward()
        for variable in model.trainable_variables:
            variable.value.grad = None
        return logits

    def timm():
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(
                mode == "training"):
            logits = reference(images.permute(0, 3, 1, 2))
            if mode == "training":
                torch.nn.functional.cross_entropy(logits.float(), labels).backward()
                reference.zero_grad(set_to_none=True)
        return logits

    counts, timm_counts = _dispatched_operations(ours), _dispatched_operations(timm)
    assert counts["addmm"] == 6 * depth + 1, counts  # and the patch embedding's
    assert counts["bmm"] == 0 and counts["clone"] <= 2, counts  # the patches' layout
    if mode == "inference":  # the residuals, position embeddings, the head's bias: no bias adds
        assert counts["add"] <= 2 * depth + 4, counts
    total, timm_total = sum(counts.values()), sum(timm_counts.values())
    assert total <= 1.5 * timm_total, (total, timm_total, counts, timm_counts)
