"""Reading checkpoint files without ever executing code from them, nor allocating more memory than
the file holds.

`sniff` tells the container from the file's first bytes (not its extension); `.npz` is read with
`allow_pickle=False`, PyTorch files with `torch.load(weights_only=True)`, safetensors without torch.
A truncated or corrupt file gives a `vit_keras.errors.CheckpointError` (a `ValueError`) that names
it and what is wrong; every array of an `.npz` is read whole, so its CRC-32 is checked, and only
once the sizes its headers claim have been checked against what the archive holds (NumPy
allocates an array before it reads a byte of it). `read_json` reads a bounded JSON file.
"""

import json
import math
import os
import zipfile
import zlib

import numpy as np

from vit_keras import errors

NPZ, TORCH, SAFETENSORS = "npz", "torch", "safetensors"
_SUPPORTED = ("a vit_jax or big_vision .npz, a PyTorch state dict (.pth/.bin), a .safetensors file, "
              "or a Hugging Face model folder")


def sniff(path):
    """`"npz"`, `"torch"` or `"safetensors"` for the file at `path`, from its content."""
    with open(path, "rb") as f:
        head = f.read(9)
    size = os.path.getsize(path)
    if head[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, EOFError) as error:
            raise errors.CheckpointError(
                f"{path!r} is a truncated or corrupt zip archive (.npz or PyTorch "
                f"file): {error}.") from error
        if names and all(name.endswith(".npy") for name in names):
            return NPZ
        if any(name.endswith("data.pkl") for name in names):
            return TORCH
    elif len(head) == 9 and head[8:9] == b"{":
        # An 8-byte header length, then the JSON header (which read_safetensors checks: a header
        # length whose first byte is 0x80 is no pickle). No pickle has "{" there: PyTorch's
        # legacy files start with a protocol-2 pickle of a magic number.
        return SAFETENSORS
    elif head[:1] == b"\x80":  # a pickle: PyTorch's legacy format (or any pickle: refused later)
        return TORCH
    found = "is empty" if not size else f"begins with {head!r}"
    raise errors.CheckpointError(
        f"Unrecognised checkpoint format: {path!r} {found}, and is none of "
        f"{_SUPPORTED}.")


def read_npz(path):
    """All arrays of an `.npz` file as a dict; refuses pickled object arrays.

    bfloat16 arrays (big_vision writes them; NumPy stores them as 2-byte voids) come back as float32.
    """
    arrays = {}
    try:
        with np.load(path, allow_pickle=False) as archive:
            _check_npz_members(path, archive.zip)
            for key in archive.files:
                array = _read_npz_array(path, archive, key)
                if array.dtype.kind == "V" and array.dtype.itemsize == 2:
                    import ml_dtypes  # pylint: disable=import-outside-toplevel
                    array = array.view(ml_dtypes.bfloat16).astype(np.float32)
                arrays[key] = array
    except (zipfile.BadZipFile, EOFError) as error:  # opening or listing the archive
        raise errors.CheckpointError(
            f"{path!r} is a truncated or corrupt .npz file: {error}.") from error
    return arrays


_NPZ_COMPRESSIONS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
"""What `numpy.savez` and `numpy.savez_compressed` write."""
_DEFLATE_MAX_RATIO = 1100
"""Deflate cannot expand data more than about 1032 times: a member that claims more is lying."""
_COMPRESSION_NAMES = {9: "deflate64", 12: "bzip2", 14: "lzma", 93: "zstandard"}


def npy_header(archive, member):
    """`(shape, dtype, header bytes)` of the `.npy` `member` of the zip `archive`, read from its
    header alone (no array data is read or allocated). Raises `ValueError` for an invalid header,
    and zip and zlib errors for a damaged member."""
    with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(f)
        return tuple(shape), dtype, f.tell()


def _check_npz_members(path, archive):
    """Refuses an `.npz` member that a reader could not read, or whose sizes are not its own: a
    compression NumPy does not write, a declared size that deflate cannot reach, an array header
    that claims more bytes than the member holds. Reads the headers only."""
    for info in archive.infolist():
        key = info.filename[:-len(".npy")] if info.filename.endswith(".npy") else info.filename
        if info.compress_type not in _NPZ_COMPRESSIONS:
            method = _COMPRESSION_NAMES.get(info.compress_type, "unknown")
            raise errors.CheckpointError(
                f"{path!r} stores array {key!r} with zip compression method "
                f"{info.compress_type} ({method}), which vit_keras does not read: an .npz holds "
                f"arrays stored or deflated (numpy.savez, numpy.savez_compressed); re-save it "
                f"with one of those.")
        limit = info.compress_size * (_DEFLATE_MAX_RATIO if info.compress_type else 1) + 1024
        if info.file_size > limit:
            raise errors.CheckpointError(
                f"{path!r} is a corrupt .npz file: array {key!r} claims {info.file_size} bytes "
                f"from {info.compress_size} compressed ones, more than its compression can give.")
        if not info.filename.endswith(".npy"):
            continue
        try:
            shape, dtype, header_size = npy_header(archive, info)
        except ValueError as error:
            raise errors.CheckpointError(
                f"{path!r} is a corrupt .npz file: array {key!r} has no valid header "
                f"({error}).") from error
        except (zipfile.BadZipFile, zlib.error, EOFError) as error:  # a bad CRC-32, cut data
            raise errors.CheckpointError(
                f"{path!r} is a truncated or corrupt .npz file: array {key!r} cannot "
                f"be read ({error}).") from error
        if dtype.hasobject:  # refused when read, without being unpickled
            continue
        claimed = math.prod(shape) * dtype.itemsize
        held = info.file_size - header_size
        if claimed > held:
            raise errors.CheckpointError(
                f"{path!r} is a corrupt .npz file: array {key!r} claims {tuple(shape)} {dtype} "
                f"({claimed} bytes) but the archive holds {held} bytes of it.")


