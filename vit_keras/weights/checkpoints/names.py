"""The one place that knows checkpoint key names: every format ↔ the canonical vit_jax layout.

The canonical layout is the official vit_jax `.npz` (pre-Linen names, no prefix), as NumPy arrays:

    embedding/kernel                                  (patch, patch, channels, hidden)  HWIO
    embedding/bias                                    (hidden,)
    cls                                               (1, 1, hidden)      token models only
    Transformer/posembed_input/pos_embedding          (1, tokens, hidden)
    Transformer/encoderblock_{i}/LayerNorm_0/scale|bias                     (hidden,)
    Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/{query,key,value}/kernel
                                                      (hidden, heads, head_dim), bias (heads, head_dim)
    Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/out/kernel  (heads, head_dim, hidden)
    Transformer/encoderblock_{i}/LayerNorm_2/scale|bias
    Transformer/encoderblock_{i}/MlpBlock_3/Dense_0/kernel (hidden, mlp), Dense_1/kernel (mlp, hidden)
    Transformer/encoder_norm/scale|bias
    pre_logits/kernel|bias                            representation layer (Dense + tanh), optional
    head/kernel|bias                                  (features, classes)
    conv_root/kernel, gn_root/scale, block{s}/unit{u}/{conv,gn}{1,2,3,_proj}/...   hybrids only

The family's switches (`ViTConfig`) add, where they are on:

    Transformer/encoderblock_{i}/LayerScale_1/scale   (hidden,)  LayerScale of the attention branch
    Transformer/encoderblock_{i}/LayerScale_3/scale   (hidden,)  LayerScale of the MLP branch
    dist                                              (1, 1, hidden)      distillation token
    reg                                               (1, registers, hidden)  register tokens
    head_dist/kernel|bias                             (features, classes) the distillation head
    Transformer/pre_norm/scale|bias                   LayerNorm before the encoder (CLIP)
    fc_norm/scale|bias                                LayerNorm after pooling (no encoder_norm then)
    MAPHead_0/probe                                   (1, 1, hidden)  attention pooling (SigLIP)
    MAPHead_0/MultiHeadDotProductAttention_0/{query,key,value,out}/kernel|bias  as in the blocks
    MAPHead_0/LayerNorm_0/scale|bias
    MAPHead_0/MlpBlock_0/Dense_0|Dense_1/kernel|bias

and the rotary families (EVA-02, DINOv3, PE, AIMv2, RoPE-ViT, DINOv2 giant):

    Transformer/encoderblock_{i}/MlpBlock_3/gate/kernel|bias   (hidden, mlp)  SwiGLU's gate branch
    Transformer/encoderblock_{i}/MlpBlock_3/norm/scale|bias    (mlp,)  a norm inside the MLP
    Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/rope/frequencies
                                                      (2, heads, head_dim / 2)  RoPE-Mixed's, learned
    patch_norm/scale                                  (hidden,)  a norm on the patch embeddings
    (a projection, norm or MLP without a bias simply has no `bias` key)

Keras weight paths equal these keys up to `Transformer/` and `gamma|beta` (see `keras_to_canonical`).
Keys a converter does not recognise are passed through under their own name, so that a strict load
reports them as unexpected.
"""

import functools
import re

import numpy as np

from vit_keras import errors

POSEMB = "Transformer/posembed_input/pos_embedding"
CLS = "cls"
DIST = "dist"
REG = "reg"
HEAD_DIST = "head_dist/"
PRE_NORM = "Transformer/pre_norm/"
FC_NORM = "fc_norm/"
MAP_HEAD = "MAPHead_0/"
LAYER_SCALE_ATTENTION = "LayerScale_1/scale"
LAYER_SCALE_MLP = "LayerScale_3/scale"
EMBEDDING_KERNEL = "embedding/kernel"
ENCODER_NORM = "Transformer/encoder_norm/"
BLOCK = "Transformer/encoderblock_{}/"
ATTENTION = "MultiHeadDotProductAttention_1/"
QUERY_KERNEL = BLOCK + ATTENTION + "query/kernel"
MLP_KERNEL = BLOCK + "MlpBlock_3/Dense_0/kernel"
PRE_LOGITS = "pre_logits/"
# Hybrids (.npz): the ResNet's keys (`conv_root`, `gn_root`, `block{s}/unit{u}/conv1`, ...) are
# canonical as they are; vit_keras keeps them under `resnet/`.
RESNET_ROOT = "conv_root/kernel"
HEAD = "head/"

