"""A user's mistake ends an app with one line, `ERROR: ...`, and status 2: no traceback and no
`--help` text. Tracebacks are for bugs."""

import concurrent.futures
import os
import re
import zipfile

import pytest

import vit_keras

from conftest import TINY_CONFIG, run_app

# The apps' own checks of their command line and inputs, made before any backend computes
# anything: the same on every backend, so one pass runs them: the TensorFlow pass, where an app
# starts fastest (it imports no other framework than TensorFlow: 6 s of CPU against torch's 11).
pytestmark = pytest.mark.backend_independent("tensorflow")


def _assert_one_line_error(result, *expected):
    """Exit status 2, one `ERROR: ...` line last on stderr holding `expected`, no traceback and no
    flag help (TensorFlow's and JAX's own start-up logs may come before the line)."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-4000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in output and lines[-1].startswith("ERROR: "), output[-4000:]
    assert [line for line in lines if "ERROR" in line] == lines[-1:], result.stderr
    for text in expected:
        assert text in lines[-1], lines[-1]
    # absl's --help lists each flag as "  --name: help"; none of it belongs in an error.
    assert not re.search(r"^\s+--\w+: ", output, re.M), output[-4000:]
    assert "USAGE" not in output


# Each case: the app, its arguments, and what its one line must say. The apps start in parallel
# (two at a time): each is a fresh process whose start-up dominates.
CASES = {
    "finetune_missing_folder": (
        "finetune.py", ["--dataset=folder:{tmp}/no_such_folder", "--output_dir={tmp}/runs"],
        ["no_such_folder", "does not exist", "one sub-folder per class"]),
    "evaluate_missing_folder": (
        "evaluate.py", ["--model={tmp}/three_classes.keras", "--dataset=folder:{tmp}/no_such_folder"],
        ["no_such_folder", "does not exist"]),
    "finetune_image_size_not_divisible": (
        "finetune.py", ["--model=ViT-Ti/16", "--image_size=30", "--epochs=1",
                        "--output_dir={tmp}/runs"],
        ["30 is not divisible by patch size 16", "multiple of 16"]),
    "visualize_out_of_an_earlier_run": (
        "visualize.py", ["--model=ViT-Ti/16", "--image_size=32", "--out={tmp}/earlier_figures"],
        ["--out", "earlier_figures holds analysis.json of an earlier run", "pass --overwrite"]),
    "visualize_image_size_not_divisible": (
        "visualize.py", ["--model=ViT-Ti/16", "--image_size=30", "--out={tmp}/figures"],
        ["30 is not divisible by patch size 16"]),
    "pretrain_image_size_not_divisible": (
        "pretrain.py", ["--model=ViT-Ti/16", "--image_size=30", "--epochs=1",
                        "--output_dir={tmp}/runs"],
        ["30 is not divisible by patch size 16"]),
    "evaluate_model_of_other_classes": (
        "evaluate.py", ["--model={tmp}/three_classes.keras"],
        ["three_classes.keras predicts 3 classes but digits has 10",
         "evaluate on the dataset the model was trained for"]),
    # A report of an earlier run is not replaced: refused before the data and model load.
    "evaluate_json_of_an_earlier_run": (
        "evaluate.py", ["--model={tmp}/three_classes.keras", "--json={tmp}/earlier_report.json",
                        "--dataset=folder:{tmp}/no_such_folder"],
        ["earlier_report.json exists already: pass --overwrite to replace it"]),
    "predict_json_a_folder": (
        "predict.py", ["--model={tmp}/no_such_run/model.keras", "--json={tmp}/earlier_figures",
                       "{tmp}/image.png"],
        ["--json", "earlier_figures is a folder; give the path of a file"]),
    "fewshot_missing_folder": (
        "fewshot.py", ["--model={tmp}/three_classes.keras", "--dataset=folder:{tmp}/no_such_folder"],
        ["no_such_folder", "does not exist"]),
    "build_hybrid_unknown_variant": (
        "build_hybrid.py", ["--model=R50+ViT-X/16", "--out={tmp}/hybrid.keras"],
        ["--model 'R50+ViT-X/16' is not a hybrid", "R50+ViT-B/16"]),
    "convert_missing_checkpoint": (
        "convert.py", ["--weights={tmp}/weights.npz", "--out={tmp}/c.keras"],
        ["weights.npz", "No checkpoint at"]),
    "finetune_unknown_variant": (
        "finetune.py", ["--model=ViT-X/16", "--epochs=1", "--output_dir={tmp}/runs"],
        ["Unknown variant 'ViT-X/16'", "ViT-B/16"]),
    "predict_unknown_variant": (
        "predict.py", ["--model=ViT-X/16", "--weights={tmp}/weights.npz", "{tmp}/image.png"],
        ["--model ViT-X/16", "Unknown variant 'ViT-X/16'"]),
    # A release name is checked before anything loads: the missing folder would fail later.
    "finetune_release_without_model": (
        "finetune.py", ["--weights=augreg_in21k", "--dataset=folder:{tmp}/no_such_folder",
                        "--output_dir={tmp}/runs"],
        ["'augreg_in21k' is a release name", "(--model ViT-B/16, for example)"]),
    "finetune_release_the_model_lacks": (
        "finetune.py", ["--model=ViT-Ti/16", "--weights=imagenet21k",
                        "--dataset=folder:{tmp}/no_such_folder", "--output_dir={tmp}/runs"],
        ["ViT-Ti/16 has no release 'imagenet21k'; its releases are: augreg_in21k, "]),
    "convert_release_without_model": (
        "convert.py", ["--weights=augreg_in21k_ft_in1k", "--out={tmp}/release.keras"],
        ["'augreg_in21k_ft_in1k' is a release name", "(--model ViT-B/16, for example)"]),
    # --model of the apps that read a .keras file, each refusing one kind of file (every kind is
    # tested in-process: tests/test_app_common.py).
    "predict_missing_model": (
        "predict.py", ["--model={tmp}/no_such_run/model.keras", "{tmp}/image.png"],
        ["--model", "no_such_run/model.keras: no such file"]),
    "evaluate_not_keras_model": (
        "evaluate.py", ["--model={tmp}/damaged.keras"],
        ["--model", "damaged.keras is not a Keras model file", "damaged"]),
    "fewshot_not_keras_model": (  # a Keras archive of a layer no library registers
        "fewshot.py", ["--model={tmp}/unknown_layer.keras"],
        ["--model", "unknown_layer.keras could not be loaded as a Keras model",
         "Could not locate class 'NoSuchLayer'"]),
    # --weights of a .keras file holding another architecture than --model names: refused before
    # the data loads (the missing folder would fail later), as a checkpoint file's is.
    "finetune_keras_weights_of_another_variant": (
        "finetune.py", ["--weights={tmp}/three_classes.keras", "--model=ViT-B/16",
                        "--dataset=folder:{tmp}/no_such_folder", "--output_dir={tmp}/runs"],
        ["three_classes.keras does not hold a ViT-B/16", "hidden_size 32 (--model ViT-B/16: 768)",
         "Leave --model out"]),
}


@pytest.fixture(scope="module")
def cases_folder(tmp_path_factory):
    """The folder `results` runs the apps in: their inputs and outputs."""
    return str(tmp_path_factory.mktemp("app_errors"))


@pytest.fixture(scope="module")
def results(cases_folder):
    tmp = cases_folder
    vit_keras.build_model(TINY_CONFIG, image_size=16, num_classes=3).save(
        os.path.join(tmp, "three_classes.keras"))
    for name, text in (("damaged.keras", "not a zip archive"),):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    os.makedirs(os.path.join(tmp, "earlier_figures"))
    with open(os.path.join(tmp, "earlier_report.json"), "w") as f:
        f.write("{}\n")
    with open(os.path.join(tmp, "earlier_figures", "analysis.json"), "w") as f:
        f.write("{}\n")
    with zipfile.ZipFile(os.path.join(tmp, "unknown_layer.keras"), "w") as archive:
        archive.writestr("config.json", '{"class_name": "NoSuchLayer", "config": {}}')

    def run(case):
        app, args, _ = CASES[case]
        return run_app(app, *[arg.format(tmp=tmp) for arg in args], timeout=300)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(CASES, pool.map(run, CASES)))


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if "_missing_" in case])
def test_a_missing_folder_or_file_is_a_one_line_error(results, case):
    _assert_one_line_error(results[case], *CASES[case][2])


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if "not_divisible" in case])
def test_an_image_size_the_patch_size_does_not_divide_is_a_one_line_error(results, case):
    _assert_one_line_error(results[case], *CASES[case][2])


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if "unknown_variant" in case])
def test_an_unknown_variant_is_a_one_line_error_without_the_help_text(results, case):
    _assert_one_line_error(results[case], *CASES[case][2])


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if "_release_" in case])
def test_a_release_without_its_variant_is_a_one_line_error_before_the_data_loads(results, case):
    _assert_one_line_error(results[case], *CASES[case][2])


@pytest.mark.slow
def test_a_model_of_other_classes_than_the_dataset_is_a_one_line_error(results):
    case = "evaluate_model_of_other_classes"
    _assert_one_line_error(results[case], *CASES[case][2])


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if "_not_keras_" in case])
def test_a_model_that_is_not_a_keras_file_is_a_one_line_error(results, case):
    _assert_one_line_error(results[case], *CASES[case][2])


@pytest.mark.slow
def test_keras_weights_of_another_architecture_than_model_is_a_one_line_error(results):
    case = "finetune_keras_weights_of_another_variant"
    _assert_one_line_error(results[case], *CASES[case][2])


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if "_json_" in case])
def test_a_json_report_is_checked_before_any_work(results, cases_folder, case):
    _assert_one_line_error(results[case], *CASES[case][2])
    with open(os.path.join(cases_folder, "earlier_report.json")) as f:
        assert f.read() == "{}\n"


@pytest.mark.slow
def test_figures_of_an_earlier_run_are_not_replaced_without_overwrite(results, cases_folder):
    case = "visualize_out_of_an_earlier_run"
    _assert_one_line_error(results[case], *CASES[case][2])
    figures = os.path.join(cases_folder, "earlier_figures")
    assert os.listdir(figures) == ["analysis.json"]
    with open(os.path.join(figures, "analysis.json")) as f:
        assert f.read() == "{}\n"


# --- careless flags (vit_keras issue 41, items 1, 3, 5 and 10) ----------------------------------

# Each case: the app, its arguments, and what its one line must say. Every app refuses a number
# outside its flag's range while absl parses the command line, before any work. One case per app
# shows its command line ends that way; which values each flag refuses is tested in-process
# (`tests/test_config_flags.py`'s CARELESS), as are the run name's and NaFlex's refusals
# (`tests/test_training.py`), each an app start fewer.
RUNS = "--output_dir={tmp}/runs"  # where a training app would begin a run folder
CARELESS_CASES = {
    "finetune_epochs_negative": ("finetune.py", [RUNS, "--epochs=-1"],
                                 ["--epochs=-1", "an integer >= 1"]),
    "train_learning_rate_negative": ("train.py", [RUNS, "--learning_rate=-1"],
                                     ["--learning_rate=-1", "a number > 0"]),
    "pretrain_corruption_rate_zero": ("pretrain.py", [RUNS, "--corruption_rate=0"],
                                      ["--corruption_rate=0", "(0, 1]"]),
    "evaluate_batch_size_zero": ("evaluate.py", ["--model={tmp}/model.keras", "--batch_size=0"],
                                 ["--batch_size=0"]),
    "predict_top_k_zero": ("predict.py", ["--model={tmp}/model.keras", "--top_k=0", "x.png"],
                           ["--top_k=0"]),
    "export_top_k_zero": ("export.py", ["--model={tmp}/model.keras", "--format=onnx",
                                        "--out={tmp}/exports", "--top_k=0"], ["--top_k=0"]),
    "fewshot_seeds_zero": ("fewshot.py", ["--model={tmp}/model.keras", "--seeds=0"],
                           ["--seeds=0"]),
    "visualize_num_components_zero": ("visualize.py", ["--model=ViT-Ti/16", "--out={tmp}/figures",
                                                       "--num_components=0"],
                                      ["--num_components=0"]),
    "convert_num_classes_zero": ("convert.py", ["--weights={tmp}/weights.npz",
                                                "--out={tmp}/c.keras", "--num_classes=0"],
                                 ["--num_classes=0"]),
    "build_hybrid_num_classes_negative": ("build_hybrid.py", ["--out={tmp}/h.keras",
                                                              "--num_classes=-1"],
                                          ["--num_classes=-1"]),
    "finetune_run_name_parent": ("finetune.py", ["--output_dir={tmp}/parent/out", "--run_name=..",
                                                 "--overwrite"],
                                 ["--run_name '..' is not a folder name"]),
    "finetune_flagfile_loop": ("finetune.py", [RUNS, "--flagfile={tmp}/a.txt"],
                               ["a.txt includes itself", "b.txt"]),
    "convert_out_dangling_link": ("convert.py", ["--weights={tmp}/weights.npz",
                                                 "--out={tmp}/dangling.keras"],
                                  ["--out", "dangling.keras is a symbolic link"]),
    "build_hybrid_out_under_dangling_link": ("build_hybrid.py", ["--model=R+ViT-Ti/16",
                                                                 "--out={tmp}/gone/h.keras"],
                                             ["gone is not a folder (a symbolic link to nothing)"]),
}


@pytest.fixture(scope="module")
def careless_results(tmp_path_factory):
    """`{case: (CompletedProcess, tmp)}` of `CARELESS_CASES`, each in its own folder with an
    unrelated file beside the --output_dir, two flag files that include each other and links
    to nothing."""
    def run(case):
        tmp = str(tmp_path_factory.mktemp(case))
        os.makedirs(os.path.join(tmp, "parent", "out"))
        with open(os.path.join(tmp, "parent", "unrelated.txt"), "w") as f:
            f.write("keep me")
        with open(os.path.join(tmp, "a.txt"), "w") as f:
            f.write(f"--epochs=1\n--flagfile={tmp}/b.txt\n")
        with open(os.path.join(tmp, "b.txt"), "w") as f:
            f.write(f"--flagfile={tmp}/a.txt\n")
        os.symlink(os.path.join(tmp, "nowhere", "x.keras"), os.path.join(tmp, "dangling.keras"))
        os.symlink(os.path.join(tmp, "nowhere"), os.path.join(tmp, "gone"))
        app, args, _ = CARELESS_CASES[case]
        before = sorted(os.listdir(tmp))
        result = run_app(app, *[arg.format(tmp=tmp) for arg in args], timeout=300)
        return result, tmp, before

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(CARELESS_CASES, pool.map(run, CARELESS_CASES)))


@pytest.mark.slow
@pytest.mark.parametrize("case", CARELESS_CASES)
def test_a_careless_flag_is_a_one_line_error_before_any_work(careless_results, case):
    result, tmp, before = careless_results[case]
    _assert_one_line_error(result, *CARELESS_CASES[case][2])
    assert sorted(os.listdir(tmp)) == before  # no run folder, export or figure begun
    assert os.listdir(os.path.join(tmp, "parent", "out")) == []
    with open(os.path.join(tmp, "parent", "unrelated.txt")) as f:
        assert f.read() == "keep me"
