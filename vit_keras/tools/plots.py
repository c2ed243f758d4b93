"""Figures in the style of the paper's Figures 6 and 7 from the arrays of `vit_keras.analysis`,
and a training run's curves (`plot_history`).

Each function writes one PNG of a fixed pixel size (stated in its docstring) to a file name,
whole or not at all, or to a binary file object, and returns it.
matplotlib is imported inside the functions and drawn with its Agg canvas (no pyplot state, no
display needed); install it with the `apps` extra.
"""

import io

import numpy as np

from vit_keras import atomic_files

_DPI = 100


def _figure(width_in, height_in):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width_in, height_in), dpi=_DPI)
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path):
    """`figure` as a PNG into `path`, a binary file object, or a file name written whole or not
    at all: drawn in memory, then written by `atomic_files.write_bytes` (a link at `path` is
    replaced, not written through)."""
    if hasattr(path, "write"):
        figure.savefig(path, dpi=_DPI, format="png")
        return path
    png = io.BytesIO()
    figure.savefig(png, dpi=_DPI, format="png")
    atomic_files.write_bytes(png.getvalue(), path)
    return path


def _mosaic(tiles, columns, gap=1):
    """`(n, h, w[, c])` tiles → one array with `gap` NaN pixels between them, `columns` per row."""
    count, height, width = tiles.shape[:3]
    rows = -(-count // columns)
    shape = (rows * (height + gap) - gap, columns * (width + gap) - gap, *tiles.shape[3:])
    mosaic = np.full(shape, np.nan)
    for index, tile in enumerate(tiles):
        top, left = (index // columns) * (height + gap), (index % columns) * (width + gap)
        mosaic[top:top + height, left:left + width] = tile
    return mosaic


def _resize(array, height, width):
    """Bilinear resize of a 2D float map to `(height, width)`."""
    from PIL import Image

    image = Image.fromarray(np.asarray(array, dtype=np.float32), mode="F")
    return np.asarray(image.resize((width, height), Image.BILINEAR), dtype=np.float64)


def _show_image(axes, image):
    image = np.clip(np.asarray(image, dtype=np.float64) / 255.0, 0.0, 1.0)
    if image.ndim == 3 and image.shape[-1] == 1:
        image = image[..., 0]
    axes.imshow(image, cmap="gray" if image.ndim == 2 else None, vmin=0, vmax=1)


def rollout_figure(images, rollouts, path, titles=None):
    """Attention rollout (Figure 6): per image, the input, the map over it, and the attended image.

    Args:
      images: `(batch, height, width, channels)` pixels in [0, 255] (1 or 3 channels).
      rollouts: `(batch, rows, cols)` from `analysis.attention_rollout`.
      path: where the PNG goes.
      titles: optional one label per image (e.g. file names or predicted classes).

    Returns:
      `path`. The PNG is 750 x (250 * batch) pixels.
    """
    images = np.asarray(images)
    rollouts = np.asarray(rollouts, dtype=np.float64)
    if len(images) != len(rollouts):
        raise ValueError(f"Got {len(images)} images but {len(rollouts)} rollout maps.")
    figure = _figure(7.5, 2.5 * len(images))
    grid = figure.subplots(len(images), 3, squeeze=False)
    figure.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=1 - 0.3 / (2.5 * len(images)),
                           wspace=0.04, hspace=0.16)
    for index, (image, rollout, row) in enumerate(zip(images, rollouts, grid)):
        height, width = image.shape[:2]
        mask = _resize(rollout / max(rollout.max(), 1e-12), height, width)
        label = titles[index] if titles is not None else f"Image {index + 1}"
        _show_image(row[0], image)
        row[0].set_title(label, fontsize=9)
        _show_image(row[1], image)
        row[1].imshow(mask, cmap="inferno", alpha=0.6, vmin=0, vmax=1)
        row[1].set_title("Attention rollout", fontsize=9)
        _show_image(row[2], image * (mask if image.ndim == 2 else mask[..., None]))
        row[2].set_title("Attended image", fontsize=9)
        for axes in row:
            axes.set_xticks([])
            axes.set_yticks([])
    return _save(figure, path)


def attention_distance_figure(distances, path, max_distance=None, uniform_distance=None,
                              title=None):
    """Mean attention distance (Figure 7, right): one dot per head at each layer.

    Args:
      distances: `(layers, heads)` pixels from `analysis.mean_attention_distance`.
      path: where the PNG goes.
      max_distance: the y-axis limit in pixels (e.g. the image's diagonal); default: 10% above the
        largest distance.
      uniform_distance: optional distance of a head that attends uniformly, drawn as a dashed line
        (heads below it look locally).
      title: the plot title.

    Returns:
      `path`. The PNG is 500 x 400 pixels.
    """
    distances = np.asarray(distances, dtype=np.float64)
    layers, heads = distances.shape
    figure = _figure(5.0, 4.0)
    axes = figure.add_subplot()
    figure.subplots_adjust(left=0.13, right=0.97, bottom=0.12, top=0.91)
    colours = _head_colours(heads)
    depth = np.arange(1, layers + 1)
    for head in range(heads):
        axes.scatter(depth, distances[:, head], s=14, color=colours[head], label=f"Head {head + 1}",
                     edgecolors="none")
    if uniform_distance is not None:
        axes.axhline(uniform_distance, color="0.5", linestyle="--", linewidth=1,
                     label="Uniform attention")
    top = max_distance or 1.1 * max(np.nanmax(distances), uniform_distance or 0, 1e-6)
    axes.set_ylim(0, top)
    axes.set_xlim(0.5, layers + 0.5)
    axes.set_xticks(depth if layers <= 12 else np.unique(np.linspace(1, layers, 7).round()))
    axes.set_xlabel("Network depth (layer)")
    axes.set_ylabel("Mean attention distance (pixels)")
    axes.set_title(title or "Mean attention distance per head", fontsize=10)
    axes.grid(alpha=0.3)
    if heads <= 16:
        axes.legend(fontsize=6, ncol=2 if heads > 4 else 1, loc="upper left", framealpha=0.8,
                    handletextpad=0.1, markerscale=0.8)
    return _save(figure, path)


def _head_colours(heads):
    from matplotlib import colormaps

    palette = colormaps["tab10" if heads <= 10 else "tab20"]
    return [palette(index % palette.N) for index in range(heads)]


def position_similarity_figure(similarity, path, title=None):
    """Position-embedding similarity (Figure 7, centre): tile `(r, c)` is the cosine similarity of
    patch `(r, c)`'s position embedding to every patch's, on the grid.

    Args:
      similarity: `(rows, cols, rows, cols)` from `analysis.position_embedding_similarity`.
      path: where the PNG goes.
      title: the plot title.

    Returns:
      `path`. The PNG is 600 x 500 pixels.
    """
    similarity = np.asarray(similarity, dtype=np.float64)
    rows, cols = similarity.shape[:2]
    mosaic = _mosaic(similarity.reshape(rows * cols, rows, cols), cols)
    figure = _figure(6.0, 5.0)
    axes = figure.add_subplot()
    figure.subplots_adjust(left=0.1, right=0.86, bottom=0.1, top=0.92)
    image = axes.imshow(mosaic, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    step_y, step_x = rows + 1, cols + 1
    label_every_y, label_every_x = max(1, rows // 8), max(1, cols // 8)
    y_ticks = np.arange(0, rows, label_every_y)
    x_ticks = np.arange(0, cols, label_every_x)
    axes.set_yticks(y_ticks * step_y + (rows - 1) / 2, [str(t + 1) for t in y_ticks], fontsize=7)
    axes.set_xticks(x_ticks * step_x + (cols - 1) / 2, [str(t + 1) for t in x_ticks], fontsize=7)
    axes.tick_params(length=0)
    for spine in axes.spines.values():
        spine.set_visible(False)
    axes.set_ylabel("Input patch row")
    axes.set_xlabel("Input patch column")
    axes.set_title(title or "Position embedding similarity", fontsize=10)
    colorbar = figure.colorbar(image, ax=axes, fraction=0.046, pad=0.03, shrink=0.9)
    colorbar.set_label("Cosine similarity")
    return _save(figure, path)


def filter_components_figure(components, path, explained=None, columns=7, title=None):
    """Patch-embedding filters (Figure 7, left): each principal component as an RGB (or grey) patch,
    rescaled to [0, 1] on its own.

    Args:
      components: `(n, patch_h, patch_w, channels)` from `analysis.embedding_filter_components`,
        with 1 or 3 channels.
      path: where the PNG goes.
      explained: optional `(n,)` explained-variance ratios, summed into the title.
      columns: components per row (7 as in the paper).
      title: the plot title.

    Returns:
      `path`. The PNG is 700 x 450 pixels.
    """
    components = np.asarray(components, dtype=np.float64)
    count, _, _, channels = components.shape
    if channels not in (1, 3):
        raise ValueError(
            f"Filters with {channels} input channels cannot be shown as RGB or grey patches (a "
            f"hybrid's embedding sees a ResNet feature map, not pixels); got components of shape "
            f"{components.shape}.")
    low = components.min(axis=(1, 2, 3), keepdims=True)
    high = components.max(axis=(1, 2, 3), keepdims=True)
    tiles = (components - low) / np.maximum(high - low, 1e-12)
    if channels == 1:
        tiles = tiles[..., 0]
    columns = min(columns, count)
    mosaic = _mosaic(tiles, columns)
    if channels == 3:  # gaps white, not NaN (RGB images have no colour map for bad values)
        mosaic = np.where(np.isnan(mosaic), 1.0, mosaic)
    figure = _figure(7.0, 4.5)
    axes = figure.add_subplot()
    figure.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=0.9)
    if channels == 1:
        from matplotlib import colormaps

        grey = colormaps["gray"].with_extremes(bad="white")
        axes.imshow(mosaic, cmap=grey, vmin=0, vmax=1, interpolation="nearest")
    else:
        axes.imshow(mosaic, interpolation="nearest")
    axes.set_axis_off()
    heading = title or f"Embedding filters (first {count} principal components)"
    if explained is not None:
        heading += f"\n{100 * float(np.sum(explained)):.0f}% of the filters' variance"
    axes.set_title(heading, fontsize=10)
    return _save(figure, path)


def plot_history(history, path):
    """Loss and accuracy per epoch (train and val), from `run_folder.read_history` rows, as a
    10x4 inch PNG at 100 dpi; a metric no row holds (a pre-training run's accuracy) gets no
    panel."""
    metrics = [m for m in ("loss", "accuracy") if any(m in row for row in history)] or ["loss"]
    figure = _figure(10, 4)
    epochs = [row["epoch"] + 1 for row in history]
    for index, metric in enumerate(metrics):
        axes = figure.add_subplot(1, len(metrics), index + 1)
        for prefix, label in (("", "train"), ("val_", "val")):
            if prefix and not any(prefix + metric in row for row in history):
                continue
            values = [row.get(prefix + metric, np.nan) for row in history]
            axes.plot(epochs, values, marker="o", markersize=3, label=label)
        axes.set_xlabel("epoch")
        axes.set_title(metric)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    return _save(figure, path)
