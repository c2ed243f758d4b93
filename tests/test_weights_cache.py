"""The weights cache never trusts junk. A hostile mirror on 127.0.0.1 answers 200 with an error
page, with garbage, with a corrupt or wrong checkpoint, with a body cut short and no
Content-Length, with a Content-Length that is no number, with another file than the hash it
publishes; it trickles bytes (of the body, of the status line and headers, of a chunk-size line),
and answers 416 to a `.part` longer than the file. Junk already in the cache, a `.part` file
planted as a link to a file outside the cache, two downloads of one file at once, and paths that
would leave the cache complete the picture. Every failure names the file or URL and what is
wrong, comes within the deadlines, and leaves nothing in the cache that a later call would trust
and nothing outside it changed.

All of it is HTTP and NumPy: the same answer on every backend, so one pass runs it."""

import io
import os
import re
import threading
import zipfile

import numpy as np
import pytest

import vit_keras
from vit_keras.weights import download, pretrained, releases

from conftest import run_app
from weights_mirror import MirrorServer, write_class_names, write_release

pytestmark = pytest.mark.backend_independent

RELEASE = releases.find_release("ViT-Ti/16", "augreg_in21k_ft_in1k", 224)


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """The release as a synthetic checkpoint at its official path, served on 127.0.0.1."""
    root = tmp_path_factory.mktemp("bucket")
    with open(write_release(root, RELEASE), "rb") as f:
        content = f.read()
    server = MirrorServer(root)
    yield server, content
    server.stop()


