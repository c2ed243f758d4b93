"""Builds a hybrid (ResNet + ViT) model, optionally loads a checkpoint, and saves it as `.keras`.

    python apps/build_hybrid.py --variant R50+ViT-B/16 --image_size 384 --num_classes 10 \
        --weights R50+ViT-B_16.npz --out saved_models/r50_vit_b16_384.keras
    python apps/build_hybrid.py --variant R+ViT-Ti/16 --image_size 64 --out tiny.keras --backend torch

Prints the parameter count, the ResNet's feature-map size and the Transformer's sequence length.
`--weights` takes any checkpoint `vit_keras.load_pretrained` reads (the official `.npz`, timm state
dicts); position embeddings are resampled on the feature-map grid when the image size differs, and
a head of another class count is zero-initialised. After saving, the file is reloaded with
`keras.models.load_model` and its logits, and the features under the head, compared with the built
model's; the program exits with status 1 if they differ.
"""

import os

import _backend

_backend.start_app()  # before keras is imported

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402

import _common  # noqa: E402

flags.DEFINE_string("variant", "R50+ViT-B/16", "Hybrid variant, e.g. R50+ViT-B/16, R+ViT-Ti/16.")
flags.DEFINE_list("image_size", ["384"], "Image size: one number or height,width.")
flags.DEFINE_integer("num_classes", 1000, "Classes of the head.")
flags.DEFINE_string("weights", None, "Optional checkpoint to load (.npz, timm state dict).")
flags.DEFINE_enum("hybrid_numerics", "vit_jax", ("vit_jax", "timm"),
                  "Weight-standardisation and GroupNorm epsilons: vit_jax (the original models) or "
                  "timm's.")
flags.DEFINE_string("out", None, "Output .keras file, e.g. saved_models/NAME.keras.", required=True)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import keras  # pylint: disable=import-outside-toplevel

    import vit_keras  # pylint: disable=import-outside-toplevel

    if not FLAGS.out.endswith(".keras"):
        raise app.UsageError(f"--out must end with .keras; got {FLAGS.out!r}.")
    hybrids = [name for name, config in vit_keras.VARIANTS.items() if config.is_hybrid]
    if FLAGS.variant not in hybrids:
        raise app.UsageError(f"--variant {FLAGS.variant!r} is not a hybrid; expected one of "
                             f"{', '.join(hybrids)}.")
    model = vit_keras.build_model(
        FLAGS.variant, image_size=_common.parse_image_size(FLAGS.image_size),
        num_classes=FLAGS.num_classes, hybrid_numerics=FLAGS.hybrid_numerics,
        weights=FLAGS.weights)
    _, rows, cols, channels = model.get_layer("resnet").output.shape
    tokens = model.get_layer("posembed_input").output.shape[1]
    print(f"{FLAGS.variant}: {model.count_params():,} parameters; feature map {rows}x{cols}x"
          f"{channels}; sequence length {tokens}.")

    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    model.save(FLAGS.out)
    try:
        difference = _common.verify_reload(model, FLAGS.out)
    except _common.ReloadMismatchError as error:
        logging.error("%s", error)
        return 1
    print(f"Wrote {FLAGS.out} (backend {keras.backend.backend()}, weights "
          f"{FLAGS.weights or 'initial'}; reloaded: max difference {difference:.2g}).")
    return 0


if __name__ == "__main__":
    app.run(main)
