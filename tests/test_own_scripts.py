"""What the README tells a user's own script to set, since `import vit_keras` changes nothing
process-wide and only the apps set up their process: each setting is said where a user looks,
and the triton workaround is run as the README writes it."""

import importlib.machinery
import os
import re
import subprocess
import sys
import warnings

import pytest

from conftest import REPO_ROOT


def _read(path):
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        return f.read()


def _section(text, heading):
    """The text under the markdown `heading` line, up to the next heading of its level or above."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    following = re.search(rf"\n#{{1,{len(level)}}} ", text[start + 1:])
    return text[start:start + 1 + following.start()] if following else text[start:]


@pytest.mark.backend_independent
def test_the_readme_and_the_guide_say_to_set_omp_wait_policy_beside_glibc_tunables():
    """The apps set OMP_WAIT_POLICY=PASSIVE for torch; a script of one's own without it ran the
    digits' prediction 20 times slower on a loaded machine."""
    for text in (_section(_read("README.md"), "## Speed"),
                 _section(_read("docs/guide.md"), "### Your own scripts")):
        assert "GLIBC_TUNABLES=glibc.malloc.arena_max=1" in text
        assert "OMP_WAIT_POLICY=PASSIVE" in text and "torch" in text


# TensorFlow, then a transformers ViT on torch, as someone comparing vit_keras with it on the
# TensorFlow backend does; transformers imports triton on the way.
_TENSORFLOW_THEN_TORCH = """
import keras
import vit_keras
import torch
import transformers

config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, image_size=16, patch_size=4, num_labels=3)
logits = transformers.ViTForImageClassification(config)(torch.zeros(1, 3, 16, 16)).logits
print(tuple(logits.shape), keras.backend.backend())
"""


def _run(code):
    environment = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=environment,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.backend_independent
# On sys.path, not in sys.modules: conftest.py has set sys.modules["triton"] to None.
@pytest.mark.skipif(any(importlib.machinery.PathFinder.find_spec(name) is None
                        for name in ("triton", "torch", "transformers", "tensorflow")),
                    reason="needs TensorFlow, torch, transformers and triton installed")
def test_the_readmes_triton_workaround_lets_tensorflow_and_torch_share_a_process():
    """Asserts the workaround; the crash without it is only reported (a warning), so that the
    day triton or TensorFlow fixes it this test says so instead of failing."""
    blocks = re.findall(r"```python\n(.*?)```", _read("README.md"), re.S)
    workaround = [block for block in blocks if 'sys.modules.setdefault("triton", None)' in block]
    assert len(workaround) == 1, "the README's triton workaround"
    result = _run(workaround[0] + _TENSORFLOW_THEN_TORCH)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["(1,", "3)", "tensorflow"]
    unworked = _run(_TENSORFLOW_THEN_TORCH)
    if unworked.returncode == 0:
        warnings.warn("triton imported after TensorFlow no longer crashes: the README's and "
                      "tests/conftest.py's workaround may go.")
