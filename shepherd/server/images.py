"""``GET`` and ``HEAD /agent/v1/images/{name}``: the catalog's images, to the agents
installing them (``shepherd.images`` is the catalog; README, "Installing an operating system").

Who may fetch: a request names its machine (``X-Shepherd-Machine``) and the token of
that machine's installation (``Authorization: Bearer``); it is allowed only while that
machine has an installation in flight for that image with that token (the injected
``Authorizer``; in ``shepherd serve``, ``bmdb_authorizer``: the BMDB's installation in
flight and the answer key's MAC). Every reason to refuse is the same 401, so a prober
learns nothing about which part was wrong.

The order of the checks is the point: authorization comes before the catalog and the
file, so a client without a token learns nothing about the catalog either (not even
whether a name is listed); only a name outside the catalog's alphabet is refused
before (404: no image can have it). Then the catalog, read again for each request
(an operator's edit counts at once; a catalog that cannot be read is 503, its cause
logged): a name it does not list, or one it says another server serves (``url``), is
404. Last the file, which must resolve inside the image directory (a symlink leading
out of it is refused) and be a regular file: otherwise 404, the cause logged.

Ranges: one range, ``bytes=N-``, ``bytes=N-M`` or ``bytes=-N`` (an agent resuming an
interrupted fetch), is answered 206 with ``Content-Range``; one that starts past the
end is 416. Several ranges, or a header this does not parse, are ignored (the whole
file, 200), as RFC 9110 allows; so is a range whose ``If-Range`` names another
version of the file (its ``ETag`` or ``Last-Modified``), so a resumed fetch never
splices two versions together.

Speed: the file is read in ``CHUNK``-byte ``os.pread`` calls in a pool of its own
(``reads``), the next chunk read while the previous one is written, and each chunk is
handed to the transport whole. Why not Starlette's ``FileResponse``: its 64 KiB
chunks, each a thread hop and an event-loop turn, cap one download well below what
loopback and a disk give. Why not ``sendfile``: uvicorn's protocol hides the
transport, and large reads already run at several hundred MB/s per download (see the
report in tests/server/test_images_route.py).

Threads: the authorization's BMDB read and the catalog run in ``checks``, the file's
reads in ``reads``; neither is the heartbeats' pool, and no thread is held while a
download waits for its client (a slow agent holds only its socket buffer and one
chunk), so heartbeats never queue behind downloads.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import bmdb
from shepherd.agent.protocol import HEADER_MACHINE, IMAGES_PATH
from shepherd.answer_key import AnswerKey
from shepherd.images import NAME_PATTERN, Catalog, CatalogError, UnknownImage
from shepherd.runtime import Runtime
from shepherd.server.asgi import UNAUTHORIZED, UNAVAILABLE, Answer, RequestHeaders
from shepherd.server.limits import LogThrottle, clip
from shepherd.server.pool import Pool

log = logging.getLogger("shepherd.server.images")

IMAGES_ROUTE = IMAGES_PATH + "{name}"
#: Bytes per read and per write to the transport: large enough that the per-chunk
#: costs (a thread hop, an event-loop turn) vanish beside the copy.
CHUNK = 4 << 20
#: The longest token a request may send (an installation's token is far shorter).
MAX_TOKEN = 512
#: Who may fetch: (machine, token, image name) -> allowed. Blocking (a BMDB read).
Authorizer = Callable[[uuid.UUID, str, str], bool]

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def bmdb_authorizer(runtime: Runtime, key: Callable[[], AnswerKey]) -> Authorizer:
    """Allowed while the machine's installation in flight is of this image, served by
    Shepherd (``bmdb.served_image_in_flight``), and the token is that installation's
    (``AnswerKey.fetch_allowed``: a MAC of machine, generation and image, compared in
    constant time). ``key``: the fleet's answer key (``AnswerSigner.key``, cached)."""

    def allowed(machine_id: uuid.UUID, token: str, image: str) -> bool:
        flight = runtime.transact(lambda tx: bmdb.served_image_in_flight(tx, machine_id))
        if flight is None:
            return False
        generation, name = flight
        return key().fetch_allowed(token, str(machine_id), generation, image) and name == image

    return allowed


class Refused(Exception):
    """The request gets ``answer`` instead of the image; ``why`` is logged (never sent)."""

    def __init__(self, answer: Answer, why: str, level: int = logging.INFO) -> None:
        super().__init__(why)
        self.answer = answer
        self.why = why
        self.level = level


def not_found(why: str, level: int = logging.INFO) -> Refused:
    return Refused(Answer.json(404, {"error": "not found"}), why, level)


def unauthorized(why: str) -> Refused:
    return Refused(Answer.json(401, UNAUTHORIZED, {"www-authenticate": "Bearer"}), why)


