"""The ViT family, one record per family: how its checkpoints are recognised (release names, timm
architecture names, transformers `model_type`s), what it computes with that its weights do not
store (LayerNorm epsilon, GELU, rotary embeddings), how its pixels are normalised, how timm
evaluates it, and its heads where a timm name's size does not say them.

Every reader asks these records: `releases` (a release's normalisation and numerics),
`release_files` (the checks of a release's files), `checkpoints.timm` (what an architecture name
says) and `checkpoints.huggingface` (what a `model_type` leaves to its config class). What a
format spells its own way stays in its reader: transformers' `hidden_act` names and config keys,
timm's size words (`base`: 12 heads) and its `quickgelu` models.

Adding a family is one `Family` in `FAMILIES` (where its timm pattern is tried in order), its
releases' files in `releases._FAMILY`, and new key names, if any, in `checkpoints.names`;
`tests/test_family_records.py` checks that each record is found by every key it claims.
"""

import dataclasses
import re

from vit_keras.model.position_embeddings import RopeSpec

_CROP_90, _CROP_95, _CROP_100 = (0.9, "bicubic"), (0.95, "bicubic"), (1.0, "bicubic")
# timm's evaluation crops of the ImageNet fine-tunes that the paper's ViTs, DeiT and DeiT III share.
_IN1K_224 = (r"^(?:vit|deit3?)_\w+_224\.(?:augreg2?_in\w+|orig_in21k\w*|fb_in1k)$", _CROP_90)
_IN1K_384 = (r"^(?:vit|deit3?)_\w+_384\.(?:augreg_in\w+|orig_in21k_ft_in1k|fb_in1k|"
             r"fb_in22k_ft_in1k)$", _CROP_100)


@dataclasses.dataclass(frozen=True)
class Family:
    """One family of ViT checkpoints. Mappings are `ViTConfig` fields unless said otherwise; a
    record is data: read it, never change it.

    Attributes:
      name: the family's name, which names a model read from its checkpoints
        (`configs.family_variant_name`: `"DINOv3-B/16"`) where `names_models`.
      names_models: False for the paper's ViT, whose models keep the paper's variant names.
      release_names: the releases of `vit_keras.weights.releases` that hold its weights.
      timm_pattern: a regular expression on timm's `"architecture.tag"` that claims the family;
        `FAMILIES` are tried in order, the first that matches wins; None for the paper's ViT,
        which takes every name no other record claims.
      model_types: the transformers `model_type`s of its `config.json` folders.
      layer_norm_epsilon: the LayerNorm (or RMSNorm) epsilon its models compute with (timm's and
        its releases'; transformers' config classes may differ, see `transformers_defaults`).
      gelu: the GELU of its releases (`"exact"`, `"tanh"`, `"quick"`).
      rope: its rotary embeddings (`RopeSpec`), None without.
      normalization: the input normalisation of its published weights (a key of
        `vit_keras.model.pixel_normalization.NORMALIZATIONS`), None where they differ.
      normalization_by_name: whether the family's name alone says `normalization`: False for
        the paper's ViT, whose `vit` folders and untagged timm names are also DINO's (ImageNet's
        mean and std); its releases and tags say it.
      eval_crop: `(crop_fraction, interpolation)` of timm's evaluation transform for every name
        of the family, or None (by `timm_eval_crops`, else resized).
      image_size: timm's input size for its names that do not end in one (rotary families
        without absolute position embeddings), or None.
      rope_own_grid: PE's rotary positions: on the model's own grid (image size / patch, from
        the name), counted from 1 beside a class token.
      timm: what timm's models of the family have that the keys do not say (DINOv3 pooled by
        the mean of its patch tokens, PE's attention pooling).
      transformers: the same for transformers' models (DINOv3's pooler: its class token).
      transformers_defaults: its config class's defaults for the `config.json` fields vit_keras
        reads, in transformers' names (a folder leaves a field at its default out).
      transformers_heads: its config class's `num_attention_heads`.
      timm_heads: `(pattern, {width: heads})` for names whose heads are not their size word's;
        the first that matches.
      timm_rope: `(pattern, RopeSpec)` for a family whose names differ in them; the first that
        matches, else `rope`.
      timm_switches: `(pattern, {field: value})` for names that switch more on than `timm`
        (timm's aspect-preserving NaFlexViTs); every one that matches adds its own.
      timm_normalization: `(pattern on "architecture.tag", normalisation name or None)`; the
        first that matches decides (None: not known), else `normalization` where
        `normalization_by_name`.
      timm_eval_crops: `(pattern on "architecture.tag", (crop_fraction, interpolation))`, where
        `eval_crop` is None; the first that matches.
    """

    name: str
    names_models: bool = True
    release_names: tuple = ()
    timm_pattern: str | None = None
    model_types: tuple = ()
    layer_norm_epsilon: float = 1e-6
    gelu: str = "exact"
    rope: RopeSpec | None = None
    normalization: str | None = None
    normalization_by_name: bool = True
    eval_crop: tuple | None = None
    image_size: int | None = None
    rope_own_grid: bool = False
    timm: dict = dataclasses.field(default_factory=dict)
    transformers: dict = dataclasses.field(default_factory=dict)
    transformers_defaults: dict = dataclasses.field(default_factory=dict)
    transformers_heads: int = 12
    timm_heads: tuple = ()
    timm_rope: tuple = ()
    timm_switches: tuple = ()
    timm_normalization: tuple = ()
    timm_eval_crops: tuple = ()

    @property
    def numerics(self):
        """What its releases compute with that their weights do not store, as `ViTConfig` fields:
        `layer_norm_epsilon`, `gelu` and, for a rotary family, the kind of its `rope`."""
        found = {"layer_norm_epsilon": self.layer_norm_epsilon, "gelu": self.gelu}
        if self.rope is not None:
            found["rope"] = self.rope.kind
        return found


