"""The XLA:CPU workarounds of `vit_keras.xla_cpu`: what they change and that they keep the math."""

import re
import sys

import keras
import numpy as np
import pytest

from vit_keras.model import xla_cpu
from vit_keras.model.xla_cpu import einsum, materialize_gradient

from conftest import run_on_backend

_GRADIENT_CODE = """
import jax, jax.numpy as jnp, numpy as np
from vit_keras.model.xla_cpu import materialize_gradient

def chain(x, barrier):
    for _ in range(4):  # a residual stream whose gradient XLA would fuse into every consumer
        x = x + jnp.tanh(barrier(x) * 0.5)
    return jnp.sum(x ** 2)

x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32)
with_barrier = jax.jit(jax.grad(lambda x: chain(x, materialize_gradient)))
without = jax.jit(jax.grad(lambda x: chain(x, lambda t: t)))
nan_grad = jax.grad(lambda x: jnp.sum(materialize_gradient(x) * jnp.nan))(x)
print(json.dumps({
    "difference": float(jnp.max(jnp.abs(with_barrier(x) - without(x)))),
    "scale": float(jnp.max(jnp.abs(without(x)))),
    "conditionals": with_barrier.lower(x).compile().as_text().count("conditional("),
    "nan_stays_nan": bool(jnp.all(jnp.isnan(nan_grad))),
}))
"""


def test_materialize_gradient_is_an_identity():
    x = keras.ops.convert_to_tensor(np.arange(6, dtype="float32").reshape(2, 3))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(materialize_gradient(x)),
                                  np.arange(6, dtype="float32").reshape(2, 3))


@pytest.mark.jax_subprocess
def test_materialize_gradient_on_jax_keeps_gradients_and_survives_xla():
    """The conditional must reach the compiled program (XLA folds trivial ones away), one per use,
    and the gradient must equal the one without it."""
    result = run_on_backend("jax", _GRADIENT_CODE)
    assert result["conditionals"] == 4
    # Not bit equality: with and without the barrier XLA fuses the same elementwise gradient into
    # different loops, which may contract a product and a sum into one FMA (a last-bit change);
    # a barrier that lost or scaled the gradient would be off by its whole size.
    assert result["difference"] <= 1e-6 * result["scale"], result
    assert result["nan_stays_nan"]


_MALLOC_CODE = """
import ctypes

# glibc's own view, through a handle made before the recorder below: a 64 MiB block is above the
# largest mmap threshold glibc adopts by itself, so it is mapped unless mallopt(M_MMAP_MAX, 0) ran.
libc = ctypes.CDLL("libc.so.6")

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def large_block_is_mapped():
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(64 << 20)
    mapped = libc.mallinfo2().hblkhd - before >= 64 << 20
    libc.free(block)
    return mapped

# Every C function looked up through ctypes from here on.
looked_up = []

class Recording(ctypes.CDLL):
    def __getitem__(self, name):
        looked_up.append(name)
        return super().__getitem__(name)

ctypes.CDLL, ctypes.cdll = Recording, ctypes.LibraryLoader(Recording)

def state():
    return {"mallopt": "mallopt" in looked_up, "large_block_mapped": large_block_is_mapped()}

result = {"start": state()}
import numpy as np
import vit_keras
model = vit_keras.build_model(ARGS["config"], image_size=8, num_classes=3)
model(np.zeros((1, 8, 8, 3), "float32"))  # JAX's CPU client and the layers' workarounds ran
result["after_import"] = state()
result["applied"] = vit_keras.keep_freed_host_memory()
result["after_call"] = state()
print(json.dumps(result))
"""


@pytest.mark.slow  # over 5 s alone: out of make test-fast
@pytest.mark.jax_subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_import_leaves_glibc_malloc_alone_until_keep_freed_host_memory_is_called(tiny_config):
    """Importing vit_keras on JAX and running a model neither looks up `mallopt` through ctypes
    nor stops glibc from mapping large blocks (which `mallopt(M_MMAP_MAX, 0)` from anywhere, C
    included, would); `keep_freed_host_memory()` does both, which shows the probes can see it."""
    result = run_on_backend("jax", _MALLOC_CODE, config=tiny_config)
    untouched = {"mallopt": False, "large_block_mapped": True}
    assert result["start"] == untouched, result
    assert result["after_import"] == untouched, result
    assert result["applied"] is True
    assert result["after_call"] == {"mallopt": True, "large_block_mapped": False}, result


