"""Known answers for `vit_keras.analysis`: attention arrays and embeddings built by hand, plus the
functions that read a model's grid and weights (ViT, GAP, rectangular and a hybrid-like stem)."""

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.inspection import analysis

from conftest import random_images, randomize_weights


def one_hot_attention(targets, tokens):
    """`(tokens, tokens)` attention where query `q` puts all its weight on key `targets[q]`."""
    attention = np.zeros((tokens, tokens))
    attention[np.arange(tokens), targets] = 1.0
    return attention


def as_layers(*matrices, heads=1):
    """One `(1, heads, tokens, tokens)` array per layer, every head the same matrix."""
    return [np.broadcast_to(m, (1, heads, *m.shape)).copy() for m in matrices]


# --- attention rollout --------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.backend_independent
def test_uniform_attention_gives_uniform_rollout(num_layers):
    rows, cols = 3, 4
    tokens = rows * cols + 1
    uniform = np.full((2, 4, tokens, tokens), 1.0 / tokens)
    rollout = analysis.attention_rollout([uniform] * num_layers, (rows, cols))
    assert rollout.shape == (2, rows, cols)
    # ((A + I) / 2)^L with A = J / T idempotent is 0.5^L I + (1 - 0.5^L) J / T.
    np.testing.assert_allclose(rollout, (1 - 0.5 ** num_layers) / tokens, rtol=1e-12)


@pytest.mark.backend_independent
def test_identity_attention_gives_zero_rollout_on_patches():
    tokens = 2 * 2 + 1
    rollout = analysis.attention_rollout(as_layers(np.eye(tokens), np.eye(tokens)), 2)
    np.testing.assert_array_equal(rollout, np.zeros((1, 2, 2)))


@pytest.mark.backend_independent
def test_rollout_places_patches_row_major_on_a_rectangular_grid():
    rows, cols = 2, 3
    targets = np.arange(rows * cols + 1)
    targets[0] = 1 + 1 * cols + 2  # the class token looks at patch (1, 2)
    rollout = analysis.attention_rollout(as_layers(one_hot_attention(targets, 7)), (rows, cols))
    expected = np.zeros((1, rows, cols))
    expected[0, 1, 2] = 0.5  # half the class token's row stays on itself (residual)
    np.testing.assert_allclose(rollout, expected, atol=1e-15)


@pytest.mark.backend_independent
def test_rollout_multiplies_later_layers_on_the_left():
    # Layer 1: patch 1 looks at patch 4. Layer 2: the class token looks at patch 1.
    tokens = 5
    first = one_hot_attention([0, 4, 2, 3, 4], tokens)
    second = one_hot_attention([1, 1, 2, 3, 4], tokens)
    rollout = analysis.attention_rollout(as_layers(first, second), (2, 2))
    # cls row: 0.5 cls + 0.5 (row 1 of layer 1 = 0.5 patch 1 + 0.5 patch 4).
    np.testing.assert_allclose(rollout[0].ravel(), [0.25, 0.0, 0.0, 0.25], atol=1e-15)


@pytest.mark.backend_independent
def test_rollout_averages_the_heads():
    tokens = 5
    attention = np.stack([one_hot_attention([1, 1, 2, 3, 4], tokens),
                          one_hot_attention([0, 1, 2, 3, 4], tokens)])[None]
    rollout = analysis.attention_rollout([attention], (2, 2))
    # Mean of heads: cls row 0.5 cls + 0.5 patch 0; plus identity and renormalised: 0.25 on patch 0.
    np.testing.assert_allclose(rollout[0].ravel(), [0.25, 0, 0, 0], atol=1e-15)


@pytest.mark.backend_independent
def test_rollout_without_class_token_averages_over_queries():
    # GAP model: every query looks at patch 3; mean over queries of 0.5 e_q + 0.5 e_3.
    attention = one_hot_attention([3, 3, 3, 3], 4)
    rollout = analysis.attention_rollout(as_layers(attention), (2, 2))
    np.testing.assert_allclose(rollout[0].ravel(), [0.125, 0.125, 0.125, 0.625], atol=1e-15)


@pytest.mark.backend_independent
def test_rollout_rejects_a_grid_larger_than_the_tokens():
    with pytest.raises(ValueError, match="5 tokens cannot hold a 3x3 patch grid"):
        analysis.attention_rollout(as_layers(np.eye(5)), 3)


# --- mean attention distance --------------------------------------------------------------------


