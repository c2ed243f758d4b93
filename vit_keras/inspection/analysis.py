"""What a trained ViT learned, as in Section 4.5 of the paper (Figures 6 and 7).

Pure NumPy on arrays, plus a few thin functions that pull those arrays out of a model:

- `attention_rollout`: how much the class token (or, for GAP models, the average token) draws on
  each input patch through all layers (Fig. 6, Abnar & Zuidema 2020).
- `mean_attention_distance`: per layer and head, how far in pixels a head looks (Fig. 7, right).
- `position_embedding_similarity`: each position embedding's cosine similarity to all others, on the
  patch grid (Fig. 7, centre).
- `embedding_filter_components`: the top principal components of the patch-embedding filters
  (Fig. 7, left).

Attention probabilities come from `vit_keras.attention_scores(model, images)`: a list with one
`(batch, heads, tokens, tokens)` array per block. Tokens are any prefix tokens (class,
distillation, register tokens, in that order: `prefix_tokens(model)`) followed by the patch
tokens in row-major order on a `(rows, cols)` grid; the number of prefix tokens is
`tokens - rows * cols`. The grid is the model's token grid (`token_grid(model)`),
which for hybrid models is the ResNet feature map's grid, not the raw image's.

The arrays come out of a model through the `vit_keras.ViT` it is (its parts, not layer names);
matplotlib is not imported here: `vit_keras.tools.plots` draws the figures.
"""

import numpy as np

from vit_keras import model as model_lib
from vit_keras.model import geometry

__all__ = [
    "attention_rollout",
    "embedding_filter_components",
    "mean_attention_distance",
    "patch_embedding_kernel",
    "position_embedding",
    "position_embedding_similarity",
    "prefix_tokens",
    "token_grid",
    "token_size_pixels",
]


# --------------------------------------------------------------------------------------------------
# Pure NumPy.


def _num_prefix_tokens(tokens, grid):
    rows, cols = grid
    prefix = tokens - rows * cols
    if prefix < 0:
        raise ValueError(
            f"{tokens} tokens cannot hold a {rows}x{cols} patch grid ({rows * cols} patches); pass "
            f"the grid of the model the arrays came from (`vit_keras.token_grid(model)`).")
    return prefix


def _attention_layers(attentions):
    """A list of `(batch, heads, tokens, tokens)` arrays, or one `(layers, batch, heads, tokens,
    tokens)` array → a list of per-layer arrays, checked to share one square shape.

    Layers are converted to float64 one at a time by the callers, so a large model's attention
    (ViT-L/16 at 384 px: 24 x 16 x 577 x 577 floats per image) is never copied whole.
    """
    if not isinstance(attentions, (list, tuple)):
        attentions = np.asarray(attentions)
        if attentions.ndim != 5:
            raise ValueError(
                f"Expected attention probabilities of shape (layers, batch, heads, tokens, tokens) "
                f"or a list of (batch, heads, tokens, tokens) arrays, one per layer; got shape "
                f"{attentions.shape}.")
        attentions = list(attentions)
    if not attentions:
        raise ValueError("Expected attention probabilities of at least one layer; got none.")
    shapes = {np.shape(a) for a in attentions}
    shape = next(iter(shapes))
    if len(shapes) != 1 or len(shape) != 4 or shape[-1] != shape[-2]:
        raise ValueError(
            f"Expected one (batch, heads, tokens, tokens) array per layer, all of one shape; got "
            f"shapes {sorted(shapes)}.")
    return attentions


