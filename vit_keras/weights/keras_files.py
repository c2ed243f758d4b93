"""A user's `.keras` file checked before Keras builds anything from it.

`keras.models.load_model` reads the archive's `config.json` whole, builds every layer it describes
(allocating the layer's weights), and only then reads the weights file. So a small file can claim
gigabytes: a `config.json` that inflates to 3 GiB, or a layer whose `mlp_dim` is 20,000,000 in a
1.9 MB file, is memory spent before any error. `check_keras_file` reads only the archive's
directory and its (bounded) `config.json`, and refuses:

- a member whose declared size its compression cannot give, or that would expand more than 100
  times to over 64 MiB (Keras writes its members uncompressed), and a `config.json` over 16 MiB;
- a `config.json` that is not JSON or nests deeper than `MAX_DEPTH` (Keras rebuilds it
  recursively);
- a layer size field (`units`, `filters`, `mlp_dim`, `hidden_size`, heads, kernel sizes, ...)
  beyond `MAX_SIZE`;
- a model whose layers, from their configs and the shapes they were built for, would hold more
  weights than the archive's weights file can store (at the least half a byte each: int4);
  first from the sizes of the layers vit_keras knows, before anything is built, then for every
  layer class as Keras itself sizes it: the model is built inside a `keras.StatelessScope` that
  never initializes its variables, and their shapes are counted (a 17 kB `LSTM(10000)` claims
  400 M weights without allocating one);
- a model Keras cannot build that way (a layer no library registers, a `Lambda` in safe mode).

Every app that loads a user's `.keras` file calls it first.
"""

import math
import os
import zipfile

from vit_keras import errors
from vit_keras.weights.checkpoints import files

CONFIG_MAX_BYTES = 16 << 20
"""The largest `config.json` or `metadata.json` read (a ViT's is tens of kilobytes)."""
MAX_DEPTH = 64
"""The deepest nesting of a `config.json` read (a ViT's is about 10, each nested model adds 4)."""
MAX_SIZE = 1 << 24
"""The largest value of a layer size field (the widest published ViT's MLP is 24576)."""
MAX_BLOCKS = 1024
"""The most encoder blocks (`num_layers`) or ResNet units per stage (`resnet_layers`) a model may
have (the deepest published ViT has 48). Each costs Python objects as it is built, about 0.25 MB
even at width 1: 20,000 blocks took 5 GB and 4 minutes to build before any weight."""
_EXPANSION_FLOOR = 64 << 20
_MAX_EXPANSION = 100
_DEFLATE_MAX_RATIO = 1100
_SIZE_FIELDS = ("units", "filters", "mlp_dim", "hidden_size", "num_heads", "key_dim", "value_dim",
                "input_dim", "output_dim", "num_tokens", "patch_size", "kernel_size",
                "output_shape", "features", "num_units", "width_factor",
                "representation_size", "num_classes", "intermediate_size", "image_size",
                "channels")
_DEPTH_FIELDS = ("num_layers", "resnet_layers")
_METADATA = ("config.json", "metadata.json")


class KerasFileError(errors.UserError, ValueError):
    """A `.keras` file that cannot be loaded safely; the message names it and what is wrong."""


def check_keras_file(path, safe_mode=True):
    """Refuses a `.keras` file that would exhaust memory or recursion when loaded, before Keras
    reads it (see the module docstring). A path that is not a zip archive (a folder, a legacy
    `.h5` file, nothing) is left to Keras, whose error names it.

    Args:
      path: the file.
      safe_mode: as `keras.saving.load_model`'s: whether a `Lambda` layer's code is refused.

    Raises:
      KerasFileError: a `vit_keras.errors.UserError` naming the file and what is wrong with it.
    """
    path = os.fspath(path)
    if not os.path.isfile(path) or not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            _check_members(path, members)
            names = [member.filename for member in members]
            if "config.json" not in names:
                raise KerasFileError(f"{path} has no config.json: it is not a Keras model file.")
            config = files.parse_json(archive.read("config.json"), f"{path}:config.json")
    except (zipfile.BadZipFile, EOFError, NotImplementedError) as error:
        raise KerasFileError(f"{path} is a truncated or corrupt .keras file ({error}).") from error
    except errors.CheckpointError as error:  # config.json is no JSON
        raise KerasFileError(str(error)) from error
    _check_depth(path, config)
    storable = 2 * sum(member.file_size for member in members
                       if member.filename not in _METADATA) + (1 << 20)
    claimed, largest = _weights_claimed(path, config)
    _check_storable(path, f"at least {claimed} weights ({largest} the largest layer)", claimed,
                    storable)
    built = _weights_built(path, config, safe_mode)
    _check_storable(path, f"{built} weights (as Keras builds it)", built, storable)