_RESNET = "resnet/"
_TRANSFORMER_PARTS = re.compile(r"^(encoderblock_\d+|encoder_norm|posembed_input|pre_norm)/")
MLP = BLOCK + "MlpBlock_3/"
ROPE_FREQUENCIES = BLOCK + ATTENTION + "rope/frequencies"
PATCH_NORM = "patch_norm/"
_TOKENS = {"cls/cls": CLS, "dist/dist": DIST, "reg/reg": REG}


# --- Keras model weights --------------------------------------------------------------------------

def keras_to_canonical(path):
    """A vit_keras weight path → its canonical key, e.g. `encoder_norm/gamma` →
    `Transformer/encoder_norm/scale`, `cls/cls` → `cls`, and for hybrids
    `resnet/block1/unit1/gn1/gamma` → `block1/unit1/gn1/scale` (the ResNet sits at the top level)."""
    if path in _TOKENS:
        return _TOKENS[path]
    if path.startswith(_RESNET):
        path = path[len(_RESNET):]
    key = re.sub(r"/gamma$", "/scale", re.sub(r"/beta$", "/bias", path))
    if _TRANSFORMER_PARTS.match(key):
        key = "Transformer/" + key
    return key


# --- vit_jax and big_vision .npz ------------------------------------------------------------------

NPZ_PREFIXES = ("opt/target/", "params/img/", "params/")
# Flax Linen numbers submodules per type; the pre-Linen names (the published files) count globally.
_LINEN_TO_PRE_LINEN = {"MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
                       "LayerNorm_1": "LayerNorm_2", "MlpBlock_0": "MlpBlock_3"}
_STACKED_BLOCK = "Transformer/encoderblock/"


def from_npz(arrays):
    """vit_jax (pre-Linen or Linen names, optional `opt/target/`) or big_vision (`params/`, top-level
    `pos_embedding`, blocks possibly stacked along a leading axis) → `(canonical dict, format)`."""
    prefix = next((p for p in NPZ_PREFIXES if p + EMBEDDING_KERNEL in arrays), "")
    if prefix:  # keys outside it (e.g. optimizer state beside `opt/target/`) are not parameters
        arrays = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    big_vision = prefix.startswith("params/") or "pos_embedding" in arrays or any(
        k.startswith(_STACKED_BLOCK) for k in arrays)
    out = {}
    for key, value in arrays.items():
        if key == "pos_embedding":
            out[POSEMB] = value
        elif key.startswith(_STACKED_BLOCK):  # big_vision's scanned blocks: (layers, ...)
            for index, layer_value in enumerate(value):
                out[BLOCK.format(index) + key[len(_STACKED_BLOCK):]] = layer_value
        else:
            out[key] = value
    blocks = {}
    for key in out:
        match = re.match(r"^(Transformer/encoderblock_\d+/)", key)
        if match:
            blocks.setdefault(match.group(1), set()).add(key[match.end():].split("/")[0])
    for block, modules in blocks.items():
        if not {"MultiHeadDotProductAttention_0", "MlpBlock_0"} & modules:
            continue  # pre-Linen names already
        for key in [k for k in out if k.startswith(block)]:
            module, rest = key[len(block):].split("/", 1)
            out[block + _LINEN_TO_PRE_LINEN.get(module, module) + "/" + rest] = out.pop(key)
    return out, "big_vision" if big_vision else "vit_jax"


# --- PyTorch state dicts: timm and Hugging Face ---------------------------------------------------

def _linear(weight):
    """torch `Linear.weight` (out, in) → Dense kernel (in, out)."""
    return np.ascontiguousarray(weight.T)


