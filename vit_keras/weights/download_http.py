"""One HTTP(S) download into an open file, given up on the clock, with the hashes the server
publishes for the file; the transport under `vit_keras.weights.download`.

A socket timeout alone never gives up on a server that sends one byte every few seconds: each
byte restarts it. So a watchdog thread holds a duplicate of every socket the download opens and
shuts the connection down when the download is late, whatever the reading thread is blocked on
(the TLS handshake, the status line, a header, a chunk-size line, the body). Two rules make a
download late: it has run longer than its deadline, or fewer than `min_progress_bytes` of the
file arrived in the last progress window (the first window starts with the request, so a status
line and headers that trickle count against it).
"""

import base64
import dataclasses
import hashlib
import http.client
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")


@dataclasses.dataclass(frozen=True)
class Limits:
    """When a download is given up.

    Attributes:
      timeout: seconds a connection attempt, or a read that receives nothing at all, waits.
      deadline: seconds the whole download (connection, headers and body) may take.
      progress_window: seconds over which progress is measured.
      min_progress_bytes: bytes of the file that must arrive in every progress window (the
        first starts with the request), unless the file ends.
      max_bytes: the largest file taken; a larger one is refused and what arrived discarded.
      deadline_name: how the caller names the deadline setting, for the message.
      progress_window_name: how the caller names the progress window setting, for the message.
      max_bytes_name: how the caller names the size cap, for the message.
    """

    timeout: float
    deadline: float
    progress_window: float
    min_progress_bytes: int
    max_bytes: int
    deadline_name: str = "deadline"
    progress_window_name: str = "progress window"
    max_bytes_name: str = "size cap"


class GaveUp(TimeoutError):
    """The download was late (the message says by which rule); what arrived is kept."""


