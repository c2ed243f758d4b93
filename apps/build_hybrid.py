"""Builds a hybrid (ResNet + ViT) model, optionally loads a checkpoint, and saves it as `.keras`.

    python apps/build_hybrid.py --model R50+ViT-B/16 --image_size 384 --num_classes 10 \
        --weights R50+ViT-B_16.npz --out saved_models/r50_vit_b16_384.keras
    python apps/build_hybrid.py --model R+ViT-Ti/16 --image_size 64 --out tiny.keras --backend torch
    python apps/build_hybrid.py --model R26+ViT-S/32 --weights augreg_in21k_ft_in1k \
        --out saved_models/r26_s32_224.keras

`--model` names the hybrid variant (`--variant`, its old name, is still accepted). Prints the
parameter count, the ResNet's feature-map size and the Transformer's sequence length.
`--weights` takes any checkpoint `vit_keras.load_pretrained` reads (the official `.npz`, timm state
dicts) or a published release by name (imagenet21k, imagenet21k+imagenet2012, augreg_in21k,
augreg_in21k_ft_in1k; `vit_keras.list_weights("R50+ViT-B/16")` lists a variant's): its file
nearest `--image_size` is downloaded once into $VIT_KERAS_HOME (default $KERAS_HOME/vit_keras) or
read from the mirror VIT_KERAS_WEIGHTS_MIRROR names, and `--image_size` and `--num_classes`
default to the release's; offline, the app exits with status 2 and says where to place the file.
Position embeddings are resampled on the feature-map grid when the image size differs, and
a head of another class count is zero-initialised. The model is saved under a temporary name,
reloaded with `keras.models.load_model` and its logits, and the features under the head, compared
with the built model's; only then does it become `--out` (the program exits with status 1 if they
differ). An existing `--out` stops the program before any work unless `--overwrite` is given.
"""


import _backend

_backend.start_app()  # before keras is imported

from absl import app, flags, logging

from vit_keras.tools.runs import config_flags

import _common

flags.DEFINE_string("model", "R50+ViT-B/16", "Hybrid variant, e.g. R50+ViT-B/16, R+ViT-Ti/16 "
                    "(or the official spelling R50+ViT-B_16).")
flags.DEFINE_alias("variant", "model")  # the flag's name before every app said --model
flags.DEFINE_list("image_size", None, "Image size: one number or height,width. Default: the "
                  "release's with a release name in --weights, else 384.")
config_flags.define_number("num_classes", None, "Classes of the head. Default: the release's with a "
                           "release name in --weights, else 1000.", bounds="[1, inf)", kind=int)
flags.DEFINE_string("weights", None, "Optional checkpoint to load (.npz, timm state dict) or a "
                    "release name (e.g. augreg_in21k_ft_in1k), downloaded once.")
flags.DEFINE_enum("hybrid_numerics", "vit_jax", ("vit_jax", "timm"),
                  "Weight-standardisation and GroupNorm epsilons: vit_jax (the original models) or "
                  "timm's.")
_common.define_model_output_flags()
FLAGS = flags.FLAGS


@_common.exit_on_user_error
def main(argv):
    del argv
    import keras  # pylint: disable=import-outside-toplevel

    import vit_keras  # pylint: disable=import-outside-toplevel

    _common.check_model_output(FLAGS.out, FLAGS.overwrite)
    hybrids = [name for name, config in vit_keras.VARIANTS.items() if config.is_hybrid]
    try:
        variant = vit_keras.get_config(FLAGS.model).name
    except ValueError:
        variant = FLAGS.model
    if variant not in hybrids:
        raise app.UsageError(f"--model {FLAGS.model!r} is not a hybrid; expected one of "
                             f"{', '.join(hybrids)}.")
    image_size = _common.parse_image_size(FLAGS.image_size) if FLAGS.image_size else None
    release = _common.check_weights(FLAGS.weights, variant, image_size)  # reads nothing yet
    if release is None:  # no weights, or a file: the defaults of the paper's fine-tuning
        image_size = 384 if image_size is None else image_size
        num_classes = 1000 if FLAGS.num_classes is None else FLAGS.num_classes
    else:  # build_model takes the release's for what is not given
        num_classes = FLAGS.num_classes
    model = vit_keras.build_model(
        variant, image_size=image_size, num_classes=num_classes,
        hybrid_numerics=FLAGS.hybrid_numerics, weights=FLAGS.weights)
    _, rows, cols, channels = model.stem.output.shape
    tokens = model.position_embedding.output.shape[1]
    height, width = model.input_shape[1:3]
    print(f"{variant}: {model.count_params():,} parameters; {height}x{width} images, "
          f"{model.output_shape[-1]} classes; feature map {rows}x{cols}x{channels}; sequence "
          f"length {tokens}.")

    try:
        difference = _common.save_checked_model(model, FLAGS.out)
    except _common.ReloadMismatchError as error:
        logging.error("%s", error)
        return 1
    source = f" ({release.path} at {release.image_size} px)" if release else ""
    print(f"Wrote {FLAGS.out} (backend {keras.backend.backend()}, weights "
          f"{FLAGS.weights or 'initial'}{source}; reloaded: max difference {difference:.2g}).")
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