def _heads_in(weight, num_heads):
    """(out, in) projection → (in, heads, head_dim)."""
    kernel = _linear(weight)
    return kernel.reshape(kernel.shape[0], num_heads, -1)


def _heads_out(weight, num_heads):
    """(out, in) output projection → (heads, head_dim, out)."""
    kernel = _linear(weight)
    return kernel.reshape(num_heads, -1, kernel.shape[1])


def _stacked_projections(attention, names, kind, value, num_heads):
    """torch `Linear` parameters of the projections `names` stacked along the output axis (one
    projection, timm's fused `qkv`, torch's `in_proj`, the MAP head's `kv`) → the canonical
    head-split kernels `(hidden, heads, head_dim)` or biases `(heads, head_dim)` under
    `attention`; `kind` is `"weight"` or `"bias"`."""
    parts = np.split(value, len(names), axis=0)
    if kind == "weight":
        return {f"{attention}{n}/kernel": _heads_in(p, num_heads) for n, p in zip(names, parts)}
    return {f"{attention}{n}/bias": p.reshape(num_heads, -1) for n, p in zip(names, parts)}


def _out_projection(attention, kind, value, num_heads):
    """torch `Linear` parameters of an attention's output projection → `attention/out/kernel`
    `(heads, head_dim, hidden)` or `.../bias`."""
    if kind == "weight":
        return {attention + "out/kernel": _heads_out(value, num_heads)}
    return {attention + "out/bias": value}


_QKV = ("query", "key", "value")


def _check_heads(hidden, num_heads):
    if not num_heads or hidden % num_heads:
        raise errors.CheckpointError(
            f"Cannot split hidden size {hidden} into {num_heads} attention heads; pass "
            f"the checkpoint's number of heads (num_heads=...).")


def _conv(weight):
    """torch Conv2d weight (out, in, h, w) → HWIO."""
    return np.ascontiguousarray(weight.transpose(2, 3, 1, 0))


def _patch_kernel(weight, patch_size):
    """A patch embedding's weight → HWIO: a Conv2d's `(out, in, h, w)`, or a `Linear` over
    flattened (row, column, channel) patches, `(out, patch_size * patch_size * in)` (SigLIP 2)."""
    if weight.ndim == 4:
        return _conv(weight)
    hidden, values = weight.shape
    if not patch_size or values % (patch_size * patch_size):
        raise errors.CheckpointError(
            f"The patch embedding is a linear map of {values} values per patch, which is not "
            f"patch_size x patch_size x channels for patch_size {patch_size}; the checkpoint's "
            f"config.json must give its patch_size.")
    return np.ascontiguousarray(weight.T.reshape(patch_size, patch_size, -1, hidden))


def _convert(state_dict, rules):
    """Applies `rules` [(regex, function(match, value) → {canonical: array})] to each key."""
    out = {}
    for key, value in state_dict.items():
        for pattern, convert in rules:
            match = re.fullmatch(pattern, key)
            if match:
                out.update(convert(match, value))
                break
        else:
            out[key] = value  # unknown: reported as unexpected by a strict load
    return out


def _to(template, transform=lambda v: v):
    """One tensor → one canonical key (the regex groups fill the template)."""
    return lambda match, value: {template.format(*match.groups()): transform(value)}


def _ln(template):
    """A torch LayerNorm or GroupNorm `weight|bias` → canonical `scale|bias`."""
    def convert(match, value):
        *indices, which = match.groups()
        return {template.format(*indices) + ("scale" if which == "weight" else "bias"): value}
    return convert


def _dense(template):
    """A torch Linear `weight|bias` → canonical `kernel|bias` (the weight transposed)."""
    def convert(match, value):
        *indices, which = match.groups()
        if which == "weight":
            return {template.format(*indices) + "kernel": _linear(value)}
        return {template.format(*indices) + "bias": value}
    return convert


