"""``GET``/``HEAD /agent/v1/images/NAME`` on a real callback server (loopback, PostgreSQL).

Installations are put in flight in the BMDB as the installer workflow does
(``bmdb.dispatch_installation``) and their tokens made with the fleet's answer key,
as the heartbeat answer hands them out; downloads are checked with curl (a client
independent of ours) and with urllib and http.client, byte for byte.

Measured speed (2 cores, loopback, a 1 GiB file of random bytes in the page cache,
``curl -o /dev/null``): one download 1.1-2.0 GB/s; eight at once 0.8-1.3 GB/s in all.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from starlette.applications import Starlette

import bmdb
from shepherd.agent.protocol import HEADER_MACHINE, HEARTBEAT_PATH
from shepherd.answer_key import AnswerKey
from shepherd.config import Settings
from shepherd.server import RunningServer, ServerLimits, serve
from shepherd.server.asgi_server import EventLoopServer, Listener, bind
from shepherd.server.images import ImageRoute
from shepherd.server.limits import LogThrottle
from shepherd.server.pool import Pool
from tests.support.agent_fixtures import add_machine, heartbeat_body, new_key, signed_headers
from tests.support.waiting import wait_until

PATH = "/agent/v1/images/"
SMALL = 3 * 1024 * 1024 + 12345  # not a multiple of the server's chunk
BIG = 64 * 1024 * 1024           # more than socket buffers and chunks in flight hold
DIGEST = "0" * 64
CATALOG = f"""
[[images]]
name = "disk"
file = "disk.raw"
sha256 = "{DIGEST}"
size = {SMALL}

[[images]]
name = "other"
file = "other.raw"
sha256 = "{DIGEST}"
size = 4096

[[images]]
name = "big"
file = "big.raw"
sha256 = "{DIGEST}"
size = {BIG}

[[images]]
name = "remote"
url = "http://images.example.net/remote.raw"
sha256 = "{DIGEST}"
size = 4096

[[images]]
name = "escape"
file = "escape.raw"
sha256 = "{DIGEST}"
size = 4096

