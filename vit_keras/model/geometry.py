"""How pixels become tokens: the one place that knows image sizes, strides and token grids.

The model builder, the checkpoint loader, position-embedding resampling and the analysis all ask
these questions; each asks it here. NumPy-free and Keras-free: plain integers in, plain integers
out. A built model answers for itself (`vit_keras.ViT.token_grid`, `token_pixels`).
"""

import numbers


def pair(value, what="size"):
    """`224` or `(224, 320)` → `(224, 320)` as positive ints: an image size or a `(rows, cols)` grid.

    Raises `ValueError` naming `what` for anything else.
    """
    try:
        first, second = (value, value) if _is_integer(value) else value
        first, second = int(first), int(second)
    except (TypeError, ValueError):
        raise ValueError(f"A {what} is one integer or a pair (height, width); got {value!r}.") from None
    if first < 1 or second < 1:
        raise ValueError(f"A {what} needs positive values; got {value!r}.")
    return first, second


EVAL_INTERPOLATIONS = ("bilinear", "bicubic")


def eval_crop(crop):
    """A model's evaluation transform (`ViT`'s `eval_crop`) checked, as JSON keeps it: None
    (resize only) or `[crop_fraction in (0, 1], interpolation]`, with a third item `"floor"` where
    the crop's offsets are rounded down (transformers' image processors; timm's round to even);
    a `ValueError` otherwise."""
    if crop is None:
        return None
    try:
        fraction, interpolation, *centre = crop
        fraction = float(fraction)
    except (TypeError, ValueError):
        fraction, interpolation, centre = None, None, None
    if not (fraction is not None and 0 < fraction <= 1 and interpolation in EVAL_INTERPOLATIONS
            and centre in ([], ["floor"])):
        raise ValueError(f"eval_crop={crop!r}: expected None or (crop_fraction in (0, 1], one of "
                         f"{EVAL_INTERPOLATIONS}[, 'floor']).")
    return [fraction, interpolation, *centre]


def _is_integer(value):
    """An int, a NumPy integer or a 0-d array (not a pair)."""
    return isinstance(value, numbers.Integral) or getattr(value, "ndim", None) == 0


def resnet_stride(resnet_layers):
    """Input pixels per feature-map cell of a hybrid's ResNet: 4 for the root (stride-2 convolution
    and stride-2 max-pool), times 2 for every stage after the first. 1 without a ResNet (`None`)."""
    if resnet_layers is None:
        return 1
    return 4 * 2 ** max(len(resnet_layers) - 1, 0)


def pixels_per_token(config):
    """Input pixels along each side of one token: the patch size times the ResNet stride (16 for
    ViT-B/16 and for R50+ViT-B/16, whose 1x1 patches sit on a stride-16 feature map)."""
    return config.patch_size * resnet_stride(config.resnet_layers)


def image_size_for_grid(config, grid):
    """The image `(height, width)` whose tokens form `grid` `(rows, cols)` under `config`."""
    step = pixels_per_token(config)
    return tuple(side * step for side in pair(grid, "token grid"))