@pytest.fixture
def mirror(bucket, tmp_path, monkeypatch):
    """The bucket's server, well-behaved until a test says otherwise, and an empty cache."""
    server, content = bucket
    monkeypatch.setenv(download.HOME_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setenv(download.MIRROR_VARIABLE, server.url)
    server.behave()
    del server.requests[:]
    yield server, content
    server.behave()


def _load_release():
    """What `build_model(RELEASE.variant, weights=RELEASE.name)` downloads, checks and reads."""
    return pretrained.resolve_weights(RELEASE.name, RELEASE.variant, RELEASE.image_size)


def _cached():
    return download.cache_path(RELEASE.path)


def _url(server):
    return server.url + RELEASE.path


def _npz(arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _arrays(content):
    with np.load(io.BytesIO(content)) as archive:
        return {key: archive[key] for key in archive.files}


def _assert_refused_and_nothing_cached(server, *patterns):
    with pytest.raises(download.InvalidFileError) as refused:
        _load_release()
    message = str(refused.value)
    assert _url(server) in message and "not cached" in message, message
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    assert not os.path.exists(_cached())
    assert not os.path.exists(_cached() + ".part")  # a resume would only repeat the problem
    return message


def _assert_loads_once_the_server_behaves(server, content):
    server.behave()
    checkpoint, release = _load_release()
    assert release == RELEASE and checkpoint.path == _cached()
    with open(_cached(), "rb") as f:
        assert f.read() == content


# --- A body that is not the file ---------------------------------------------------------------

def test_an_html_error_page_sent_with_200_is_not_cached(mirror):
    server, content = mirror
    server.answer_instead(b"<!DOCTYPE html>\n<html><body><h1>502 Bad Gateway</h1></body></html>",
                          content_type="text/html")
    _assert_refused_and_nothing_cached(server, "HTML page", "Unrecognised checkpoint format")
    _assert_loads_once_the_server_behaves(server, content)


def test_garbage_sent_with_200_is_not_cached(mirror):
    server, content = mirror
    garbage = b"\x00" + np.random.default_rng(0).bytes(len(content) - 1)  # no format starts so
    server.answer_instead(garbage)
    _assert_refused_and_nothing_cached(server, "Unrecognised checkpoint format")
    _assert_loads_once_the_server_behaves(server, content)


def test_a_file_with_a_corrupt_array_is_not_cached(mirror):
    server, content = mirror
    corrupt = bytearray(content)
    corrupt[len(corrupt) // 2] ^= 0xFF  # inside an array's data: only its CRC-32 tells
    server.answer_instead(bytes(corrupt))
    _assert_refused_and_nothing_cached(server, "corrupt .npz", "CRC")


def test_a_body_cut_short_without_content_length_is_not_cached(mirror):
    server, content = mirror
    server.answer_instead(content[:len(content) // 2], content_length=False)
    _assert_refused_and_nothing_cached(server, "truncated or corrupt")
    _assert_loads_once_the_server_behaves(server, content)


def test_another_releases_checkpoint_is_not_cached(mirror):
    server, content = mirror
    arrays = _arrays(content)
    arrays["head/kernel"], arrays["head/bias"] = arrays["head/kernel"][:, :10], arrays[
        "head/bias"][:10]
    server.answer_instead(_npz(arrays))
    _assert_refused_and_nothing_cached(
        server, re.escape(f"does not hold the {RELEASE.spec} weights: num_classes 10 (expected "
                          f"1000)"))


def test_a_checkpoint_with_arrays_of_impossible_shapes_is_not_cached(mirror):
    server, content = mirror
    arrays = _arrays(content)
    arrays["Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"] = np.zeros(3, "float32")
    server.answer_instead(_npz(arrays))
    _assert_refused_and_nothing_cached(server, "not a well-formed ViT checkpoint")


def test_a_checkpoint_with_nan_is_not_cached(mirror):
    server, content = mirror
    arrays = _arrays(content)
    arrays["Transformer/encoder_norm/scale"][3] = np.nan
    server.answer_instead(_npz(arrays))
    _assert_refused_and_nothing_cached(server, "NaN or Inf values in 1 array "
                                               r"\(Transformer/encoder_norm/scale\)")


# --- Resuming ----------------------------------------------------------------------------------

def test_a_junk_part_file_is_downloaded_again_from_the_start_in_the_same_call(mirror):
    """A `.part` file an earlier call left (here what a proxy sent before the connection dropped)
    is resumed; when the result fails its check, the file is downloaded again from its first
    byte at once, not reported as the server's fault."""
    server, content = mirror
    junk = b"<html>proxy error</html>"
    os.makedirs(os.path.dirname(_cached()))
    with open(_cached() + ".part", "wb") as f:
        f.write(junk)
    checkpoint, _ = _load_release()
    assert [rng for _, rng in server.requests] == [f"bytes={len(junk)}-", None]
    assert checkpoint.path == _cached()
    with open(_cached(), "rb") as f:
        assert f.read() == content
    assert not os.path.exists(_cached() + ".part")


def test_a_server_that_keeps_sending_junk_after_a_resume_is_blamed(mirror):
    server, _ = mirror
    page = b"<html><body>" + b"proxy error " * 20 + b"</body></html>"
    os.makedirs(os.path.dirname(_cached()))
    with open(_cached() + ".part", "wb") as f:
        f.write(page[:24])
    server.serve_instead(RELEASE.path, page)  # as a file: Range answered
    _assert_refused_and_nothing_cached(server, "HTML page")
    assert [rng for _, rng in server.requests] == ["bytes=24-", None]  # resumed, then started over


def test_416_for_a_part_file_longer_than_the_file_starts_the_download_over(mirror):
    server, content = mirror
    left_over = b"the end of a longer version of the file"
    os.makedirs(os.path.dirname(_cached()))
    with open(_cached() + ".part", "wb") as f:
        f.write(content + left_over)
    checkpoint, _ = _load_release()
    assert [rng for _, rng in server.requests] == [f"bytes={len(content) + len(left_over)}-", None]
    with open(checkpoint.path, "rb") as f:
        assert f.read() == content
    assert not os.path.exists(_cached() + ".part")


def test_a_trickling_server_is_given_up_and_the_part_file_kept_for_a_resume(mirror, monkeypatch):
    server, content = mirror
    # The real bound is 64 KB in 30 s; a shorter window keeps the test short. The server sends at
    # most 64 bytes per 10 ms (6.4 KB/s), far below 64 KB per 0.5 s however loaded the machine.
    monkeypatch.setenv(download.PROGRESS_WINDOW_VARIABLE, "0.5")
    server.trickle(64, 0.01)
    with pytest.raises(download.WeightsUnavailableError) as slow:
        _load_release()
    message = str(slow.value)
    assert not isinstance(slow.value, download.InvalidFileError)
    assert _url(server) in message, message
    assert re.search(r"only \d+ bytes arrived in 0.5 s, fewer than the 65536 required per 0.5 s "
                     r"\(VIT_KERAS_DOWNLOAD_PROGRESS_WINDOW\)", message), message
    assert not os.path.exists(_cached())
    arrived = os.path.getsize(_cached() + ".part")
    assert 0 < arrived < len(content)
    _assert_loads_once_the_server_behaves(server, content)
    assert server.requests[-1][1] == f"bytes={arrived}-"


def test_a_server_that_trickles_its_status_line_and_headers_is_given_up_by_the_deadline(
        mirror, monkeypatch):
    """A byte of the status line and headers every 50 ms: each read gets a byte long before the
    5 s socket timeout, and no byte of the file ever arrives. Without a deadline the ~100 bytes
    of head take 5 s to arrive, and then the file downloads."""
    server, _ = mirror
    monkeypatch.setenv(download.DEADLINE_VARIABLE, "1")
    server.trickle_head(0.05)
    with pytest.raises(download.WeightsUnavailableError) as late:
        _load_release()
    message = str(late.value)
    assert _url(server) in message and download.cache_path(RELEASE.path) in message, message
    assert "the download did not finish within 1 s (VIT_KERAS_DOWNLOAD_DEADLINE)" in message, \
        message
    assert not os.path.exists(_cached()) and not os.path.exists(_cached() + ".part")


def test_a_server_that_trickles_a_chunk_size_line_is_given_up_by_the_progress_rule(
        mirror, monkeypatch):
    """A chunked body whose second chunk-size line never ends (a zero every 50 ms): the read of
    that line blocks, so a rule checked between reads never runs; the watchdog's does."""
    server, content = mirror
    monkeypatch.setenv(download.PROGRESS_WINDOW_VARIABLE, "0.5")
    server.trickle_chunk_size_line(0.05, first_chunk=1000)
    with pytest.raises(download.WeightsUnavailableError) as late:
        _load_release()
    message = str(late.value)
    assert re.search(r"only \d+ bytes arrived in 0.5 s, fewer than the 65536 required", message), \
        message
    assert os.path.getsize(_cached() + ".part") == 1000  # kept for a resume
    _assert_loads_once_the_server_behaves(server, content)


@pytest.mark.parametrize("variable", [download.DEADLINE_VARIABLE,
                                      download.PROGRESS_WINDOW_VARIABLE])
# 1e308 s overflowed the watchdog's wait (OverflowError), killing it: a trickle then held on.
@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "1e308"])
def test_a_deadline_setting_that_is_not_a_number_of_seconds_is_named(mirror, monkeypatch,
                                                                     variable, value):
    server, _ = mirror
    monkeypatch.setenv(variable, value)
    with pytest.raises(download.DownloadSettingError,
                       match=f"{variable}={value!r} is not a positive number of seconds"):
        _load_release()
    assert server.requests == []


def test_a_content_length_that_is_not_a_number_is_a_download_error(mirror):
    server, content = mirror
    server.send_content_length("abc")
    with pytest.raises(download.WeightsUnavailableError) as refused:
        _load_release()
    message = str(refused.value)
    assert _url(server) in message and "invalid Content-Length, 'abc'" in message, message
    assert not os.path.exists(_cached()) and not os.path.exists(_cached() + ".part")
    _assert_loads_once_the_server_behaves(server, content)


def test_conflicting_content_lengths_are_a_download_error_and_nothing_is_cached(mirror):
    """http.client reads as many bytes as the first header says: a 5-byte file was cached."""
    server, content = mirror
    server.send_content_length("5", str(len(content)))
    with pytest.raises(download.WeightsUnavailableError) as refused:
        download.fetch(RELEASE.path, progress=False)
    message = str(refused.value)
    assert _url(server) in message and "conflicting Content-Length headers" in message, message
    assert not os.path.exists(_cached()) and not os.path.exists(_cached() + ".part")


@pytest.mark.parametrize("content_length", [True, False], ids=["length", "no-length"])
def test_a_file_over_the_size_cap_is_refused_until_the_cap_is_raised(mirror, monkeypatch,
                                                                     content_length):
    """Without a Content-Length a body of any size was cached (314 MB of zeros)."""
    server, content = mirror
    server.answer_instead(content, content_length=content_length)
    monkeypatch.setenv(download.MAX_BYTES_VARIABLE, "1000")
    with pytest.raises(download.WeightsUnavailableError) as refused:
        download.fetch(RELEASE.path, progress=False)
    message = str(refused.value)
    assert _url(server) in message and "over the 1000 bytes a download may take " \
        "(VIT_KERAS_DOWNLOAD_MAX_BYTES)" in message, message
    assert not os.path.exists(_cached()) and not os.path.exists(_cached() + ".part")
    monkeypatch.setenv(download.MAX_BYTES_VARIABLE, str(len(content)))
    with open(download.fetch(RELEASE.path, progress=False), "rb") as f:
        assert f.read() == content


def test_a_size_cap_that_is_not_a_number_of_bytes_is_named(mirror, monkeypatch):
    server, _ = mirror
    monkeypatch.setenv(download.MAX_BYTES_VARIABLE, "-1")
    with pytest.raises(download.DownloadSettingError,
                       match="VIT_KERAS_DOWNLOAD_MAX_BYTES='-1' is not a positive number of bytes"):
        _load_release()
    assert server.requests == []


# --- Links planted in the cache ------------------------------------------------------------------

@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "no-range"])
def test_a_part_file_planted_as_a_link_outside_the_cache_is_refused_not_written_through(
        mirror, tmp_path, honour_range):
    """A mirror that honours Range would append the file to the link's target; one that does not
    would truncate and replace it; and the rename would make the cache entry a link to it."""
    server, content = mirror
    server.ignore_range(not honour_range)
    outside = tmp_path / "thesis.tex"
    outside.write_bytes(b"\\documentclass{article} years of work")
    os.makedirs(os.path.dirname(_cached()))
    os.symlink(outside, _cached() + ".part")
    with pytest.raises(download.WeightsUnavailableError) as refused:
        _load_release()
    message = str(refused.value)
    assert f"{_cached()}.part is a symbolic link to {outside}" in message, message
    assert "never writes through a link" in message and "Remove" in message, message
    assert outside.read_bytes() == b"\\documentclass{article} years of work"
    assert os.path.islink(_cached() + ".part") and not os.path.lexists(_cached())
    assert server.requests == []


def test_a_part_file_planted_as_a_hard_link_is_refused_not_written_through(mirror, tmp_path):
    server, _ = mirror
    outside = tmp_path / "notes.txt"
    outside.write_bytes(b"mine")
    os.makedirs(os.path.dirname(_cached()))
    os.link(outside, _cached() + ".part")
    with pytest.raises(download.WeightsUnavailableError, match="is a hard link to another file"):
        _load_release()
    assert outside.read_bytes() == b"mine" and not os.path.lexists(_cached())
    assert server.requests == []


# --- Hashes the server publishes -----------------------------------------------------------------

@pytest.mark.parametrize("style,published", [("gcs", r"md5 is [0-9a-f]{32}, not the [0-9a-f]{32} "
                                                     r"the server published in x-goog-hash"),
                                             ("hub", r"sha256 is [0-9a-f]{64}, not the [0-9a-f]{64}"
                                                     r" the server published in X-Linked-Etag")])
def test_other_weights_of_the_same_architecture_are_refused_by_the_published_hash(
        mirror, style, published):
    """A random ViT-Ti/16 of the release's every shape is a well-formed release file: only the
    hash the server publishes for the file (Cloud Storage's md5, the hub's sha256 on its
    redirect to storage) tells it apart."""
    server, content = mirror
    other = _arrays(content)
    rng = np.random.default_rng(1)
    other = {key: rng.normal(0, 0.05, value.shape).astype(value.dtype)
             for key, value in other.items()}
    server.publish_hashes(style)
    server.serve_instead(RELEASE.path, _npz(other))
    _assert_refused_and_nothing_cached(server, published)
    server.serve_instead(RELEASE.path, content)
    checkpoint, _ = _load_release()  # the file the hash is of
    assert checkpoint.path == _cached()
    if style == "hub":
        assert [path for path, _ in server.requests[-2:]] == ["/" + RELEASE.path,
                                                             "/cdn/" + RELEASE.path]


def test_a_resumed_download_that_does_not_match_the_published_hash_is_started_over(mirror):
    server, content = mirror
    server.publish_hashes("gcs")
    os.makedirs(os.path.dirname(_cached()))
    with open(_cached() + ".part", "wb") as f:
        f.write(b"\0" * 100)  # as long as the file's first bytes, but not them
    checkpoint, _ = _load_release()
    assert [rng for _, rng in server.requests] == ["bytes=100-", None]
    with open(checkpoint.path, "rb") as f:
        assert f.read() == content


# --- Memory bombs ---------------------------------------------------------------------------------

def test_an_npz_whose_header_claims_37_gib_is_refused_and_its_part_file_deleted(mirror):
    """A few hundred bytes whose array header says (100000, 100000) float32: NumPy would allocate
    37 GiB before reading."""
    server, content = mirror
    arrays = _arrays(content)
    del arrays["Transformer/encoder_norm/bias"]
    buffer = io.BytesIO(_npz(arrays))
    with zipfile.ZipFile(buffer, "a") as archive:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": "<f4", "fortran_order": False, "shape": (100_000, 100_000)})
        archive.writestr("Transformer/encoder_norm/bias.npy", header.getvalue() + b"\0" * 64)
    server.answer_instead(buffer.getvalue())
    _assert_refused_and_nothing_cached(
        server, r"array 'Transformer/encoder_norm/bias' claims \(100000, 100000\) float32 "
                r"\(40000000000 bytes\) but the archive holds 64 bytes of it")


# --- What is already on disk ---------------------------------------------------------------------

def test_a_junk_file_in_the_cache_is_named_with_what_to_do(mirror):
    server, _ = mirror
    os.makedirs(os.path.dirname(_cached()))
    with open(_cached(), "wb") as f:
        f.write(b"<html>captive portal</html>")  # placed by hand, or cached by an older version
    with pytest.raises(download.InvalidFileError) as refused:
        vit_keras.build_model(RELEASE.variant, weights=RELEASE.name)
    message = str(refused.value)
    assert f"The cached file {_cached()} is not a valid '{RELEASE.path}'" in message, message
    assert "Unrecognised checkpoint format" in message and "Delete it" in message, message
    assert server.requests == []  # a cached file is used without the network


def test_two_downloads_of_one_file_share_its_part_file_when_the_first_gets_nothing(
        mirror, monkeypatch):
    """The first download fails before any byte (here a 503; a timeout is the same) while a
    second waits for the `.part` file's lock: the second must still download the file."""
    server, content = mirror
    let_first_fail = threading.Event()
    first_arrived = server.hold_next_request(let_first_fail, 503)
    second_waits = threading.Event()
    lock = download._lock

    def lock_noting_the_second(file):
        if threading.current_thread().name == "second":
            second_waits.set()  # it has opened the .part: it holds that file from here on
        lock(file)

    monkeypatch.setattr(download, "_lock", lock_noting_the_second)
    outcomes = {}

    def fetch():
        try:
            outcomes[threading.current_thread().name] = download.fetch(RELEASE.path,
                                                                        progress=False)
        except download.WeightsUnavailableError as error:
            outcomes[threading.current_thread().name] = error

    first = threading.Thread(target=fetch, name="first")
    second = threading.Thread(target=fetch, name="second")
    first.start()
    assert first_arrived.wait(timeout=30)
    second.start()
    assert second_waits.wait(timeout=30)
    let_first_fail.set()
    first.join(timeout=60)
    second.join(timeout=60)
    assert isinstance(outcomes["first"], download.WeightsUnavailableError)
    assert "HTTP 503" in str(outcomes["first"])
    assert outcomes["second"] == _cached(), outcomes["second"]
    with open(_cached(), "rb") as f:
        assert f.read() == content
    assert not os.path.exists(_cached() + ".part")


# --- Paths ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["../escaped.npz", "vit_models/../../escaped.npz",
                                  "/tmp/escaped.npz", "vit_models//x.npz", "./x.npz"])
