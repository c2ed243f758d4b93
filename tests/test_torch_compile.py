"""Keras' `jit_compile=True` on the torch backend is `torch.compile` of its step: vit_keras' forward
pass must reach it as one graph. A graph break splits the step, and since every block shares one
`call`, dynamo then compiles the code after the break once per block until its recompile limit (8)
and runs the remaining blocks eagerly (ViT-Ti/16 before: 21 graphs a forward pass, 23 a training
step, slower than eager; `docs/performance.md`).

`torch._dynamo.explain` traces without compiling (no C++ compiler needed); one small model is also
compiled for real, through Keras, and must give the eager logits.
"""

import keras
import numpy as np
import pytest

import vit_keras

pytestmark = [pytest.mark.skipif(keras.backend.backend() != "torch",
                                 reason="torch.compile is the torch backend's jit_compile"),
              pytest.mark.slow]

SMALL = dict(name="small", patch_size=8, num_layers=2, hidden_size=32, num_heads=2, mlp_dim=64)
IMAGE_SIZE = 32
# The slots and switches whose forward passes differ: the paper's ViT, DINOv3's rotary family with
# registers, LayerScale, SwiGLU, RMSNorm and mean pooling, mixed-frequency RoPE under a MAP head.
# Not the hybrids: Keras' torch `ops.pad` (their SAME padding) mutates a dict, after which dynamo
# breaks the graph at the next Keras layer call's `inspect.Signature.bind` (a `mappingproxy` read;
# pytorch/pytorch#147162, fixed upstream by pytorch/pytorch#185908).
MODELS = {
    "vit": (SMALL, {}),
    "rotary_family": (dict(SMALL, rope="dinov3", num_registers=4, layer_scale_init=1e-5,
                           mlp="swiglu", norm="rms_norm", qkv_bias="none", mlp_norm=True,
                           patch_norm=True), {"classifier": "gap"}),
    "mixed_rope_map": (dict(SMALL, rope="mixed", position_embedding="none"), {"classifier": "map"}),
}


def _build(name, dtype_policy=None):
    config, arguments = MODELS[name]
    keras.utils.set_random_seed(0)
    return vit_keras.build_model(config, image_size=IMAGE_SIZE, num_classes=5,
                                 dtype=dtype_policy, **arguments)


def _images(batch=2):
    import torch  # pylint: disable=import-outside-toplevel
    return torch.from_numpy(
        np.random.default_rng(0).uniform(0, 255, (batch, IMAGE_SIZE, IMAGE_SIZE, 3)).astype("float32"))


def _breaks(explanation):
    return [reason.reason.splitlines()[0] for reason in explanation.break_reasons]


@pytest.mark.parametrize("name", MODELS)
def test_the_forward_pass_is_one_graph(name):
    import torch  # pylint: disable=import-outside-toplevel
    torch._dynamo.reset()
    model = _build(name, "mixed_bfloat16" if name == "vit" else None)
    explanation = torch._dynamo.explain(lambda images: model(images, training=False))(_images())
    assert explanation.graph_break_count == 0, _breaks(explanation)
    assert explanation.graph_count == 1


def test_kerass_training_step_breaks_only_at_its_backward_call():
    """Keras' torch trainer calls `loss.backward()` inside its step, which dynamo does not trace:
    the forward pass and loss compile as one graph, the gradient update as another."""
    import torch  # pylint: disable=import-outside-toplevel
    torch._dynamo.reset()
    model = _build("vit")
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images, labels = _images(), torch.tensor([1, 3])
    model.train_on_batch(images, labels)  # the optimizer's variables, built eagerly
    explanation = torch._dynamo.explain(model.train_step)((images, labels, None))
    breaks = _breaks(explanation)
    assert len(breaks) == 1 and "backward" in breaks[0], breaks
    assert explanation.graph_count == 2


def test_kerass_compiled_predict_gives_the_eager_logits():
    import torch  # pylint: disable=import-outside-toplevel
    torch._dynamo.reset()
    model = _build("vit")
    images = _images()
    eager = keras.ops.convert_to_numpy(model(images, training=False))
    model.compile(jit_compile=True)
    compiled = model.predict_on_batch(images)
    np.testing.assert_allclose(compiled, eager, rtol=1e-5, atol=1e-5)