def attention_rollout(attentions, grid, class_token=None):
    """Attention rollout (Abnar & Zuidema, 2020), the paper's Figure 6.

    For each layer the heads' attention matrices are averaged, the identity is added for the
    residual connection and each row is renormalised to sum to 1:
    `A_l = (mean_h(attention_l) + I) / 2`.
    The rollout is the product through the layers, `A_L @ ... @ A_1`: row `q` says how much the last
    layer's token `q` draws on each input token.

    Args:
      attentions: a list with one `(batch, heads, tokens, tokens)` array per layer, in order (as
        `vit_keras.attention_scores` returns), or one `(layers, batch, heads, tokens, tokens)`
        array.
      grid: the patch grid `(rows, cols)` (or one int for a square grid); `tokens - rows * cols`
        prefix tokens come first.
      class_token: whether token 0 is a class token (`"class" in prefix_tokens(model)`). None
        (the default) takes it to be one when there are prefix tokens, as in every vit_keras
        model but one with registers and no class token.

    Returns:
      A float array `(batch, rows, cols)` over the patch tokens (prefix tokens left out as keys):
      with a class token, its row of the rollout (for DeiT distilled too: the class token's, not
      the distillation token's); without one (GAP and MAP models, whose pooling reads the patch
      tokens), the rollout averaged over the patch tokens as queries. Values are not rescaled
      (they sum to at most 1 per image); divide by the maximum for display.
    """
    grid = geometry.pair(grid, "token grid")
    attentions = _attention_layers(attentions)
    batch, _, tokens, _ = np.shape(attentions[0])
    prefix = _num_prefix_tokens(tokens, grid)
    if class_token is None:
        class_token = prefix > 0
    elif class_token and not prefix:
        raise ValueError(f"class_token=True, but the {tokens} tokens are a {grid[0]}x{grid[1]} "
                         f"patch grid with no prefix token to be the class token.")
    identity = np.eye(tokens)
    rollout = np.broadcast_to(identity, (batch, tokens, tokens)).copy()
    for attention in attentions:
        layer = np.asarray(attention, dtype=np.float64).mean(axis=1) + identity
        layer /= layer.sum(axis=-1, keepdims=True)
        rollout = layer @ rollout
    weights = rollout[:, 0, prefix:] if class_token else rollout[:, prefix:, prefix:].mean(axis=1)
    return weights.reshape(-1, *grid)


def _patch_distances(grid, token_size):
    """`(rows * cols, rows * cols)` Euclidean distances in pixels between patch centres."""
    rows, cols = grid
    height, width = (token_size, token_size) if np.ndim(token_size) == 0 else token_size
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    y, x = r.ravel() * float(height), c.ravel() * float(width)
    return np.hypot(y[:, None] - y[None, :], x[:, None] - x[None, :])


def mean_attention_distance(attentions, grid, token_size):
    """Mean attention distance per layer and head in pixels, the paper's Figure 7 (right).

    For every query patch, the Euclidean distance between its centre and each key patch's centre,
    weighted by the attention weight, summed over keys; then averaged over query patches and images
    (Appendix D.7: the "receptive field size" of a head).

    Prefix tokens (the class token) have no place on the image, so they are left out on both sides:
    their rows (queries) are dropped, their columns (keys) are dropped and each remaining
    patch-to-patch row is renormalised to sum to 1. A query that gives all its weight to prefix
    tokens has no patch-to-patch distance and does not count in the average.

    Args:
      attentions: a list with one `(batch, heads, tokens, tokens)` array per layer, or one
        `(layers, batch, heads, tokens, tokens)` array.
      grid: the patch grid `(rows, cols)` (or one int); `tokens - rows * cols` prefix tokens first.
      token_size: the pixels of input image covered by one token, a number or `(height, width)`
        (`token_size_pixels(model)`; 16 for ViT-B/16 and for the hybrids' stride-16 feature map).

    Returns:
      A float array `(layers, heads)` of distances in pixels.
    """
    grid = geometry.pair(grid, "token grid")
    attentions = _attention_layers(attentions)
    prefix = _num_prefix_tokens(np.shape(attentions[0])[-1], grid)
    distances = _patch_distances(grid, token_size)
    result = []
    for attention in attentions:
        weights = np.asarray(attention, dtype=np.float64)[..., prefix:, prefix:]
        totals = weights.sum(axis=-1)  # (batch, heads, queries)
        per_query = (weights * distances).sum(axis=-1)
        valid = totals > 0
        per_query = np.where(valid, per_query / np.where(valid, totals, 1.0), 0.0)
        counts = valid.sum(axis=(0, 2))
        with np.errstate(invalid="ignore", divide="ignore"):
            result.append(np.where(counts > 0, per_query.sum(axis=(0, 2)) / counts, np.nan))
    return np.stack(result)


