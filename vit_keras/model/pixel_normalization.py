"""Input normalisation: how a checkpoint's pixels were normalised when it was trained, and the
layer that does the same inside the model.

Every model of the family was trained on RGB pixels scaled to [0, 1] and then normalised per
channel, `(x / 255 - mean) / std`: timm states `mean` and `std` in each pretrained config, Hugging
Face in each image processor (`image_mean`, `image_std`), and they differ between families:

| name | mean | std | used by |
|---|---|---|---|
| `"inception"` | 0.5 | 0.5 | the paper's and AugReg's ViTs, SigLIP: `(x - 127.5) / 127.5` |
| `"imagenet"` | 0.485, 0.456, 0.406 | 0.229, 0.224, 0.225 | DeiT, DeiT III, DINOv2, MAE |
| `"clip"` | 0.4815, 0.4578, 0.4082 | 0.2686, 0.2613, 0.2758 | OpenAI's CLIP, and timm's CLIP |

(timm's names: `IMAGENET_INCEPTION_*`, `IMAGENET_DEFAULT_*`, `OPENAI_CLIP_*`.) A model fed pixels
normalised the wrong way gives wrong outputs without any error, so `vit_keras.build_model` and
`build_model_from_checkpoint` put the weights' own normalisation into the model
(`PixelNormalization`, the layer named `rescale`) and save it with it.
"""

import dataclasses
import math
import types

import keras
from keras import ops

_PACKAGE = "vit_keras"


@dataclasses.dataclass(frozen=True)
class Normalization:
    """Per-channel `mean` and `std` of pixels scaled to [0, 1] (tuples of floats, one per channel,
    or one for every channel); `name` is the convention's, when it is one of `NORMALIZATIONS`."""

    mean: tuple
    std: tuple
    name: str | None = None

    def __post_init__(self):
        mean, std = _floats(self.mean, "mean"), _floats(self.std, "std")
        if len(mean) != len(std) and 1 not in (len(mean), len(std)):
            raise ValueError(f"Normalisation mean {mean} and std {std} have different lengths.")
        if not all(math.isfinite(value) for value in mean + std) or min(std) <= 0:
            raise ValueError(f"Normalisation mean {mean} and std {std}: every mean must be finite "
                             f"and every std positive.")
        _check_float32(mean, std)
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)

    def __str__(self):
        values = f"mean {_rounded(self.mean)}, std {_rounded(self.std)}"
        return f"{self.name!r} ({values})" if self.name else values

    def for_channels(self, channels):
        """`(mean, std)` for images of `channels` channels: as they are, or one value for every
        channel where all channels have the same (the paper's 0.5 fits grey images too)."""
        if channels not in (len(self.mean), len(self.std)) and len(set(self.mean)) == 1 and len(
                set(self.std)) == 1:
            return self.mean[:1], self.std[:1]
        return self.mean, self.std

    def matches(self, other):
        """Whether `other` normalises as this one does (to float32 precision; one value stands
        for every channel)."""
        channels = max(map(len, (self.mean, self.std, other.mean, other.std)))
        return all(len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a, b))
                   for a, b in ((_per_channel(self.mean, channels),
                                 _per_channel(other.mean, channels)),
                                (_per_channel(self.std, channels),
                                 _per_channel(other.std, channels))))


_LARGEST = 65504.0
"""The largest normalised pixel taken: float16's largest number, so that no compute dtype
overflows (nor a float32 LayerNorm, which squares and sums the values it is given)."""
_RESOLUTION = 2.0 ** -23
"""float32's relative resolution: a pixel step smaller than this relative to the normalised
values (or, absolutely, than its half, next to the model's biases of order 1) is rounded away."""


def _check_float32(mean, std):
    """Refuses a `mean` and `std` whose normalised pixels `(x - mean) / std`, x in [0, 1], float32
    cannot hold: too large, or in steps of one pixel level (1/255) that rounding loses."""
    channels = max(len(mean), len(std))
    for m, s in zip(_per_channel(mean, channels), _per_channel(std, channels)):
        largest, step = max(abs(m), abs(1 - m)) / s, 1 / (255 * s)
        floor = max(largest * _RESOLUTION, _RESOLUTION / 2)
        if largest > _LARGEST or step < floor:
            raise ValueError(
                f"Normalisation mean {mean} and std {std} would overflow or lose the image in "
                f"float32: pixels normalise to values up to {largest:.3g} (at most {_LARGEST:g} "
                f"are taken) in steps of {step:.3g} (rounding loses steps below {floor:.3g}). "
                f"Give them in the [0, 1] pixel scale, e.g. mean 0.5 and std 0.5.")


