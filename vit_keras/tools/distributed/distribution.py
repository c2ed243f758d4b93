"""`--distribution`: data, model and fully sharded data parallelism (Keras' JAX distribution
API, TensorFlow's MirroredStrategy), one `Distribution` per kind (`get`), in one process or, on
JAX, in several cooperating ones (`initialize_processes`).
Imports only Keras at module level; TensorFlow and JAX inside the functions."""

import contextlib
import dataclasses
import os
import sys
import threading

import keras
import numpy as np

from vit_keras import errors
from vit_keras.model import ViT

# The environment variables of `keras.distribution.initialize`; the apps' flags default to them.
ADDRESSES_ENV = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
NUM_PROCESSES_ENV = "KERAS_DISTRIBUTION_NUM_PROCESSES"
PROCESS_ID_ENV = "KERAS_DISTRIBUTION_PROCESS_ID"
# How long a process waits for a dead peer's heartbeat before it stops with an error (JAX's
# own default is 100 s).
DEFAULT_PEER_TIMEOUT = 60


class MultiProcessError(errors.UserError, RuntimeError):
    """Several processes were asked for where they cannot be set up (backend, flags)."""


@dataclasses.dataclass(frozen=True)
class Processes:
    """The processes of a run: `count` of them, this one numbered `index` (0 is the chief, the
    one that writes the run folder)."""

    count: int = 1
    index: int = 0

    @property
    def is_chief(self):
        return self.index == 0

    @property
    def multi(self):
        return self.count > 1


def resolve_processes(coordinator_address=None, num_processes=None, process_id=None,
                      environ=None):
    """`(addresses, num_processes, process_id)` from the flags, else from the environment
    variables `keras.distribution.initialize` reads (`KERAS_DISTRIBUTION_JOB_ADDRESSES`,
    `..._NUM_PROCESSES`, `..._PROCESS_ID`).

    `addresses` is a list of `host:port` (process 0's first, the only one JAX needs; Keras'
    variable may list every process's) or `None`. `num_processes` is 1 when neither says
    otherwise (one process, no set-up) and 0 for "ask the cluster" (JAX's detection of Cloud TPU,
    SLURM and Open MPI).
    Raises `MultiProcessError` when several processes are asked for without an address or an id.
    """
    environ = os.environ if environ is None else environ
    addresses = coordinator_address or environ.get(ADDRESSES_ENV) or None
    if num_processes is None:
        num_processes = int(environ.get(NUM_PROCESSES_ENV) or 1)
    if process_id is None and environ.get(PROCESS_ID_ENV):
        process_id = int(environ[PROCESS_ID_ENV])
    addresses = [a.strip() for a in addresses.split(",") if a.strip()] if addresses else None
    if num_processes < 0:
        raise MultiProcessError(f"--num_processes {num_processes} is negative; use 1 (one "
                                f"process), N > 1, or 0 to let JAX detect the cluster.")
    if num_processes > 1:
        missing = [name for name, value in (("--coordinator_address", addresses),
                                            ("--process_id", process_id)) if value is None]
        if missing:
            raise MultiProcessError(
                f"--num_processes {num_processes} needs {' and '.join(missing)} (or "
                f"{ADDRESSES_ENV} / {PROCESS_ID_ENV}): every process is started with the same "
                f"coordinator address and its own id, 0 to {num_processes - 1}.")
        if not 0 <= process_id < num_processes:
            raise MultiProcessError(f"--process_id {process_id} is outside 0..{num_processes - 1} "
                                    f"(--num_processes {num_processes}).")
        if len(addresses) not in (1, num_processes):
            raise MultiProcessError(
                f"--coordinator_address lists {len(addresses)} addresses for {num_processes} "
                f"processes; give process 0's address, or one per process, process 0's first.")
    return addresses, num_processes, process_id


