r"""Evaluates a trained .keras model on a dataset split: accuracy, top-5 (more than 5 classes) and
per-class accuracy.

    python apps/evaluate.py --backend jax --model saved_models/finetune_digits_ViT-digits_jax/model.keras
    python apps/evaluate.py --model run/model.keras --dataset cifar10 --data_dir ~/tensorflow_datasets \
        --split test --json results.json

The model's own input size sets the resolution; its evaluation transform (`eval_crop`: the
crop fraction and interpolation its weights state, as timm's data config or a transformers
image processor; else resize) brings the
images to it, --resize_only resizes. When the model
sits in a run folder, the run's metrics.json supplies the dataset, data_dir, seed and val_fraction
that were used for training, so the same held-out split is evaluated; flags override it.
"""

import os

import numpy as np

import _backend

_backend.start_app()  # before keras is imported

from absl import app, flags

from vit_keras.tools.runs import config_flags

import _common

flags.DEFINE_string("model", None, "The .keras file to evaluate.", required=True)
flags.DEFINE_string("dataset", None, "digits, folder:PATH or a tfds name (default: the run's "
                    "dataset from metrics.json beside the model, else digits).")
flags.DEFINE_string("data_dir", None, "tfds data directory (default: the run's).")
flags.DEFINE_enum("split", "test", ["train", "val", "test"], "Split to evaluate.")
config_flags.define_number("val_fraction", None, "Held-out fraction for val (default: the run's).",
                           bounds="(0, 1)")
config_flags.define_number("seed", None, "Seed of the held-out splits (default: the run's, else 0).",
                           bounds="[0, 4294967295]", kind=int)
config_flags.define_number("batch_size", 256, "Evaluation batch size.", bounds="[1, inf)", kind=int)
_common.define_json_flags("the results")
flags.DEFINE_enum("quantize", "none", ["none", "int8"],
                  "int8: also evaluate the model with Keras' int8 weight quantization "
                  "(model.quantize('int8'), as apps/predict.py --quantize int8 runs it) on the same "
                  "images, and print its accuracy next to float's (JSON: quantized).")
_common.define_resize_only_flag()
flags.declare_key_flag("resize_only")  # listed by --help with the app's own
_common.define_max_num_patches_flag()
flags.declare_key_flag("max_num_patches")
FLAGS = flags.FLAGS


@_common.exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    import keras

    import vit_keras  # noqa: F401  (registers the layers for loading)
    from vit_keras.tools import data
    from vit_keras.tools.runs import evaluation

    _common.check_model_file(FLAGS.model)  # before the data loads
    _common.check_json_output()
    dataset, splits = _common.load_run_splits(FLAGS.model, FLAGS.dataset, FLAGS.data_dir,
                                              FLAGS.seed, FLAGS.val_fraction)
    model = _common.load_keras_model(FLAGS.model)
    if model.output_shape[-1] != splits.num_classes:
        raise app.UsageError(f"{FLAGS.model} predicts {model.output_shape[-1]} classes but "
                             f"{dataset} has {splits.num_classes}; evaluate on the dataset the "
                             f"model was trained for.")
    batching = _common.naflex_batching(model, FLAGS.model)
    if batching is not None:  # each image at its own aspect ratio, as patches
        from vit_keras.tools.data import naflex

        pipeline = naflex.make_naflex_pipeline(splits, FLAGS.split, batching,
                                               batch_size=FLAGS.batch_size)
    else:
        pipeline = data.make_pipeline(splits, FLAGS.split, image_size=_common.model_image_size(model),
                                      batch_size=FLAGS.batch_size,
                                      eval_crop=_common.eval_crop(model))
    logits, labels = evaluation.evaluate_model(model, pipeline)
    if splits.skipped_files:
        print(splits.unreadable.summary())
    report = evaluation.classification_report(logits, labels, splits.class_names)
    report.update(model=os.path.abspath(FLAGS.model), dataset=dataset, split=FLAGS.split,
                  backend=keras.backend.backend(),
                  skipped_files=[path for path, _ in splits.skipped_files])
    print(f"{dataset} {FLAGS.split}: {report['count']} images, {evaluation.headline(report)}")
    if FLAGS.quantize != "none":
        quantized_logits, _ = evaluation.evaluate_model(
            evaluation.quantized_copy(model, FLAGS.quantize), pipeline)
        quantized = evaluation.classification_report(quantized_logits, labels,
                                                     splits.class_names)
        agreement = float(np.mean(quantized_logits.argmax(-1) == logits.argmax(-1)))
        report["quantized"] = {"mode": FLAGS.quantize, "accuracy": quantized["accuracy"],
                               "top5_accuracy": quantized["top5_accuracy"],
                               "agreement_with_float": agreement}
        print(f"{FLAGS.quantize}: {evaluation.headline(quantized)} (float "
              f"{evaluation.headline(report)}), same top-1 class as float on "
              f"{100 * agreement:.2f}% of the images")
    print("\n| class | images | accuracy |\n|---|---|---|")
    for name, row in report["per_class"].items():
        accuracy = "-" if row["accuracy"] is None else f"{100 * row['accuracy']:.2f}%"
        print(f"| {name} | {row['count']} | {accuracy} |")
    if FLAGS.json:
        _common.write_json(report)
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