def _unit(part):
    """timm ResNetV2 `stages.{s}.blocks.{u}.<part>` (0-based) → vit_jax `block{s+1}/unit{u+1}/`."""
    def convert(match, value):
        stage, unit, *rest = match.groups()
        prefix = f"block{int(stage) + 1}/unit{int(unit) + 1}/"
        if part == "conv":  # conv{1,2,3} or the projection shortcut's conv
            return {prefix + f"conv{rest[0] or '_proj'}/kernel": _conv(value)}
        return {prefix + f"gn{rest[0] or '_proj'}/" + ("scale" if rest[1] == "weight" else "bias"):
                value}
    return convert


# timm hybrids (`vision_transformer_hybrid.py`): the ResNetV2 backbone sits in `patch_embed.backbone`
# (its root in `.stem`; a root-only model's backbone is the root itself), torch convs are OIHW.
_BACKBONE = r"patch_embed\.backbone\."
_STAGE_UNIT = _BACKBONE + r"stages\.(\d+)\.blocks\.(\d+)\."
_TIMM_RESNET = [
    (_BACKBONE + r"(?:stem\.)?conv\.weight", _to(RESNET_ROOT, _conv)),
    (_BACKBONE + r"(?:stem\.)?norm\.(weight|bias)", _ln("gn_root/")),
    (_STAGE_UNIT + r"(?:conv([123])|downsample\.conv)\.weight", _unit("conv")),
    (_STAGE_UNIT + r"(?:norm([123])|downsample\.norm)\.(weight|bias)", _unit("norm")),
]