@pytest.mark.backend_independent
def test_identity_attention_has_distance_zero():
    attention = np.broadcast_to(np.eye(17), (2, 3, 17, 17))
    distance = analysis.mean_attention_distance([attention] * 2, (4, 4), 16)
    np.testing.assert_array_equal(distance, np.zeros((2, 3)))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.backend_independent
def test_attention_k_patches_away_gives_k_times_the_patch_size(k):
    rows, cols, patch = 3, 7, 16
    # Patch (r, c) looks k columns right, or k left where that would leave the grid.
    targets = [r * cols + (c + k if c + k < cols else c - k)
               for r in range(rows) for c in range(cols)]
    patches = one_hot_attention(targets, rows * cols)
    attention = np.zeros((rows * cols + 1,) * 2)
    attention[1:, 1:] = 0.7 * patches  # 30% to the class token: left out and renormalised away
    attention[1:, 0] = 0.3
    attention[0] = 1.0 / len(attention)  # the class token's own row is not a patch query
    distance = analysis.mean_attention_distance(as_layers(attention, heads=2), (rows, cols), patch)
    np.testing.assert_allclose(distance, np.full((1, 2), k * patch), rtol=1e-12)


@pytest.mark.backend_independent
def test_attention_distance_is_per_head_and_uses_rectangular_pixels():
    rows, cols = 3, 3
    down = one_hot_attention([(i + 3) % 9 if i < 6 else i - 3 for i in range(9)], 9)  # 1 row away
    attention = np.stack([np.eye(9), down])[None]
    distance = analysis.mean_attention_distance([attention], (rows, cols), (8, 32))
    np.testing.assert_allclose(distance, [[0.0, 8.0]], rtol=1e-12)


@pytest.mark.backend_independent
def test_attention_distance_averages_diagonal_distances():
    # On a 2x2 grid of 10-pixel patches each patch looks at the opposite corner: 10 * sqrt(2).
    attention = one_hot_attention([3, 2, 1, 0], 4)
    distance = analysis.mean_attention_distance(as_layers(attention), 2, 10)
    np.testing.assert_allclose(distance, [[10 * np.sqrt(2)]], rtol=1e-12)


# --- position-embedding similarity --------------------------------------------------------------


@pytest.mark.backend_independent
def test_position_embedding_from_a_2d_function_gives_the_expected_similarity():
    rows, cols, a, b = 4, 6, 0.7, 0.4
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    r, c = r.ravel(), c.ravel()
    patches = np.stack([np.cos(a * r), np.sin(a * r), np.cos(b * c), np.sin(b * c)], axis=-1)
    cls = np.array([[5.0, -1.0, 2.0, 0.5]])
    embedding = np.concatenate([cls, 3.0 * patches])[None]  # (1, tokens, 4); scale must not matter
    similarity = analysis.position_embedding_similarity(embedding, (rows, cols))
    dr = np.arange(rows)[:, None, None, None] - np.arange(rows)[None, None, :, None]
    dc = np.arange(cols)[None, :, None, None] - np.arange(cols)[None, None, None, :]
    expected = (np.cos(a * dr) + np.cos(b * dc)) / 2  # cos(x - y) = cos x cos y + sin x sin y
    np.testing.assert_allclose(similarity, expected, atol=1e-12)
    np.testing.assert_allclose(similarity[1, 2, 1, 2], 1.0)


@pytest.mark.backend_independent
def test_position_embedding_similarity_of_a_gap_model_uses_every_token():
    embedding = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 1.0]])
    similarity = analysis.position_embedding_similarity(embedding, (2, 2))
    np.testing.assert_allclose(similarity[0, 0].ravel(), [1.0, 0.0, -1.0, np.sqrt(0.5)])


# --- embedding filters --------------------------------------------------------------------------


@pytest.mark.backend_independent
def test_filter_components_recover_the_directions_of_largest_variance():
    rng = np.random.default_rng(0)
    basis = np.linalg.qr(rng.normal(size=(2 * 2 * 3, 3)))[0].T  # 3 orthonormal directions
    # Uncorrelated, centred coefficients with standard deviations in the ratio 10 : 3 : 1.
    coefficients = rng.normal(size=(64, 3))
    coefficients = np.linalg.qr(coefficients - coefficients.mean(axis=0))[0] * [10.0, 3.0, 1.0]
    mean_filter = rng.normal(size=12)
    filters = mean_filter + coefficients @ basis  # (hidden, 12)
    kernel = filters.T.reshape(2, 2, 3, 64)
    components, ratio = analysis.embedding_filter_components(kernel, num_components=3)
    assert components.shape == (3, 2, 2, 3)
    flat = components.reshape(3, -1)
    for found, direction in zip(flat, basis):
        np.testing.assert_allclose(abs(found @ direction), 1.0, rtol=1e-9)
        assert found[np.abs(found).argmax()] > 0  # sign convention
    np.testing.assert_allclose(ratio, np.array([100.0, 9.0, 1.0]) / 110.0, rtol=1e-9)


