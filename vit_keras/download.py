"""Fetching published files into a local cache: resumable, atomic, checked, and quick to fail.

Files are named by their path below a base URL (the official bucket, `releases.OFFICIAL_BASE_URL`,
or for the ViT family's releases the Hugging Face hub, `releases.HUB_BASE_URL`) and cached at the
same path below `cache_dir()`, so a file can be placed there by hand and a mirror can hold the same
tree. `VIT_KERAS_WEIGHTS_MIRROR` (a base URL or a local folder) replaces either base: a mirror holds
the bucket's paths (`vit_models/...`) and the hub's (`<repo id>/resolve/main/<file>`) side by side.

Why not `keras.utils.get_file`: it writes in place (a process killed mid-download leaves a
truncated file that the next call trusts, since there is no published hash to check) and opens
the URL without a timeout (an unreachable host hangs for minutes). Here the download goes to
`<file>.part`, resumes from there with an HTTP Range request, is checked by the caller's `verify`
(a mirror or proxy may answer 200 with an error page or a body cut short), and becomes the cached
file by one atomic rename only when it has passed. The `.part` file is locked while a process
works on it: only the lock holder reads, writes, renames or deletes it.
"""

import contextlib
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from vit_keras import errors, releases

MIRROR_VARIABLE = "VIT_KERAS_WEIGHTS_MIRROR"
HOME_VARIABLE = "VIT_KERAS_HOME"
TIMEOUT_SECONDS = 5
"""How long a connection attempt, or a download that receives nothing at all, waits before failing."""
PROGRESS_WINDOW_SECONDS = 30
"""The window over which a download's progress is measured (see `MIN_PROGRESS_BYTES`)."""
MIN_PROGRESS_BYTES = 64 * 1024
"""A download that receives fewer bytes than this in `PROGRESS_WINDOW_SECONDS` (a server that
trickles bytes, which `TIMEOUT_SECONDS` alone never catches) is given up; its `.part` file is
kept, and the next call resumes it."""

_CHUNK = 1 << 20
_HTML_STARTS = (b"<!doctype html", b"<html", b"<head", b"<body", b"<?xml")


class WeightsUnavailableError(errors.UserError, OSError):
    """A published file can be neither found in the cache nor downloaded."""


class InvalidFileError(WeightsUnavailableError):
    """A published file (just downloaded, in the cache, or in a mirror folder) fails its check: an
    error page, a truncated or corrupt body, or another file than the one named. Nothing that
    fails the check is ever cached."""


def cache_dir():
    """`$VIT_KERAS_HOME`, else `$KERAS_HOME/vit_keras`, else `~/.keras/vit_keras`."""
    if os.environ.get(HOME_VARIABLE):
        return os.path.expanduser(os.environ[HOME_VARIABLE])
    keras_home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(keras_home, "vit_keras")


def _parts(path):
    """The `/`-separated names of `path`, refused unless it stays below the bucket's root (so that
    neither the cache nor a mirror folder can be left: no `..`, no absolute path, no drive)."""
    parts = path.split("/") if isinstance(path, str) else []
    if not parts or any(part in ("", ".", "..") or os.sep in part or
                        (os.altsep and os.altsep in part) or os.path.splitdrive(part)[0]
                        for part in parts):
        raise ValueError(f"{path!r} is not a file path below the bucket: it must be relative and "
                         f"'/'-separated, with no empty, '.' or '..' part "
                         f"(e.g. 'vit_models/imagenet21k/ViT-B_16.npz').")
    return parts


def cache_path(path):
    """Where the file at `path` (below the bucket) is cached."""
    return os.path.join(cache_dir(), *_parts(path))


def _source(base_url=None):
    """The base the files are fetched from: `(url, None)` or `(None, local folder)`; without a
    mirror, `base_url` (default: the official bucket)."""
    mirror = os.environ.get(MIRROR_VARIABLE, "").strip()
    if not mirror:
        return base_url or releases.OFFICIAL_BASE_URL, None
    scheme = urllib.parse.urlparse(mirror).scheme
    if scheme == "file":
        return None, urllib.request.url2pathname(urllib.parse.urlparse(mirror).path)
    if scheme in ("http", "https"):
        return mirror if mirror.endswith("/") else mirror + "/", None
    return None, os.path.expanduser(mirror)  # a folder