def unavailable(error: str, why: str) -> Refused:
    return Refused(Answer.json(503, {"error": error}, {"retry-after": "5"}), why,
                   logging.WARNING)


@dataclass(frozen=True)
class Credentials:
    """What a request says about itself; the token is never logged."""

    machine_id: uuid.UUID
    token: str = ""

    def __repr__(self) -> str:
        return f"Credentials({self.machine_id})"

    @classmethod
    def of(cls, headers: RequestHeaders) -> Credentials:
        """``Refused`` (401) unless both headers are there and well formed."""
        try:
            machine_id = uuid.UUID(headers.get(HEADER_MACHINE) or "")
        except ValueError:
            raise unauthorized("no machine id, or not a UUID") from None
        scheme, _, token = (headers.get("authorization") or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN:
            raise unauthorized(f"machine {machine_id}: no bearer token")
        return cls(machine_id, token)


@dataclass
class ImageFile:
    """A served image's file, open: what one answer sends (even if the file is replaced
    meanwhile, this answer sends the version it opened)."""

    name: str
    file: Any  # io.FileIO
    size: int
    etag: str
    modified: str
    #: The read running in a thread, if any: ``close`` waits for it.
    reading: asyncio.Future[bytes] | None = None

    @classmethod
    def open(cls, directory: Path, name: str, file: str) -> ImageFile:
        """Resolved inside ``directory`` (symlinks followed, then checked), a regular file."""
        root = directory.resolve()
        path = (root / file).resolve()
        if not path.is_relative_to(root):
            raise not_found(f"image {name}: {directory / file} leads out of the image "
                            f"directory (to {path})", logging.WARNING)
        try:
            handle = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by ``close``
        except OSError as error:
            raise not_found(f"image {name}: cannot open {path}: {error.strerror}",
                            logging.WARNING) from None
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            handle.close()
            raise not_found(f"image {name}: {path} is not a regular file", logging.WARNING)
        return cls(name, handle, status.st_size,
                   f'"{status.st_ino:x}-{status.st_size:x}-{status.st_mtime_ns:x}"',
                   email.utils.formatdate(status.st_mtime, usegmt=True))

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self.file.fileno(), size, offset)

    def close(self) -> None:
        """Close the file, but not under a read still running in a thread (its
        descriptor could meanwhile be another file's): then once that read is done."""
        reading, self.reading = self.reading, None
        if reading is None or reading.done():
            self.file.close()
        else:
            reading.add_done_callback(self._closed_after)

    def _closed_after(self, reading: asyncio.Future[bytes]) -> None:
        if not reading.cancelled():
            reading.exception()  # retrieved: the answer has ended, nobody else wants it
        self.file.close()


@dataclass(frozen=True)
class Span:
    """The bytes an answer sends: ``start`` to ``end`` (exclusive) of a ``size``-byte file."""

    start: int
    end: int
    size: int
    partial: bool

    @property
    def length(self) -> int:
        return self.end - self.start


class Unsatisfiable(Exception):
    """The range starts at or past the end of the file (416)."""


def span_of(header: str | None, if_range: str | None, image: ImageFile) -> Span:
    """What to send for a ``Range`` header (see the module docstring); ``Unsatisfiable``."""
    whole = Span(0, image.size, image.size, partial=False)
    if header is None or (if_range is not None
                          and if_range.strip() not in (image.etag, image.modified)):
        return whole
    match = _RANGE.match(header.replace(" ", ""))
    if match is None:
        return whole  # several ranges or garbage: the whole file, as RFC 9110 allows
    first, last = match.groups()
    if not first:
        if not last:
            return whole
        suffix = int(last)
        if suffix == 0 or image.size == 0:
            raise Unsatisfiable()
        return Span(max(0, image.size - suffix), image.size, image.size, partial=True)
    start = int(first)
    if last and int(last) < start:
        return whole  # bytes=9-3 is no range at all: RFC 9110 says ignore it
    if start >= image.size:
        raise Unsatisfiable()
    end = image.size if not last else min(int(last) + 1, image.size)
    return Span(start, end, image.size, partial=True)


