"""A real HTTP server on 127.0.0.1 that serves one image, with the faults the image
writer must survive (``shepherd/agent/installer.py``): cut connections, stalls, a
server that ignores Range, refused authorization.

It records every request's headers, so that a test sees what the agent asked for.
"""

from __future__ import annotations

import http.server
import re
import socket
import threading
from pathlib import Path
from typing import Any

PIECE = 64 << 10


class ImageServer:
    """Serves ``body`` (bytes, or a file's path) at ``url``; faults are set as attributes."""

    def __init__(self, body: bytes | Path) -> None:
        self.body = body
        self.length = len(body) if isinstance(body, bytes) else body.stat().st_size
        #: Cut the connection after this many bytes of a response, ``cuts`` times.
        self.cut_after: int | None = None
        self.cuts = 0
        #: Send this many bytes of each response, then nothing until stopped.
        self.stall_after: int | None = None
        self.ignore_range = False
        #: Answer every request with this status (401, say) and no image.
        self.status: int | None = None
        self.requests: list[dict[str, str]] = []
        self.stopped = threading.Event()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/images/test.img"

    def stop(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests.append(dict(self.headers.items()))
                if outer.status is not None:
                    self.send_response(outer.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = self._range_start()
                if start is None:
                    self.send_response(200)
                    start = 0
                else:
                    self.send_response(206)
                    self.send_header("Content-Range",
                                     f"bytes {start}-{outer.length - 1}/{outer.length}")
                self.send_header("Content-Length", str(outer.length - start))
                self.end_headers()
                self._send(start)

            def _range_start(self) -> int | None:
                match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if outer.ignore_range or match is None:
                    return None
                return int(match.group(1))

            def _send(self, start: int) -> None:
                limit = None
                if outer.cut_after is not None and outer.cuts > 0:
                    outer.cuts -= 1
                    limit = outer.cut_after
                stall = outer.stall_after
                sent = 0
                with _reader(outer.body, start) as read:
                    while True:
                        piece = read(PIECE)
                        if not piece:
                            return
                        if limit is not None:
                            piece = piece[:limit - sent]
                        if stall is not None:
                            piece = piece[:stall - sent]
                        self.wfile.write(piece)
                        sent += len(piece)
                        if limit is not None and sent >= limit:
                            self.wfile.flush()
                            self.connection.shutdown(socket.SHUT_RDWR)
                            self.close_connection = True
                            return
                        if stall is not None and sent >= stall:
                            self.wfile.flush()
                            outer.stopped.wait(60)
                            return

        return Handler


class _reader:
    """Reads the body from ``start``, from memory or from its file."""

    def __init__(self, body: bytes | Path, start: int) -> None:
        self.body, self.start = body, start
        self.handle: Any = None

    def __enter__(self) -> Any:
        if isinstance(self.body, bytes):
            view = memoryview(self.body)[self.start:]
            position = [0]

            def read(size: int) -> bytes:
                piece = bytes(view[position[0]:position[0] + size])
                position[0] += len(piece)
                return piece

            return read
        self.handle = open(self.body, "rb")
        self.handle.seek(self.start)
        return self.handle.read

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.close()
