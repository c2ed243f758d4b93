"""The variant table: every model of the paper as one record of data."""

import dataclasses
import types

from vit_keras.model import legacy
from vit_keras.model.position_embeddings import RopeSpec


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """The architecture of one Vision Transformer.

    `patch_size` is in pixels of the image fed to the Transformer (for hybrids: of the ResNet's
    feature map). Everything that can differ between two runs of the same architecture (image size,
    classes, dropout) is an argument of `build_model`, not part of the config.
    """

    name: str
    patch_size: int
    hidden_size: int
    mlp_dim: int
    num_heads: int
    num_layers: int
    # Hybrids only: units per ResNet stage (`()`: the root alone) and its width multiplier.
    resnet_layers: tuple | None = None
    resnet_width: int = 1
    # The family's switches (DeiT, DeiT III, DINOv2, SigLIP, CLIP, MAE); the defaults are the
    # paper's model. See docs/checkpoints.md for which family sets which.
    layer_scale_init: float | None = None  # LayerScale on both residual branches, its init value
    num_registers: int = 0  # register tokens (DINOv2-reg); they take no position embedding
    distillation: bool = False  # DeiT's distillation token and its second head `head_dist`
    posemb_prefix: bool = True  # position embeddings cover the class/distillation tokens
    pre_norm: bool = False  # LayerNorm before the encoder (CLIP's `ln_pre`)
    fc_norm: bool = False  # LayerNorm after pooling instead of before it (MAE, BEiT fine-tuning)
    patch_bias: bool = True  # the patch embedding has a bias (CLIP's has none)
    layer_norm_epsilon: float = 1e-6
    gelu: str = "exact"  # "exact" (erf), "tanh" (Flax's approximation) or "quick" (CLIP's)
    # A class token: None follows the classifier ("token" has one, "gap" and "map" none); True
    # keeps one beside another pooling (MAE fine-tuned with mean pooling).
    class_token: bool | None = None
    # The slots: which implementation the model builds for each part, by the name its table
    # gives (vit_keras.model.mlp.MLPS, vit_keras.model.norms.NORMS, vit_keras.model.position_embeddings).
    mlp: str = "gelu"
    norm: str = "layer_norm"
    position_embedding: str = "learned"  # or "none": no absolute embedding (RoPE alone)
    # How the forward pass resizes the learned grid (dynamic image size, NaFlex): antialiased
    # "bicubic" (timm's) or "bilinear" (SigLIP 2's, as big_vision and transformers resize it).
    posemb_interpolation: str = "bicubic"
    # Resize the grid as a square of the longer side and keep its top-left rows x cols, so a
    # patch's embedding does not depend on the other side (timm's `pos_embed_ar_preserving`).
    posemb_preserve_aspect: bool = False
    # The rotary and gated families' switches (EVA-02, DINOv3, PE, AIMv2, RoPE-ViT, DINOv2
    # giant); see docs/checkpoints.md.
    qkv_bias: str = "qkv"  # which of the query, key and value projections have biases: "qv", "none"
    proj_bias: bool = True  # the attention's output projection has a bias
    mlp_bias: bool = True  # the MLP's projections have biases
    mlp_norm: bool = False  # a norm inside the MLP before its output projection (EVA-02)
    patch_norm: bool = False  # a norm on the patch embeddings (AIMv2)
    map_num_heads: int | None = None  # the MAP head's heads (None: num_heads; PE's: 8)
    map_prefix: bool = False  # the MAP head attends to the prefix tokens too (PE)
    # Rotary embeddings: their spec (vit_keras.model.position_embeddings.RopeSpec; a dict of its
    # fields, or its kind alone: "axial", "dinov3", "mixed"), or None.
    rope: RopeSpec | None = None

    @property
    def is_hybrid(self):
        return self.resnet_layers is not None

    def has_class_token(self, classifier):
        """Whether a model of this config with `classifier` has a class token."""
        return classifier == "token" if self.class_token is None else self.class_token

    def num_prefix_tokens(self, classifier):
        """Tokens before the patches: class token, distillation token, registers, in that order."""
        return (int(self.has_class_token(classifier)) + int(self.distillation)
                + self.num_registers)

    def __post_init__(self):
        if self.resnet_layers is not None:  # JSON gives lists
            object.__setattr__(self, "resnet_layers", tuple(self.resnet_layers))
        rope = RopeSpec(self.rope) if isinstance(self.rope, str) else RopeSpec.of(self.rope)
        object.__setattr__(self, "rope", rope)
        for field, allowed in _CHOICES.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"{self.name}: unknown {field} {getattr(self, field)!r}; expected "
                                 f"one of {allowed}.")
        if self.rope and (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"{self.name}: rotary embeddings rotate pairs along two axes, so the "
                             f"head size ({self.hidden_size // self.num_heads}) must be a "
                             f"multiple of 4.")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"{self.name}: hidden size {self.hidden_size} is not divisible by the number of "
                f"heads {self.num_heads}; choose a hidden size that is a multiple of "
                f"{self.num_heads}.")
        for field in ("patch_size", "hidden_size", "mlp_dim", "num_heads", "num_layers"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be positive; got {getattr(self, field)}.")
        if self.gelu not in GELUS:
            raise ValueError(f"{self.name}: unknown gelu {self.gelu!r}; expected one of {GELUS}.")
        if self.num_registers < 0:
            raise ValueError(f"{self.name}: num_registers must be 0 or more; got "
                             f"{self.num_registers}.")
        if self.distillation and self.class_token is False:
            raise ValueError(f"{self.name}: a distillation token needs a class token (DeiT reads "
                             f"both); leave class_token at None or True.")


GELUS = ("exact", "tanh", "quick")
_CHOICES = {"qkv_bias": ("qkv", "qv", "none"), "position_embedding": ("learned", "none"),
            "posemb_interpolation": ("bicubic", "bilinear")}
_SIZES = ("name", "patch_size", "hidden_size", "mlp_dim", "num_heads", "num_layers",
          "resnet_layers", "resnet_width")
SWITCHES = tuple(field.name for field in dataclasses.fields(ViTConfig) if field.name not in _SIZES)
"""The `ViTConfig` fields that switch a family member's behaviour on (not its sizes), derived
from the fields: a new field is a switch unless it is a size."""


def _vit(size, patch, hidden, mlp, heads, layers):
    return ViTConfig(f"ViT-{size}/{patch}", patch, hidden, mlp, heads, layers)


def _hybrid(resnet, vit, patch_size, resnet_layers):
    """A ResNet stem feeding `vit`'s Transformer with `patch_size` patches of its feature map."""
    return dataclasses.replace(vit, name=f"{resnet}+{vit.name}", patch_size=patch_size,
                               resnet_layers=resnet_layers)


# Sizes from Table 1 of the paper (Ti and S from "How to train your ViT", g and G from "Scaling
# Vision Transformers"); the same sizes with
# 14-pixel patches are DINOv2's (S, B, L) and CLIP's ViT-L/14.
_VITS = (
    _vit("Ti", 16, 192, 768, 3, 12),
    _vit("S", 14, 384, 1536, 6, 12),
    _vit("S", 16, 384, 1536, 6, 12),
    _vit("S", 32, 384, 1536, 6, 12),
    _vit("B", 8, 768, 3072, 12, 12),
    _vit("B", 14, 768, 3072, 12, 12),
    _vit("B", 16, 768, 3072, 12, 12),
    _vit("B", 32, 768, 3072, 12, 12),
    _vit("L", 14, 1024, 4096, 16, 24),
    _vit("L", 16, 1024, 4096, 16, 24),
    _vit("L", 32, 1024, 4096, 16, 24),
    _vit("H", 14, 1280, 5120, 16, 32),
    # Zhai et al., "Scaling Vision Transformers" (CVPR 2022), Table 2: 1011M and 1843M parameters
    # without the class token and the head.
    _vit("g", 14, 1408, 6144, 16, 40),
    _vit("G", 14, 1664, 8192, 16, 48),
)
_BY_NAME = {config.name: config for config in _VITS}

# vit_jax's hybrids (configs/models.py). The stem strides by 4 (root) and 2 per stage after the
# first, so the names' "/16" and "/32" are the effective pixels per token; R+ViT-Ti/16 is named
# after its Transformer (its 8x8 patches on the stride-4 root map make 32-pixel tokens).
_HYBRIDS = (
    _hybrid("R50", _BY_NAME["ViT-B/16"], 1, (3, 4, 9)),
    _hybrid("R26", _BY_NAME["ViT-S/32"], 1, (2, 2, 2, 2)),
    _hybrid("R26", _BY_NAME["ViT-B/32"], 1, (2, 2, 2, 2)),
    _hybrid("R50", _BY_NAME["ViT-L/32"], 1, (3, 4, 6, 3)),
    _hybrid("R", _BY_NAME["ViT-Ti/16"], 8, ()),
)

# The rotary and gated families' sizes that the paper's table lacks (their switches are data too;
# a checkpoint of one sets its own). DINOv3 S/B/L and PE core B have the paper's sizes: their
# releases are the paper's variants, the switches read from the files.
_FAMILY = (
    ViTConfig("EVA02-B/14", 14, 768, 2048, 12, 12, mlp="swiglu", mlp_norm=True, qkv_bias="qv",
              fc_norm=True, class_token=True, rope=RopeSpec("axial", ref_grid=(16, 16))),
    ViTConfig("EVA02-L/14", 14, 1024, 2730, 16, 24, mlp="swiglu", mlp_norm=True, qkv_bias="qv",
              fc_norm=True, class_token=True, rope=RopeSpec("axial", ref_grid=(16, 16))),
    ViTConfig("AIMv2-L/14", 14, 1024, 2816, 8, 24, norm="rms_norm", mlp="swiglu",
              qkv_bias="none", proj_bias=False, mlp_bias=False, patch_norm=True,
              layer_norm_epsilon=1e-5),
    # DINOv2's giant (Oquab et al.), not the ViT-g/14 of Zhai et al. ("Scaling Vision Transformers").
    ViTConfig("DINOv2-g/14", 14, 1536, 4096, 24, 40, mlp="swiglu", layer_scale_init=1e-5),
    # The shape-optimised ViT of Alabdulmohsin et al. ("Getting ViT in Shape"), SigLIP's and
    # SigLIP 2's largest tower.
    ViTConfig("ViT-So400m/16", 16, 1152, 4304, 16, 27),
)

VARIANTS = types.MappingProxyType(
    {config.name: config for config in _VITS + _HYBRIDS + _FAMILY})
"""Every variant of the paper (ViTs and hybrids) and the sizes of the families that the paper
lacks (EVA-02 B and L, AIMv2 L, DINOv2 giant, SigLIP's So400m), by name, read-only."""


# The size in a variant's name by its width (Ti 192, S 384, B 768, ..., DINOv2's giant g 1536).
_SIZE_BY_WIDTH = {config.hidden_size: config.name.split("-")[1].split("/")[0]
                  for config in _VITS + _FAMILY}


def family_variant_name(family, config):
    """A family's name for the architecture `config`: `"DINOv3-B/16"`, `"EVA02-S/14"` (the size
    that of the variants of its width; the width itself where none has it)."""
    size = _SIZE_BY_WIDTH.get(config.hidden_size, config.hidden_size)
    return f"{family}-{size}/{config.patch_size}"


def get_config(variant):
    """Resolves a variant name (`"ViT-B/16"`, or `"ViT-B_16"` as the published files spell it), a
    `ViTConfig` or a mapping of `ViTConfig` fields (as `dataclasses.asdict` gives them, or as an
    earlier version saved them) to a `ViTConfig`."""
    if isinstance(variant, ViTConfig):
        return variant
    if isinstance(variant, dict):
        fields = {"name": "custom", **legacy.variant_config(variant)}
        unknown = set(fields) - {f.name for f in dataclasses.fields(ViTConfig)}
        if unknown:
            raise ValueError(f"Unknown config fields {sorted(unknown)}; a config has the fields of "
                             f"ViTConfig: {[f.name for f in dataclasses.fields(ViTConfig)]}.")
        return ViTConfig(**fields)
    if variant in VARIANTS:
        return VARIANTS[variant]
    official = variant.replace("_", "/") if isinstance(variant, str) else None
    if official in VARIANTS:  # the release files' spelling, "ViT-B_16"
        return VARIANTS[official]
    raise ValueError(f"Unknown variant {variant!r}; known variants: {', '.join(VARIANTS)}.")
