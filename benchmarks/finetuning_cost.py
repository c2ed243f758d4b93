"""What fine-tuning a part of the weights costs: training step time, the process's peak memory
and the trainable parameters of full fine-tuning, LoRA, the linear probe and full with remat;
and int8 against float inference throughput (`model.quantize("int8")`).

    python benchmarks/finetuning_cost.py            # ViT-B/16, 224 px, batch 8, jax; 3 rounds
    python benchmarks/finetuning_cost.py --backend torch --inference_backends jax tensorflow torch
    python benchmarks/finetuning_cost.py --models ViT-Ti/16 --steps 2 --rounds 1  # a smoke run
    python benchmarks/finetuning_cost.py --models ViT-digits --image_size 16 --batch_size 256 \
        --modes                         # only the digits model's float vs int8 inference

Each measurement runs in its own process (peak RSS is the process's, `ru_maxrss`), and the
processes alternate over `--rounds` rounds (full, lora, probe, remat, full, ...) so that drift in
the machine's load hits all alike. A training process builds the model with random weights,
applies the mode as `training.run` does (the parts of `vit_keras.tools.runs.run_parts`),
compiles SGD (XLA on jax and tensorflow, eager on torch, as the apps default) and times
`train_on_batch` after `--warmup` steps. An inference process times `predict_on_batch` of the
float model and of its int8 copy. Prints a table per part and writes all measurements as JSON
(default benchmarks/results/finetuning_cost-BACKEND-DATE.json). Not part of the tests'
pass/fail.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("jax", "tensorflow", "torch")
# mode → RunConfig fields of training.run that select it
MODES = {
    "full": {},
    "lora8": {"lora_rank": 8},
    "linear_probe": {"linear_probe": True},
    "full_remat": {"remat": True},
}


def _worker(args):
    """One measurement in this process; prints its JSON last."""
    import resource
    import time

    import keras
    import numpy as np

    import vit_keras
    from vit_keras.tools import finetuning
    from vit_keras.tools.runs import evaluation, recipes, run_parts, training

    keras.utils.set_random_seed(0)
    model = vit_keras.build_model(recipes.variant_config(args.model), image_size=args.image_size,
                                  num_classes=1000)
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (args.batch_size, args.image_size, args.image_size, 3)).astype(
        "float32")
    result = {"model": args.model, "backend": keras.backend.backend(), "mode": args.mode,
              "batch_size": args.batch_size, "image_size": args.image_size}
    if args.mode in MODES:
        for part in run_parts.choose(training.RunConfig.of(**MODES[args.mode])):
            model = part.adapt_model(model, log=lambda *_: None)
        labels = np.eye(1000, dtype="float32")[rng.integers(0, 1000, args.batch_size)]
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                      jit_compile=keras.backend.backend() != "torch")
        step = lambda: model.train_on_batch(images, labels)  # noqa: E731
        result["trainable_parameters"] = finetuning.trainable_parameters(model)
        result["parameters"] = int(model.count_params())
    else:  # float or int8 inference
        model = evaluation.quantized_copy(model, "int8" if args.mode == "int8" else "none")
        step = lambda: model.predict_on_batch(images)  # noqa: E731
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    result.update(step_seconds=statistics.median(times), all_step_seconds=times,
                  images_per_second=args.batch_size / statistics.median(times),
                  peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(result))


def _run_worker(backend, model, mode, args):
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--mode",
               mode, "--image_size", str(args.image_size), "--batch_size", str(args.batch_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        return {"model": model, "backend": backend, "mode": mode,
                "error": done.stderr.strip().splitlines()[-1:] or ["exit " + str(done.returncode)]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(column, "-")) for column in columns) + " |"
              for row in rows]
    return "\n".join(lines)


def _summary(measurements):
    """Median over rounds per (model, backend, mode)."""
    groups = {}
    for m in measurements:
        groups.setdefault((m["model"], m["backend"], m["mode"]), []).append(m)
    rows = []
    for (model, backend, mode), runs in groups.items():
        good = [r for r in runs if "error" not in r]
        row = {"model": model, "backend": backend, "mode": mode}
        if not good:
            row["error"] = runs[0]["error"]
        else:
            row.update(
                step_ms=round(1000 * statistics.median(r["step_seconds"] for r in good), 1),
                images_per_s=round(statistics.median(r["images_per_second"] for r in good), 2),
                peak_rss_mib=round(statistics.median(r["peak_rss_mib"] for r in good)),
                trainable_parameters=good[0].get("trainable_parameters", "-"))
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=["ViT-B/16"])
    parser.add_argument("--backend", default="jax", choices=BACKENDS,
                        help="Backend of the training measurements (the issue: the fastest).")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES),
                        help="Training modes (none: inference only).")
    parser.add_argument("--inference_backends", nargs="*", default=list(BACKENDS),
                        choices=BACKENDS, help="Backends of float vs int8 inference (none: skip).")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="Timed steps per process.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps (compilation).")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    measurements = []
    for round_index in range(args.rounds):
        for model in args.models:
            for mode in args.modes:
                measurements.append(_run_worker(args.backend, model, mode, args))
                print(f"round {round_index + 1}: {model} {mode}: "
                      f"{measurements[-1].get('step_seconds', measurements[-1].get('error'))}",
                      file=sys.stderr)
            for backend in args.inference_backends:
                for mode in ("float", "int8"):
                    measurements.append(_run_worker(backend, model, mode, args))
    rows = _summary(measurements)
    training = [row for row in rows if row["mode"] in MODES]
    inference = [row for row in rows if row["mode"] not in MODES]
    if training:
        print(f"Training step, batch {args.batch_size}, {args.image_size} px, {args.backend} "
              f"(median of {args.rounds} rounds):\n")
        print(_table(training, ["model", "mode", "step_ms", "images_per_s", "peak_rss_mib",
                                "trainable_parameters", "error"]))
    if inference:
        print(f"\nInference, batch {args.batch_size}:\n")
        print(_table(inference, ["model", "backend", "mode", "images_per_s", "peak_rss_mib", "error"]))
    path = args.json or os.path.join(
        REPO, "benchmarks", "results",
        f"finetuning_cost-{args.backend}-cpu{os.cpu_count()}-{datetime.date.today()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"settings": vars(args), "machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "rows": rows, "measurements": measurements}, f,
                  indent=1)
    print(f"\nWrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
