"""The release table: every published checkpoint of the paper's models, and the common releases of
the ViT family (DeiT, DeiT III, DINOv2 with and without registers, SigLIP, CLIP, MAE), as one
record of data each.

A release is a set of weights for one variant (`imagenet21k`, `augreg_in21k_ft_in1k`, `dinov2`,
...), at one or more resolutions. Each record names its file by its path below a base URL: the
paper's files below the official bucket (`OFFICIAL_BASE_URL`), the family's below the Hugging Face
hub (`HUB_BASE_URL`, as `<repo id>/resolve/main/<file>`, with the repository's `config.json`
beside the weights), so that a mirror can replace the base and keep the paths. File names are the
facts of google-research/vision_transformer's README and of timm's `default_cfgs`
(`vision_transformer.py`, `vision_transformer_hybrid.py`, `deit.py`; tests compare them); Hugging
Face hub ids are listed where the hub holds the same weights with the same head.
"""

import dataclasses

from vit_keras import errors
from vit_keras.model import configs, pixel_normalization
from vit_keras.weights import families

OFFICIAL_BASE_URL = "https://storage.googleapis.com/"
"""The bucket the paper's `Release.path`s are relative to (`VIT_KERAS_WEIGHTS_MIRROR` replaces it)."""
HUB_BASE_URL = "https://huggingface.co/"
"""The Hugging Face hub, which the family's `Release.path`s are relative to (the mirror variable
replaces it too: a mirror holds both trees)."""

CLASS_NAME_FILES = {"imagenet2012": None, "imagenet21k": "bit_models/imagenet21k_wordnet_lemmas.txt"}
"""The class-name lists a release can name: ImageNet-1k's ship in the package (`None`), the 21k
list is fetched from this path below the bucket (through the same mirror and cache)."""


@dataclasses.dataclass(frozen=True)
class Release:
    """One checkpoint file of a release.

    Attributes:
      variant: a key of `vit_keras.VARIANTS`.
      name: the release (`"imagenet21k"`, `"augreg_in21k_ft_in1k"`, ...); one release can have
        files at several resolutions.
      path: the file below `OFFICIAL_BASE_URL`.
      image_size: the resolution the weights were trained or fine-tuned at.
      num_classes: the head's classes (21843 for ImageNet-21k, 1000 for ImageNet-1k), the width
        of a projection head without class names (PE core's 1024), or None for a backbone
        published without a head (DINOv2, SigLIP, CLIP, MAE, DINOv3, EVA-02, AIMv2).
      representation_size: width of the `pre_logits` layer (original ImageNet-21k files), or None.
      classifier: `"token"` for the paper's ViTs, `"map"` for SigLIP's attention pooling.
      class_names: the key in `CLASS_NAME_FILES` of the head's class names (None without a head).
      hf_hub_id: the same weights on the Hugging Face hub (`timm/...` state dicts, `google/...`
        transformers folders), or None; for the family's releases, the repository the files
        come from.
      base_url: what `path` is below: `OFFICIAL_BASE_URL` or `HUB_BASE_URL`.
      config_path: the `config.json` beside the weights (below `base_url`), fetched first: it
        says what the weights alone do not (epsilon, GELU variant, timm architecture).
      other_hub_ids: further hub repositories that hold the same weights (for the family:
        timm's, or the transformers folder a timm file was converted from), found by
        `release_for_hub_id` like `hf_hub_id`.
    """

    variant: str
    name: str
    path: str
    image_size: int
    num_classes: int | None
    representation_size: int | None = None
    classifier: str = "token"
    class_names: str | None = "imagenet2012"
    hf_hub_id: str | None = None
    base_url: str = OFFICIAL_BASE_URL
    config_path: str | None = None
    other_hub_ids: tuple = ()

    @property
    def normalization(self):
        """How the release's pixels were normalised in training (a
        `vit_keras.model.pixel_normalization.Normalization`): the model built from it normalises
        its input the same way. Its family's (`vit_keras.weights.families`); a release of no
        family's has the paper's."""
        family = families.by_release(self.name) or families.VIT
        return pixel_normalization.NORMALIZATIONS[family.normalization]

    @property
    def url(self):
        return self.base_url + self.path

    @property
    def files(self):
        """The paths below `base_url` to fetch, in order: the config (if any), then the weights."""
        return (self.config_path, self.path) if self.config_path else (self.path,)

    @property
    def spec(self):
        """How `build_model` names this file: `"ViT-B/16", weights="<name>", image_size=<size>`."""
        return f"{self.variant} {self.name} @ {self.image_size}"


