"""The throughput benchmark runs end to end; its numbers are never part of pass/fail."""

import json
import os
import subprocess
import sys

import keras
import pytest

from conftest import REPO_ROOT, TINY_CONFIG

BENCHMARK = os.path.join(REPO_ROOT, "benchmarks", "throughput.py")


@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_throughput_benchmark_measures_vit_keras_on_a_tiny_model(tmp_path, dtype):
    backend = keras.backend.backend()
    output = tmp_path / "throughput.json"
    command = [sys.executable, BENCHMARK, "--models", json.dumps(TINY_CONFIG), "--image_size", "32",
               "--batch_size", "2", "--implementations", f"vit_keras-{backend}", "--rounds", "1",
               "--steps", "1", "--warmup", "1", "--dtype", dtype, "--json", str(output)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(output.read_text())
    for mode in ("inference", "train"):
        (row,) = [r for r in report["rows"] if r["mode"] == mode]
        assert row["median"] > 0 and 0 < row["median_fraction_of_peak"] < 1
    assert f"| tiny | train | vit_keras-{backend} |" in result.stdout
    assert report["gemm_peak_flops"][backend][0] > 1e8
    (process,) = report["rounds"][0].values()
    assert {run["dtype"] for run in process["runs"]} == {dtype}  # the policy the model was built with


def test_throughput_benchmark_rejects_an_unknown_implementation():
    result = subprocess.run([sys.executable, BENCHMARK, "--implementations", "no_such_peer"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Unknown implementation 'no_such_peer'" in result.stderr