def _check_storable(path, described, count, storable):
    if count > storable:
        raise KerasFileError(
            f"{path} describes a model of {described}, but its weights file holds at most "
            f"{storable // 2} bytes: the model it describes is not the one it stores. Refusing "
            f"to build it.")


def _weights_built(path, config, safe_mode):
    """The number of weights the model `config` describes holds as Keras builds it, from the
    shapes of the variables it declares inside a `keras.StatelessScope` that never initializes
    them: nothing is allocated, whatever the layer class."""
    import keras  # pylint: disable=import-outside-toplevel
    from keras.src.backend.common import global_state  # pylint: disable=import-outside-toplevel
    from keras.src.saving import serialization_lib  # pylint: disable=import-outside-toplevel

    # Keras keeps the variables a stateless scope declared, to initialize them when the next
    # scope closes: those of this model are taken off that list again, never to be allocated.
    pending = global_state.get_global_attribute("uninitialized_variables", [],
                                                set_to_default=True)
    known = len(pending)
    try:
        with keras.StatelessScope(initialize_variables=False), \
                serialization_lib.ObjectSharingScope():
            model = keras.saving.deserialize_keras_object({**config, "compile_config": None},
                                                          safe_mode=safe_mode)
        return sum(math.prod(variable.shape) for variable in model.weights)
    except Exception as error:  # noqa: BLE001  (whatever a layer's code raises for this config)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise KerasFileError(f"{path} could not be loaded as a Keras model: {reason}") from error
    finally:
        del pending[known:]


def _check_members(path, members):
    for member in members:
        limit = (member.compress_size * (_DEFLATE_MAX_RATIO if member.compress_type else 1)
                 + 1024)
        if member.file_size > limit:
            raise KerasFileError(
                f"{path} is a corrupt .keras file: {member.filename} claims {member.file_size} "
                f"bytes from {member.compress_size} stored ones, more than its compression can "
                f"give.")
        if (member.file_size > _EXPANSION_FLOOR
                and member.file_size > _MAX_EXPANSION * member.compress_size):
            raise KerasFileError(
                f"{path}: {member.filename} expands from {member.compress_size} bytes to "
                f"{member.file_size} (Keras stores its files uncompressed): refusing to load a "
                f"decompression bomb.")
        if member.filename in _METADATA and member.file_size > CONFIG_MAX_BYTES:
            raise KerasFileError(
                f"{path}: {member.filename} is {member.file_size} bytes, over the "
                f"{CONFIG_MAX_BYTES} a model's configuration takes: refusing to read it.")