# --- The original releases (the paper): vit_models/imagenet21k[+imagenet2012]/ -------------------
_ORIGINAL_21K = {  # variant: (file stem, hidden size = pre_logits width)
    "ViT-B/16": ("ViT-B_16", 768), "ViT-B/32": ("ViT-B_32", 768), "ViT-L/16": ("ViT-L_16", 1024),
    "ViT-L/32": ("ViT-L_32", 1024), "ViT-H/14": ("ViT-H_14", 1280),
    "R50+ViT-B/16": ("R50+ViT-B_16", 768),
}
# Fine-tuned on ImageNet-1k at 384 (plain file names) and, for B/16 and L/16, also at 224
# ("-224" files). H/14 was released pre-trained only.
_ORIGINAL_FT = {  # variant: {image size: (file stem, Hugging Face hub id)}
    "ViT-B/16": {224: ("ViT-B_16-224", "google/vit-base-patch16-224"),
                 384: ("ViT-B_16", "google/vit-base-patch16-384")},
    "ViT-B/32": {384: ("ViT-B_32", "google/vit-base-patch32-384")},
    "ViT-L/16": {224: ("ViT-L_16-224", "google/vit-large-patch16-224"),
                 384: ("ViT-L_16", "google/vit-large-patch16-384")},
    "ViT-L/32": {384: ("ViT-L_32", "google/vit-large-patch32-384")},
    "R50+ViT-B/16": {384: ("R50+ViT-B_16", "timm/vit_base_r50_s16_384.orig_in21k_ft_in1k")},
}

# --- The AugReg releases ("How to train your ViT"): vit_models/augreg/ ----------------------------
# The ImageNet-21k pre-training run of each variant is named by its hyper-parameters; fine-tuned
# files append the fine-tuning run. timm's model name gives the hub id `timm/<name>.<release>`.
_AUGREG_21K = {  # variant: (pre-training run, timm model name without the resolution)
    "ViT-Ti/16": ("Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0", "vit_tiny_patch16"),
    "ViT-S/32": ("S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0", "vit_small_patch32"),
    "ViT-S/16": ("S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0", "vit_small_patch16"),
    "ViT-B/32": ("B_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.03-do_0.0-sd_0.0", "vit_base_patch32"),
    "ViT-B/16": ("B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0", "vit_base_patch16"),
    "ViT-B/8": ("B_8-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0", "vit_base_patch8"),
    "ViT-L/16": ("L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1", "vit_large_patch16"),
    "R+ViT-Ti/16": ("R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0",
                    "vit_tiny_r_s16_p8"),
    "R26+ViT-S/32": ("R26_S_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.03-do_0.0-sd_0.0",
                     "vit_small_r26_s32"),
    "R50+ViT-L/32": ("R50_L_32-i21k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0",
                     "vit_large_r50_s32"),
}
_FT_1K = "--imagenet2012-steps_20k-lr_{lr}-res_{size}"
# Which pre-training run each fine-tuned file starts from, where it is not the one above (the
# authors fine-tuned the best run per resolution), and the fine-tuning learning rate.
_AUGREG_FT = {  # variant: {image size: (pre-training run or None for the one above, lr)}
    "ViT-Ti/16": {224: (None, "0.03"), 384: (None, "0.03")},
    "ViT-S/32": {224: (None, "0.03"), 384: (None, "0.03")},
    "ViT-S/16": {224: (None, "0.03"), 384: (None, "0.03")},
    "ViT-B/32": {224: (None, "0.03"),
                 384: ("B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0", "0.03")},
    "ViT-B/16": {224: (None, "0.01"), 384: (None, "0.01")},
    "ViT-B/8": {224: (None, "0.01")},
    "ViT-L/16": {224: (None, "0.01"), 384: (None, "0.01")},
    "R+ViT-Ti/16": {224: (None, "0.03"), 384: (None, "0.03")},
    "R26+ViT-S/32": {224: ("R26_S_32-i21k-300ep-lr_0.001-aug_light0-wd_0.03-do_0.1-sd_0.1", "0.03"),
                     384: (None, "0.03")},
    "R50+ViT-L/32": {224: ("R50_L_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1", "0.01"),
                     384: (None, "0.01")},
}
_AUGREG_1K = {  # variant: (ImageNet-1k training run, timm model name without the resolution)
    "ViT-S/16": ("S_16-i1k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.0-sd_0.0", "vit_small_patch16"),
    "ViT-B/32": ("B_32-i1k-300ep-lr_0.001-aug_medium2-wd_0.1-do_0.1-sd_0.1", "vit_base_patch32"),
    "ViT-B/16": ("B_16-i1k-300ep-lr_0.001-aug_strong2-wd_0.1-do_0.1-sd_0.1", "vit_base_patch16"),
}

