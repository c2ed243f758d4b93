"""Deployment exports of a trained model, each checked against Keras after it is written.

Three formats, all written from the TensorFlow backend (a `.keras` file holds backend-independent
weights, so a model trained on JAX or torch loads there unchanged; `apps/export.py` does this):

- `saved_model`: a TF Serving SavedModel in the versioned layout `DIR/NAME/VERSION/` with two
  signatures, `serving_default` (float32 pixels) and `serving_bytes` (encoded JPEG/PNG strings).
- `tflite`: a LiteRT flatbuffer of builtin ops only (float32, dynamic-range int8 or float16
  weights).
- `onnx`: an ONNX model for onnxruntime.

Every signature takes raw RGB pixels in [0, 255] (or image files) with a dynamic batch dimension;
preprocessing happens inside the model, as `vit_keras.build_model` puts it there by default. Every
artifact of a classifier returns float32 `logits` and `probabilities` `(batch, num_classes)`; a
SavedModel of a model with class names also returns `top_k_indices` (int32) and `top_k_names`
(string) `(batch, k)`. A backbone without head (`include_top=False`) returns float32 `features`
`(batch, hidden)` alone, verified as features (no top-1 agreement: there are no classes).

A model of dynamic image size takes sides that are whole multiples of its token size, from one
token to `max_image_size` pixels (default: 4 times the size it was built for). The SavedModel's
signatures refuse any other size with an `InvalidArgumentError` that names it (TF Serving returns
it to the client); the LiteRT and ONNX graphs cannot carry that check (their converters drop
assertions), so their callers must keep to it: they ignore the pixels beyond the last whole token
and return NaN for an empty image.

A NaFlex model (`ViT(naflex=True)`) takes patch sequences instead of pixels: `serving_default` has
the inputs `patches` float32 `(batch, N, P*P*C)`, `patch_coord` int32 `(batch, N, 2)` and
`patch_valid` bool `(batch, N)` (`vit_keras.naflex_patches`' layouts), N from 1 to
`max_num_patches` (default: the patches of the model's position grid; longer ones are refused);
`serving_bytes` resizes each encoded image at its own aspect ratio to at most `max_num_patches`
patches in the graph (`vit_keras.tools.data.naflex.naflex_example`). LiteRT takes N =
`max_num_patches` exactly (padded), ONNX any N.

Class names travel as a `class_names.json` (a JSON list of strings, one per output class) beside the
`.keras` file, or from any `.json` list or `.txt` file with one name per line
(`vit_keras.tools.runs.run_folder.load_class_names`).

Exact GELU: TensorFlow computes it as `0.5 * x * erfc(-x / sqrt(2))`. The LiteRT converter fuses
that pattern into its builtin `GELU` op (approximate=False), so no Flex op is needed and the
numerics are unchanged. tf2onnx has no mapping for `Erfc`; this module maps it to `1 - Erf(x)` with
ONNX's own `Erf` (the only difference is float32 rounding of `1 - erf`, about 6e-8 absolute).

Importing this module imports TensorFlow; `import vit_keras` alone does not.
"""

import ctypes
import dataclasses
import errno
import logging
import os
import re
import shutil
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

from vit_keras import atomic_files
from vit_keras.model import ViT
from vit_keras.tools.runs.run_folder import RunFolder, atomic_write_text

FORMATS = ("saved_model", "tflite", "onnx")
QUANTIZATIONS = ("none", "dynamic_int8", "float16")
SERVING_SIGNATURE = "serving_default"
BYTES_SIGNATURE = "serving_bytes"
# Float exports must match Keras' logits (or features) to this fraction of their largest magnitude.
RELATIVE_TOLERANCE = 1e-4
ONNX_OPSET = 17


class ExportVerificationError(RuntimeError):
    """An exported artifact does not reproduce the Keras model within tolerance."""


@dataclasses.dataclass(frozen=True)
class Verification:
    """How one exported entry point compares with Keras on the fixed verification batch.

    `output` is what is compared: `"logits"` of a classifier, or `"features"` of a backbone
    without head. `max_rel_diff` is `max |exported - keras| / max |keras|` over all of it
    (`max_abs_logit` is the denominator). `tolerance` is the bound on it (`None` for quantised
    artifacts, whose agreement is reported but not bounded). `top1_agreement` is the fraction of
    images whose highest logit is the same class; `None` for features, which have no classes.
    """

    artifact: str
    entry_point: str
    max_abs_diff: float
    max_rel_diff: float
    top1_agreement: float | None
    batch_size: int
    tolerance: float | None
    max_abs_logit: float
    output: str = "logits"

    @property
    def passed(self):
        finite = np.isfinite(self.max_abs_diff)
        return bool(finite and (self.tolerance is None or self.max_rel_diff <= self.tolerance))

    def summary(self):
        bound = ("not bounded (quantised)" if self.tolerance is None
                 else f"tolerance {self.tolerance:.0e}")
        verdict = "OK" if self.passed else "FAILED"
        note = ("" if self.max_abs_logit > 0 else
                f" (Keras' {self.output} are all zero, e.g. an untrained zero-initialised head: "
                f"this comparison proves little)")
        agreement = ("" if self.top1_agreement is None
                     else f", top-1 agreement {self.top1_agreement:.1%}")
        return (f"{verdict} {self.artifact} [{self.entry_point}]: max abs diff to Keras "
                f"{self.output} {self.max_abs_diff:.3e}, max rel diff {self.max_rel_diff:.3e} "
                f"({bound}){agreement} on {self.batch_size} images{note}")


