"""A published release's files checked against what the release table says of them, before any of
them is cached (see `vit_keras.weights.download.fetch_release`).

- A hub release's `config.json`, on its own (`check_config`): the image size, patch size, width,
  depth, heads and MLP size of the release's variant and resolution, and the LayerNorm epsilon and
  GELU of `releases.FAMILY_NUMERICS` (the numerics of each release's family record,
  `vit_keras.weights.families`). A `config.json` that says otherwise would make the weights
  compute something else, or be refused under a name that is not the culprit's.
- The weights, read with that `config.json` beside them (`read_release`): a checkpoint that reads
  whole, finite, with the release variant's architecture, head, representation layer,
  resolution, epsilon and GELU.

What no check here can catch: other weights of the very same architecture (a random or another
run's `.npz` served under a release's name). Only a hash of the content tells those apart; the
download checks the one the server publishes (the Hugging Face hub's sha256, Google Cloud
Storage's md5, see `vit_keras.weights.download_http.published_hashes`), and a mirror that publishes none
is trusted for it.
"""

import dataclasses
import os

from vit_keras import errors
from vit_keras.model import configs, geometry
from vit_keras.model.position_embeddings import RopeSpec
from vit_keras.weights import download, releases
from vit_keras.weights.checkpoints import huggingface, loader, timm


def check_file(path, local, release):
    """Checks the local copy `local` of `release`'s file at `path` on its own (its `config.json`:
    see `check_config`; the weights need the config, see `read_together`)."""
    if path == release.config_path:
        check_config(local, release)


def check_config(path, release):
    """Refuses the `config.json` at `path` unless it describes `release`'s weights.

    Raises:
      vit_keras.errors.CheckpointError: naming each field that differs from the release's, with
        the value expected.
    """
    config = huggingface.read_json(path)
    variant = configs.get_config(release.variant)
    numerics = releases.FAMILY_NUMERICS.get(release.name)
    if release.path.startswith("timm/"):
        problems = _timm_config_problems(config, variant, numerics)
    else:
        problems = _transformers_config_problems(config, variant, release, numerics)
    if problems:
        raise errors.CheckpointError(f"{path!r} does not describe the {release.spec} weights: "
                                     f"{', '.join(problems)}.")


def _transformers_config_problems(config, variant, release, numerics):
    tower = huggingface.vision_config(config)
    hints = huggingface.hints(tower)  # refuses impossible values, fills in the family's defaults
    wanted = {"image_size": release.image_size, "patch_size": variant.patch_size,
              "hidden_size": variant.hidden_size, "num_hidden_layers": variant.num_layers,
              "num_attention_heads": variant.num_heads, "intermediate_size": variant.mlp_dim}
    problems = []
    for field, value in wanted.items():
        found = tower.get(field, value)
        if field == "image_size" and isinstance(found, list) and found == [value, value]:
            continue
        if found != value:
            problems.append(f"{field} {found!r} (expected {value})")
    ratio = tower.get("mlp_ratio")  # DINOv2 states its MLP size as a multiple of the width
    if ratio is not None and ratio * variant.hidden_size != variant.mlp_dim:
        problems.append(f"mlp_ratio {ratio!r} (expected {variant.mlp_dim // variant.hidden_size})")
    if numerics is not None:
        if hints["layer_norm_epsilon"] != numerics["layer_norm_epsilon"]:
            problems.append(f"layer_norm_eps {hints['layer_norm_epsilon']!r} (expected "
                            f"{numerics['layer_norm_epsilon']!r})")
        if hints["gelu"] != numerics["gelu"]:
            problems.append(f"hidden_act {tower.get('hidden_act')!r} (expected the "
                            f"{numerics['gelu']} GELU)")
    return problems


def _numeric(value):
    """A switch as a family's `numerics` states it (rotary embeddings: their kind)."""
    return value.kind if isinstance(value, RopeSpec) else value