_PAGE_FAULT_CODE = """
import resource
if ARGS["call"]:
    from vit_keras.model.xla_cpu import keep_freed_host_memory
    assert keep_freed_host_memory()  # before JAX's CPU client, as its docstring asks
import jax, jax.numpy as jnp

@jax.jit
def step(a):  # a 64 MiB scratch buffer (the first product), above glibc's mmap threshold
    return jnp.sum((a @ a.T) @ a[:, :8])

a = jnp.ones((4096, 256), jnp.float32) * 1e-3
step(a).block_until_ready()
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(a).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults_per_step": faults}))
"""


@pytest.mark.slow
@pytest.mark.jax_subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_keep_freed_host_memory_and_its_glibc_tunables_stop_page_faulting_scratch_buffers(
        monkeypatch):
    """Untuned, every step faults its 64 MiB scratch buffer in again (16k pages); after
    `keep_freed_host_memory()`, or with the GLIBC_TUNABLES its docstring names, steps reuse the
    pages of earlier ones.

    The fewest faults of 10 steps is compared, not the mean: on a busy machine (the other backends'
    test passes run alongside) some tuned steps still extend the heap by one buffer, as the block a
    step frees is not always reusable by the next one; an untuned step never avoids the faults.
    """
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    untuned = run_on_backend("jax", _PAGE_FAULT_CODE, call=False)["faults_per_step"]
    called = run_on_backend("jax", _PAGE_FAULT_CODE, call=True)["faults_per_step"]
    tunables = re.search(r"GLIBC_TUNABLES=(\S+)", xla_cpu.keep_freed_host_memory.__doc__)
    monkeypatch.setenv("GLIBC_TUNABLES", tunables.group(1))
    tuned = run_on_backend("jax", _PAGE_FAULT_CODE, call=False)["faults_per_step"]
    assert min(untuned) > 8000, untuned
    assert min(called) < min(untuned) / 2, (called, untuned)
    assert min(tuned) < min(untuned) / 2, (tuned, untuned)


_SWITCH_CODE = """
import jax, jax.numpy as jnp, numpy as np
import keras
from vit_keras import build_model
from vit_keras.model import xla_cpu

attention_calls = []
dot_product_attention = keras.ops.dot_product_attention

def counting(*args, **kwargs):  # the kernels look it up in keras.ops at each call
    attention_calls.append(1)
    return dot_product_attention(*args, **kwargs)

keras.ops.dot_product_attention = counting
rng = np.random.default_rng(0)
x = rng.uniform(0, 255, (4, 8, 8, 3)).astype("float32")
y = np.arange(4) % 3

def built():  # the same weights whenever it is built
    keras.utils.set_random_seed(0)
    model = build_model(ARGS["config"], image_size=8, num_classes=3)
    rng = np.random.default_rng(0)
    for weight in model.weights:  # the head starts at zero
        weight.assign(rng.normal(0, 0.1, weight.shape).astype("float32"))
    return model

def traced(model):  # a fresh function: traced now, under the switch's setting now
    attention_calls.clear()
    trainable = [v.value for v in model.trainable_variables]

    def loss(trainable):
        logits, _ = model.stateless_call(trainable, [], x, training=True)
        return jnp.mean(keras.ops.sparse_categorical_crossentropy(y, logits, from_logits=True)), logits

    step = jax.jit(jax.grad(lambda t: loss(t), has_aux=True))
    hlo = step.lower(trainable).compile().as_text()
    gradients, logits = step(trainable)
    return {"conditionals": hlo.count("conditional("), "attention_calls": len(attention_calls),
            "fused": [block.attention.fused for block in model.layers if hasattr(block, "attention")]
            }, np.asarray(logits), gradients

default_active = xla_cpu.workarounds_active()
model = built()
default, default_logits, default_gradients = traced(model)
with xla_cpu.set_workarounds(not default_active):
    flipped_active = xla_cpu.workarounds_active()
    kept = traced(model)[0]  # built before the switch changed
    flipped, flipped_logits, flipped_gradients = traced(built())
print(json.dumps({
    "default": {"active": default_active, **default}, "kept": kept,
    "flipped": {"active": flipped_active, **flipped}, "restored": xla_cpu.workarounds_active(),
    "logits_difference": float(np.max(np.abs(default_logits - flipped_logits))),
    "logits_scale": float(np.max(np.abs(default_logits))),
    "gradients": [(float(np.max(np.abs(a - b))), float(np.max(np.abs(a))))
                  for a, b in zip(default_gradients, flipped_gradients)],
}))
"""


