r"""Classifies image files with a trained .keras model, or a published model, and prints the
top-k classes.

    python apps/predict.py --backend jax \
        --model saved_models/finetune_digits_ViT-digits_jax/model.keras digit.png other.jpg --top_k 3
    python apps/predict.py --model ViT-B/16 --weights augreg_in21k_ft_in1k --image_size 384 cat.jpg

--model is a .keras file, or a variant (ViT-B/16, or the official spelling ViT-B_16) built with
--weights: a published release by name (imagenet21k, imagenet21k+imagenet2012, augreg_in21k,
augreg_in21k_ft_in1k, augreg_in1k; `vit_keras.list_weights()` lists them), downloaded once into
$VIT_KERAS_HOME (default $KERAS_HOME/vit_keras) or read from the mirror VIT_KERAS_WEIGHTS_MIRROR
names, or a checkpoint file. Offline, the app exits with status 2 and says where to place the file.

Images are read with their own size, converted to RGB and brought to the model's input size by
its evaluation transform: the one its weights state (a timm checkpoint's crop fraction and
interpolation, timm's data config, or a transformers image processor's crop: the shorter side
resized to size / crop_pct, then the centre cropped), else resized; --resize_only resizes.

Class names come from --class_names; else, for a release, from its dataset (ImageNet-1k's ship
with the package, ImageNet-21k's are downloaded like the weights); else from class_names.json
beside a .keras model (written by apps/finetune.py and apps/train.py); otherwise classes are
numbered.
"""

import os

import _backend

_backend.start_app()  # before keras is imported

from absl import app, flags

from vit_keras.tools.runs import config_flags

import _common

flags.DEFINE_string("model", None, "A .keras file, or a variant (e.g. ViT-B/16) with --weights.",
                    required=True)
flags.DEFINE_string("weights", None,
                    "With a variant in --model: a release name (e.g. augreg_in21k_ft_in1k), "
                    "downloaded once, or a checkpoint file.")
config_flags.define_number("image_size", None, "With --weights: the input size (a release's file "
                           "nearest to it is taken). Default: the release's or the checkpoint's.",
                           bounds="[1, inf)", kind=int)
_common.define_checkpoint_flags()
_common.define_resize_only_flag()
flags.declare_key_flag("resize_only")  # listed by --help with the app's own
_common.define_max_num_patches_flag()
flags.declare_key_flag("max_num_patches")
config_flags.define_number("top_k", 5, "Classes listed per image.", bounds="[1, inf)", kind=int)
flags.DEFINE_string("class_names", None,
                    "A JSON list or a text file with one class name per line (default: the "
                    "release's classes, or class_names.json beside a .keras model).")
_common.define_json_flags("the predictions")
flags.DEFINE_enum("quantize", "none", ["none", "int8"],
                  "int8: Keras' int8 weight quantization of the model (model.quantize('int8'): "
                  "int8 kernels with per-channel scales in every Dense/EinsumDense) before "
                  "predicting; apps/evaluate.py --quantize int8 measures its accuracy.")
FLAGS = flags.FLAGS


def _published_model(variant, weights, image_size):
    """`--model VARIANT --weights W`: the model and the `Release` it is (or None for a file).
    The weights are checked first, then resolved (downloaded, read) once, by the one builder."""
    import vit_keras

    try:
        variant = vit_keras.get_config(variant).name
    except ValueError as error:
        raise app.UsageError(f"--model {variant}: {error}") from None
    release = _common.check_weights(weights, variant, image_size)
    return vit_keras.build_model_from_checkpoint(weights, variant=variant, image_size=image_size,
                                                 **_common.checkpoint_options()), release


@_common.exit_on_user_error
def main(argv):
    files = argv[1:]
    if not files:
        raise app.UsageError("Give one or more image files after the flags.")
    import keras

    import vit_keras  # registers the layers for loading
    from vit_keras.tools import data
    from vit_keras.tools.runs import evaluation

    _common.check_json_output()
    is_keras_file = FLAGS.model.endswith(".keras") or os.path.isfile(FLAGS.model)
    if FLAGS.weights is None:
        if not is_keras_file:
            raise app.UsageError(f"--model {FLAGS.model} is not a .keras file; to classify with "
                                 f"a published model give its variant and --weights (e.g. "
                                 f"--model ViT-B/16 --weights augreg_in21k_ft_in1k).")
        if FLAGS.image_size is not None:
            raise app.UsageError("--image_size goes with --weights; a .keras model has its own.")
        _common.check_model_file(FLAGS.model)
        class_names = _common.read_class_names(FLAGS.class_names, FLAGS.model) or []
        model = _common.load_keras_model(FLAGS.model)
    elif is_keras_file:
        raise app.UsageError(f"--weights goes with a variant in --model (e.g. --model ViT-B/16 "
                             f"--weights augreg_in21k_ft_in1k), not with the model file "
                             f"{FLAGS.model}.")
    else:
        model, release = _published_model(FLAGS.model, FLAGS.weights, FLAGS.image_size)
        class_names = _common.read_class_names(FLAGS.class_names, None) if FLAGS.class_names \
            else (vit_keras.class_names(release) if release is not None else [])
    model = evaluation.quantized_copy(model, FLAGS.quantize)
    batching = _common.naflex_batching(model, FLAGS.model if is_keras_file else None)
    if batching is not None:  # each image at its own aspect ratio, as patches
        from vit_keras.tools.data import naflex

        images = naflex.load_image_files(files, batching)
    else:
        images = data.load_image_files(files, _common.model_image_size(model),  # names bad files
                                       _common.eval_crop(model))
    logits = keras.ops.convert_to_numpy(model.predict(images, verbose=0))
    predictions = evaluation.top_k_predictions(logits, class_names, FLAGS.top_k)
    for file, ranked in zip(files, predictions):
        print(file)
        for rank, (name, probability) in enumerate(ranked, 1):
            print(f"  {rank}. {name}  {100 * probability:.2f}%")
    if FLAGS.json:
        _common.write_json({file: [{"class": n, "probability": p} for n, p in ranked]
                            for file, ranked in zip(files, predictions)})
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
