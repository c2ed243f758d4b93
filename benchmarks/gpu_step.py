r"""The model step on a GPU: timm against vit_keras on Keras' JAX and torch backends (issue 42).

timm eager and through torch.compile, vit_keras on JAX and on torch: the same model, batch,
precision and device, inference and a training step.

    python benchmarks/gpu_step.py --out gpu_step_results           # the issue's table (B/16, L/16)
    python benchmarks/gpu_step.py --out DIR --plan "ViT-L/16:128:timm,vit_keras-jax"
    python benchmarks/gpu_step.py --out DIR --plan "ViT-B/16:256:vit_keras-torch-jit"  # minutes
    python benchmarks/gpu_step.py --out DIR --smoke                # ViT-Ti/16, batch 2, 32 px: CPU
    python benchmarks/gpu_step.py --out DIR --profile --plan \
        "ViT-B/16:256:timm-compile,vit_keras-jax,vit_keras-jax@cublaslt"  # issue 59's A/B
    python benchmarks/gpu_step.py --out DIR --profile vit_keras-jax --artifacts DIR/art --plan \
        "ViT-B/16:256:vit_keras-jax,vit_keras-jax@keras_layer_norm+rank3_projections"
    python benchmarks/gpu_step.py --from_json DIR/results.json     # the table of an earlier run
    bash benchmarks/gpu_step.sh                                    # the device machine's command

Each case runs in its own process, one after the other, each with a timeout (`--case_timeout`)
and all within `--deadline` seconds; a case that fails, times out or has no time left is
recorded as such and the next one runs. The cases, in order:

1. Parity: timm's randomly initialised model (the first `--plan` model) is saved as a state dict
   and loaded into vit_keras (`build_model_from_checkpoint`, normalisation `"inception"`, timm's
   mean = std = 0.5), and vit_keras' float32 logits on JAX and on torch are compared with timm's
   on the same device (TF32 off, JAX at matmul precision "highest"). Relative difference: the
   largest absolute difference over the largest absolute timm logit; the issue's bar is 1e-5.
2. A bfloat16 GEMM (`--gemm_size`³, torch, best of 10 calls): the reference for MFU.
3. For each `--plan` entry and implementation: images/s of inference and of a training step.
   Implementations: `timm` (eager), `timm-compile` (torch.compile of the model), `vit_keras-jax`
   (`jit_compile=True`), `vit_keras-torch` (Keras' torch backend, eager) and
   `vit_keras-torch-jit` (the same with `jit_compile=True`; minutes of compiling, not in the
   default plan), and `vit_keras-jax@VARIANT`: vit_keras-jax with the XLA flags `XLA_VARIANTS`
   names (issue 59's candidates: cuBLASLt, Triton GEMMs off, command buffers off, the
   latency-hiding scheduler) or the library's earlier paths `CODE_VARIANTS` names, joined by
   `+` (`vit_keras-jax@keras_layer_norm+rank3_projections`). vit_keras-jax runs inference and
   training in two processes, since JAX's peak memory cannot be reset; the others reset torch's
   between the two.
4. With `--profile` (run after the GEMM, before the plan's steps): one training step of the
   first plan model on vit_keras-jax (jax.profiler) and timm compiled (torch.profiler),
   `--steps` steps traced after the warm-up: device time
   per step by kernel class (`KERNEL_CLASSES`: attention, GEMM, LayerNorm, GELU, optimizer,
   casts, copies, reductions, the rest), kernels per step and the slowest kernels by name.
   `--profile IMPL ...` profiles only those. `--artifacts DIR` keeps the traces and, for each
   vit_keras-jax case, the optimised HLO of its compiled steps (gzipped): XLA's fusions name
   their kernels, and the HLO's `op_name`s trace each to its layer.

Inputs are random (224 px unless `--image_size`) and already on the device: vit_keras takes NHWC
pixels in [0, 255] (the model normalises them), timm NCHW pixels normalised with mean = std = 0.5.
Both run under bfloat16 mixed precision (`mixed_bfloat16`; `torch.autocast(dtype=torch.bfloat16)`).
Inference is a forward pass (`predict_on_batch`; timm under `torch.inference_mode`); a training
step is forward, sparse cross-entropy from logits, backward and an AdamW update (`train_on_batch`;
timm: fused AdamW on CUDA). Each step is timed to the device's completion: images/s is the batch
over the median of `--steps` steps after `--warmup` untimed ones, of which the first is timed on
its own (the compile time). Peak memory is `torch.cuda.max_memory_allocated` or JAX's
`peak_bytes_in_use` (with `XLA_PYTHON_CLIENT_PREALLOCATE=false`). MFU: images/s x analytic FLOPs
per image (`throughput.forward_flops`, x3 for a training step) over the GEMM's FLOP/s. For
vit_keras-jax the cuDNN fused-attention calls (`__cudnn$fmha*` custom calls) are counted in the
optimised HLO that XLA dumps when it compiles `train_on_batch`'s step and `predict_on_batch`'s
forward pass, and its inference is also timed as a jitted `stateless_call` whose logits stay on the
device (what `predict_on_batch` adds is the difference), and its training step also inside
`model.fit` (as users train: Keras' loop keeps the state between steps, which `train_on_batch`
gathers and assigns back on every call). Each case's stdout and stderr go to `OUT/logs/`; its ERROR
lines (the word ERROR, or absl's `E0123 ...` severity) and tracebacks are counted (the issue asks
for none).

Writes each row as one JSON line to `OUT/results.jsonl` as its case ends (a run starts the file
afresh), and `OUT/results.json` (every row, the machine, the library versions, the commit, the
settings) after every case; prints a markdown table at the end. Exits with status 1 when a case
did not complete or a parity check missed its tolerance. Not part of the test suite's pass/fail
(its `--smoke` run is).

On a GPU machine without network and without Keras (JAX, torch and timm installed), run
`OUT=DIR bash benchmarks/gpu_step.sh` from the repository root: it installs Keras from the wheels
in `.whl/` (kept out of git, e.g. by `.git/info/exclude`), downloaded beforehand for that
machine's Python (3.12 here) with

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl keras==3.15.1 namex==0.1.0 optree==0.20.0

(Keras' other requirements, absl-py, numpy, rich, h5py, ml-dtypes and packaging, and optree's
typing-extensions come with JAX and torch). Nothing here needs TensorFlow.
"""