@pytest.mark.slow
@pytest.mark.jax_subprocess
@pytest.mark.parametrize("setting", [None, "1", "0"])
def test_switch_turns_the_workarounds_on_and_off_for_models_built_after_it_on_jax_cpu(
        tiny_config, setting, monkeypatch):
    """`VIT_KERAS_XLA_CPU_WORKAROUNDS` sets the default (on when unset) and `set_workarounds`
    flips it for models built inside it; a model built before keeps its choices when traced
    inside it. On: one barrier conditional per block in the compiled training step and the
    explicit attention kernel; off: no conditional and every block through
    `keras.ops.dot_product_attention`. Both compute the same logits and gradients."""
    if setting is None:
        monkeypatch.delenv(xla_cpu.SWITCH, raising=False)
    else:
        monkeypatch.setenv(xla_cpu.SWITCH, setting)
    result = run_on_backend("jax", _SWITCH_CODE, config=tiny_config)
    blocks = tiny_config["num_layers"]
    on = {"active": True, "conditionals": blocks, "attention_calls": 0, "fused": [False] * blocks}
    off = {"active": False, "conditionals": 0, "attention_calls": blocks, "fused": [True] * blocks}
    expected_default = off if setting == "0" else on
    assert result["default"] == expected_default, result
    assert result["kept"] == {k: v for k, v in expected_default.items() if k != "active"}, result
    assert result["flipped"] == (on if expected_default is off else off), result
    assert result["restored"] is expected_default["active"]
    assert result["logits_difference"] <= 1e-5 * result["logits_scale"] + 1e-6, result
    # Per weight; the floor is for the key bias, whose gradient is zero up to rounding (softmax
    # does not see a constant added to every key).
    for difference, scale in result["gradients"]:
        assert difference <= 1e-4 * scale + 1e-9, result["gradients"]


def test_switch_reads_the_environment_when_first_needed_and_rejects_unknown_settings(
        monkeypatch):
    monkeypatch.setenv(xla_cpu.SWITCH, "0")
    with xla_cpu.set_workarounds(None):  # back to the environment's setting, read now
        assert xla_cpu.workarounds_enabled() is False
        assert xla_cpu.workarounds_active() is False
        with xla_cpu.set_workarounds(True):
            assert xla_cpu.workarounds_enabled() is True
            assert xla_cpu.workarounds_active() is xla_cpu.on_xla_cpu()
        assert xla_cpu.workarounds_enabled() is False
    monkeypatch.setenv(xla_cpu.SWITCH, "yes")
    with xla_cpu.set_workarounds(None):
        with pytest.raises(ValueError, match="VIT_KERAS_XLA_CPU_WORKAROUNDS='yes' is not a setting"):
            xla_cpu.workarounds_enabled()


# Element types of each dot's operands in compiled HLO text: a dot names its operands, whose types
# are where they are defined (an instruction, or a parameter of the fused computation).
_DOT_TYPES = """
import re

def dot_operand_types(hlo):
    types = dict(re.findall(r"%?([\\w.-]+) = (\\w+)\\[", hlo))
    types.update(re.findall(r"([\\w.-]+): (\\w+)\\[", hlo))
    return [tuple(types[name] for name in operands)
            for operands in re.findall(r" dot\\(%?([\\w.-]+), %?([\\w.-]+)\\)", hlo)]
"""

_BFLOAT16_EINSUM_CODE = _DOT_TYPES + """
import jax, jax.numpy as jnp, numpy as np
import keras
from vit_keras.model.xla_cpu import einsum, set_workarounds

equation = "btd,dhk->bhtk"  # the q/k/v projection's
rng = np.random.default_rng(0)
a, b = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for shape in ((2, 5, 8), (8, 3, 4)))
weights = rng.normal(size=(2, 3, 5, 4)).astype("float32")

def loss_and_gradients(product):
    loss = lambda a, b: jnp.sum(product(equation, a, b).astype(jnp.float32) * weights)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

reference = loss_and_gradients(jnp.einsum)(a.astype(jnp.float32), b.astype(jnp.float32))
reference = [reference[0], *reference[1]]

def relative_error(x, y):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))

results = {}
for name, product, enabled in (("ours", einsum, True), ("keras", keras.ops.einsum, True),
                               ("ours_switched_off", einsum, False)):
    with set_workarounds(enabled):  # the functions are traced inside
        step = loss_and_gradients(product)
        loss, gradients = step(a, b)
        dots = dot_operand_types(step.lower(a, b).compile().as_text())
    results[name] = {
        "gradient_dtypes": [str(g.dtype) for g in gradients],
        "errors": [relative_error(x, y) for x, y in zip([loss, *gradients], reference)],
        "dots": dots,
    }
print(json.dumps(results))
"""


