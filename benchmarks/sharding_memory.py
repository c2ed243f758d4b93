"""What one device holds of a model and its AdamW state under each `--distribution`, on 8
virtual XLA CPU devices, and how long a training step takes there.

    python benchmarks/sharding_memory.py                    # the performance page's table
    python benchmarks/sharding_memory.py --models ViT-B/16 --live ViT-B/16 --json out.json

Every row runs in its own process with `XLA_FLAGS=--xla_force_host_platform_device_count=8`:

- `estimate` (every model): the model and its optimizer built inside a `keras.StatelessScope`
  (nothing allocated), their per-device bytes read from the layouts the distribution gives
  (`sharding.placement`); float32 weights and AdamW's two slots per weight.
- `live` (`--live` models): the same, allocated; the bytes summed over what device 0 really holds,
  and the median time of `--steps` training steps (`train_on_batch`, jit-compiled) at
  `--batch_size` images of 224 px, after one compiling step.
  Under fsdp also the seconds to write the state as the run's sharded Orbax backup, to read it
  back, and to write it whole as a `.keras` file.
- `compile` (`--compile` models, under fsdp): the training step (forward, loss, gradients, AdamW)
  lowered and compiled by XLA for the 8 devices from shapes alone, and XLA's own memory analysis
  of it per device (arguments, outputs, temporaries) - for models too large to allocate here.

The 7B row is DINOv3's 7B shape (4096 wide, 40 blocks, 32 heads, SwiGLU 8192, patch 16), a
`ViTConfig` dict. Writes a markdown table to stdout and everything to `--json`. Not a test.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

DEVICES = 8
DISTRIBUTIONS = ("none", "data_parallel", "model_parallel", "fsdp")
SEVEN_B = {"name": "ViT-7B_16", "patch_size": 16, "hidden_size": 4096, "mlp_dim": 8192,
           "num_heads": 32, "num_layers": 40, "mlp": "swiglu", "layer_scale_init": 1e-5}
MODELS = {"ViT-B/16": "ViT-B/16", "ViT-L/16": "ViT-L/16", "ViT-g/14": "ViT-g/14",
          "ViT-7B/16": SEVEN_B}


def _worker(model_name, kind, mode, batch_size, steps):
    import keras
    import numpy as np

    import vit_keras
    from vit_keras.tools.distributed import distribution, sharding

    variant = MODELS[model_name]
    # model_parallel splits heads and MLP units over the model axis: as many devices as divide
    # the head count (4 of 8 for ViT-B's 12 heads), the rest on the batch axis.
    heads = vit_keras.model.configs.get_config(variant).num_heads
    distribution.distribution_scope(
        kind, model_parallel_size=math.gcd(heads, DEVICES) if kind == "model_parallel" else None)
    optimizer = keras.optimizers.AdamW(1e-4)
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    result = {"model": model_name, "distribution": kind, "mode": mode}
    if mode == "live":
        model = vit_keras.ViT(variant, num_classes=1000)
        model.compile(optimizer, loss, jit_compile=True)
        optimizer.build(model.trainable_variables)
        import jax

        device = jax.devices()[0]

        def held(variables):
            return sum(shard.data.nbytes for v in variables for shard in v.value.addressable_shards
                       if shard.device == device)

        result["parameter_bytes"] = held(model.weights)
        result["optimizer_bytes"] = held([v for v in optimizer.variables if len(v.shape)])
        rng = np.random.default_rng(0)
        images = rng.uniform(0, 255, (batch_size, 224, 224, 3)).astype("float32")
        labels = np.eye(1000, dtype="float32")[rng.integers(0, 1000, batch_size)]
        model.train_on_batch(images, labels)  # compiles
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            float(model.train_on_batch(images, labels))
            times.append(time.perf_counter() - started)
        result["step_seconds"] = statistics.median(times)
        if kind == "fsdp":
            result.update(_backup_seconds(model))
        return result
    with keras.StatelessScope(initialize_variables=False):
        model = vit_keras.ViT(variant, num_classes=1000)
        optimizer.build(model.trainable_variables)
    model.optimizer = optimizer
    placed = sharding.placement(model)
    result.update(parameter_bytes=placed.parameter_bytes, optimizer_bytes=placed.optimizer_bytes,
                  total_bytes=placed.total_parameter_bytes + placed.total_optimizer_bytes,
                  parameters=model.count_params(), uncovered=list(placed.uncovered))
    if mode == "compile":
        result.update(_compiled_step_memory(model, optimizer, loss, batch_size))
    return result


def _backup_seconds(model):
    """Seconds to write an fsdp run's epoch backup as a sharded Orbax checkpoint and to read it
    back onto the devices, and to write the same state whole as a `.keras` file (what each epoch
    wrote before); with the bytes each takes on disk."""
    import tempfile

    from vit_keras.tools.distributed import sharded_checkpoint

    def timed(call):
        started = time.perf_counter()
        call()
        return time.perf_counter() - started

    def disk_bytes(path):
        if os.path.isfile(path):
            return os.path.getsize(path)
        return sum(os.path.getsize(os.path.join(root, name))
                   for root, _, names in os.walk(path) for name in names)

    with tempfile.TemporaryDirectory() as folder:
        orbax, keras_file = os.path.join(folder, "epoch-1.orbax"), os.path.join(folder, "m.keras")
        return {"orbax_save_seconds": timed(lambda: sharded_checkpoint.save(model, orbax)),
                "orbax_restore_seconds": timed(lambda: sharded_checkpoint.restore(model, orbax)),
                "keras_save_seconds": timed(lambda: model.save(keras_file)),
                "orbax_disk_bytes": disk_bytes(orbax), "keras_disk_bytes": disk_bytes(keras_file)}


def _compiled_step_memory(model, optimizer, loss, batch_size):
    """XLA's memory analysis of one device's share of a jit-compiled training step, lowered from
    shapes and the distribution's layouts alone."""
    import jax
    import keras

    from vit_keras.tools.distributed import sharding as sharding_lib

    mesh_distribution = keras.distribution.distribution()

    def spec(variable):
        layout = mesh_distribution.get_variable_layout(variable) if mesh_distribution else None
        sharding = layout.backend_layout if layout is not None else None
        return jax.ShapeDtypeStruct(tuple(variable.shape), variable.dtype, sharding=sharding)

    trainable = [spec(v) for v in model.trainable_variables]
    non_trainable = [spec(v) for v in model.non_trainable_variables]
    # Slots copy their weight's layout when created for real; ask for the weight's here.
    def slot_spec(variable):
        if not len(variable.shape):  # the step count, the learning rate
            return jax.ShapeDtypeStruct((), variable.dtype)
        weight = sharding_lib.slot_weight(variable, model.trainable_variables)
        return spec(variable if weight is None else weight)

    slots = [slot_spec(v) for v in optimizer.variables]
    data_layout = (mesh_distribution.get_data_layout((batch_size, 224, 224, 3)).backend_layout
                   if mesh_distribution else None)
    images = jax.ShapeDtypeStruct((batch_size, 224, 224, 3), "float32", sharding=data_layout)
    labels = jax.ShapeDtypeStruct((batch_size, 1000), "float32")

    def step(trainable, non_trainable, slots, images, labels):
        def objective(trainable):
            logits, updated = model.stateless_call(trainable, non_trainable, images,
                                                   training=True)
            return loss(labels, logits), updated

        (value, updated), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
        trainable, slots = optimizer.stateless_apply(slots, grads, trainable)
        return value, trainable, updated, slots

    started = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(
        trainable, non_trainable, slots, images, labels).compile()
    analysis = compiled.memory_analysis()
    return {"compile_seconds": time.perf_counter() - started,
            "xla_argument_bytes": analysis.argument_size_in_bytes,
            "xla_output_bytes": analysis.output_size_in_bytes,
            "xla_temp_bytes": analysis.temp_size_in_bytes,
            "xla_alias_bytes": analysis.alias_size_in_bytes}


