"""absl flags defined from a dataclass, so an app's flags and its config have one list of fields.

A field becomes a flag when it is declared with `option(default, help, choices, bounds)`; its
flag type comes from the annotation (`str`, `bool`, `int`, `float`; `str` with choices is an
enum; `tuple` is a comma-separated list of strings). Every `int` and `float` field has a range,
`bounds`, in interval notation (`"[1, inf)"`, `"(0, 1]"`): absl refuses a value outside it, NaN
included, while it parses the command line, before the app does any work.

    @dataclasses.dataclass
    class Config:
        batch_size: int = option(None, "Global batch size.", bounds="[1, inf)")
        decay: str = option(None, "Decay after the warm-up.", choices=("cosine", "linear"))

    define_flags(Config, module_name=...)   # at import time of the app
    config = from_flags(Config)             # in main, after absl parsed argv
    check_ranges(config)                    # a config built in Python: the same ranges

A field whose type is itself a dataclass is a group: its fields are flags too, named as they are
(a flag's name says nothing of its group, so flag names are unique across groups). `build` and
`replace` set fields by their flag names wherever they sit, and `flat` reads them back so:

    @dataclasses.dataclass
    class Run:
        schedule: Config = dataclasses.field(default_factory=Config)
        seed: int = option(0, "Seed.", bounds="[0, inf)")

    run = build(Run, batch_size=8, seed=1)  # run.schedule.batch_size == 8
    flat(run)                               # {"batch_size": 8, "decay": None, "seed": 1}

An app may leave fields out (`leave_out`: they are no flags there and keep their defaults) and
give a field another default, help or choices (`overrides`). An app's own numeric flags, outside
any dataclass, are defined with `define_number`, the same ranges.
"""

import dataclasses
import math
import re
import sys
import typing

from absl import flags

from vit_keras import errors

_DEFINE = {str: "DEFINE_string", bool: "DEFINE_boolean", int: "DEFINE_integer",
           float: "DEFINE_float", tuple: "DEFINE_list"}


class FlagRangeError(errors.UserError, ValueError):
    """A numeric setting outside its flag's range."""


@dataclasses.dataclass(frozen=True)
class Interval:
    """A range of numbers, written in interval notation: `"[1, inf)"`, `"(0, 1]"`. NaN is in
    none."""

    low: float
    high: float
    low_closed: bool
    high_closed: bool

    _NOTATION = re.compile(r"^\s*([\[(])\s*([^,\s]+)\s*,\s*([^\]\s)]+)\s*([\])])\s*$")

    @classmethod
    def parse(cls, text):
        match = cls._NOTATION.match(text)
        if not match:
            raise ValueError(f"{text!r} is no interval; write one as [1, inf) or (0, 1].")
        opening, low, high, closing = match.groups()
        interval = cls(float(low), float(high), opening == "[", closing == "]")
        if not interval.low <= interval.high or (
                math.isinf(interval.low) and interval.low_closed) or (
                math.isinf(interval.high) and interval.high_closed):
            raise ValueError(f"{text!r} is no interval of numbers.")
        return interval

    def __contains__(self, value):
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return bool(above and below)  # False for NaN: every comparison with it is

    def __str__(self):
        return (f"{'[' if self.low_closed else '('}{_number(self.low)}, "
                f"{_number(self.high)}{']' if self.high_closed else ')'}")

    def describe(self, kind):
        """"an integer >= 1", "a number > 0", "a number in [0, 1)"."""
        noun = "an integer" if kind is int else "a number"
        if math.isinf(self.high):
            return f"{noun} {'>=' if self.low_closed else '>'} {_number(self.low)}"
        if math.isinf(self.low):
            return f"{noun} {'<=' if self.high_closed else '<'} {_number(self.high)}"
        return f"{noun} in {self}"


def _number(value):
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class _RangeParser:
    """absl's numeric parser with an `Interval` for its bounds (absl's own are closed and let NaN
    through): `lower_bound` and `upper_bound` are the interval's ends (None when infinite), and
    a value outside it is refused with the range in words."""

    def __init__(self, bounds):  # absl caches parsers by their arguments: one per range
        super().__init__()  # pylint: disable=no-value-for-parameter
        self.interval = Interval.parse(bounds)
        self.lower_bound = None if math.isinf(self.interval.low) else self.kind(self.interval.low)
        self.upper_bound = (None if math.isinf(self.interval.high)
                            else self.kind(self.interval.high))
        self.syntactic_help = self.interval.describe(self.kind)

    def is_outside_bounds(self, val):
        return val not in self.interval


class IntegerRangeParser(_RangeParser, flags.IntegerParser):
    kind = int


class FloatRangeParser(_RangeParser, flags.FloatParser):
    kind = float


def define_number(name, default, help, bounds, kind=float,  # pylint: disable=redefined-builtin
                  flag_values=None, module_name=None):
    """An `int` or `float` absl flag whose values must lie in `bounds` (interval notation, e.g.
    `"[1, inf)"`); absl refuses any other value (and NaN) while it parses the command line,
    and `--help` shows the range in words. `None` is allowed as a default ("not given").
    `module_name` (absl's module the flag is listed under in `--help`) defaults to the caller's."""
    parser = (IntegerRangeParser if kind is int else FloatRangeParser)(bounds)
    if module_name is None:  # the caller's, as absl names it: an app's --help lists its own flags
        module_name = sys._getframe(1).f_globals["__name__"]  # pylint: disable=protected-access
        module_name = sys.argv[0] if module_name == "__main__" else module_name
    flags.DEFINE(parser, name, default, help,
                 flags.FLAGS if flag_values is None else flag_values,
                 flags.ArgumentSerializer(), module_name=module_name)


