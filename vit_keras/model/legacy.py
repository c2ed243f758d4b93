"""The one converter of configs saved before the slots took specs.

Until the specs (`vit_keras.model.specs`), an encoder block's config carried its slots' options
one by one (`gelu`, `mlp`, `norm`, `qkv_bias`, `rope_temperature`, ...), and an attention layer's
its rotary options, and a `ViTConfig` its rotary fields (`rope_temperature`, ...). `.keras` files
written then hold those configs; the layers' `from_config` and `configs.get_config` pass them
through here, which returns the config of today (the specs as dicts), so that every
file of an earlier version loads and predicts as before. Nothing else reads the old names.
"""

# An encoder block's options before specs, with their defaults then.
_BLOCK = {"layer_norm_epsilon": 1e-6, "approximate_gelu": False, "gelu": None, "mlp": "gelu",
          "norm": "layer_norm", "qkv_bias": "qkv", "proj_bias": True, "mlp_bias": True,
          "mlp_norm": False, "rope": None, "rope_temperature": 10000.0,
          "rope_rotate_half": False}
# An attention layer's.
_ATTENTION = {"qkv_bias": "qkv", "out_bias": True, "rope": None, "rope_temperature": 10000.0,
              "rope_rotate_half": False}


def _gelu(gelu, approximate_gelu):
    """The GELU of an old config: `gelu`, or before it the boolean `approximate_gelu`."""
    return gelu or ("tanh" if approximate_gelu else "exact")


def _attention_spec(options):
    rope = None if options["rope"] is None else {
        "kind": options["rope"], "temperature": float(options["rope_temperature"]),
        "rotate_half": bool(options["rope_rotate_half"])}
    return {"qkv_bias": options["qkv_bias"], "out_bias": bool(options["out_bias"]), "rope": rope}


def _split(config, defaults):
    """`(config without the old options, the old options with their defaults)`."""
    rest = {key: value for key, value in config.items() if key not in defaults}
    return rest, {**defaults, **{key: config[key] for key in defaults if key in config}}


# A ViTConfig's rotary fields before they became one RopeSpec, by the spec field each is.
_ROPE_FIELDS = {"rope_temperature": "temperature", "rope_grid_offset": "grid_offset",
                "rope_xy": "xy", "rope_ref_grid": "ref_grid", "rope_rotate_half": "rotate_half"}


def variant_config(fields):
    """`ViTConfig` fields of today from those of any version (before the rotary spec: `rope` the
    kind, beside `rope_temperature`, `rope_grid_offset`, ...)."""
    if not any(name in fields for name in _ROPE_FIELDS):
        return dict(fields)
    rest = {key: value for key, value in fields.items() if key not in _ROPE_FIELDS}
    rope = None if fields.get("rope") is None else {
        "kind": fields["rope"], **{field: fields[old] for old, field in _ROPE_FIELDS.items()
                                   if old in fields}}
    return {**rest, "rope": rope}


def mlp_config(config):
    """An `MlpBlock` config of today from one of any version (before `gelu`: the boolean
    `approximate_gelu`)."""
    if "approximate_gelu" not in config:
        return dict(config)
    rest = {key: value for key, value in config.items() if key != "approximate_gelu"}
    return {**rest, "gelu": _gelu(config.get("gelu"), config["approximate_gelu"])}


def attention_config(config):
    """A `MultiHeadDotProductAttention` config of today from one of any version."""
    if "spec" in config:
        return dict(config)
    rest, options = _split(config, _ATTENTION)
    return {**rest, "spec": _attention_spec(options)}


def block_config(config):
    """A `TransformerBlock` config of today from one of any version."""
    if "attention_spec" in config:
        return dict(config)
    rest, options = _split(config, _BLOCK)
    norm = {"kind": options["norm"], "epsilon": float(options["layer_norm_epsilon"])}
    return {**rest, "norm_spec": norm,
            "attention_spec": _attention_spec({**options, "out_bias": options["proj_bias"]}),
            "mlp_spec": {"kind": options["mlp"],
                         "gelu": _gelu(options["gelu"], options["approximate_gelu"]),
                         "bias": bool(options["mlp_bias"]),
                         "inner_norm": norm if options["mlp_norm"] else None}}


def map_head_config(config):
    """A `MAPHead` config of today from one of any version (before specs: `layer_norm_epsilon`
    and `gelu`)."""
    if "norm_spec" in config:
        return dict(config)
    rest, options = _split(config, {"layer_norm_epsilon": 1e-6, "gelu": "exact"})
    return {**rest, "norm_spec": {"kind": "layer_norm",
                                  "epsilon": float(options["layer_norm_epsilon"])},
            "mlp_spec": {"kind": "gelu", "gelu": options["gelu"]}}
