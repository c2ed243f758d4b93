"""A stand-in for the official weights bucket: an HTTP server on 127.0.0.1 serving a folder.

It answers Range requests (as the bucket does: 206, or 416 from the end of the file on),
records every request, and can be told to misbehave as mirrors and proxies do: cut a response
off, answer 200 with another body (an error page, garbage, a body cut short without a
Content-Length), trickle bytes, or hold a request until a test lets it fail. Synthetic
checkpoints are written at the official relative paths of `vit_keras.releases`.
"""

import functools
import http.server
import os
import threading
import time

import vit_keras

from conftest import randomize_weights

TRICKLE_LIMIT_SECONDS = 60
"""A trickling response ends after this long even if the client never gives up."""


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
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        with open(path, "rb") as f:
            data = f.read()
        if server.instead is not None:
            self._send_instead(*server.instead)
            return
        start = 0
        wanted = self.headers.get("Range")
        if wanted and server.honour_range:
            start = int(wanted.split("=")[1].split("-")[0])
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:]
        if server.trickle is not None:
            self._trickle(body, *server.trickle)
            return
        if server.cut_after is not None:  # the connection drops mid-file
            body, server.cut_after = body[:server.cut_after], None
        self.wfile.write(body)

    def _send_instead(self, body, content_length, content_type):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        if content_length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()  # without a Content-Length the body ends when the connection closes
        self.wfile.write(body)

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
        """Back to serving files as the bucket does."""
        server = self._server
        server.cut_after, server.honour_range, server.instead, server.trickle = None, True, None, None

    def cut_next_response_after(self, num_bytes):
        self._server.cut_after = num_bytes

    def ignore_range(self, ignore=True):
        self._server.honour_range = not ignore

    def answer_instead(self, body, content_length=True, content_type="application/octet-stream"):
        """Every request for an existing file gets 200 and `body` instead (an error page, garbage,
        a file cut short), with its Content-Length or, with `content_length=False`, none."""
        self._server.instead = (body, content_length, content_type)

    def trickle(self, num_bytes, pause):
        """Every file is sent `num_bytes` at a time with `pause` seconds between, until the client
        gives up (or `TRICKLE_LIMIT_SECONDS` pass)."""
        self._server.trickle = (num_bytes, pause)

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
    path = os.path.join(str(root), *vit_keras.releases.CLASS_NAME_FILES[dataset].split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(f"{dataset} class {i}\n" for i in range(count))
    return path