def _check_depth(path, config):
    stack = [(config, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise KerasFileError(f"{path}: config.json nests deeper than {MAX_DEPTH} levels; no "
                                 f"model's configuration does. Refusing to build it.")
        children = value.values() if isinstance(value, dict) else (
            value if isinstance(value, list) else ())
        stack.extend((child, depth + 1) for child in children)


def _layers(config):
    """Every serialized object of `config` with a `class_name` and a `config` dict, in the file's
    order: its layers, those of nested models included."""
    stack = [config]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if isinstance(value.get("class_name"), str) and isinstance(value.get("config"), dict):
                yield value
            stack.extend(reversed(value.values()))  # in the file's order
        elif isinstance(value, list):
            stack.extend(reversed(value))


def _whole(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _weights_claimed(path, config):
    """The fewest weights the model `config` describes would allocate, and the layer that holds
    the most of them; refuses a size field beyond `MAX_SIZE`."""
    total, largest = 0, (0, None)
    for layer in _layers(config):
        fields = layer["config"]
        name = fields.get("name", layer["class_name"])
        sizes = fields
        if layer["class_name"] == "ViT" and isinstance(fields.get("variant"), dict):
            # A vit_keras.ViT saves its arguments, its variant's sizes among them.
            sizes = {**fields["variant"], **fields}
        for field in (*_SIZE_FIELDS, *_DEPTH_FIELDS):
            limit, what = ((MAX_BLOCKS, f"{MAX_BLOCKS} blocks") if field in _DEPTH_FIELDS
                           else (MAX_SIZE, str(MAX_SIZE)))
            values = sizes.get(field)
            for value in values if isinstance(values, list) else [values]:
                if _whole(value) > limit:
                    raise KerasFileError(
                        f"{path}: layer {name!r} ({layer['class_name']}) has {field} {value}, "
                        f"beyond the {what} of any model vit_keras loads; building it would "
                        f"take more memory than the file could ever fill. Refusing to build it.")
        build = layer.get("build_config")
        shape = build.get("input_shape") if isinstance(build, dict) else None
        count = _layer_weights(layer["class_name"], fields, shape)
        total += count
        largest = max(largest, (count, name), key=lambda pair: pair[0])
    return total, f"{largest[1]!r}, {largest[0]}" if largest[1] else "none"


def _layer_weights(class_name, fields, shape):
    """The fewest weights a layer of `class_name` with `fields` allocates when built for inputs
    of `shape` (0 for a layer not known here): a lower bound, so that no real model is refused."""
    dims = shape if isinstance(shape, list) and all(
        d is None or _whole(d) for d in shape) else []
    width = _whole(dims[-1]) if dims else 1
    width = width or 1

    def get(field):
        return _whole(fields.get(field))

    def kernel():
        size = fields.get("kernel_size")
        sizes = size if isinstance(size, list) else [size]
        return math.prod(_whole(s) for s in sizes) if all(_whole(s) for s in sizes) else 1

    if class_name == "Dense":
        return get("units") * width
    if class_name in ("Conv1D", "Conv2D", "Conv3D", "StdConv2D"):
        return get("filters") * width * kernel()
    if class_name == "Embedding":
        return get("input_dim") * get("output_dim")
    if class_name == "MultiHeadAttention":
        return 3 * get("num_heads") * get("key_dim") * width
    if class_name in ("TransformerBlock", "MlpBlock", "MAPHead"):
        return 2 * get("mlp_dim") * width
    if class_name == "PatchEmbedding":
        return get("hidden_size") * width * get("patch_size") ** 2
    if class_name == "RegisterTokens":
        return get("num_tokens") * width
    if class_name == "AddPositionEmbs":
        return math.prod(_whole(d) or 1 for d in dims[1:]) if dims else 0
    if class_name == "ResidualUnit":  # its 3x3 convolution
        return 9 * get("features") ** 2
    if class_name == "ResNetStage":
        return 9 * get("num_units") * get("features") ** 2
    if class_name == "ViT" and isinstance(fields.get("variant"), dict):
        return _vit_weights(fields)
    return 0


def _vit_weights(fields):
    """The fewest weights a `vit_keras.ViT` of these arguments holds: its blocks' projections and
    MLPs (a SwiGLU's gate not counted), its position embeddings and its head."""
    variant = fields["variant"]
    hidden, mlp_dim = _whole(variant.get("hidden_size")), _whole(variant.get("mlp_dim"))
    patch = _whole(variant.get("patch_size")) or 1
    size = fields.get("image_size")
    sides = size if isinstance(size, list) and len(size) == 2 else [size, size]
    tokens = math.prod(_whole(side) // patch for side in sides)
    if variant.get("position_embedding") == "none":  # rotary embeddings alone: no table
        tokens = 0
    head = _whole(fields.get("num_classes")) if fields.get("include_top", True) else 0
    return (_whole(variant.get("num_layers")) * (4 * hidden ** 2 + 2 * hidden * mlp_dim)
            + (tokens + head) * hidden)