def initialize_processes(coordinator_address=None, num_processes=None, process_id=None,
                         peer_timeout=DEFAULT_PEER_TIMEOUT):
    """Joins this process to a run of several; call before the backend computes anything.

    - JAX: `jax.distributed.initialize` with process 0's address as coordinator (what
      `keras.distribution.initialize(job_addresses, num_processes, process_id)` calls, which
      does not forward the heartbeat timeout); `num_processes=0` leaves all three to JAX's
      cluster detection (Cloud TPU pod slices, SLURM, Open MPI). Afterwards
      `keras.distribution.list_devices()` lists every process's devices. A process whose
      peers have not all joined within `peer_timeout` seconds ends with one line, `ERROR: ...`,
      and status 2 (JAX's own wait would abort it with a C++ stack trace after 300 s); one
      whose peer stops sending heartbeats for `peer_timeout` seconds aborts with JAX's message
      "The following tasks are unhealthy (stopped sending heartbeats)".
    - TensorFlow: `MultiProcessError` (also for a `TF_CONFIG` of several workers): Keras 3's
      TensorFlow trainer fails under `tf.distribute.MultiWorkerMirroredStrategy`
      (`TENSORFLOW_MULTI_WORKER_ERROR` says where).
    - torch: `MultiProcessError`: Keras has no distribution engine for torch.

    Args:
      coordinator_address: `host:port` of process 0, or every process's comma-separated (the
        flag; default `KERAS_DISTRIBUTION_JOB_ADDRESSES`).
      num_processes: how many processes (default `KERAS_DISTRIBUTION_NUM_PROCESSES`, else 1);
        0 asks JAX's cluster detection.
      process_id: this process's number, 0 to `num_processes - 1` (default
        `KERAS_DISTRIBUTION_PROCESS_ID`).
      peer_timeout: seconds without a peer's heartbeat before the others stop.

    Returns:
      `Processes`: how many there are and which one this is.
    """
    addresses, num_processes, process_id = resolve_processes(coordinator_address, num_processes,
                                                             process_id)
    backend = keras.backend.backend()
    if backend == "tensorflow" and (num_processes != 1 or _tf_config_workers() > 1):
        raise MultiProcessError(TENSORFLOW_MULTI_WORKER_ERROR)
    if num_processes == 1:
        return Processes()
    if backend == "jax":
        import jax

        arguments = {} if num_processes == 0 else {
            "coordinator_address": addresses[0], "num_processes": num_processes,
            "process_id": process_id}
        who = ("the cluster's processes" if num_processes == 0 else
               f"the {num_processes} processes (this is process {process_id}, coordinator "
               f"{addresses[0]})")
        with _exit_unless_done_within(
                peer_timeout,
                f"Not all of {who} joined the run within --peer_timeout {peer_timeout:g} s: start "
                f"every process with the same --coordinator_address and --num_processes and its "
                f"own --process_id, or give them a longer --peer_timeout."):
            # JAX's own deadline comes later: when it passes, it aborts the process.
            jax.distributed.initialize(**arguments, heartbeat_timeout_seconds=int(peer_timeout),
                                       initialization_timeout=int(peer_timeout) + 60)
        return Processes(jax.process_count(), jax.process_index())
    raise MultiProcessError(
        f"Training in several processes is not available on the {backend} backend: Keras "
        f"{keras.__version__} has no distribution engine for torch (keras.distribution is "
        f"implemented for JAX only). Use --backend jax with --num_processes, or write a "
        f"torch.distributed DistributedDataParallel loop launched with torchrun.")