def _per_channel(values, channels):
    """`values` for each of `channels` channels (one value stands for every channel)."""
    return values * channels if len(values) == 1 else values


def _floats(values, what):
    values = (values,) if isinstance(values, (int, float)) else values
    try:
        values = tuple(float(value) for value in values)
    except (TypeError, ValueError):
        raise ValueError(f"Normalisation {what} must be a number or a sequence of numbers; got "
                         f"{values!r}.") from None
    if not values:
        raise ValueError(f"Normalisation {what} is empty.")
    return values


def _rounded(values):
    return "(" + ", ".join(f"{value:.4g}" for value in values) + ")"


NORMALIZATIONS = types.MappingProxyType({
    "inception": Normalization((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "inception"),
    "imagenet": Normalization((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "imagenet"),
    "clip": Normalization((0.48145466, 0.4578275, 0.40821073),
                          (0.26862954, 0.26130258, 0.27577711), "clip"),
})
"""The family's conventions by name (the table above), read-only."""

PAPER = NORMALIZATIONS["inception"]
"""The original ViT weights' normalisation, `(x - 127.5) / 127.5`: a new model's default."""


def get_normalization(value):
    """Resolves a name of `NORMALIZATIONS`, a `Normalization`, a `(mean, std)` pair or a
    `{"mean": ..., "std": ...}` mapping (values in the [0, 1] pixel scale) to a `Normalization`,
    named when it equals one of `NORMALIZATIONS`."""
    if isinstance(value, Normalization):
        found = value
    elif isinstance(value, str):
        if value not in NORMALIZATIONS:
            raise ValueError(f"Unknown normalization {value!r}; expected one of "
                             f"{', '.join(NORMALIZATIONS)}, or (mean, std).")
        return NORMALIZATIONS[value]
    elif isinstance(value, dict) and set(value) >= {"mean", "std"}:
        found = Normalization(value["mean"], value["std"])
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        found = Normalization(*value)
    else:
        raise ValueError(f"A normalization is a name ({', '.join(NORMALIZATIONS)}), (mean, std) "
                         f"or {{'mean': ..., 'std': ...}}; got {value!r}.")
    named = next((known for known in NORMALIZATIONS.values() if known.matches(found)), None)
    return named or dataclasses.replace(found, name=None)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PixelNormalization(keras.layers.Layer):
    """RGB pixels in [0, 255] → `(x / 255 - mean) / std` per channel, as `x * scale + offset`.

    Input and output: `(batch, height, width, channels)`. `mean` and `std` are in the [0, 1]
    pixel scale, one value per channel or one for all (see `NORMALIZATIONS`). With the default
    (0.5, 0.5) it computes exactly what `keras.layers.Rescaling(1 / 127.5, offset=-1)` does.
    """

    def __init__(self, mean=PAPER.mean, std=PAPER.std, **kwargs):
        super().__init__(**kwargs)
        normalization = Normalization(mean, std)
        self.mean, self.std = normalization.mean, normalization.std
        channels = max(len(self.mean), len(self.std))
        mean, std = _per_channel(self.mean, channels), _per_channel(self.std, channels)
        # Tuples: Keras tracks a list attribute as a `TrackedList`, which torch.compile cannot
        # turn into a constant (a graph break in every compiled forward pass).
        self._scale = tuple(1.0 / (255.0 * s) for s in std)
        self._offset = tuple(-m / s for m, s in zip(mean, std))

    def build(self, input_shape):
        channels = input_shape[-1]
        if channels is not None and len(self._scale) not in (1, channels):
            raise ValueError(
                f"{self.name}: a normalisation of {len(self._scale)} channels cannot apply to "
                f"images of {channels} channels; give one mean and std per channel, or one "
                f"for all.")

    def call(self, images):
        images = ops.cast(images, self.compute_dtype)
        scale = ops.convert_to_tensor(self._scale, self.compute_dtype)
        offset = ops.convert_to_tensor(self._offset, self.compute_dtype)
        return images * scale + offset

    def compute_output_shape(self, input_shape):
        return input_shape

    @property
    def normalization(self):
        """The layer's `Normalization` (named when it is one of `NORMALIZATIONS`)."""
        return get_normalization((self.mean, self.std))

    def get_config(self):
        return {**super().get_config(), "mean": list(self.mean), "std": list(self.std)}