def url_for(path, base_url=None):
    """The URL the file at `path` below `base_url` (default: the official bucket) is downloaded
    from (the mirror's, if one is set)."""
    parts = _parts(path)
    base, folder = _source(base_url)
    if folder is not None:
        return "file://" + urllib.request.pathname2url(os.path.join(folder, *parts))
    return base + urllib.parse.quote("/".join(parts), safe="/+")


def _unavailable(path, url, reason, base_url=None):
    return WeightsUnavailableError(
        f"Could not download {url} ({reason}). Without network access, place the file by hand "
        f"at {cache_path(path)}, or set {MIRROR_VARIABLE} to a base URL or folder that holds "
        f"'{path}' (it replaces {base_url or releases.OFFICIAL_BASE_URL}).")


def invalid_file_error(path, local, problem):
    """The `InvalidFileError` for `local`, the cached or mirrored copy of the file at `path`, which
    failed its check with `problem`: it names the file and says what to do with it."""
    if os.path.abspath(local).startswith(os.path.join(os.path.abspath(cache_dir()), "")):
        return InvalidFileError(f"The cached file {local} is not a valid '{path}' ({problem}). "
                                f"Delete it; the next call downloads it again.")
    return InvalidFileError(f"{local} (the {MIRROR_VARIABLE} folder's copy) is not a valid "
                            f"'{path}' ({problem}). Replace it with a good copy.")


def fetch(path, *, progress=True, verify=None, base_url=None):
    """The local copy of the published file at `path`, downloaded on the first call.

    A cached file is returned without touching the network. With `VIT_KERAS_WEIGHTS_MIRROR` set
    to a folder, the file is read from there and not copied.

    Args:
      path: the file's path below `base_url`, e.g. `"vit_models/imagenet21k/ViT-B_16.npz"`;
        relative, without `..`.
      progress: show a progress bar (on stderr) while downloading.
      verify: checks a downloaded file before it becomes the cached file: called with the path of
        the complete download, it raises `ValueError` saying what is wrong. A file that fails is
        deleted, never cached. Cached and mirror-folder files are not checked here (a caller that
        reads one reports its problem with `invalid_file_error`).
      base_url: what `path` is below (default: the official bucket; `releases.HUB_BASE_URL` for
        the family's releases). A mirror replaces it.

    Raises:
      ValueError: for a `path` that leaves the bucket's root.
      WeightsUnavailableError: within about `TIMEOUT_SECONDS` when the source cannot be reached
        (or when it sends fewer than `MIN_PROGRESS_BYTES` in `PROGRESS_WINDOW_SECONDS`), naming
        the URL, the cache path for a copy placed by hand, and the mirror variable.
      InvalidFileError: when the complete download fails `verify`, naming the URL and what is
        wrong. (A download shorter than the server's `Content-Length` is a
        `WeightsUnavailableError`: its `.part` file is kept, and the next call resumes it.)
    """
    parts = _parts(path)
    _, folder = _source(base_url)
    if folder is not None:
        local = os.path.join(folder, *parts)
        if not os.path.isfile(local):
            raise WeightsUnavailableError(
                f"{MIRROR_VARIABLE} points at the folder {folder}, which has no '{path}' "
                f"(looked for {local}).")
        return local
    target = cache_path(path)
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    url = url_for(path, base_url)
    try:
        _download(url, target, progress, verify)
    except _Rejected as rejected:
        raise InvalidFileError(
            f"The file downloaded from {url} is not a valid '{path}' ({rejected}); it was deleted, "
            f"not cached. Check the server ({MIRROR_VARIABLE} replaces "
            f"{base_url or releases.OFFICIAL_BASE_URL}), or place a good copy at "
            f"{target}.") from rejected
    except urllib.error.HTTPError as error:
        raise _unavailable(path, url, f"HTTP {error.code} {error.reason}", base_url) from error
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", None) or error
        raise _unavailable(path, url, str(reason) or type(error).__name__, base_url) from error
    return target


class _Rejected(ValueError):
    """A complete download failed its check (the message says why)."""