@contextlib.contextmanager
def _exit_unless_done_within(seconds, message):
    """Ends the process with `ERROR: message` on stderr and status 2 unless the block ends within
    `seconds`. For `jax.distributed.initialize`, which blocks in C++ (the GIL released) until
    every process has joined, and on its own deadline aborts the whole process with a C++ stack
    trace: nothing Python can catch."""
    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            sys.stderr.write(f"ERROR: {message}\n")
            sys.stderr.flush()
            os._exit(2)  # pylint: disable=protected-access

    threading.Thread(target=watch, name="vit_keras-join-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()


# Keras 3's TensorFlow trainer cannot fit under MultiWorkerMirroredStrategy (seen with Keras
# 3.15.1, TensorFlow 2.21): `fit` first reduces a data batch across workers
# (`_maybe_symbolic_build`: "Attempt to convert a value (PerReplica:{...}) with an unsupported
# type ... to a Tensor"), and past that, reduces scalar logs along axis 0 (`reduce_per_replica`:
# "Invalid reduction dimension 0 for input with 0 dimensions").
TENSORFLOW_MULTI_WORKER_ERROR = (
    "Training in several processes is not available on the tensorflow backend: Keras 3's "
    "TensorFlow trainer fails under tf.distribute.MultiWorkerMirroredStrategy (keras-team/keras"
    "#20585; fit reduces its first batch and its scalar logs across workers in ways "
    "MultiWorkerMirroredStrategy rejects). Use --backend jax with --num_processes (the same "
    "flags), or --distribution data_parallel in one process (MirroredStrategy).")


def _tf_config_workers():
    """The workers `TF_CONFIG` lists (0 when it is unset or unreadable)."""
    import json

    try:
        return len(json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
                   .get("worker", []))
    except (ValueError, AttributeError):
        return 0


def process_values(value, processes):
    """`[process 0's value, ..., process N-1's]` of an integer every process passes (a
    collective: all processes must call it); `[value]` in a single-process run."""
    if not processes.multi:
        return [int(value)]
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(value, dtype=np.int32))
    return [int(v) for v in np.asarray(gathered).ravel()]


def model_parallel_layout_map(device_mesh):
    """Shards attention (over heads) and MLP kernels (over the hidden MLP units, a SwiGLU's gate
    too) on the mesh's `model` axis; everything else is replicated."""
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for path, axes in ViT.model_parallel_layout().items():  # the model's own answer
        layout_map[path] = axes
    return layout_map


class Distribution:
    """`--distribution none`, and what every kind answers the training loop (`get` makes the one
    a flag names): one device holds the whole model and takes the whole batch."""

    kind = "none"
    sharded_backup = False  # an epoch's backup: the whole model (epoch-N.keras)
    shards_weights = False  # every device holds every weight whole

    def __init__(self, model_parallel_size=None, processes=Processes(), fsdp_min_bytes=0):
        self.model_parallel_size = model_parallel_size
        self.processes = processes
        self.fsdp_min_bytes = fsdp_min_bytes

    def __repr__(self):
        return f"<{type(self).__name__} {self.kind!r}>"

    def scope(self):
        """Sets the distribution up; returns the context to build and compile the model in."""
        return contextlib.nullcontext()

    @property
    def replicas(self):
        """How many devices a batch is split over."""
        return 1

    @property
    def xla_off(self):
        """Why XLA compilation is off unless asked for (`--jit_compile`), or None."""
        return None

    def placement(self, model):
        """What each device holds of `model` and its optimizer (`sharding.Placement`; the
        optimizer is built first, so that its slots are laid out), or None where every device
        holds all of it. Call after `scope`."""
        if not self.shards_weights:
            return None
        from vit_keras.tools.distributed import sharding

        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        return sharding.placement(model, self.fsdp_min_bytes)

    def reset(self):
        """Leaves the process without the distribution `scope` set (at the end of a run)."""


class _Parallel(Distribution):
    """A kind Keras' distribution API runs on JAX (`_keras_distribution(devices)`); refused on
    the other backends."""

    def scope(self):
        backend = keras.backend.backend()
        if backend != "jax":
            return self._scope_off_jax(backend)
        keras.distribution.set_distribution(
            self._keras_distribution(keras.distribution.list_devices()))
        return contextlib.nullcontext()

    def _scope_off_jax(self, backend):
        if backend == "tensorflow":
            raise ValueError(f"--distribution {self.kind} needs the JAX backend: Keras' "
                             f"ModelParallel is implemented for JAX only, and TensorFlow's DTensor "
                             f"path is not supported here. Use --backend jax, or data_parallel on "
                             f"TensorFlow.")
        raise ValueError(f"--distribution {self.kind} is not available on the {backend} backend: "
                         f"Keras has no distribution engine for torch. Use --backend jax "
                         f"(data_parallel, model_parallel, fsdp) or --backend tensorflow "
                         f"(data_parallel).")

    @property
    def replicas(self):
        # Every device of every process takes a slice of each batch.
        return len(keras.distribution.list_devices()) if keras.backend.backend() == "jax" else 1

    def reset(self):
        if keras.backend.backend() == "jax":
            keras.distribution.set_distribution(None)


