"""`ViT`: the Vision Transformer as a Keras model that owns its structure.

A functional `keras.Model` subclass (as keras-hub's backbones are): its config is its
constructor's arguments (the `ViTConfig` and the build arguments), it saves to and loads from
`.keras` with only `import vit_keras`, and the rest of the library asks it for its parts (blocks,
prefix tokens, token grid, heads, norms, LoRA targets, layer groups) instead of looking layers up
by name. Architecture only: weights come in through `vit_keras.weights.pretrained`
(`vit_keras.build_model`).
"""

import dataclasses
import re
import warnings

import keras
import numpy as np

from vit_keras.model import attention as attention_lib
from vit_keras.model import (
    configs,
    failed_calls,
    geometry,
    heads,
    jax_predict,
    jax_train,
    layers,
    norms,
    position_embeddings,
    resnet,
)
from vit_keras.model import mlp as mlp_lib
from vit_keras.model import pixel_normalization as normalization_lib

CLASSIFIERS = heads.CLASSIFIERS
"""Poolings: the class token, the mean of the patch tokens, SigLIP's attention pooling (MAP)."""


@keras.saving.register_keras_serializable(package="vit_keras")
class ViT(failed_calls.FailSafeModel):
    """A Vision Transformer (or an R+ViT hybrid): images `(batch, height, width, channels)` →
    logits `(batch, num_classes)` (float32 under mixed precision), or pooled features `(batch,
    features)` without the top.

    `vit_keras.build_model` builds one and loads weights into it; built here it is freshly
    initialised. `get_config()` is these arguments (with `layer_norm_epsilon` and `gelu` folded
    into `variant`), so `ViT.from_config` rebuilds it.

    Args:
      variant: a name from `vit_keras.VARIANTS` (e.g. `"ViT-B/16"`), a `ViTConfig`, or a dict of
        `ViTConfig` fields for a custom architecture.
      image_size: `int` or `(height, width)`; multiples of the patch size (default 224).
      num_classes: size of the classification head (default 1000).
      include_top: with `False` the model ends at the pooled `(batch, features)` representation
        (after the final LayerNorm and the representation layer, if any) and has no head.
      include_preprocessing: `True`: inputs are RGB pixels in [0, 255], normalised in the graph
        as `normalization` says (`vit_keras.model.pixel_normalization.PixelNormalization`, the
        layer named `rescale`); `False`: inputs are already normalised.
      normalization: how the graph normalises pixels, `(x / 255 - mean) / std` per channel: a
        name (`"inception"`: the original weights' `(x - 127.5) / 127.5`; `"imagenet"`: DeiT,
        DINOv2, MAE; `"clip"`), a `(mean, std)` pair in the [0, 1] scale, or None: `"inception"`
        (`build_model` makes None the weights' own). Saved with the model and its exports.
      classifier: `"token"` (class token), `"gap"` (global average pooling of the patch tokens;
        no class token unless the config's `class_token` says so) or `"map"` (SigLIP's attention
        pooling, `vit_keras.model.heads.MAPHead`).
      representation_size: width of the optional `pre_logits` layer (Dense + tanh) before the head
        (default: none).
      dropout: dropout rate after the embeddings, the attention and the MLP.
      attention_dropout: dropout rate on the attention probabilities.
      drop_path_rate: stochastic depth of the last block; earlier blocks get linearly less.
      channels: number of input channels.
      layer_norm_epsilon: overrides the config's `layer_norm_epsilon` (1e-6, the original
        models'); None keeps it.
      gelu: overrides the config's `gelu`: `"tanh"` (Flax's approximation), `"exact"` (the erf
        GELU of timm and Hugging Face) or `"quick"` (CLIP's); None keeps the config's.
      approximate_gelu: deprecated (goes on 2027-06-01), the boolean spelling of `gelu`: True
        `"tanh"`, False `"exact"`.
      hybrid_numerics: hybrids only: the weight-standardisation and GroupNorm epsilons of
        `"vit_jax"` (the original models) or `"timm"` (see `vit_keras.model.resnet.NUMERICS`).
      dynamic_image_size: `True`: the model takes images of any size, `(batch, None, None,
        channels)` (each side a multiple of the patch size, or for hybrids of the ResNet's
        stride times it); the position embeddings, built and loaded for `image_size`, are
        resampled inside the forward pass to each input's token grid, bicubic with antialiasing
        as timm's `dynamic_img_size=True` does, and added unchanged at `image_size` itself.
      eval_crop: how images are prepared for it at evaluation, a record that its weights'
        checkpoint (or family) states and apps/predict.py and apps/evaluate.py follow:
        `(crop_fraction, interpolation)`, timm's eval transform: the shorter side resized
        (`"bilinear"` or `"bicubic"`) to the input size / `crop_fraction`, then the centre
        cropped (offsets rounded to even; `(crop_fraction, interpolation, "floor")`: rounded
        down, as transformers' image processors crop); None: resized to the input size, bilinear
        (what vit_keras runs train and evaluate with). Nothing in the graph depends on it; saved
        with the model.
      name: the model's name (default: the variant's, with "/" and "+" replaced by "_": TensorFlow
        refuses them in the name scopes of predict and fit).
      attention: the attention kernel of every block (`vit_keras.model.attention.KERNELS`); None lets
        each layer choose the fastest for its backend and device when it is built.
      dtype: the dtype policy of its layers (default: Keras' global policy when it is built);
        the final norm and the head compute in float32 under a mixed policy.

    Its parts, read by the rest of the library: `stem` (a hybrid's ResNet, else None),
    `patch_embedding`, `patch_norm`, `position_embedding` (None without an absolute one),
    `rotary_positions` (`RotaryPositions`, with rotary embeddings), `rotary_rotation`
    (`RotaryRotation`, with fixed rotary frequencies), `blocks`, `encoder_norm`
    (None with `fc_norm`), `fc_norm`, `pooling` (`heads.Pooling`), `pre_logits`, `heads` (the
    classifier's Dense layers).
    """

    ARGUMENTS = ("image_size", "num_classes", "include_top", "include_preprocessing",
                 "normalization", "classifier", "representation_size", "dropout",
                 "attention_dropout", "drop_path_rate", "channels", "layer_norm_epsilon", "gelu",
                 "approximate_gelu", "hybrid_numerics", "dynamic_image_size", "naflex",
                 "attention", "dtype", "eval_crop", "name")
    """The keyword arguments beside `variant` (those `build_model` passes on)."""

    def __init__(self, variant="ViT-B/16", *, image_size=None, num_classes=None,
                 include_top=True, include_preprocessing=True, normalization=None,
                 classifier="token", representation_size=None, dropout=0.0,
                 attention_dropout=0.0, drop_path_rate=0.0, channels=3, layer_norm_epsilon=None,
                 gelu=None, approximate_gelu=None, hybrid_numerics="vit_jax",
                 dynamic_image_size=False, naflex=False, attention=None, dtype=None,
                 eval_crop=None, name=None, **kwargs):
        gelu = _gelu_argument(gelu, approximate_gelu)
        config = _with_overrides(configs.get_config(variant), layer_norm_epsilon, gelu)
        height, width = geometry.pair(224 if image_size is None else image_size, "image size")
        num_classes = 1000 if num_classes is None else int(num_classes)
        _check_switches(config, classifier, representation_size)
        if naflex:
            _check_naflex(config, dynamic_image_size)
        if hybrid_numerics not in resnet.NUMERICS:
            raise ValueError(f"Unknown hybrid_numerics {hybrid_numerics!r}; expected one of "
                             f"{list(resnet.NUMERICS)}.")
        if not include_preprocessing and normalization is not None:
            raise ValueError(f"normalization={normalization!r} needs include_preprocessing=True "
                             f"(without it the model takes pixels already normalised).")
        # The policy's name: layers that Keras configures from their arguments take a string.
        policy = keras.dtype_policies.get(dtype or keras.config.dtype_policy()).name
        # Under mixed precision the last norm and everything after it run in float32.
        head_policy = "float32" if policy.startswith("mixed") else policy
        # The slots' specs, each read from the config by its own module.
        norm_spec, mlp_spec = norms.norm_spec(config), mlp_lib.mlp_spec(config)
        attention_spec = attention_lib.attention_spec(config)
        tokens = layers.token_spec(config, classifier)
        position_spec = position_embeddings.position_spec(config)
        head_spec = heads.head_spec(config, classifier)

        p = config.patch_size
        if naflex:  # timm's names and layouts: patches flattened (row, column, channel)
            inputs = {"patches": keras.Input((None, p * p * channels), name="patches"),
                      "patch_coord": keras.Input((None, 2), dtype="int32", name="patch_coord"),
                      "patch_valid": keras.Input((None,), dtype="bool", name="patch_valid")}
            x = inputs["patches"]
        else:
            inputs = x = keras.Input(
                (*((None, None) if dynamic_image_size else (height, width)), channels),
                name="images")
        rescale = stem = None
        if include_preprocessing:
            pixels = normalization_lib.get_normalization(
                normalization_lib.PAPER if normalization is None else normalization)
            rescale = normalization_lib.PixelNormalization(
                *pixels.for_channels(channels), dtype="float32", name="rescale")
            if naflex:  # the pixels of each patch, channels last, normalised as an image's
                x = keras.layers.Reshape((-1, p * p, channels), name="patch_pixels")(x)
                x = keras.layers.Reshape((-1, p * p * channels), name="patch_values")(rescale(x))
            else:
                x = rescale(x)
        feature_map = (height, width)  # what the patch embedding sees at the built size
        if config.is_hybrid:
            stem = resnet.ResNetStem(config.resnet_layers, config.resnet_width, dtype=policy,
                                     name="resnet", **resnet.NUMERICS[hybrid_numerics])
            x = stem(x)
            feature_map = stem.compute_output_shape((None, height, width, channels))[1:3]
        _check_divisible(config, (height, width), feature_map)
        embedding = layers.PatchEmbedding(config.patch_size, config.hidden_size,
                                          flatten=not dynamic_image_size,
                                          use_bias=config.patch_bias, dtype=policy,
                                          name="embedding")
        patches = x = embedding(x)
        patch_norm = None
        if config.patch_norm:  # AIMv2's, on the patch embeddings before anything is added
            patch_norm = norm_spec.make(dtype=policy, name="patch_norm")
            patches = x = patch_norm(x)
        if dynamic_image_size:  # the grid stays for the position embeddings to resample to
            x = keras.layers.Reshape((-1, config.hidden_size), dtype=policy,
                                     name="patch_tokens")(x)
        # Token order [cls, dist, registers..., patches]. Position embeddings cover the class and
        # distillation tokens (`covers_prefix`) or only the patches; registers take none.
        prefix, registers = tokens.make(dtype=policy)
        grid = tuple(side // config.patch_size for side in feature_map)
        position = position_spec.make(grid if dynamic_image_size or naflex else None,
                                      tokens.named, dtype=policy, naflex=naflex)
        for token in prefix if position_spec.covers_prefix else ():
            x = token(x)
        if naflex and position is not None:
            x = position(x, inputs["patch_coord"], inputs["patch_valid"])
        elif position is not None:
            x = position(x, patches) if dynamic_image_size else position(x)
        for token in () if position_spec.covers_prefix else prefix:
            x = token(x)
        if registers is not None:
            prefix.append(registers)
            x = registers(x)
        rotary_positions = rotation = rotary = None
        if attention_spec.rope is not None:  # the blocks' rotary input, computed once
            rotary_positions = attention_spec.rope.positions(grid, tokens.count, naflex=naflex)
            rotary = (rotary_positions(inputs["patch_coord"], inputs["patch_valid"]) if naflex
                      else rotary_positions(patches))
            if not attention_spec.rope.learned:
                rotation = attention_spec.rope.rotation(config.hidden_size // config.num_heads)
                rotary = rotation(rotary)
        # NaFlex: the real tokens, whose keys every attention and the pooling read alone.
        valid = (layers.ValidTokens(tokens.count, name="valid_tokens")(inputs["patch_valid"])
                 if naflex else None)
        x = keras.layers.Dropout(dropout, dtype=policy, name="dropout")(x)
        pre_norm = None
        if config.pre_norm:
            pre_norm = norm_spec.make(dtype=policy, name="pre_norm")
            x = pre_norm(x)
        blocks = []
        for index, rate in enumerate(np.linspace(0.0, drop_path_rate, config.num_layers)):
            blocks.append(layers.TransformerBlock(
                config.num_heads, config.mlp_dim, dropout=dropout,
                attention_dropout=attention_dropout, drop_path_rate=float(rate),
                layer_scale_init=config.layer_scale_init, attention=attention,
                attention_spec=attention_spec, mlp_spec=mlp_spec, norm_spec=norm_spec,
                dtype=policy, name=f"encoderblock_{index}"))
            rotary_input = () if rotary is None else (rotary,)
            x = blocks[-1](x, *rotary_input, **({} if valid is None else {"valid": valid}))
        encoder_norm = fc_norm = pre_logits = None
        if not head_spec.fc_norm:  # the norm after the pooling replaces it
            encoder_norm = norm_spec.make(dtype=head_policy, name="encoder_norm")
            x = encoder_norm(x)
        pooling = head_spec.pooling(config.num_heads, config.mlp_dim, tokens.count, norm_spec,
                                    mlp_spec, dtype=head_policy)
        x = pooling(x, valid)
        if head_spec.fc_norm:
            fc_norm = norm_spec.make(dtype=head_policy, name="fc_norm")
            x = fc_norm(x)
        if representation_size:
            pre_logits = keras.layers.Dense(representation_size, activation="tanh",
                                            dtype=head_policy, name="pre_logits")
            x = pre_logits(x)
        classifier_heads = head_spec.heads(num_classes, dtype=head_policy) if include_top else []
        x = heads.classify(classifier_heads, x, dtype=head_policy)
        super().__init__(inputs, x, name=name or re.sub(r"[/+]", "_", config.name), **kwargs)

        # The constructor's arguments, for get_config (the overrides are folded into the config).
        self.vit_config = config
        self._arguments = {
            "variant": dataclasses.asdict(config), "image_size": [height, width],
            "num_classes": num_classes, "include_top": bool(include_top),
            "include_preprocessing": bool(include_preprocessing),
            "normalization": _serializable(normalization), "classifier": classifier,
            "representation_size": representation_size, "dropout": float(dropout),
            "attention_dropout": float(attention_dropout),
            "drop_path_rate": float(drop_path_rate), "channels": int(channels),
            "hybrid_numerics": hybrid_numerics, "dynamic_image_size": bool(dynamic_image_size),
            "naflex": bool(naflex),
            "attention": attention, "dtype": policy, "eval_crop": geometry.eval_crop(eval_crop)}
        # The parts (the layers above, tracked once: Keras saves each layer under the graph's).
        self.rescale, self.stem, self.patch_embedding = rescale, stem, embedding
        self.patch_norm, self.rotary_positions = patch_norm, rotary_positions
        self.rotary_rotation = rotation
        self.prefix_layers, self.position_embedding = prefix, position
        self.pre_norm, self.blocks = pre_norm, blocks
        self.encoder_norm, self.pooling, self.fc_norm = encoder_norm, pooling, fc_norm
        self.pre_logits, self.heads = pre_logits, list(classifier_heads)

    def call(self, inputs, training=None, mask=None, **kwargs):
        # Keras checks the input's shape in `__call__`, which JAX's `predict` and `fit` skip (they
        # trace `call`): a model without absolute position embeddings would run on images of
        # another size there, silently unlike what it was built and loaded for.
        if not (self.dynamic_image_size or self.naflex) and hasattr(inputs, "shape"):
            self._check_images(tuple(keras.ops.shape(inputs)))
        return super().call(inputs, training=training, mask=mask, **kwargs)

    def _check_images(self, shape):
        """Refuses a batch `shape` other than `(batch, height, width, channels)` of the model's
        size, naming what differs."""
        height, width = self.image_size
        channels = self._arguments["channels"]
        # A side a traced graph leaves unknown is a tensor here, not an int: unchecked.
        shape = tuple(side if isinstance(side, int) else None for side in shape)
        if len(shape) != 4:
            single = (" One image: add a batch axis (images[None], or a dataset's .batch(n))."
                      if shape == (height, width, channels) else "")
            raise ValueError(f"Model {self.name!r} takes a batch of images, shape (batch, "
                             f"{height}, {width}, {channels}); got shape {shape}.{single}")
        if shape[1:3] != (height, width) and None not in shape[1:3]:
            raise ValueError(
                f"Model {self.name!r} takes {height}x{width} images; got {shape[1]}x{shape[2]}. "
                f"Resize the images, or build the model with image_size={shape[1:3]} or "
                f"dynamic_image_size=True.")
        # One channel broadcasts to the model's in a per-channel normalisation: grey as RGB.
        normalized_channels = [len(getattr(self.rescale, name, ())) for name in ("mean", "std")]
        broadcasts = channels == max(normalized_channels)
        if shape[3] not in (None, channels) and not (shape[3] == 1 and broadcasts):
            raise ValueError(f"Model {self.name!r} takes images of {channels} channels; "
                             f"got {shape[3]}.")

    def predict_on_batch(self, x):
        """Keras' `predict_on_batch`: outputs of one batch as NumPy arrays. On JAX one jitted
        forward pass of the weights as they are, without Keras' copy of every variable into and
        out of the step on each call (`vit_keras.model.jax_predict`)."""
        if keras.backend.backend() == "jax":
            return jax_predict.predict_on_batch(self, x)
        return super().predict_on_batch(x)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """Keras' `train_on_batch`: one training step, its logs. On JAX Keras' own compiled step
        on the variables' arrays as they are, without Keras' checked copy of every variable into
        and out of the step on each call (`vit_keras.model.jax_train`)."""
        if keras.backend.backend() == "jax":
            return jax_train.train_on_batch(self, x, y, sample_weight, class_weight, return_dict)
        return super().train_on_batch(x, y, sample_weight=sample_weight, class_weight=class_weight,
                                      return_dict=return_dict)

    # The images are checked before Keras runs: TensorFlow traces a second `fit` for images of
    # any size, which then fails deep in the graph. A call that raises keeps the model's weights
    # (`failed_calls.FailSafeModel`).

    def fit(self, *args, **kwargs):
        self._check_data(args[0] if args else kwargs.get("x"))
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        self._check_data(args[0] if args else kwargs.get("x"))
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self._check_data(args[0] if args else kwargs.get("x"))
        return super().predict(*args, **kwargs)

    def _check_data(self, x):
        """`_check_images` for an array of images, or a `tf.data.Dataset` of them (alone, or
        first in a tuple); generators and the rest are checked as they are traced."""
        if self.dynamic_image_size or self.naflex:
            return
        spec = getattr(x, "element_spec", None)  # a tf.data.Dataset
        if isinstance(spec, tuple) and spec:
            spec = spec[0]
        shape = getattr(spec if spec is not None else x, "shape", None)
        if shape is not None and getattr(shape, "rank", 0) is not None:
            self._check_images(tuple(shape))

    # -- configuration ----------------------------------------------------------------------------

    def get_config(self):
        return {"name": self.name, "trainable": self.trainable, **self._arguments}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def rebuilt(self, **changes):
        """A new `ViT` of this one's arguments with `changes` (e.g. `dynamic_image_size=True`,
        `dropout=0.0`, `dtype="float32"`), holding this one's weights (each by its path; a change
        that alters a weight's shape is refused)."""
        unknown = set(changes) - set(self._arguments) - {"name", "trainable"}
        if unknown:
            raise ValueError(f"Unknown ViT arguments {sorted(unknown)}; expected some of "
                             f"{sorted(self._arguments)}.")
        copy = type(self).from_config({**self.get_config(), **changes})
        _copy_weights(self, copy)
        return copy

    # -- structure --------------------------------------------------------------------------------

    @staticmethod
    def model_parallel_layout():
        """The layouts of its weights over a device mesh's `model` axis, as
        `keras.distribution.LayoutMap` takes them: `{path regex: axes}`, the blocks' attention
        split over heads and their MLPs over hidden units; every other weight replicated. The
        same for every ViT (a rule matches the weights a model has), so a distribution can be set
        before the model is built."""
        return {f".*{path}": axes
                for path, axes in layers.TransformerBlock.model_parallel_layout().items()}

    @property
    def dynamic_image_size(self):
        """Whether the model takes images of any size (position embeddings resampled per call)."""
        return self._arguments["dynamic_image_size"]

    @property
    def naflex(self):
        """Whether the model takes NaFlex inputs: `{"patches", "patch_coord", "patch_valid"}`
        (`vit_keras.naflex_patches` makes them) instead of images."""
        return self._arguments.get("naflex", False)

    @property
    def image_size(self):
        """`(height, width)` the model was built for (and its position embeddings hold)."""
        return tuple(self._arguments["image_size"])

    @property
    def eval_crop(self):
        """`(crop_fraction, interpolation[, "floor"])` of its evaluation transform, or None
        (resize only)."""
        crop = self._arguments["eval_crop"]
        return None if crop is None else tuple(crop)

    @property
    def normalization(self):
        """The `Normalization` the model applies to its input pixels, or None when it takes
        normalised inputs (`include_preprocessing=False`)."""
        return None if self.rescale is None else self.rescale.normalization

    @property
    def token_pixels(self):
        """Input pixels along each side of one token: the patch size times a hybrid's ResNet
        stride (16 for ViT-B/16 and R50+ViT-B/16)."""
        return geometry.pixels_per_token(self.vit_config)

    @property
    def token_grid(self):
        """The patch-token grid `(rows, cols)` at the built image size."""
        return tuple(side // self.token_pixels for side in self.image_size)

    @property
    def prefix_tokens(self):
        """The kinds of the tokens before the patch tokens, in order: `"class"`,
        `"distillation"`, one `"register"` per register token (`[]` for GAP and MAP models)."""
        return layers.token_spec(self.vit_config, self._arguments["classifier"]).kinds

    @property
    def num_prefix_tokens(self):
        return len(self.prefix_tokens)

    @property
    def norms(self):
        """Every LayerNorm: the pre-norm, each block's two, the final one (encoder or fc)."""
        found = [self.pre_norm] + [norm for block in self.blocks for norm in block.norms]
        return [norm for norm in found + [self.encoder_norm, self.fc_norm] if norm is not None]

    @property
    def classifier_layers(self):
        """The layers after the pooling that a LoRA run trains in full: `pre_logits` (if any)
        and the heads."""
        return [layer for layer in [self.pre_logits, *self.heads] if layer is not None]

    @property
    def lora_targets(self):
        """The layers LoRA adapts: each block's `query`, `key`, `value`, `out` and its MLP's two
        Dense layers, block by block."""
        return [layer for block in self.blocks for layer in block.lora_targets]

    def layer_groups(self):
        """`[(group name, layers), ...]` in depth order for layer-wise learning-rate decay:
        `"embeddings"` (every layer with weights before the first block: the ResNet stem, the
        patch embedding, the prefix tokens, the position embedding, the pre-norm), then one group
        per block, named as the block. The final norm, pooling and heads are in no group."""
        first = [self.stem, self.patch_embedding, self.patch_norm, *self.prefix_layers,
                 self.position_embedding, self.pre_norm]
        return [("embeddings", [layer for layer in first if layer is not None])] + [
            (block.name, [block]) for block in self.blocks]

    def set_remat(self, enabled=True):
        """Recompute each block's forward in the backward pass (`keras.remat`: less memory,
        larger batches), or stop; in place. Not part of the config: a saved model does not
        carry it."""
        for block in self.blocks:
            block.set_remat(enabled)
        return self

    def with_dynamic_image_size(self):
        """This model taking images of any size, with the same weights (see
        `vit_keras.with_dynamic_image_size`)."""
        return self if self.dynamic_image_size else self.rebuilt(dynamic_image_size=True)

    def tokens_before_blocks(self):
        """A `keras.Model` (of this model's layers) from images to the first block's input
        tokens `(batch, tokens, hidden)`; with rotary embeddings to those tokens and each block's
        second input, the tokens' coordinates `(tokens, 2)` or their rotation `(2, 1, tokens,
        head_dim)` (see `vit_keras.model.position_embeddings`)."""
        return failed_calls.FailSafeModel(self.input, self.blocks[0].input)

    # -- adopting models saved before this class --------------------------------------------------

    @classmethod
    def of(cls, model):
        """`model` itself when it is a `ViT`; a `ViT` with the same arguments and weights when it
        is a functional vit_keras model saved before this class existed (a `.keras` file of an
        earlier vit_keras). Raises `ValueError` for any other model."""
        if isinstance(model, cls):
            return model
        arguments = _arguments_of_functional(model)
        try:
            vit = cls(**arguments)
            _copy_weights(model, vit)
        except ValueError as error:
            raise ValueError(f"Model {model.name!r} is not a vit_keras ViT: the ViT its layers "
                             f"describe does not fit it ({error})") from None
        return vit


def _gelu_argument(gelu, approximate_gelu):
    """`gelu`, or the deprecated `approximate_gelu`'s (with its warning)."""
    if approximate_gelu is None:
        return gelu
    warnings.warn("ViT(approximate_gelu=...) is deprecated and goes on 2027-06-01: pass "
                  "gelu=\"tanh\" or gelu=\"exact\".", DeprecationWarning, stacklevel=3)
    wanted = "tanh" if approximate_gelu else "exact"
    if gelu is not None and gelu != wanted:
        raise ValueError(f"approximate_gelu={approximate_gelu} asks for the {wanted} GELU, but "
                         f"gelu={gelu!r}; pass gelu alone.")
    return wanted


def _with_overrides(config, layer_norm_epsilon, gelu):
    """`config` with the build arguments that override its fields (None: the config's)."""
    changes = {}
    if layer_norm_epsilon is not None:
        changes["layer_norm_epsilon"] = float(layer_norm_epsilon)
    if gelu is not None:
        changes["gelu"] = mlp_lib.gelu_variant(gelu)
    return dataclasses.replace(config, **changes) if changes else config


def _serializable(normalization):
    """A `normalization` argument as JSON keeps it: a name, `[mean, std]` lists, or None."""
    if normalization is None or isinstance(normalization, str):
        return normalization
    found = normalization_lib.get_normalization(normalization)
    return found.name or [list(found.mean), list(found.std)]


def _check_switches(config, classifier, representation_size):
    """Refuses a classifier that the config's switches cannot pool with."""
    if classifier not in CLASSIFIERS:
        raise ValueError(f"Unknown classifier {classifier!r}; expected one of {CLASSIFIERS}.")
    if classifier == "token" and config.class_token is False:
        raise ValueError(f"{config.name} has no class token (class_token=False), so it cannot "
                         f"pool with classifier='token'; use 'gap' or 'map'.")
    if config.distillation and classifier != "token":
        raise ValueError(f"{config.name} has a distillation token, whose head reads the class "
                         f"and distillation tokens (DeiT); use classifier='token', not "
                         f"{classifier!r}.")
    if config.distillation and (representation_size or config.fc_norm):
        raise ValueError(f"{config.name}: DeiT's distilled heads read the tokens directly; a "
                         f"representation layer or fc_norm is not supported with distillation.")
    if config.is_hybrid and (config.num_registers or config.distillation):
        raise ValueError(f"{config.name}: hybrids take no register or distillation tokens.")


def _check_naflex(config, dynamic_image_size):
    """Refuses what NaFlex inputs cannot feed: a hybrid's ResNet (it needs whole images)."""
    if config.is_hybrid:
        raise ValueError(f"{config.name}: a hybrid's ResNet reads whole images, so it takes no "
                         f"NaFlex patches; build it without naflex.")
    if dynamic_image_size:
        raise ValueError("naflex=True already takes any size and aspect ratio; pass it without "
                         "dynamic_image_size.")


def _check_divisible(config, image_size, feature_map):
    for side, size, grid in zip(("height", "width"), image_size, feature_map):
        if grid % config.patch_size:
            feature = f" (a feature map of {grid})" if config.is_hybrid else ""
            raise ValueError(
                f"Image {side} {size}{feature} is not divisible by patch size "
                f"{config.patch_size} of {config.name}; use an image size that is a multiple of "
                f"{config.patch_size * size // grid}.")


def _copy_weights(source, target):
    """Assigns `source`'s weights to `target`'s of the same path; every weight of `target` must
    have one of the same shape."""
    values = {weight.path: weight for weight in source.weights}
    for weight in target.weights:
        value = values.get(weight.path)
        if value is None or tuple(value.shape) != tuple(weight.shape):
            raise ValueError(
                f"{target.name}: weight {weight.path} {tuple(weight.shape)} has no counterpart "
                f"in {source.name}" + ("" if value is None else f" (it is {tuple(value.shape)})")
                + ".")
        # A copy: sharing a JAX buffer with another model's variable lets one donate it away.
        weight.assign(keras.ops.convert_to_numpy(value))


# The layer names of the functional models vit_keras built before `ViT` existed. Here only: the
# rest of the library asks a `ViT` for its parts.
def _arguments_of_functional(model):
    """The `ViT` arguments of a functional vit_keras model of an earlier version, read from its
    layers' configs."""
    found = {layer.name: layer for layer in getattr(model, "layers", ())}
    blocks = [layer for layer in found.values() if isinstance(layer, layers.TransformerBlock)]
    embedding = found.get("embedding")
    pooling, map_head = found.get("pooling"), found.get("MAPHead_0")
    if not blocks or not isinstance(embedding, layers.PatchEmbedding) or (
            pooling is None and map_head is None):
        raise ValueError(f"Model {getattr(model, 'name', model)!r} is not a vit_keras ViT: it has "
                         f"no patch embedding, transformer blocks and pooling. Expected a model from "
                         f"`vit_keras.build_model` or a vit_keras .keras file.")
    block = blocks[0]
    classifier = "map" if map_head is not None else pooling.mode
    order = [layer.name for layer in model.layers]
    position = found["posembed_input"]
    stem = found.get("resnet")
    head = found.get("head")
    class_token = "cls" in found
    config = configs.ViTConfig(
        name=_variant_name(model.name), patch_size=embedding.patch_size,
        hidden_size=embedding.hidden_size, mlp_dim=block.mlp_dim, num_heads=block.num_heads,
        num_layers=len(blocks),
        resnet_layers=None if stem is None else stem.num_layers,
        resnet_width=1 if stem is None else stem.width_factor,
        layer_scale_init=block.layer_scale_init,
        num_registers=found["reg"].num_tokens if "reg" in found else 0,
        distillation="dist" in found,
        posemb_prefix=not (class_token and order.index("cls") > order.index("posembed_input")),
        pre_norm="pre_norm" in found, fc_norm="fc_norm" in found,
        patch_bias=embedding.use_bias, layer_norm_epsilon=block.layer_norm_epsilon,
        gelu=block.gelu,
        class_token=None if class_token == (classifier == "token") else class_token)
    rescale = _legacy_normalization(found.get("rescale"))
    shape = model.input.shape
    grid = getattr(position, "grid_size", None)
    image_size = (tuple(side * geometry.pixels_per_token(config) for side in grid)
                  if grid is not None else tuple(shape[1:3]))
    pre_logits = found.get("pre_logits")
    dtype = block.dtype_policy.name
    return {
        "variant": config, "image_size": image_size,
        "num_classes": head.units if head is not None else 1000,
        "include_top": head is not None, "include_preprocessing": rescale is not None,
        "normalization": None if rescale is None else (rescale.mean, rescale.std),
        "classifier": classifier,
        "representation_size": None if pre_logits is None else pre_logits.units,
        "dropout": block.dropout, "attention_dropout": block.attention_dropout,
        "drop_path_rate": blocks[-1].drop_path_rate, "channels": shape[-1],
        "hybrid_numerics": _numerics_of(stem), "dynamic_image_size": grid is not None,
        "dtype": dtype, "name": model.name}


def _legacy_normalization(layer):
    """The `Normalization` of a legacy model's `rescale` layer: a `PixelNormalization`, or (saved
    before the normalisation was stored) a `Rescaling`; None without one."""
    if isinstance(layer, normalization_lib.PixelNormalization):
        return layer.normalization
    if isinstance(layer, keras.layers.Rescaling):
        scale, offset = float(layer.scale), float(layer.offset)
        return normalization_lib.get_normalization(
            ((-offset / (255 * scale),), (1 / (255 * scale),)))
    return None


def _variant_name(model_name):
    """The variant a model's default name stands for (`ViT_B_16` → `ViT-B/16`), else the name."""
    for name in configs.VARIANTS:
        if re.sub(r"[/+]", "_", name) == model_name:
            return name
    return model_name


def _numerics_of(stem):
    if stem is None:
        return "vit_jax"
    settings = stem.get_config()
    return next((name for name, numerics in resnet.NUMERICS.items()
                 if all(settings.get(key) == value for key, value in numerics.items())),
                "vit_jax")


def with_dynamic_image_size(model):
    """A copy of a fixed-size vit_keras model that takes images of any size, with the same weights.

    The copy is what `build_model(..., dynamic_image_size=True)` would build at the model's image
    size: its input is `(batch, None, None, channels)` and its position embeddings are resampled
    in the forward pass to each input's token grid (unchanged at the model's own size, where both
    give the same logits). For a model trained at a fixed size that should now serve others.

    Args:
      model: a model from `build_model` (ViT, GAP or hybrid), or loaded from a vit_keras .keras
        file. A model that already has a dynamic image size is returned as it is.
    """
    return ViT.of(model).with_dynamic_image_size()


def transformer_blocks(model):
    """The model's `TransformerBlock`s in the order they run."""
    return list(ViT.of(model).blocks)


def attention_scores(model, images, batch_size=16):
    """Every encoder block's attention probabilities for a batch of images.

    Args:
      model: a model from `build_model` (or a loaded one).
      images: `(batch, height, width, channels)`, as the model takes them.
      batch_size: images per forward pass.

    Returns:
      A list with one float32 NumPy array `(batch, heads, tokens, tokens)` per block, in order.
      Only this call takes the explicit-softmax path; the model itself keeps fused attention.
    """
    vit = ViT.of(model)
    stem = vit.tokens_before_blocks()
    images = np.asarray(images)
    per_block = [[] for _ in vit.blocks]
    for start in range(0, len(images), batch_size):
        x = stem(images[start:start + batch_size], training=False)
        x, rotary = x if vit.rotary_positions is not None else (x, None)
        for index, block in enumerate(vit.blocks):
            x, scores = block(x, rotary, training=False, return_attention_scores=True)
            per_block[index].append(keras.ops.convert_to_numpy(scores))
    return [np.concatenate(chunks) for chunks in per_block]

