"""Files only this user may read, replaced whole: the settings ``shepherd up`` hands on,
the simulator's world, generated logins.

Why one way to write them: each holds a secret (a token, host private keys, a
password), and each is read by other processes while it may be rewritten. Written to
a 0600 temporary file beside it and renamed over it, such a file is never readable
by anyone else, not even for a moment, and a reader sees the old file or the new one,
never half of either.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_private(path: Path, data: bytes | str, *, durable: bool = False) -> None:
    """``data`` as the whole of ``path`` (mode 0600), atomically. ``durable``: fsync
    the file and its directory, so the new file survives a power cut too."""
    raw = data.encode() if isinstance(data, str) else data
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as sink:  # mkstemp makes it 0600
            sink.write(raw)
            if durable:
                sink.flush()
                os.fsync(sink.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if durable:
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