class _DataParallel(_Parallel):
    """`data_parallel` (see `get`)."""

    kind = "data_parallel"
    _strategy = None  # TensorFlow's MirroredStrategy: one per run, its replicas are the run's

    def _keras_distribution(self, devices):
        return keras.distribution.DataParallel(devices=devices)

    def _mirrored(self):
        if self._strategy is None:
            import tensorflow as tf

            self._strategy = tf.distribute.MirroredStrategy()
        return self._strategy

    def _scope_off_jax(self, backend):
        if backend == "tensorflow":
            return self._mirrored().scope()
        return super()._scope_off_jax(backend)

    @property
    def replicas(self):
        if keras.backend.backend() == "tensorflow":
            return self._mirrored().num_replicas_in_sync
        return super().replicas

    @property
    def xla_off(self):
        if keras.backend.backend() != "tensorflow":
            return None
        # "Trying to access resource ... located in device CPU:1 from device CPU:0",
        # tensorflow.org/xla/known_issues.
        return ("MirroredStrategy: XLA compilation off (TensorFlow's XLA cannot place mirrored "
                "variables).")


class _ModelParallel(_Parallel):
    """`model_parallel` (see `get`)."""

    kind = "model_parallel"
    shards_weights = True

    def _keras_distribution(self, devices):
        local = len(devices) // self.processes.count
        model_size = int(self.model_parallel_size
                         or (local if self.processes.multi else len(devices)))
        mesh = _mesh(devices, model_size, self.processes)
        return keras.distribution.ModelParallel(layout_map=model_parallel_layout_map(mesh),
                                                batch_dim_name="batch")


class _FullyShardedDataParallel(_Parallel):
    """`fsdp` (see `get`)."""

    kind = "fsdp"
    shards_weights = True
    sharded_backup = True

    def _keras_distribution(self, devices):
        from vit_keras.tools.distributed import sharding

        model_size = int(self.model_parallel_size or 1)
        mesh = _mesh(devices, model_size, self.processes, spanning_allowed=True)
        rules = model_parallel_layout_map(mesh) if model_size > 1 else None
        return sharding.FullyShardedDataParallel(mesh, layout_map=rules,
                                                 min_bytes=self.fsdp_min_bytes)


_KINDS = {kind.kind: kind for kind in (Distribution, _DataParallel, _ModelParallel,
                                       _FullyShardedDataParallel)}
DISTRIBUTIONS = tuple(_KINDS)  # the values of --distribution


