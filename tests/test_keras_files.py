"""A user's `.keras` file is checked before Keras builds anything from it: a small file that claims
gigabytes (a `config.json` that inflates, a layer size no model has, more weights than the file
stores) or that nests too deep is refused with one error naming it, and the apps that load a
user's model say so in one line. Saved models of every kind vit_keras builds pass.

The checks that read the zip archive and its JSON alone give the same answer on every backend,
so one pass runs them (`zip_only`); those that reach Keras's own sizing of the layers, built
unallocated on the pass's backend, run on every backend."""

import gc
import json
import math
import os
import zipfile

import keras
import numpy as np
import pytest

import vit_keras
from vit_keras.weights import keras_files

from conftest import TINY_CONFIG, run_app

zip_only = pytest.mark.backend_independent


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny ViT saved as `.keras` (its members stored, as Keras writes them)."""
    path = tmp_path_factory.mktemp("saved") / "tiny.keras"
    vit_keras.build_model(TINY_CONFIG, image_size=16, num_classes=3).save(path)
    return str(path)


def _rewritten(saved, out, config=None, config_member=None):
    """A copy of the archive `saved` at `out` whose config.json is `config(original dict)` (a dict
    or JSON text, stored) or, with `config_member(archive, original dict)`, written by that
    function."""
    with zipfile.ZipFile(saved) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            if info.filename != "config.json":
                target.writestr(info, source.read(info))
            elif config_member is not None:
                config_member(target, json.loads(source.read(info)))
            else:
                text = config(json.loads(source.read(info)))
                target.writestr(info, text if isinstance(text, str) else json.dumps(text))
    return str(out)


def _with_field(config, class_name, field, value):
    """A functional model's config (an earlier vit_keras's) with `field` of each `class_name`
    layer set to `value`."""
    for layer in config["config"]["layers"]:
        if layer["class_name"] == class_name:
            layer["config"][field] = value
    return config


def _with_variant_field(config, field, value):
    """A `vit_keras.ViT`'s config with its variant's `field` set to `value`."""
    config["config"]["variant"][field] = value
    return config


def _inflating_config(target, config):
    """A config.json of 256 MiB of spaces then the model's JSON (valid JSON, which Keras would
    read whole), deflated to about 250 kB."""
    info = zipfile.ZipInfo("config.json")
    info.compress_type = zipfile.ZIP_DEFLATED
    with target.open(info, "w", force_zip64=True) as member:
        spaces = b" " * (1 << 20)
        for _ in range(256):
            member.write(spaces)
        member.write(json.dumps(config).encode())


def _deep(config, depth=5000):
    """The config as JSON text, with a list nested `depth` deep in its first layer's config."""
    config["config"]["variant"]["nested"] = "DEEP"
    return json.dumps(config).replace('"DEEP"', "[" * depth + "]" * depth)


def test_a_saved_model_passes(tmp_path, saved):
    keras_files.check_keras_file(saved)
    keras_files.check_keras_file(tmp_path / "not_a_zip.h5")  # nothing there: Keras's to report


@zip_only  # each backend's unallocated build is test_a_saved_model_passes's
@pytest.mark.slow  # a 6 M-parameter model built and saved, and a quantized one
def test_saved_hybrid_and_int8_models_pass(tmp_path):
    hybrid = tmp_path / "hybrid.keras"
    vit_keras.build_model("R+ViT-Ti/16", image_size=64, num_classes=5).save(hybrid)
    keras_files.check_keras_file(hybrid)
    quantized = vit_keras.build_model(TINY_CONFIG, image_size=16, num_classes=3,
                                      classifier="map")
    quantized.quantize("int8")  # int8 kernels: a byte a weight
    quantized.save(tmp_path / "int8.keras")
    keras_files.check_keras_file(tmp_path / "int8.keras")


@zip_only
def test_a_config_json_that_inflates_to_hundreds_of_megabytes_is_refused_unread(tmp_path, saved):
    path = _rewritten(saved, tmp_path / "bomb.keras", config_member=_inflating_config)
    assert os.path.getsize(path) < 2 << 20
    with pytest.raises(keras_files.KerasFileError,
                       match=r"config.json expands from \d+ bytes to 268\d+ .*decompression bomb"):
        vit_keras.check_keras_file(path)


@zip_only
@pytest.mark.parametrize("field,value,limit", [("mlp_dim", 20_000_000, "16777216"),
                                               ("num_layers", 20_000, "1024 blocks")])
def test_a_layer_size_no_model_has_is_refused_before_building(tmp_path, saved, field, value,
                                                              limit):
    """20,000 blocks of width 1 claim few weights, but building them took 5 GB and 4 minutes."""
    path = _rewritten(saved, tmp_path / "wide.keras",
                      lambda c: _with_variant_field(c, field, value))
    with pytest.raises(keras_files.KerasFileError,
                       match=rf"layer '\w+' \(ViT\) has {field} {value}, beyond the {limit}"):
        vit_keras.check_keras_file(path)


