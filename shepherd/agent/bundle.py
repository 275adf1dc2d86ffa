"""The agent as uploaded: one file that needs python3 (3.9 or newer) and nothing else.

A stock machine has python3 but seldom the ``cryptography`` package, so the agent
carries a pure-Python Ed25519 (``ecdsa``, with ``six``), used only where
``cryptography`` is missing (``shepherd_agent.ed25519``). The file is:

- ``launcher.sh``, a shell prologue: it runs python3 on the file itself, or answers
  the "python3 is not installed" TakeoverResponse error on its own;
- then a zip archive, which python3 runs as an application (``zipapp``; the
  prologue is skipped because zip offsets are found from the end of the file):
  ``__main__.py`` (``zipapp_main.py``, which refuses a python3 older than 3.9 with
  an answer), ``shepherd_agent.py`` (``agent.py``), ``protocol.py`` (the wire
  format, the very module the shepherd imports, beside the agent as it is here),
  ``installer.py`` (the image writer, beside it too) and ``identity.py`` (what the
  writer puts into the installed system), the bundled libraries, and
  their licences under ``LICENSES/``.

Built from the installed packages, in memory, once per process. Byte for byte the
same on every build of the same sources (fixed timestamps and member order), so a
machine's copy can be compared with what this shepherd would upload.
"""

from __future__ import annotations

import functools
import importlib.metadata
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

HERE = Path(__file__).parent
#: What the bundle is called on a machine (``InitializerSettings.agent_target``); its
#: state directory is ``shepherd-agent.d`` beside it (``agent.parse_args``).
BUNDLE_NAME = "shepherd-agent.pyz"
#: The wire format (``protocol.py``), in the bundle under its name here: the agent
#: imports it as ``protocol`` there, and as ``shepherd.agent.protocol`` here.
WIRE_MODULE = "protocol.py"
#: The agent's own modules beside it, imported by their names here (``installer``,
#: and ``identity``, which writes an installed system's identity for it).
SIBLINGS = (WIRE_MODULE, "installer.py", "identity.py")
#: The distributions bundled, importable in the zip by their top-level names.
BUNDLED = ("ecdsa", "six")
#: zip cannot store earlier dates; one fixed date makes the bytes reproducible.
TIMESTAMP = (1980, 1, 1, 0, 0, 0)


@functools.cache
def agent_bundle() -> bytes:
    """The file the initializer uploads and runs as ``/bin/sh FILE ARGS...``."""
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as bundle:
        for name, data in sorted(_members()):
            member = zipfile.ZipInfo(name, date_time=TIMESTAMP)
            member.compress_type = zipfile.ZIP_DEFLATED
            member.external_attr = 0o644 << 16
            bundle.writestr(member, data)
    return (HERE / "launcher.sh").read_bytes() + archive.getvalue()


def _members() -> Iterator[tuple[str, bytes]]:
    yield "__main__.py", (HERE / "zipapp_main.py").read_bytes()
    yield "shepherd_agent.py", (HERE / "agent.py").read_bytes()
    for sibling in SIBLINGS:
        yield sibling, (HERE / sibling).read_bytes()
    for name in BUNDLED:
        yield from _distribution_members(importlib.metadata.distribution(name))


def _distribution_members(distribution: importlib.metadata.Distribution
                          ) -> Iterator[tuple[str, bytes]]:
    """Its modules (not its tests) at their import paths, and its licence files."""
    label = f"{distribution.metadata['Name']}-{distribution.version}"
    if distribution.files is None:  # installed without a RECORD: nothing to go by
        raise RuntimeError(f"cannot bundle {label} into the agent: its installation "
                           "lists no files (reinstall it with pip)")
    for file in distribution.files:
        path = PurePosixPath(str(file))
        if path.suffix == ".py" and not _is_test(path) and ".." not in path.parts:
            yield str(path), file.read_binary()
        elif path.parts[0].endswith(".dist-info") and path.name.upper().startswith(
                ("LICENSE", "LICENCE", "COPYING")):
            yield f"LICENSES/{label}/{path.name}", file.read_binary()


def _is_test(path: PurePosixPath) -> bool:
    return path.name.startswith("test_") or "tests" in path.parts


def bundle_members(bundle: bytes) -> list[str]:
    """The names in a bundle's archive (for tests and for whoever inspects one)."""
    with zipfile.ZipFile(io.BytesIO(bundle)) as archive:
        return archive.namelist()
