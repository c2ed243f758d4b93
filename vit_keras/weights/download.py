"""Fetching published files into a local cache: resumable, atomic, checked, and quick to fail.

Files are named by their path below a base URL (the official bucket, `releases.OFFICIAL_BASE_URL`,
or for the ViT family's releases the Hugging Face hub, `releases.HUB_BASE_URL`) and cached at the
same path below `cache_dir()`, so a file can be placed there by hand and a mirror can hold the same
tree. `VIT_KERAS_WEIGHTS_MIRROR` (a base URL or a local folder) replaces either base: a mirror holds
the bucket's paths (`vit_models/...`) and the hub's (`<repo id>/resolve/main/<file>`) side by side.

Why not `keras.utils.get_file`: it writes in place (a process killed mid-download leaves a
truncated file that the next call trusts) and opens the URL without a timeout (an unreachable host
hangs for minutes). Here the download goes to `<file>.part`, resumes from there with an HTTP
Range request, is given up on the clock (`vit_keras.weights.download_http`), is checked against the hash
the server publishes, if any, and by the caller's checks (a mirror or proxy may answer 200 with an
error page or a body cut short), and becomes the cached file by one atomic rename only when it has
passed. Files that belong together (a release's `config.json` and weights) are checked together
before any of them is cached (`fetch_release`). The `.part` file is locked while a process works
on it: only the lock holder reads, writes, renames or deletes it; and it is never a link: a
`.part` planted as a symbolic or hard link (to a file outside the cache) is refused, not written
through.
"""

import contextlib
import math
import os
import stat
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request

from vit_keras import errors
from vit_keras.weights import download_http, releases

MIRROR_VARIABLE = "VIT_KERAS_WEIGHTS_MIRROR"
HOME_VARIABLE = "VIT_KERAS_HOME"
TIMEOUT_SECONDS = 5
"""How long a connection attempt, or a read that receives nothing at all, waits before failing."""
DEADLINE_VARIABLE = "VIT_KERAS_DOWNLOAD_DEADLINE"
"""Replaces `DEADLINE_SECONDS` (a number of seconds, at most `MAX_SECONDS`)."""
MAX_SECONDS = 7 * 24 * 60 * 60
"""The longest deadline or progress window accepted: a week (a clock of centuries overflows the
watchdog's wait, and a download held that long is held by a hostile server)."""
DEADLINE_SECONDS = 2 * 60 * 60
"""How long one file's download (connection, headers and body) may take in all before it is
given up; its `.part` file is kept, and the next call resumes it."""
PROGRESS_WINDOW_VARIABLE = "VIT_KERAS_DOWNLOAD_PROGRESS_WINDOW"
"""Replaces `PROGRESS_WINDOW_SECONDS` (a number of seconds, at most `MAX_SECONDS`)."""
PROGRESS_WINDOW_SECONDS = 30
"""The window over which a download's progress is measured (see `MIN_PROGRESS_BYTES`)."""
MIN_PROGRESS_BYTES = 64 * 1024
"""A download that receives fewer bytes of the file than this in any `PROGRESS_WINDOW_SECONDS`
(the first window starts with the request, so a status line or headers that trickle count) is
given up, even while a read is blocked: a server that trickles bytes, which `TIMEOUT_SECONDS`
alone never catches. Its `.part` file is kept, and the next call resumes it."""
MAX_BYTES_VARIABLE = "VIT_KERAS_DOWNLOAD_MAX_BYTES"
"""Replaces `MAX_BYTES` (a number of bytes)."""
MAX_BYTES = 16 << 30
"""The largest file a download may take: twice the largest published ViT checkpoint (ViT-G/14,
1.8 billion float32 weights), so that a server sending endless bytes, with or without a
`Content-Length`, fills no disk. A file over it is refused and its `.part` deleted."""

_HTML_STARTS = (b"<!doctype html", b"<html", b"<head", b"<body", b"<?xml")
_OPEN_PART = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
              | getattr(os, "O_BINARY", 0))