import argparse
import collections
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from throughput import MODELS, forward_flops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {**MODELS, "ViT-L/16": dict(patch_size=16, hidden_size=1024, mlp_dim=4096, num_heads=16,
                                     num_layers=24)}
TIMM_NAMES = {"ViT-Ti/16": "vit_tiny_patch16_224", "ViT-S/16": "vit_small_patch16_224",
              "ViT-B/16": "vit_base_patch16_224", "ViT-L/16": "vit_large_patch16_224"}
IMPLEMENTATIONS = ("timm", "timm-compile", "vit_keras-jax", "vit_keras-torch", "vit_keras-torch-jit")
PARITY_IMPLEMENTATIONS = ("vit_keras-jax", "vit_keras-torch")
# Issue 59's A/B candidates for XLA's GPU compiler: `vit_keras-jax@NAME` in a --plan runs JAX with
# these flags added to XLA_FLAGS (each in its own process: XLA reads its flags once).
XLA_VARIANTS = {
    "cublaslt": ["--xla_gpu_enable_cublaslt=true"],
    "no_triton_gemm": ["--xla_gpu_enable_triton_gemm=false"],
    "no_command_buffer": ["--xla_gpu_enable_command_buffer="],
    "latency_hiding": ["--xla_gpu_enable_latency_hiding_scheduler=true"],
}
# ... and the library's earlier ways, each undone in that process before the model is built:
# `vit_keras-jax@keras_layer_norm+cublaslt` combines variants.
CODE_VARIANTS = {
    "keras_layer_norm": "Keras' LayerNorm call (autodiff's gradient), not jax_layer_norm's",
    "rank3_projections": "the projections as Keras' layer calls (rank-3 products)",
    "keras_train_on_batch": "Keras' own train_on_batch, its checked round trip of every variable",
}
MODES = ("inference", "train")
PROFILE_IMPLEMENTATIONS = ("vit_keras-jax", "timm-compile")
IMAGE_SIZE = 224  # the issue's; --image_size changes it (the smoke check's is 32)
NUM_CLASSES = 1000
# The plan, and the CPU smoke check's (`--smoke`); a setting given explicitly wins.
DEFAULTS = {"plan": ["ViT-B/16:256:timm,vit_keras-jax,vit_keras-torch,timm-compile",
                 "ViT-L/16:128:timm,vit_keras-jax,vit_keras-torch"],
        "warmup": 3, "steps": 15, "gemm_size": 8192, "parity_images": 8, "image_size": IMAGE_SIZE}
SMOKE_DEFAULTS = {"plan": ["ViT-Ti/16:2:timm,vit_keras-jax,vit_keras-torch"],
         "warmup": 1, "steps": 2, "gemm_size": 512, "parity_images": 2, "image_size": 32}
MIN_CASE_S = 30  # a case is not started with less time than this left before --deadline
# A case prints each of its rows on one line after this prefix; the driver reads them from its log.
ROW_PREFIX = "gpu_step row: "
ERROR_LINE = re.compile(r"\bERROR\b|^E\d{4} ")
TRACEBACK_LINE = "Traceback (most recent call last)"
FUSED_ATTENTION_CALL = re.compile(r"__cudnn\$fmha\w*")


# ------------------------------------------------------------------------------------- the cases

def emit(row):
    """Hands one row to the driver (through this case's log)."""
    print(ROW_PREFIX + json.dumps(row), flush=True)


def random_batch(batch_size, image_size, seed=0):
    """Pixels `(batch, image_size, image_size, 3)` in [0, 255] (float32) and int32 labels of 1000
    classes."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    images = rng.uniform(0, 255, (batch_size, image_size, image_size, 3)).astype("float32")
    return images, rng.integers(0, NUM_CLASSES, (batch_size,)).astype("int32")


def time_steps(step, sync, warmup, steps):
    """Seconds of the first call (compile included) and of each of `steps` calls after `warmup`
    untimed ones (the first included), each to the device's completion (`sync`)."""
    started = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - started
    for _ in range(warmup - 1):
        step()
    sync()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    return first, times


def back_to_back_rate(step, sync, batch_size, steps):
    """images/s of `steps` calls one after the other and one wait at the end, as a training loop
    that does not read its loss every step runs: the host's work for the next call overlaps the
    device's for this one (where the call itself does not wait, as `train_on_batch` does)."""
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return batch_size * steps / (time.perf_counter() - started)


def step_row(spec, first, times, peak_bytes):
    """The measurements of one mode: images/s (median and fastest step), first call, peak memory."""
    median = statistics.median(times)
    return {"images_per_s": spec["batch_size"] / median,
            "images_per_s_best": spec["batch_size"] / min(times), "median_step_s": median,
            "first_call_s": first, "peak_gib": None if peak_bytes is None else peak_bytes / 2**30}


def torch_device():
    import torch  # pylint: disable=import-outside-toplevel

    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(), torch.cuda.synchronize
    return "cpu", platform.processor() or "cpu", lambda: None


def timm_pixels(images, device):
    """NHWC pixels in [0, 255] → timm's input: NCHW, `(x / 255 - 0.5) / 0.5`."""
    import torch  # pylint: disable=import-outside-toplevel

    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(device) / 127.5 - 1.0