# --- The ViT family on the Hugging Face hub: HUB_BASE_URL + "<repo id>/resolve/main/<file>" -------
# The files come from the transformers folder where its config.json says everything vit_keras needs
# (CLIP's quick GELU, which timm's `*_clip_224.openai` names do not say); else from timm's repository
# (a state dict and a config.json naming the timm architecture). CLIP and SigLIP folders hold the
# whole image-text model: vit_keras reads the image tower. timm's CLIP files carry the projection
# into the joint space as a head (512 or 768 classes); the table's CLIP records have none.
_FAMILY = (  # (variant, release, files' repository, other repository, image size, classes, pooling)
    ("ViT-S/16", "deit_in1k", "timm/deit_small_patch16_224.fb_in1k",
     "facebook/deit-small-patch16-224", 224, 1000, "token"),
    ("ViT-B/16", "deit_distilled_in1k", "timm/deit_base_distilled_patch16_224.fb_in1k",
     "facebook/deit-base-distilled-patch16-224", 224, 1000, "token"),
    ("ViT-B/16", "deit3_in22k_ft_in1k", "timm/deit3_base_patch16_224.fb_in22k_ft_in1k", None,
     224, 1000, "token"),
    ("ViT-S/14", "dinov2", "facebook/dinov2-small", "timm/vit_small_patch14_dinov2.lvd142m", 518,
     None, "token"),
    ("ViT-B/14", "dinov2", "facebook/dinov2-base", "timm/vit_base_patch14_dinov2.lvd142m", 518,
     None, "token"),
    ("ViT-L/14", "dinov2", "facebook/dinov2-large", "timm/vit_large_patch14_dinov2.lvd142m", 518,
     None, "token"),
    ("ViT-S/14", "dinov2_reg4", "facebook/dinov2-with-registers-small",
     "timm/vit_small_patch14_reg4_dinov2.lvd142m", 518, None, "token"),
    ("ViT-B/14", "dinov2_reg4", "facebook/dinov2-with-registers-base",
     "timm/vit_base_patch14_reg4_dinov2.lvd142m", 518, None, "token"),
    ("ViT-L/14", "dinov2_reg4", "facebook/dinov2-with-registers-large",
     "timm/vit_large_patch14_reg4_dinov2.lvd142m", 518, None, "token"),
    ("ViT-B/16", "siglip_webli", "google/siglip-base-patch16-224",
     "timm/vit_base_patch16_siglip_224.webli", 224, None, "map"),
    ("ViT-B/16", "clip_openai", "openai/clip-vit-base-patch16",
     "timm/vit_base_patch16_clip_224.openai", 224, None, "token"),
    ("ViT-B/32", "clip_openai", "openai/clip-vit-base-patch32",
     "timm/vit_base_patch32_clip_224.openai", 224, None, "token"),
    ("ViT-L/14", "clip_openai", "openai/clip-vit-large-patch14",
     "timm/vit_large_patch14_clip_224.openai", 224, None, "token"),
    ("ViT-B/16", "mae", "timm/vit_base_patch16_224.mae", "facebook/vit-mae-base", 224, None,
     "token"),
    # The rotary and gated families, from timm's repositories (a state dict and the config.json
    # that names the architecture, which says the rotary settings). DINOv3 is pooled as timm
    # pools it, by the mean of the patch tokens; PE's head is its projection (1024 features).
    ("ViT-S/16", "dinov3", "timm/vit_small_patch16_dinov3.lvd1689m",
     "facebook/dinov3-vits16-pretrain-lvd1689m", 256, None, "gap"),
    ("ViT-B/16", "dinov3", "timm/vit_base_patch16_dinov3.lvd1689m",
     "facebook/dinov3-vitb16-pretrain-lvd1689m", 256, None, "gap"),
    ("ViT-L/16", "dinov3", "timm/vit_large_patch16_dinov3.lvd1689m",
     "facebook/dinov3-vitl16-pretrain-lvd1689m", 256, None, "gap"),
    ("ViT-B/16", "pe_core", "timm/vit_pe_core_base_patch16_224.fb", "facebook/PE-Core-B16-224",
     224, 1024, "map"),
    ("EVA02-B/14", "eva02_mim_in22k", "timm/eva02_base_patch14_224.mim_in22k", None, 224, None,
     "gap"),
    ("EVA02-L/14", "eva02_mim_in22k", "timm/eva02_large_patch14_224.mim_in22k", None, 224, None,
     "gap"),
    ("AIMv2-L/14", "aimv2", "timm/aimv2_large_patch14_224.apple_pt",
     "apple/aimv2-large-patch14-224", 224, None, "gap"),
    ("DINOv2-g/14", "dinov2", "timm/vit_giant_patch14_dinov2.lvd142m", None, 518, None, "token"),
)
# big_vision's own files, in its bucket: SigLIP 2's NaFlex towers (the image tower of each
# image-text `.npz`, read as a NaFlex model), whose weights transformers' and timm's repositories
# hold too. Their grid is 16 x 16 patches (the sequence length 256 they were evaluated at).
_BIG_VISION = (  # (variant, release, path below the bucket, image size, hub ids of the weights)
    ("ViT-B/16", "siglip2_naflex", "big_vision/siglip2/siglip2_b16_naflex.npz", 256,
     ("google/siglip2-base-patch16-naflex", "timm/naflexvit_base_patch16_siglip.v2_webli")),
    ("ViT-So400m/16", "siglip2_naflex", "big_vision/siglip2/siglip2_so400m16_naflex.npz", 256,
     ("google/siglip2-so400m-patch16-naflex", "timm/naflexvit_so400m_patch16_siglip.v2_webli")),
)
_HUB_WEIGHTS = "model.safetensors"
def _hub_file(repo, name):
    return f"{repo}/resolve/main/{name}"


