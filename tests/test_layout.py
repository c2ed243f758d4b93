"""The package's import graph: no circles, the core never reaches the application half, the model
path needs no TensorFlow, JAX or torch. Read from the source (every import statement, including
those inside functions), so an import hidden in a function to get round a circle counts too."""

import ast
import inspect
import os
import re

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.backend_independent

PACKAGE = os.path.join(REPO_ROOT, "vit_keras")


def _module_name(path):
    relative = os.path.relpath(path, REPO_ROOT)[:-len(".py")].replace(os.sep, ".")
    return relative[:-len(".__init__")] if relative.endswith(".__init__") else relative


def _modules():
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                found[_module_name(path)] = path
    return found


MODULES = _modules()


def _imports(name):
    """Every module `name` imports, as absolute dotted names (relative imports resolved)."""
    with open(MODULES[name]) as f:
        tree = ast.parse(f.read())
    package = name if MODULES[name].endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            # `from vit_keras import layers` imports the module vit_keras.layers.
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" in MODULES)
    return found


def _package_graph():
    return {name: {i for i in _imports(name) if i in MODULES and i != name} for name in MODULES}


def _parents(name):
    """`vit_keras.checkpoints.npz` → `vit_keras.checkpoints`, `vit_keras`: imported on the way."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_the_package_import_graph_has_no_circle():
    # A package's __init__ importing its own modules is how Python packages work; a circle is a
    # module that, through its imports, needs itself (parents' __init__ files left out).
    graph = {name: targets - _parents(name) for name, targets in _package_graph().items()}
    visiting, done, circles = [], set(), []

    def visit(name):
        if name in done:
            return
        if name in visiting:
            circles.append(visiting[visiting.index(name):] + [name])
            return
        visiting.append(name)
        for target in sorted(graph[name]):
            if not target.endswith("__init__"):
                visit(target)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_core_never_imports_the_application_half():
    core = [name for name in MODULES if not name.startswith("vit_keras.tools")]
    offenders = {name: sorted(i for i in _imports(name) if i.startswith("vit_keras.tools"))
                 for name in core}
    assert not {name: found for name, found in offenders.items() if found}


# The per-device kernels (attention, backend_ops, xla_cpu) and JAX's predict_on_batch and
# train_on_batch (jax_predict, jax_train) import JAX or torch inside the functions that run on
# them, and JAX's LayerNorm (jax_layer_norm) is JAX through and through, imported by backend_ops
# only on JAX; the rest of the model imports no framework at all.
@pytest.mark.parametrize("module", sorted(
    name for name in MODULES if name.startswith("vit_keras.model") and name.rpartition(".")[2]
    not in ("attention", "backend_ops", "xla_cpu", "jax_predict", "jax_train", "jax_layer_norm")) + [
        "vit_keras.weights.posemb", "vit_keras.inspection.analysis"])
def test_the_model_path_imports_no_framework_but_keras(module):
    frameworks = {"tensorflow", "torch", "jax"}
    # (JAX-only code lives in vit_keras.xla_cpu, which imports JAX inside the functions that
    # need it; TensorFlow and torch formats import theirs inside the readers.)
    found = {i.split(".")[0] for i in _imports(module)} & frameworks
    assert not found, f"{module} imports {sorted(found)}"


def test_host_memory_imports_only_the_standard_library():
    """The apps load vit_keras/host_memory.py by path before NumPy starts its threads."""
    assert {i.split(".")[0] for i in _imports("vit_keras.host_memory")} <= {"ctypes", "sys"}


def test_atomic_files_imports_only_the_standard_library():
    """Every layer writes through it (the model's checkpoints, the tools, the apps)."""
    assert {i.split(".")[0] for i in _imports("vit_keras.atomic_files")} <= {"contextlib", "os"}


def test_the_builder_and_the_checkpoint_loader_do_not_import_each_other():
    checkpoints = [name for name in MODULES if name.startswith("vit_keras.weights.checkpoints")]
    for name in checkpoints:
        # The variant table and the arithmetic (vit_keras.model.configs, .geometry) are data;
        # the builder (vit.py, whose ViT the package exports) is not for the loader.
        assert not _imports(name) & {"vit_keras.model.vit", "vit_keras.weights.pretrained"}, name
        with open(MODULES[name]) as f:
            assert not re.search(r"from vit_keras\.model import .*\bViT\b|"
                                 r"^\s*import vit_keras\.model\b", f.read(), re.M), name
    model = [name for name in MODULES if name.startswith("vit_keras.model")]
    for name in model:
        assert not {i for i in _imports(name) if i.startswith("vit_keras.weights")}, name


def test_nothing_in_the_package_imports_apps_or_benchmarks():
    for name in MODULES:
        assert not {i for i in _imports(name) if i.split(".")[0] in ("apps", "benchmarks")}, name


def test_build_model_passes_on_exactly_the_vit_arguments():
    # One list of the architecture's arguments: ViT's signature. build_model names weights and
    # the three a release decides, and passes the rest on (checked against ViT.ARGUMENTS).
    import vit_keras

    signature = inspect.signature(vit_keras.ViT.__init__).parameters
    keywords = [name for name, p in signature.items() if p.kind is p.KEYWORD_ONLY]
    assert list(vit_keras.ViT.ARGUMENTS) == keywords
    facade = inspect.signature(vit_keras.build_model).parameters
    assert set(facade) - {"variant", "weights", "arguments"} <= set(keywords)
    with pytest.raises(TypeError, match="unknown arguments \\['dropuot'\\]"):
        vit_keras.build_model("ViT-Ti/16", dropuot=0.1)


# The names `ViT` gives its layers. Only the model (and the checkpoint name tables, whose keys
# are these names) may spell them: everything else asks the model for its parts.
_LAYER_NAMES = {"embedding", "posembed_input", "encoder_norm", "fc_norm", "pre_norm", "head",
                "head_dist", "pre_logits", "rescale", "resnet", "cls", "dist", "reg", "pooling",
                "pooling_dist", "MAPHead_0", "distilled_average", "patch_tokens"}
_MAY_NAME_LAYERS = ("vit_keras.model.", "vit_keras.weights.checkpoints.")


# A path through an encoder block's layers (`.*MlpBlock_3/Dense_0/kernel`): the model answers its
# own layouts (`ViT.model_parallel_layout`), LoRA targets and layer groups instead.
_BLOCK_PATH = re.compile(r"(?:MultiHeadDotProductAttention|MlpBlock|LayerNorm|LayerScale)_\d/")


def _docstrings(tree):
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def _layer_lookups(path):
    """`(line, what)` of every `get_layer` call, comparison with a layer name (`layer.name ==
    "head"`, `"rescale" in names`), `encoderblock_` regular expression and path through a block's
    layers (outside docstrings) in a source file."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = []
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "get_layer":
            found.append((node.lineno, "get_layer"))
        elif isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Constant) and side.value in _LAYER_NAMES:
                    found.append((node.lineno, repr(side.value)))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and "encoderblock_" in node.value and "\\d" in node.value):
            found.append((node.lineno, repr(node.value)))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and _BLOCK_PATH.search(node.value)):
            found.append((node.lineno, repr(node.value)))
    return found


def test_no_module_outside_the_model_finds_a_layer_by_name():
    paths = {name: path for name, path in MODULES.items() if not name.startswith(_MAY_NAME_LAYERS)}
    apps = os.path.join(REPO_ROOT, "apps")
    paths.update({f"apps.{file[:-3]}": os.path.join(apps, file) for file in os.listdir(apps)
                  if file.endswith(".py")})
    offenders = {name: lookups for name, path in sorted(paths.items())
                 if (lookups := _layer_lookups(path))}
    assert not offenders, f"layer lookups by name outside vit_keras.model: {offenders}"


def test_the_layout_check_sees_a_lookup_by_name(tmp_path):
    offender = tmp_path / "offender.py"
    offender.write_text('head = model.get_layer("head")\npattern = r"^encoderblock_(\\d+)$"\n'
                        'norms = [layer for layer in model.layers if layer.name == "fc_norm"]\n'
                        'dense = keras.layers.Dense(4, name="head")  # naming a new layer is fine\n'
                        'rules = {f".*MlpBlock_3/{name}/kernel": 1 for name in names}\n')
    assert sorted(_layer_lookups(str(offender))) == [
        (1, "get_layer"), (2, repr(r"^encoderblock_(\d+)$")), (3, "'fc_norm'"),
        (5, repr(".*MlpBlock_3/"))]


def _fit_calls(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "fit"]


def test_the_training_apps_share_one_training_loop():
    """Every objective (classification, masked patch prediction) trains through
    `vit_keras.tools.runs.training.run`: no other module of the application half, and no app,
    calls `fit` (a few-shot probe in the core, `vit_keras.fewshot`, is not a training run)."""
    apps = os.path.join(REPO_ROOT, "apps")
    paths = [path for name, path in MODULES.items() if name.startswith("vit_keras.tools")]
    paths += [os.path.join(apps, file) for file in os.listdir(apps) if file.endswith(".py")]
    callers = {os.path.relpath(path, REPO_ROOT) for path in paths if _fit_calls(path)}
    assert callers == {os.path.join("vit_keras", "tools", "runs", "training.py")}


# The application half's concerns (`vit_keras/tools/`: a sub-package or a module each) and the
# others each may import: a run uses the distribution, the data, fine-tuning and the figures; an
# export reads a run folder, and a NaFlex export cuts images into patches as the data does.
# Nothing below a run imports it, and no concern imports its user.
_TOOLS_CONCERNS = {
    "runs": {"distributed", "data", "finetuning", "plots"},
    "export": {"runs", "data"},
    "distributed": set(),
    "data": set(),
    "finetuning": set(),
    "plots": set(),
}


def _tools_concern(name):
    """`vit_keras.tools.runs.training` → `runs`; `vit_keras.tools.data` → `data`; the package's
    own `__init__` → None."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["vit_keras", "tools"] else None


def test_each_tools_module_belongs_to_a_concern():
    concerns = {_tools_concern(name) for name in MODULES} - {None}
    assert concerns == set(_TOOLS_CONCERNS)


def test_the_tools_concerns_import_one_way():
    """`runs` may use `distributed`, `data`, `finetuning` and `plots`; `export` may read `runs`
    and `data`; nothing else in `vit_keras/tools/` imports across concerns (imports inside
    functions count)."""
    found = {}
    for name in MODULES:
        concern = _tools_concern(name)
        if concern is None:
            continue
        crossed = {_tools_concern(i) for i in _imports(name) if i.startswith("vit_keras.tools.")}
        crossed -= {concern, None}
        if crossed - _TOOLS_CONCERNS[concern]:
            found[name] = sorted(crossed - _TOOLS_CONCERNS[concern])
    assert not found, f"imports across the application half's concerns: {found}"


def test_the_tools_concerns_allow_no_circle():
    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n)))
                   for n in _TOOLS_CONCERNS[start])

    assert not [concern for concern in _TOOLS_CONCERNS if reaches(concern, concern)]