def test_a_path_that_leaves_the_bucket_is_refused(mirror, tmp_path, monkeypatch, path):
    server, _ = mirror
    with open(os.path.join(server.root, "escaped.npz"), "wb") as f:
        f.write(b"anything")
    try:
        with pytest.raises(ValueError, match="is not a file path below the bucket"):
            download.fetch(path, progress=False)
        assert server.requests == []
        assert not os.path.exists(tmp_path / "escaped.npz")
        monkeypatch.setenv(download.MIRROR_VARIABLE, server.root)  # a mirror folder
        with pytest.raises(ValueError, match="is not a file path below the bucket"):
            download.fetch(path, progress=False)
    finally:
        os.remove(os.path.join(server.root, "escaped.npz"))


# --- Class names come through the same checks ---------------------------------------------------

def test_an_error_page_instead_of_the_imagenet21k_class_names_is_not_cached(mirror):
    server, _ = mirror
    list_path = releases.CLASS_NAME_FILES["imagenet21k"]
    write_class_names(server.root, "imagenet21k", 21843)
    server.answer_instead(b"<html><body>404 Not Found</body></html>", content_type="text/html")
    with pytest.raises(download.InvalidFileError, match=r"has 1 names, not the 21843"):
        vit_keras.class_names("imagenet21k")
    assert not os.path.exists(download.cache_path(list_path))
    server.behave()
    assert len(vit_keras.class_names("augreg_in21k")) == 21843


# --- The apps report it as a user error ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("junk_in", ["download", "cache"])
def test_an_app_given_junk_stops_with_one_error_line(mirror, tmp_path, junk_in):
    server, _ = mirror
    page = b"<html><body>Service Unavailable</body></html>"
    if junk_in == "download":
        server.answer_instead(page, content_type="text/html")
        expected = f"ERROR: The file downloaded from {_url(server)} is not a valid"
    else:
        os.makedirs(os.path.dirname(_cached()))
        with open(_cached(), "wb") as f:
            f.write(page)
        expected = f"ERROR: The cached file {_cached()} is not a valid"
    result = run_app("convert.py", "--weights", RELEASE.name, "--model", RELEASE.variant,
                     "--out", str(tmp_path / "x.keras"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (junk_in == "cache") == os.path.exists(_cached())  # only the user's own file stays