def _table():
    rows = []
    for variant, (stem, width) in _ORIGINAL_21K.items():
        rows.append(Release(variant, "imagenet21k", f"vit_models/imagenet21k/{stem}.npz", 224,
                            21843, representation_size=width, class_names="imagenet21k"))
    for variant, sizes in _ORIGINAL_FT.items():
        for size, (stem, hub_id) in sizes.items():
            rows.append(Release(variant, "imagenet21k+imagenet2012",
                                f"vit_models/imagenet21k+imagenet2012/{stem}.npz", size, 1000,
                                hf_hub_id=hub_id))
    for variant, (run, timm_name) in _AUGREG_21K.items():
        rows.append(Release(variant, "augreg_in21k", f"vit_models/augreg/{run}.npz", 224, 21843,
                            class_names="imagenet21k",
                            hf_hub_id=f"timm/{timm_name}_224.augreg_in21k"))
        for size, (start, lr) in _AUGREG_FT[variant].items():
            path = f"vit_models/augreg/{start or run}{_FT_1K.format(lr=lr, size=size)}.npz"
            rows.append(Release(variant, "augreg_in21k_ft_in1k", path, size, 1000,
                                hf_hub_id=f"timm/{timm_name}_{size}.augreg_in21k_ft_in1k"))
    for variant, (run, timm_name) in _AUGREG_1K.items():
        for size in (224, 384):
            path = f"vit_models/augreg/{run}{_FT_1K.format(lr='0.01', size=size)}.npz"
            rows.append(Release(variant, "augreg_in1k", path, size, 1000,
                                hf_hub_id=f"timm/{timm_name}_{size}.augreg_in1k"))
    for variant, name, repo, other, size, classes, classifier in _FAMILY:
        rows.append(Release(variant, name, _hub_file(repo, _HUB_WEIGHTS), size, classes,
                            classifier=classifier,
                            class_names="imagenet2012" if classes == 1000 else None,
                            hf_hub_id=repo,
                            base_url=HUB_BASE_URL, config_path=_hub_file(repo, "config.json"),
                            other_hub_ids=(other,) if other else ()))
    for variant, name, path, size, hub_ids in _BIG_VISION:
        rows.append(Release(variant, name, path, size, None, classifier="map", class_names=None,
                            hf_hub_id=hub_ids[0], other_hub_ids=hub_ids[1:]))
    order = {name: i for i, name in enumerate(configs.VARIANTS)}
    return tuple(sorted(rows, key=lambda r: (order[r.variant], RELEASE_NAMES.index(r.name),
                                             r.image_size)))