@pytest.mark.backend_independent
def test_filter_components_are_limited_by_the_number_requested():
    kernel = np.random.default_rng(1).normal(size=(4, 4, 3, 32))
    components, ratio = analysis.embedding_filter_components(kernel, num_components=6)
    assert components.shape == (6, 4, 4, 3) and ratio.shape == (6,)
    np.testing.assert_allclose(np.linalg.norm(components.reshape(6, -1), axis=1), 1.0)


# --- reading a model ----------------------------------------------------------------------------


def test_token_grid_and_pixels_of_a_rectangular_model(tiny_config):
    model = vit_keras.build_model(tiny_config, image_size=(16, 24), num_classes=3)
    assert analysis.token_grid(model) == (4, 6)
    assert analysis.token_size_pixels(model) == (4.0, 4.0)
    assert analysis.position_embedding(model).shape == (4 * 6 + 1, 32)
    assert analysis.patch_embedding_kernel(model).shape == (4, 4, 3, 32)


def test_token_grid_of_a_hybrid_is_the_feature_map_grid(tiny_config):
    # The ResNet root alone (stride 4) before a patch-size-1 embedding: 32 px → an 8x8 grid.
    model = vit_keras.build_model({**tiny_config, "patch_size": 1, "resnet_layers": ()},
                                  image_size=32, num_classes=3)
    assert analysis.token_grid(model) == (8, 8)
    assert analysis.token_size_pixels(model) == (4.0, 4.0)
    assert analysis.patch_embedding_kernel(model).shape == (1, 1, 64, 32)
    attentions = vit_keras.attention_scores(model, random_images(1, 32, 32))
    assert analysis.attention_rollout(attentions, (8, 8)).shape == (1, 8, 8)


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_analysis_of_a_model_gives_well_formed_maps(tiny_config, classifier):
    model = randomize_weights(vit_keras.build_model(
        tiny_config, image_size=(16, 24), num_classes=3, classifier=classifier))
    grid = analysis.token_grid(model)
    attentions = vit_keras.attention_scores(model, random_images(2, 16, 24))
    rollout = analysis.attention_rollout(attentions, grid)
    assert rollout.shape == (2, 4, 6) and np.all(rollout > 0)
    total = rollout.sum(axis=(1, 2))
    if classifier == "gap":
        # Rows of a product of row-stochastic matrices; float32 attention, hence 1e-5.
        np.testing.assert_allclose(total, 1.0, rtol=1e-5)
    else:
        assert np.all(total < 1.0)  # the rest stays on the class token
    distance = analysis.mean_attention_distance(attentions, grid, analysis.token_size_pixels(model))
    diagonal = np.hypot(3 * 4, 5 * 4)
    assert distance.shape == (2, 4) and np.all((distance > 0) & (distance < diagonal))
    similarity = analysis.position_embedding_similarity(analysis.position_embedding(model), grid)
    assert similarity.shape == (4, 6, 4, 6)
    np.testing.assert_allclose(np.einsum("ijij->ij", similarity), 1.0, rtol=1e-6)


def test_model_without_a_patch_embedding_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="mlp")
    with pytest.raises(ValueError, match="'mlp' is not a vit_keras ViT"):
        analysis.token_grid(model)


@pytest.mark.backend_independent
def test_attention_arrays_of_mixed_shapes_are_refused():
    with pytest.raises(ValueError, match="all of one shape"):
        analysis.mean_attention_distance([np.ones((1, 2, 5, 5)), np.ones((1, 2, 4, 4))], 2, 16)


@pytest.mark.backend_independent
def test_one_stacked_array_gives_the_same_answers_as_a_list_of_layers():
    attentions = [np.random.default_rng(seed).dirichlet(np.ones(5), size=(2, 3, 5))
                  for seed in (0, 1)]
    np.testing.assert_array_equal(analysis.attention_rollout(np.stack(attentions), 2),
                                  analysis.attention_rollout(attentions, 2))
    np.testing.assert_array_equal(analysis.mean_attention_distance(np.stack(attentions), 2, 16),
                                  analysis.mean_attention_distance(attentions, 2, 16))
