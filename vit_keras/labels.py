"""Class names of the published heads: ImageNet-1k's ship with the package, ImageNet-21k's
are fetched once into the weights cache.

Both lists are in head order: row `i` of a head's kernel scores class `i`. ImageNet-1k's order
is the ILSVRC-2012 synsets sorted by WordNet id (the order of `tensorflow_datasets`' `imagenet2012`
and of every published 1000-class head); each name is the synset's WordNet lemmas.
"""

import functools
import os

from vit_keras import download
from vit_keras import releases

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


def class_names(dataset):
    """The class names of a head trained on `dataset`, in head order.

    Args:
      dataset: `"imagenet2012"` (1000 names, from the package) or `"imagenet21k"` (21843 names,
        downloaded on first use like the weights: same cache, same mirror variable), or a
        `Release`, whose head's list is used.

    Returns:
      A list of strings, e.g. `"tench, Tinca tinca"`.
    """
    if isinstance(dataset, releases.Release):
        dataset = dataset.class_names
    if dataset not in releases.CLASS_NAME_FILES:
        raise ValueError(f"No class names for {dataset!r}; known: "
                         f"{', '.join(releases.CLASS_NAME_FILES)}.")
    path = releases.CLASS_NAME_FILES[dataset]
    if path is None:
        names = _read_tsv()[1]
    else:
        with open(download.fetch(path, progress=False), encoding="utf-8") as f:
            names = [line.strip() for line in f if line.strip()]
    if len(names) != _SIZES[dataset]:
        raise ValueError(f"The {dataset} class-name list has {len(names)} names, not "
                         f"{_SIZES[dataset]}" + (f"; delete {download.cache_path(path)} to fetch it "
                                                 f"again." if path else "."))
    return names
