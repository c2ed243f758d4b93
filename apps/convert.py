"""Converts a checkpoint of any supported format into a `.keras` file.

    python apps/convert.py --weights ViT-B_16.npz --out saved_models/vit_b16_384.keras \
        --image_size 384 --num_classes 10
    python apps/convert.py --weights hf_vit_folder --out saved_models/hf_vit.keras --backend torch
    python apps/convert.py --weights augreg_in21k_ft_in1k --model ViT-S/16 --image_size 384 \
        --out saved_models/vit_s16_384.keras

Formats: vit_jax and big_vision `.npz`, timm state dicts (`.pth`, `.bin`, `.safetensors`), Hugging
Face `save_pretrained` folders (or their `model.safetensors`). `--weights` also takes a published
release by name (imagenet21k, imagenet21k+imagenet2012, augreg_in21k, augreg_in21k_ft_in1k,
augreg_in1k; `vit_keras.list_weights()` lists them), which needs `--model`: the release's file
nearest `--image_size` is downloaded once into $VIT_KERAS_HOME (default $KERAS_HOME/vit_keras), or
read from the mirror VIT_KERAS_WEIGHTS_MIRROR names; offline, the app exits with status 2 and says
where to place the file.

The checkpoint determines the architecture; `--model` only checks it (`--variant` is its old name,
still accepted). A different `--image_size` resamples the position embeddings, a different
`--num_classes` gets a zero-initialised head. The model is saved under a temporary name, reloaded
with `keras.models.load_model` and its logits, and the features under the head, compared with the
converted model's; only then does it become `--out` (the program exits with status 1 if they
differ). An existing `--out` stops the program before any work unless `--overwrite` is given.
"""


import _backend

_backend.start_app()  # before keras is imported

from absl import app, flags, logging

from vit_keras.tools.runs import config_flags

import _common

flags.DEFINE_string("weights", None, "Checkpoint file, Hugging Face folder, hf-hub:REPO_ID, or a "
                    "release name (e.g. augreg_in21k_ft_in1k; needs --model), downloaded once.",
                    required=True)
_common.define_model_output_flags()
flags.DEFINE_string("model", None, "Expected variant (e.g. ViT-B/16 or ViT-B_16); an error if the "
                    "checkpoint holds another architecture. Required with a release name.")
flags.DEFINE_alias("variant", "model")  # the flag's name before every app said --model
flags.DEFINE_list("image_size", None, "Image size: one number or height,width. Default: the "
                  "checkpoint's (a release's file nearest to it is taken).")
config_flags.define_number("num_classes", None, "Classes of the head. Default: the checkpoint's.",
                           bounds="[1, inf)", kind=int)
flags.DEFINE_enum("interpolation", None, ("vit_jax", "bilinear", "bicubic"),
                  "Position-embedding resampling. Default: vit_jax for .npz, bicubic otherwise.")
flags.DEFINE_boolean("antialias", None, "Antialiased bilinear/bicubic resampling. Default: the "
                     "format's (on for timm state dicts).")
config_flags.define_number("num_heads", None, "Attention heads, for timm files of non-standard width.",
                           bounds="[1, inf)", kind=int)
_common.define_checkpoint_flags()
FLAGS = flags.FLAGS


@_common.exit_on_user_error
def main(argv):
    del argv
    import keras  # pylint: disable=import-outside-toplevel

    import vit_keras  # pylint: disable=import-outside-toplevel

    _common.check_model_output(FLAGS.out, FLAGS.overwrite)
    image_size = _common.parse_image_size(FLAGS.image_size) if FLAGS.image_size else None
    _common.check_weights(FLAGS.weights, FLAGS.model, image_size)  # before the download
    model = vit_keras.build_model_from_checkpoint(
        FLAGS.weights, variant=FLAGS.model, image_size=image_size,
        num_classes=FLAGS.num_classes, num_heads=FLAGS.num_heads,
        interpolation=FLAGS.interpolation, antialias=FLAGS.antialias,
        **_common.checkpoint_options())
    try:
        difference = _common.save_checked_model(model, FLAGS.out)
    except _common.ReloadMismatchError as error:
        logging.error("%s", error)
        return 1
    height, width = model.input_shape[1:3]
    print(f"Wrote {FLAGS.out}: {model.name}, {height}x{width}, output {model.output_shape[1:]}, "
          f"{model.count_params():,} parameters, backend {keras.backend.backend()} "
          f"(reloaded: max difference {difference:.2g}).")
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
