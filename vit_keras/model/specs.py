"""`Spec`: a slot's options as one frozen record, which the layer of that slot takes whole.

Each slot module owns its spec (`norms.NormSpec`, `mlp.MlpSpec`, `attention.AttentionSpec`,
`position_embeddings.RopeSpec`) and the function that reads it from a `ViTConfig`; a layer that
holds a slot's layer hands it the spec, never the spec's options one by one. A spec serialises to
a JSON-ready dict (`get_config`) and back (`of`), nested specs included.
"""

import dataclasses
import typing


class Spec:
    """Base of the slots' specs (frozen dataclasses). `NESTED` maps a field to the spec class its
    value is (e.g. `AttentionSpec.rope` → `RopeSpec`)."""

    NESTED: typing.ClassVar[dict] = {}

    def get_config(self):
        """The spec as a dict of JSON values (tuples as lists, nested specs as dicts)."""
        config = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Spec):
                value = value.get_config()
            elif isinstance(value, tuple):
                value = list(value)
            config[field.name] = value
        return config

    @classmethod
    def of(cls, value):
        """`value` as this spec: the spec itself, its `get_config()` dict, or None (stays None)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"{cls.__name__}: expected a {cls.__name__}, a dict of its fields or "
                            f"None; got {type(value).__name__}.")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"Unknown {cls.__name__} fields {unknown}; expected some of "
                             f"{sorted(known)}.")
        nested = {name: cls.NESTED[name].of(item) for name, item in value.items()
                  if name in cls.NESTED}
        return cls(**{**value, **nested})
