"""NaFlex inputs (`vit_keras.model.naflex_patches`), held to transformers' `Siglip2ImageProcessor`.

transformers is the oracle for the size rule, the patch counts and grids and the patch values; the
patch layout is checked against the image itself, on an image that needs no resizing.
"""

import numpy as np
import pytest

from vit_keras.model.naflex_patches import naflex_grid_shapes, naflex_patches, naflex_size


def _siglip2_processed(images, patch_size, max_num_patches):
    """transformers' processor, built offline, on `images`: neither rescaling nor normalisation,
    so that its `pixel_values` keep the pixels' own scale as ours do. Channels last said outright:
    it would take a 3 x 5 x 3 image for channels first."""
    from transformers import Siglip2ImageProcessor

    processor = Siglip2ImageProcessor(patch_size=patch_size, max_num_patches=max_num_patches,
                                      do_resize=True, do_rescale=False, do_normalize=False)
    return processor(images, return_tensors="np", input_data_format="channels_last")


# Wide, tall, square, tiny (upsampled) and huge (downsampled) images, (height, width).
_MIXED_SIZES = ((40, 900), (900, 40), (300, 300), (3, 5), (3000, 2000), (123, 457))


def _random_images(sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(0, 255, (height, width, 3)).astype(dtype) for height, width in sizes]


def test_naflex_size_equals_transformers_for_random_sizes():
    from transformers.models.siglip2 import image_processing_siglip2

    rng = np.random.default_rng(0)
    for _ in range(200):
        # Log-uniform sides: tiny, huge and extreme aspect ratios all occur.
        height, width = np.exp(rng.uniform(0, np.log(5000), 2)).astype(int)
        patch_size = int(rng.choice([14, 16]))
        max_num_patches = int(rng.choice([64, 256, 576, 1024]))
        expected = image_processing_siglip2.get_image_size_for_max_num_patches(
            int(height), int(width), patch_size, max_num_patches)
        rows, cols = naflex_size(height, width, patch_size, max_num_patches)
        assert (rows * patch_size, cols * patch_size) == expected, (height, width, patch_size,
                                                                    max_num_patches)


def test_patch_counts_and_grids_equal_siglip2_processor():
    images = _random_images(_MIXED_SIZES, np.float32)
    expected = _siglip2_processed(images, 16, 256)
    ours = naflex_patches(images, 16, 256)
    np.testing.assert_array_equal(ours["patch_valid"].sum(axis=1),
                                  expected["pixel_attention_mask"].sum(axis=1))
    np.testing.assert_array_equal(ours["patch_valid"], expected["pixel_attention_mask"] == 1)
    np.testing.assert_array_equal(naflex_grid_shapes(ours["patch_coord"], ours["patch_valid"]),
                                  expected["spatial_shapes"])


@pytest.mark.parametrize("patch_size, max_num_patches", [(16, 256), (14, 576)])
def test_float_patch_values_equal_siglip2_processor(patch_size, max_num_patches):
    images = _random_images(_MIXED_SIZES, np.float32)
    expected = _siglip2_processed(images, patch_size, max_num_patches)
    ours = naflex_patches(images, patch_size, max_num_patches)
    assert ours["patches"].shape == expected["pixel_values"].shape
    # Both resize with antialiased bilinear (transformers: torchvision's resize): on the torch
    # backend the values are identical; JAX's and TensorFlow's kernels sum the same weights in
    # another order, measured up to 0.03 on pixels in [0, 255] (1e-4 of the range) over 45 random
    # sizes. A wrong filter, scale or offset differs by whole pixel levels.
    np.testing.assert_allclose(ours["patches"], expected["pixel_values"], rtol=0, atol=0.1)