class ImageRoute:
    """The route, as a bare ASGI app (its path parameter from Starlette's router)."""

    def __init__(self, image_dir: Path, authorize: Authorizer, checks: Pool, reads: Pool,
                 refusals: LogThrottle) -> None:
        self.image_dir = image_dir
        self.authorize = authorize
        self.checks = checks
        self.reads = reads
        self.refusals = refusals

    def route(self) -> Route:
        return Route(IMAGES_ROUTE, self, methods=["GET", "HEAD"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope["path_params"]["name"]
        client = scope.get("client")
        peer = clip(client[0] if client else "?")
        headers = RequestHeaders.of(scope)
        try:
            if not NAME_PATTERN.match(name):
                raise not_found(f"image name {clip(name)!r} is not one the catalog allows")
            who = Credentials.of(headers)
            image = await self.checks.run(lambda: self.check(who, name))
        except Refused as refusal:
            self.refusals(refusal.level, "image %s refused to %s: %s", clip(name), peer,
                          refusal.why)
            await refusal.answer.send(send)
            return
        try:
            await self.answer(scope, receive, send, image, who, headers, peer)
        finally:
            image.close()

    def check(self, who: Credentials, name: str) -> ImageFile:
        """Authorization, then the catalog, then the file (blocking: in ``checks``)."""
        try:
            allowed = self.authorize(who.machine_id, who.token, name)
        except UNAVAILABLE as error:
            raise unavailable("BMDB unavailable",
                              f"BMDB unavailable: {type(error).__name__}") from None
        if not allowed:
            raise unauthorized(f"machine {who.machine_id} has no installation of this "
                               "image with this token in flight")
        try:
            catalog = Catalog.load(self.image_dir)
            image = catalog.get(name)
        except CatalogError as error:
            raise unavailable("image catalog unavailable", str(error)) from None
        except UnknownImage as error:
            raise not_found(str(error)) from None
        if image.file is None:
            raise not_found(f"image {name} is served by {clip(image.url)}, not by Shepherd")
        return ImageFile.open(self.image_dir, name, image.file)

    async def answer(self, scope: Scope, receive: Receive, send: Send, image: ImageFile,
                     who: Credentials, headers: RequestHeaders, peer: str) -> None:
        try:
            span = span_of(headers.get("range"), headers.get("if-range"), image)
        except Unsatisfiable:
            await Answer.json(416, {"error": "range not satisfiable"},
                              {"content-range": f"bytes */{image.size}"}).send(send)
            return
        await send({"type": "http.response.start", "status": 206 if span.partial else 200,
                    "headers": response_headers(image, span)})
        if scope["method"] == "HEAD" or span.length == 0:
            await send({"type": "http.response.body", "body": b""})
            return
        log.info("image %s to machine %s (%s): sending bytes %d-%d of %d", image.name,
                 who.machine_id, peer, span.start, span.end - 1, span.size)
        began = time.monotonic()
        sent, cause = await self.stream(receive, send, image, span)
        seconds = max(time.monotonic() - began, 1e-6)
        log.log(logging.INFO if cause is None else logging.WARNING,
                "image %s to machine %s (%s): %d bytes in %.2f s (%.0f MB/s)%s", image.name,
                who.machine_id, peer, sent, seconds, sent / seconds / 1e6,
                "" if cause is None else f"; stopped: {cause}")

    async def stream(self, receive: Receive, send: Send, image: ImageFile, span: Span
                     ) -> tuple[int, str | None]:
        """Send ``span``, reading a chunk ahead; (bytes sent, why it stopped early or
        None). Stopping early leaves the answer incomplete: uvicorn closes the
        connection, and the agent sees a short stream (and resumes with a range)."""
        gone = asyncio.ensure_future(disconnected(receive))
        offset, sent = span.start, 0
        reading = image.reading = self.read(image, offset, span.end)
        try:
            while True:
                # Shielded: cancelled (the server stopping), the read still ends in its
                # thread, and ``image.close`` waits for it.
                chunk = await asyncio.shield(reading)
                if not chunk:
                    return sent, f"the file ended at byte {offset} (truncated meanwhile?)"
                offset += len(chunk)
                more = offset < span.end
                if more:
                    reading = image.reading = self.read(image, offset, span.end)
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
                if gone.done():
                    return sent, "the client went away"
                sent += len(chunk)
                if not more:
                    return sent, None
        except OSError as error:
            return sent, f"cannot read the file: {error.strerror}"
        finally:
            gone.cancel()

    def read(self, image: ImageFile, offset: int, end: int) -> asyncio.Future[bytes]:
        """The next chunk, read in the ``reads`` pool."""
        size = min(CHUNK, end - offset)
        return asyncio.get_running_loop().run_in_executor(
            self.reads.executor, image.read, offset, size)


async def disconnected(receive: Receive) -> None:
    """Returns once the client is gone (uvicorn then makes every write a no-op)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def response_headers(image: ImageFile, span: Span) -> list[tuple[bytes, bytes]]:
    headers = {"content-type": "application/octet-stream",
               "content-length": str(span.length), "accept-ranges": "bytes",
               "etag": image.etag, "last-modified": image.modified,
               "cache-control": "no-store"}
    if span.partial:
        headers["content-range"] = f"bytes {span.start}-{span.end - 1}/{span.size}"
    return [(key.encode(), value.encode("latin-1")) for key, value in headers.items()]


__all__ = ["CHUNK", "IMAGES_ROUTE", "Authorizer", "ImageRoute", "bmdb_authorizer", "span_of"]
