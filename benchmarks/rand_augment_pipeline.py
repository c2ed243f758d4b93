"""Measures the training input pipeline with RandAugment on each Keras backend: vit_keras'
`RandAugment` (`vit_keras.tools.data.rand_augment`) against Keras' own `keras.layers.RandAugment`,
each in a fresh process, alternating, in one run.

    python benchmarks/rand_augment_pipeline.py                # digits at 224 px, batch 64
    python benchmarks/rand_augment_pipeline.py --backends jax --rounds 3 --json ra.json

Reports, per backend and layer: the graph ops of one traced RandAugment call, the seconds from
`make_pipeline` to the first batch (tracing included), and images/s over `--batches` batches
after it (the median over `--rounds`). The pipeline is the apps' (`--randaugment 2,0.5`, inception
crop, flip), on scikit-learn's bundled digits. Not part of the test suite.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("vit_keras", "keras")


def measure(layer, image_size, batch_size, batches):
    """One process's measurement (`--worker`): a dict of the numbers the table shows."""
    sys.path.insert(0, REPO)
    import keras
    import tensorflow as tf

    from vit_keras.tools import data
    from vit_keras.tools.data import rand_augment

    if layer == "keras":  # the pipeline builds what this name holds
        rand_augment.RandAugment = keras.layers.RandAugment
    probe = rand_augment.RandAugment(value_range=(0, 255), num_ops=2, factor=0.5, seed=0)
    traced = tf.function(lambda x: probe(x, training=True)).get_concrete_function(
        tf.zeros((2, 8, 8, 3)))
    splits = data.load_splits("digits", log=lambda _: None)
    augmentation = data.Augmentation(randaugment=(2, 0.5))
    started = time.perf_counter()
    batches_iter = iter(data.make_pipeline(splits, "train", image_size=image_size,
                                           batch_size=batch_size, training=True,
                                           augmentation=augmentation))
    next(batches_iter)
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(batches):
        next(batches_iter)
    return {"graph_ops": len(traced.graph.get_operations()), "first_batch_s": first,
            "images_per_s": batches * batch_size / (time.perf_counter() - started)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["jax", "torch", "tensorflow"])
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=LAYERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.image_size, args.batch_size, args.batches)))
        return

    found = {}
    for _ in range(args.rounds):
        for backend in args.backends:
            for layer in LAYERS:
                env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", layer, "--image_size",
                     str(args.image_size), "--batch_size", str(args.batch_size), "--batches",
                     str(args.batches)], env=env, capture_output=True, text=True, check=True)
                found.setdefault((backend, layer), []).append(json.loads(out.stdout.splitlines()[-1]))
    rows = [{"backend": backend, "layer": layer,
             **{key: statistics.median(run[key] for run in runs) for key in runs[0]}}
            for (backend, layer), runs in found.items()]
    print(f"RandAugment 2,0.5 pipeline, {args.image_size} px, batch {args.batch_size}, "
          f"median of {args.rounds}:\n")
    print("| backend | RandAugment | graph ops | first batch (s) | images/s |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['backend']} | {row['layer']} | {row['graph_ops']:,.0f} | "
              f"{row['first_batch_s']:.1f} | {row['images_per_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