def test_uint8_patch_values_equal_siglip2_processor_within_one_level():
    images = _random_images(_MIXED_SIZES, np.uint8, seed=1)
    expected = _siglip2_processed(images, 16, 256)
    ours = naflex_patches(images, 16, 256)
    assert ours["patches"].dtype == np.float32
    # torchvision resizes uint8 in fixed point and rounds its output to uint8; ours stays float:
    # measured up to 1.004 levels apart on every backend.
    np.testing.assert_allclose(ours["patches"], expected["pixel_values"].astype(np.float32),
                               rtol=0, atol=1.05)


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_unresized_image_patches_are_row_major_with_row_col_channel_pixels(channels):
    patch, max_num_patches, pad_to = 4, 64, 70
    height, width = 5 * patch, 12 * patch
    rows, cols = naflex_size(height, width, patch, max_num_patches)
    assert (rows * patch, cols * patch) == (height, width)  # already its NaFlex size: no resize
    image = np.random.default_rng(0).integers(0, 256, (height, width, channels), dtype=np.uint8)
    out = naflex_patches([image], patch, max_num_patches, pad_to=pad_to)
    assert out["patches"].shape == (1, pad_to, patch * patch * channels)
    assert out["patches"].dtype == np.float32 and out["patch_coord"].dtype == np.int32
    for r in range(rows):
        for c in range(cols):
            np.testing.assert_array_equal(
                out["patches"][0, r * cols + c],
                image[r * patch:(r + 1) * patch, c * patch:(c + 1) * patch].reshape(-1))
            np.testing.assert_array_equal(out["patch_coord"][0, r * cols + c], (r, c))
    assert out["patch_valid"][0, :rows * cols].all() and not out["patch_valid"][0, rows * cols:].any()
    assert not out["patches"][0, rows * cols:].any() and not out["patch_coord"][0, rows * cols:].any()


def test_batch_array_gives_what_a_list_gives():
    images = np.random.default_rng(0).uniform(0, 1, (3, 50, 70, 3)).astype(np.float32)
    from_array, from_list = naflex_patches(images, 8, 32), naflex_patches(list(images), 8, 32)
    for key in ("patches", "patch_coord", "patch_valid"):
        np.testing.assert_array_equal(from_array[key], from_list[key])


def test_naflex_grid_shapes_reads_rows_and_cols_per_image():
    images = _random_images(((20, 90), (90, 20)), np.float32)
    out = naflex_patches(images, 10, 16)
    shapes = naflex_grid_shapes(out["patch_coord"], out["patch_valid"])
    assert shapes.dtype == np.int32
    np.testing.assert_array_equal(shapes, [naflex_size(20, 90, 10, 16), naflex_size(90, 20, 10, 16)])


@pytest.mark.parametrize("images, match", [
    ([np.zeros((32, 32))], r"shape \(32, 32\); expected \(height, width, channels\)"),
    ([np.zeros((32, 32, 5))], r"shape \(32, 32, 5\); expected .* 1 to 4 channels"),
    (np.zeros((32, 32, 3)), r"got shape \(32, 32, 3\)\. Put a single image in a list"),
    ([np.zeros((32, 32, 3)), np.zeros((32, 32, 1))], r"different channel counts \[1, 3\]"),
    ([], "got no images"),
])
def test_refuses_images_that_are_not_hwc_with_one_channel_count(images, match):
    with pytest.raises(ValueError, match=match):
        naflex_patches(images, 16, 64)


@pytest.mark.parametrize("patch_size, max_num_patches, match", [
    (16, 0, "max_num_patches must be a positive integer; got 0"),
    (0, 64, "patch_size must be a positive integer; got 0"),
    (16.5, 64, "patch_size must be a positive integer; got 16.5"),
])
def test_refuses_patch_size_and_max_num_patches_below_one(patch_size, max_num_patches, match):
    with pytest.raises(ValueError, match=match):
        naflex_patches([np.zeros((32, 32, 3))], patch_size, max_num_patches)
    with pytest.raises(ValueError, match=match):
        naflex_size(32, 32, patch_size, max_num_patches)


def test_refuses_an_image_with_more_patches_than_pad_to():
    with pytest.raises(ValueError, match=r"takes 8 x 8 = 64 patches .* more than the 32 of pad_to"):
        naflex_patches([np.zeros((128, 128, 3))], 16, 64, pad_to=32)