def require_tensorflow_backend():
    """Raises unless Keras runs on the TensorFlow backend, which every export needs."""
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            f"vit_keras.tools.export needs the TensorFlow backend but Keras runs on "
            f"{keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow before importing keras and "
            f"load the .keras file there (weights are backend-independent), or run "
            f"`python apps/export.py`, which does this for you.")


def find_class_names(model_path):
    """The class names stored as `class_names.json` beside a `.keras` file, or `None`."""
    return RunFolder.of_model(model_path).read_class_names()


def load_model(model_path):
    """Loads a `.keras` file (trained on any backend) for export, without its training state."""
    require_tensorflow_backend()
    import vit_keras  # noqa: F401  (registers the layers for deserialization)

    vit_keras.check_keras_file(model_path)
    model = keras.saving.load_model(model_path, compile=False)
    try:  # a ViT (adopted when an earlier vit_keras saved it); any other model as it is
        return ViT.of(model)
    except ValueError:
        return model


def float32_model(model):
    """`model` itself, or a float32 copy if any of its layers computes in another dtype.

    A model trained under mixed precision holds float32 weights; it is exported, and verified, in
    float32 (LiteRT cannot lower float16 6-D transposes, and float16 compute cannot meet the 1e-4
    tolerance). Serving precision is chosen by `quantize` instead.
    """
    if all(layer.dtype_policy.name == "float32" for layer in model.layers):
        return model
    if isinstance(model, ViT):
        return model.rebuilt(dtype="float32")
    clone = keras.models.clone_model(model, clone_function=lambda layer: type(layer).from_config(
        {**layer.get_config(), "dtype": "float32"}))
    clone.set_weights(model.get_weights())
    return clone


def is_classifier(model):
    """Whether `model`'s output is class logits: False for a vit_keras backbone built without
    its head (`include_top=False`: pooled features), True for any other model."""
    return not (isinstance(model, ViT) and not model.heads)


def output_name(model):
    """The name of what every artifact of `model` returns first: `"logits"` or `"features"`."""
    return "logits" if is_classifier(model) else "features"


def default_max_image_size(model):
    """The default largest side, in pixels, a model of dynamic image size is served at: 4 times
    the larger side of the size it was built for (16 times its tokens, 256 times its attention
    scores), so that one request cannot ask a server for unbounded memory."""
    rows, cols = model.token_grid
    return 4 * max(rows, cols) * model.token_pixels


def _max_image_size(model, max_image_size):
    """`max_image_size` checked against the model (None: `default_max_image_size`)."""
    if max_image_size is None:
        return default_max_image_size(model)
    step = model.token_pixels
    built = max(model.token_grid) * step
    if int(max_image_size) != max_image_size or max_image_size < built:
        raise ValueError(f"max_image_size must be a whole number of pixels no smaller than the "
                         f"size the model was built for ({built}); got {max_image_size}.")
    return int(max_image_size)


def is_naflex(model):
    """Whether `model` takes NaFlex patch sequences (`ViT(naflex=True)`) instead of pixels."""
    return isinstance(model, ViT) and model.naflex


def naflex_length(model, max_num_patches=None):
    """The longest sequence a NaFlex model's exports serve: `max_num_patches`, by default the
    patches of its position grid (what it was built for)."""
    rows, cols = model.token_grid
    length = rows * cols if max_num_patches is None else max_num_patches
    if int(length) != length or length < 1:
        raise ValueError(f"max_num_patches must be a positive whole number; got {length}.")
    return int(length)


def _naflex_signature(model, length):
    """The three NaFlex inputs' `TensorSpec`s at sequence length `length` (None: any)."""
    width = model.input["patches"].shape[-1]
    return [tf.TensorSpec((None, length, width), tf.float32, name="patches"),
            tf.TensorSpec((None, length, 2), tf.int32, name="patch_coord"),
            tf.TensorSpec((None, length), tf.bool, name="patch_valid")]


def _checked_length(patches, max_num_patches):
    """`patches` `(batch, N, ...)` once N is seen to be from 1 to `max_num_patches`; otherwise
    the graph raises `InvalidArgumentError` naming N."""
    length = tf.shape(patches)[1]
    check = tf.debugging.Assert(tf.logical_and(length >= 1, length <= max_num_patches), [
        f"Sequence refused: NaFlex inputs take from 1 to {max_num_patches} patches (the export's "
        f"max_num_patches); got", length], name="sequence_length_check")
    with tf.control_dependencies([check]):
        return tf.identity(patches)