"""How a `.part` file is opened: never through a symbolic link (`O_NOFOLLOW`), never waiting on a
FIFO planted in its place (`O_NONBLOCK`, which regular files ignore)."""


class WeightsUnavailableError(errors.UserError, OSError):
    """A published file can be neither found in the cache nor downloaded."""


class InvalidFileError(WeightsUnavailableError):
    """A published file (just downloaded, in the cache, or in a mirror folder) fails its check: an
    error page, a truncated or corrupt body, another file than the one named, a hash other than
    the one the server published. Nothing that fails the check is ever cached."""


class DownloadSettingError(errors.UserError, ValueError):
    """An environment variable of the download holds something other than a positive number of
    seconds up to `MAX_SECONDS` (`DEADLINE_VARIABLE`, `PROGRESS_WINDOW_VARIABLE`) or of bytes
    (`MAX_BYTES_VARIABLE`)."""


class FileRejected(ValueError):
    """Raised by a `fetch_release` check of several files to say which one is wrong.

    Args:
      path: the file's path below the base (one of the paths fetched).
      problem: what is wrong with it.
    """

    def __init__(self, path, problem):
        super().__init__(problem)
        self.path = path


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


def _setting(variable, default, unit, maximum=None):
    """The positive number of `unit` in the environment variable `variable`, at most `maximum`
    (a finite number when None), else `default`."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number <= (maximum or sys.float_info.max):
        bound = f" up to {maximum} (a week)" if maximum == MAX_SECONDS else ""
        raise DownloadSettingError(f"{variable}={value!r} is not a positive number of {unit}"
                                   f"{bound}; unset it (the default is {default}) or give one, "
                                   f"e.g. {variable}={default}.")
    return number


def _limits():
    return download_http.Limits(
        timeout=TIMEOUT_SECONDS,
        deadline=_setting(DEADLINE_VARIABLE, DEADLINE_SECONDS, "seconds", MAX_SECONDS),
        progress_window=_setting(PROGRESS_WINDOW_VARIABLE, PROGRESS_WINDOW_SECONDS, "seconds",
                                 MAX_SECONDS),
        min_progress_bytes=MIN_PROGRESS_BYTES,
        max_bytes=int(_setting(MAX_BYTES_VARIABLE, MAX_BYTES, "bytes")),
        deadline_name=DEADLINE_VARIABLE, progress_window_name=PROGRESS_WINDOW_VARIABLE,
        max_bytes_name=MAX_BYTES_VARIABLE)


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
      DownloadSettingError: for a deadline variable that is not a number of seconds.
      WeightsUnavailableError: within about `TIMEOUT_SECONDS` when the source cannot be reached;
        when the download is late (fewer than `MIN_PROGRESS_BYTES` of the file in a
        `PROGRESS_WINDOW_SECONDS`, or longer than `DEADLINE_SECONDS` in all), naming the URL,
        the cache path for a copy placed by hand, and the mirror variable; when the cache's
        `.part` file is a link or not a regular file.
      InvalidFileError: when the complete download does not match the hash the server published
        or fails `verify`, naming the URL and what is wrong. (A download shorter than the
        server's `Content-Length` is a `WeightsUnavailableError`: its `.part` file is kept, and
        the next call resumes it.)
    """
    parts = _parts(path)
    _, folder = _source(base_url)
    if folder is not None:
        return _in_folder(folder, path, parts)
    target = cache_path(path)
    if not os.path.isfile(target):
        _download({path: target}, base_url, progress, None,
                  None if verify is None else lambda files: verify(files[path]))
    return target