VIT = Family(
    "ViT", names_models=False,
    release_names=("imagenet21k", "imagenet21k+imagenet2012", "augreg_in21k",
                   "augreg_in21k_ft_in1k", "augreg_in1k"),
    model_types=("vit",),
    normalization="inception", normalization_by_name=False,
    transformers_defaults={"layer_norm_eps": 1e-12, "hidden_act": "gelu"},
    timm_heads=((r"^vit_base_patch16_gap_224$", {768: 16}),),  # timm's B/16 with mean pooling
    timm_normalization=((r"\.dino$", "imagenet"), (r"\.augreg|\.orig_in21k", "inception")),
    timm_eval_crops=((r"\.dino$", _CROP_90), _IN1K_224, _IN1K_384))
"""The paper's ViTs (Google's, AugReg's) and every timm name no other record claims."""

FAMILIES = (
    Family(
        "DINOv3", release_names=("dinov3",), timm_pattern=r"_dinov3",
        model_types=("dinov3_vit",), layer_norm_epsilon=1e-5,
        rope=RopeSpec("dinov3", temperature=100.0, rotate_half=True),
        normalization="imagenet", eval_crop=_CROP_100, image_size=256,
        timm={"classifier": "gap"},  # timm pools by the mean of the patch tokens
        transformers={"classifier": "token"},  # transformers' pooler: the class token
        transformers_defaults={"layer_norm_eps": 1e-5, "hidden_act": "gelu", "rope_theta": 100.0},
        transformers_heads=6,
        # Its satellite weights have their own; without a tag L and 7B may be either.
        timm_normalization=((r"^vit_(?:large|7b)_patch16_dinov3(?:_qkvb)?(?:\.sat|$)", None),)),
    Family(
        "DINOv2", release_names=("dinov2", "dinov2_reg4"), timm_pattern=r"_dinov2",
        model_types=("dinov2", "dinov2_with_registers"), normalization="imagenet",
        eval_crop=_CROP_100,
        transformers_defaults={"layer_norm_eps": 1e-6, "hidden_act": "gelu"}),
    Family(
        "EVA02", release_names=("eva02_mim_in22k",), timm_pattern=r"^eva02_",
        rope=RopeSpec("axial", ref_grid=(16, 16)), normalization="clip",
        timm_eval_crops=(
            (r"^eva02_\w+_224\.(?:mim_in22k|mim_m38m|merged2b|laion2b(?:_plus)?)$", _CROP_90),
            (r"^eva02_\w+_(?:336|448)\.(?:mim_(?:in22k|m38m)_ft_in1k|merged2b)$", _CROP_100))),
    Family(
        # Perception Encoder: EVA's positions rescaled to its own grid; attention pooling over
        # every token.
        "PE", release_names=("pe_core",), timm_pattern=r"^vit_pe_", layer_norm_epsilon=1e-5,
        rope=RopeSpec("axial", xy=True), normalization="inception", eval_crop=_CROP_100,
        rope_own_grid=True, timm={"map_num_heads": 8, "map_prefix": True},
        timm_heads=((r"^vit_pe_[a-z]+_gigantic_", {1536: 16}),)),
    Family(
        "AIMv2", release_names=("aimv2",), timm_pattern=r"^aimv2_",
        model_types=("aimv2_vision_model",), layer_norm_epsilon=1e-5, normalization="clip",
        eval_crop=_CROP_100,
        transformers_defaults={"rms_norm_eps": 1e-5, "hidden_act": "silu", "use_head": True},
        transformers_heads=8,
        timm_heads=((r"^aimv2_large_", {1024: 8}), (r"^aimv2_huge_", {1536: 12}),
                    (r"^aimv2_1b_", {2048: 16}), (r"^aimv2_3b_", {3072: 24}))),
    Family(
        "DeiT3", release_names=("deit3_in22k_ft_in1k",), timm_pattern=r"^deit3_",
        normalization="imagenet",
        timm_eval_crops=(_IN1K_224, _IN1K_384,
                         (r"^deit3_\w+_224\.fb_in22k_ft_in1k$", _CROP_100))),
    Family(
        "DeiT", release_names=("deit_in1k", "deit_distilled_in1k"), timm_pattern=r"^deit_",
        # ImageNet's mean and std, as the published processors (facebook/deit-*) say; not
        # transformers' DeiTImageProcessor() default of 0.5.
        model_types=("deit",), normalization="imagenet",
        transformers_defaults={"layer_norm_eps": 1e-12, "hidden_act": "gelu"},
        timm_eval_crops=(_IN1K_224, _IN1K_384)),
    Family(
        "SigLIP", release_names=("siglip_webli",), timm_pattern=r"^(?!naflexvit_)\w*_siglip",
        model_types=("siglip_vision_model",), gelu="tanh", normalization="inception",
        transformers_defaults={"layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"},
        timm_eval_crops=(
            (r"_siglip_gap_(?:448|896)\.pali\w*$|^vit_so400m_patch14_siglip_gap_(?:378|384)\.webli$",
             _CROP_100),
            (r"_siglip_(?:gap_)?\d+\.(?:v2_webli|webli|webli_i18n|pali_mix|pali_pt|pali2_3b_pt|"
             r"pali2_10b_pt)$", _CROP_90))),
    Family(
        # SigLIP 2's NaFlex towers (google/siglip2-*-naflex): a model read from one takes NaFlex
        # inputs, its grid resized bilinearly with antialiasing as transformers and big_vision do.
        "SigLIP2", release_names=("siglip2_naflex",), timm_pattern=r"^naflexvit_\w+_siglip",
        model_types=("siglip2_vision_model",),
        gelu="tanh", normalization="inception",
        timm={"naflex": True, "posemb_interpolation": "bilinear", "gelu": "tanh"},  # gelu_tanh
        transformers={"naflex": True, "posemb_interpolation": "bilinear"},
        transformers_defaults={"layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
                               "patch_size": 16, "num_patches": 256}),
    Family(
        # timm's own NaFlex ViTs (`naflexvit_base_patch16_par_gap.e300_s576_in1k`): their grid is
        # resized bicubically, as a square of the longer side for the `_par` (aspect-preserving)
        # ones; NVIDIA's RADIO backbones are timm's NaFlexViTs too, but resize without
        # antialiasing, which vit_keras does not, and are refused (`checkpoints.timm`).
        "NaFlexViT", timm_pattern=r"^naflexvit_(?!\w+_siglip)", normalization="inception",
        eval_crop=_CROP_100, timm={"naflex": True},
        timm_switches=((r"^naflexvit_\w+_par(?:fac)?_", {"posemb_preserve_aspect": True}),)),
    Family(
        "CLIP", release_names=("clip_openai",), timm_pattern=r"_clip_",
        model_types=("clip_vision_model",), layer_norm_epsilon=1e-5, gelu="quick",
        normalization="clip",
        transformers_defaults={"layer_norm_eps": 1e-5, "hidden_act": "quick_gelu"},
        timm_normalization=(
            (r"^vit_large_patch14_clip_\d+\.laion2b", "inception"),  # LAION's L/14, unlike its others
            (r"^vit_large_patch14_clip_\d+$", None)),  # without a tag: OpenAI's or LAION's
        timm_eval_crops=(
            (r"^vit_base_patch(?:16|32)_clip_(?:quickgelu_)?224\.openai(?:_ft_in1k|_ft_in12k)?$",
             _CROP_90),
            (r"^vit_base_patch32_clip_(?:quickgelu_)?224\.laion(?:2b(?:_ft_in1k|_ft_in12k_in1k)?|"
             r"400m_e32)$", _CROP_90),
            (r"^vit_base_patch16_clip_224\.laion2b_ft_in12k$|_clip_224\.tinyclip_\w+$", _CROP_90),
            (r"^vit_base_patch16_clip_224\.(?:laion2b|openai)_ft_in12k_in1k$", _CROP_95),
            (r"^vit_base_patch16_clip_(?:quickgelu_)?224\.(?:laion2b|laion2b_ft_in1k|"
             r"laion400m_e32)$", _CROP_100),
            (r"^vit_(?:large|huge|giant|gigantic)_patch14_clip_(?:quickgelu_)?224\.", _CROP_100),
            (r"_clip_(?:quickgelu_)?(?:224|256)\.(?:datacompxl|dfn2b|metaclip_2pt5b|"
             r"metaclip_400m)$", _CROP_100),
            (r"_clip_(?:quickgelu_)?(?:336|378)\.(?:openai|dfn5b)$|_plus_clip_240\.laion400m_e32$",
             _CROP_100),
            (r"^vit_base_patch32_clip_(?:384|448)\.laion2b_ft_in12k_in1k$", _CROP_100))),
    Family(
        "RoPE-ViT", timm_pattern=r"_rope_",
        timm_rope=(
            (r"_rope_reg\d+_gap_", RopeSpec("axial", ref_grid=(16, 16))),
            (r"_rope_mixed_", RopeSpec("mixed", temperature=10.0, xy=True)),
            (r"_rope_", RopeSpec("axial", temperature=100.0, xy=True))),
        timm_normalization=((r"^vit_betwixt_patch16_rope_reg4_gap_", "clip"),
                            (r"_patch16_rope_(?:mixed_)?(?:ape_)?224", "imagenet"),
                            (r"_rope_reg1_gap_", "inception")),
        timm_eval_crops=((r"_rope_(?:mixed_)?(?:ape_)?224\.naver_in1k$", _CROP_90),
                         (r"_rope_reg\d_gap_256\.sbb_in1k$", _CROP_95))),
    Family(
        "MAE", release_names=("mae",), timm_pattern=r"\.mae$", model_types=("vit_mae",),
        normalization="imagenet", eval_crop=_CROP_90,
        transformers_defaults={"layer_norm_eps": 1e-12, "hidden_act": "gelu"}),
    VIT,
)
"""Every family, in the order their `timm_pattern`s are tried (EVA-02's CLIP towers are EVA-02's;
MAE is told by its tag, after every name's own family); the paper's ViT last."""


def by_timm_name(timm_name):
    """The family a timm name (`"vit_base_patch16_clip_224.openai"`, with or without its
    pretrained tag) belongs to: the first record whose `timm_pattern` it matches, else `VIT`."""
    return next(family for family in FAMILIES
                if family.timm_pattern is None or re.search(family.timm_pattern, timm_name))


def by_model_type(model_type):
    """The family of a transformers `model_type` (`"dinov2"`), or None."""
    return next((family for family in FAMILIES if model_type in family.model_types), None)


def by_release(name):
    """The family of a release name (`"dinov2_reg4"`), or None."""
    return next((family for family in FAMILIES if name in family.release_names), None)


def model_types():
    """Every transformers `model_type` a record claims."""
    return tuple(model_type for family in FAMILIES for model_type in family.model_types)


def first_match(rules, name):
    """`(True, value)` of the first `(pattern, value)` of `rules` that `name` matches, else
    `(False, None)`."""
    return next(((True, value) for pattern, value in rules if re.search(pattern, name)),
                (False, None))
