"""The image catalog: which operating-system images Shepherd can install, and where each
one comes from.

One file, ``catalog.toml`` in Shepherd's image directory (``SHEPHERD_IMAGE_DIR``),
beside the image files that ``shepherd serve`` serves to agents::

    [[images]]
    name = "debian-12"
    file = "debian-12.raw.zst"      # in this directory, served by `shepherd serve`
    sha256 = "9f86d0..."            # of the RAW disk image (after decompression)
    size = 1073741824               # bytes of the raw disk image
    format = "zstd"                 # raw, gzip or zstd

    [[images]]
    name = "ubuntu-24.04"
    url = "https://images.example.net/ubuntu-24.04.raw.gz"   # any http(s) server
    sha256 = "..."
    size = 2147483648
    format = "gzip"

Why a file of its own rather than the inventory: images are chosen for machines of
every provider (an Equinix fleet has no inventory file), and the file lives with the
bytes it describes, so ``sha256`` and the file it names are changed together.

Why the digest and size are the raw image's: what the agent verifies is the disk, read
back after the write; a digest of the compressed stream would say nothing about it.

The catalog is read again whenever it is needed (it is a few lines), so an operator's
edit counts at the next installation without restarting anything. Every problem is a
``CatalogError`` naming the file, the image and the field.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

CATALOG_FILE = "catalog.toml"
FORMATS: tuple[str, ...] = ("raw", "gzip", "zstd")
Format = Literal["raw", "gzip", "zstd"]
#: Names appear in URLs (``/agent/v1/images/NAME``) and commands: kept to a safe alphabet.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
FIELDS = frozenset({"name", "file", "url", "sha256", "size", "format"})


#: How a disk is named (``check_disk``): the forms the agent resolves
#: (``shepherd.agent.installer``).
DISK_FORMS = ("serial=SERIAL", "wwn=WWN", "/dev/disk/by-KIND/NAME", "device=/dev/NAME")


@dataclass(frozen=True)
class OsEntry:
    """An inventory's ``os`` entry: the image a machine should run, on which disk."""

    image: str
    disk: str


def check_disk(selector: str) -> str:
    """``selector`` if it names a disk in one of ``DISK_FORMS``; ``ValueError`` saying
    why otherwise.

    Why a bare ``/dev/sdb`` is refused: kernel names follow probe order, which can
    change between boots or when a disk is added, and the wrong disk would be
    overwritten. Serials, WWNs and udev's by-* links stay with the disk; whoever
    means the kernel's name says so with ``device=``."""
    kind, _, value = selector.partition("=")
    if kind in ("serial", "wwn") and value.strip() and value == value.strip():
        return selector
    if kind == "device" and re.fullmatch(r"/dev/[A-Za-z0-9._-]+(/[A-Za-z0-9._:-]+)*", value):
        return selector
    if re.fullmatch(r"/dev/disk/by-[a-z-]+/[^/\s]+", selector):
        return selector
    if selector.startswith("/dev/"):
        raise ValueError(f"disk {selector!r}: a bare device path may name another disk after "
                         f"a reboot; say device={selector} to mean exactly it, or use its "
                         "serial, WWN or a /dev/disk/by-* link")
    raise ValueError(f"disk {selector!r} is none of {', '.join(DISK_FORMS)}")


class CatalogError(ValueError):
    """The catalog cannot be used as written; the text names the file and the field."""


class UnknownImage(LookupError):
    """An image name the catalog does not list."""


@dataclass(frozen=True)
class Image:
    """One installable image. Exactly one of ``file`` (served by Shepherd) and ``url``."""

    name: str
    sha256: str
    size: int
    format: Format
    file: str | None = None
    url: str | None = None

    @property
    def served(self) -> bool:
        """Whether ``shepherd serve`` serves it (agents then fetch it with a token)."""
        return self.file is not None

    def catalog_entry(self) -> str:
        """Its ``[[images]]`` table, as ``Catalog.load`` reads it back (strings quoted
        as JSON does, which TOML's basic strings accept)."""
        source = (f"file = {json.dumps(self.file)}" if self.served
                  else f"url = {json.dumps(self.url)}")
        return (f"[[images]]\nname = {json.dumps(self.name)}\n{source}\n"
                f"sha256 = {json.dumps(self.sha256)}\nsize = {self.size}\n"
                f"format = {json.dumps(self.format)}\n")


@dataclass(frozen=True)
class Catalog:
    directory: Path
    images: dict[str, Image]

    @classmethod
    def load(cls, directory: Path) -> Catalog:
        """The catalog in ``directory``; an empty one where there is no catalog file."""
        path = directory / CATALOG_FILE
        try:
            document = tomllib.loads(path.read_text())
        except FileNotFoundError:
            return cls(directory, {})
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise CatalogError(f"{path}: {error}") from None
        entries = document.get("images", [])
        unknown = sorted(set(document) - {"images"})
        if unknown or not isinstance(entries, list):
            raise CatalogError(f"{path}: only [[images]] tables belong here"
                               + (f" (found {unknown})" if unknown else ""))
        images: dict[str, Image] = {}
        for number, entry in enumerate(entries, 1):
            image = _image(entry, f"{path}: image {number}")
            if image.name in images:
                raise CatalogError(f"{path}: image {image.name!r} is listed twice")
            images[image.name] = image
        return cls(directory, images)

    def get(self, name: str) -> Image:
        try:
            return self.images[name]
        except KeyError:
            listed = ", ".join(sorted(self.images)) or "none"
            raise UnknownImage(f"image {name!r} is not in the catalog "
                               f"{self.directory / CATALOG_FILE} (listed: {listed})") from None


def _image(entry: Any, where: str) -> Image:
    if not isinstance(entry, dict):
        raise CatalogError(f"{where}: must be a table")
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise CatalogError(f"{where}: unknown fields {unknown}")
    name = entry.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise CatalogError(f"{where}: name must be 1-64 letters, digits, '.', '_' or '-'")
    where = f"{where} ({name})"
    return Image(name=name, sha256=_sha256(entry.get("sha256"), where),
                 size=_size(entry.get("size"), where), format=_format(entry, where),
                 **_source(entry, where))


def _sha256(value: Any, where: str) -> str:
    if not isinstance(value, str) or not SHA256_PATTERN.match(value.lower()):
        raise CatalogError(f"{where}: sha256 must be 64 hexadecimal digits (of the raw image)")
    return value.lower()


def _size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CatalogError(f"{where}: size must be the raw image's bytes, a positive integer")
    return value


def _format(entry: dict[str, Any], where: str) -> Format:
    value = entry.get("format", "raw")
    if value not in FORMATS:
        raise CatalogError(f"{where}: format must be one of {', '.join(FORMATS)}")
    return value  # type: ignore[no-any-return]


def _source(entry: dict[str, Any], where: str) -> dict[str, str]:
    file, url = entry.get("file"), entry.get("url")
    if (file is None) == (url is None):
        raise CatalogError(f"{where}: give exactly one of file (served by Shepherd) and url")
    if file is not None:
        if not isinstance(file, str) or not file or "/" in file or file.startswith("."):
            raise CatalogError(f"{where}: file must be a file name in the image directory "
                               "(no '/', not hidden)")
        return {"file": file}
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise CatalogError(f"{where}: url must be an http(s) URL with a host")
    return {"url": str(url)}


__all__ = ["CATALOG_FILE", "DISK_FORMS", "Catalog", "CatalogError", "Image", "OsEntry",
           "UnknownImage", "check_disk"]