def _lock(file):
    try:
        import fcntl  # pylint: disable=import-outside-toplevel
    except ImportError:  # Windows: two processes downloading one file at once is left unguarded
        return
    fcntl.flock(file.fileno(), fcntl.LOCK_EX)


def _is_at(file, path):
    """Whether the open `file` is still the file at `path` (not removed or renamed meanwhile)."""
    try:
        return os.path.samestat(os.fstat(file.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _locked(partial):
    """`partial` opened for appending and locked; a second process waits here.

    A process that waited for the lock may get it on a file the holder before removed (nothing had
    arrived) or renamed (it became the cached file): it then opens and locks the file now at
    `partial`, so that only the lock holder ever touches that path.
    """
    while True:
        out = open(partial, "ab")
        try:
            _lock(out)
            if _is_at(out, partial):
                break
        except BaseException:
            out.close()
            raise
        out.close()
    with out:
        yield out


def _download(url, target, progress, verify):
    """Downloads `url` to `target` through `target + ".part"`, resuming what an earlier call left,
    and renames it to `target` once it is complete and passes `verify`."""
    partial = target + ".part"
    with _locked(partial) as out:
        if os.path.isfile(target):  # another process finished it while this one waited
            if not os.fstat(out.fileno()).st_size:
                os.remove(partial)
            return
        try:
            _receive(url, out, partial, progress)
        except BaseException:
            if not os.fstat(out.fileno()).st_size:
                os.remove(partial)  # nothing arrived: leave no clutter
            raise
        problem = _check(partial, verify)
        if problem:
            os.remove(partial)  # resuming onto it would only repeat the problem
            raise _Rejected(problem)
        os.replace(partial, target)


def _check(partial, verify):
    """What is wrong with the complete download at `partial`, or None."""
    if verify is None:
        return None
    try:
        verify(partial)
    except ValueError as error:
        with open(partial, "rb") as f:
            head = f.read(256).lstrip().lower()
        if head.startswith(_HTML_STARTS):
            return f"the server sent an HTML page, not the file (a proxy's or mirror's error " \
                   f"page?); {error}"
        return str(error)
    return None


def _open(url, start):
    """The response to a GET of `url` from byte `start` on."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"} if start else {})
    return urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS)


def _range_start(response):
    """The first byte of a 206 response's body, from its `Content-Range` (None if it has none)."""
    match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    return int(match[1]) if match else None


def _receive(url, out, partial, progress):
    """Appends the rest of `url` to the locked, open `out` (at `partial`) until the server closes."""
    done = out.seek(0, os.SEEK_END)
    try:
        response = _open(url, done)
    except urllib.error.HTTPError as error:
        if error.code != 416 or not done:
            raise
        # Range Not Satisfiable: the .part is as long as the file or longer (a server that changed
        # the file, or a process killed between the last byte and the rename). Start again.
        error.close()
        out.truncate(0)
        done = 0
        response = _open(url, 0)
    if done and response.status != 206:  # the server ignores Range: the body is the whole file
        out.truncate(0)
        done = 0
    elif done and _range_start(response) != done:  # a range other than the one asked for
        response.close()
        out.truncate(0)
        done = 0
        response = _open(url, 0)
    with response:
        remaining = response.headers.get("Content-Length")
        total = done + int(remaining) if remaining is not None else None
        bar = _Progress(url, total, done) if progress else None
        window_start, window_done = time.monotonic(), done
        # read1 returns what has arrived (at most one chunk), so a trickle is seen as it happens.
        while chunk := response.read1(_CHUNK):
            out.write(chunk)
            done += len(chunk)
            if bar is not None:
                bar.update(done)
            now = time.monotonic()
            if now - window_start >= PROGRESS_WINDOW_SECONDS:
                if done - window_done < MIN_PROGRESS_BYTES:
                    out.flush()
                    raise TimeoutError(
                        f"only {done - window_done} bytes arrived in {now - window_start:.0f} s, "
                        f"fewer than the {MIN_PROGRESS_BYTES} required per "
                        f"{PROGRESS_WINDOW_SECONDS} s; calling again resumes from {partial}")
                window_start, window_done = now, done
    out.flush()
    os.fsync(out.fileno())
    if total is not None and done != total:
        raise OSError(f"the connection closed after {done} of {total} bytes; calling again "
                      f"resumes from {partial}")


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