PAPER_RELEASE_NAMES = families.VIT.release_names
"""The paper's releases (ImageNet-21k, and fine-tuned on ImageNet-1k) and AugReg's ("How to train
your ViT": ImageNet-21k, fine-tuned on ImageNet-1k, and ImageNet-1k only), in the bucket."""
FAMILY_RELEASE_NAMES = tuple(dict.fromkeys(row[1] for row in _FAMILY))
"""The family's releases on the Hugging Face hub, in the table's order: DeiT (ImageNet-1k;
distilled), DeiT III (ImageNet-21k, fine-tuned on 1k), DINOv2 (LVD-142M; with four registers;
giant), SigLIP (WebLI), CLIP (OpenAI's), MAE (ImageNet-1k self-supervised), DINOv3 (LVD-1689M),
PE core, EVA-02 (masked image modelling on ImageNet-21k), AIMv2 (Apple's pre-training)."""
ROTARY_RELEASE_NAMES = ("dinov3", "pe_core", "eva02_mim_in22k", "aimv2")
"""The family's releases with rotary embeddings or a gated MLP throughout (DINOv2 giant's SwiGLU
is a `dinov2` release)."""
BIG_VISION_RELEASE_NAMES = tuple(dict.fromkeys(row[1] for row in _BIG_VISION))
"""The family's releases in big_vision's bucket: SigLIP 2's NaFlex towers (B/16, So400m/16)."""
RELEASE_NAMES = PAPER_RELEASE_NAMES + FAMILY_RELEASE_NAMES + BIG_VISION_RELEASE_NAMES
"""Every release name a `weights=` value can take."""

FAMILY_NUMERICS = {name: families.by_release(name).numerics
                   for name in FAMILY_RELEASE_NAMES + BIG_VISION_RELEASE_NAMES}
"""What each family release computes with that its weights do not store, as `ViTConfig` fields:
the LayerNorm epsilon, the GELU (`"exact"`, `"tanh"` or `"quick"`) and the kind of rotary
embeddings (`rope`): its family record's `numerics` (`vit_keras.weights.families`), which its
repository's `config.json` states (a transformers `layer_norm_eps` and `hidden_act`, or a timm
architecture name, see `vit_keras.weights.checkpoints.timm`). A release's files are checked
against it before they are cached: a `config.json` that says otherwise describes other weights."""

RELEASES = _table()
"""Every published file, as `Release` records, by variant (in `VARIANTS` order) and release."""


def list_weights(variant=None):
    """The published weights: all `Release` records, or those of one variant.

    Args:
      variant: a variant name (`"ViT-B/16"` or the official spelling `"ViT-B_16"`), or None.

    Returns:
      A list of `Release` (variant, release name, image size, classes, file path, hub id).
    """
    if variant is None:
        return list(RELEASES)
    name = configs.get_config(variant).name
    return [release for release in RELEASES if release.variant == name]


def _closeness(size, wanted):
    # Resampling from the nearest resolution keeps the most of what was learned; between two at
    # the same distance the larger one has the finer position grid.
    return abs(size - wanted), -size


def find_release(variant, name, image_size=None):
    """The file of release `name` for `variant` at `image_size`.

    Args:
      variant: a variant name (either spelling) or a `ViTConfig` of a published variant.
      name: a release name (see `RELEASE_NAMES`).
      image_size: None for the release's smallest resolution; otherwise the file at that
        resolution, or at the nearest one (its position embeddings are resampled on loading).
        `(height, width)` compares by the geometric mean of the two.

    Raises:
      vit_keras.errors.ReleaseNotFoundError: naming the releases `variant` has, when it has no
        release `name` (the one message for it).
    """
    config = configs.get_config(variant)
    own = list_weights(config.name)
    files = [release for release in own if release.name == name]
    if not files:
        known = sorted({release.name for release in own})
        raise errors.ReleaseNotFoundError(
            f"{config.name} has no release {name!r}; "
            + (f"its releases are: {', '.join(known)}." if known else
               f"no weights are published for it. Variants with weights: "
               f"{', '.join(dict.fromkeys(r.variant for r in RELEASES))}."))
    if image_size is None:
        return min(files, key=lambda release: release.image_size)
    if isinstance(image_size, (tuple, list)):
        image_size = (image_size[0] * image_size[1]) ** 0.5
    return min(files, key=lambda release: _closeness(release.image_size, image_size))


def release_for_hub_id(hub_id):
    """The `Release` whose weights the hub repository `hub_id` holds, or None."""
    return next((release for release in RELEASES
                 if hub_id == release.hf_hub_id or hub_id in release.other_hub_ids), None)
