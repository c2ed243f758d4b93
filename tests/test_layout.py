"""The package's import graph: no circles, the core never reaches the application half, the model
path needs no TensorFlow, JAX or torch. Read from the source (every import statement, including
those inside functions), so an import hidden in a function to get round a circle counts too."""

import ast
import inspect
import os

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


@pytest.mark.parametrize("module", ["vit_keras.layers", "vit_keras.configs", "vit_keras.model",
                                    "vit_keras.resnet", "vit_keras.geometry", "vit_keras.posemb",
                                    "vit_keras.interpolation_ops", "vit_keras.analysis"])
def test_the_model_path_imports_no_framework_but_keras(module):
    frameworks = {"tensorflow", "torch", "jax"}
    # (JAX-only code lives in vit_keras.xla_cpu, which imports JAX inside the functions that
    # need it; TensorFlow and torch formats import theirs inside the readers.)
    found = {i.split(".")[0] for i in _imports(module)} & frameworks
    assert not found, f"{module} imports {sorted(found)}"


def test_host_memory_imports_only_the_standard_library():
    """The apps load vit_keras/host_memory.py by path before NumPy starts its threads."""
    assert {i.split(".")[0] for i in _imports("vit_keras.host_memory")} <= {"ctypes", "sys"}


def test_the_builder_and_the_checkpoint_loader_do_not_import_each_other():
    checkpoints = [name for name in MODULES if name.startswith("vit_keras.checkpoints")]
    for name in checkpoints:
        assert not _imports(name) & {"vit_keras.model", "vit_keras.pretrained"}, name
    assert not {i for i in _imports("vit_keras.model") if i.startswith("vit_keras.checkpoints")}


def test_nothing_in_the_package_imports_apps_or_benchmarks():
    for name in MODULES:
        assert not {i for i in _imports(name) if i.split(".")[0] in ("apps", "benchmarks")}, name


def test_build_model_takes_build_vits_arguments_and_weights():
    # vit_keras.build_model (the facade) and model.build_vit (the architecture) list the same
    # arguments with the same defaults, so neither can drift from the other.
    import vit_keras
    from vit_keras import model

    facade = dict(inspect.signature(vit_keras.build_model).parameters)
    assert facade.pop("weights").default is None
    assert facade == dict(inspect.signature(model.build_vit).parameters)


def _fit_calls(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "fit"]


def test_the_training_apps_share_one_training_loop():
    """Every objective (classification, masked patch prediction) trains through
    `vit_keras.tools.training.run`: no other module of the application half, and no app, calls
    `fit` (a few-shot probe in the core, `vit_keras.fewshot`, is not a training run)."""
    apps = os.path.join(REPO_ROOT, "apps")
    paths = [path for name, path in MODULES.items() if name.startswith("vit_keras.tools")]
    paths += [os.path.join(apps, file) for file in os.listdir(apps) if file.endswith(".py")]
    callers = {os.path.relpath(path, REPO_ROOT) for path in paths if _fit_calls(path)}
    assert callers == {os.path.join("vit_keras", "tools", "training.py")}