def fetch_release(paths, *, check_file=None, check_together=None, base_url=None, progress=True):
    """The local copies of files that belong together (a release's `config.json` and weights),
    each checked on its own and then all together, from the cache, the mirror folder or a
    download. Downloads happen in the order of `paths`, each checked on its own as soon as it
    is complete (so a bad `config.json` is refused before the weights are downloaded); none is
    cached before all have passed the check together. A cached file is checked on its own
    before anything is downloaded.

    Args:
      paths: the files' paths below `base_url`.
      check_file: `check_file(path, local)` raises `ValueError` saying what is wrong with the
        local copy `local` of the file at `path` on its own.
      check_together: `check_together(files)`, with `files` a dict of each path's local copy,
        raises `FileRejected` naming the file that is wrong (or a `ValueError`, which blames the
        last of `paths`); what it returns is returned.
      base_url: as in `fetch`.
      progress: as in `fetch`.

    Returns:
      `(files, checked)`: the dict of each path's local copy, and what `check_together` returned.

    Raises:
      ValueError: for a path that leaves the bucket's root.
      DownloadSettingError: as in `fetch`.
      WeightsUnavailableError: as in `fetch`.
      InvalidFileError: naming the file that failed its checks: a download (deleted, not
        cached), a cached file (to delete) or a mirror folder's (to replace).
    """
    paths = list(paths)
    for path in paths:
        _parts(path)
    _, folder = _source(base_url)
    if folder is not None:
        files = {path: _in_folder(folder, path, _parts(path)) for path in paths}
        return files, _check_local(files, check_file, check_together)
    files = {path: cache_path(path) for path in paths}
    cached = {path: local for path, local in files.items() if os.path.isfile(local)}
    _check_local(cached, check_file, None)  # a bad cached file is named before any download
    if len(cached) == len(files):
        return files, _check_local(files, None, check_together)
    return files, _download({path: files[path] for path in paths if path not in cached},
                            base_url, progress, check_file, check_together, files)


def _in_folder(folder, path, parts):
    local = os.path.join(folder, *parts)
    if not os.path.isfile(local):
        raise WeightsUnavailableError(
            f"{MIRROR_VARIABLE} points at the folder {folder}, which has no '{path}' "
            f"(looked for {local}).")
    return local


def _check_local(files, check_file, check_together):
    """Runs the checks on files that are not downloads; an `InvalidFileError` names the one that
    fails. Returns what `check_together` returns."""
    for path, local in files.items():
        try:
            if check_file is not None:
                check_file(path, local)
        except ValueError as error:
            raise invalid_file_error(path, local, error) from error
    try:
        return None if check_together is None else check_together(dict(files))
    except ValueError as error:
        blamed = _blamed(error, files)
        raise invalid_file_error(blamed, files[blamed], error) from error


def _blamed(error, files):
    """The path `error` (from a check of all `files`) blames: a `FileRejected`'s, else the last."""
    if isinstance(error, FileRejected) and error.path in files:
        return error.path
    return list(files)[-1]


