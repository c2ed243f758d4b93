"""Writing a file whole or not at all, and never through a symbolic link.

A file vit_keras writes (a checkpoint, a figure, a run's JSON, an exported model) is first written
under a temporary name beside it and then renamed over it in one `os.replace`. A write that fails
midway (a full disk, Ctrl-C) leaves the file that was there as it was, and a reader never finds
half a file. A link at the path is replaced by the new file, its target untouched.

This module imports only the standard library: the library, its tools and the apps all use it.
"""

import contextlib
import os

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; Windows has no symbolic links to refuse here


@contextlib.contextmanager
def replacing(path, suffix=""):
    """Yields the temporary name to write the new `path` to; when the block ends, the file there
    replaces `path` in one `os.replace`. When the block raises, the temporary file is deleted and
    `path` is left as it was; an `OSError` about the temporary file (a missing folder, a full
    disk) names `path` instead, the file the caller asked for.

    `suffix` ends the temporary name, for writers that choose a format by it (Keras' `.keras`):
    `model.keras` is written as `model.tmp-PID.keras`. Whatever is at the temporary name before
    (a killed run's leftover, a link) is removed first, so writers that follow links write a new
    file there."""
    stem = path[:-len(suffix)] if suffix and path.endswith(suffix) else path
    temporary = f"{stem}.tmp-{os.getpid()}{suffix}"
    remove_link_or_file(temporary)
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            remove_link_or_file(temporary)
        if isinstance(error, OSError) and error.filename == temporary:
            named = type(error)(error.errno, error.strerror, path)
            raise named.with_traceback(error.__traceback__) from None
        raise


def write_bytes(data, path):
    """`data` written to `path` whole or not at all (`replacing`)."""
    with replacing(path) as temporary, open_new_file(temporary, "wb") as f:
        f.write(data)


def open_new_file(path, mode="w", **kwargs):
    """`open(path, mode)` for writing a file anew, but never through a symbolic link: a link at
    `path` is an `OSError` (`ELOOP`), its target untouched."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o644)
    return os.fdopen(descriptor, mode, **kwargs)


def remove_link_or_file(path):
    """Removes what is at `path` when it is a file or a link (a link's target is untouched)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
