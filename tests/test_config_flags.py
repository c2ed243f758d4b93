"""vit_keras.tools.config_flags: an app's flags from a dataclass, with fields left out, another
help or choices, and list flags."""

import dataclasses

from absl import flags
import pytest

from vit_keras.tools.config_flags import define_flags, from_flags, option

pytestmark = pytest.mark.backend_independent


@dataclasses.dataclass
class _Config:
    recipe: str = option("auto", "Base recipe.", choices=("auto", "a", "b"))
    smoothing: float = option(None, "Label smoothing.")
    splits: tuple = option(("train",), "Splits.")
    shots: tuple = option((1, 5), "Shots.")


def test_a_left_out_field_is_no_flag_and_keeps_its_default():
    flag_values = flags.FlagValues()
    define_flags(_Config, flag_values=flag_values, leave_out=("smoothing",))
    assert "smoothing" not in flag_values and "recipe" in flag_values
    with pytest.raises(flags.UnrecognizedFlagError, match="smoothing"):
        flag_values(["app", "--smoothing=0.1"])
    flag_values(["app"])
    assert from_flags(_Config, flag_values, leave_out=("smoothing",)).smoothing is None


def test_an_app_may_give_a_field_other_choices_and_help():
    flag_values = flags.FlagValues()
    define_flags(_Config, flag_values=flag_values,
                 recipe={"choices": ("auto", "c"), "help": "Another recipe."})
    assert flag_values["recipe"].parser.enum_values == ["auto", "c"]
    assert flag_values["recipe"].help.startswith("<auto|c>: Another recipe.")
    with pytest.raises(flags.IllegalFlagValueError):
        flag_values(["app", "--recipe=a"])


def test_a_tuple_field_is_a_list_flag_read_back_as_a_tuple():
    flag_values = flags.FlagValues()
    define_flags(_Config, flag_values=flag_values)
    flag_values(["app", "--splits=train,val"])
    config = from_flags(_Config, flag_values)
    assert config.splits == ("train", "val") and config.shots == ("1", "5")
    assert flag_values["shots"].default == ["1", "5"]


def test_leaving_out_or_overriding_a_field_that_is_no_flag_is_an_error():
    with pytest.raises(ValueError, match=r"no flag fields \['missing'\]"):
        define_flags(_Config, flag_values=flags.FlagValues(), leave_out=("missing",))