def timm_parity_source(spec):
    """Saves timm's random model, the parity pixels and timm's float32 logits into the work folder."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import timm  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device, name, _ = torch_device()
    torch.manual_seed(0)
    model = timm.create_model(TIMM_NAMES[spec["model"]], pretrained=False, num_classes=NUM_CLASSES,
                              img_size=spec["image_size"]).to(device).eval()
    images, _ = random_batch(spec["parity_images"], spec["image_size"], seed=1)
    with torch.no_grad():
        logits = model(timm_pixels(images, device)).float().cpu().numpy()
    torch.save(model.state_dict(), os.path.join(spec["work"], "timm.pth"))
    np.save(os.path.join(spec["work"], "pixels.npy"), images)
    np.save(os.path.join(spec["work"], "logits.npy"), logits)
    emit({"device": name, "timm_architecture": TIMM_NAMES[spec["model"]],
          "images": len(images)})


def vit_keras_parity(spec, backend):
    """vit_keras' float32 logits of timm's weights against timm's (see the module's docstring)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    import vit_keras  # pylint: disable=import-outside-toplevel

    model = vit_keras.build_model_from_checkpoint(
        os.path.join(spec["work"], "timm.pth"), variant=spec["model"],
        timm_architecture=TIMM_NAMES[spec["model"]], normalization="inception",
        image_size=spec["image_size"])
    images = np.load(os.path.join(spec["work"], "pixels.npy"))
    expected = np.load(os.path.join(spec["work"], "logits.npy")).astype("float64")
    if backend == "jax":
        import jax  # pylint: disable=import-outside-toplevel

        device = jax.devices()[0].device_kind
        with jax.default_matmul_precision("highest"):
            logits = model.predict_on_batch(jax.device_put(images))
    else:
        import torch  # pylint: disable=import-outside-toplevel

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        where, device, _ = torch_device()
        logits = model.predict_on_batch(torch.from_numpy(images).to(where))
    difference = np.abs(np.asarray(logits, dtype="float64") - expected).max()
    relative = difference / np.abs(expected).max()
    emit({"device": device, "images": len(images), "max_abs": float(difference),
          "max_rel": float(relative), "tolerance": spec["parity_tolerance"],
          "within_tolerance": bool(relative <= spec["parity_tolerance"]),
          "argmax_agree": float((np.argmax(logits, -1) == expected.argmax(-1)).mean())})


def gemm_case(spec):
    """bfloat16 FLOP/s of a `gemm_size`³ matrix product through torch (cuBLAS on a GPU)."""
    import torch  # pylint: disable=import-outside-toplevel

    device, name, sync = torch_device()
    size = spec["gemm_size"]
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    _, times = time_steps(lambda: a @ b, sync, warmup=3, steps=10)
    emit({"device": name, "gemm_size": size, "dtype": "bfloat16",
          "tflops": 2 * size ** 3 / min(times) / 1e12})