class _Download:
    """One file's download into its locked `.part` file."""

    def __init__(self, path, target, out, base_url):
        self.path, self.target, self.out = path, target, out
        self.partial = target + ".part"
        self.url = url_for(path, base_url)
        self.base_url = base_url
        self.resumed = False

    def receive(self, limits, progress, check_file):
        """Downloads the rest of the file and checks it on its own (the published hash,
        `check_file`); a resumed download that fails is started over once, since the `.part`
        an earlier call left may have been junk."""
        for attempt in (0, 1):
            try:
                start, headers = download_http.receive(self.url, self.out, self.partial, limits,
                                                       progress)
            except urllib.error.HTTPError as error:
                self.clear_if_empty()
                raise _unavailable(self.path, self.url, f"HTTP {error.code} {error.reason}",
                                   self.base_url) from error
            except download_http.HTTP_ERRORS as error:
                self.clear_if_empty()
                reason = getattr(error, "reason", None) or error
                raise _unavailable(self.path, self.url, str(reason) or type(error).__name__,
                                   self.base_url) from error
            except BaseException:
                self.clear_if_empty()
                raise
            self.resumed = start > 0
            hub = (self.base_url or releases.OFFICIAL_BASE_URL) == releases.HUB_BASE_URL
            problem = self.problem(lambda local: _raise_problem(download_http.hash_problem(
                local, download_http.published_hashes(headers, hub=hub))))
            if problem is None and check_file is not None:
                problem = self.problem(lambda local: check_file(self.path, local))
            if problem is None:
                return
            if not (self.resumed and attempt == 0):
                raise self.rejected(problem)
            self.start_over()

    def problem(self, check):
        """What `check(partial)` finds wrong (a `ValueError`'s message), or None; the `.part`
        file is deleted when the check fails in any other way."""
        try:
            check(self.partial)
        except ValueError as error:
            with open(self.partial, "rb") as f:
                head = f.read(256).lstrip().lower()
            if head.startswith(_HTML_STARTS):
                return f"the server sent an HTML page, not the file (a proxy's or mirror's " \
                       f"error page?); {error}"
            return str(error)
        except BaseException:
            os.remove(self.partial)
            raise
        return None

    def start_over(self):
        self.out.truncate(0)
        self.resumed = False

    def rejected(self, problem):
        """Deletes the `.part` file (resuming onto it would only repeat the problem) and returns
        the error that says so."""
        os.remove(self.partial)
        return InvalidFileError(
            f"The file downloaded from {self.url} is not a valid '{self.path}' ({problem}); it "
            f"was deleted, not cached. Check the server ({MIRROR_VARIABLE} replaces "
            f"{self.base_url or releases.OFFICIAL_BASE_URL}), or place a good copy at "
            f"{self.target}.")

    def clear_if_empty(self):
        if not os.fstat(self.out.fileno()).st_size and _is_at(self.out, self.partial):
            os.remove(self.partial)  # nothing arrived: leave no clutter


def _raise_problem(problem):
    if problem is not None:
        raise ValueError(problem)


def _download(targets, base_url, progress, check_file, check_together, files=None):
    """Downloads the files at `targets` (path: cache path) through their `.part` files, checks
    them (with the other `files`, already cached) and renames them into place; returns what
    `check_together` returns."""
    limits = _limits()
    for target in targets.values():
        os.makedirs(os.path.dirname(target), exist_ok=True)
    with contextlib.ExitStack() as stack:
        downloads = {}
        for path in sorted(targets, key=targets.get):  # one order: no two processes deadlock
            out = stack.enter_context(_locked(targets[path] + ".part"))
            downloads[path] = _Download(path, targets[path], out, base_url)
        for path in list(downloads):
            if os.path.isfile(targets[path]):  # another process finished it while this one waited
                downloads.pop(path).clear_if_empty()
        local = {**(files or targets), **{path: d.partial for path, d in downloads.items()}}
        try:
            for path in targets:  # in the caller's order
                if path in downloads:
                    downloads[path].receive(limits, progress, check_file)
            checked = _check_downloads(downloads, local, limits, progress, check_file,
                                       check_together)
        except BaseException:
            for download in downloads.values():  # those not reached yet: leave no clutter
                download.clear_if_empty()
            raise
        for download in downloads.values():
            os.replace(download.partial, download.target)
        return checked


def _check_downloads(downloads, local, limits, progress, check_file, check_together):
    """`check_together(local)`; a download it blames is started over once if it was resumed, and
    else deleted; a cached file it blames is named. Whatever fails, no `.part` file that was
    not checked with the others is kept."""
    try:
        while check_together is not None:
            try:
                return check_together(dict(local))
            except ValueError as error:
                blamed = _blamed(error, local)
                download = downloads.get(blamed)
                if download is None:
                    raise invalid_file_error(blamed, local[blamed], error) from error
                if not download.resumed:
                    problem = download.problem(lambda _, error=error: _raise_problem(str(error)))
                    raise download.rejected(problem) from error
                download.start_over()
                download.receive(limits, progress, check_file)
        return None
    except BaseException:
        for download in downloads.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(download.partial)
        raise