def position_embedding_similarity(pos_embedding, grid):
    """Cosine similarity of each patch's position embedding to every other's, Figure 7 (centre).

    Args:
      pos_embedding: `(1, tokens, hidden)` or `(tokens, hidden)`; the first `tokens - rows * cols`
        rows (the class token's) are left out.
      grid: the patch grid `(rows, cols)` (or one int).

    Returns:
      A float array `(rows, cols, rows, cols)`: `[r, c]` is the map of the similarities of patch
      `(r, c)`'s embedding to every patch's, in [-1, 1], with 1 at `[r, c, r, c]`.
    """
    grid = geometry.pair(grid, "token grid")
    embedding = np.asarray(pos_embedding, dtype=np.float64)
    if embedding.ndim == 3 and embedding.shape[0] == 1:
        embedding = embedding[0]
    if embedding.ndim != 2:
        raise ValueError(f"Expected a position embedding of shape (1, tokens, hidden) or "
                         f"(tokens, hidden); got shape {np.shape(pos_embedding)}.")
    embedding = embedding[_num_prefix_tokens(len(embedding), grid):]
    norms = np.linalg.norm(embedding, axis=-1, keepdims=True)
    unit = embedding / np.maximum(norms, np.finfo(np.float64).tiny)
    return (unit @ unit.T).reshape(*grid, *grid)


def embedding_filter_components(kernel, num_components=28):
    """Principal components of the patch-embedding filters, Figure 7 (left).

    Each of the `hidden` filters is one `patch_h * patch_w * channels` vector; the filters are
    centred on their mean and the components are the top right-singular vectors. The sign of a
    component is arbitrary; it is chosen so that its largest-magnitude entry is positive.

    Args:
      kernel: the `embedding` kernel `(patch_h, patch_w, channels, hidden)` (HWIO).
      num_components: how many to return (28 in the paper); fewer if there are fewer.

    Returns:
      `(components, explained_variance_ratio)`: unit-norm components `(n, patch_h, patch_w,
      channels)` and the fraction of the filters' variance each one explains `(n,)`. Rescale each
      component to [0, 1] to show it as an RGB patch (`vit_keras.tools.plots` does).
    """
    kernel = np.asarray(kernel, dtype=np.float64)
    if kernel.ndim != 4:
        raise ValueError(f"Expected a patch-embedding kernel (patch_h, patch_w, channels, hidden); "
                         f"got shape {kernel.shape}.")
    patch_h, patch_w, channels, hidden = kernel.shape
    filters = kernel.reshape(-1, hidden).T  # (hidden, patch_h * patch_w * channels)
    centred = filters - filters.mean(axis=0)
    _, singular, components = np.linalg.svd(centred, full_matrices=False)
    count = min(int(num_components), len(singular))
    components = components[:count]
    peaks = components[np.arange(count), np.abs(components).argmax(axis=1)]
    components = components * np.where(peaks < 0, -1.0, 1.0)[:, None]
    variance = singular ** 2
    ratio = variance[:count] / max(variance.sum(), np.finfo(np.float64).tiny)
    return components.reshape(count, patch_h, patch_w, channels), ratio


# --------------------------------------------------------------------------------------------------
# Arrays out of a model (a `build_model` model or a loaded one; hybrids included).


def _to_numpy(variable):
    return np.asarray(variable.numpy())


def prefix_tokens(model):
    """The kinds of the model's tokens before the patch tokens, in the encoder's order: `"class"`,
    `"distillation"`, then one `"register"` per register token. `[]` for GAP and MAP models
    without registers; `["class", "register", "register", "register", "register"]` for
    DINOv2-reg (`vit_keras.ViT.prefix_tokens`)."""
    return model_lib.ViT.of(model).prefix_tokens


def token_grid(model):
    """The model's patch-token grid `(rows, cols)` at the size it was built for
    (`vit_keras.ViT.token_grid`; for hybrids the ResNet feature map's)."""
    return model_lib.ViT.of(model).token_grid


def token_size_pixels(model):
    """`(height, width)` in input pixels covered by one token: image size over the token grid.

    16 for ViT-B/16 and for hybrids on a stride-16 feature map; floats when the division is uneven.
    """
    vit = model_lib.ViT.of(model)
    if vit.dynamic_image_size:  # every size is whole tokens
        return float(vit.token_pixels), float(vit.token_pixels)
    (height, width), (rows, cols) = vit.image_size, vit.token_grid
    return height / rows, width / cols


def position_embedding(model):
    """The `posembed_input` weight as a NumPy array `(tokens, hidden)` (class token's row first)."""
    embedding = model_lib.ViT.of(model).position_embedding
    if embedding is None:
        raise ValueError(f"{model.name} has no absolute position embedding (its positions are "
                         f"rotary, applied in attention); there is no table to show.")
    return _to_numpy(embedding.pos_embedding)[0]


def patch_embedding_kernel(model):
    """The `embedding` kernel as a NumPy array `(patch_h, patch_w, channels, hidden)` (HWIO)."""
    return _to_numpy(model_lib.ViT.of(model).patch_embedding.kernel)
