"""absl flags defined from a dataclass, so an app's flags and its config have one list of fields.

A field becomes a flag when it is declared with `option(default, help, choices)`; its flag type
comes from the annotation (`str`, `bool`, `int`, `float`; `str` with choices is an enum; `tuple`
is a comma-separated list of strings):

    @dataclasses.dataclass
    class Config:
        batch_size: int = option(None, "Global batch size.")
        decay: str = option(None, "Decay after the warm-up.", choices=("cosine", "linear"))

    define_flags(Config, module_name=...)   # at import time of the app
    config = from_flags(Config)             # in main, after absl parsed argv

An app may leave fields out (`leave_out`: they are no flags there and keep their defaults) and
give a field another default, help or choices (`overrides`).

absl is imported inside the functions: only the apps need it.
"""

import dataclasses
import typing

_DEFINE = {str: "DEFINE_string", bool: "DEFINE_boolean", int: "DEFINE_integer",
           float: "DEFINE_float", tuple: "DEFINE_list"}


def option(default, help, choices=None):  # pylint: disable=redefined-builtin
    """A dataclass field that is also a command-line flag with this help text (and choices)."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return dataclasses.field(default=default, metadata=metadata)


def flag_fields(config_class):
    """The fields of `config_class` declared with `option`, in declaration order."""
    return [field for field in dataclasses.fields(config_class) if "help" in field.metadata]


def define_flags(config_class, module_name=None, flag_values=None, leave_out=(), **overrides):
    """Defines one absl flag per `option` field of `config_class`: same name, default and help.

    Args:
      config_class: a dataclass.
      module_name: the module absl files the flags under; an app's `--help` lists only its own
        module's flags, so pass the app's (absl's name for a script is `sys.argv[0]`). Default:
        this module's, as absl would name it.
      flag_values: the `FlagValues` to define them in (default `absl.flags.FLAGS`).
      leave_out: names of fields that are no flags of this app (an absl "Unknown command line
        flag" there); pass the same to `from_flags`.
      **overrides: field name → `{"default": ..., "help": ..., "choices": ...}` (any of them),
        replacing the field's own for one app (e.g. another default recipe).
    """
    from absl import flags  # pylint: disable=import-outside-toplevel

    flag_values = flags.FLAGS if flag_values is None else flag_values
    types = typing.get_type_hints(config_class)
    fields = {field.name: field for field in flag_fields(config_class)}
    unknown = sorted((set(overrides) | set(leave_out)) - set(fields))
    if unknown:
        raise ValueError(f"{config_class.__name__} has no flag fields {unknown}.")
    for name, field in fields.items():
        if name in leave_out:
            continue
        settings = {"default": field.default, "help": field.metadata["help"],
                    "choices": field.metadata.get("choices"), **overrides.get(name, {})}
        kind = types[name]
        if kind not in _DEFINE:
            raise TypeError(f"{config_class.__name__}.{name} is annotated {kind!r}; a flag field "
                            f"must be one of {', '.join(t.__name__ for t in _DEFINE)}.")
        extra = {"module_name": module_name} if module_name else {}
        if settings["choices"] is not None:
            if kind is not str:
                raise TypeError(f"{config_class.__name__}.{name} has choices but is not a str.")
            flags.DEFINE_enum(name, settings["default"], list(settings["choices"]),
                              settings["help"], flag_values=flag_values, **extra)
        elif kind is tuple:  # absl's list flags take a list (or a comma-separated string)
            flags.DEFINE_list(name, [str(value) for value in settings["default"]], settings["help"],
                              flag_values=flag_values, **extra)
        else:
            getattr(flags, _DEFINE[kind])(name, settings["default"], settings["help"],
                                          flag_values=flag_values, **extra)


def from_flags(config_class, flag_values=None, leave_out=(), **values):
    """A `config_class` from the parsed flags of its `option` fields but those in `leave_out`
    (which keep their defaults); `values` fill the others. A list flag gives a tuple."""
    from absl import flags  # pylint: disable=import-outside-toplevel

    flag_values = flags.FLAGS if flag_values is None else flag_values
    parsed = {field.name: flag_values[field.name].value for field in flag_fields(config_class)
              if field.name not in leave_out}
    return config_class(**{name: tuple(value) if isinstance(value, list) else value
                           for name, value in parsed.items()}, **values)
