r"""Few-shot linear evaluation of a model's frozen pre-logits features (the paper's few-shot metric).

    python apps/fewshot.py --backend jax --model saved_models/pretrain_digits_ViT-digits_jax/model.keras
    python apps/fewshot.py --model run/model.keras --dataset cifar10 --data_dir ~/tensorflow_datasets \
        --shots 1,5,10,25 --seeds 3 --json fewshot.json
    python apps/fewshot.py --model run/model.keras --probe logistic
    python apps/fewshot.py --model ViT-S/14 --weights dinov2 --image_size 224 --dataset cifar10

For each shot count and seed, that many training examples per class are drawn (big_vision's
order), a linear probe is fitted on their frozen features and scored on the whole test split;
the table gives the mean and standard deviation over seeds. `--probe lsr` (default) is
big_vision's closed-form L2-regularised least squares onto {-1, 1} targets (whitened features, a
bias feature, `--l2_reg` 1024); `--probe logistic` trains a softmax layer with Keras. Any vit_keras
`.keras` file works: a classifier (the head's input is used), a model without head, or a masked
patch prediction model from apps/pretrain.py (its encoder's pooled output). The model's own input
size sets the resolution; when the model sits in a run folder its dataset, data_dir, seed and
val_fraction are the defaults. With `--weights` a published release (the paper's or the ViT
family's: DINOv2, CLIP, SigLIP, ...), a checkpoint or a hub id is evaluated as a frozen backbone:
`--model` names its variant, and its pooled output (the one its source library calls pooled) is the
features.
"""

import os

import _backend

_backend.start_app()  # before keras is imported

from absl import app, flags

from vit_keras.tools.runs import config_flags

import _common

flags.DEFINE_string("model", None, "The .keras file whose features are evaluated; with --weights, "
                    "the variant the weights are for (e.g. ViT-S/14).", required=True)
flags.DEFINE_string("weights", None, "Pretrained weights evaluated instead of a .keras file: a "
                    "release name (e.g. dinov2, clip_openai, augreg_in21k; --model names the "
                    "variant), a checkpoint file or folder, or hf-hub:REPO_ID. The model is built "
                    "without its head: its pooled features are evaluated.")
_common.define_checkpoint_flags()
config_flags.define_number("image_size", None, "With --weights: the resolution (default: the weights' "
                           "own; position embeddings are resampled to another).",
                           bounds="[1, inf)", kind=int)
flags.DEFINE_string("dataset", None, "digits, folder:PATH or a tfds name (default: the run's "
                    "dataset from metrics.json beside the model, else digits).")
flags.DEFINE_string("data_dir", None, "tfds data directory (default: the run's).")
config_flags.define_number("val_fraction", None, "Held-out fraction for val (default: the run's).",
                           bounds="(0, 1)")
config_flags.define_number("split_seed", None, "Seed of the held-out splits (default: the run's, else "
                           "0).", bounds="[0, 4294967295]", kind=int)
flags.DEFINE_list("shots", ["1", "5", "10", "25"], "Training examples per class, each count "
                  "evaluated on its own.")
config_flags.define_number("seeds", 3, "Draws of the training examples (seeds 0 .. N-1).",
                           bounds="[1, inf)", kind=int)
flags.DEFINE_enum("probe", "lsr", ["lsr", "logistic"], "lsr: closed-form regularised least "
                  "squares (big_vision's fewshot_lsr); logistic: a softmax layer trained with "
                  "Keras.")
config_flags.define_number("l2_reg", 2.0 ** 10, "L2 regularisation of the least squares (big_vision's "
                           "2**10).", bounds="[0, inf)")
flags.DEFINE_enum("train_split", "train", ["train", "val", "test"], "Split the shots come from.")
flags.DEFINE_enum("test_split", "test", ["train", "val", "test"], "Split the probe is scored on.")
config_flags.define_number("batch_size", 256, "Feature extraction batch size.",
                           bounds="[1, inf)", kind=int)
_common.define_json_flags("the results")
FLAGS = flags.FLAGS


@_common.exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    import keras

    import vit_keras  # registers the layers for loading
    from vit_keras.tools import data
    from vit_keras.training import fewshot

    try:
        shots = [int(count) for count in FLAGS.shots]
        if min(shots, default=1) < 1:
            raise ValueError
    except ValueError:
        raise app.UsageError(f"--shots takes positive whole numbers (e.g. 1,5,10,25); got "
                             f"{','.join(FLAGS.shots)!r}.") from None
    _common.check_json_output()
    if FLAGS.weights:  # checked before the data loads
        _common.check_weights(FLAGS.weights, FLAGS.model, FLAGS.image_size)
    else:
        _common.check_model_file(FLAGS.model)
    dataset, splits = _common.load_run_splits(FLAGS.model, FLAGS.dataset, FLAGS.data_dir,
                                              FLAGS.split_seed, FLAGS.val_fraction)
    if FLAGS.weights:
        model = vit_keras.build_model_from_checkpoint(
            FLAGS.weights, variant=FLAGS.model, image_size=FLAGS.image_size, include_top=False,
            **_common.checkpoint_options())
    else:
        model = _common.load_keras_model(FLAGS.model)
    image_size = _common.model_image_size(model)
    features = {split: fewshot.dataset_features(model, data.make_pipeline(
        splits, split, image_size=image_size, batch_size=FLAGS.batch_size).as_numpy_iterator())
        for split in (FLAGS.train_split, FLAGS.test_split)}
    if splits.skipped_files:
        print(splits.unreadable.summary())
    # More shots than a class has is a ValueError of vit_keras.training.fewshot: exit_on_user_error
    # reports it.
    results = fewshot.evaluate(*features[FLAGS.train_split], *features[FLAGS.test_split],
                               shots=shots, seeds=FLAGS.seeds, l2_reg=FLAGS.l2_reg,
                               num_classes=splits.num_classes, probe=FLAGS.probe)
    dimension = features[FLAGS.train_split][0].shape[1]
    source = f"{FLAGS.model} {FLAGS.weights}" if FLAGS.weights else FLAGS.model
    print(f"{dataset}: {FLAGS.probe} probe on {dimension} frozen features of {source}, "
          f"shots from {FLAGS.train_split} ({len(features[FLAGS.train_split][1])} images), scored "
          f"on {FLAGS.test_split} ({len(features[FLAGS.test_split][1])} images), {FLAGS.seeds} "
          f"seeds, backend {keras.backend.backend()}.\n")
    print(fewshot.results_table(results))
    if FLAGS.json:
        _common.write_json({
            "model": FLAGS.model if FLAGS.weights else os.path.abspath(FLAGS.model),
            "weights": FLAGS.weights, "dataset": dataset, "probe": FLAGS.probe,
            "l2_reg": FLAGS.l2_reg, "train_split": FLAGS.train_split,
            "test_split": FLAGS.test_split, "feature_dimension": dimension,
            "backend": keras.backend.backend(),
            "results": {str(count): row for count, row in results.items()}})
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
