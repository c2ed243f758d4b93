"""Measures the main job's claim (docs/performance.md): `python apps/finetune.py --backend B` with
no other flags reaches >= 95% held-out test accuracy on the digits data in under 5 minutes, on
each backend.

    python benchmarks/digits_accuracy.py                       # all three backends, one at a time
    python benchmarks/digits_accuracy.py --backends jax torch --json digits.json

Each backend runs the app exactly as a user would (a fresh process, the default flags, a fresh run
folder: `--overwrite`), timed from process start to exit; the numbers come from the run's metrics
(read through `vit_keras.tools.runs.run_folder`, the one module that knows a run folder's layout).
Prints a markdown table. Not part of the test suite.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # vit_keras from this checkout, installed or not
from vit_keras.tools.runs.run_folder import RunFolder  # noqa: E402

TARGET_ACCURACY = 0.95
TARGET_SECONDS = 300


def measure(backend, output_dir):
    run_name = f"digits_accuracy_{backend}"
    # --overwrite: a fresh run, never a resumed or an already finished one.
    command = [sys.executable, "apps/finetune.py", "--backend", backend, "--output_dir",
               output_dir, "--run_name", run_name, "--overwrite", "--verbose", "2"]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    metrics = RunFolder(os.path.join(output_dir, run_name)).read_metrics()
    return {"backend": backend, "test_accuracy": metrics["test_accuracy"],
            "val_accuracy": metrics["val_accuracy"], "process_seconds": seconds,
            "fit_seconds": metrics["fit_time_s"], "images_per_second": metrics["images_per_second"],
            "jit_compile": metrics["config"]["jit_compile"],
            "passes": metrics["test_accuracy"] >= TARGET_ACCURACY and seconds < TARGET_SECONDS,
            "command": f"python apps/finetune.py --backend {backend}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["jax", "tensorflow", "torch"])
    parser.add_argument("--output_dir", default=None, help="default: a temporary folder")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="digits_accuracy_")
    rows = []
    for backend in args.backends:
        rows.append(measure(backend, output_dir))
        print(f"{backend}: {100 * rows[-1]['test_accuracy']:.2f}% in "
              f"{rows[-1]['process_seconds']:.0f} s", file=sys.stderr, flush=True)
    print(f"| backend | test accuracy | val accuracy | wall time (process) | fit time | "
          f"train images/s | jit | >= {TARGET_ACCURACY:.0%} in < {TARGET_SECONDS // 60} min |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['backend']} | {100 * row['test_accuracy']:.2f}% | "
              f"{100 * row['val_accuracy']:.2f}% | {row['process_seconds']:.0f} s | "
              f"{row['fit_seconds']:.0f} s | {row['images_per_second']:.0f} | "
              f"{'on' if row['jit_compile'] else 'off'} | {'yes' if row['passes'] else 'NO'} |")
    print(f"\n{os.cpu_count()} CPUs visible; load average at the end "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (other work on the machine slows "
          f"these numbers down).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(row["passes"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
