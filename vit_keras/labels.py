"""Class names of the published heads: ImageNet-1k's ship with the package, ImageNet-21k's
are fetched once into the weights cache.

Both lists are in head order: row `i` of a head's kernel scores class `i`. ImageNet-1k's order
is the ILSVRC-2012 synsets sorted by WordNet id (the order of `tensorflow_datasets`' `imagenet2012`
and of every published 1000-class head); each name is the synset's WordNet lemmas.
"""

import functools
import os

from vit_keras import download, releases

_IMAGENET2012 = os.path.join(os.path.dirname(__file__), "data", "imagenet2012_classes.tsv")
_SIZES = {"imagenet2012": 1000, "imagenet21k": 21843}


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
      ValueError: for an unknown `dataset`.
      vit_keras.download.WeightsUnavailableError: when the ImageNet-21k list cannot be
        downloaded; its subclass `InvalidFileError` when the file (downloaded, cached or in a
        mirror folder) does not hold the 21843 names.
    """
    if isinstance(dataset, releases.Release):
        dataset = dataset.class_names
    elif dataset in releases.RELEASE_NAMES:
        (dataset,) = _release_lists()[dataset]
    if dataset not in releases.CLASS_NAME_FILES:
        raise ValueError(f"No class names for {dataset!r}; known: "
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
