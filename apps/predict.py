r"""Classifies image files with a trained .keras model and prints the top-k classes.

    python apps/predict.py --backend jax --model saved_models/finetune_digits_ViT-digits/model.keras \
        digit.png other.jpg --top_k 3

Images are read with their own size, converted to RGB and resized to the model's input size (the
evaluation preprocessing). Class names come from --class_names or from class_names.json beside the
model (written by apps/finetune.py and apps/train.py); otherwise classes are numbered.
"""

import sys

import _backend

_backend.start_app()  # before keras is imported

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import _common  # noqa: E402

flags.DEFINE_string("model", None, "The .keras file.", required=True)
flags.DEFINE_integer("top_k", 5, "Classes listed per image.")
flags.DEFINE_string("class_names", None,
                    "A JSON list or a text file with one class name per line (default: "
                    "class_names.json beside the model).")
flags.DEFINE_string("json", None, "Also write the predictions as JSON to this path.")
FLAGS = flags.FLAGS


def main(argv):
    files = argv[1:]
    if not files:
        raise app.UsageError("Give one or more image files after the flags.")
    import keras

    import vit_keras  # noqa: F401  (registers the layers for loading)
    from vit_keras.tools import data, run_folder, training

    class_names = _common.read_class_names(FLAGS.class_names, FLAGS.model) or []
    model = keras.saving.load_model(FLAGS.model, compile=False)
    try:
        images = data.load_image_files(files, model.input_shape[1])
    except ValueError as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    logits = keras.ops.convert_to_numpy(model.predict(images, verbose=0))
    predictions = training.top_k_predictions(logits, class_names, FLAGS.top_k)
    for file, ranked in zip(files, predictions):
        print(file)
        for rank, (name, probability) in enumerate(ranked, 1):
            print(f"  {rank}. {name}  {100 * probability:.2f}%")
    if FLAGS.json:
        run_folder.atomic_write_json(
            {file: [{"class": n, "probability": p} for n, p in ranked]
             for file, ranked in zip(files, predictions)}, FLAGS.json)
    return 0


if __name__ == "__main__":
    app.run(main)
