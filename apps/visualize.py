r"""Figures of what a ViT learned, as in the paper's Figures 6 and 7.

    python apps/visualize.py --model saved_models/digits.keras --images a.jpg b.png --out figures/

writes to `--out`:
  rollout.png                        attention rollout over each image (needs --images)
  attention_distance.png             mean attention distance per head and layer (needs --images)
  position_embedding_similarity.png  cosine similarity of the position embeddings on the grid
  embedding_filters.png              principal components of the patch-embedding filters
                                     (skipped for hybrids, whose embedding sees a feature map)
  analysis.json                      the numbers behind the figures

`--model` is a `.keras` file saved on any backend, or a variant name such as `ViT-Ti/16` for a
randomly initialised model (to try the app). Images are resized to the model's input size; images
after `--images` that are not flags also count (`--images a.jpg b.png`).

An `--out` that holds any of these files (an earlier run's) stops the app with status 2 before the
model loads, unless `--overwrite`: then the new files replace them and those this run does not
write (the rollout without `--images`) are deleted, so the folder describes one run. Each file is
written whole or not at all.
"""

import _backend

_backend.start_app()  # before keras is imported

import json
import os

from absl import app, flags, logging
import numpy as np

from vit_keras.tools.runs import config_flags

import _common

flags.DEFINE_string("model", None, "A .keras file, or a variant name (random weights).")
flags.DEFINE_list("images", [], "Image files (any format PIL reads).")
flags.DEFINE_string("out", None, "Directory for the figures.")
config_flags.define_number("image_size", 224, "Image size for a variant name (ignored for files).",
                           bounds="[1, inf)", kind=int)
flags.DEFINE_enum("classifier", "token", ["token", "gap"], "Classifier for a variant name.")
config_flags.define_number("num_components", 28, "Principal components of the filters to show.",
                           bounds="[1, inf)", kind=int)
config_flags.define_number("batch_size", 8, "Images per forward pass.", bounds="[1, inf)", kind=int)
config_flags.define_number("seed", 0, "Seed of the random weights for a variant name.",
                           bounds="[0, 4294967295]", kind=int)
flags.DEFINE_bool("overwrite", False,
                  "Replace the figures and analysis.json of an earlier run in --out. Without it, "
                  "an --out that holds any of them stops the app before the model loads.")
flags.mark_flags_as_required(["model", "out"])
FLAGS = flags.FLAGS
OUTPUTS = ("rollout.png", "attention_distance.png", "position_embedding_similarity.png",
           "embedding_filters.png", "analysis.json")


def check_out():
    """The app's files already in --out (an earlier run's): refused without --overwrite."""
    existing = [name for name in OUTPUTS if os.path.lexists(os.path.join(FLAGS.out, name))]
    if existing and not FLAGS.overwrite:
        raise app.UsageError(
            f"--out {FLAGS.out} holds {', '.join(existing)} of an earlier run; pass --overwrite "
            f"to replace {'it' if len(existing) == 1 else 'them'}, or choose another --out.")
    return existing


def load_model(spec):
    """A `.keras` path, or a variant name built with random weights."""
    import keras

    import vit_keras

    if os.path.exists(spec):
        vit_keras.check_keras_file(spec)
        return vit_keras.ViT.of(keras.models.load_model(spec, compile=False))
    try:
        vit_keras.get_config(spec)  # a variant name, in either spelling (ViT-B/16, ViT-B_16)
        is_variant = True
    except ValueError:
        is_variant = False
    if is_variant:
        logging.warning("%s is not a file: building %s with random weights.", spec, spec)
        keras.utils.set_random_seed(FLAGS.seed)
        return vit_keras.build_model(spec, image_size=FLAGS.image_size, classifier=FLAGS.classifier)
    raise ValueError(f"--model {spec!r} is neither an existing .keras file nor a variant name "
                     f"({', '.join(vit_keras.VARIANTS)}).")


def read_images(paths):
    """Decodes every image file (before the slow model load, so a bad file fails at once).

    Returns: a list of PIL images. Raises: ValueError naming a missing or unreadable file.
    """
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"Image file {path!r} does not exist.")
        try:
            with Image.open(path) as image:
                image.load()
                images.append(image.copy())
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
            raise ValueError(f"Cannot read image file {path!r}: it is not a valid image "
                             f"({type(error).__name__}: {error}).") from None
    return images


def resize_images(images, height, width, channels):
    """PIL images → `(n, height, width, channels)` float32 pixels in [0, 255], resized
    bilinearly (aspect ratio not kept)."""
    from PIL import Image

    mode = {1: "L", 3: "RGB"}.get(channels)
    if mode is None:
        raise ValueError(f"The model takes {channels}-channel inputs; only 1 (grey) or 3 (RGB) "
                         f"channel images can be shown.")
    return np.stack([
        np.asarray(image.convert(mode).resize((width, height), Image.BILINEAR),
                   dtype=np.float32).reshape(height, width, channels) for image in images])