def _naflex_from_bytes(model, image_bytes, max_num_patches):
    """Encoded images `(batch,)` → their NaFlex inputs at `max_num_patches`, in the graph."""
    from vit_keras.tools.data import naflex

    patch_size = model.token_pixels
    width = model.input["patches"].shape[-1]
    channels = width // (patch_size * patch_size)

    def one(data):
        image = tf.io.decode_image(data, channels=channels, expand_animations=False)
        return naflex.naflex_example(image, patch_size, max_num_patches)

    specs = {spec.name: tf.TensorSpec(spec.shape[1:], spec.dtype)
             for spec in _naflex_signature(model, max_num_patches)}
    return tf.map_fn(one, image_bytes, fn_output_signature=specs)


def naflex_verification_cases(model, max_num_patches=None, batch_size=4, seed=0):
    """`[(label, images, inputs)]` NaFlex exports are checked on: integer-valued float32 images
    `(batch, H, W, C)` of the grid's size, a wide and a tall one, and their NaFlex inputs
    (`naflex_example`) at `naflex_length(model, max_num_patches)`."""
    from vit_keras.tools.data import naflex

    length = naflex_length(model, max_num_patches)
    patch_size, (rows, cols) = model.token_pixels, model.token_grid
    channels = model.input["patches"].shape[-1] // (patch_size * patch_size)
    rng = np.random.default_rng(seed)
    cases = []
    for height, width in ((rows, cols), (max(rows // 2, 1), 3 * cols), (3 * rows, max(cols // 2, 1))):
        size = (height * patch_size, width * patch_size)
        images = rng.integers(0, 256, (batch_size, *size, channels)).astype("float32")
        examples = [naflex.naflex_example(image, patch_size, length) for image in images]
        inputs = {key: tf.stack([example[key] for example in examples]).numpy()
                  for key in examples[0]}
        cases.append((f" at {size[0]}x{size[1]}", images, inputs))
    return cases


def _batch_part(inputs, part):
    """`inputs` (an array or a dict of arrays) cut along the batch to the slice `part`."""
    if isinstance(inputs, dict):
        return {key: value[part] for key, value in inputs.items()}
    return inputs[part]


def is_dynamic(model):
    """Whether `model` takes images of any size (`build_model(..., dynamic_image_size=True)`)."""
    return isinstance(model, ViT) and model.dynamic_image_size


def image_shape(model):
    """`(height, width, channels)` of a model with one image input `(batch, H, W, C)`; height and
    width are `None` for a model of dynamic image size."""
    shape = tuple(model.input_shape) if not isinstance(model.input_shape, list) else None
    if (shape is None or len(shape) != 4 or shape[3] is None
            or (None in shape[1:3] and not is_dynamic(model))):
        raise ValueError(
            f"Export needs a model with one image input of static shape (batch, height, width, "
            f"channels), or one built with dynamic_image_size=True; {model.name!r} has input "
            f"shape {model.input_shape}.")
    return shape[1:]


def verification_sizes(model, max_image_size=None):
    """The image sizes `(height, width)` an export is checked at: the model's own, and for a model
    of dynamic image size also a taller, narrower one and a shorter, wider one (multiples of its
    token size, within `max_image_size`), so the artifact is seen to serve several sizes."""
    height, width, _ = image_shape(model)
    if height is not None:
        return [(height, width)]
    step = model.token_pixels
    rows, cols = model.token_grid
    largest = _max_image_size(model, max_image_size) // step
    sizes = [(rows, cols), (rows + 2, max(cols - 1, 1)), (max(rows // 2, 1), cols + 3)]
    return [(min(r, largest) * step, min(c, largest) * step) for r, c in sizes]


def verification_images(model, batch_size=8, seed=0, size=None):
    """The fixed verification batch: integer-valued float32 pixels `(batch, H, W, C)` in [0, 255],
    at `size` `(H, W)` (default: the first of `verification_sizes`).

    Integer values survive PNG encoding exactly, so `serving_bytes` is checked on the same pixels.
    """
    height, width = size or verification_sizes(model)[0]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (batch_size, height, width, image_shape(model)[2])).astype("float32")


def _verification_batches(model, images, max_image_size=None, max_num_patches=None):
    """`[(label, images, inputs)]` to verify with: the given batch, or one batch per
    verification size (labelled with its size when there are several); `inputs` is what the
    model takes, the images themselves but for a NaFlex model (`naflex_verification_cases`)."""
    if is_naflex(model):
        if images is not None:
            raise ValueError("A NaFlex model is verified on its own cases "
                             "(naflex_verification_cases); give no images.")
        return naflex_verification_cases(model, max_num_patches)
    if images is not None:
        return [("", np.asarray(images, "float32"), np.asarray(images, "float32"))]
    sizes = verification_sizes(model, max_image_size)
    return [(f" at {h}x{w}" if len(sizes) > 1 else "", batch, batch) for h, w in sizes
            for batch in [verification_images(model, size=(h, w))]]


def _check_class_names(model, class_names):
    if class_names is not None and not is_classifier(model):
        raise ValueError(
            f"{model.name!r} has no classification head (it outputs features), so class names "
            f"do not apply; export it without them.")
    num_classes = model.output_shape[-1]
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(
            f"Got {len(class_names)} class names for a model with {num_classes} outputs; give one "
            f"name per output class, in class-index order.")


def _outputs(model, images, class_names=None, top_k=5):
    """The signature outputs for a batch of raw pixels: a classifier's logits, probabilities and
    top-k, or a backbone's features."""
    values = tf.cast(model(images, training=False), tf.float32)
    if not is_classifier(model):
        return {"features": values}
    logits = values
    outputs = {"logits": logits, "probabilities": tf.nn.softmax(logits, axis=-1)}
    if class_names:
        indices = tf.math.top_k(logits, k=min(top_k, len(class_names))).indices
        outputs["top_k_indices"] = indices
        outputs["top_k_names"] = tf.gather(tf.constant(class_names), indices)
    return outputs


def _checked_image_size(images, step, max_image_size):
    """`images` `(batch, H, W, C)` of a model of dynamic image size, once `H` and `W` are seen to
    be whole multiples of `step` (the token size) from `step` to `max_image_size`; otherwise the
    graph raises `InvalidArgumentError` naming the size. Without it a side of 17 pixels would
    give the logits of its first 16 silently, an empty image NaN, and a large one any memory."""
    height, width = tf.shape(images)[1], tf.shape(images)[2]
    fits = tf.reduce_all(tf.stack([height >= step, width >= step, height % step == 0,
                                   width % step == 0, height <= max_image_size,
                                   width <= max_image_size]))
    check = tf.debugging.Assert(fits, [
        f"Image size refused: height and width must be whole multiples of {step} pixels from "
        f"{step} to {max_image_size} (the export's max_image_size); got height", height,
        "width", width], name="image_size_check")
    with tf.control_dependencies([check]):
        return tf.identity(images)


def _decode_images(image_bytes, height, width, channels, step=None, max_image_size=None):
    """Encoded JPEG/PNG/GIF/BMP strings `(batch,)` → float32 pixels `(batch, H, W, C)`, 0..255.

    With `height` and `width` `None` (a model of dynamic image size), every image of the batch is
    resized to the first image's size rounded to the nearest multiple of `step` (the token size);
    a rounded size beyond `max_image_size` pixels a side is refused (`InvalidArgumentError`).
    """
    if height is None:
        first = tf.shape(tf.io.decode_image(image_bytes[0], channels=channels,
                                            expand_animations=False))
        size = tf.maximum(tf.cast(tf.round(first[:2] / step), tf.int32), 1) * step
        check = tf.debugging.Assert(tf.reduce_all(size <= max_image_size), [
            f"Image size refused: the first image rounds to more than {max_image_size} pixels a "
            f"side (the export's max_image_size); send smaller images. Rounded height and width:",
            size], name="image_size_check")
        with tf.control_dependencies([check]):
            size = tf.identity(size)
    else:
        size = (height, width)

    def decode(data):
        image = tf.io.decode_image(data, channels=channels, expand_animations=False)
        image = tf.image.resize(image, size, method="bilinear")
        return tf.ensure_shape(tf.cast(image, tf.float32), (height, width, channels))

    return tf.map_fn(decode, image_bytes,
                     fn_output_signature=tf.TensorSpec((height, width, channels), tf.float32))


def _archive(model, class_names=None, top_k=5, with_bytes=True, max_image_size=None,
             check_sizes=True, max_num_patches=None):
    """A `keras.export.ExportArchive` holding the serving signatures of `model`; for a model of
    dynamic image size, with `check_sizes`, the signatures refuse sizes it cannot serve
    (`_checked_image_size`)."""
    if is_naflex(model):
        return _naflex_archive(model, class_names, top_k, with_bytes, max_num_patches,
                               check_sizes)
    height, width, channels = image_shape(model)
    step = None
    check = tf.identity
    if height is None:
        step = model.token_pixels
        max_image_size = _max_image_size(model, max_image_size)
        if check_sizes:
            def check(images):
                return _checked_image_size(images, step, max_image_size)
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(
        SERVING_SIGNATURE, lambda images: _outputs(model, check(images), class_names, top_k),
        input_signature=[tf.TensorSpec((None, height, width, channels), tf.float32, name="images")])
    if with_bytes:
        archive.add_endpoint(
            BYTES_SIGNATURE,
            lambda image_bytes: _outputs(
                model, _decode_images(image_bytes, height, width, channels, step, max_image_size),
                class_names, top_k),
            input_signature=[tf.TensorSpec((None,), tf.string, name="image_bytes")])
    return archive


def _naflex_archive(model, class_names, top_k, with_bytes, max_num_patches, variable_length):
    """`_archive` of a NaFlex model: patch sequences of any length up to `max_num_patches`
    (`variable_length`), or of that length exactly (LiteRT's static shapes)."""
    length = naflex_length(model, max_num_patches)
    archive = keras.export.ExportArchive()
    archive.track(model)

    def serve(patches, patch_coord, patch_valid):
        if variable_length:
            patches = _checked_length(patches, length)
        inputs = {"patches": patches, "patch_coord": patch_coord, "patch_valid": patch_valid}
        return _outputs(model, inputs, class_names, top_k)

    archive.add_endpoint(SERVING_SIGNATURE, serve, input_signature=_naflex_signature(
        model, None if variable_length else length))
    if with_bytes:
        archive.add_endpoint(
            BYTES_SIGNATURE,
            lambda image_bytes: _outputs(model, _naflex_from_bytes(model, image_bytes, length),
                                         class_names, top_k),
            input_signature=[tf.TensorSpec((None,), tf.string, name="image_bytes")])
    return archive


def export_saved_model(model, export_dir, class_names=None, top_k=5, max_image_size=None,
                       max_num_patches=None):
    """Writes a TF Serving SavedModel to `export_dir` (the `.../NAME/VERSION` folder).

    Signatures:
      `serving_default`: `images` float32 `(batch, H, W, C)` raw pixels in [0, 255]; `(batch,
        None, None, C)` for a model of dynamic image size: sides whole multiples of its token
        size, from one token to `max_image_size` pixels, others refused (`InvalidArgumentError`).
      `serving_bytes`: `image_bytes` string `(batch,)` of encoded images, decoded and resized to
        `(H, W)` (bilinear) in the graph; for a model of dynamic image size, to the first image's
        size rounded to a multiple of the token size, refused beyond `max_image_size`.
    Both return `logits`, `probabilities` float32 `(batch, num_classes)`, and with `class_names`
    `top_k_indices` int32 and `top_k_names` string `(batch, min(top_k, num_classes))`; for a
    backbone without head, `features` float32 `(batch, hidden)` alone.
    `max_image_size`: default `default_max_image_size(model)`; ignored for a fixed-size model.
    A NaFlex model's signatures take patch sequences and images at `max_num_patches`
    (the module's docstring).
    """
    require_tensorflow_backend()
    _check_class_names(model, class_names)
    _archive(model, class_names, top_k, max_image_size=max_image_size,
             max_num_patches=max_num_patches).write_out(export_dir, verbose=False)
    return export_dir


def _litert_converter(saved_model_dir, quantize):
    converter = tf.lite.TFLiteConverter.from_saved_model(
        saved_model_dir, signature_keys=[SERVING_SIGNATURE])
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]  # no Flex ops
    if quantize != "none":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]  # dynamic-range int8 weights
    if quantize == "float16":
        converter.target_spec.supported_types = [tf.float16]
    return converter


def export_litert(model, path, quantize="none", max_num_patches=None):
    """Writes a LiteRT (`.tflite`) model of builtin ops only.

    Signature `serving_default`: `images` float32 `(batch, H, W, C)` raw pixels → `logits`,
    `probabilities` float32 `(batch, num_classes)` (a backbone without head: `features`).
    `quantize`: `"none"` (float32), `"dynamic_int8"` (int8 weights, float activations) or
    `"float16"` (float16 weights). A model of dynamic image size is not checked for the sizes it
    is fed (LiteRT has no assertion op): see the module's docstring. A NaFlex model takes
    `naflex_length(model, max_num_patches)` patches exactly.
    """
    require_tensorflow_backend()
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"Unknown quantization {quantize!r}; expected one of {QUANTIZATIONS}.")
    with tempfile.TemporaryDirectory() as saved_model_dir:
        _archive(model, with_bytes=False, check_sizes=False,
                 max_num_patches=max_num_patches).write_out(saved_model_dir, verbose=False)
        try:
            flatbuffer = _litert_converter(saved_model_dir, quantize).convert()
        except Exception as error:
            raise RuntimeError(
                f"The LiteRT converter could not lower {model.name!r} to builtin ops only (Flex / "
                f"Select-TF ops are not allowed): {error}") from error
    atomic_files.write_bytes(flatbuffer, path)
    return path


def _erfc_as_one_minus_erf(ctx, node, name, args):
    """tf2onnx handler: TF's `Erfc(x)` (used by exact GELU) → ONNX `1 - Erf(x)`.

    tf2onnx calls custom handlers as `(graph, node, node_name, extra_args)`; the node is rewritten
    in place into `Sub(1, Erf(x))`.
    """
    from tf2onnx import utils

    dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.input[0]))
    erf = ctx.make_node("Erf", [node.input[0]], op_name_scope=node.name)
    one = ctx.make_const(utils.make_name(f"{node.name}/one"), np.array(1, dtype))
    node.type = "Sub"
    ctx.replace_inputs(node, [one.output[0], erf.output[0]])


