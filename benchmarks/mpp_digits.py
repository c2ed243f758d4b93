"""Does masked patch prediction help on the digits? Measures it offline:

1. MPP pre-training (`apps/pretrain.py`, recipe mpp_digits) on all 1,797 digits images (train,
   val and test splits; labels unused), one run per seed;
2. fine-tuning (`apps/finetune.py`, the digits recipe with the flags below) on 5 and 10 labelled
   images per class drawn from the train split, from the pre-trained model and from scratch, with
   the same flags, scored on the digits test split (360 images);
3. few-shot linear accuracy (big_vision's least squares, `vit_keras.training.fewshot`) of the frozen
   features of the pre-trained model and of the same architecture at its random initialisation.

    python benchmarks/mpp_digits.py --backend jax --seeds 3 --json mpp_digits.json

Every run is a fresh process of the apps, as a user would run them. Prints markdown tables (mean
± standard deviation over seeds, and every seed's value). Not part of the test suite.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS_MODEL = ["--model", "ViT-digits", "--classifier", "gap"]


def app(name, *args, backend):
    """Runs `apps/<name>` and returns its output; raises with the output when it fails."""
    command = [sys.executable, os.path.join("apps", name), *args, "--backend", backend]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return result.stdout


def labelled_subset(folder, per_class, seed):
    """Writes `per_class` train images per class (drawn with `seed`) and the whole val and test
    splits of the digits as PNG files under `folder/{train,val,test}/<class>/` (lossless, so the
    folder pipeline reads the digits pipeline's pixels)."""
    import numpy as np
    from PIL import Image

    from vit_keras.tools import data

    arrays = data.digits_arrays()
    rng = np.random.default_rng(seed)
    for split, (images, labels) in arrays.items():
        chosen = np.arange(len(labels))
        if split == "train":
            chosen = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:per_class]
                                     for c in range(10)])
        for index in chosen:
            path = os.path.join(folder, split, str(labels[index]))
            os.makedirs(path, exist_ok=True)
            Image.fromarray(images[index]).save(os.path.join(path, f"{index}.png"))
    return f"folder:{folder}"


def random_init_model(path, image_size, seed):
    """The fine-tuning runs' architecture (ViT-digits, GAP) at its random initialisation."""
    import keras

    from vit_keras import build_model
    from vit_keras.tools.runs import recipes

    keras.utils.set_random_seed(seed)
    build_model(recipes.DIGITS_VIT, image_size=image_size, num_classes=10,
                classifier="gap").save(path)
    return path


def fewshot_accuracy(model_path, shots, seeds, image_size):
    import keras

    from vit_keras.tools import data
    from vit_keras.training import fewshot

    model = keras.saving.load_model(model_path, compile=False)
    splits = data.load_splits("digits", log=lambda _: None)
    features = {split: fewshot.dataset_features(model, data.make_pipeline(
        splits, split, image_size=image_size, batch_size=256).as_numpy_iterator())
        for split in ("train", "test")}
    return fewshot.evaluate(*features["train"], *features["test"], shots=shots, seeds=seeds,
                            num_classes=10)


def masking_cost(image_size, batch_size, variant, rounds=8, steps=20):
    """Seconds per compiled training step of the MPP model, with the corruption and with the
    corruption layer passing its input through (same graph otherwise), in alternating rounds of
    `steps` steps (each going first in half of them) so that load drifts hit both; returns their
    medians."""
    import keras
    import numpy as np

    from vit_keras import build_model
    from vit_keras.tools.runs import recipes
    from vit_keras.training import masked_patch_prediction as mpp

    class NoCorruption(mpp.MaskedPatchCorruption):
        def call(self, tokens, training=None):
            return tokens, keras.ops.ones(keras.ops.shape(tokens)[:2], dtype="float32")

    variant = recipes.variant_config(variant)
    images = np.random.default_rng(0).uniform(0, 255, (batch_size, image_size, image_size, 3)
                                              ).astype("float32")
    labels = np.zeros((batch_size, 1), "float32")
    models = {}
    for name in ("with corruption", "without"):
        model = mpp.build_pretraining_model(build_model(variant, image_size=image_size), seed=0)
        if name == "without":
            layer = model.get_layer("mpp_corruption")
            layer.__class__ = NoCorruption  # the same weights and graph, the corruption skipped
        model.compile(optimizer="adam", loss=None, jit_compile=recipes.use_jit_compile())
        model.train_on_batch(images, labels)  # compile
        models[name] = model
    times = {name: [] for name in models}
    for round_index in range(rounds):
        order = list(models.items())
        for name, model in order if round_index % 2 else order[::-1]:  # ABBA: neither goes first
            started = time.perf_counter()
            for _ in range(steps):
                model.train_on_batch(images, labels)
            times[name].append((time.perf_counter() - started) / steps)
    return {name: float(np.median(values)) for name, values in times.items()}


