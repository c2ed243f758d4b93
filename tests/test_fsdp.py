"""Fully sharded data parallelism (`--distribution fsdp`, vit_keras.tools.distributed.sharding):
the rule, the layouts on 8 XLA CPU devices, the step against one device's, sharded Orbax
checkpoints (vit_keras.tools.distributed.sharded_checkpoint) read onto another mesh, and
apps/finetune.py as two processes of four devices, killed and resumed from their sharded backup
as one process (docs/distributed.md)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import test_multiprocess as multiprocess

from vit_keras.tools.distributed import sharding

from conftest import REPO_ROOT, xla_cpu_devices


@pytest.mark.backend_independent
@pytest.mark.parametrize("shape, taken, axes, why", [
    ((768, 3072), None, (None, "batch"), "sharded"),           # an MLP's first kernel
    ((3072, 768), None, ("batch", None), "sharded"),           # its second
    ((768, 768), None, (None, "batch"), "sharded"),            # ties: the last axis
    ((768, 12, 64), (None, "model", None), ("batch", "model", None), "sharded"),  # with the model axis
    ((12, 64), ("model", None), ("model", "batch"), "sharded"),
    ((10,), None, (None,), "indivisible"),                     # a 10-class head's bias
    ((), None, (), "scalar"),
])
def test_fsdp_splits_the_largest_free_axis_the_device_count_divides(shape, taken, axes, why):
    assert sharding.fsdp_axes(shape, 8, taken=taken) == (axes, why)


@pytest.mark.backend_independent
def test_fsdp_leaves_weights_below_the_size_whole_and_one_device_alone():
    assert sharding.fsdp_axes((768,), 8, itemsize=4, min_bytes=4096) == ((None,), "small")
    assert sharding.fsdp_axes((1024,), 8, itemsize=4, min_bytes=4096) == (("batch",), "sharded")
    assert sharding.fsdp_axes((768, 768), 1) == ((None, None), "one device")


@pytest.mark.backend_independent
def test_a_devices_bytes_are_its_shards():
    mesh = {"batch": 8, "model": 2}
    assert sharding.shard_bytes((768, 3072), "float32", (None, "batch"), mesh) == 768 * 384 * 4
    assert sharding.shard_bytes((768, 12, 64), "bfloat16", ("batch", "model", None), mesh) == (
        96 * 6 * 64 * 2)
    assert sharding.shard_bytes((10,), "float32", (None,), mesh) == 40


# On 8 devices: a tiny ViT trained 3 steps with AdamW under no distribution, data_parallel and
# fsdp from the same initial weights and batches; what each device holds, and the results.
_EIGHT_DEVICES = r"""
import json, os
os.environ["KERAS_BACKEND"] = "jax"
import keras, numpy as np
import sys
import vit_keras
from vit_keras import errors
from vit_keras.tools.distributed import distribution, sharded_checkpoint, sharding

