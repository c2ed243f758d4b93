"""The GPU model-step benchmark (`benchmarks/gpu_step.sh` and `gpu_step.py`) end to end on the CPU:
its `--smoke` run (ViT-Ti/16, batch 2) must complete every planned case; the speeds it measures
here are never part of pass/fail."""

import importlib.util
import json
import os
import subprocess
import sys

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
        assert row["model"] == "ViT-Ti/16" and row["batch_size"] == 2
        assert row["images_per_s"] > 0 and row["first_call_s"] > 0 and row["mfu"] > 0, row
        assert row["ratio_to_timm"] > 0 and row["ratio_to_timm-compile"] is None
        if row["implementation"] == "vit_keras-jax":
            # Counted in the HLO XLA dumped for the step; XLA:CPU has no cuDNN attention.
            assert row["cudnn_fmha_calls"] == 0 and row["jit_compile"] is True, row
    with open(tmp_path / "results.jsonl") as f:
        assert [json.loads(line)["status"] for line in f] == ["ok"] * len(rows)

    table = report["markdown"]
    for name in SMOKE_IMPLEMENTATIONS:
        for mode in ("inference", "train"):
            assert f"| ViT-Ti/16 | 2 | {mode} | {name} |" in table
    assert table in result.stdout and table in (tmp_path / "gpu_step.log").read_text()
    reprinted = subprocess.run([sys.executable, DRIVER, "--from_json", str(tmp_path / "results.json")],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert reprinted.returncode == 0 and reprinted.stdout.strip() == table
