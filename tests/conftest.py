"""Shared test fixtures. Each pytest process runs on one backend (KERAS_BACKEND); tests that need
another backend start a subprocess through `run_on_backend`."""

import json
import os
import subprocess
import sys
import textwrap

# The test oracles (torch, timm, transformers) pull in triton when it is installed; importing triton
# after TensorFlow segfaults the process on the TensorFlow backend. No test needs triton (CPU only).
sys.modules.setdefault("triton", None)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKENDS = ("tensorflow", "jax", "torch")
# The backend a pass loads the models it saved on, in the tests of one kind of model (a dynamic
# size, a merged LoRA, a family, an optimizer): a ring, so that over the three passes every backend
# saves and loads each kind, in three fresh processes rather than nine. The plain ViT
# (test_saving.py) and every app's output (test_user_journeys.py) load on all three.
NEXT_BACKEND = BACKENDS[(BACKENDS.index(keras.backend.backend()) + 1) % len(BACKENDS)]


# The environment variables of the compilation caches below.
COMPILATION_CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR",
                               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "TF_XLA_FLAGS")


def _compilation_caches_for_started_processes():
    """Most of an app's run on JAX or TensorFlow is XLA compiling the same few programs (the
    initialisers, the train and test steps of the same tiny ViT) that the previous app run of this
    pass compiled: the persistent compilation caches of JAX and TensorFlow let each compile once
    per pytest process (a JAX app run of the tests: 29 s -> 14 s; TensorFlow: 36 s -> 21 s).
    Set in the environment after this process has imported its backend, so the processes the
    tests start inherit them and JAX in this process keeps none (its thousands of small in-process
    compiles gain nothing); TensorFlow reads its flags at its first compile, so this process
    shares its cache. One folder per pytest process, removed at exit: its processes run one after
    another (JAX writes an entry in place, so two processes writing at once must not share one;
    tests/test_multiprocess.py takes the variables out). No size limit: JAX's limit turns on a
    file lock and an eviction scan at every write. Every program is kept, however short its
    compile: building or loading a model on JAX compiles its initialisers, one small program per
    shape (81 of about 0.05 s for the user journeys' five models), and a later process reads them
    back (the journeys' load of those models 6.9 s -> 3.5 s; a second JAX app run 10.3 s -> 8.9 s
    against keeping only compiles of 0.2 s or more). A test setting: neither the library nor the
    apps configure a cache."""
    import atexit
    import shutil
    import tempfile

    if any(name in os.environ for name in COMPILATION_CACHE_VARIABLES):
        return  # the caller's own settings stand
    folder = tempfile.mkdtemp(prefix="vit_keras-test-compilation-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.makedirs(os.path.join(folder, "tensorflow"))
    os.environ.update({
        "JAX_COMPILATION_CACHE_DIR": os.path.join(folder, "jax"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "TF_XLA_FLAGS": f"--tf_xla_persistent_cache_directory={folder}/tensorflow"})


_compilation_caches_for_started_processes()

# The tests run tiny programs a few times each, so compiling them is most of their time. XLA:CPU
# then compiles faster: its LLVM back end without its optimisation passes (JAX's in-process tests
# -26%, TensorFlow's -13%), and its older elemental emitters instead of the MLIR fusion emitters
# (the NaFlex tests on JAX 91 -> 64 s, a JAX app run without cache 15 -> 12 s, TensorFlow's
# callback and recipe tests 80 -> 70 s). Both compute the same HLO; the apps and the library keep
# XLA's defaults. XLA reads XLA_FLAGS when a backend starts its first computation, after these
# lines; the processes the tests start inherit them. A flag the environment names already keeps
# its value. Both XLAs (JAX's and TensorFlow's) must know each flag: XLA ends the process on an
# unknown one, so a new pin of either that drops a flag fails at once, naming it.
TEST_XLA_FLAGS = {"--xla_backend_optimization_level": "0", "--xla_cpu_use_fusion_emitters": "false"}
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), *(f"{flag}={value}" for flag, value in TEST_XLA_FLAGS.items()
                                        if flag not in os.environ.get("XLA_FLAGS", ""))]).strip()