CHECKPOINT = sys.argv[1]
CONFIG = dict(patch_size=4, hidden_size=64, mlp_dim=128, num_heads=4, num_layers=2)
rng = np.random.default_rng(0)
images = rng.uniform(0, 255, (24, 16, 16, 3)).astype("float32")
labels = np.eye(16, dtype="float32")[rng.integers(0, 16, 24)]
report = {}
for kind in ("none", "data_parallel", "fsdp"):
    keras.utils.set_random_seed(0)
    distribution.distribution_scope(kind)
    model = vit_keras.ViT(CONFIG, image_size=16, num_classes=16)
    model.compile(keras.optimizers.AdamW(1e-3),
                  keras.losses.CategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    placed = sharding.placement(model)
    blocks = [w for block in model.blocks for w in block.weights]
    slots = [v for v in model.optimizer.variables if "encoderblock" in v.path]
    losses = [float(model.train_on_batch(images[i:i + 8], labels[i:i + 8]))
              for i in range(0, 24, 8)]
    report[kind] = {
        "bytes": [placed.parameter_bytes, placed.optimizer_bytes],
        "uncovered": list(placed.uncovered),
        "block_split": sorted({w.value.size // w.value.addressable_shards[0].data.size
                               for w in blocks}),
        "slot_split": sorted({v.value.size // v.value.addressable_shards[0].data.size
                              for v in slots}),
        "losses": losses,
        "weights": [np.asarray(w).tolist() for w in model.weights],
    }
    keras.distribution.set_distribution(None)
    if kind == "fsdp":  # its sharded checkpoint, read back onto 4 of the 8 devices
        sharded_checkpoint.save(model, CHECKPOINT)
        mesh = keras.distribution.DeviceMesh((4,), ["batch"], keras.distribution.list_devices()[:4])
        keras.distribution.set_distribution(sharding.FullyShardedDataParallel(mesh))
        again = vit_keras.ViT(CONFIG, image_size=16, num_classes=16)
        again.compile(keras.optimizers.AdamW(1e-3),
                      keras.losses.CategoricalCrossentropy(from_logits=True))
        sharded_checkpoint.restore(again, CHECKPOINT)
        pairs = [*zip(model.weights, again.weights),
                 *zip(model.optimizer.variables, again.optimizer.variables)]
        report["restored"] = {
            "equal": all(np.array_equal(np.asarray(a.value), np.asarray(b.value))
                         for a, b in pairs),
            "block_split": sorted({w.value.size // w.value.addressable_shards[0].data.size
                                   for block in again.blocks for w in block.weights}),
            "devices": sorted({len(w.value.sharding.device_set) for w in again.weights}),
            "variables": len(pairs),
        }
        other = vit_keras.ViT(CONFIG, image_size=16, num_classes=10)
        try:
            sharded_checkpoint.restore(other, CHECKPOINT, with_optimizer=False)
        except errors.CheckpointError as error:
            report["restored"]["mismatch"] = str(error)
        keras.distribution.set_distribution(None)
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "jax",
           "XLA_FLAGS": xla_cpu_devices(8)}
    checkpoint = tmp_path_factory.mktemp("orbax") / "epoch-3.orbax"
    result = subprocess.run([sys.executable, "-c", _EIGHT_DEVICES, str(checkpoint)],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


@pytest.mark.jax_subprocess
def test_fsdp_splits_every_block_weight_and_optimizer_slot_over_8_devices(eight_devices):
    fsdp, replicated = eight_devices["fsdp"], eight_devices["data_parallel"]
    assert fsdp["block_split"] == [8] and fsdp["slot_split"] == [8]
    assert replicated["block_split"] == [1] and replicated["slot_split"] == [1]
    assert fsdp["uncovered"] == []  # 16 classes: the head's bias divides too
    # Every weight divides by 8 here, so a device holds exactly an eighth.
    assert [b * 8 for b in fsdp["bytes"]] == replicated["bytes"] == eight_devices["none"]["bytes"]


@pytest.mark.jax_subprocess
def test_fsdp_trains_as_one_device_does(eight_devices):
    import numpy as np

    one, fsdp = eight_devices["none"], eight_devices["fsdp"]
    assert len(set(one["losses"])) == 3  # the weights changed between steps
    assert fsdp["losses"] == pytest.approx(one["losses"], rel=1e-5)
    # AdamW divides each update by the root of its second moment: for a weight whose gradients
    # are near epsilon, the float32 rounding of a sharded reduction moves an update by up to
    # ~0.1% of a step (1.3e-6 at learning rate 1e-3 on an AMD EPYC with AVX-512, where the
    # reduction order differs), while a shard trained wrongly moves it by a whole step.
    step = 1e-3
    for mine, reference in zip(fsdp["weights"], one["weights"]):
        np.testing.assert_allclose(mine, reference, rtol=1e-5, atol=step / 100)
    moved = max(np.max(np.abs(np.subtract(a, b))) for a, b in
                zip(one["weights"], eight_devices["data_parallel"]["weights"]))
    assert moved < step / 100  # and as data parallelism does


@pytest.mark.jax_subprocess
def test_a_sharded_checkpoint_of_8_devices_restores_onto_4(eight_devices):
    """Each process writes its shards (nothing gathered); read back onto another mesh, every
    weight and optimizer slot is the one saved, split over the new mesh."""
    restored = eight_devices["restored"]
    assert restored["equal"] and restored["variables"] > 40
    assert restored["block_split"] == [4] and restored["devices"] == [4]
    assert "holds head/kernel with shape (64, 16), but" in restored["mismatch"]
    assert "is (64, 10)" in restored["mismatch"]


# An fsdp run whose model.keras cannot be gathered on its host (its memory made small here):
# it trains, backs up each epoch as an Orbax checkpoint, and stops before model.keras; on a host
# with the memory, the same command resumes at the final evaluation and writes it.
_TOO_BIG_TO_GATHER = r"""
import json, os, shutil, sys
os.environ["KERAS_BACKEND"] = "jax"
import keras, numpy as np
import vit_keras
from vit_keras.tools.distributed import memory, sharded_checkpoint
from vit_keras.tools.runs import training

output = sys.argv[1]
run = os.path.join(output, "run")
config = training.RunConfig.of(image_size=8, batch_size=16, epochs=2, steps_per_epoch=2,
                               distribution="fsdp", output_dir=output, run_name="run", verbose=0)
report, logs, host_ram_bytes = {}, [], memory.host_ram_bytes
memory.device_memory = lambda ram=host_ram_bytes(): (ram, "host memory (RAM)")  # as it is
memory.host_ram_bytes = lambda: 2 ** 16
try:
    training.run(config, log=logs.append)
except memory.HostMemoryError as error:
    report["error"] = str(error)
report["warnings"] = [line for line in logs if line.startswith("Warning")]
report["files"] = sorted(os.listdir(run))
report["backup"] = sorted(os.listdir(os.path.join(run, "backup")))
shutil.copytree(os.path.join(run, "backup", "epoch-2.orbax"), os.path.join(output, "kept.orbax"))
memory.host_ram_bytes, logs = host_ram_bytes, []
metrics = training.run(config, log=logs.append)
report["resumed"] = [line for line in logs if "evaluating the backed-up model" in line]
report["resumed_from_epoch"] = metrics["resumed_from_epoch"]
report["after"] = sorted(os.listdir(run))
model = keras.models.load_model(os.path.join(run, "model.keras"))
bare = keras.models.load_model(os.path.join(run, "model.keras"), compile=False)
for weight in bare.weights:
    weight.assign(np.zeros(weight.shape, weight.dtype))
sharded_checkpoint.restore(bare, os.path.join(output, "kept.orbax"), with_optimizer=False)
report["restored_equal"] = all(np.array_equal(np.asarray(a), np.asarray(b))
                               for a, b in zip(model.weights, bare.weights))
print("REPORT " + json.dumps(report))
"""


@pytest.mark.jax_subprocess
def test_an_fsdp_run_too_big_to_gather_keeps_its_sharded_checkpoint_and_finishes_elsewhere(
        tmp_path):
    result = subprocess.run([sys.executable, "-c", _TOO_BIG_TO_GATHER, str(tmp_path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(next(line for line in result.stdout.splitlines()
                             if line.startswith("REPORT "))[len("REPORT "):])
    assert len(report["warnings"]) == 1 and "stops before writing model.keras" in (
        report["warnings"][0])
    assert f"sharded checkpoint {tmp_path}/run/backup/epoch-2.orbax" in report["error"]
    # Trained and backed up without gathering: no model.keras, no metrics, the checkpoint kept.
    assert "model.keras" not in report["files"] and "metrics.json" not in report["files"]
    assert report["backup"] == ["epoch-2.orbax", "training_metadata.json"]
    assert report["resumed"] and report["resumed_from_epoch"] == 2
    assert "model.keras" in report["after"] and "backup" not in report["after"]
    assert report["restored_equal"]  # the checkpoint's weights are model.keras's


def _one_process(tmp, output, devices, epochs=multiprocess.EPOCHS):
    return subprocess.run(
        [sys.executable, "apps/finetune.py", *_FLAGS, "--epochs", str(epochs), "--output_dir",
         str(output)], cwd=REPO_ROOT, env=multiprocess._env(tmp, devices), capture_output=True,
        text=True, timeout=600)


_FLAGS = [flag if flag != "data_parallel" else "fsdp" for flag in multiprocess.FLAGS]


@pytest.fixture(scope="module")
def killed_and_resumed_on_fewer_devices(tmp_path_factory):
    """Two processes of four devices each (the weights split 8 ways across both), SIGKILLed
    after their first backed-up epoch, then resumed by one process of four devices."""
    tmp = tmp_path_factory.mktemp("fsdp")
    output, port = tmp / "runs", multiprocess._free_port()
    metadata = output / "run" / "backup" / "training_metadata.json"
    first = multiprocess._start(output, port, multiprocess.EPOCHS, tmp, flags=_FLAGS, devices=4)
    multiprocess._wait_for_backup(first, metadata)
    for process, _ in first:
        os.kill(process.pid, signal.SIGKILL)
    first_results = multiprocess._finish(first)
    assert [code for code, _ in first_results] == [-signal.SIGKILL] * 2, (
        "a process ended on its own:\n" + "\n".join(out[-3000:] for _, out in first_results))
    killed_after = json.loads(metadata.read_text())["epoch"]
    left = {"backup": sorted(os.listdir(metadata.parent)),
            "model_written": (output / "run" / "model.keras").exists()}
    resumed = _one_process(tmp, output, 4)
    uninterrupted = _one_process(tmp, tmp / "reference", 8)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    return {"first": first_results, "resumed": resumed, "killed_after": killed_after, **left,
            "run": output / "run", "reference": tmp / "reference" / "run"}


@pytest.mark.multiprocess
def test_fsdp_run_of_two_processes_resumes_in_one_process_on_four_devices(
        killed_and_resumed_on_fewer_devices):
    run = killed_and_resumed_on_fewer_devices
    first_log = run["first"][0][1]
    # The weights were split over both processes' 8 devices: an eighth of a whole copy each.
    assert "--distribution fsdp, per device:" in first_log and "(0.125 of one whole" in first_log
    # Each epoch's backup is an Orbax checkpoint of both processes' shards; nothing was gathered
    # (an fsdp run writes model.keras once, at its end).
    checkpoint = f"epoch-{run['killed_after']}.orbax"
    assert checkpoint in run["backup"] and "training_metadata.json" in run["backup"]
    assert not any(name.endswith(".keras") for name in run["backup"])
    assert not run["model_written"]
    resumed = run["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert (f"from its backup after epoch {run['killed_after']} of {multiprocess.EPOCHS}"
            in resumed.stdout)
    assert "(0.250 of one whole" in resumed.stdout  # four devices now
    metrics = json.loads((run["run"] / "metrics.json").read_text())
    assert metrics["config"]["distribution"] == "fsdp"
    assert metrics["resumed_from_epoch"] == run["killed_after"]
    assert [row["epoch"] for row in metrics["history"]] == list(range(multiprocess.EPOCHS))
    assert not (run["run"] / "backup").exists()
    # The same global batches: the losses of one uninterrupted process of 8 devices.
    reference = run["reference"]
    assert (reference / "metrics.json").exists()
    mine, theirs = multiprocess._losses(run["run"]), multiprocess._losses(reference)
    assert len(set(theirs["loss"])) > 1
    for key in ("loss", "val_loss", "val_accuracy"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key


@pytest.mark.multiprocess
def test_the_fsdp_runs_model_loads_whole_in_a_fresh_process_on_torch(
        killed_and_resumed_on_fewer_devices):
    code = ("import keras, vit_keras, sys\n"
            "model = keras.models.load_model(sys.argv[1])\n"
            "print(type(model).__name__, model.count_params())\n")
    result = subprocess.run(
        [sys.executable, "-c", code, str(killed_and_resumed_on_fewer_devices["run"] /
                                         "model.keras")],
        cwd=REPO_ROOT, env={**os.environ, "KERAS_BACKEND": "torch", "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2] == "ViT"



@pytest.mark.slow
@pytest.mark.jax_subprocess
@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_disk_filling_during_an_fsdp_backup_ends_the_app_in_one_line(tmp_path):
    """Epoch 1's Orbax backup fails midway: writes past 16 KiB fail with EFBIG, as on a full disk
    with ENOSPC (the run folder's files before it are smaller; its checkpoint files are not).
    Orbax logs each failing thread's error, TensorStore's writes then find asyncio's loop closed
    and asyncio logs their errors, hundreds of tracebacks: the app prints its one line alone."""
    limit = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384)); "
             "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    result = subprocess.run(
        [sys.executable, "-c", limit, "apps/finetune.py", *_FLAGS, "--epochs", "1",
         "--output_dir", str(tmp_path)], cwd=REPO_ROOT, env=multiprocess._env(tmp_path, 4),
        capture_output=True, text=True, timeout=600)
    backup = tmp_path / "run" / "backup"
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"ERROR: Cannot write {backup / 'epoch-1.orbax'}: File too large")
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr
    assert os.listdir(backup) == []  # no partial *.orbax-checkpoint-tmp

@pytest.mark.slow
@pytest.mark.jax_subprocess
@pytest.mark.parametrize("kind", ["fsdp", "model_parallel"])
def test_the_sharding_benchmark_sizes_a_model_without_allocating_it(kind):
    """benchmarks/sharding_memory.py's estimate of ViT-B/16 on 8 devices (the performance page's
    table): AdamW's two slots laid out as their weights (`sharding.slot_weight`: model_parallel's
    rules name weights, not slots), and under fsdp an eighth of everything."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "jax",
           "XLA_FLAGS": xla_cpu_devices(8)}
    result = subprocess.run(
        [sys.executable, "benchmarks/sharding_memory.py", "--worker", "ViT-B/16", kind,
         "estimate"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    row = json.loads(line[len("RESULT "):])
    assert row["parameters"] == 86_567_656 and row["uncovered"] == []
    assert row["optimizer_bytes"] == 2 * row["parameter_bytes"]
    if kind == "fsdp":
        assert row["parameter_bytes"] == 86_567_656 * 4 // 8
    else:  # kernels split 4 ways (12 heads), embeddings, norms and some biases whole
        assert 86_567_656 * 4 // 4 < row["parameter_bytes"] < 86_567_656 * 4 // 2