@zip_only
def test_a_layer_size_of_a_functional_file_of_an_earlier_version_is_refused(tmp_path):
    legacy = os.path.join(os.path.dirname(__file__), "data", "legacy_vit.keras")
    path = _rewritten(legacy, tmp_path / "wide.keras",
                      lambda c: _with_field(c, "TransformerBlock", "mlp_dim", 20_000_000))
    with pytest.raises(keras_files.KerasFileError,
                       match=r"layer 'encoderblock_0' \(TransformerBlock\) has mlp_dim 20000000, "
                             r"beyond the 16777216"):
        vit_keras.check_keras_file(path)


@zip_only
def test_a_model_of_more_weights_than_its_file_stores_is_refused(tmp_path, saved):
    """mlp_dim 2,000,000 is a size some layer could have; a model of 2 such blocks of width 32 has
    256 M weights, which a file of 200 kB cannot hold."""
    path = _rewritten(saved, tmp_path / "claims.keras",
                      lambda c: _with_variant_field(c, "mlp_dim", 2_000_000))
    with pytest.raises(keras_files.KerasFileError,
                       match=r"describes a model of at least 256\d{6} weights .*but its weights "
                             r"file holds at most \d+ bytes"):
        vit_keras.check_keras_file(path)


@pytest.mark.parametrize("layer,field,weights", [("LSTM", "units", 400_160_000),
                                                  ("GRU", "units", 300_150_000)])
def test_a_layer_class_the_check_has_no_rule_for_is_sized_by_keras_without_allocating(
        tmp_path, layer, field, weights):
    """A 17 kB file of one LSTM(10000) passed, and loading it took 4 GB on TensorFlow. Keras
    sizes each layer as it builds it, on this pass's backend, without allocating."""
    small = tmp_path / "small.keras"
    keras.Sequential([keras.Input((None, 3)), getattr(keras.layers, layer)(4)]).save(small)
    path = _rewritten(small, tmp_path / "wide.keras", lambda c: _with_field(c, layer, field, 10_000))
    with pytest.raises(keras_files.KerasFileError,
                       match=rf"describes a model of {weights} weights .*but its weights file "
                             rf"holds at most \d+ bytes"):
        vit_keras.check_keras_file(path)
    # Keras keeps the variables a stateless scope declares, to allocate them when the next scope
    # closes: none of the checked model's may outlive the check.
    gc.collect()
    assert not [v for v in gc.get_objects() if isinstance(v, keras.Variable)
                and math.prod(v.shape) >= 10_000 * 10_000], "a sized variable outlived the check"


@zip_only
@pytest.mark.parametrize("depth", [100, 5000])
def test_a_config_json_nested_too_deep_is_refused(tmp_path, saved, depth):
    path = _rewritten(saved, tmp_path / "deep.keras", lambda c: _deep(c, depth))
    with pytest.raises(keras_files.KerasFileError, match="nests"):
        vit_keras.check_keras_file(path)


@zip_only
def test_a_config_json_number_of_thousands_of_digits_is_refused(tmp_path, saved):
    """Python refuses to read an integer of more than 4,300 digits (a ValueError that escaped as
    a traceback)."""
    path = _rewritten(saved, tmp_path / "digits.keras",
                      lambda c: json.dumps(c).replace('"tiny"', "9" * 5000, 1))
    with pytest.raises(keras_files.KerasFileError, match=r"config.json.* number too large"):
        vit_keras.check_keras_file(path)


@zip_only
@pytest.mark.slow
@pytest.mark.parametrize("case", ["inflating_config", "more_weights_than_stored", "too_deep"])
def test_predict_refuses_a_hostile_keras_file_in_one_line(tmp_path, saved, case):
    """Before the check, the first file passed (Keras read its 256 MiB and predicted), the second
    built 1 GB of weights before failing with a traceback, the third hit Python's recursion
    limit inside Keras."""
    from PIL import Image

    model = {"inflating_config": lambda: _rewritten(saved, tmp_path / "m.keras",
                                                    config_member=_inflating_config),
             "more_weights_than_stored": lambda: _rewritten(
                 saved, tmp_path / "m.keras",
                 lambda c: _with_variant_field(c, "mlp_dim", 2_000_000)),
             "too_deep": lambda: _rewritten(saved, tmp_path / "m.keras", _deep)}[case]()
    image = tmp_path / "image.png"
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(image)
    result = run_app("predict.py", "--model", model, str(image))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ERROR: ") and model in last and "Traceback" not in output, \
        output[-3000:]
    assert {"inflating_config": "decompression bomb", "more_weights_than_stored": "describes a "
            "model of at least", "too_deep": "nests"}[case] in last, last
