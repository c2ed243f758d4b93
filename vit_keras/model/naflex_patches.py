"""NaFlex inputs: images of any size and aspect ratio as padded sequences of patches.

SigLIP 2's NaFlex variants and timm's `naflexvit` take each image near its native resolution: it is
resized, keeping its aspect ratio, to the largest size whose sides are multiples of the patch size
and whose patch count is at most `max_num_patches` (`naflex_size`, big_vision's and transformers'
`Siglip2ImageProcessor`'s rule), cut into patches, and padded to a fixed sequence length so that
images of different sizes share a batch. `naflex_patches` returns timm's dictionary:

- `"patches"`: float32 `(batch, N, patch_size * patch_size * channels)`, each patch flattened
  (row, column, channel); zeros where padded.
- `"patch_coord"`: int32 `(batch, N, 2)`, the (row, column) of each patch in its image's patch
  grid; zeros where padded.
- `"patch_valid"`: bool `(batch, N)`, True for a patch of the image, False for padding.

Patches come in row-major order over the patch grid, as transformers' `convert_image_to_patches`
and timm's `patchify_image` give them. No pixel normalisation happens here: the values keep the
caller's scale.
"""

import math
import numbers

import keras
import numpy as np

SCALE_SEARCH_END = 1e-5  # transformers' and big_vision's end of the binary search on the scale


def naflex_size(height, width, patch_size, max_num_patches):
    """The NaFlex size of a `height` x `width` image, as `(rows, cols)` in patches.

    The largest aspect-preserving scale whose sides, each rounded up to a multiple of `patch_size`
    (at least one patch), give at most `max_num_patches` patches, found by the binary search of
    transformers' `get_image_size_for_max_num_patches`, whose answer it gives exactly.
    """
    patch_size = positive_int(patch_size, "patch_size")
    max_num_patches = positive_int(max_num_patches, "max_num_patches")
    height, width = positive_int(height, "image height"), positive_int(width, "image width")

    def scaled(scale, size):
        # The same float operations as transformers', so that ties round the same way.
        return max(patch_size, math.ceil(size * scale / patch_size) * patch_size)

    scale_min, scale_max = SCALE_SEARCH_END / 10, 100.0
    while scale_max - scale_min >= SCALE_SEARCH_END:
        scale = (scale_min + scale_max) / 2
        count = (scaled(scale, height) / patch_size) * (scaled(scale, width) / patch_size)
        if count <= max_num_patches:
            scale_min = scale
        else:
            scale_max = scale
    return scaled(scale_min, height) // patch_size, scaled(scale_min, width) // patch_size


def naflex_patches(images, patch_size, max_num_patches, pad_to=None):
    """Images of any sizes → timm's NaFlex dictionary (see the module's list), N = `pad_to` or
    `max_num_patches`.

    Args:
      images: a list of `(height, width, channels)` arrays (1 to 4 channels, the same for all;
        sizes may differ), or a `(batch, height, width, channels)` array; uint8 or float.
      patch_size: pixels along each side of a patch.
      max_num_patches: the most patches an image is resized to (`naflex_size`).
      pad_to: the sequence length N, when it differs from `max_num_patches` (e.g. a fixed length
        for several budgets); an image with more patches than N is refused.

    Each image is resized to its NaFlex size with antialiased bilinear interpolation
    (`keras.ops.image.resize`), unless it already has that size.
    """
    patch_size = positive_int(patch_size, "patch_size")
    max_num_patches = positive_int(max_num_patches, "max_num_patches")
    length = max_num_patches if pad_to is None else positive_int(pad_to, "pad_to")
    images = _checked_images(images)
    channels = images[0].shape[-1]
    batch = len(images)
    patches = np.zeros((batch, length, patch_size * patch_size * channels), np.float32)
    patch_coord = np.zeros((batch, length, 2), np.int32)
    patch_valid = np.zeros((batch, length), bool)
    for index, image in enumerate(images):
        rows, cols = naflex_size(image.shape[0], image.shape[1], patch_size, max_num_patches)
        if rows * cols > length:
            raise ValueError(
                f"Image {index} of size {image.shape[:2]} takes {rows} x {cols} = {rows * cols} "
                f"patches of {patch_size} pixels, more than the {length} of pad_to={pad_to}; "
                f"use a pad_to of at least max_num_patches={max_num_patches}.")
        image = _resized(image, (rows * patch_size, cols * patch_size))
        grid = image.reshape(rows, patch_size, cols, patch_size, channels).transpose(0, 2, 1, 3, 4)
        patches[index, :rows * cols] = grid.reshape(rows * cols, -1)
        patch_coord[index, :rows * cols] = np.stack(np.divmod(np.arange(rows * cols), cols), -1)
        patch_valid[index, :rows * cols] = True
    return {"patches": patches, "patch_coord": patch_coord, "patch_valid": patch_valid}


def naflex_grid_shapes(patch_coord, patch_valid):
    """Each image's patch grid, `(batch, 2)` int32 (rows, cols): transformers' `spatial_shapes`,
    read back from `patch_coord` `(batch, N, 2)` and `patch_valid` `(batch, N)` as the largest
    valid coordinate plus one ((0, 0) for an image without valid patches)."""
    patch_coord, patch_valid = np.asarray(patch_coord), np.asarray(patch_valid, bool)
    if patch_coord.ndim != 3 or patch_coord.shape[-1] != 2 or (
            patch_valid.shape != patch_coord.shape[:2]):
        raise ValueError(
            f"Expected patch_coord of shape (batch, N, 2) and patch_valid of shape (batch, N); "
            f"got {patch_coord.shape} and {patch_valid.shape}.")
    extents = np.where(patch_valid[..., None], patch_coord + 1, 0)
    return extents.max(axis=1, initial=0).astype(np.int32)


def _resized(image, size):
    """`image` `(height, width, channels)` → float32 `(*size, channels)`, antialiased bilinear."""
    image = image.astype(np.float32)
    if image.shape[:2] == size:
        return image  # exactly the caller's pixels, as transformers' resize to the same size
    resized = keras.ops.image.resize(image, size, interpolation="bilinear", antialias=True,
                                     data_format="channels_last")
    return np.asarray(keras.ops.convert_to_numpy(resized), np.float32)


def _checked_images(images):
    """`images` as a list of NumPy HWC arrays, refused with a ValueError where they are not."""
    if getattr(images, "ndim", 4) != 4:
        raise ValueError(
            f"A batch array of images has shape (batch, height, width, channels); got shape "
            f"{images.shape}. Put a single image in a list: [image].")
    images = [np.asarray(image) for image in images]
    if not images:
        raise ValueError("naflex_patches got no images; give a list of (height, width, channels) "
                         "arrays or a (batch, height, width, channels) array.")
    for index, image in enumerate(images):
        if image.ndim != 3 or not 1 <= image.shape[-1] <= 4 or 0 in image.shape:
            raise ValueError(
                f"Image {index} has shape {image.shape}; expected (height, width, channels) with "
                f"1 to 4 channels (HWC, channels last) and a nonzero height and width.")
    channels = sorted({image.shape[-1] for image in images})
    if len(channels) > 1:
        raise ValueError(f"The images have different channel counts {channels}; a batch of "
                         f"patches needs one, so convert them to the same (e.g. RGB) first.")
    return images


def positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive integer; got {value!r}.")
    return int(value)
