"""Fine-tuning methods on the digits, offline: full fine-tuning, LoRA rank 4 and a linear probe,
each with and without weight EMA (--ema_decay) and layer-wise learning-rate decay
(--layer_decay), from one model pre-trained by masked patch prediction on the digits.

1. MPP pre-training (`apps/pretrain.py`, recipe mpp_digits) on all 1,797 digits images (labels
   unused), once, in its own process as a user would run it;
2. fine-tuning on the digits' train split (the digits recipe with --weights: AdamW, warm-up,
   linear decay) for each method and option, `--seeds` seeds each, through
   `vit_keras.tools.runs.training.run` in this process (a process per run would spend more time
   starting than training); scored on the test split (360 images).

    python benchmarks/finetuning_digits.py --backend jax --json \\
        benchmarks/results/finetuning_digits-jax-cpu2-DATE.json

A linear probe trains only the head, whose layer-decay scale is 1: --layer_decay leaves it as it
is, so the table has no such row. Prints a markdown table (mean, min-max over seeds, each seed's
value). Not part of the test suite.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = {"full": {}, "LoRA r4": {"lora_rank": 4}, "linear probe": {"linear_probe": True}}


def options(ema_decay, layer_decay):
    """The option sets of the table: none, EMA, layer decay, both."""
    return {"-": {}, "EMA": {"ema_decay": ema_decay}, "layer decay": {"layer_decay": layer_decay},
            "EMA + layer decay": {"ema_decay": ema_decay, "layer_decay": layer_decay}}


def pretrain(output, epochs, backend):
    """Runs apps/pretrain.py once; returns its model.keras."""
    command = [sys.executable, os.path.join("apps", "pretrain.py"), "--output_dir", output,
               "--run_name", "pretrain", "--pretrain_splits", "train,val,test",
               "--fewshot_shots", "", "--verbose", "2", "--backend", backend,
               *([] if epochs is None else ["--epochs", str(epochs)])]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return os.path.join(output, "pretrain", "model.keras")


def spread(values):
    import numpy as np

    return (f"{100 * np.mean(values):.1f}% ({100 * min(values):.1f}-{100 * max(values):.1f}; "
            f"{', '.join(f'{100 * v:.1f}' for v in values)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="jax", choices=["jax", "tensorflow", "torch"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10, help="fine-tuning epochs per run")
    parser.add_argument("--pretrain_epochs", type=int, default=30)
    parser.add_argument("--ema_decay", type=float, default=0.99)
    parser.add_argument("--layer_decay", type=float, default=0.75)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--output_dir", default=None, help="default: a temporary folder")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, REPO)
    import tempfile

    import keras  # after KERAS_BACKEND is set

    from vit_keras.tools.runs import training

    output = args.output_dir or tempfile.mkdtemp(prefix="finetuning_digits_")
    started = time.perf_counter()
    weights = pretrain(output, args.pretrain_epochs, args.backend)
    pretrain_seconds = time.perf_counter() - started
    rows, seconds, chosen = {}, {}, {}
    for method in args.methods:
        for option_name, extra in options(args.ema_decay, args.layer_decay).items():
            if method == "linear probe" and "layer_decay" in extra:
                continue  # the head's scale is 1: the same run as without
            key = f"{method} | {option_name}"
            rows[key], seconds[key], chosen[key] = [], [], []
            for seed in range(args.seeds):
                keras.utils.clear_session(free_memory=False)
                run_started = time.perf_counter()
                config = training.RunConfig.of(
                    weights=weights, epochs=args.epochs, seed=seed, output_dir=output,
                    run_name=f"{method.replace(' ', '_')}-{option_name.replace(' ', '_')}-{seed}",
                    verbose=0, **METHODS[method], **extra)
                metrics = training.run(config, log=lambda _: None)
                seconds[key].append(time.perf_counter() - run_started)
                rows[key].append(metrics["test_accuracy"])
                chosen[key].append(metrics.get("ema", {}).get("weights"))
                print(f"{key}, seed {seed}: {metrics['test_accuracy']:.3f} "
                      f"({seconds[key][-1]:.0f} s)", file=sys.stderr, flush=True)
    total = time.perf_counter() - started
    print(f"Fine-tuning the MPP-pre-trained ViT-digits on the digits ({args.epochs} epochs, digits "
          f"recipe), test accuracy (360 images): mean (min-max; each of {args.seeds} seeds). "
          f"EMA decay {args.ema_decay}, layer decay {args.layer_decay}.\n")
    print("| method | options | test accuracy | EMA weights chosen | s per run |\n"
          "|---|---|---|---|---|")
    for key, values in rows.items():
        picks = [c for c in chosen[key] if c]
        ema_chosen = f"{picks.count('ema')} of {len(picks)}" if picks else "-"
        print(f"| {key} | {spread(values)} | {ema_chosen} | "
              f"{sum(seconds[key]) / len(seconds[key]):.0f} |")
    print(f"\nBackend {args.backend}; pre-training {pretrain_seconds:.0f} s; {total:.0f} s in all; "
          f"{os.cpu_count()} CPUs; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "backend": args.backend,
                       "command": " ".join(sys.argv), "epochs": args.epochs,
                       "pretrain_epochs": args.pretrain_epochs, "ema_decay": args.ema_decay,
                       "layer_decay": args.layer_decay, "test_accuracy": rows,
                       "ema_weights_chosen": chosen, "run_seconds": seconds,
                       "pretrain_seconds": pretrain_seconds, "total_seconds": total},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
