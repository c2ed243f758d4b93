"""A stand-in for the official weights bucket: an HTTP server on 127.0.0.1 serving a folder.

It answers Range requests (as the bucket does), records every request, and can be told to cut
the next responses off after some bytes, so tests can see downloads resume and caches hit.
Synthetic checkpoints are written at the official relative paths of `vit_keras.releases`.
"""

import functools
import http.server
import os
import threading

import vit_keras
from conftest import randomize_weights


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # noqa: N802 (http.server's naming)
        server = self.server
        server.requests.append((self.path, self.headers.get("Range")))
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        with open(path, "rb") as f:
            data = f.read()
        start = 0
        wanted = self.headers.get("Range")
        if wanted and server.honour_range:
            start = int(wanted.split("=")[1].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:]
        if server.cut_after is not None:  # the connection drops mid-file
            body, server.cut_after = body[:server.cut_after], None
        self.wfile.write(body)


class MirrorServer:
    """Serves `root` at `url` until `stop()`; `requests` lists `(path, Range header)`."""

    def __init__(self, root):
        self.root = str(root)
        self._server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(_Handler, directory=self.root))
        self._server.requests, self._server.cut_after, self._server.honour_range = [], None, True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def requests(self):
        return self._server.requests

    def cut_next_response_after(self, num_bytes):
        self._server.cut_after = num_bytes

    def ignore_range(self, ignore=True):
        self._server.honour_range = not ignore

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