def xla_cpu_devices(count):
    """XLA_FLAGS for a started process with `count` XLA CPU devices (JAX's data-parallel,
    multi-process and fsdp runs on one CPU), keeping this run's flags above: a device count alone
    would compile those runs with XLA's default settings again (a 4-device JAX app run: 23 s of
    CPU against 17 s with LLVM's optimisations off)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()


def without_compilation_caches(env):
    """`env` without the compilation caches above: for processes that run at the same time."""
    return {name: value for name, value in env.items()
            if name not in COMPILATION_CACHE_VARIABLES}

# Exports run under the TensorFlow backend, whatever trained the model (`apps/export.py` switches to
# it itself): these modules belong to the TensorFlow pytest run, which also exports models trained
# on JAX and torch in subprocesses. They are not collected on the other runs.
collect_ignore = ([] if keras.backend.backend() == "tensorflow"
                  else ["test_export.py", "test_export_app.py"])


# Tests marked `backend_independent` (NumPy-only code, parameter counts of unallocated models, an
# app's checks of its flags and run folder) give the same answer on every backend: in a run over
# all three, only this pass runs them (torch's is the shortest pass), or the pass the marker names:
# `@pytest.mark.backend_independent("jax")` spreads the slow ones (apps in subprocesses) over the
# passes, so that each pass's shards stay about as long as the others'.
BACKEND_INDEPENDENT_PASS = "torch"


def pytest_addoption(parser):
    parser.addoption(
        "--backends", default=None, metavar="NAMES",
        help="the backends of the whole run, one pytest process each, comma- or space-separated "
             "(`make test` passes all three): a test that gives one answer whatever the pass "
             "(jax_subprocess, multiprocess, backend_independent) is collected in its own pass "
             "only. Default: this process's backend alone, which collects every test it can run.")


def _pass_of(item):
    """The backend whose pass runs `item` in a run over several backends; None: every pass."""
    if any(item.get_closest_marker(name) is not None
           for name in ("jax_subprocess", "multiprocess")):
        return "jax"  # they start their own JAX processes whatever this pass's backend
    marker = item.get_closest_marker("backend_independent")
    if marker is not None:
        owner = marker.args[0] if marker.args else BACKEND_INDEPENDENT_PASS
        if owner not in BACKENDS:
            raise pytest.UsageError(f"{item.nodeid}: backend_independent({owner!r}) must name "
                                    f"one of {BACKENDS}")
        return owner
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection, which sees `slow` added here
def pytest_collection_modifyitems(config, items):
    """Tests marked `jax_subprocess` or `multiprocess` start their own processes whatever this
    pass's backend, so they belong to the JAX pass; `backend_independent` tests belong to
    `BACKEND_INDEPENDENT_PASS`, or to the pass their marker names. When that pass is part of the
    run (`--backends`), the other passes deselect them (as with the export modules); when it is
    not (say `make test-fast` on torch), this pass runs them. A `multiprocess` test is `slow`
    too."""
    for item in items:
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.slow)
    backend = keras.backend.backend()
    option = config.getoption("--backends")
    run = set(option.replace(",", " ").split()) if option else {backend}
    unknown = run - set(BACKENDS)
    if unknown or backend not in run:
        raise pytest.UsageError(f"--backends {option!r} must name backends among {BACKENDS}, "
                                f"this pass's {backend!r} included")

    def kept(item):
        owner = _pass_of(item)
        return owner is None or owner == backend or owner not in run

    deselected = [item for item in items if not kept(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if kept(item)]


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A ViT small enough to build, run and save in well under a second on any backend.
TINY_CONFIG = {"name": "tiny", "patch_size": 4, "hidden_size": 32, "mlp_dim": 64, "num_heads": 4,
               "num_layers": 2}


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Each test starts with a clean graph, float32 policy and a fixed seed."""
    keras.config.set_dtype_policy("float32")
    # free_memory=False: its gc.collect() costs about a second per test once torch is imported.
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True, scope="session")
def _quantize_without_a_collection_per_variable():
    """Keras' `Layer.__delattr__` runs a full `gc.collect()` for every variable it deletes (added
    with `quantize` in keras-team/keras#19954, to free device buffers at once), and `quantize`
    deletes each projection's kernel: 13 collections for a 2-block ViT, each over every object
    of a test process that holds three frameworks (about 1.5 s each: 20 s a test). The tests of
    quantized models skip them; what the models compute is the same."""
    import gc
    from unittest import mock

    quantize = keras.Model.quantize

    def quantize_collecting_nothing(self, *args, **kwargs):
        with mock.patch.object(gc, "collect", lambda *_: 0):
            return quantize(self, *args, **kwargs)

    with mock.patch.object(keras.Model, "quantize", quantize_collecting_nothing):
        yield


@pytest.fixture
def tiny_config():
    return dict(TINY_CONFIG)


def tiny_model(tiny_config, num_classes=3, size=8):
    """A built tiny ViT classifier on `size` x `size` images."""
    from vit_keras import build_model

    return build_model(tiny_config, image_size=size, num_classes=num_classes)