def _lock(file):
    try:
        import fcntl  # pylint: disable=import-outside-toplevel
    except ImportError:  # Windows: two processes downloading one file at once is left unguarded
        return
    fcntl.flock(file.fileno(), fcntl.LOCK_EX)


def _is_at(file, path):
    """Whether the open `file` is still the file at `path` (not removed or renamed meanwhile)."""
    try:
        return os.path.samestat(os.fstat(file.fileno()), os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        return False


def _not_own(partial, what):
    return WeightsUnavailableError(
        f"{partial} is {what}, not a file of the cache's own: vit_keras never writes through a "
        f"link (it could reach a file outside the cache). Remove {partial} and call again.")


def _open_part(partial):
    """`partial` opened for appending; refused when it is a symbolic or hard link or not a regular
    file (`O_NOFOLLOW` keeps a link planted between the check and the open from being followed)."""
    try:
        info = os.lstat(partial)
    except FileNotFoundError:
        info = None
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise _not_own(partial, f"a symbolic link to {os.readlink(partial)}")
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise _not_own(partial, "not a regular file")
    try:
        descriptor = os.open(partial, _OPEN_PART, 0o644)
    except OSError as error:
        if os.path.islink(partial):
            raise _not_own(partial, "a symbolic link") from error
        raise
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(descriptor)
        raise _not_own(partial, "a hard link to another file" if stat.S_ISREG(info.st_mode)
                       else "not a regular file")
    return os.fdopen(descriptor, "ab")


@contextlib.contextmanager
def _locked(partial):
    """`partial` opened for appending and locked; a second process waits here.

    A process that waited for the lock may get it on a file the holder before removed (nothing had
    arrived) or renamed (it became the cached file): it then opens and locks the file now at
    `partial`, so that only the lock holder ever touches that path.
    """
    while True:
        out = _open_part(partial)
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


@contextlib.contextmanager
def as_one_folder(files):
    """A folder in which each of `files` (a dict of paths below the base to local files) sits
    under its own name (the last part of its path): their own folder when they already do
    (cached or mirrored files), else a temporary folder of symbolic links to them (`.part` files
    read as the folder they will form). Readers of a folder (a Hugging Face `config.json`
    beside its weights) read the files as they will be cached."""
    names = {path.rsplit("/", 1)[-1]: local for path, local in files.items()}
    folders = {os.path.dirname(os.path.abspath(local)) for local in names.values()}
    if len(folders) == 1 and all(os.path.basename(local) == name
                                 for name, local in names.items()):
        yield folders.pop()
        return
    with tempfile.TemporaryDirectory(prefix="vit_keras-check-") as folder:
        for name, local in names.items():
            try:
                os.symlink(os.path.abspath(local), os.path.join(folder, name))
            except OSError:  # no symbolic links here (Windows without the privilege): a copy
                import shutil  # pylint: disable=import-outside-toplevel

                shutil.copyfile(local, os.path.join(folder, name))
        yield folder


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
            repo_id, allow_patterns=["config.json", "preprocessor_config.json", "*.safetensors",
                                     "*.safetensors.index.json"],
            etag_timeout=TIMEOUT_SECONDS)
        if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
            # Older repositories hold only a pickled state dict (read with weights_only=True).
            folder = huggingface_hub.snapshot_download(
                repo_id, allow_patterns=["config.json", "preprocessor_config.json",
                                         "pytorch_model.bin"],
                etag_timeout=TIMEOUT_SECONDS)
        return folder
    except (OSError, ValueError) as error:
        raise WeightsUnavailableError(
            f"Could not fetch hf-hub:{repo_id} from the Hugging Face hub ({error}). Without "
            f"network access, use the release name instead (its file can be mirrored with "
            f"{MIRROR_VARIABLE}) or a local copy of the repository.") from error