def _timm_config_problems(config, variant, numerics):
    architecture = config.get("architecture")
    if not isinstance(architecture, str):
        return [f"architecture {architecture!r} (expected the name of a timm model, which says "
                f"what the weights alone do not)"]
    hints = timm.architecture_hints(architecture)
    problems = []
    widths = hints.get("heads_by_width")  # {width: heads} the name's size has
    if widths is not None and widths.get(variant.hidden_size) != variant.num_heads:
        problems.append(f"architecture {architecture!r} is not {variant.hidden_size} wide with "
                        f"{variant.num_heads} heads")
    for field in numerics or ():
        if _numeric(hints.get(field)) != numerics[field]:
            problems.append(f"architecture {architecture!r} computes with {field} "
                            f"{_numeric(hints.get(field))!r} (expected {numerics[field]!r})")
    features = config.get("num_features", variant.hidden_size)
    if features != variant.hidden_size:
        problems.append(f"num_features {features!r} (expected {variant.hidden_size})")
    return problems


def read_together(files, release):
    """`release`'s weights read with its other files beside them, as they will be cached.

    Args:
      files: each of `release.files` mapped to its local copy (cached, mirrored or a complete
        download).
      release: a `vit_keras.Release`.

    Returns:
      The `vit_keras.weights.checkpoints.Checkpoint` (see `read_release`).

    Raises:
      vit_keras.weights.download.FileRejected: blaming the weights, saying what is wrong.
    """
    if release.config_path is None:  # a single file: read where it is
        return read_release(files[release.path], release)
    with download.as_one_folder(files) as folder:
        staged = os.path.join(folder, release.path.rsplit("/", 1)[-1])
        try:
            checkpoint = read_release(staged, release)
        except ValueError as error:  # named as the caller knows the file, not as staged here
            raise download.FileRejected(
                release.path, str(error).replace(staged, files[release.path])) from error
    return dataclasses.replace(checkpoint, path=files[release.path])


def read_release(path, release):
    """Reads the file at `path` as `release`'s, checking that it is: a checkpoint that reads
    whole (every array's CRC-32, for an `.npz`), finite, with the release variant's architecture,
    head, representation layer and resolution, and for the family's releases the LayerNorm
    epsilon and GELU of `releases.FAMILY_NUMERICS` (from the `config.json` beside it).

    Args:
      path: a checkpoint file.
      release: the `vit_keras.Release` the file should be.

    Returns:
      The `vit_keras.weights.checkpoints.Checkpoint`.

    Raises:
      ValueError: naming the file and what is wrong with it.
    """
    config = configs.get_config(release.variant)
    try:
        checkpoint = loader.read_checkpoint(path, num_heads=config.num_heads)
        arch = loader.architecture(checkpoint)
    except (KeyError, IndexError, TypeError) as error:  # arrays of impossible shapes or types
        raise errors.CheckpointError(f"{path!r} is not a well-formed ViT checkpoint "
                                     f"({type(error).__name__}: {error}).") from error
    fields = {"resnet_layers": None, "resnet_width": 1, **arch["config"]}
    numerics = releases.FAMILY_NUMERICS.get(release.name, {})
    found = {**fields, "classifier": arch["classifier"], "num_classes": arch["num_classes"],
             "representation_size": arch["representation_size"],
             "grid": tuple(arch["grid"]) if arch["grid"] else None,
             **{name: _numeric(arch["switches"][name]) for name in numerics}}
    side = release.image_size // geometry.pixels_per_token(config)
    wanted = {**{name: getattr(config, name) for name in fields},
              "classifier": release.classifier, "num_classes": release.num_classes,
              "representation_size": release.representation_size, "grid": (side, side),
              **numerics}
    if arch["switches"]["position_embedding"] == "none":
        del wanted["grid"]  # rotary embeddings alone: the weights store no grid to check
    differ = [f"{name} {found[name]} (expected {wanted[name]})" for name in wanted
              if found[name] != wanted[name]]
    if differ:
        raise errors.CheckpointError(f"{path!r} does not hold the {release.spec} weights: "
                                     f"{', '.join(differ)}.")
    loader.check_finite(checkpoint.params, path)
    return checkpoint