def _old_paths_used(source):
    """The old module paths (`vit_keras._moved.MOVED`) a source file imports or reads as
    `vit_keras.<old>` attributes."""
    from vit_keras import _moved  # pylint: disable=import-outside-toplevel

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in _moved.MOVED)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in _moved.MOVED)
            found.update({node.module} & set(_moved.MOVED))
        elif isinstance(node, ast.Attribute) and _dotted(node) in _moved.MOVED:
            found.add(_dotted(node))  # `vit_keras.releases`, `vit_keras.tools.training`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a monkeypatch target or a module a subprocess runs: "vit_keras.tools.training.run"
            found.update(old for old in _moved.MOVED
                         if re.fullmatch(rf"{re.escape(old)}(\.\w+)*", node.value))
    return found


def _dotted(node):
    """`vit_keras.tools.training` for the attribute chain that spells it, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def test_the_library_apps_benchmarks_and_tests_use_no_old_module_path():
    """Old paths are for users' code, until they go (`vit_keras._moved.REMOVAL`)."""
    used = {}
    for folder in ("vit_keras", "apps", "benchmarks", "tests"):
        for root, _, files in os.walk(os.path.join(REPO_ROOT, folder)):
            for file in files:
                # (the old paths' own module and the tests that name them as examples aside)
                if file.endswith(".py") and file not in (
                        "test_public_api.py", "_moved.py", "test_layout.py"):
                    with open(os.path.join(root, file)) as f:
                        found = _old_paths_used(f.read())
                    if found:
                        used[os.path.relpath(os.path.join(root, file), REPO_ROOT)] = found
    assert not used
    assert _old_paths_used("import vit_keras.layers\nfrom vit_keras.checkpoints import timm\n"
                           "vit_keras.releases.find_release('x')\n") == {
        "vit_keras.layers", "vit_keras.checkpoints", "vit_keras.checkpoints.timm",
        "vit_keras.releases"}
    assert _old_paths_used("from vit_keras.tools import data, training\n"
                           "import vit_keras.tools.sharding\nvit_keras.tools.memory.check(m)\n"
                           "patch('vit_keras.tools.recipes.RECIPES', {})\n") == {
        "vit_keras.tools.training", "vit_keras.tools.sharding", "vit_keras.tools.memory",
        "vit_keras.tools.recipes"}
