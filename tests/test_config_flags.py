"""vit_keras.tools.runs.config_flags: an app's flags from a dataclass, with fields left out, another
help or choices, list flags, and the range of every number."""

import dataclasses
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

from absl import flags
import pytest

from vit_keras.tools.runs import config_flags, objectives, training
from vit_keras.tools.runs.config_flags import define_flags, from_flags, option

from conftest import REPO_ROOT

pytestmark = pytest.mark.backend_independent


@dataclasses.dataclass
class _Config:
    recipe: str = option("auto", "Base recipe.", choices=("auto", "a", "b"))
    smoothing: float = option(None, "Label smoothing.", bounds="[0, 1)")
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


@dataclasses.dataclass
class _Grouped:
    config: _Config = dataclasses.field(default_factory=_Config)
    seed: int = option(0, "Seed.", bounds="[0, inf)")
    note: str = None  # no flag


def test_a_groups_fields_are_flags_named_as_they_are_and_set_by_those_names():
    flag_values = flags.FlagValues()
    define_flags(_Grouped, flag_values=flag_values)
    assert {"recipe", "smoothing", "splits", "shots", "seed"} == set(flag_values)
    flag_values(["app", "--recipe=a", "--seed=3"])
    grouped = from_flags(_Grouped, flag_values, note="x")
    assert (grouped.config.recipe, grouped.seed, grouped.note) == ("a", 3, "x")
    changed = config_flags.replace(grouped, smoothing=0.1, seed=4)
    assert (changed.config.smoothing, changed.seed, grouped.config.smoothing) == (0.1, 4, None)
    assert config_flags.flat(changed) == {"recipe": "a", "smoothing": 0.1,
                                          "splits": ("train",), "shots": ("1", "5"), "seed": 4}
    assert config_flags.build(_Grouped, smoothing=0.2).config.smoothing == 0.2
    with pytest.raises(TypeError, match="has no field missing"):
        config_flags.build(_Grouped, missing=1)
    with pytest.raises(config_flags.FlagRangeError, match="--smoothing 2 is out of range"):
        config_flags.check_ranges(config_flags.build(_Grouped, smoothing=2))


def test_two_fields_of_one_name_in_two_groups_are_refused():
    @dataclasses.dataclass
    class Twice:
        config: _Config = dataclasses.field(default_factory=_Config)
        recipe: str = option("auto", "Again.")

    with pytest.raises(TypeError, match=r"declares the flags \['recipe'\] twice"):
        define_flags(Twice, flag_values=flags.FlagValues())


def test_a_number_field_without_a_range_is_refused_where_the_flags_are_defined():
    @dataclasses.dataclass
    class Unbounded:
        epochs: int = option(None, "Epochs.")

    with pytest.raises(TypeError, match="Unbounded.epochs is a number without a range"):
        define_flags(Unbounded, flag_values=flags.FlagValues())


@pytest.mark.parametrize("bounds, inside, outside", [
    ("[1, inf)", [1, 10**9], [0, -5, math.inf, math.nan]),
    ("(0, 1)", [1e-9, 0.5], [0, 1, -1, math.nan]),
    ("(0, 1]", [1], [0, 1.5]),
    ("[0, 2]", [0, 2], [-1, 3]),
])
def test_an_interval_holds_what_its_notation_says_and_never_nan(bounds, inside, outside):
    interval = config_flags.Interval.parse(bounds)
    assert str(interval) == bounds
    assert all(value in interval for value in inside)
    assert not any(value in interval for value in outside)


# The careless values of vit_keras issue 41 (item 5) and their flags, as the training apps define
# them: each is refused while absl parses the command line, naming the flag and the range.
CARELESS = {"epochs": ["-1", "0"], "learning_rate": ["-1", "0", "nan"], "steps_per_epoch": ["0", "-5"],
            "label_smoothing": ["5"], "drop_path_rate": ["5"], "val_fraction": ["-1", "1"],
            "accum_steps": ["-3"], "warmup_steps": ["-5"], "grad_clip_norm": ["-1"],
            "total_steps": ["-1"], "batch_size": ["0"], "eval_batch_size": ["-5"],
            "dropout": ["1.5"], "crop_min_area": ["0"], "representation_size": ["-3"],
            "peer_timeout": ["0"], "num_processes": ["-1"], "seed": ["-1"], "verbose": ["3"]}


@pytest.mark.backend_independent
@pytest.mark.parametrize("flag, value", [(flag, value) for flag, values in CARELESS.items()
                                         for value in values])
def test_a_careless_training_flag_is_refused_while_parsing(flag, value):
    flag_values = flags.FlagValues()
    define_flags(training.RunConfig, flag_values=flag_values)
    with pytest.raises(flags.IllegalFlagValueError, match=f"flag --{flag}={value}: .* is not "):
        flag_values(["app", f"--{flag}={value}"])


def test_a_careless_value_from_python_is_refused_by_run_before_anything_loads(tmp_path):
    for field, value in (("epochs", -1), ("steps_per_epoch", 0), ("learning_rate", -1.0),
                         ("dropout", 1.5)):
        config = training.RunConfig.of(output_dir=str(tmp_path), **{field: value})
        with pytest.raises(config_flags.FlagRangeError, match=f"--{field} {value} is out of "):
            training.run(config, log=lambda _: None)
    with pytest.raises(config_flags.FlagRangeError, match="--corruption_rate 0 is out of"):
        training.run(training.RunConfig.of(output_dir=str(tmp_path)), log=lambda _: None,
                     objective=objectives.MaskedPatchPrediction(corruption_rate=0))
    assert os.listdir(tmp_path) == []  # refused before the run folder was made


def test_flag_lines_are_what_absl_writes_for_the_same_values():
    flag_values = flags.FlagValues()
    define_flags(training.RunConfig, flag_values=flag_values)
    flag_values(["app", "--learning_rate=0.03", "--nodownload", "--linear_probe", "--epochs=3"])
    config = from_flags(training.RunConfig, flag_values)
    absl_lines = sorted(flag.serialize() for flag in flag_values.flags_by_module_dict()[
        config_flags.__name__] if flag.value is not None)
    assert sorted(config_flags.flag_lines(config)) == absl_lines


APPS = ["finetune", "train", "pretrain", "evaluate", "predict", "export", "fewshot", "visualize",
        "convert", "build_hybrid"]


def _help_xml(app):
    # The flags are the same on every backend; TensorFlow's start is the cheapest (on JAX and
    # torch the apps import TensorFlow for tf.data too).
    result = subprocess.run([sys.executable, os.path.join("apps", f"{app}.py"), "--helpxml"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
                                 "KERAS_BACKEND": "tensorflow"})
    assert "<AllFlags>" in result.stdout, result.stderr[-3000:]
    return ElementTree.fromstring(result.stdout[result.stdout.index("<?xml"):])


@pytest.mark.slow  # starts every app
@pytest.mark.backend_independent
@pytest.mark.parametrize("app", APPS)
def test_every_numeric_flag_of_every_app_has_a_range(app):
    found = {}
    for flag in _help_xml(app).iter("flag"):
        if flag.findtext("type") in ("int", "float") and not flag.findtext("file").startswith(
                ("absl", "tensorflow", "jax", "keras")):
            found[flag.findtext("name")] = (flag.findtext("lower_bound"),
                                            flag.findtext("upper_bound"))
    assert found, f"{app} has no numeric flags?"
    unbounded = sorted(name for name, bounds in found.items() if bounds == (None, None))
    assert not unbounded, f"{app}: numeric flags without a range: {unbounded}"