def from_timm(state_dict, num_heads, map_num_heads=None):
    """A timm `VisionTransformer` or `Eva` state dict (NumPy values) → canonical dict; hybrids
    (`vit_base_r50_s16_384`, `vit_tiny_r_s16_p8_224`, ...), the family's switches (DeiT's
    `dist_token`/`head_dist`, `reg_token`, LayerScale `ls1`/`ls2` or `gamma_1`/`gamma_2`,
    `norm_pre`, `fc_norm`, the `attn_pool` MAP head) and the rotary families' parts (separate
    `q_proj`/`k_proj`/`v_proj`, EVA's `q_bias`/`v_bias` beside a bias-free `qkv`, SwiGLU packed
    in `fc1` or as `fc1_g`/`fc1_x`, the MLP's `norm`, `patch_embed.norm`, RoPE-Mixed's
    `rope.freqs` (2, depth, heads, head_dim / 2) split per block) included. `map_num_heads`: the
    MAP head's heads where they differ from the blocks' (PE's 8)."""
    hidden = state_dict["patch_embed.proj.weight"].shape[0]
    _check_heads(hidden, num_heads)
    fc1, fc2 = state_dict.get("blocks.0.mlp.fc1.weight"), state_dict.get("blocks.0.mlp.fc2.weight")
    # timm's packed SwiGLU (GluMlp, gate first): fc1 is twice as wide as fc2 reads.
    packed = fc1 is not None and fc2 is not None and fc1.shape[0] == 2 * fc2.shape[-1]

    def fc1_rule(match, value):
        template = BLOCK.format(match.group(1)) + "MlpBlock_3/"
        if not packed:
            return _dense(template + "Dense_0/")(match, value)
        gate, kept = np.split(value, 2, axis=0)
        key = "kernel" if match.group(2) == "weight" else "bias"
        transform = _linear if key == "kernel" else (lambda v: v)
        return {f"{template}gate/{key}": transform(gate), f"{template}Dense_0/{key}": transform(kept)}

    def separate_projection(match, value):
        name = {"q": "query", "k": "key", "v": "value"}[match.group(2)]
        return _stacked_projections(BLOCK.format(match.group(1)) + ATTENTION, (name,),
                                    match.group(3), value, num_heads)

    def eva_bias(match, value):  # `q_bias`, `v_bias` beside a bias-free fused `qkv`
        name = {"q": "query", "v": "value"}[match.group(2)]
        return {f"{BLOCK.format(match.group(1))}{ATTENTION}{name}/bias": value.reshape(num_heads, -1)}

    def rope_frequencies(match, value):  # (2, depth, heads, head_dim / 2) → per block
        return {ROPE_FREQUENCIES.format(index): value[:, index] for index in range(value.shape[1])}

    def qkv(match, value):
        return _stacked_projections(BLOCK.format(match.group(1)) + ATTENTION, _QKV,
                                    match.group(2), value, num_heads)

    def proj(match, value):
        return _out_projection(BLOCK.format(match.group(1)) + ATTENTION, match.group(2), value,
                               num_heads)

    pool = MAP_HEAD + "MultiHeadDotProductAttention_0/"

    pool_heads = map_num_heads or num_heads

    def pool_projection(names_):
        """`attn_pool.q` (query) or `attn_pool.kv` (key and value, stacked) of the MAP head."""
        return lambda match, value: _stacked_projections(pool, names_, match.group(1), value,
                                                         pool_heads)

    def pool_out(match, value):
        return _out_projection(pool, match.group(1), value, pool_heads)

    return _convert(state_dict, _TIMM_RESNET + [
        (r"patch_embed\.proj\.weight", _to(EMBEDDING_KERNEL, _conv)),
        (r"patch_embed\.proj\.bias", _to("embedding/bias")),
        (r"cls_token", _to(CLS)),
        (r"dist_token", _to(DIST)),
        (r"reg_token", _to(REG)),
        (r"pos_embed", _to(POSEMB)),
        (r"norm_pre\.(weight|bias)", _ln(PRE_NORM)),
        (r"patch_embed\.norm\.(weight|bias)", _ln(PATCH_NORM)),
        (r"rope\.freqs", rope_frequencies),
        (r"blocks\.(\d+)\.(?:ls1\.gamma|gamma_1)", _to(BLOCK + LAYER_SCALE_ATTENTION)),
        (r"blocks\.(\d+)\.(?:ls2\.gamma|gamma_2)", _to(BLOCK + LAYER_SCALE_MLP)),
        (r"blocks\.(\d+)\.norm1\.(weight|bias)", _ln(BLOCK + "LayerNorm_0/")),
        (r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", qkv),
        (r"blocks\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)", separate_projection),
        (r"blocks\.(\d+)\.attn\.([qv])_bias", eva_bias),
        (r"blocks\.(\d+)\.attn\.proj\.(weight|bias)", proj),
        (r"blocks\.(\d+)\.norm2\.(weight|bias)", _ln(BLOCK + "LayerNorm_2/")),
        (r"blocks\.(\d+)\.mlp\.fc1\.(weight|bias)", fc1_rule),
        (r"blocks\.(\d+)\.mlp\.fc1_g\.(weight|bias)", _dense(BLOCK + "MlpBlock_3/gate/")),
        (r"blocks\.(\d+)\.mlp\.fc1_x\.(weight|bias)", _dense(BLOCK + "MlpBlock_3/Dense_0/")),
        (r"blocks\.(\d+)\.mlp\.norm\.(weight|bias)", _ln(BLOCK + "MlpBlock_3/norm/")),
        (r"blocks\.(\d+)\.mlp\.fc2\.(weight|bias)", _dense(BLOCK + "MlpBlock_3/Dense_1/")),
        (r"norm\.(weight|bias)", _ln(ENCODER_NORM)),
        (r"fc_norm\.(weight|bias)", _ln(FC_NORM)),
        (r"attn_pool\.latent", _to(MAP_HEAD + "probe")),
        (r"attn_pool\.q\.(weight|bias)", pool_projection(("query",))),
        (r"attn_pool\.kv\.(weight|bias)", pool_projection(("key", "value"))),
        (r"attn_pool\.proj\.(weight|bias)", pool_out),
        (r"attn_pool\.norm\.(weight|bias)", _ln(MAP_HEAD + "LayerNorm_0/")),
        (r"attn_pool\.mlp\.fc1\.(weight|bias)", _dense(MAP_HEAD + "MlpBlock_0/Dense_0/")),
        (r"attn_pool\.mlp\.fc2\.(weight|bias)", _dense(MAP_HEAD + "MlpBlock_0/Dense_1/")),
        (r"pre_logits\.fc\.(weight|bias)", _dense(PRE_LOGITS)),  # timm < 0.6
        (r"head\.(weight|bias)", _dense(HEAD)),
        (r"head_dist\.(weight|bias)", _dense(HEAD_DIST)),
    ])


# Keys of a full CLIPModel / SiglipModel folder outside its image tower: the vision tower is loaded
# as `CLIPVisionModel` / `SiglipVisionModel` would load it, so the text tower and the projections
# into the joint embedding space are left out (`logit_scale`, `logit_bias` belong to the pair).
_HF_OUTSIDE_VISION = re.compile(r"^(text_model\.|text_projection\.|visual_projection\.|"
                                r"logit_scale$|logit_bias$)")
# DINOv2's and DINOv3's `mask_token` replaces masked patches in self-supervised training only;
# inference and fine-tuning never read it.
_HF_TRAINING_ONLY = {"embeddings.mask_token"}
# The patch embedding: `patch_embeddings.projection` (ViT, DeiT, DINOv2, MAE), `patch_embedding`
# (CLIP, SigLIP), `patch_embeddings` (DINOv3), `patch_embed` (AIMv2).
_HF_PATCHES = r"embeddings\.patch_embed(?:dings?)?\.(?:projection\.)?"


def from_huggingface(state_dict, num_heads, patch_size=None):
    """A Hugging Face ViT-family state dict → canonical dict.

    The families: `ViTModel` / `ViTForImageClassification`, `ViTMAEModel` (ViT's names),
    `DeiTModel` / `DeiTForImageClassification[WithTeacher]` (`distillation_token`,
    `cls_classifier` / `distillation_classifier` → `head` / `head_dist`), `Dinov2Model` and
    `Dinov2WithRegistersModel` (`norm1|2`, `mlp.fc1|2`, `layer_scale{1,2}.lambda1` → LayerScale,
    `register_tokens` → `reg`), `CLIPVisionModel` (`class_embedding` (hidden,), bias-free
    `patch_embedding`, `position_embedding.weight` (tokens, hidden), `pre_layrnorm` → pre_norm,
    `post_layernorm` → encoder_norm), `SiglipVisionModel` (no class token; its `head` is the
    MAP head, a `torch.nn.MultiheadAttention` with fused `in_proj`) and `Siglip2VisionModel`
    (SigLIP's names, its patch embedding a `Linear` over NaFlex's flattened patches, `(hidden,
    patch_size * patch_size * channels)`, whose `patch_size` the caller gives). The names
    `save_pretrained` writes (`encoder.layer.{i}.attention.attention.query`) and the in-memory names of
    transformers >= 5 (`layers.{i}.attention.q_proj`) are accepted, with or without the model's
    prefix (`vit.`, `deit.`, `vision_model.`). `ViTModel`'s and `DeiTModel`'s pooler (Dense + tanh
    on the class token after the final LayerNorm) is the representation layer `pre_logits`. A full
    CLIPModel / SiglipModel gives its image tower; DINOv2's training-only `mask_token` is dropped.
    """
    state_dict = {re.sub(r"^(vit|deit|vision_model)\.", "", k): v for k, v in state_dict.items()
                  if not _HF_OUTSIDE_VISION.match(k) and k not in _HF_TRAINING_ONLY
                  and not (k.endswith("embeddings.register_tokens") and 0 in v.shape)}
    hidden = next(v for k, v in state_dict.items() if re.fullmatch(_HF_PATCHES + "weight", k)).shape[0]
    _check_heads(hidden, num_heads)
    layer = r"(?:encoder\.layers?|layers|(?:model\.)?layer)\.(\d+)\."
    projections = {"query": "query", "key": "key", "value": "value", "q_proj": "query",
                   "k_proj": "key", "v_proj": "value"}

    def qkv(match, value):
        return _stacked_projections(BLOCK.format(match.group(1)) + ATTENTION,
                                    (projections[match.group(2)],), match.group(3), value,
                                    num_heads)

    def out(match, value):
        return _out_projection(BLOCK.format(match.group(1)) + ATTENTION, match.group(2), value,
                               num_heads)

    map_attention = MAP_HEAD + "MultiHeadDotProductAttention_0/"

    def map_in(match, value):  # torch MultiheadAttention: in_proj stacks query, key, value
        return _stacked_projections(map_attention, _QKV, match.group(1), value, num_heads)

    def map_out(match, value):
        return _out_projection(map_attention, match.group(1), value, num_heads)

    return _convert(state_dict, [
        (_HF_PATCHES + "weight", _to(EMBEDDING_KERNEL,
                                     functools.partial(_patch_kernel, patch_size=patch_size))),
        (_HF_PATCHES + "bias", _to("embedding/bias")),
        (r"embeddings\.rms_norm\.weight", _to(PATCH_NORM + "scale")),
        (r"embeddings\.cls_token", _to(CLS)),
        (r"embeddings\.class_embedding", _to(CLS, lambda v: v.reshape(1, 1, -1))),
        (r"embeddings\.distillation_token", _to(DIST)),
        (r"embeddings\.register_tokens", _to(REG)),
        (r"embeddings\.position_embeddings", _to(POSEMB)),
        (r"embeddings\.position_embedding\.weight", _to(POSEMB, lambda v: v[None])),
        (r"pre_layrnorm\.(weight|bias)", _ln(PRE_NORM)),
        (layer + r"(?:layernorm_before|norm1|layer_norm1|rms_norm1)\.(weight|bias)",
         _ln(BLOCK + "LayerNorm_0/")),
        (layer + r"(?:attention\.(?:attention\.)?|self_attn\.)"
                 r"(query|key|value|q_proj|k_proj|v_proj)\.(weight|bias)", qkv),
        (layer + r"(?:attention\.(?:output\.dense|o_proj|out_proj)|self_attn\.out_proj)\."
                 r"(weight|bias)", out),
        (layer + r"layer_scale1\.lambda1", _to(BLOCK + LAYER_SCALE_ATTENTION)),
        (layer + r"(?:layernorm_after|norm2|layer_norm2|rms_norm2)\.(weight|bias)",
         _ln(BLOCK + "LayerNorm_2/")),
        (layer + r"(?:intermediate\.dense|mlp\.fc1|(?:mlp|ffn)\.up_proj)\.(weight|bias)",
         _dense(BLOCK + "MlpBlock_3/Dense_0/")),
        (layer + r"(?:mlp|ffn)\.gate_proj\.(weight|bias)", _dense(BLOCK + "MlpBlock_3/gate/")),
        (layer + r"(?:output\.dense|mlp\.fc2|(?:mlp|ffn)\.down_proj)\.(weight|bias)",
         _dense(BLOCK + "MlpBlock_3/Dense_1/")),
        (layer + r"layer_scale2\.lambda1", _to(BLOCK + LAYER_SCALE_MLP)),
        (r"(?:layernorm|post_layernorm|norm|rms_norm)\.(weight|bias)", _ln(ENCODER_NORM)),
        (r"head\.probe", _to(MAP_HEAD + "probe")),
        (r"head\.attention\.in_proj_(weight|bias)", map_in),
        (r"head\.attention\.out_proj\.(weight|bias)", map_out),
        (r"head\.layernorm\.(weight|bias)", _ln(MAP_HEAD + "LayerNorm_0/")),
        (r"head\.mlp\.fc1\.(weight|bias)", _dense(MAP_HEAD + "MlpBlock_0/Dense_0/")),
        (r"head\.mlp\.fc2\.(weight|bias)", _dense(MAP_HEAD + "MlpBlock_0/Dense_1/")),
        (r"pooler\.dense\.(weight|bias)", _dense(PRE_LOGITS)),
        (r"(?:classifier|cls_classifier)\.(weight|bias)", _dense(HEAD)),
        (r"distillation_classifier\.(weight|bias)", _dense(HEAD_DIST)),
    ])