@pytest.mark.jax_subprocess
def test_einsum_on_jax_keeps_bfloat16_products_in_both_directions():
    """XLA:CPU runs `keras.ops.einsum` of bfloat16 operands, and its gradients, as float32 products;
    `einsum` keeps all three in bfloat16 and agrees with a float32 reference as closely. With the
    workarounds switched off it is `keras.ops.einsum`."""
    result = run_on_backend("jax", _BFLOAT16_EINSUM_CODE)
    ours, plain = result["ours"], result["keras"]
    assert result["ours_switched_off"]["dots"] == plain["dots"]
    assert ours["dots"] == [["bf16", "bf16"]] * 3, ours["dots"]
    assert all(dot == ["f32", "f32"] for dot in plain["dots"]), plain["dots"]  # what this works around
    assert ours["gradient_dtypes"] == ["bfloat16", "bfloat16"]
    for error, keras_error in zip(ours["errors"], plain["errors"]):
        assert error < 1e-2 and error <= 1.5 * keras_error + 1e-3, (ours["errors"], plain["errors"])


_MIXED_VIT_CODE = _DOT_TYPES + """
import jax, jax.numpy as jnp, numpy as np
import keras
from vit_keras import build_model

x = np.random.default_rng(0).uniform(0, 255, (4, 8, 8, 3)).astype("float32")
y = np.arange(4) % 3
gradients, dots = {}, {}
for policy in ("float32", "mixed_bfloat16"):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = build_model(ARGS["config"], image_size=8, num_classes=3)
    trainable = [v.value for v in model.trainable_variables]
    def loss(trainable):
        logits, _ = model.stateless_call(trainable, [], x, training=True)
        return jnp.mean(keras.ops.sparse_categorical_crossentropy(y, logits, from_logits=True))
    step = jax.jit(jax.grad(loss))
    gradients[policy] = np.concatenate([np.ravel(g) for g in step(trainable)]).astype(np.float64)
    dots[policy] = dot_operand_types(step.lower(trainable).compile().as_text())
g32, g16 = gradients["float32"], gradients["mixed_bfloat16"]
print(json.dumps({"dots": dots["mixed_bfloat16"],
                  "cosine": float(g32 @ g16 / np.linalg.norm(g32) / np.linalg.norm(g16))}))
"""


@pytest.mark.slow  # over 5 s alone: out of make test-fast
@pytest.mark.jax_subprocess
def test_mixed_bfloat16_vit_on_jax_differentiates_through_bfloat16_products(tiny_config):
    """On JAX on CPU the encoder's products (patches, q/k/v, attention, output, MLP; forward and
    gradients) are bfloat16, and the gradient is the float32 model's to bfloat16 precision.

    Of each block's 18 products XLA converts three attention gradients to float32 whatever their
    operands (the probabilities', and the keys' and values', whose left operand it reads
    transposed), and the head computes in float32: 3 products.
    """
    result = run_on_backend("jax", _MIXED_VIT_CODE, config=tiny_config)
    bfloat16 = result["dots"].count(["bf16", "bf16"])
    blocks = tiny_config["num_layers"]
    # + the patch projection and its gradient; more if a later XLA keeps those three in bfloat16
    assert bfloat16 >= blocks * 15 + 2, result["dots"]
    assert len(result["dots"]) == blocks * 18 + 2 + 3, result["dots"]
    assert result["cosine"] > 0.999, result["cosine"]


@pytest.mark.parametrize("equation", ["ab,bc->a", "aab,bc->ac", "...b,bc->...c", "ab->a",
                                      "ab,bc,cd->ad"])
def test_einsum_rejects_equations_whose_gradients_are_not_einsums(equation):
    with pytest.raises(ValueError, match="each index of an operand once"):
        einsum(equation, np.ones((2, 3), "float32"), np.ones((3, 4), "float32"))


def test_einsum_is_keras_einsum_in_float32():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 5, 8)).astype("float32"), rng.normal(size=(8, 3, 4)).astype("float32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(einsum("btd,dhk->bhtk", a, b)),
                               np.einsum("btd,dhk->bhtk", a, b), rtol=1e-5, atol=1e-5)
