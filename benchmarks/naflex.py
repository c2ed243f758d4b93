"""NaFlex against the square model, on one machine in one run (issue 58's measurements).

    python benchmarks/naflex.py throughput --rounds 3 --json naflex_throughput.json
    python benchmarks/naflex.py accuracy --seeds 0 1 --json naflex_accuracy.json

`throughput`: images/s of ViT-Ti/16 (1,000 classes) on 196-token inputs, inference and a training
step (forward, cross-entropy, backward, SGD), for the square model at 224 px and the NaFlex model
at a budget of 196 patches, on a batch mixing aspect ratios (1:1, 2:1, 1:3, 4:3, padded to 196),
through vit_keras on JAX (jit-compiled) and torch (eager), and through timm's `NaFlexVit`
(`vit_tiny_patch16_224`, `use_naflex=True`) and square ViT, eager. Each implementation runs in its
own process, alternating over `--rounds`; the median over rounds is reported.

`accuracy`: the digits pasted at random places onto wide (8x32), tall (32x8) and square (16x16)
black canvases, written as an image folder; `apps/finetune.py` trains ViT-digits on it with the
digits recipe and augmentation, once squashing every canvas to 16x16 (16 patches of 4 px:
`--image_size 16`) and at each canvas's own aspect ratio with the same budget
(`--max_num_patches 16`), in one bucket of 16 patches (the square run's batches and steps) and
in timm's buckets (2 to 16 patches: fewer, larger batches); the test accuracy of each, per seed.
Not part of the test suite.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS, PATCH, BATCH = 196, 16, 8
# Image shapes (height, width) of the NaFlex batch: each is resized to at most 196 patches.
SHAPES = ((224, 224), (160, 320), (360, 120), (240, 320)) * (BATCH // 4)
IMPLEMENTATIONS = {  # name -> (library, Keras backend or None, NaFlex)
    "vit_keras-jax": ("vit_keras", "jax", False), "vit_keras-jax-naflex": ("vit_keras", "jax", True),
    "vit_keras-torch": ("vit_keras", "torch", False),
    "vit_keras-torch-naflex": ("vit_keras", "torch", True),
    "timm": ("timm", None, False), "timm-naflex": ("timm", None, True),
}


def _naflex_batch():
    import numpy as np

    sys.path.insert(0, REPO)
    from vit_keras.model.naflex_patches import naflex_patches

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (*shape, 3), dtype=np.uint8) for shape in SHAPES]
    return naflex_patches(images, PATCH, TOKENS)


def _timed(step, warmup=2, steps=5):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return BATCH / statistics.median(times)


def _keras_worker(naflex):
    import keras
    import numpy as np

    sys.path.insert(0, REPO)
    import vit_keras

    model = vit_keras.build_model("ViT-Ti/16", image_size=224, num_classes=1000, naflex=naflex)
    inputs = (_naflex_batch() if naflex else
              np.random.default_rng(0).uniform(0, 255, (BATCH, 224, 224, 3)).astype("float32"))
    labels = keras.utils.to_categorical(np.arange(BATCH) % 1000, 1000)
    jit = keras.backend.backend() != "torch"  # torch.compile of a ViT step takes minutes on CPU
    model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=jit,
                  loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    return {"inference": _timed(lambda: model.predict_on_batch(inputs)),
            "train": _timed(lambda: model.train_on_batch(inputs, labels))}


def _timm_worker(naflex):
    import numpy as np
    import timm
    import torch

    model = timm.create_model("vit_tiny_patch16_224", num_classes=1000, use_naflex=naflex)
    if naflex:
        batch = _naflex_batch()
        inputs = {"patches": torch.from_numpy(batch["patches"]),
                  "patch_coord": torch.from_numpy(batch["patch_coord"]).long(),
                  "patch_valid": torch.from_numpy(batch["patch_valid"])}
    else:
        inputs = torch.from_numpy(
            np.random.default_rng(0).uniform(0, 1, (BATCH, 3, 224, 224)).astype("float32"))
    labels = torch.arange(BATCH) % 1000
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def infer():
        model.eval()
        with torch.no_grad():
            model(inputs)

    def train():
        model.train()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    return {"inference": _timed(infer), "train": _timed(train)}


def worker(name):
    library, _, naflex = IMPLEMENTATIONS[name]
    result = (_keras_worker if library == "vit_keras" else _timm_worker)(naflex)
    print(json.dumps(result))


def throughput(args):
    rounds = []
    for number in range(args.rounds):
        row = {}
        for name in args.implementations:
            backend = IMPLEMENTATIONS[name][1] or "torch"
            env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
            result = subprocess.run([sys.executable, __file__, "worker", name], env=env, cwd=REPO,
                                    capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
            row[name] = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"round {number + 1}/{args.rounds} {name}: {row[name]}", flush=True)
        rounds.append(row)
    print(f"\nViT-Ti/16, batch {BATCH}, {TOKENS} tokens; images/s, median over {args.rounds} "
          f"rounds (min-max)\n\n| implementation | inference | training step |\n|---|---:|---:|")
    for name in args.implementations:
        cells = []
        for mode in ("inference", "train"):
            values = [r[name][mode] for r in rounds]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    return {"batch": BATCH, "tokens": TOKENS, "shapes": SHAPES, "rounds": rounds}


def _canvases(folder, seed):
    """The digits on wide, tall and square canvases, as `folder/<digit>/<index>.png`."""
    import numpy as np
    from PIL import Image

    sys.path.insert(0, REPO)
    from vit_keras.tools import data

    rng = np.random.default_rng(seed)
    index = 0
    for split in ("train", "val", "test"):
        images, labels = data.digits_arrays(seed)[split]
        for image, label in zip(images, labels):
            height, width = ((8, 32), (32, 8), (16, 16))[index % 3]
            canvas = np.zeros((height, width, 3), np.uint8)
            top, left = rng.integers(0, height - 7), rng.integers(0, width - 7)
            canvas[top:top + 8, left:left + 8] = image
            os.makedirs(os.path.join(folder, split, str(label)), exist_ok=True)
            Image.fromarray(canvas).save(os.path.join(folder, split, str(label), f"{index}.png"))
            index += 1


def accuracy(args):
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            folder = os.path.join(scratch, f"canvases{seed}")
            _canvases(folder, seed)
            for method, flags in (
                    ("square 16x16", []),
                    ("NaFlex, one length of 16", ["--max_num_patches", "16",
                                                  "--naflex_seq_lens", "16"]),
                    ("NaFlex, buckets 2-16", ["--max_num_patches", "16"])):
                command = [sys.executable, "apps/finetune.py", "--backend", args.backend,
                           "--dataset", f"folder:{folder}", "--recipe", "digits", "--model",
                           "ViT-digits", "--image_size", "16", "--seed", str(seed),
                           "--crop_min_area", "0.8", "--noflip",  # the digits' augmentation
                           "--output_dir", os.path.join(scratch, "runs"), "--run_name",
                           f"{seed}_{len(results)}", "--verbose", "0", *flags]
                started = time.perf_counter()
                result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
                if result.returncode:
                    raise RuntimeError(f"{' '.join(command)}:\n{result.stderr[-3000:]}")
                with open(os.path.join(scratch, "runs", f"{seed}_{len(results)}",
                                       "metrics.json")) as f:
                    metrics = json.load(f)
                results.append({"seed": seed, "method": method,
                                "test_accuracy": metrics["test_accuracy"],
                                "seconds": time.perf_counter() - started})
                print(results[-1], flush=True)
    print("\n| method | " + " | ".join(f"seed {s}" for s in args.seeds) + " |\n|---|"
          + "---:|" * len(args.seeds))
    for method in dict.fromkeys(r["method"] for r in results):
        cells = [f"{100 * r['test_accuracy']:.2f}%" for r in results if r["method"] == method]
        print(f"| {method} | " + " | ".join(cells) + " |")
    return {"backend": args.backend, "results": results}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    speed = commands.add_parser("throughput")
    speed.add_argument("--rounds", type=int, default=3)
    speed.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS),
                       choices=list(IMPLEMENTATIONS))
    speed.add_argument("--json")
    quality = commands.add_parser("accuracy")
    quality.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    quality.add_argument("--backend", default="jax")
    quality.add_argument("--json")
    commands.add_parser("worker").add_argument("name", choices=list(IMPLEMENTATIONS))
    args = parser.parse_args()
    if args.command == "worker":
        return worker(args.name)
    result = throughput(args) if args.command == "throughput" else accuracy(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "date": time.strftime("%Y-%m-%d"),
                       "command": " ".join(sys.argv)}, f, indent=1)


if __name__ == "__main__":
    main()
