"""The GPU model-step benchmark (`benchmarks/gpu_step.sh` and `gpu_step.py`) end to end on the CPU:
its `--smoke` run (ViT-Ti/16, batch 2 of 32 px) must complete every planned case; the speeds it measures
here are never part of pass/fail."""

import importlib.util
import json
import os
import subprocess
import sys

import keras
import pytest

from conftest import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "gpu_step.sh")
DRIVER = os.path.join(REPO_ROOT, "benchmarks", "gpu_step.py")
MISSING = [name for name in ("timm", "torch", "jax") if importlib.util.find_spec(name) is None]
PARITY = ("vit_keras-jax", "vit_keras-torch")
SMOKE_IMPLEMENTATIONS = ("timm", "vit_keras-jax", "vit_keras-torch")


@pytest.mark.slow
@pytest.mark.jax_subprocess
@pytest.mark.skipif(bool(MISSING), reason=f"the benchmark needs {', '.join(MISSING)} "
                                          "(pip install -e .[all,bench])")
def test_gpu_step_smoke_run_completes_every_case(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("KERAS_BACKEND", None)  # each case sets its own
    result = subprocess.run(["bash", SCRIPT, "--smoke", "--commit", "test"], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

    report = json.loads((tmp_path / "results.json").read_text())
    assert report["complete"] and report["machine"]["commit"] == "test"
    rows = report["rows"]
    planned = ({("parity", name, None) for name in ("timm",) + PARITY} | {("gemm", "torch", None)}
               | {("step", name, mode) for name in SMOKE_IMPLEMENTATIONS
                  for mode in ("inference", "train")})
    assert sorted((r["kind"], r["implementation"], str(r["mode"])) for r in rows) == sorted(
        (kind, name, str(mode)) for kind, name, mode in planned)
    for row in rows:
        assert row["status"] == "ok", row
        # "No error or traceback in the log" (the issue): counted in every case's own log.
        assert type(row["error_lines"]) is int and type(row["traceback_lines"]) is int, row
        assert row["error_lines"] == row["traceback_lines"] == 0, row
        assert os.path.isfile(tmp_path / row["log"])
    for row in (r for r in rows if r["kind"] == "parity" and r["implementation"] != "timm"):
        assert row["max_rel"] <= 1e-5 and row["within_tolerance"], row  # float32, on the CPU
        assert row["argmax_agree"] == 1.0
    (gemm,) = [r for r in rows if r["kind"] == "gemm"]
    assert gemm["gemm_size"] == 512 and gemm["tflops"] > 0
    for row in (r for r in rows if r["kind"] == "step"):
        assert row["model"] == "ViT-Ti/16" and row["batch_size"] == 2 and row["image_size"] == 32
        assert row["images_per_s"] > 0 and row["first_call_s"] > 0 and row["mfu"] > 0, row
        assert row["back_to_back_images_per_s"] > 0, row
        assert row["ratio_to_timm"] > 0 and row["ratio_to_timm-compile"] is None
        if row["implementation"] == "vit_keras-jax":
            # Counted in the HLO XLA dumped for the step; XLA:CPU has no cuDNN attention.
            assert row["cudnn_fmha_calls"] == 0 and row["jit_compile"] is True, row
            rate = "stateless" if row["mode"] == "inference" else "fit"
            assert row[f"{rate}_images_per_s"] > 0, row
            assert row[f"{rate}_back_to_back_images_per_s"] > 0, row
            assert set(row["library_paths"]) == {"layer_norm", "mlp_projection",
                                                 "attention_projection", "train_on_batch"}, row
    with open(tmp_path / "results.jsonl") as f:
        assert [json.loads(line)["status"] for line in f] == ["ok"] * len(rows)

    table = report["markdown"]
    for name in SMOKE_IMPLEMENTATIONS:
        for mode in ("inference", "train"):
            assert f"| ViT-Ti/16 | 2 | {mode} | {name} |" in table
    assert "Back to back (the timed steps with one wait at the end)" in table
    assert table in result.stdout and table in (tmp_path / "gpu_step.log").read_text()
    reprinted = subprocess.run([sys.executable, DRIVER, "--from_json", str(tmp_path / "results.json")],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert reprinted.returncode == 0 and reprinted.stdout.strip() == table


def _driver_module():
    sys.path.insert(0, os.path.dirname(DRIVER))
    try:
        return __import__("gpu_step")
    finally:
        sys.path.remove(os.path.dirname(DRIVER))


@pytest.mark.backend_independent("jax")
def test_a_plan_takes_xla_flag_variants_of_jax_and_refuses_unknown_ones():
    gpu_step = _driver_module()
    ((model, batch, implementations),) = gpu_step.parse_plan(
        ["ViT-B/16:256:timm-compile,vit_keras-jax,vit_keras-jax@cublaslt"])
    assert (model, batch) == ("ViT-B/16", 256) and implementations[-1] == "vit_keras-jax@cublaslt"
    ((_, _, combined),) = gpu_step.parse_plan(
        ["ViT-B/16:256:vit_keras-jax@keras_layer_norm+rank3_projections+cublaslt"])
    assert gpu_step.variant_names(combined[0]) == ["keras_layer_norm", "rank3_projections",
                                                   "cublaslt"]
    for wrong in ("vit_keras-jax@no_such_flags", "vit_keras-torch@cublaslt", "timm@cublaslt",
                  "vit_keras-jax@cublaslt+no_such_path", "vit_keras-jax@"):
        with pytest.raises(ValueError, match="XLA flags"):
            gpu_step.parse_plan([f"ViT-B/16:256:{wrong}"])


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the variants are vit_keras-jax's")
def test_a_code_variant_builds_the_model_through_the_earlier_library_paths(monkeypatch):
    """`@keras_layer_norm+rank3_projections+keras_train_on_batch` puts back Keras' LayerNorm,
    layer calls and `train_on_batch`, and the row says which paths the model took (on the test
    machine with the XLA:CPU workarounds off, as on a GPU)."""
    import vit_keras
    from vit_keras.model import attention, backend_ops, vit, xla_cpu

    gpu_step = _driver_module()
    for module, name in ((backend_ops, "choose_layer_norm"), (backend_ops, "choose_projection"),
                         (attention, "matrix_projection"), (vit.ViT, "train_on_batch")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test

    def paths():
        with xla_cpu.set_workarounds(False):
            return gpu_step.library_paths(vit_keras.build_model("ViT-Ti/16", image_size=32,
                                                                num_classes=3))

    assert paths() == {"layer_norm": "_jax_layer_norm", "mlp_projection": "matrix_projection",
                       "attention_projection": "matrix_projection",
                       "train_on_batch": "ViT.train_on_batch"}
    gpu_step.undo_library_paths(["keras_layer_norm", "rank3_projections", "keras_train_on_batch",
                                 "cublaslt"])
    assert paths() == {"layer_norm": "_layer_call", "mlp_projection": "_dense_call",
                       "attention_projection": "<lambda>",
                       "train_on_batch": "JAXTrainer.train_on_batch"}


@pytest.mark.backend_independent("jax")
def test_the_profile_sums_each_kernel_class_per_step_from_a_chrome_trace():
    gpu_step = _driver_module()
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7,
             "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]

    def event(name, us, pid=1, tid=7, **extra):
        return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": 0, "dur": us, **extra}

    jax_trace = meta + [
        event("nvjet_tst_128x256_gemm", 3000), event("cudnn_fmha_fprop", 1000),
        event("loop_convert_fusion_3", 500), event("input_reduce_fusion", 400),
        event("loop_multiply_fusion", 100),
        event("fusion.12", 9999, tid=8),  # the "XLA Ops" line repeats the kernels
        event("PjitFunction(train_step)", 9999, pid=2, tid=3)]  # the host
    table = gpu_step.kernel_table(jax_trace, steps=2)
    assert table["timed"] == "GPU kernels" and table["ms_per_step"] == pytest.approx(2.5)
    assert table["classes_ms"] == {"GEMM": 1.5, "attention": 0.5, "casts": 0.25,
                                   "reductions": 0.2, "other (elementwise)": 0.05}
    assert table["top_kernels_ms"][0] == ["nvjet_tst_128x256_gemm", 1.5, "GEMM"]
    torch_trace = [event("ampere_bf16_s16816gemm", 2000, pid=5, cat="kernel"),
                   event("vectorized_layer_norm_kernel", 1000, pid=5, cat="kernel"),
                   event("aten::addmm", 9999, pid=6, cat="cpu_op")]  # the host's view
    assert gpu_step.kernel_table(torch_trace, steps=1)["classes_ms"] == {"GEMM": 2.0,
                                                                         "LayerNorm": 1.0}
    # A CPU: no kernels, the operations instead.
    assert gpu_step.kernel_table([event("aten::addmm", 2000, pid=6, cat="cpu_op")], steps=1)[
        "timed"] == "CPU operations"