def model_inputs(model, images):
    """Pixels in [0, 255] → what the model takes: models built with `include_preprocessing=False`
    take [-1, 1] (the original weights' convention)."""
    return images if model.rescale is not None else images / 127.5 - 1.0


def image_titles(model, inputs, paths):
    """File names, with the predicted class and its probability when the model has a head."""
    names = [os.path.basename(path) for path in paths]
    if not model.heads or model.outputs[0].shape[-1] in (None, 1):
        return names
    import keras

    logits = np.concatenate([  # eager calls: no compilation for a handful of images
        keras.ops.convert_to_numpy(model(inputs[start:start + FLAGS.batch_size], training=False))
        for start in range(0, len(inputs), FLAGS.batch_size)]).astype(np.float64)
    probabilities = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    titles = []
    for name, p in zip(names, probabilities):
        percent = 100 * p.max()  # one decimal below 10%, so that 1/1000 does not read "0%"
        titles.append(f"{name}: class {p.argmax()} ({percent:.{0 if percent >= 10 else 1}f}%)")
    return titles


@_common.exit_on_user_error
def main(argv):
    paths = list(FLAGS.images) + list(argv[1:])
    earlier = check_out()
    pictures = read_images(paths)  # a missing or bad file: a one-line error (exit_on_user_error)

    import vit_keras  # Keras, after the images are known to be readable
    from vit_keras import atomic_files
    from vit_keras.inspection import analysis
    from vit_keras.tools import plots
    from vit_keras.tools.runs import run_folder

    model = load_model(FLAGS.model)
    _, height, width, channels = model.inputs[0].shape
    grid = analysis.token_grid(model)
    token_size = analysis.token_size_pixels(model)
    images = resize_images(pictures, height, width, channels) if paths else None
    os.makedirs(FLAGS.out, exist_ok=True)
    summary = {"model": FLAGS.model, "image_size": [height, width], "grid": list(grid),
               "token_size_pixels": list(token_size), "images": paths}
    written = []

    if images is not None:
        inputs = model_inputs(model, images)
        attentions = vit_keras.attention_scores(model, inputs, batch_size=FLAGS.batch_size)
        rollout = analysis.attention_rollout(
            attentions, grid, class_token="class" in analysis.prefix_tokens(model))
        written.append(plots.rollout_figure(
            images, rollout, os.path.join(FLAGS.out, "rollout.png"),
            titles=image_titles(model, inputs, paths)))
        distances = analysis.mean_attention_distance(attentions, grid, token_size)
        patches = grid[0] * grid[1]
        uniform = analysis.mean_attention_distance(
            np.full((1, 1, 1, patches, patches), 1.0 / patches), grid, token_size)[0, 0]
        written.append(plots.attention_distance_figure(
            distances, os.path.join(FLAGS.out, "attention_distance.png"),
            max_distance=float(np.hypot(height, width)) / 2, uniform_distance=uniform,
            title=f"{model.name}: mean attention distance ({len(images)} images)"))
        summary["mean_attention_distance"] = distances.round(3).tolist()
        summary["uniform_attention_distance"] = round(float(uniform), 3)
    else:
        logging.info("No --images: skipping the rollout and attention-distance figures.")

    similarity = analysis.position_embedding_similarity(analysis.position_embedding(model), grid)
    written.append(plots.position_similarity_figure(
        similarity, os.path.join(FLAGS.out, "position_embedding_similarity.png"),
        title=f"{model.name}: position embedding similarity"))

    kernel = analysis.patch_embedding_kernel(model)
    if kernel.shape[2] in (1, 3):
        components, explained = analysis.embedding_filter_components(kernel, FLAGS.num_components)
        written.append(plots.filter_components_figure(
            components, os.path.join(FLAGS.out, "embedding_filters.png"), explained=explained,
            title=f"{model.name}: embedding filters "
                  f"(first {len(components)} principal components)"))
        summary["filter_explained_variance"] = explained.round(5).tolist()
    else:
        logging.warning("The patch embedding sees %d channels (a hybrid's feature map), not "
                        "pixels: skipping the filter figure.", kernel.shape[2])

    written.append(os.path.join(FLAGS.out, "analysis.json"))
    run_folder.atomic_write_text("{\n" + ",\n".join(f" {json.dumps(key)}: {json.dumps(value)}"
                                                     for key, value in summary.items()) + "\n}\n",
                                 written[-1])
    for name in earlier:  # --overwrite: the earlier run's files this one did not replace
        if os.path.join(FLAGS.out, name) not in written:
            atomic_files.remove_link_or_file(os.path.join(FLAGS.out, name))
    for path in written:
        print(path)


if __name__ == "__main__":
    app.run(main, flags_parser=_backend.parse_flags)