[[images]]
name = "missing"
file = "missing.raw"
sha256 = "{DIGEST}"
size = 4096
"""


@dataclass
class Images:
    """The running server, its image directory and the BMDB it authorizes with."""

    server: RunningServer
    directory: Path
    db: bmdb.BMDB
    session: bmdb.Session

    def grant(self, image: str, machine_id: uuid.UUID | None = None
              ) -> tuple[uuid.UUID, str]:
        """A machine (new unless given) with an installation of ``image`` in flight, and
        the token its heartbeat answer would carry."""
        machine = machine_id or add_machine(self.session, None)

        def body(tx: bmdb.Tx) -> int:
            bmdb.want_installation(tx, machine, image=image, disk="serial=TEST", by="test",
                                   origin="operator", reason="image route test")
            return bmdb.dispatch_installation(tx, machine, {
                "kind": "image", "image": {"name": image, "served": True}})

        generation = self.session.transact(body)
        return machine, AnswerKey.from_bmdb(self.db).fetch_token(str(machine), generation,
                                                                 image)

    def url(self, name: str) -> str:
        return self.server.url + PATH + name

    def bytes_of(self, name: str) -> bytes:
        return (self.directory / f"{name}.raw").read_bytes()


def auth(machine: uuid.UUID | str, token: str) -> dict[str, str]:
    return {HEADER_MACHINE: str(machine), "Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def image_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image directory: a catalog, random files, one symlink leading out of it."""
    root = tmp_path_factory.mktemp("images")
    directory = root / "images"
    directory.mkdir()
    (directory / "catalog.toml").write_text(CATALOG)
    (directory / "disk.raw").write_bytes(os.urandom(SMALL))
    (directory / "other.raw").write_bytes(os.urandom(4096))
    with open(directory / "big.raw", "wb") as big:
        for _ in range(BIG // (4 << 20)):
            big.write(os.urandom(4 << 20))
    (root / "secret.raw").write_bytes(b"outside the image directory\n")
    (directory / "escape.raw").symlink_to(root / "secret.raw")
    return directory


@pytest.fixture
def images(pg_url: str, image_files: Path) -> Iterator[Images]:
    """A callback server with one heartbeat thread (downloads must not need it)."""
    db = bmdb.connect(pg_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    settings = Settings(bmdb_url=pg_url, serve_listen="127.0.0.1:0", serve_threads=1,
                        session_interval=2, image_dir=image_files)
    try:
        with db.start_session("test", interval=10) as session, \
                serve(settings, db=db) as running:
            yield Images(running, image_files, db, session)
    finally:
        db.close()


def fetch(url: str, headers: dict[str, str], method: str = "GET"
          ) -> tuple[int, dict[str, str], bytes]:
    """(status, headers by lower-case name, body), errors included."""
    request = urllib.request.Request(url, headers=headers, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=30) as answer:
            return answer.status, {k.lower(): v for k, v in answer.headers.items()}, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def curl(*args: str) -> subprocess.CompletedProcess[bytes]:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    return subprocess.run(["curl", "-sS", "--noproxy", "*", *args], capture_output=True,
                          timeout=60, check=False)


def curl_headers(machine: uuid.UUID, token: str) -> list[str]:
    return ["-H", f"{HEADER_MACHINE}: {machine}", "-H", f"Authorization: Bearer {token}"]


# -- downloads -----------------------------------------------------------------------


def test_curl_downloads_the_image_byte_for_byte(images: Images, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "shepherd.server")
    machine, token = images.grant("disk")
    out = tmp_path / "disk.raw"

    done = curl("-f", "-o", str(out), "-w", "%{http_code}", *curl_headers(machine, token),
                images.url("disk"))

    assert (done.returncode, done.stdout) == (0, b"200"), done.stderr
    assert out.read_bytes() == images.bytes_of("disk")
    wait_until(lambda: f"{SMALL} bytes in" in caplog.text, timeout=10)
    assert str(machine) in caplog.text
    assert token not in caplog.text


def test_curl_resumes_from_a_byte_with_a_range(images: Images, tmp_path: Path) -> None:
    machine, token = images.grant("disk")
    whole = images.bytes_of("disk")
    cut = 1_234_567
    tail = tmp_path / "tail"

    done = curl("-f", "-r", f"{cut}-", "-o", str(tail), "-D", "-", *curl_headers(machine, token),
                images.url("disk"))

    assert done.returncode == 0, done.stderr
    head = done.stdout.decode().lower()
    assert head.startswith("http/1.1 206")
    assert f"content-range: bytes {cut}-{SMALL - 1}/{SMALL}" in head
    assert whole[:cut] + tail.read_bytes() == whole


def test_urllib_ranges(images: Images) -> None:
    machine, token = images.grant("disk")
    whole, url = images.bytes_of("disk"), images.url("disk")

    status, headers, body = fetch(url, {**auth(machine, token), "Range": "bytes=100-199"})
    assert (status, headers["content-range"], headers["content-length"], body) == (
        206, f"bytes 100-199/{SMALL}", "100", whole[100:200])

    status, headers, body = fetch(url, {**auth(machine, token), "Range": f"bytes={SMALL - 10}-"})
    assert (status, body) == (206, whole[-10:])

    status, headers, body = fetch(url, {**auth(machine, token), "Range": "bytes=-5"})
    assert (status, headers["content-range"], body) == (
        206, f"bytes {SMALL - 5}-{SMALL - 1}/{SMALL}", whole[-5:])

    # An end past the file is clipped to it; several ranges get the whole file.
    status, _, body = fetch(url, {**auth(machine, token), "Range": f"bytes=5-{SMALL * 2}"})
    assert (status, body) == (206, whole[5:])
    status, _, body = fetch(url, {**auth(machine, token), "Range": "bytes=0-1,5-9"})
    assert (status, body) == (200, whole)


def test_a_range_of_another_version_gets_the_whole_file(images: Images) -> None:
    machine, token = images.grant("disk")
    status, headers, _ = fetch(images.url("disk"), auth(machine, token), "HEAD")
    assert status == 200

    same = fetch(images.url("disk"), {**auth(machine, token), "Range": "bytes=10-",
                                      "If-Range": headers["etag"]})
    stale = fetch(images.url("disk"), {**auth(machine, token), "Range": "bytes=10-",
                                       "If-Range": '"another-version"'})

    assert (same[0], len(same[2])) == (206, SMALL - 10)
    assert (stale[0], stale[2]) == (200, images.bytes_of("disk"))


def test_head_says_what_a_get_would_send(images: Images) -> None:
    machine, token = images.grant("disk")

    status, headers, body = fetch(images.url("disk"), auth(machine, token), "HEAD")
    assert (status, body) == (200, b"")
    assert headers["content-length"] == str(SMALL)
    assert headers["accept-ranges"] == "bytes"
    assert headers["content-type"] == "application/octet-stream"

    status, headers, body = fetch(images.url("disk"),
                                  {**auth(machine, token), "Range": "bytes=10-"}, "HEAD")
    assert (status, headers["content-length"], body) == (206, str(SMALL - 10), b"")


def test_a_range_past_the_end_is_416(images: Images) -> None:
    machine, token = images.grant("disk")
    for wanted in (f"bytes={SMALL}-", f"bytes={SMALL + 10}-{SMALL + 20}", "bytes=-0"):
        status, headers, _ = fetch(images.url("disk"),
                                   {**auth(machine, token), "Range": wanted})
        assert (status, headers.get("content-range")) == (416, f"bytes */{SMALL}"), wanted


# -- refusals ------------------------------------------------------------------------


def test_every_authorization_failure_is_the_same_401(images: Images) -> None:
    machine, token = images.grant("disk")
    other_machine, other_token = images.grant("disk")
    wrong_image_machine, wrong_image_token = images.grant("other")
    idle = add_machine(images.session, None)
    url = images.url("disk")
    attempts = {
        "no headers": {},
        "no token": {HEADER_MACHINE: str(machine)},
        "no machine": {"Authorization": f"Bearer {token}"},
        "machine not a uuid": auth("not-a-uuid", token),
        "not bearer": {HEADER_MACHINE: str(machine), "Authorization": f"Basic {token}"},
        "wrong token": auth(machine, token[:-2] + ("AA" if token[-2:] != "AA" else "BB")),
        "other machine's token": auth(machine, other_token),
        "token given to another machine": auth(other_machine, token),
        "token for another image": auth(wrong_image_machine, wrong_image_token),
        "no installation in flight": auth(idle, token),
        "unknown machine": auth(uuid.uuid4(), token),
    }

    answers = {}
    for why, headers in attempts.items():
        status, got, body = fetch(url, headers)
        answers[why] = (status, body, got.get("www-authenticate"))

    assert set(answers.values()) == {(401, b'{"error":"unauthorized"}', "Bearer")}, answers
    # The token for the other image still fetches that image.
    assert fetch(images.url("other"), auth(wrong_image_machine, wrong_image_token))[0] == 200


def test_an_installation_that_ended_takes_its_token_with_it(images: Images) -> None:
    machine, token = images.grant("disk")
    generation = images.session.transact(
        lambda tx: bmdb.installation_of(tx, machine).in_flight.generation)  # type: ignore[union-attr]
    assert fetch(images.url("disk"), auth(machine, token), "HEAD")[0] == 200

    images.session.transact(
        lambda tx: bmdb.settle_installation(tx, machine, generation, "installed"))

    assert fetch(images.url("disk"), auth(machine, token), "HEAD")[0] == 401


@pytest.mark.parametrize(("image", "cause"), [
    ("remote", "not by Shepherd"),
    ("missing", "cannot open"),
    ("escape", "leads out of the image directory"),
    ("unlisted", "not in the catalog"),
])
def test_images_shepherd_cannot_serve_are_404(images: Images, image: str, cause: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "shepherd.server")
    machine, token = images.grant(image)

    status, _, body = fetch(images.url(image), auth(machine, token))

    assert (status, body) == (404, b'{"error":"not found"}')
    wait_until(lambda: cause in caplog.text, timeout=10)


@pytest.mark.parametrize("target", [
    "..", "..%2Fcatalog.toml", "..%2F..%2Fsecret.raw", "%2E%2E", ".hidden", "a%00b",
    "disk.raw%2F..%2F..%2Fsecret.raw",
])
def test_paths_out_of_the_directory_are_404(images: Images, target: str) -> None:
    machine, token = images.grant("disk")
    connection = http.client.HTTPConnection(images.server.host, images.server.port, timeout=10)
    try:  # http.client sends the path as given: no client-side normalization
        connection.request("GET", PATH + target, headers=auth(machine, token))
        answer = connection.getresponse()
        assert answer.status == 404, answer.read()
    finally:
        connection.close()


def test_a_catalog_that_cannot_be_read_is_503(pg_url: str, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "shepherd.server")
    (tmp_path / "catalog.toml").write_text("[[images]\nname = ")
    db = bmdb.connect(pg_url)
    settings = Settings(bmdb_url=pg_url, serve_listen="127.0.0.1:0", image_dir=tmp_path)
    try:
        with db.start_session("test", interval=10) as session, \
                serve(settings, db=db) as running:
            shared = Images(running, tmp_path, db, session)
            machine, token = shared.grant("disk")
            status, _, body = fetch(shared.url("disk"), auth(machine, token))
    finally:
        db.close()
    assert (status, body) == (503, b'{"error":"image catalog unavailable"}')
    assert "catalog.toml" in caplog.text


def test_a_bmdb_that_does_not_answer_is_503(tmp_path: Path) -> None:
    """The route alone on a real listener, its authorizer the BMDB's failure (a real
    BMDB that does not answer is retried for half a minute first)."""

    def down(machine_id: uuid.UUID, token: str, image: str) -> bool:
        raise bmdb.Unavailable("connection refused")

    checks, reads = Pool(1, "test-check"), Pool(1, "test-read")
    route = ImageRoute(tmp_path, down, checks, reads, LogThrottle(logging.getLogger("test")))
    listener = Listener("agents", Starlette(routes=[route.route()]), bind("127.0.0.1", 0, 16),
                        ServerLimits.from_settings(Settings()))
    server = EventLoopServer()
    try:
        server.start([listener])
        status, headers, body = fetch(listener.url + PATH + "disk", auth(uuid.uuid4(), "t"))
    finally:
        server.stop()
        listener.sock.close()
        checks.close()
        reads.close()
    assert (status, body) == (503, b'{"error":"BMDB unavailable"}')
    assert headers["retry-after"]


# -- streaming beside heartbeats -----------------------------------------------------


def open_download(images: Images, image: str, first: int) -> tuple[http.client.HTTPConnection,
                                                                     http.client.HTTPResponse,
                                                                     hashlib._Hash]:
    """A download whose first ``first`` bytes are read (and hashed); the rest waits."""
    machine, token = images.grant(image)
    connection = http.client.HTTPConnection(images.server.host, images.server.port, timeout=30)
    connection.request("GET", PATH + image, headers=auth(machine, token))
    answer = connection.getresponse()
    assert answer.status == 200
    digest = hashlib.sha256(answer.read(first))
    return connection, answer, digest


@pytest.mark.timeout(60)
def test_heartbeats_are_answered_while_downloads_stream(images: Images) -> None:
    """Four downloads stalled by their readers (the extreme of a slow agent) with one
    heartbeat thread: a heartbeat and /healthz are answered before any finishes."""
    downloads = [open_download(images, "big", 1 << 20) for _ in range(4)]
    try:
        key, public = new_key()
        machine = add_machine(images.session, public)
        body = heartbeat_body(machine)
        beat = http.client.HTTPConnection(images.server.host, images.server.port, timeout=10)
        beat.request("POST", HEARTBEAT_PATH, body=body,
                     headers=signed_headers(key, machine, body))
        assert beat.getresponse().status == 200
        beat.close()
        assert fetch(images.server.url + "/healthz", {})[0] == 200

        # Still in flight: none of them can have been sent whole yet.
        assert all(not answer.isclosed() and answer.length and answer.length > BIG // 2
                   for _, answer, _ in downloads)
        expected = hashlib.sha256(images.bytes_of("big")).hexdigest()
        for _, answer, digest in downloads:
            digest.update(answer.read())
            assert digest.hexdigest() == expected
    finally:
        for connection, _, _ in downloads:
            connection.close()


def test_a_client_that_leaves_ends_its_download(images: Images,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "shepherd.server")
    connection, _, _ = open_download(images, "big", 1 << 20)
    connection.close()

    wait_until(lambda: "stopped: the client went away" in caplog.text, timeout=20)
