"""Class names of the published heads: ImageNet-1k's ship with the package, ImageNet-21k's
are fetched once into the weights cache.

Both lists are in head order: row `i` of a head's kernel scores class `i`. ImageNet-1k's order
is the ILSVRC-2012 synsets sorted by WordNet id (the order of `tensorflow_datasets`' `imagenet2012`
and of every published 1000-class head); each name is the synset's WordNet lemmas.
"""

import functools
import os

from vit_keras import errors
from vit_keras.weights import download, releases

_IMAGENET2012 = os.path.join(os.path.dirname(__file__), "data", "imagenet2012_classes.tsv")
_SIZES = {"imagenet2012": 1000, "imagenet21k": 21843}


class NoClassNamesError(errors.UserError, ValueError):
    """`class_names` was asked for a dataset it does not know, or for a release without a head."""


@functools.cache
def imagenet2012_synsets():
    """The 1000 WordNet ids of ImageNet-1k's classes, in head order (`"n01440764"`, ...)."""
    return tuple(_read_tsv()[0])


def _read_tsv():
    with open(_IMAGENET2012, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return [wnid for wnid, _ in rows], [lemmas for _, lemmas in rows]


def _read_names(path, dataset):
    """The names in the list file at `path`, one a line; a `ValueError` unless there are as many
    as `dataset` has classes."""
    try:
        with open(path, encoding="utf-8") as f:
            names = [line.strip() for line in f if line.strip()]
    except UnicodeDecodeError as error:
        raise ValueError(f"it is not UTF-8 text: {error}") from error
    if len(names) != _SIZES[dataset]:
        raise ValueError(f"it has {len(names)} names, not the {_SIZES[dataset]} of {dataset}")
    return names


def _release_lists():
    """Each release name → the class-name lists of its heads (one each, a test checks)."""
    lists = {}
    for release in releases.RELEASES:
        lists.setdefault(release.name, set()).add(release.class_names)
    return lists


def class_names(dataset):
    """The class names of a head trained on `dataset`, in head order.

    Args:
      dataset: `"imagenet2012"` (1000 names, from the package) or `"imagenet21k"` (21843 names,
        downloaded on first use like the weights: same cache, same mirror variable); a release
        name (`"augreg_in21k_ft_in1k"`, ...: the list of its head); or a `Release`.

    Returns:
      A list of strings, e.g. `"tench, Tinca tinca"`.

    Raises:
      NoClassNamesError (a `ValueError`): for an unknown `dataset`, or a release without a head
        (a backbone such as `"dinov2"`).
      vit_keras.weights.download.WeightsUnavailableError: when the ImageNet-21k list cannot be
        downloaded; its subclass `InvalidFileError` when the file (downloaded, cached or in a
        mirror folder) does not hold the 21843 names.
    """
    if isinstance(dataset, releases.Release):
        release, dataset = dataset.name, dataset.class_names
    elif dataset in releases.RELEASE_NAMES:
        release, (dataset,) = dataset, _release_lists()[dataset]
    else:
        release = None
    if release is not None and dataset is None:
        # A backbone release (DINOv2, SigLIP, CLIP, MAE) ships no classifier head.
        with_heads = [name for name, lists in _release_lists().items() if None not in lists]
        raise NoClassNamesError(
            f"Release {release!r} has no classifier head, so it has no class names: it is a "
            f"backbone (build it with include_top=False, or fine-tune a head on your own "
            f"classes). Releases with a head: {', '.join(with_heads)}.")
    if dataset not in releases.CLASS_NAME_FILES:
        raise NoClassNamesError(f"No class names for {dataset!r}; known: "
                                f"{', '.join(releases.CLASS_NAME_FILES)}, and the release names "
                                f"{', '.join(releases.RELEASE_NAMES)}.")
    path = releases.CLASS_NAME_FILES[dataset]
    if path is None:
        return _read_tsv()[1]
    local = download.fetch(path, progress=False, verify=lambda file: _read_names(file, dataset))
    try:
        return _read_names(local, dataset)
    except ValueError as error:
        raise download.invalid_file_error(path, local, error) from error
