"""A model's and its optimizer's variables as one Orbax checkpoint (JAX): written by every process
without gathering anything, each writing the shards its own devices hold, and read back onto the
variables' current layouts, so a run may resume on another mesh, another number of processes or
devices, as long as the device count still divides each split axis. The backup format of an
fsdp run (`callbacks.AtomicBackupAndRestore(sharded=True)`), and how to export its weights when
`model.keras` cannot be gathered on one host (`docs/distributed.md`).

    PATH/   an Orbax checkpoint (orbax-checkpoint, tensorstore) of the tree
            {"weights": [model.weights, in order], "optimizer": [optimizer.variables, in order]}

Variables are matched by position, as `model.load_weights` matches them, and not by path: paths
carry per-process counters (a second model built in one process is `vi_t_1`). Orbax writes into a
temporary folder beside PATH and renames it when every process has written
(`ORBAX_TEMPORARY_MARK`): PATH is always a whole checkpoint. A disk without the room
for a checkpoint is refused before it is written, and a write that fails removes that folder.
"""

import errno
import os
import re
import shutil
import threading
import time

import keras

SUFFIX = ".orbax"
# Orbax writes a checkpoint into a folder named with this, renamed once every process has written
# (a run folder's `temporary_files` lists what an interrupted write left).
ORBAX_TEMPORARY_MARK = ".orbax-checkpoint-tmp"
# TensorStore reports a failed write as a ValueError whose message ends with the errno.
_OS_ERROR_CODE = re.compile(r"\[os_error_code='(\d+)'\]")


def _orbax():
    if keras.backend.backend() != "jax":  # the checkpoint holds JAX arrays' shards
        raise ValueError(f"Sharded Orbax checkpoints need the JAX backend (KERAS_BACKEND=jax), "
                         f"not {keras.backend.backend()}.")
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ImportError(
            "Sharded checkpoints (--distribution fsdp) need orbax-checkpoint, which the jax "
            "extras install: pip install 'vit-keras3[jax]' (or pip install orbax-checkpoint)."
        ) from None
    return ocp


def _groups(model, with_optimizer=True):
    """`{"weights": [...], "optimizer": [...]}`: the variables a checkpoint holds, in order (the
    optimizer's built first, as `load_weights` does, so that its slots exist to be filled)."""
    groups = {"weights": list(model.weights)}
    optimizer = getattr(model, "optimizer", None)
    if with_optimizer and optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        groups["optimizer"] = list(optimizer.variables)
    return groups


def save(model, path):
    """Writes `model`'s weights and its optimizer's variables to the Orbax checkpoint `path`,
    replacing what is there. A collective: every process calls it with the same `path`, on a
    filesystem all of them see, and each writes only its devices' shards; it returns once the
    checkpoint is committed, on every process.

    Raises:
      OSError: a file could not be written (`errno.ENOSPC`: a full disk); nothing of the new
        checkpoint is left, and what was at `path` before is kept.
    """
    ocp = _orbax()
    path = os.path.abspath(path)
    tree = {group: [variable.value for variable in variables]
            for group, variables in _groups(model).items()}
    _check_room(path, sum(value.nbytes for values in tree.values() for value in values))
    running = set(threading.enumerate())
    try:
        ocp.PyTreeCheckpointer().save(path, tree, force=True)
    except Exception as error:  # TensorStore's ValueError, asyncio's RuntimeError, an OSError
        # Orbax's other writing threads go on after the first fails (a minute at most, for
        # them all; Thread's own join: Orbax's re-raises the thread's error, the one this save
        # reports below), and TensorStore's writes, on its own threads, may land later still:
        # the temporary folder is removed until half a second passes without one.
        deadline = time.monotonic() + 60
        for thread in set(threading.enumerate()) - running:
            threading.Thread.join(thread, timeout=max(0.0, deadline - time.monotonic()))
        while _remove_temporary_folders(path) and time.monotonic() < deadline:
            time.sleep(0.5)
        failure = write_failure(error, path)
        if failure is None:
            raise
        raise failure from None


def _remove_temporary_folders(path):
    """Removes Orbax's temporary folders of the checkpoint `path`; whether there were any."""
    folder, name = os.path.split(path)
    found = [entry for entry in os.listdir(folder) if entry.startswith(name + ORBAX_TEMPORARY_MARK)]
    for entry in found:
        shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
    return bool(found)


def write_failure(error, path=None):
    """The `OSError` of a file Orbax could not write, from the error its save or one of its
    writing threads raised: `error` itself, or TensorStore's ValueError naming the errno, as an
    OSError for `path`; None for any other error."""
    if isinstance(error, OSError):
        return error
    code = _OS_ERROR_CODE.search(str(error))
    return None if code is None else OSError(int(code[1]), os.strerror(int(code[1])), path)


def restore(model, path, with_optimizer=True):
    """Loads the Orbax checkpoint `path` (written by `save`) into `model`'s variables, each read
    onto its current layout: under a `keras.distribution`, every device reads only its shard.

    Args:
      model: a built model (compiled, when `with_optimizer`), of the architecture that wrote
        `path`.
      path: the checkpoint folder.
      with_optimizer: also restore the optimizer's state (`False`: the weights alone, for
        inference or export; the model need not be compiled).

    Raises:
      errors.CheckpointNotFoundError: nothing at `path`.
      errors.CheckpointError: the checkpoint holds another number of variables, or a variable of
        another shape, than `model` (named), or cannot be read (a file truncated or missing).
    """
    import jax

    from vit_keras import errors

    ocp = _orbax()
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise errors.CheckpointNotFoundError(f"No Orbax checkpoint at {path}.")
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        stored = checkpointer.metadata(path).item_metadata.tree
    except Exception as error:  # Orbax: an AttributeError where the metadata is missing
        raise _unreadable(path, error) from None
    groups = _groups(model, with_optimizer)
    for group, variables in groups.items():
        held = stored.get(group, [])
        if len(held) != len(variables):
            raise errors.CheckpointError(
                f"The checkpoint {path} holds {len(held)} {group} variables but "
                f"{model.name} has {len(variables)}: it was written by another architecture or "
                f"training setup (LoRA, optimizer) than this model's.")
        for variable, meta in zip(variables, held):
            if tuple(meta.shape) != tuple(variable.shape):
                raise errors.CheckpointError(
                    f"The checkpoint {path} holds {variable.path} with shape "
                    f"{tuple(meta.shape)}, but {model.name}'s is {tuple(variable.shape)}: it was "
                    f"written by another architecture, image size or number of classes.")
    target = {group: [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=v.value.sharding)
                      for v in variables] for group, variables in groups.items()}
    try:
        restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True))
    except Exception as error:  # TensorStore's errors reach here as a bare Exception
        raise _unreadable(path, error) from None
    for group, variables in groups.items():
        for variable, value in zip(variables, restored[group]):
            variable.assign(value)
    return model


def _check_room(path, needed):
    """`OSError(ENOSPC)` when the disk of `path` has less than `needed` bytes free: a write
    that fails midway leaves Orbax's threads printing errors long after it is given up."""
    folder = os.path.dirname(path)
    while not os.path.isdir(folder):  # another process's backup folder, not yet created
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (the checkpoint needs about "
                                    f"{needed / 2 ** 20:.1f} MiB, {free / 2 ** 20:.1f} MiB are "
                                    f"free)", path)


def _unreadable(path, error):
    from vit_keras import errors

    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return errors.CheckpointError(
        f"The Orbax checkpoint {path} cannot be read, a file of it is damaged or missing "
        f"({reason[:300]}): restore it from a copy, or delete it.")
