"""The benchmarks run end to end on tiny models; their numbers are never part of pass/fail."""

import argparse
import json
import os
import subprocess
import sys

import keras
import pytest

from conftest import REPO_ROOT, TINY_CONFIG

BENCHMARK = os.path.join(REPO_ROOT, "benchmarks", "throughput.py")
PRODUCTS = os.path.join(REPO_ROOT, "benchmarks", "products.py")


def _benchmark_module(name):
    sys.path.insert(0, os.path.dirname(BENCHMARK))
    try:
        return __import__(name)
    finally:
        sys.path.remove(os.path.dirname(BENCHMARK))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
def test_throughput_benchmark_measures_vit_keras_on_a_tiny_model(tmp_path, dtype):
    backend = keras.backend.backend()
    # On torch, float32 runs Keras' jit_compile=True (torch.compile; its inference alone: compiling
    # the training step takes 40 s), mixed bfloat16 eagerly.
    compiled = backend != "torch" or dtype == "float32"
    implementation = f"vit_keras-{backend}" + ("-jit" if backend == "torch" and compiled else "")
    modes = ["inference"] if implementation.endswith("-jit") else ["inference", "train"]
    output = tmp_path / "throughput.json"
    command = [sys.executable, BENCHMARK, "--models", json.dumps(TINY_CONFIG), "--image_size", "32",
               "--batch_size", "2", "--implementations", implementation, "--rounds", "1",
               "--steps", "1", "--warmup", "1", "--dtype", dtype, "--modes", *modes,
               "--json", str(output)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(output.read_text())
    for mode in modes:
        (row,) = [r for r in report["rows"] if r["mode"] == mode]
        # No timing bound: the bounds are physical (a measured time is positive, and no step can
        # beat the GEMM peak the same script measured), so a loaded machine cannot fail them.
        assert row["median"] > 0 and 0 < row["median_fraction_of_peak"] < 1
    assert f"| tiny | {modes[-1]} | {implementation} |" in result.stdout
    assert report["gemm_peak_flops"][backend][0] > 1e8
    (process,) = report["rounds"][0].values()
    assert {run["dtype"] for run in process["runs"]} == {dtype}  # the policy the model was built with
    assert {run["jit_compile"] for run in process["runs"]} == {compiled}
    assert all(run["page_faults_per_step"] >= 0 for run in process["runs"])


@pytest.mark.slow
def test_throughput_benchmark_runs_jax_data_parallel_over_cpu_devices(tmp_path):
    """`-dp2` runs a JAX implementation over 2 XLA CPU devices; other backends have no such mode."""
    backend = keras.backend.backend()
    output = tmp_path / "throughput.json"
    command = [sys.executable, BENCHMARK, "--models", json.dumps(TINY_CONFIG), "--image_size", "32",
               "--batch_size", "4", "--implementations", f"vit_keras-{backend}-dp2", "--rounds",
               "1", "--steps", "1", "--warmup", "1", "--modes", "train", "--json", str(output)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    if backend != "jax":
        assert result.returncode == 2
        assert f"'vit_keras-{backend}-dp2': -dpN needs a JAX implementation" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    (process,) = json.loads(output.read_text())["rounds"][0].values()
    (run,) = process["runs"]
    assert run["devices"] == 2 and run["images_per_s"] > 0
    assert "| tiny | train | vit_keras-jax-dp2 |" in result.stdout


@pytest.mark.slow
def test_throughput_benchmark_feeds_models_of_dynamic_image_size_another_size(tmp_path):
    backend = keras.backend.backend()
    output = tmp_path / "throughput.json"
    implementations = [f"vit_keras-{backend}-dynamic", "timm-dynamic"]
    command = [sys.executable, BENCHMARK, "--models", json.dumps(TINY_CONFIG), "--image_size", "48",
               "--dynamic_built_size", "32", "--batch_size", "2", "--implementations",
               *implementations, "--rounds", "1", "--steps", "1", "--warmup", "1", "--modes",
               "inference", "--json", str(output)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    processes = json.loads(output.read_text())["rounds"][0]
    assert sorted(processes) == sorted(implementations)
    for process in processes.values():
        (run,) = process["runs"]
        assert run["dynamic_built_size"] == 32 and run["images_per_s"] > 0
    assert f"| tiny | inference | vit_keras-{backend}-dynamic |" in result.stdout


@pytest.mark.slow
@pytest.mark.backend_independent
def test_throughput_benchmark_measures_two_commits_side_by_side(tmp_path):
    """`--commits HEAD .`: one process per commit and round, each importing its commit's vit_keras
    (HEAD from a temporary git worktree, `.` from the checkout), and the worktree is gone after."""
    backend = keras.backend.backend()
    output = tmp_path / "throughput.json"
    command = [sys.executable, BENCHMARK, "--models", json.dumps(TINY_CONFIG), "--image_size", "32",
               "--batch_size", "2", "--implementations", f"vit_keras-{backend}", "--rounds", "1",
               "--steps", "1", "--warmup", "1", "--modes", "train", "--commits", "HEAD", ".",
               "--json", str(output)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(output.read_text())
    sources = {name: process["runs"][0]["source"] for name, process in report["rounds"][0].items()}
    assert set(sources) == {f"vit_keras-{backend}@HEAD", f"vit_keras-{backend}@."}
    assert os.path.samefile(sources[f"vit_keras-{backend}@."], REPO_ROOT)
    worktree = sources[f"vit_keras-{backend}@HEAD"]
    assert not os.path.exists(worktree) and worktree != REPO_ROOT
    listed = subprocess.run(["git", "-C", REPO_ROOT, "worktree", "list"], capture_output=True,
                            text=True, check=True).stdout
    assert worktree not in listed
    for name in sources:
        assert f"| tiny | train | {name} |" in result.stdout


def test_throughput_benchmark_rejects_devices_that_do_not_divide_the_batch():
    result = subprocess.run([sys.executable, BENCHMARK, "--batch_size", "8", "--implementations",
                             "vit_keras-jax-dp3"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "'vit_keras-jax-dp3': 3 devices must be at least 1 and divide --batch_size 8" in (
        result.stderr)


@pytest.mark.backend_independent
def test_throughput_benchmark_rejects_an_unknown_implementation():
    result = subprocess.run([sys.executable, BENCHMARK, "--implementations", "no_such_peer"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Unknown implementation 'no_such_peer'" in result.stderr


@pytest.mark.backend_independent
def test_throughput_report_gives_the_fraction_of_peak_for_all_steps_and_for_the_fastest():
    throughput = _benchmark_module("throughput")
    config = {**throughput.MODELS["ViT-Ti/16"], "name": "ViT-Ti/16"}
    args = argparse.Namespace(image_size=224, modes=["inference"], implementations=["timm"],
                              batch_size=8)
    flops = throughput.forward_flops(config, 224)
    peak = 10 * flops  # 10 images/s would be 100% of it
    rounds = [{"timm": {"peak_flops": peak, "runs": [{
        "model": "ViT-Ti/16", "mode": "inference", "batch_size": 8, "first_call_s": 1.0,
        "step_s": steps, "images_per_s": 8 * len(steps) / sum(steps)}]}}
        for steps in ([1.0, 2.0, 1.0], [2.0, 2.0, 1.6])]
    (row,) = throughput.summarize(rounds, [config], args)
    assert row["fraction_of_peak"] == pytest.approx([8 * 3 / 4.0 / 10, 8 * 3 / 5.6 / 10])
    assert row["best_step_fraction_of_peak"] == pytest.approx([0.8, 0.5])
    assert row["median_best_step_fraction_of_peak"] == pytest.approx(0.65)
    table = throughput.markdown([row], {"torch": [peak]}, {}, [], argparse.Namespace(
        batch_size=8, image_size=224, dtype="float32", rounds=2, steps=3, warmup=2))
    assert "| 51% / 65% |" in table


@pytest.mark.backend_independent
def test_throughput_benchmark_reprints_an_earlier_run_from_its_json():
    earlier = os.path.join(REPO_ROOT, "benchmarks", "results", "throughput-cpu2-2026-11-25.json")
    result = subprocess.run([sys.executable, BENCHMARK, "--from_json", earlier], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(earlier) as f:
        old_table = json.load(f)["markdown"]
    # The table is recomputed from the stored rounds' step times, not copied: the same numbers.
    old_row = next(line for line in old_table.splitlines() if "| ViT-B/16 | inference | timm |" in line)
    new_row = next(line for line in result.stdout.splitlines()
                   if "| ViT-B/16 | inference | timm |" in line)
    assert new_row == old_row


@pytest.mark.backend_independent
def test_products_of_a_block_add_up_to_the_forward_flops_of_a_layer():
    throughput, products = _benchmark_module("throughput"), _benchmark_module("products")
    config = {**throughput.MODELS["ViT-Ti/16"], "name": "ViT-Ti/16"}
    forward = [products.flops(sizes) for name, _, sizes in products.products(config, 8, 224)
               if name not in ("dV = Pᵀ·dO (and dK)", "MLP-in weight gradient")]
    d, n = config["hidden_size"], 196
    outside_blocks = 2 * n * 16 * 16 * 3 * d + 2 * d * 1000  # patch embedding and head
    assert (sum(forward) * config["num_layers"] + 8 * outside_blocks
            == 8 * throughput.forward_flops(config, 224))


@pytest.mark.slow
def test_products_benchmark_measures_each_product_on_all_cores_and_on_one(tmp_path):
    library = keras.backend.backend()
    output = tmp_path / "products.json"
    command = [sys.executable, PRODUCTS, "--models", json.dumps(TINY_CONFIG),
               "--image_size", "16", "--batch_size", "2", "--libraries", library, "--rounds", "1",
               "--repeats", "2", "--json", str(output)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (model,) = json.loads(output.read_text())["models"].values()
    assert len(model["products"]) == 8
    for rates in model["flops_per_s"].values():
        assert len(rates) == 8 and min(rates) > 0
    assert "| q·kᵀ (and dP = dO·Vᵀ) | `bqd,bkd->bqk` | 8×17×17×8 |" in result.stdout