class _Watchdog:
    """Shuts down the download's connections once it is late (see the module docstring)."""

    def __init__(self, limits):
        self._limits = limits
        self._condition = threading.Condition()
        self._sockets = []
        self._received = 0
        self._stopped = False
        self.reason = None
        now = time.monotonic()
        self._end = now + limits.deadline
        self._window_start, self._window_received = now, 0
        self._thread = threading.Thread(target=self._run, name="vit_keras download watchdog",
                                        daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()
        self._thread.join()
        for sock in self._sockets:
            sock.close()

    def stop(self):
        """Stops watching; returns why the download was given up before, or None."""
        with self._condition:
            self._stopped = True
            self._condition.notify()
            return self.reason

    def watch(self, sock):
        """Watches the connection of `sock` (through a duplicate, which stays valid whatever
        becomes of `sock`: wrapped in TLS, closed); returns `sock`."""
        duplicate = sock.dup()
        with self._condition:
            self._sockets.append(duplicate)
            if self.reason is not None:
                _shut(duplicate)
        return sock

    def received(self, num_bytes):
        with self._condition:
            self._received += num_bytes

    def _run(self):
        limits = self._limits
        with self._condition:
            while not self._stopped:
                now = time.monotonic()
                if now >= self._end:
                    self._give_up(f"the download did not finish within {limits.deadline:g} s "
                                  f"({limits.deadline_name})")
                    return
                if now >= self._window_start + limits.progress_window:
                    arrived = self._received - self._window_received
                    if arrived < limits.min_progress_bytes:
                        self._give_up(
                            f"only {arrived} bytes arrived in {limits.progress_window:g} s, "
                            f"fewer than the {limits.min_progress_bytes} required per "
                            f"{limits.progress_window:g} s ({limits.progress_window_name})")
                        return
                    self._window_start, self._window_received = now, self._received
                self._condition.wait(min(self._end, self._window_start + limits.progress_window)
                                     - now)

    def _give_up(self, reason):
        self.reason = reason
        for sock in self._sockets:
            _shut(sock)


def _shut(sock):
    try:
        # socket.socket's own shutdown, not SSLSocket's: the reading thread's TLS state is left
        # alone, and its blocked read returns at once with the connection closed under it.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


def _watched(connection_class, watchdog):
    """`connection_class` whose sockets `watchdog` watches from their creation on."""

    class Watched(connection_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            create = self._create_connection
            self._create_connection = lambda *a, **k: watchdog.watch(create(*a, **k))

    return Watched


def _opener(watchdog, redirects):
    """A urllib opener (proxies as the environment says) whose connections `watchdog` watches
    and which appends the headers of every redirect it follows to `redirects`."""

    class HTTPHandler(urllib.request.HTTPHandler):
        def do_open(self, http_class, req, **kwargs):
            return super().do_open(_watched(http_class, watchdog), req, **kwargs)

    class Redirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            redirects.append(headers)
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    handlers = [HTTPHandler, Redirects]
    if hasattr(urllib.request, "HTTPSHandler"):  # Python built with ssl
        class HTTPSHandler(urllib.request.HTTPSHandler):
            def do_open(self, http_class, req, **kwargs):
                return super().do_open(_watched(http_class, watchdog), req, **kwargs)

        handlers.append(HTTPSHandler)
    return urllib.request.build_opener(*handlers)


def _range_start(response):
    """The first byte of a 206 response's body, from its `Content-Range` (None if it has none)."""
    match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    return int(match[1]) if match else None


def _content_length(response):
    """The body's length from `Content-Length`, None without one; an `OSError` for a value that
    is not a number of bytes, or for headers that disagree (http.client reads as many bytes as
    the first says): a broken server or proxy, nothing it sends can be trusted."""
    values = {value.strip() for value in response.headers.get_all("Content-Length") or ()}
    if len(values) > 1:
        raise OSError(f"the server sent conflicting Content-Length headers, "
                      f"{' and '.join(sorted(values))}")
    if not values:
        return None
    value = values.pop()
    if not re.fullmatch(r"\d+", value):
        raise OSError(f"the server sent an invalid Content-Length, {value!r}")
    return int(value)


def _too_large(out, size, limits):
    """The error for a file of `size` bytes or more, over `limits.max_bytes`; what arrived in
    `out` is discarded (no resume can make it a file that is taken)."""
    out.truncate(0)
    return OSError(f"the file is {size} bytes or more, over the {limits.max_bytes} bytes a "
                   f"download may take ({limits.max_bytes_name}); raise it if the file is "
                   f"that large")


def receive(url, out, partial, limits, progress=True):
    """Appends the rest of the file at `url` to `out` (open for appending, at path `partial`),
    resuming from its end with an HTTP Range request, until the server has sent all of it.

    Args:
      url: an http(s) URL.
      out: a binary file open for appending.
      partial: the path of `out`, for messages.
      limits: a `Limits`.
      progress: show a progress bar on stderr.

    Returns:
      `(start, headers)`: the byte the download started from (0 when it started over), and the
      headers of the responses that delivered the file, redirects first (see
      `published_hashes`).

    Raises:
      GaveUp: a `TimeoutError`, when the download is late (see `Limits`); what arrived is kept
        in `out`.
      urllib.error.HTTPError, urllib.error.URLError, OSError, http.client.HTTPException: the
        server could not be reached or broke off.
    """
    with _Watchdog(limits) as watchdog:
        try:
            return _receive(url, out, partial, limits, progress, watchdog)
        except GaveUp:
            raise
        except Exception as error:  # a connection the watchdog shut down breaks off in many ways
            gave_up = watchdog.stop()
            if gave_up is None:
                raise
            out.flush()
            raise GaveUp(f"{gave_up}; calling again resumes from {partial}") from error


def _receive(url, out, partial, limits, progress, watchdog):
    redirects = []
    opener = _opener(watchdog, redirects)

    def get(start):
        del redirects[:]
        request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"} if start
                                         else {})
        return opener.open(request, timeout=limits.timeout)

    done = out.seek(0, os.SEEK_END)
    try:
        response = get(done)
    except urllib.error.HTTPError as error:
        if error.code != 416 or not done:
            raise
        # Range Not Satisfiable: the .part is as long as the file or longer (a server that changed
        # the file, or a process killed between the last byte and the rename). Start again.
        error.close()
        out.truncate(0)
        done = 0
        response = get(0)
    if done and response.status != 206:  # the server ignores Range: the body is the whole file
        out.truncate(0)
        done = 0
    elif done and _range_start(response) != done:  # a range other than the one asked for
        response.close()
        out.truncate(0)
        done = 0
        response = get(0)
    start = done
    with response:
        remaining = _content_length(response)
        total = done + remaining if remaining is not None else None
        if total is not None and total > limits.max_bytes:
            raise _too_large(out, total, limits)
        bar = _Progress(url, total, done) if progress else None
        # read1 returns what has arrived (at most one chunk), so progress is counted as it comes.
        while chunk := response.read1(_CHUNK):
            if done + len(chunk) > limits.max_bytes:  # a body without a Content-Length
                raise _too_large(out, done + len(chunk), limits)
            out.write(chunk)
            done += len(chunk)
            watchdog.received(len(chunk))
            if bar is not None:
                bar.update(done)
        headers = [*redirects, response.headers]
    out.flush()
    gave_up = watchdog.stop()
    if gave_up is not None and done != total:  # a file that ended before the watchdog struck is whole
        raise GaveUp(f"{gave_up}; calling again resumes from {partial}")
    os.fsync(out.fileno())
    if total is not None and done != total:
        raise OSError(f"the connection closed after {done} of {total} bytes; calling again "
                      f"resumes from {partial}")
    return start, headers


def published_hashes(headers, hub=False):
    """The content hashes the server published for the whole file, as `{name: (hex digest,
    where it was published)}`, from the headers `receive` returns.

    Read: the Hugging Face hub's `X-Linked-Etag` (the sha256 of a file stored with Git LFS, sent
    on the redirect to its storage), Google Cloud Storage's `x-goog-hash` (`md5=<base64>`; its
    `crc32c` is not checked), and with `hub=True` the `ETag` of a response that was not
    redirected (the git blob sha1 of a small file, or a sha256). Other servers' ETags are not
    hashes of the content and are ignored, as are weak ones (`W/"..."`).
    """
    found = {}
    for response in headers:
        linked = _strong_etag(response.get("X-Linked-Etag"))
        if linked and _SHA256.fullmatch(linked):
            found["sha256"] = (linked, "X-Linked-Etag")
        for part in ",".join(response.get_all("x-goog-hash") or ()).split(","):
            name, _, value = part.strip().partition("=")
            if name.lower() == "md5":
                try:
                    digest = base64.b64decode(value, validate=True)
                except ValueError:
                    continue
                if len(digest) == 16:
                    found["md5"] = (digest.hex(), "x-goog-hash")
    # The hub's own ETag is the content's hash only on a direct answer: a redirect's may name the
    # Git LFS pointer, and the storage's final answer has its own kind of ETag.
    etag = _strong_etag(headers[0].get("ETag")) if hub and len(headers) == 1 else None
    if etag and "sha256" not in found and _SHA256.fullmatch(etag):
        found["sha256"] = (etag, "ETag")
    elif etag and "sha256" not in found and _GIT_SHA1.fullmatch(etag):
        found["git-sha1"] = (etag, "ETag")
    return found


def _strong_etag(value):
    value = (value or "").strip()
    return None if value.startswith("W/") else value.strip('"').lower()


def hash_problem(path, hashes):
    """What is wrong with the file at `path` against `published_hashes`, or None."""
    if not hashes:
        return None
    digests = {name: hashlib.sha1() if name == "git-sha1" else hashlib.new(name)
               for name in hashes}
    if "git-sha1" in digests:  # git hashes a blob as "blob <size>\0<content>"
        digests["git-sha1"].update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            for digest in digests.values():
                digest.update(chunk)
    for name, (expected, header) in hashes.items():
        found = digests[name].hexdigest()
        if found != expected:
            return (f"its {name} is {found}, not the {expected} the server published in "
                    f"{header}")
    return None


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


HTTP_ERRORS = (urllib.error.URLError, OSError, http.client.HTTPException)
"""What `receive` raises when the server cannot be reached or breaks off (`HTTPError` is a
`URLError`; `GaveUp` an `OSError`)."""