def export_onnx(model, path, opset=ONNX_OPSET):
    """Writes an ONNX model with a dynamic batch dimension.

    Input `images` float32 `(batch, H, W, C)` raw pixels → `logits`, `probabilities` float32
    `(batch, num_classes)` (a backbone without head: `features`). The graph is converted by
    tf2onnx from the same function the SavedModel serves, without its size check (tf2onnx drops
    assertions); `Erfc` (exact GELU) becomes `1 - Erf`.
    """
    require_tensorflow_backend()
    import tf2onnx

    logging.getLogger("tf2onnx").setLevel(logging.ERROR)
    if is_naflex(model):  # patch sequences of any length
        height = width = None
        signature = _naflex_signature(model, None)
        serve = tf.function(lambda patches, patch_coord, patch_valid: _outputs(model, {
            "patches": patches, "patch_coord": patch_coord, "patch_valid": patch_valid}),
            input_signature=signature)
    else:
        height, width, channels = image_shape(model)
        signature = [tf.TensorSpec((None, height, width, channels), tf.float32, name="images")]
        serve = tf.function(lambda images: _outputs(model, images), input_signature=signature)
    model_proto, _ = tf2onnx.convert.from_function(
        serve, input_signature=signature, opset=opset,
        custom_op_handlers={"Erfc": (_erfc_as_one_minus_erf, [])})
    # tf2onnx names dynamic dimensions "unk__N".
    for value in (*model_proto.graph.input, *model_proto.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    if is_naflex(model):
        for value in model_proto.graph.input:
            value.type.tensor_type.shape.dim[1].dim_param = "patches"
    elif height is None:
        for axis, name in ((1, "height"), (2, "width")):
            model_proto.graph.input[0].type.tensor_type.shape.dim[axis].dim_param = name
    atomic_files.write_bytes(model_proto.SerializeToString(), path)
    return path


def _compare(artifact, entry_point, values, reference, tolerance, output="logits"):
    """A `Verification` of an artifact's `output` ("logits" or "features") against Keras'."""
    values, reference = np.asarray(values), np.asarray(reference)
    if values.shape != reference.shape:
        raise ExportVerificationError(
            f"{artifact} [{entry_point}] returned {output} of shape {values.shape}; Keras "
            f"returns {reference.shape}.")
    max_abs = float(np.max(np.abs(values - reference)))
    max_value = float(np.max(np.abs(reference)))
    agreement = (float(np.mean(np.argmax(values, -1) == np.argmax(reference, -1)))
                 if output == "logits" else None)
    return Verification(artifact, entry_point, max_abs, max_abs / max(max_value, 1e-6), agreement,
                        len(reference), tolerance, max_value, output)


def _in_two_batches(run, images):
    """Runs `images` as batches of 1 and of the rest, which also proves the batch is dynamic."""
    count = len(next(iter(images.values()))) if isinstance(images, dict) else len(images)
    if count < 2:
        return run(images)
    return np.concatenate([run(_batch_part(images, slice(0, 1))),
                           run(_batch_part(images, slice(1, None)))])


def _named_inputs(inputs):
    """Keyword arguments of a signature: `images=...`, or a NaFlex model's three inputs."""
    return dict(inputs) if isinstance(inputs, dict) else {"images": inputs}


def verify_saved_model(export_dir, model, images=None, max_image_size=None, max_num_patches=None):
    """Reloads a SavedModel with `tf.saved_model.load` and checks both signatures against Keras,
    on `images` or at every `verification_sizes` size (a NaFlex model: on
    `naflex_verification_cases`, the bytes signature on the images they were cut from)."""
    loaded = tf.saved_model.load(export_dir)
    serving = loaded.signatures[SERVING_SIGNATURE]
    by_bytes = loaded.signatures[BYTES_SIGNATURE]
    output = output_name(model)

    def from_inputs(x):
        return serving(**{k: tf.constant(v) for k, v in _named_inputs(x).items()})[output].numpy()

    def from_png(x):
        png = tf.stack([tf.io.encode_png(tf.cast(image, tf.uint8)) for image in x])
        return by_bytes(image_bytes=png)[output].numpy()

    verifications = []
    for label, batch, inputs in _verification_batches(model, images, max_image_size,
                                                      max_num_patches):
        reference = keras.ops.convert_to_numpy(model(inputs, training=False))
        verifications += [
            _compare(export_dir, SERVING_SIGNATURE + label, _in_two_batches(from_inputs, inputs),
                     reference, RELATIVE_TOLERANCE, output),
            _compare(export_dir, f"{BYTES_SIGNATURE} (PNG){label}",
                     _in_two_batches(from_png, batch), reference, RELATIVE_TOLERANCE, output),
        ]
    return verifications


def litert_interpreter(path):
    """An `ai_edge_litert` interpreter for a `.tflite` file."""
    from ai_edge_litert.interpreter import Interpreter

    return Interpreter(model_path=path)


def litert_ops(path):
    """The operator names in a `.tflite` file (Flex ops appear as `Flex...` / `DELEGATE`)."""
    # ai_edge_litert exposes no public op listing; `_get_ops_details` is the interpreter's own.
    return sorted({op["op_name"] for op in litert_interpreter(path)._get_ops_details()})


def verify_litert(path, model, images=None, quantize="none", max_image_size=None,
                  max_num_patches=None):
    """Runs a `.tflite` file in `ai_edge_litert`'s Interpreter and checks it against Keras."""
    runner = litert_interpreter(path).get_signature_runner(SERVING_SIGNATURE)
    tolerance = RELATIVE_TOLERANCE if quantize == "none" else None
    output = output_name(model)
    verifications = []
    for label, _, inputs in _verification_batches(model, images, max_image_size,
                                                  max_num_patches):
        reference = keras.ops.convert_to_numpy(model(inputs, training=False))
        values = _in_two_batches(lambda x: runner(**_named_inputs(x))[output], inputs)
        verifications.append(_compare(path, f"{SERVING_SIGNATURE}, quantize={quantize}{label}",
                                      values, reference, tolerance, output))
    return verifications


def verify_onnx(path, model, images=None, max_image_size=None, max_num_patches=None):
    """Runs an `.onnx` file in onnxruntime and checks it against Keras."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    output = output_name(model)
    verifications = []
    for label, _, inputs in _verification_batches(model, images, max_image_size,
                                                  max_num_patches):
        reference = keras.ops.convert_to_numpy(model(inputs, training=False))
        values = _in_two_batches(lambda x: session.run([output], _named_inputs(x))[0], inputs)
        verifications.append(_compare(path, "onnxruntime" + label, values, reference,
                                      RELATIVE_TOLERANCE, output))
    return verifications


def verify_artifact(path, format, model, images=None, quantize="none", max_image_size=None,
                    max_num_patches=None):
    """Reloads an exported artifact in its own runtime; a list of `Verification`s against Keras
    (at the sizes `verification_sizes(model, max_image_size)` unless `images` are given; a
    NaFlex model on `naflex_verification_cases(model, max_num_patches)`)."""
    if format == "saved_model":
        return verify_saved_model(path, model, images, max_image_size, max_num_patches)
    if format == "tflite":
        return verify_litert(path, model, images, quantize, max_image_size, max_num_patches)
    return verify_onnx(path, model, images, max_image_size, max_num_patches)


def _next_version(model_dir):
    versions = [int(v) for v in os.listdir(model_dir) if v.isdigit()] if os.path.isdir(
        model_dir) else []
    return max(versions, default=0) + 1


def export_path(format, out_dir, name, version=None, quantize="none"):
    """Where `export` writes an artifact: `out_dir/name/version` (`saved_model`; by default the
    next version), `out_dir/name[_quantize].tflite` or `out_dir/name.onnx`."""
    if format == "saved_model":
        model_dir = os.path.join(out_dir, name)
        return os.path.join(model_dir, str(_next_version(model_dir) if version is None
                                           else int(version)))
    if format == "tflite":
        return os.path.join(out_dir, f"{name}{'' if quantize == 'none' else '_' + quantize}.tflite")
    return os.path.join(out_dir, f"{name}.onnx")


def labels_path(out_dir, name):
    """The class names file written beside `tflite` and `onnx` artifacts, one name per line."""
    return os.path.join(out_dir, f"{name}.labels.txt")


def _labels_text(class_names):
    return "".join(f"{name}\n" for name in class_names)


def existing_outputs(format, out_dir, name, version=None, quantize="none", class_names=None):
    """The files `export` would replace: the artifact, and a labels file of other class names.

    Raises `NotADirectoryError` when `out_dir` is a file."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(f"The export folder {out_dir} is a file; give the folder the "
                                 f"exports go in (it is created if missing).")
    found = []
    path = export_path(format, out_dir, name, version, quantize)
    if os.path.exists(path):
        found.append(path)
    labels = labels_path(out_dir, name)
    if format != "saved_model" and class_names and os.path.exists(labels):
        with open(labels, encoding="utf-8") as f:
            if f.read() != _labels_text(class_names):
                found.append(labels)
    return found