def _run(model, kind, mode, args):
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"}
    command = [sys.executable, __file__, "--worker", model, kind, mode,
               "--batch_size", str(args.batch_size), "--steps", str(args.steps)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result.returncode or line is None:
        return {"model": model, "distribution": kind, "mode": mode,
                "error": (result.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(line[len("RESULT "):])


def _gib(count):
    return f"{count / 2 ** 30:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--live", nargs="*", default=["ViT-B/16"], choices=list(MODELS))
    parser.add_argument("--compile", nargs="*", default=["ViT-B/16", "ViT-7B/16"],
                        choices=list(MODELS))
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        print("RESULT " + json.dumps(_worker(*args.worker, args.batch_size, args.steps)))
        return
    rows = []
    for model in args.models:
        for kind in DISTRIBUTIONS:
            rows.append(_run(model, kind, "estimate", args))
            if model in args.live:
                rows.append(_run(model, kind, "live", args))
        if model in args.compile:
            rows.append(_run(model, "fsdp", "compile", args))
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"| model | distribution | measured | parameters GiB / device | AdamW state GiB / "
          f"device | step s (batch {args.batch_size}) | XLA step GiB / device |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['model']} | {row['distribution']} | {row['mode']} | error: "
                  f"{row['error'][:80]} | | | |")
            continue
        xla = (_gib(row["xla_argument_bytes"] + row["xla_output_bytes"] + row["xla_temp_bytes"]
                    - row["xla_alias_bytes"]) if "xla_temp_bytes" in row else "")
        step = f"{row['step_seconds']:.2f}" if "step_seconds" in row else ""
        print(f"| {row['model']} | {row['distribution']} | {row['mode']} | "
              f"{_gib(row['parameter_bytes'])} | {_gib(row['optimizer_bytes'])} | {step} | "
              f"{xla} |")
    for row in rows:
        if "orbax_save_seconds" in row:
            print(f"\n{row['model']} backup under fsdp: Orbax save {row['orbax_save_seconds']:.2f}"
                  f" s, restore {row['orbax_restore_seconds']:.2f} s, "
                  f"{_gib(row['orbax_disk_bytes'])} GiB on disk; whole .keras save "
                  f"{row['keras_save_seconds']:.2f} s, {_gib(row['keras_disk_bytes'])} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "devices": DEVICES,
                       "argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