def read_json(path, max_bytes=16 << 20):
    """The JSON value in the file at `path`, read whole only if it is at most `max_bytes` long
    (a `config.json` is kilobytes); a `CheckpointError` naming the file when it is longer, not
    UTF-8 JSON, or nested too deep to parse."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise errors.CheckpointError(f"{path!r} is over {max_bytes} bytes, not a configuration "
                                     f"file.")
    return parse_json(data, path)


def parse_json(data, name):
    """The JSON value in the bytes `data` (from the file `name`); a `CheckpointError` naming it
    when it is not UTF-8 JSON, is nested too deep to parse or holds an integer of thousands of
    digits."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise errors.CheckpointError(f"{name!r} is not valid JSON ({error}).") from error
    except RecursionError as error:
        raise errors.CheckpointError(f"{name!r} nests JSON arrays or objects too deep to "
                                     f"read.") from error
    except ValueError as error:  # Python reads no integer of over 4,300 digits
        raise errors.CheckpointError(f"{name!r} holds a number too large to read (an integer "
                                     f"of over 4,300 digits).") from error


def _read_npz_array(path, archive, key):
    try:
        return archive[key]
    except ValueError as error:
        if "allow_pickle" not in str(error):  # NumPy's refusal of an object array says so
            raise errors.CheckpointError(
                f"{path!r} is a corrupt .npz file: array {key!r} cannot be read "
                f"({error}).") from error
        raise errors.CheckpointError(
            f"Refusing to load {path!r}: array {key!r} is a pickled object array, and "
            f"unpickling can execute code. Checkpoints must hold numeric arrays only.") from error
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as error:
        # a bad CRC-32, cut data, a compression zipfile cannot read
        raise errors.CheckpointError(
            f"{path!r} is a truncated or corrupt .npz file: array {key!r} cannot "
            f"be read ({error}).") from error


def _to_numpy(tensor):
    import torch  # pylint: disable=import-outside-toplevel

    tensor = tensor.detach().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.float()
    return tensor.numpy()


def read_torch(path):
    """A PyTorch state dict (`torch.save`) as NumPy arrays; only tensors and containers are allowed.

    Training checkpoints that wrap the weights (`{"model": ...}`, `{"state_dict": ...}`) are
    unwrapped and a DataParallel `module.` prefix is removed.
    """
    import pickle  # pylint: disable=import-outside-toplevel

    import torch  # pylint: disable=import-outside-toplevel

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, AttributeError) as error:
        raise errors.CheckpointError(
            f"Refusing to load {path!r}: it is not a plain PyTorch state dict (torch.load with "
            f"weights_only=True rejected it; loading it fully could execute code). Details: "
            f"{_first_line(error)}") from error
    except (RuntimeError, EOFError, OSError) as error:
        raise errors.CheckpointError(
            f"{path!r} is a truncated or corrupt PyTorch file: "
            f"{_first_line(error)}") from error
    for wrapper in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        raise errors.CheckpointError(f"{path!r} holds a {type(state).__name__}, not a state dict.")
    arrays = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            arrays[key[len("module."):] if key.startswith("module.") else key] = _to_numpy(value)
    return arrays


def _first_line(error):
    return (str(error).splitlines() or [type(error).__name__])[0]


def read_safetensors(paths):
    """One or more (sharded) `.safetensors` files as one dict of NumPy arrays (no torch needed)."""
    from safetensors import SafetensorError  # pylint: disable=import-outside-toplevel
    from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

    arrays = {}
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError) as error:
            raise errors.CheckpointError(
                f"{path!r} is not a valid safetensors file (its header or data is "
                f"truncated or corrupt): {_first_line(error)}.") from error
        for key, value in tensors.items():
            # bfloat16 (an ml_dtypes type) and float16 are widened to float32.
            arrays[key] = value.astype(np.float32) if value.dtype.name in (
                "bfloat16", "float16") else value
    return arrays