def option(default, help, choices=None, bounds=None):  # pylint: disable=redefined-builtin
    """A dataclass field that is also a command-line flag with this help text (and choices, or
    for a number its range `bounds` in interval notation, e.g. `"[0, 1)"`)."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if bounds is not None:
        Interval.parse(bounds)  # a typo fails where the field is declared
        metadata["bounds"] = bounds
    return dataclasses.field(default=default, metadata=metadata)


def check_ranges(config):
    """Raises `FlagRangeError` (one line, naming the flag, the value and its range) when a
    numeric `option` field of the dataclass `config` holds a value outside its `bounds`:
    the check absl makes on the command line, for a config built in Python."""
    values = flat(config)
    for field, kind in _option_fields(type(config)):
        value = values[field.name]
        if value is None or "bounds" not in field.metadata:
            continue
        interval = Interval.parse(field.metadata["bounds"])
        if isinstance(value, bool) or value not in interval:
            raise FlagRangeError(f"--{field.name} {value} is out of range: it takes "
                                 f"{interval.describe(kind)}.")


def _groups(config_class):
    """`{field name: dataclass}` of the group fields of `config_class`."""
    kinds = typing.get_type_hints(config_class)
    return {field.name: kinds[field.name] for field in dataclasses.fields(config_class)
            if dataclasses.is_dataclass(kinds[field.name])}


def _option_fields(config_class):
    """`[(field, its type)]` of the `option` fields of `config_class` and of its groups, in
    declaration order (a group's where the group is declared)."""
    kinds, groups = typing.get_type_hints(config_class), _groups(config_class)
    found = []
    for field in dataclasses.fields(config_class):
        if field.name in groups:
            found += _option_fields(groups[field.name])
        elif "help" in field.metadata:
            found.append((field, kinds[field.name]))
    return found


def flag_fields(config_class):
    """The fields of `config_class` declared with `option`, its groups' included, in declaration
    order. Raises `TypeError` when two of them have one name (one flag)."""
    fields = [field for field, _ in _option_fields(config_class)]
    names = [field.name for field in fields]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise TypeError(f"{config_class.__name__} declares the flags {repeated} twice.")
    return fields


def flat(config):
    """`{flag name: value}` of the `option` fields of the dataclass `config` (its groups'
    included), in declaration order."""
    values = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            values.update(flat(value))
        elif "help" in field.metadata:
            values[field.name] = value
    return values


def replace(config, **values):
    """A copy of the dataclass `config` with the fields named in `values` replaced: an `option`
    field by its flag name, in whichever group it sits, or any other field of `config` itself
    (`flags_text`). `TypeError` for a name it has not."""
    groups = _groups(type(config))
    changes = {name: values.pop(name) for name in list(values)
               if name not in groups and name in {f.name for f in dataclasses.fields(config)}}
    for name, group in groups.items():
        names = {field.name for field in dataclasses.fields(group)} | set(
            flat(getattr(config, name)))
        given = {key: values.pop(key) for key in list(values) if key in names}
        if given:
            changes[name] = replace(getattr(config, name), **given)
    if values:
        raise TypeError(f"{type(config).__name__} has no field {', '.join(sorted(values))}.")
    return dataclasses.replace(config, **changes)


def build(config_class, **values):
    """A `config_class` with the fields named in `values` set (`replace`), the others at their
    defaults: `build(RunConfig, dataset="cifar10", epochs=5)`."""
    return replace(config_class(), **values)


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
    flag_values = flags.FLAGS if flag_values is None else flag_values
    flag_fields(config_class)  # one flag per name
    types = {field.name: kind for field, kind in _option_fields(config_class)}
    fields = {field.name: field for field, _ in _option_fields(config_class)}
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
        elif kind in (int, float):
            if "bounds" not in field.metadata:
                raise TypeError(f"{config_class.__name__}.{name} is a number without a range; "
                                f"declare it with option(..., bounds=\"[low, high]\").")
            define_number(name, settings["default"], settings["help"], field.metadata["bounds"],
                          kind=kind, flag_values=flag_values,
                          module_name=module_name or __name__)
        else:
            getattr(flags, _DEFINE[kind])(name, settings["default"], settings["help"],
                                          flag_values=flag_values, **extra)


def flag_lines(config, leave_out=()):
    """The `option` fields of the dataclass `config` but `leave_out` as absl writes the flags
    that set them (`Flag.serialize`): `--name=value`, `--name` / `--noname` for a boolean, a
    list comma-separated; a field that is `None` is left out. In field order."""
    lines = []
    for name, value in flat(config).items():
        if name in leave_out or value is None:
            continue
        if isinstance(value, bool):
            lines.append(f"--{'' if value else 'no'}{name}")
        elif isinstance(value, (tuple, list)):
            lines.append(f"--{name}={','.join(str(item) for item in value)}")
        else:
            lines.append(f"--{name}={value}")
    return lines


def from_flags(config_class, flag_values=None, leave_out=(), **values):
    """A `config_class` from the parsed flags of its `option` fields but those in `leave_out`
    (which keep their defaults); `values` fill the others (`build`). A list flag gives a
    tuple."""
    flag_values = flags.FLAGS if flag_values is None else flag_values
    parsed = {field.name: flag_values[field.name].value for field in flag_fields(config_class)
              if field.name not in leave_out}
    return build(config_class, **{name: tuple(value) if isinstance(value, list) else value
                                  for name, value in parsed.items()}, **values)