def _write_labels(path, class_names):
    if class_names:  # a new file renamed into place: a link at `path` is replaced, not followed
        atomic_write_text(_labels_text(class_names), path)


def _clear_staging(staged):
    """Removes what a killed export (or anyone) left at the staging name, a link included (its
    target untouched), so the exporters, which follow links, write a new file or folder there."""
    if os.path.islink(staged) or os.path.isfile(staged):
        os.remove(staged)
    elif os.path.isdir(staged):
        shutil.rmtree(staged)


# `NAME/VERSION.replaced-PID`: a SavedModel version moved aside by `_publish` where folders cannot
# be exchanged, between its two renames.
_REPLACED = re.compile(r"^(\d+)\.replaced-\d+$")


def _recover_replaced_versions(model_dir):
    """Undoes what an export killed inside `_publish` left in a SavedModel's folder: a version
    moved aside whose place is empty is put back (it is the version being served), and one whose
    place is taken again is deleted."""
    if not os.path.isdir(model_dir):
        return
    for name in sorted(os.listdir(model_dir)):
        match = _REPLACED.match(name)
        if not match:
            continue
        aside, version = os.path.join(model_dir, name), os.path.join(model_dir, match.group(1))
        if not os.path.lexists(version):
            os.replace(aside, version)
        else:
            _clear_staging(aside)