def mean_sd(values):
    import numpy as np

    return (f"{100 * np.mean(values):.1f}% ± {100 * np.std(values):.1f} "
            f"({', '.join(f'{100 * v:.1f}' for v in values)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="jax", choices=["jax", "tensorflow", "torch"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--labels_per_class", type=int, nargs="+", default=[5, 10])
    parser.add_argument("--fewshot_shots", type=int, nargs="+", default=[1, 5, 10, 25])
    parser.add_argument("--image_size", type=int, default=16)
    parser.add_argument("--pretrain_epochs", type=int, default=None,
                        help="default: the mpp_digits recipe's")
    parser.add_argument("--finetune_flags", default="--recipe digits --batch_size 16 --epochs 100 "
                        "--warmup_steps 30 --crop_min_area 0.8 --noflip",
                        help="apps/finetune.py flags of both fine-tunings (pre-trained and "
                             "from scratch)")
    parser.add_argument("--output_dir", default=None, help="default: a temporary folder")
    parser.add_argument("--masking_cost", nargs=3, metavar=("VARIANT", "IMAGE_SIZE", "BATCH"),
                        default=None, help="only measure the corruption's share of a training "
                        "step, e.g. ViT-digits 16 64 or ViT-Ti/16 224 16")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend  # for the few-shot evaluation in this process
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, REPO)
    # After KERAS_BACKEND is set: vit_keras imports Keras.
    from vit_keras.tools.runs.run_folder import RunFolder

    if args.masking_cost:
        variant, image_size, batch = args.masking_cost
        seconds = masking_cost(int(image_size), int(batch), variant)
        share = 1 - seconds["without"] / seconds["with corruption"]
        print(f"| model | backend | batch | step with corruption | without | corruption's share |"
              f"\n|---|---|---|---|---|---|\n| {variant} {image_size} px | {args.backend} | {batch} "
              f"| {1e3 * seconds['with corruption']:.1f} ms | {1e3 * seconds['without']:.1f} ms | "
              f"{100 * share:.1f}% |")
        return 0
    output = args.output_dir or tempfile.mkdtemp(prefix="mpp_digits_")
    size = ["--image_size", str(args.image_size)]
    finetune_flags = args.finetune_flags.split()
    rows = {"pretrained": {k: [] for k in args.labels_per_class},
            "scratch": {k: [] for k in args.labels_per_class}}
    fewshot_rows = {"pretrained": {s: [] for s in args.fewshot_shots},
                    "random init": {s: [] for s in args.fewshot_shots}}
    pretrain_seconds = []
    started = time.perf_counter()
    for seed in range(args.seeds):
        run_started = time.perf_counter()
        app("pretrain.py", "--output_dir", output, "--run_name", f"pretrain_{seed}", "--seed",
            str(seed), "--pretrain_splits", "train,val,test", "--fewshot_shots", "", *size,
            *([] if args.pretrain_epochs is None else ["--epochs", str(args.pretrain_epochs)]),
            "--verbose", "2", backend=args.backend)
        pretrain_seconds.append(time.perf_counter() - run_started)
        pretrained = RunFolder(os.path.join(output, f"pretrain_{seed}")).model
        random_model = random_init_model(os.path.join(output, f"random_{seed}.keras"),
                                         args.image_size, seed)
        for name, path in (("pretrained", pretrained), ("random init", random_model)):
            results = fewshot_accuracy(path, args.fewshot_shots, args.seeds, args.image_size)
            for shots in args.fewshot_shots:
                # seeds draws of the shots per model: the spread covers models and draws.
                fewshot_rows[name][shots].extend(results[shots]["accuracies"])
        for per_class in args.labels_per_class:
            dataset = labelled_subset(os.path.join(output, f"labels_{per_class}_{seed}"),
                                      per_class, seed)
            for name, init in (("pretrained", ["--weights", pretrained]),
                               ("scratch", DIGITS_MODEL)):
                run_name = f"finetune_{name}_{per_class}_{seed}"
                app("finetune.py", "--dataset", dataset, "--output_dir", output, "--run_name",
                    run_name, "--seed", str(seed), *size, *init, *finetune_flags, "--verbose", "2",
                    backend=args.backend)
                metrics = RunFolder(os.path.join(output, run_name)).read_metrics()
                rows[name][per_class].append(metrics["test_accuracy"])
            print(f"seed {seed}, {per_class} labels/class: pre-trained "
                  f"{rows['pretrained'][per_class][-1]:.3f}, scratch "
                  f"{rows['scratch'][per_class][-1]:.3f}", file=sys.stderr, flush=True)

    print(f"Fine-tuning on k labelled digits per class, test accuracy (360 images), mean ± sd over "
          f"{args.seeds} seeds (each seed's value):\n")
    print("| labels per class | from MPP pre-training | from scratch |\n|---|---|---|")
    for per_class in args.labels_per_class:
        print(f"| {per_class} | {mean_sd(rows['pretrained'][per_class])} | "
              f"{mean_sd(rows['scratch'][per_class])} |")
    print(f"\nFew-shot linear accuracy (least squares) of the frozen features, test split, mean ± "
          f"sd over {args.seeds} models x {args.seeds} draws of the shots:\n")
    print("| shots per class | MPP pre-trained | random initialisation |\n|---|---|---|")
    for shots in args.fewshot_shots:
        print(f"| {shots} | {mean_sd(fewshot_rows['pretrained'][shots])} | "
              f"{mean_sd(fewshot_rows['random init'][shots])} |")
    total = time.perf_counter() - started
    print(f"\nBackend {args.backend}; pre-training {sum(pretrain_seconds) / len(pretrain_seconds):.0f}"
          f" s per run (process); {total:.0f} s in all; {os.cpu_count()} CPUs; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "backend": args.backend,
                       "command": " ".join(sys.argv), "finetune_flags": args.finetune_flags,
                       "finetune_test_accuracy": rows, "fewshot_accuracy": fewshot_rows,
                       "pretrain_process_seconds": pretrain_seconds, "total_seconds": total},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
