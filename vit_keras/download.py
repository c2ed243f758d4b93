"""Fetching published files into a local cache: resumable, atomic, and quick to fail offline.

Files are named by their path below the official bucket (`releases.OFFICIAL_BASE_URL`) and cached
at the same path below `cache_dir()`, so a file can be placed there by hand and a mirror can hold
the same tree. `VIT_KERAS_WEIGHTS_MIRROR` (a base URL or a local folder) replaces the bucket.

Why not `keras.utils.get_file`: it writes in place (a process killed mid-download leaves a
truncated file that the next call trusts, since there is no published hash to check) and opens
the URL without a timeout (an unreachable host hangs for minutes). Here the download goes to
`<file>.part`, resumes from there with an HTTP Range request, and becomes the cached file by one
atomic rename only when all its bytes have arrived.
"""

import os
import sys
import urllib.error
import urllib.parse
import urllib.request

from vit_keras import releases

MIRROR_VARIABLE = "VIT_KERAS_WEIGHTS_MIRROR"
HOME_VARIABLE = "VIT_KERAS_HOME"
TIMEOUT_SECONDS = 5
"""How long a connection attempt, or a stalled download, waits before failing."""

_CHUNK = 1 << 20


class WeightsUnavailableError(OSError):
    """A published file can be neither found in the cache nor downloaded."""


def cache_dir():
    """`$VIT_KERAS_HOME`, else `$KERAS_HOME/vit_keras`, else `~/.keras/vit_keras`."""
    if os.environ.get(HOME_VARIABLE):
        return os.path.expanduser(os.environ[HOME_VARIABLE])
    keras_home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(keras_home, "vit_keras")


def cache_path(path):
    """Where the file at `path` (below the bucket) is cached."""
    return os.path.join(cache_dir(), *path.split("/"))


def _source():
    """The base the files are fetched from: `(url, None)` or `(None, local folder)`."""
    mirror = os.environ.get(MIRROR_VARIABLE, "").strip()
    if not mirror:
        return releases.OFFICIAL_BASE_URL, None
    scheme = urllib.parse.urlparse(mirror).scheme
    if scheme == "file":
        return None, urllib.request.url2pathname(urllib.parse.urlparse(mirror).path)
    if scheme in ("http", "https"):
        return mirror if mirror.endswith("/") else mirror + "/", None
    return None, os.path.expanduser(mirror)  # a folder


def url_for(path):
    """The URL the file at `path` is downloaded from (the mirror's, if one is set)."""
    base, folder = _source()
    if folder is not None:
        return "file://" + urllib.request.pathname2url(os.path.join(folder, path))
    return base + urllib.parse.quote(path, safe="/+")


def _unavailable(path, url, reason):
    return WeightsUnavailableError(
        f"Could not download {url} ({reason}). Without network access, place the file by hand "
        f"at {cache_path(path)}, or set {MIRROR_VARIABLE} to a base URL or folder that holds "
        f"'{path}' (it replaces {releases.OFFICIAL_BASE_URL}).")


def fetch(path, *, progress=True):
    """The local copy of the published file at `path`, downloaded on the first call.

    A cached file is returned without touching the network. With `VIT_KERAS_WEIGHTS_MIRROR` set
    to a folder, the file is read from there and not copied.

    Args:
      path: the file's path below the official bucket, e.g. `"vit_models/imagenet21k/ViT-B_16.npz"`.
      progress: show a progress bar while downloading.

    Raises:
      WeightsUnavailableError: within about `TIMEOUT_SECONDS` when the source cannot be reached,
        naming the URL, the cache path for a copy placed by hand, and the mirror variable.
    """
    base, folder = _source()
    if folder is not None:
        local = os.path.join(folder, *path.split("/"))
        if not os.path.isfile(local):
            raise WeightsUnavailableError(
                f"{MIRROR_VARIABLE} points at the folder {folder}, which has no '{path}' "
                f"(looked for {local}).")
        return local
    target = cache_path(path)
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    url = url_for(path)
    try:
        _download(url, target, progress)
    except urllib.error.HTTPError as error:
        raise _unavailable(path, url, f"HTTP {error.code} {error.reason}") from error
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", None) or error
        raise _unavailable(path, url, str(reason) or type(error).__name__) from error
    finally:
        partial = target + ".part"
        if os.path.isfile(partial) and not os.path.getsize(partial):
            os.remove(partial)  # nothing arrived: leave no clutter
    return target


def _lock(file):
    try:
        import fcntl  # pylint: disable=import-outside-toplevel
    except ImportError:  # Windows: two processes downloading one file at once is left unguarded
        return
    fcntl.flock(file.fileno(), fcntl.LOCK_EX)


def _download(url, target, progress):
    """Downloads `url` to `target` through `target + ".part"`, resuming what an earlier call left."""
    partial = target + ".part"
    with open(partial, "ab") as out:
        _lock(out)  # a second process downloading the same file waits here, then finds it
        if os.path.isfile(target):
            return
        done = out.seek(0, os.SEEK_END)
        request = urllib.request.Request(url, headers={"Range": f"bytes={done}-"} if done else {})
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            if done and response.status != 206:  # the server ignores Range: start again
                out.truncate(0)
                done = 0
            remaining = response.headers.get("Content-Length")
            total = done + int(remaining) if remaining is not None else None
            bar = _Progress(url, total, done) if progress else None
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                done += len(chunk)
                if bar is not None:
                    bar.update(done)
        out.flush()
        os.fsync(out.fileno())
        if total is not None and done != total:
            raise OSError(f"the connection closed after {done} of {total} bytes; calling again "
                          f"resumes from {partial}")
        os.replace(partial, target)


class _Progress:
    """A one-line progress report on stderr (stdout stays the caller's: apps print results there)."""

    def __init__(self, url, total, done):
        self.total, self.shown, self.live = total, -1, sys.stderr.isatty()
        print(f"Downloading {url}", file=sys.stderr)
        self.update(done)

    def update(self, done):
        percent = int(100 * done / self.total) if self.total else None
        step = percent if self.live else (percent // 10 * 10 if percent is not None else None)
        if step == self.shown and percent is not None:
            return
        self.shown = step
        size = f"{done / 1e6:.1f}" + (f" / {self.total / 1e6:.1f} MB ({percent}%)" if self.total
                                      else " MB")
        print(("\r  " if self.live else "  ") + size, end="" if self.live else "\n",
              file=sys.stderr, flush=True)
        if self.live and self.total and done >= self.total:
            print(file=sys.stderr)


def fetch_hub(repo_id):
    """The local folder of Hugging Face hub repository `repo_id` (its config and safetensors),
    downloaded into the hub's own cache (`HF_HOME`) with `huggingface_hub`."""
    try:
        import huggingface_hub  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise WeightsUnavailableError(
            f"Loading hf-hub:{repo_id} needs huggingface_hub: pip install huggingface_hub.") from error
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json"],
            etag_timeout=TIMEOUT_SECONDS)
        if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
            # Older repositories hold only a pickled state dict (read with weights_only=True).
            folder = huggingface_hub.snapshot_download(
                repo_id, allow_patterns=["config.json", "pytorch_model.bin"],
                etag_timeout=TIMEOUT_SECONDS)
        return folder
    except (OSError, ValueError) as error:
        raise WeightsUnavailableError(
            f"Could not fetch hf-hub:{repo_id} from the Hugging Face hub ({error}). Without "
            f"network access, use the release name instead (its file can be mirrored with "
            f"{MIRROR_VARIABLE}) or a local copy of the repository.") from error