def _exchange(first, second):
    """Swaps two paths in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where the system or
    the filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if (
        sys.platform.startswith("linux")) else None
    if renameat2 is None:
        return False
    at_cwd, rename_exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), first, None, second)


def _publish(staged, path):
    """Moves a verified artifact into place; an existing one is replaced (`overwrite`).

    A file replaces a file (or a link) in one `os.replace`. A SavedModel version folder and the
    one it replaces are exchanged in one step where the system can (Linux), so a server watching
    the folder always finds a whole version, and the old one, now at the staging name no server
    loads, is deleted. Elsewhere the old version is moved aside to `VERSION.replaced-PID` first;
    the next export into the model's folder puts it back if a kill came between the two renames
    (`_recover_replaced_versions`)."""
    if not os.path.isdir(staged) or not os.path.lexists(path):
        os.replace(staged, path)
        return
    if _exchange(staged, path):
        _clear_staging(staged)  # the old version
        return
    replaced = f"{path}.replaced-{os.getpid()}"
    os.replace(path, replaced)
    os.replace(staged, path)
    _clear_staging(replaced)


def export(model, format, out_dir, *, name, version=None, quantize="none", class_names=None,
           top_k=5, verify=True, images=None, overwrite=False, max_image_size=None,
           max_num_patches=None):
    """Exports `model` in one format under `out_dir`, then reloads and verifies the artifact.

    Args:
      model: a Keras model (on the TensorFlow backend) with one image input of raw pixels; a
        mixed-precision model is exported in float32 (`float32_model`).
      format: `"saved_model"`, `"tflite"` or `"onnx"`.
      out_dir: the root folder (created if missing). `saved_model` writes
        `out_dir/name/version/`; `tflite` writes `out_dir/name.tflite`
        (`out_dir/name_{quantize}.tflite` when quantised); `onnx` writes `out_dir/name.onnx`
        (`export_path`). With class names, `tflite` and `onnx` also write
        `out_dir/name.labels.txt`.
      name: the model name (TF Serving's `MODEL_NAME`, and the file stem).
      version: the SavedModel version folder; by default one more than the highest present.
      quantize: `"none"`, or for `tflite` `"dynamic_int8"` / `"float16"`.
      class_names: optional list of `num_classes` names (SavedModel `top_k_names`, labels
        files); none for a backbone without head, whose artifacts return `features`.
      top_k: how many classes `top_k_indices` / `top_k_names` list.
      verify: reload the artifact in its runtime and compare with Keras (raise beyond tolerance).
      images: the verification batch; `verification_images(model)` by default.
      overwrite: replace an existing artifact (and a labels file of other class names) once the
        new one is verified; without it, they are refused before anything is written.
      max_image_size: for a model of dynamic image size, the largest side in pixels its
        SavedModel serves (larger ones are refused); default `default_max_image_size(model)`, 4
        times the size it was built for. LiteRT and ONNX graphs cannot check it.
      max_num_patches: for a NaFlex model, the longest patch sequence its SavedModel serves
        (longer ones are refused), the budget `serving_bytes` resizes images to, and LiteRT's
        one sequence length; default `naflex_length(model)`, the patches of its position grid.

    Returns:
      `(path, verifications)`: the artifact's path and a list of `Verification`s (empty if
      `verify=False`).

    Raises:
      FileExistsError: the artifact (a file, or the SavedModel version) or a labels file of other
        class names exists, and `overwrite` is False.
      NotADirectoryError: `out_dir` is a file.
      ExportVerificationError: an artifact differs from Keras beyond `RELATIVE_TOLERANCE`
        (float exports) or returns non-finite logits.
    """
    require_tensorflow_backend()
    if format not in FORMATS:
        raise ValueError(f"Unknown export format {format!r}; expected one of {FORMATS}.")
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"Unknown quantization {quantize!r}; expected one of {QUANTIZATIONS}.")
    if quantize != "none" and format != "tflite":
        raise ValueError(f"Quantization {quantize!r} applies to the tflite format only, not "
                         f"{format!r}; use --quantize none.")
    _check_class_names(model, class_names)
    if is_dynamic(model):
        max_image_size = _max_image_size(model, max_image_size)
    if is_naflex(model):
        max_num_patches = naflex_length(model, max_num_patches)
    elif max_num_patches is not None:
        raise ValueError(f"max_num_patches is for NaFlex models; {model.name!r} takes images.")
    if format == "saved_model":
        _recover_replaced_versions(os.path.join(out_dir, name))
    existing = existing_outputs(format, out_dir, name, version, quantize, class_names)
    if existing and not overwrite:
        raise FileExistsError(
            f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; export "
            f"under another name, folder or version, or pass overwrite=True to replace "
            f"{'it' if len(existing) == 1 else 'them'}.")
    model = float32_model(model)
    os.makedirs(out_dir, exist_ok=True)
    path = export_path(format, out_dir, name, version, quantize)
    # Written under a name no runtime picks up (TF Serving loads numeric folders only) and moved
    # into place once verified, so a model server watching out_dir never sees a bad artifact.
    staged = path + ".unverified"
    _clear_staging(staged)
    if format == "saved_model":
        export_saved_model(model, staged, class_names, top_k, max_image_size, max_num_patches)
    elif format == "tflite":
        export_litert(model, staged, quantize, max_num_patches)
    else:
        export_onnx(model, staged)
    verifications = []
    if verify:
        verifications = [dataclasses.replace(v, artifact=path)
                         for v in verify_artifact(staged, format, model, images, quantize,
                                                  max_image_size, max_num_patches)]
    failed = [v for v in verifications if not v.passed]
    if failed:
        raise ExportVerificationError(
            "The exported artifact does not reproduce the Keras model:\n"
            + "\n".join(v.summary() for v in failed)
            + f"\nFloat exports must match Keras' {output_name(model)} within a relative "
              f"difference of {RELATIVE_TOLERANCE:.0e}. The artifact was left at {staged} for "
              f"inspection.")
    _publish(staged, path)
    if format != "saved_model":
        _write_labels(labels_path(out_dir, name), class_names)
    return path, verifications
