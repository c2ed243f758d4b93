"""A stand-in for the official weights bucket: an HTTP server on 127.0.0.1 serving a folder.

It answers Range requests (as the bucket does: 206, or 416 from the end of the file on), records
every request, and can be told to misbehave as mirrors and proxies do: cut a response off, answer
200 with another body (an error page, garbage, a body cut short without a Content-Length), send one
file's body instead of another, send a Content-Length that is no number (or two that disagree),
trickle bytes (of the body, of the status line and headers, or of a chunk-size line), or hold a
request until a test lets it fail. It can publish the hashes the real servers publish: Google Cloud
Storage's `x-goog-hash: md5=...`, the Hugging Face hub's redirect of a large file to its storage
with the sha256 in `X-Linked-Etag` (and the git blob sha1 of a small file in its ETag), always of
the file it holds, whatever body it sends. Synthetic checkpoints are written at the official
relative paths of `vit_keras.releases`.
"""

import base64
import functools
import hashlib
import http.server
import os
import threading
import time

import vit_keras

from conftest import randomize_weights

TRICKLE_LIMIT_SECONDS = 60
"""A trickling response ends after this long even if the client never gives up."""
_CDN = "/cdn"


def _git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # noqa: N802 (http.server's naming)
        server = self.server
        server.requests.append((self.path, self.headers.get("Range")))
        if server.held:
            arrived, release, status = server.held.pop(0)
            arrived.set()
            release.wait(timeout=30)
            self.send_error(status)
            return
        redirected = self.path.startswith(_CDN + "/")
        name = self.path[len(_CDN):] if redirected else self.path
        path = self.translate_path(name)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        with open(path, "rb") as f:
            held = f.read()
        if server.hashes == "hub" and not redirected and not name.endswith(".json"):
            self._redirect_to_storage(name, held)
            return
        if server.instead is not None:
            self._send_instead(held, *server.instead)
            return
        data = server.replaced.get(name, held)
        start = 0
        wanted = self.headers.get("Range")
        if wanted and server.honour_range:
            start = int(wanted.split("=")[1].split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self._end_head()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self._publish_hashes(name, held)
        body = data[start:]
        if server.trickled_chunk_size is not None:
            self._send_chunked_then_trickle(body, *server.trickled_chunk_size)
            return
        for value in server.content_length or (str(len(body)),):
            self.send_header("Content-Length", value)
        self._end_head()
        if server.trickle is not None:
            self._trickle(body, *server.trickle)
            return
        if server.cut_after is not None:  # the connection drops mid-file
            body, server.cut_after = body[:server.cut_after], None
        self.wfile.write(body)

    def _publish_hashes(self, name, held):
        if self.server.hashes == "gcs":
            self.send_header("x-goog-hash", "md5=" + base64.b64encode(
                hashlib.md5(held).digest()).decode())
        elif self.server.hashes == "hub" and name.endswith(".json"):  # a file stored in git
            self.send_header("ETag", f'"{_git_blob_sha1(held)}"')

    def _redirect_to_storage(self, name, held):
        """What the hub answers for a file stored with Git LFS: a redirect to its storage, with
        the file's sha256 and size (and an ETag that is not the file's hash)."""
        self.send_response(302)
        self.send_header("Location", _CDN + name)
        sha256 = hashlib.sha256(held).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\n" \
                  f"size {len(held)}\n".encode()  # what git holds: its ETag is not the file's
        self.send_header("ETag", f'"{_git_blob_sha1(pointer)}"')
        self.send_header("X-Linked-Etag", f'"{sha256}"')
        self.send_header("X-Linked-Size", str(len(held)))
        self.send_header("Content-Length", "0")
        self._end_head()

    def _end_head(self):
        """Sends the status line and headers: at once, or a byte at a time if told to trickle."""
        if self.server.trickled_head is None:
            self.end_headers()
            return
        head = b"".join(self._headers_buffer) + b"\r\n"
        self._headers_buffer = []
        self._trickle(head, 1, self.server.trickled_head)

    def _send_instead(self, held, body, content_length, content_type):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self._publish_hashes(self.path, held)
        if content_length:
            self.send_header("Content-Length", str(len(body)))
        self._end_head()  # without a Content-Length the body ends when the connection closes
        self.wfile.write(body)

    def _send_chunked_then_trickle(self, body, pause, first_chunk):
        """A chunked body whose first chunk comes whole and whose next chunk-size line never ends:
        zeros, one every `pause` seconds (a valid size line has as many leading zeros as the
        server likes)."""
        self.send_header("Transfer-Encoding", "chunked")
        self._end_head()
        chunk = body[:first_chunk]
        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.flush()
        self._trickle(b"0" * (1 << 20), 1, pause)

    def _trickle(self, body, num_bytes, pause):
        stop = time.monotonic() + TRICKLE_LIMIT_SECONDS
        try:
            for start in range(0, len(body), num_bytes):
                if time.monotonic() > stop:
                    return
                self.wfile.write(body[start:start + num_bytes])
                self.wfile.flush()
                time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
            return


class MirrorServer:
    """Serves `root` at `url` until `stop()`; `requests` lists `(path, Range header)`."""

    def __init__(self, root):
        self.root = str(root)
        self._server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(_Handler, directory=self.root))
        self._server.requests, self._server.held = [], []
        self.behave()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def requests(self):
        return self._server.requests

    def behave(self):
        """Back to serving files as the bucket does (publishing no hash)."""
        server = self._server
        server.cut_after, server.honour_range, server.instead, server.trickle = None, True, None, None
        server.replaced, server.content_length, server.hashes = {}, None, None
        server.trickled_head, server.trickled_chunk_size = None, None

    def cut_next_response_after(self, num_bytes):
        self._server.cut_after = num_bytes

    def ignore_range(self, ignore=True):
        self._server.honour_range = not ignore

    def answer_instead(self, body, content_length=True, content_type="application/octet-stream"):
        """Every request for an existing file gets 200 and `body` instead (an error page, garbage,
        a file cut short), with its Content-Length or, with `content_length=False`, none."""
        self._server.instead = (body, content_length, content_type)

    def serve_instead(self, path, body):
        """Requests for the file at `path` (below the root) get `body` instead of the file, as a
        file (Range answered); the published hashes stay the file's."""
        self._server.replaced["/" + path] = body

    def send_content_length(self, *values):
        """Every file is sent with a header `Content-Length: value` for each of `values` (e.g.
        `"abc"`, or two that disagree)."""
        self._server.content_length = values

    def publish_hashes(self, style):
        """`"gcs"`: every file comes with Cloud Storage's `x-goog-hash: md5=<base64>`; `"hub"`:
        `.json` files come with the git blob sha1 as ETag, other files are redirected to
        `/cdn/<path>` with their sha256 in `X-Linked-Etag`, as the Hugging Face hub does."""
        self._server.hashes = style

    def trickle(self, num_bytes, pause):
        """Every file is sent `num_bytes` at a time with `pause` seconds between, until the client
        gives up (or `TRICKLE_LIMIT_SECONDS` pass)."""
        self._server.trickle = (num_bytes, pause)

    def trickle_head(self, pause):
        """The status line and headers of every response are sent one byte every `pause` seconds."""
        self._server.trickled_head = pause

    def trickle_chunk_size_line(self, pause, first_chunk=1024):
        """Every file is sent chunked: its first `first_chunk` bytes, then a chunk-size line that
        never ends (a zero every `pause` seconds)."""
        self._server.trickled_chunk_size = (pause, first_chunk)

    def hold_next_request(self, release, status):
        """The next request waits until the `threading.Event` `release` is set, then fails with
        HTTP `status` (nothing of the file is sent). Returns an event set when it arrives."""
        arrived = threading.Event()
        self._server.held.append((arrived, release, status))
        return arrived

    def stop(self):
        self._server.shutdown()
        self._server.server_close()


def write_release(root, release, seed=0):
    """Writes a randomly initialised checkpoint of `release`'s shapes at its official path below
    `root` (the npz layout of the original files); returns the file's path."""
    model = vit_keras.build_model(
        release.variant, image_size=release.image_size, num_classes=release.num_classes,
        representation_size=release.representation_size, include_preprocessing=False)
    randomize_weights(model, seed=seed, scale=0.05)
    path = os.path.join(str(root), *release.path.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    vit_keras.save_npz(model, path)
    return path


def write_class_names(root, dataset, count):
    """A synthetic class-name list (`"class 0"`, ...) at the path the release table names."""
    path = os.path.join(str(root), *vit_keras.weights.releases.CLASS_NAME_FILES[dataset].split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(f"{dataset} class {i}\n" for i in range(count))
    return path