def get(kind="none", model_parallel_size=None, processes=Processes(), fsdp_min_bytes=0):
    """The `Distribution` that `--distribution kind` names (`DISTRIBUTIONS`; None or "" is
    "none"), for a run of `processes`. Nothing is set up until its `scope()`:

    - `data_parallel`: `keras.distribution.DataParallel` over all devices of all processes on
      JAX; `tf.distribute.MirroredStrategy` on TensorFlow. Batches are split across devices; with
      several processes Keras gives each process its slice of every batch
      (`DataParallel.distribute_dataset`), so the batch size stays the global one.
    - `model_parallel` (JAX): `keras.distribution.ModelParallel` with a (batch, model) mesh and
      `model_parallel_layout_map`; `model_parallel_size` devices on the model axis (default: all,
      or with several processes each process's own: a weight sharded across processes could not
      be saved by one of them).
    - `fsdp` (JAX): `sharding.FullyShardedDataParallel`: the batch and every weight of at least
      `fsdp_min_bytes` (with its optimizer slots) split over all devices; with
      `model_parallel_size` > 1, a (batch, model) mesh whose model axis shards as
      `model_parallel` does and whose batch axis takes the FSDP rule. Its backups are sharded
      Orbax checkpoints (`sharded_backup`).
    The torch backend has no such engine in Keras: `scope()` raises `ValueError` there, and for
    `model_parallel` and `fsdp` on TensorFlow.

    Raises `ValueError` for an unknown kind, naming the choices, and `MultiProcessError` for
    several processes without a distribution to share the work.
    """
    kind = kind or "none"
    if kind not in _KINDS:
        raise ValueError(f"Unknown distribution {kind!r}; choose one of "
                         f"{', '.join(DISTRIBUTIONS)}.")
    if kind == "none" and processes.multi:
        raise MultiProcessError(
            f"{processes.count} processes need --distribution data_parallel (or "
            f"model_parallel or fsdp on JAX) to share the work.")
    return _KINDS[kind](model_parallel_size, processes, fsdp_min_bytes)


def distribution_scope(kind="none", model_parallel_size=None, processes=Processes(),
                       fsdp_min_bytes=0):
    """`get(...).scope()`: sets up `--distribution kind` and returns the context to build and
    compile the model in."""
    return get(kind, model_parallel_size, processes, fsdp_min_bytes).scope()


def _mesh(devices, model_size, processes, spanning_allowed=False):
    """A (batch, model) `DeviceMesh` with `model_size` devices on the model axis. A model axis
    spanning processes is refused unless `spanning_allowed` (FSDP gathers its weights to save)."""
    local = len(devices) // processes.count
    if model_size < 1 or len(devices) % model_size:
        raise ValueError(f"model_parallel_size {model_size} does not divide the "
                         f"{len(devices)} devices.")
    if processes.multi and local % model_size and not spanning_allowed:
        raise MultiProcessError(
            f"model_parallel_size {model_size} spreads weights over several of the "
            f"{processes.count} processes ({local} devices each); use a divisor of "
            f"{local}, so that every process holds whole weights to save.")
    return keras.distribution.DeviceMesh((len(devices) // model_size, model_size),
                                         ("batch", "model"), devices)


def pad_to_whole_batches(dataset, num_examples, batch_size):
    """An evaluation pipeline whose every batch is whole, for several JAX processes.

    Keras splits each global batch into equal per-process slices (`rebatch` then `shard`), so a
    last, partial batch would reach some processes and not others, which would then wait for
    each other forever. The `num_examples` real examples get the sample weight
    `padded / num_examples` and the padding weight 0: accuracy (a weighted mean) and
    the loss (Keras sums `weight * loss` over all `padded` examples and divides by `padded`)
    come out as the means over the real examples.

    Args:
      dataset: batched `(inputs, one-hot labels (B, classes))`, in order: images `(B, H, W,
        C)`, or a NaFlex model's dict of patches.
      num_examples: the examples `dataset` holds.
      batch_size: the global evaluation batch.

    Returns:
      `(inputs, labels, weights (B,))` batches of exactly `batch_size`; the padding repeats the
      first example (a real one, whose outputs are finite: an all-padding NaFlex sequence would
      pool nothing) at weight 0.
    """
    import tensorflow as tf

    padded = -(-num_examples // batch_size) * batch_size
    weight = padded / max(1, num_examples)
    real = dataset.unbatch().map(lambda x, y: (x, y, tf.constant(weight, tf.float32)))
    padding = dataset.unbatch().take(1).map(
        lambda x, y: (x, y, tf.constant(0.0, tf.float32))).repeat(padded - num_examples)
    batches = real.concatenate(padding).batch(batch_size, drop_remainder=True)
    # unbatch() loses the count; Keras needs it to know where an evaluation ends.
    return batches.apply(tf.data.experimental.assert_cardinality(padded // batch_size)).prefetch(
        tf.data.AUTOTUNE)
