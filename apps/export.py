"""Exports a trained `.keras` model for serving and proves the export matches Keras.

    python apps/export.py --model saved_models/RUN/model.keras --format saved_model --out exports
    python apps/export.py --model saved_models/RUN/model.keras --format tflite \
        --quantize dynamic_int8 --out exports
    python apps/export.py --model saved_models/RUN/model.keras --format onnx --format tflite \
        --out exports
    python apps/export.py --model saved_models/RUN/model.keras --format saved_model \
        --dynamic_image_size --out exports

`saved_model` writes the TF Serving layout `OUT/NAME/VERSION/`; `tflite` and `onnx` write
`OUT/NAME[_QUANTIZE].tflite` and `OUT/NAME.onnx`. After writing, the artifact is reloaded in its own
runtime, run on a fixed batch and compared with Keras; the program exits with status 1 when a float
export differs by more than 1e-4 (relative to the largest logit).

An export that exists already (a `.tflite` or `.onnx` file, a SavedModel version, a labels file of
other class names) stops the program with status 2 before the model loads, unless `--overwrite`
is given: then the new export replaces it once it is verified.

`--dynamic_image_size` exports a model trained at one size so that it takes any image size
(`vit_keras.with_dynamic_image_size`): inputs `(batch, None, None, 3)`, position embeddings
resampled in the graph; the export is then verified at three sizes. Its SavedModel refuses sides
that are not whole multiples of the patch size, and sides over `--max_image_size` pixels (default:
4 times the trained size); LiteRT and ONNX cannot check either, their callers must.

A model without head (`include_top=False`) is exported as a backbone: its artifacts return
`features`, verified as such, and take no class names.

The export always runs on the TensorFlow backend, whatever backend trained the model: the weights in
a `.keras` file are backend-independent. Class names come from `--class_names` or from a
`class_names.json` beside the model file.
"""

import os
import sys

import _backend

_backend.start_app(  # before keras is imported
    only="tensorflow", help_text="Export always runs on TensorFlow, whatever backend trained the model.")

from absl import app, flags, logging

from vit_keras.tools import export as vit_export
from vit_keras.tools.runs import config_flags

import _common

flags.DEFINE_string("model", None, "The .keras file to export.", required=True)
flags.DEFINE_multi_enum("format", None, vit_export.FORMATS,
                        "Export format; repeat the flag to write several from one load.",
                        required=True)
flags.DEFINE_enum("quantize", "none", vit_export.QUANTIZATIONS,
                  "Weight quantization (tflite only): none (float32), dynamic_int8 (TFLite's int8 "
                  "weights with int8 products at run time: the LiteRT counterpart of "
                  "apps/predict.py and apps/evaluate.py --quantize int8) or float16.")
flags.DEFINE_string("out", None, "Root folder of the exports.", required=True)
flags.DEFINE_string("name", None,
                    "Model name: the SavedModel folder (TF Serving's MODEL_NAME) and file stem. "
                    "Default: the name of the folder that holds the .keras file.")
config_flags.define_number("version", None, "SavedModel version folder. Default: one more than the "
                           "highest present.", bounds="[0, inf)", kind=int)
flags.DEFINE_string("class_names", None,
                    "Class names: a JSON list or a text file with one name per line. Default: "
                    "class_names.json beside the .keras file, if present.")
config_flags.define_number("top_k", 5, "Classes listed by the SavedModel's top_k outputs.",
                           bounds="[1, inf)", kind=int)
flags.DEFINE_bool("overwrite", False,
                  "Replace exports that exist already (a .tflite or .onnx file, a SavedModel "
                  "version, a labels file of other class names) once the new ones are verified. "
                  "Without it an existing export stops the program before the model loads.")
flags.DEFINE_bool("dynamic_image_size", False,
                  "Export a model that takes images of any size (sides multiples of the patch "
                  "size): position embeddings resampled in the graph, exact at the trained size.")
config_flags.define_number("max_image_size", None,
                           "With a model of dynamic image size: the largest side, in pixels, its "
                           "SavedModel serves (larger images are refused, so that no request asks "
                           "the server for unbounded memory). Default: 4 times the trained size.",
                           bounds="[1, inf)", kind=int)
_common.define_max_num_patches_flag()
FLAGS = flags.FLAGS


@_common.exit_on_user_error
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # TensorFlow's SavedModel writer logs every step
    formats = list(dict.fromkeys(FLAGS.format))
    if FLAGS.version is not None and formats != ["saved_model"]:
        raise app.UsageError("--version applies to --format saved_model only.")
    if FLAGS.quantize != "none" and formats != ["tflite"]:
        raise app.UsageError("--quantize applies to --format tflite only.")
    _common.check_model_file(FLAGS.model)
    name = FLAGS.name or os.path.basename(os.path.dirname(os.path.abspath(FLAGS.model)))
    class_names = _common.read_class_names(FLAGS.class_names, FLAGS.model)
    if os.path.exists(FLAGS.out) and not os.path.isdir(FLAGS.out):
        raise app.UsageError(f"--out {FLAGS.out} is a file; give the folder the exports go in "
                             f"(it is created if missing).")
    existing = list(dict.fromkeys(path for export_format in formats for path in (
        vit_export.existing_outputs(export_format, FLAGS.out, name, FLAGS.version, FLAGS.quantize,
                                    class_names))))
    if existing and not FLAGS.overwrite:
        raise app.UsageError(
            f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; pass "
            f"--overwrite to replace {'it' if len(existing) == 1 else 'them'}, or choose another "
            f"--out or --name" + (" (or leave out --version for the next SavedModel version)"
                                  if FLAGS.version is not None else "") + ".")
    model = _common.load_keras_model(FLAGS.model)
    if FLAGS.dynamic_image_size:
        import vit_keras

        model = vit_keras.with_dynamic_image_size(model)
    if FLAGS.max_image_size is not None and not vit_export.is_dynamic(model):
        raise app.UsageError("--max_image_size applies to a model of dynamic image size "
                             "(--dynamic_image_size); this one takes its one size only.")
    batching = _common.naflex_batching(model, FLAGS.model)  # refuses the flag for pixels
    if not vit_export.is_classifier(model):
        if FLAGS.class_names:
            raise app.UsageError(f"{FLAGS.model} has no classification head (it outputs "
                                 f"features): --class_names does not apply.")
        class_names = None  # a class_names.json beside a backbone names no output of it
    for export_format in formats:
        try:
            path, verifications = vit_export.export(
                model, export_format, FLAGS.out, name=name, version=FLAGS.version,
                quantize=FLAGS.quantize, class_names=class_names, top_k=FLAGS.top_k,
                overwrite=FLAGS.overwrite, max_image_size=FLAGS.max_image_size,
                max_num_patches=batching and batching.max_num_patches)
        except vit_export.ExportVerificationError as error:
            print(f"Export verification failed ({export_format}).\n{error}", file=sys.stderr)
            return 1
        for verification in verifications:
            print(verification.summary())
        print(f"Wrote {path}")
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