def tiny_data(n=8, size=8, num_classes=3, seed=0):
    """`n` random images `(n, size, size, 3)` and one-hot labels `(n, num_classes)`."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 255, (n, size, size, 3)).astype("float32")
    y = np.eye(num_classes, dtype="float32")[rng.integers(0, num_classes, n)]
    return x, y


def random_images(batch, height, width, channels=3, seed=0):
    """Raw pixels in [0, 255], float32."""
    return np.random.default_rng(seed).uniform(0, 255, (batch, height, width, channels)).astype(
        "float32")


def randomize_weights(model, seed=0, scale=0.1):
    """Gives every weight (zero-initialised heads and class tokens too) a random non-trivial value."""
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        weight.assign(rng.normal(0, scale, weight.shape).astype(weight.dtype))
    return model


def run_app(app, *args, timeout=300, kill_after_training=None):
    """Runs `apps/<app>` with `--backend <this pass's backend>` while KERAS_BACKEND names another
    backend: the flag must win over the environment. With `kill_after_training` (the run's
    folder), SIGKILLed once its training has ended (`run_killed_after_training`)."""
    backend = keras.backend.backend()
    other = "jax" if backend != "jax" else "torch"
    env = {**os.environ, "KERAS_BACKEND": other, "TF_CPP_MIN_LOG_LEVEL": "3"}
    command = [sys.executable, os.path.join(REPO_ROOT, "apps", app), *args, "--backend", backend]
    if kill_after_training is not None:
        return run_killed_after_training(command, str(kill_after_training), env, timeout)
    return subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)


def run_killed_after_training(command, run_folder, env, timeout=600):
    """Runs a training app's `command` (a list, from the repository root) and SIGKILLs it from
    outside once its training has ended and before it writes metrics.json: the run folder as a
    kill between training and the end of the run leaves it, for a test of the resumption there.
    Returns the `subprocess.CompletedProcess` (returncode -9).

    The state is made to persist: the run writes metrics.json through `metrics.json.tmp-PID`
    (`run_folder.atomic_write_json`), and a FIFO made at that path as the process starts, which
    nothing reads, holds the run in its opening for good, after the final evaluation, model.keras
    and training_curves.png. The test waits for the curves to be whole (the PNG's last chunk,
    IEND, written), kills the run there, and removes the FIFO, which is no file a run leaves."""
    import signal
    import tempfile
    import time

    os.makedirs(run_folder, exist_ok=True)
    curves = os.path.join(run_folder, "training_curves.png")
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=stdout,
                                   stderr=stderr, text=True)
        fifo = os.path.join(run_folder, f"metrics.json.tmp-{process.pid}")
        os.mkfifo(fifo)  # long before the run gets there: it has not even imported Keras yet
        deadline, reached = time.monotonic() + timeout, False
        try:
            while not reached and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
                if os.path.exists(curves):
                    with open(curves, "rb") as f:
                        reached = f.read().endswith(b"IEND\xaeB`\x82")
            process.send_signal(signal.SIGKILL)  # nothing when it has ended on its own
            process.wait()
        finally:
            os.remove(fifo)
        stdout.seek(0)
        stderr.seek(0)
        result = subprocess.CompletedProcess(command, process.returncode, stdout.read(),
                                             stderr.read())
    if not reached and process.returncode == -signal.SIGKILL:
        raise AssertionError(f"{' '.join(command)} did not finish training in {timeout} s:\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def run_killed_after_first_backup(command, run_dir, env, timeout=300):
    """Starts a training app's `command` (a list, from the repository root) and SIGKILLs it once
    its first epoch's backup is written in `run_dir`. Returns `(output, epoch)`: what it printed
    and the epoch its backup holds."""
    import json
    import signal
    import time

    metadata = os.path.join(run_dir, "backup", "training_metadata.json")
    first = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout
    while not os.path.exists(metadata) and first.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGKILL)
    output = first.communicate()[0]
    assert first.returncode == -signal.SIGKILL, f"the first run ended on its own:\n{output}"
    with open(metadata) as f:
        return output, json.load(f)["epoch"]


def run_on_backend(backend, code, timeout=600, **kwargs):
    """Runs `code` in a fresh Python process on `backend` and returns the JSON it prints last.

    `kwargs` are made available to the code as the dict `ARGS`.
    """
    script = "import json\nARGS = json.loads(%r)\n" % json.dumps(kwargs) + textwrap.dedent(code)
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise AssertionError(f"subprocess on {backend} failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])