def timm_steps(spec, compiled):
    """timm's model, eager or through torch.compile, on the batch of `spec`: `(model, steps,
    device, name, sync)`, `steps` the inference and training step by mode."""
    import timm  # pylint: disable=import-outside-toplevel
    import torch  # pylint: disable=import-outside-toplevel

    device, name, sync = torch_device()
    torch.manual_seed(0)
    model = timm.create_model(TIMM_NAMES[spec["model"]], pretrained=False, num_classes=NUM_CLASSES,
                              img_size=spec["image_size"]).to(device)
    forward = torch.compile(model) if compiled else model
    images, labels = random_batch(spec["batch_size"], spec["image_size"])
    x, y = timm_pixels(images, device), torch.from_numpy(labels).long().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    cross_entropy = torch.nn.CrossEntropyLoss()

    def inference():
        with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16):
            forward(x)

    def train():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = cross_entropy(forward(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, {"inference": inference, "train": train}, device, name, sync


def timm_case(spec, compiled):
    """timm's model, eager or through torch.compile: each mode of `spec["modes"]` timed."""
    import torch  # pylint: disable=import-outside-toplevel

    model, steps, device, name, sync = timm_steps(spec, compiled)
    for mode in spec["modes"]:
        model.train(mode == "train")
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        first, times = time_steps(steps[mode], sync, spec["warmup"], spec["steps"])
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        emit({"mode": mode, "device": name, **step_row(spec, first, times, peak),
              "back_to_back_images_per_s": back_to_back_rate(
                  steps[mode], sync, spec["batch_size"], spec["steps"])})


def vit_keras_model(spec, jit_compile):
    """vit_keras' model of `spec` under mixed bfloat16, compiled with AdamW and cross-entropy."""
    import keras  # pylint: disable=import-outside-toplevel

    import vit_keras  # pylint: disable=import-outside-toplevel

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = vit_keras.build_model(spec["model"], num_classes=NUM_CLASSES,
                                  image_size=spec["image_size"])
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return model


def optimised_hlo(dump, module):
    """The path of the optimised HLO XLA dumped for `module` (the last one compiled, when there
    are several), or None when none was dumped."""
    paths = sorted(glob.glob(os.path.join(dump, f"*.{module}.*after_optimizations.txt")))
    return paths[-1] if paths else None


def count_fused_attention(dump, module):
    """`{custom call target: count}` of cuDNN fused attention in `optimised_hlo(dump, module)`,
    or None when none was dumped."""
    path = optimised_hlo(dump, module)
    if path is None:
        return None
    with open(path) as f:
        return dict(collections.Counter(FUSED_ATTENTION_CALL.findall(f.read())))


def vit_keras_case(spec, backend):
    """vit_keras on a Keras backend: each mode of `spec["modes"]` timed through
    `predict_on_batch` / `train_on_batch`."""
    dump = None
    # The first call is timed as the compile and the HLO XLA dumps as it compiles is read: a
    # persistent compilation cache (JAX_COMPILATION_CACHE_DIR set by a user) would skip both.
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    if backend == "jax":  # before JAX starts: XLA reads its flags once
        dump = tempfile.mkdtemp(prefix="gpu_step-hlo-")
        names = variant_names(spec["implementation"])
        variant = [flag for name in names for flag in XLA_VARIANTS.get(name, [])]
        os.environ["XLA_FLAGS"] = " ".join([
            os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text",
            "--xla_dump_hlo_module_re=jit_(train_step|predict_forward)", *variant]).strip()
        undo_library_paths(names)
    import keras  # pylint: disable=import-outside-toplevel

    from vit_keras.model.layers import MultiHeadDotProductAttention  # pylint: disable=import-outside-toplevel

    model = vit_keras_model(spec, jit_compile=backend == "jax" or spec["jit_compile"])
    fused = [layer.fused for layer in model._flatten_layers()
             if isinstance(layer, MultiHeadDotProductAttention)]
    images, labels = random_batch(spec["batch_size"], spec["image_size"])
    if backend == "jax":
        import jax  # pylint: disable=import-outside-toplevel

        device = jax.devices()[0]
        name = device.device_kind
        x, y = jax.device_put(images), jax.device_put(labels)

        def sync():  # the steps return host values; the updated weights may still be in flight
            model.trainable_variables[-1].value.block_until_ready()
    else:
        import torch  # pylint: disable=import-outside-toplevel

        where, name, sync = torch_device()
        x, y = torch.from_numpy(images).to(where), torch.from_numpy(labels).to(where)
    row = {"device": name, "keras": keras.__version__, "dtype_policy": model.dtype_policy.name,
           "jit_compile": model.jit_compile,
           "fused_attention_layers": f"{sum(fused)}/{len(fused)}",
           "library_paths": library_paths(model)}
    for mode in spec["modes"]:
        if backend == "torch" and where == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step = (lambda: model.predict_on_batch(x)) if mode == "inference" else (
            lambda: model.train_on_batch(x, y))
        first, times = time_steps(step, sync, spec["warmup"], spec["steps"])
        back_to_back = back_to_back_rate(step, sync, spec["batch_size"], spec["steps"])
        if backend == "jax":
            peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
            calls = count_fused_attention(
                # ViT.predict_on_batch's forward pass (vit_keras.model.jax_predict), Keras' step
                dump, "jit_predict_forward" if mode == "inference" else "jit_train_step")
            extra = {"cudnn_fmha_calls": None if calls is None else sum(calls.values()),
                     "cudnn_fmha_targets": calls}
            if mode == "inference":
                (extra["stateless_images_per_s"],
                 extra["stateless_back_to_back_images_per_s"]) = stateless_forward_rate(
                     model, x, spec)
            else:
                extra["fit_images_per_s"] = fit_step_rate(model, x, y, spec)
                extra["fit_back_to_back_images_per_s"] = fit_step_rate(
                    model, x, y, spec, wait_each_step=False)
        else:
            peak = torch.cuda.max_memory_allocated() if where == "cuda" else None
            extra = {}
        emit({"mode": mode, **row, **step_row(spec, first, times, peak),
              "back_to_back_images_per_s": back_to_back, **extra})
    if dump:
        for module in ("jit_train_step", "jit_predict_forward"):
            path = optimised_hlo(dump, module)
            if path:
                keep_artifact(spec, path, f"hlo-{spec['implementation']}-{spec['model']}-{module}")
        shutil.rmtree(dump, ignore_errors=True)


def library_paths(model):
    """The functions the first encoder block took for its LayerNorms and MLP projections, the
    attention's projection (`vit_keras.model.backend_ops`) and the model's `train_on_batch`
    (`vit_keras.model.jax_train`'s, or Keras'): which variant ran."""
    from vit_keras.model import attention, layers  # pylint: disable=import-outside-toplevel

    block = next(layer for layer in model._flatten_layers()
                 if isinstance(layer, layers.TransformerBlock))
    return {"layer_norm": block._norm.__name__, "mlp_projection": block.mlp._project.__name__,
            "attention_projection": attention.matrix_projection.__name__,
            "train_on_batch": type(model).train_on_batch.__qualname__}


def variant_names(implementation):
    """The variants `vit_keras-jax@a+b` names: `["a", "b"]`."""
    variants = implementation.partition("@")[2]
    return variants.split("+") if variants else []


def undo_library_paths(names):
    """Puts back the library's earlier way for each of `names` in `CODE_VARIANTS`."""
    from vit_keras.model import attention, backend_ops, vit  # pylint: disable=import-outside-toplevel

    if "keras_layer_norm" in names:
        backend_ops.choose_layer_norm = lambda: backend_ops._layer_call  # pylint: disable=protected-access
    if "rank3_projections" in names:
        backend_ops.choose_projection = lambda: backend_ops._dense_call  # pylint: disable=protected-access
        attention.matrix_projection = lambda layer, x: layer(x)
    if "keras_train_on_batch" in names:
        import keras  # pylint: disable=import-outside-toplevel

        vit.ViT.train_on_batch = keras.Model.train_on_batch


def keep_artifact(spec, path, name):
    """With `--artifacts`: `path` gzipped into that folder as NAME (made file-name safe)."""
    if not spec.get("artifacts"):
        return
    import gzip  # pylint: disable=import-outside-toplevel

    os.makedirs(spec["artifacts"], exist_ok=True)
    target = os.path.join(spec["artifacts"], re.sub(r"[^A-Za-z0-9.-]+", "_", name))
    target += ".json.gz" if path.endswith(".json.gz") else os.path.splitext(path)[1] + ".gz"
    with open(path, "rb") as source, (open if path.endswith(".gz") else gzip.open)(target, "wb") as f:
        shutil.copyfileobj(source, f)


def stateless_forward_rate(model, x, spec):
    """images/s of the same forward pass as one jitted `stateless_call` whose logits stay on the
    device: the gap to `predict_on_batch` is what Keras' predict adds (its data handling, the copy
    of the logits to NumPy on every step). Waited for each step, and back to back."""
    import jax  # pylint: disable=import-outside-toplevel

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    forward = jax.jit(lambda t, n, x: model.stateless_call(t, n, x, training=False)[0])
    logits = []

    def step():
        logits[:] = [forward(trainable, non_trainable, x)]

    sync = lambda: logits[0].block_until_ready()  # noqa: E731
    _, times = time_steps(step, sync, spec["warmup"], spec["steps"])
    return (spec["batch_size"] / statistics.median(times),
            back_to_back_rate(step, sync, spec["batch_size"], spec["steps"]))


# A kernel's class by its name, the first pattern that matches (cuBLAS/cuDNN/Triton kernel names,
# XLA's fusions named after their root operation, torch's aten operations on a CPU).
KERNEL_CLASSES = (
    ("attention", r"fmha|flash|attention|sdpa"),
    ("GEMM", r"gemm|matmul|nvjet|cutlass|xmma|cublas|\bdot|addmm|\bmm\b|\bbmm|linear|convolution"),
    ("LayerNorm", r"layer_?norm"),
    ("GELU", r"gelu|\berf|tanh"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("casts", r"convert|_to_copy|\bcast"),
    ("copies", r"copy|transpose|memcpy|memset|concat|\bcat\b|\bpad|slice|gather|scatter"),
    ("reductions", r"reduc|\bsum|\bmean|\bmax"),
)


# Events of XLA's CPU client threads that are its scheduling, not an operation.
CPU_BOOKKEEPING = ("ThreadpoolListener", "ThunkExecutor", "end: ", "SlinkyThreadPool")


def kernel_class(name):
    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other (elementwise)"


def kernel_table(trace, steps, top=40):
    """Device time per step by kernel class and the `top` kernels, from a Chrome trace (torch's
    `export_chrome_trace`, JAX's perfetto trace): on a GPU the kernels of its streams, on a CPU
    the operations XLA's or torch's threads ran (all of them, nested ones too)."""
    names = {}
    for event in trace:
        if event.get("ph") == "M" and event.get("name") in ("process_name", "thread_name"):
            names[(event["name"], event["pid"], event.get("tid"))] = event["args"]["name"]
    def process(event):
        return str(names.get(("process_name", event.get("pid"), None), ""))

    def thread(event):
        return str(names.get(("thread_name", event.get("pid"), event.get("tid")), ""))

    timed = [e for e in trace if e.get("ph") == "X" and e.get("dur")]
    # torch's kernels; JAX's on its GPU's streams (its other lines, "XLA Ops" and "XLA Modules",
    # span the same kernels again).
    kernels = [e for e in timed if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") or (
        "/device:GPU" in process(e) and thread(e).startswith("Stream"))]
    where = "GPU kernels"
    if not kernels:  # a CPU: torch's operators, or the thunks of XLA's CPU client threads
        kernels = [e for e in timed if e.get("cat") == "cpu_op" or (
            thread(e).startswith(("tf_XLAPjRtCpuClient", "tf_XLAEigen"))
            and not e["name"].startswith(CPU_BOOKKEEPING))]
        where = "CPU operations"
    per_kernel = collections.Counter()
    for event in kernels:
        per_kernel[event["name"]] += event["dur"] / 1e3 / steps  # microseconds -> ms per step
    per_class = collections.Counter()
    for name, ms in per_kernel.items():
        per_class[kernel_class(name)] += ms
    return {"timed": where, "ms_per_step": sum(per_kernel.values()),
            "kernels_per_step": round(len(kernels) / steps, 1),
            "classes_ms": {k: round(v, 3) for k, v in per_class.most_common()},
            "top_kernels_ms": [[name[:120], round(ms, 3), kernel_class(name)]
                               for name, ms in per_kernel.most_common(top)]}


def read_trace(path):
    import gzip  # pylint: disable=import-outside-toplevel

    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def profile_case(spec):
    """One training step's kernels, by class and the slowest, of vit_keras on JAX (jax.profiler)
    or of timm compiled (torch.profiler): `spec["steps"]` steps traced after the warm-up."""
    steps = spec["steps"]
    folder = tempfile.mkdtemp(prefix="gpu_step-profile-")
    if spec["implementation"] == "vit_keras-jax":
        import jax  # pylint: disable=import-outside-toplevel

        model = vit_keras_model(spec, jit_compile=True)
        images, labels = random_batch(spec["batch_size"], spec["image_size"])
        x, y = jax.device_put(images), jax.device_put(labels)
        for _ in range(spec["warmup"]):
            model.train_on_batch(x, y)
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(steps):
                model.train_on_batch(x, y)
            model.trainable_variables[-1].value.block_until_ready()
        (path,) = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
    else:
        import torch  # pylint: disable=import-outside-toplevel

        model, timm_step, device, _, sync = timm_steps(spec, compiled=True)
        model.train()
        for _ in range(spec["warmup"]):
            timm_step["train"]()
        sync()
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(steps):
                timm_step["train"]()
            sync()
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
    emit({"mode": "train", "steps": steps, **kernel_table(read_trace(path), steps)})
    keep_artifact(spec, path, f"profile-{spec['implementation']}-{spec['model']}")
    shutil.rmtree(folder, ignore_errors=True)


def fit_step_rate(model, x, y, spec, wait_each_step=True):
    """images/s of the same training step inside `model.fit`, as users train: Keras' loop keeps
    the state between steps, where `train_on_batch` gathers every variable (optimizer slots
    included) before each step and assigns it back after. Each step is timed from one batch end
    to the next, once its loss is on the host; with `wait_each_step=False` the timed steps run
    back to back, waited for once after the warm-up and once at the end."""
    import jax  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel

    ends = []
    last_warmup = spec["warmup"] - 1

    class StepEnds(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if wait_each_step or batch in (last_warmup, last_warmup + spec["steps"]):
                jax.block_until_ready(logs)
                ends.append(time.perf_counter())

    def batches():  # as train_on_batch hands them to the step, whose compiled program fit reuses
        while True:
            yield x, y, None

    model.fit(batches(), steps_per_epoch=spec["warmup"] + spec["steps"], epochs=1, verbose=0,
              callbacks=[StepEnds()])
    if not wait_each_step:
        return spec["batch_size"] * spec["steps"] / (ends[-1] - ends[0])
    steps = [b - a for a, b in zip(ends, ends[1:])][-spec["steps"]:]
    return spec["batch_size"] / statistics.median(steps)


def run_case(spec):
    """The case `spec` describes (a dict from `plan_cases`), in this process."""
    # As on the GPU machine, which has no TensorFlow: nothing here needs it, but Keras'
    # set_random_seed imports it where it is installed (and TensorFlow imported before torch's
    # triton crashes the process, see README.md).
    sys.modules.setdefault("tensorflow", None)
    implementation = spec["implementation"]
    if implementation.startswith("vit_keras-"):
        # Before Keras is imported; vit_keras-torch-jit is Keras' torch backend too.
        os.environ["KERAS_BACKEND"] = implementation.partition("@")[0].split("-")[1]
    if spec["kind"] == "gemm":
        gemm_case(spec)
    elif spec["kind"] == "profile":
        profile_case(spec)
    elif spec["kind"] == "parity" and implementation == "timm":
        timm_parity_source(spec)
    elif spec["kind"] == "parity":
        vit_keras_parity(spec, os.environ["KERAS_BACKEND"])
    elif implementation.startswith("timm"):
        timm_case(spec, compiled=implementation == "timm-compile")
    else:
        vit_keras_case(spec, os.environ["KERAS_BACKEND"])


# ------------------------------------------------------------------------------------ the driver

def parse_plan(entries):
    """[(model, batch size, [implementations])] of "MODEL:BATCH:IMPL,IMPL,..." entries."""
    plan = []
    for entry in entries:
        try:
            model, batch_size, implementations = entry.split(":")
            batch_size = int(batch_size)
        except ValueError:
            raise ValueError(f"--plan entry {entry!r} is not MODEL:BATCH:IMPL,IMPL,...") from None
        implementations = implementations.split(",")
        unknown = [i for i in implementations if i not in IMPLEMENTATIONS and not (
            i.partition("@")[0] == "vit_keras-jax" and variant_names(i) and all(
                name in XLA_VARIANTS or name in CODE_VARIANTS for name in variant_names(i)))]
        if model not in TIMM_NAMES or unknown or batch_size < 1:
            raise ValueError(f"--plan entry {entry!r}: models are {list(TIMM_NAMES)}, "
                             f"implementations {list(IMPLEMENTATIONS)} (vit_keras-jax@VARIANT "
                             f"with XLA flags: {list(XLA_VARIANTS)}, or earlier library "
                             f"paths: {list(CODE_VARIANTS)}, joined by +), batch sizes positive.")
        plan.append((model, batch_size, implementations))
    return plan


def plan_cases(args, work):
    """Every case of the run, in order: the parity cases, the GEMM, the plan's steps. A case is the
    dict `run_case` takes (`kind`, `implementation`, `model`, `batch_size`, the `modes` it reports
    a row for, None for the parity and GEMM cases' one row, ...), with a `name` and its `log`."""
    plan = parse_plan(args.plan)
    common = {"work": work, "warmup": args.warmup, "steps": args.steps, "jit_compile": False,
              "image_size": args.image_size,
              "artifacts": args.artifacts and os.path.abspath(args.artifacts)}
    parity_model = plan[0][0]
    cases = [dict(common, kind="parity", implementation=implementation, model=parity_model,
                  parity_images=args.parity_images, parity_tolerance=args.parity_tolerance,
                  modes=[None], batch_size=args.parity_images)
             for implementation in ("timm",) + PARITY_IMPLEMENTATIONS if not args.no_parity]
    cases.append(dict(common, kind="gemm", implementation="torch", model=None, batch_size=None,
                      gemm_size=args.gemm_size, modes=[None]))
    if args.profile is not None:  # the first step: before the steps a deadline may cut
        model, batch_size, _ = plan[0]
        cases.extend(dict(common, kind="profile", implementation=implementation, model=model,
                          batch_size=batch_size, modes=["train"])
                     for implementation in args.profile or PROFILE_IMPLEMENTATIONS)
    for model, batch_size, implementations in plan:
        for implementation in implementations:
            # JAX's peak memory cannot be reset: its training step gets a process of its own.
            per_process = [[mode] for mode in MODES] if implementation.startswith(
                "vit_keras-jax") else [list(MODES)]
            for modes in per_process:
                cases.append(dict(common, kind="step", implementation=implementation, model=model,
                                  batch_size=batch_size, modes=modes,
                                  jit_compile=implementation == "vit_keras-torch-jit"))
    for case in cases:
        case["name"] = " ".join(str(part) for part in (
            case["kind"], case["implementation"], case["model"], *case["modes"]) if part)
        case["log"] = os.path.join("logs", re.sub(r"[^A-Za-z0-9.-]+", "_", case["name"]) + ".log")
    return cases


def count_log_lines(text):
    """ERROR lines (the word, or absl's error severity `E0123 ...`) and tracebacks in a log."""
    lines = text.splitlines()
    errors = [line for line in lines if ERROR_LINE.search(line)]
    return {"error_lines": len(errors), "traceback_lines": sum(TRACEBACK_LINE in line for line in lines),
            "error_line_samples": [line[:300] for line in errors[:3]]}


def run_process(case, args, timeout):
    """Runs `case` in a new process (its own process group, killed whole on timeout; torch.compile
    starts workers), its output into its log. Returns (status, seconds, log text)."""
    path = os.path.join(args.out, case["log"])
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    spec = {k: v for k, v in case.items() if k not in ("name", "log")}
    command = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(spec)]
    started = time.perf_counter()
    with open(path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                   start_new_session=True)
        try:
            status = "ok" if process.wait(timeout=timeout) == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = "timeout"
    with open(path, errors="replace") as log:
        return status, time.perf_counter() - started, log.read()


def case_rows(case, status, seconds, text, timeout):
    """The rows of a finished case: those it reported, and a failure row for each one it did not."""
    reported = {}
    for line in text.splitlines():
        if line.startswith(ROW_PREFIX):
            row = json.loads(line[len(ROW_PREFIX):])
            reported[row.get("mode")] = row
    tail = [line for line in text.splitlines() if line.strip() and not line.startswith(ROW_PREFIX)]
    reason = {"failed": "exit status not 0", "timeout": f"after {timeout:.0f} s",
              "ok": "no result reported"}[status]
    rows = []
    for mode in case["modes"]:
        row = {"kind": case["kind"], "implementation": case["implementation"],
               "model": case["model"], "mode": mode, "batch_size": case["batch_size"],
               "image_size": case["image_size"]}
        if mode in reported:
            row.update(reported[mode], status="ok")
        else:  # the log's last line says why, mostly (an exception, an out-of-memory error)
            row.update(status=status if status != "ok" else "failed",
                       error=f"{reason}: {tail[-1][:200]}" if tail else reason, log_tail=tail[-6:])
        row.update(count_log_lines(text), process_s=seconds, log=case["log"])
        rows.append(row)
    return rows


def skipped_rows(case):
    return [{"kind": case["kind"], "implementation": case["implementation"],
             "model": case["model"], "mode": mode, "batch_size": case["batch_size"],
             "image_size": case["image_size"], "status": "skipped",
             "error": "no time left before --deadline"}
            for mode in case["modes"]]


def git_commit():
    try:
        result = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode:
        return None
    return result.stdout.strip() or None


def machine(args):
    """The GPU (nvidia-smi), the library versions, the measured commit and the date."""
    gpus = None
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                 "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
        if result.returncode == 0:
            gpus = [dict(zip(("name", "driver", "memory"), (p.strip() for p in line.split(","))))
                    for line in result.stdout.strip().splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    versions = {}
    for package in ("jax", "jaxlib", "torch", "timm", "keras", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"gpus": gpus, "cpu": platform.processor(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "versions": versions,
            "commit": args.commit or git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def summarize(rows):
    """The rows with the MFU and the ratios to timm eager and timm compiled of each step row."""
    gemm = next((r["tflops"] for r in rows if r["kind"] == "gemm" and r["status"] == "ok"), None)
    rate = {(r["implementation"], r["model"], r["mode"]): r["images_per_s"]
            for r in rows if r["kind"] == "step" and r["status"] == "ok"}
    summarized = []
    for row in rows:
        row = dict(row)
        if row["kind"] == "step" and row["status"] == "ok":
            work = forward_flops(SHAPES[row["model"]], row.get("image_size", IMAGE_SIZE),
                                 NUM_CLASSES) * (
                3 if row["mode"] == "train" else 1)
            row["mfu"] = gemm and row["images_per_s"] * work / (gemm * 1e12)
            for baseline in ("timm", "timm-compile"):
                base = rate.get((baseline, row["model"], row["mode"]))
                row[f"ratio_to_{baseline}"] = base and row["images_per_s"] / base
        summarized.append(row)
    return summarized


def _number(value, digits):
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report):
    """The run's table (one line per step row) and the parity, GEMM and machine lines under it."""
    rows = summarize(report["rows"])
    about = report["machine"]
    gpu = ", ".join(f"{g['name']} (driver {g['driver']})" for g in about["gpus"] or ()) or (
        f"no GPU ({about['cpu'] or 'CPU'}, {about['cpus']} cores)")
    versions = ", ".join(f"{k} {v}" for k, v in about["versions"].items() if v)
    lines = [f"{gpu}; {versions}; commit {about['commit'] or 'unknown'}; {about['date']}. "
             f"{report['settings'].get('image_size', IMAGE_SIZE)} px images, bfloat16 mixed "
             f"precision, inputs on the device; images/s: median of "
             f"{report['settings']['steps']} steps after {report['settings']['warmup']} warm-up.",
             "",
             "| model | batch | mode | implementation | images/s | x timm | x timm compiled "
             "| peak GiB | first call s | MFU | cuDNN fMHA calls | ERROR lines / tracebacks |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if row["kind"] != "step":
            continue
        head = f"| {row['model']} | {row['batch_size']} | {row['mode']} | {row['implementation']} |"
        log = (f"{row['error_lines']} / {row['traceback_lines']}" if "error_lines" in row else "-")
        if row["status"] != "ok":
            lines.append(f"{head} {row['status']}: {row['error']} | | | | | | | {log} |")
            continue
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        lines.append(
            f"{head} {row['images_per_s']:.1f} | {_number(row['ratio_to_timm'], 2)} | "
            f"{_number(row['ratio_to_timm-compile'], 2)} | {_number(row['peak_gib'], 2)} | "
            f"{row['first_call_s']:.1f} | {mfu} | {_number(row.get('cudnn_fmha_calls'), 0)} | "
            f"{log} |")
    back_to_back = [f"{row['implementation']} {row['model']} {row['mode']} "
                    f"{row['back_to_back_images_per_s']:.1f}" for row in rows
                    if row["kind"] == "step" and row.get("back_to_back_images_per_s")]
    if back_to_back:
        lines += ["", "Back to back (the timed steps with one wait at the end), images/s: "
                  + "; ".join(back_to_back) + "."]
    lines.append("")
    for row in rows:
        if row["kind"] == "parity" and row["implementation"] != "timm":
            if row["status"] != "ok":
                lines.append(f"Parity {row['implementation']}: {row['status']}: {row['error']}.")
                continue
            verdict = "within" if row["within_tolerance"] else "OUTSIDE"
            lines.append(
                f"Parity {row['implementation']} against timm ({row['model']}, float32 logits of "
                f"{row['images']} images): max relative difference {row['max_rel']:.2e} (max "
                f"absolute {row['max_abs']:.2e}), {verdict} the tolerance {row['tolerance']:.0e}; "
                f"argmax agrees on {100 * row['argmax_agree']:.0f}%; ERROR lines / tracebacks "
                f"{row['error_lines']} / {row['traceback_lines']}.")
        elif row.get("stateless_images_per_s") and row["status"] == "ok":
            lines.append(
                f"{row['implementation']} {row['model']} inference as a jitted stateless_call, "
                f"logits left on the device: {row['stateless_images_per_s']:.1f} images/s, "
                f"{_number(row.get('stateless_back_to_back_images_per_s'), 1)} back to back "
                f"(predict_on_batch: {row['images_per_s']:.1f}).")
        elif row.get("fit_images_per_s") and row["status"] == "ok":
            lines.append(
                f"{row['implementation']} {row['model']} training inside model.fit: "
                f"{row['fit_images_per_s']:.1f} images/s, "
                f"{_number(row.get('fit_back_to_back_images_per_s'), 1)} back to back "
                f"(train_on_batch: {row['images_per_s']:.1f}).")
        elif row["kind"] == "profile":
            if row["status"] != "ok":
                lines.append(f"Profile {row['implementation']}: {row['status']}: {row['error']}.")
                continue
            classes = ", ".join(f"{name} {ms:.2f}" for name, ms in row["classes_ms"].items())
            slowest = "; ".join(f"{name} {ms:.2f}" for name, ms, _ in row["top_kernels_ms"][:8])
            lines.append(
                f"Profile of {row['implementation']}'s {row['model']} training step "
                f"({row['timed']}, ms per step, {row['ms_per_step']:.2f} in all): {classes}. "
                f"Slowest: {slowest}.")
        elif row["kind"] == "gemm":
            lines.append(
                f"bfloat16 GEMM {row.get('gemm_size', '')}³ (torch, best of 10): "
                f"{row['tflops']:.1f} TFLOP/s, the MFU reference." if row["status"] == "ok" else
                f"bfloat16 GEMM: {row['status']}: {row['error']} (no MFU).")
        elif row["kind"] == "parity" and row["status"] != "ok":
            lines.append(f"Parity source (timm): {row['status']}: {row['error']}.")
    return "\n".join(lines)


def write_report(args, about, rows, complete):
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "machine": about, "complete": complete,
              "settings": {k: v for k, v in vars(args).items() if k not in ("case", "from_json")},
              "rows": rows}
    report["markdown"] = markdown(report)
    report["rows"] = summarize(rows)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def drive(args):
    """Runs every case within the deadline, writing the rows as they come; returns the exit status."""
    started = time.perf_counter()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    jsonl = os.path.join(args.out, "results.jsonl")
    open(jsonl, "w").close()
    about, rows = machine(args), []
    with tempfile.TemporaryDirectory(prefix="gpu_step-") as work:
        for case in plan_cases(args, work):
            left = args.deadline - (time.perf_counter() - started)
            if left < MIN_CASE_S:
                new = skipped_rows(case)
                print(f"# {case['name']}: skipped ({left:.0f} s left)", flush=True)
            else:
                timeout = min(args.case_timeout, left)
                status, seconds, text = run_process(case, args, timeout)
                new = case_rows(case, status, seconds, text, timeout)
                print(f"# {case['name']}: {status}, {seconds:.0f} s", flush=True)
            rows.extend(new)
            with open(jsonl, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in new)
            write_report(args, about, rows, complete=False)
    report = write_report(args, about, rows, complete=True)
    print(f"\n# {time.perf_counter() - started:.0f} s in all\n")
    print(report["markdown"])
    missed = [r for r in rows if r["status"] != "ok" or not r.get("within_tolerance", True)]
    return 1 if missed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for results.jsonl, results.json and logs/")
    parser.add_argument("--plan", nargs="+", metavar="MODEL:BATCH:IMPL,...",
                        help=f"models ({', '.join(TIMM_NAMES)}), batch sizes and implementations "
                             f"({', '.join(IMPLEMENTATIONS)}); the first model is also the parity "
                             f"check's. Default: {' '.join(DEFAULTS['plan'])}")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick check that runs on a CPU too: --plan {plan[0]} on "
                             "{image_size} px images, {warmup} warm-up and {steps} timed steps, "
                             "a {gemm_size}³ GEMM, {parity_images} parity images, unless "
                             "given".format(**SMOKE_DEFAULTS))
    parser.add_argument("--warmup", type=int, help="untimed steps, the first (compile) timed apart "
                        f"(default {DEFAULTS['warmup']})")
    parser.add_argument("--steps", type=int, help=f"timed steps (default {DEFAULTS['steps']})")
    parser.add_argument("--gemm_size", type=int,
                        help="side of the bfloat16 GEMM, the MFU reference "
                             f"(default {DEFAULTS['gemm_size']})")
    parser.add_argument("--parity_images", type=int,
                        help=f"images of the parity check (default {DEFAULTS['parity_images']})")
    parser.add_argument("--image_size", type=int,
                        help=f"images' side in pixels (default {DEFAULTS['image_size']})")
    parser.add_argument("--parity_tolerance", type=float, default=1e-5,
                        help="largest relative logit difference the parity check accepts")
    parser.add_argument("--profile", nargs="*", choices=PROFILE_IMPLEMENTATIONS,
                        help="profile one training step of the first --plan model on these "
                             f"(none named: {' and '.join(PROFILE_IMPLEMENTATIONS)}) before the "
                             "plan: device time per kernel class and the slowest kernels")
    parser.add_argument("--artifacts", metavar="DIR",
                        help="keep the profiles' traces and vit_keras-jax's optimised HLO "
                             "(gzipped) in DIR")
    parser.add_argument("--no_parity", action="store_true",
                        help="leave out the parity cases (a quick re-measure of the steps)")
    parser.add_argument("--case_timeout", type=float, default=240, help="seconds per case")
    parser.add_argument("--deadline", type=float, default=450,
                        help="seconds for the whole run: no case starts later than "
                             f"{MIN_CASE_S} s before it, none runs past it")
    parser.add_argument("--commit", help="the measured commit (default: git rev-parse HEAD)")
    parser.add_argument("--from_json", metavar="PATH",
                        help="measure nothing: print the table of an earlier run's results.json")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the driver's: run one case (JSON)
    args = parser.parse_args()
    if args.case:
        run_case(json.loads(args.case))
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            print(markdown(json.load(f)))
        return 0
    if not args.out:
        parser.error("--out is required (or --from_json)")
    for key, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.warmup, args.steps, args.gemm_size, args.parity_images, args.image_size) < 1:
        parser.error("--warmup, --steps, --gemm_size, --parity_images and --image_size must be "
                     "at least 1")
    try:
        parse_plan(args.plan)
    except ValueError as error:
        parser.error(str(error))
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
