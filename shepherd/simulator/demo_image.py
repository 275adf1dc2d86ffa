"""The simulator's demo OS image: a small raw GPT disk image, built once and cached.

What ``shepherd up --racks`` installs on its simulated machines (``disks``): a 16 MiB
raw disk image whose GPT holds one partition named "root" (the x86-64 root type) with
an ext4 filesystem made by ``mke2fs -d`` from a tiny tree (``/etc/hostname``,
``/etc/os-release`` saying "Shepherd demo", an empty ``/etc/ssh``, ``/root``). No root
privileges, loop devices or mounts: ``sfdisk`` writes the table into a regular file,
``mke2fs`` the filesystem into another, copied in at the partition's offset.

It holds no SSH host key: a disk the image was merely written to cannot boot; the
agent's identity (host key, authorized keys, marker) makes it bootable.

``ensure`` builds it into an image directory under a name carrying the recipe's hash
(``shepherd-demo-<hash>.raw``: a changed recipe is a new file, an unchanged one is
reused) and puts a ``demo`` entry in that directory's ``catalog.toml`` (file, sha256,
size, format raw), so ``shepherd serve`` serves it. An operator's catalog is kept: the
entry is added (or, when it names an older demo file, replaced); a ``demo`` entry of
the operator's own is left alone, and said so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from shepherd.images import CATALOG_FILE, Image

NAME = "demo"
FILE_PREFIX = "shepherd-demo-"
SIZE = 16 << 20
SECTOR = 512
PARTITION_START = 1 << 20
#: The backup GPT's 33 sectors at the end, rounded to the next MiB.
PARTITION_SIZE = SIZE - PARTITION_START - (1 << 20)
ROOT_TYPE = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"  # x86-64 root (DPS)
TOOLS = ("sfdisk", "mke2fs")
SBIN = ("/usr/sbin", "/sbin")
TOOL_TIMEOUT = 60.0
#: The tree ``mke2fs -d`` copies (path -> text; a path ending in "/" is a directory).
TREE: dict[str, str] = {
    "etc/hostname": "shepherd-demo\n",
    "etc/os-release": 'NAME="Shepherd demo"\nID=shepherd-demo\nVERSION_ID="1"\n'
                      'PRETTY_NAME="Shepherd demo (the simulator\'s image)"\n',
    "etc/ssh/": "",
    "root/": "",
    "usr/sbin/": "",
}
#: Part of the recipe: a change here or in ``TREE`` is a new image.
RECIPE_VERSION = 1


class DemoImageError(Exception):
    """The image cannot be built; one line saying why (a missing tool, say)."""


@dataclass(frozen=True)
class DemoImage:
    name: str
    path: Path
    sha256: str
    size: int

    def catalog_entry(self) -> str:
        return Image(self.name, self.sha256, self.size, "raw", file=self.path.name
                     ).catalog_entry()


def find_tool(name: str) -> str | None:
    """The tool on PATH or in sbin (a normal user's PATH often lacks /usr/sbin)."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if find_tool(tool) is None]


def recipe_hash() -> str:
    recipe = json.dumps({"version": RECIPE_VERSION, "size": SIZE, "tree": TREE,
                         "start": PARTITION_START, "type": ROOT_TYPE}, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def ensure(image_dir: Path) -> tuple[DemoImage, str | None]:
    """The demo image in ``image_dir`` (built unless this recipe's file is there) with
    its catalog entry; and a note for the operator when the catalog's own ``demo``
    entry was left alone (None otherwise). ``DemoImageError`` when it cannot be built."""
    image_dir.mkdir(parents=True, exist_ok=True)
    path = image_dir / f"{FILE_PREFIX}{recipe_hash()}.raw"
    if not path.is_file() or path.stat().st_size != SIZE:
        build(path)
    image = DemoImage(NAME, path, _sha256(path), SIZE)
    return image, add_to_catalog(image_dir / CATALOG_FILE, image)


def build(path: Path) -> Path:
    """Build the image at ``path`` (replaced in one rename: a reader never sees half)."""
    missing = missing_tools()
    if missing:
        raise DemoImageError(f"the demo image needs {' and '.join(missing)} (Debian "
                             f"packages fdisk and e2fsprogs): not found on PATH or in sbin")
    with tempfile.TemporaryDirectory(prefix=".demo-", dir=path.parent) as work:
        staged = Path(work, "disk.raw")
        with staged.open("xb") as handle:
            handle.truncate(SIZE)
        script = (f"label: gpt\nstart={PARTITION_START // SECTOR}, "
                  f"size={PARTITION_SIZE // SECTOR}, type={ROOT_TYPE}, name=root\n")
        _run(["sfdisk", "--quiet", "--no-reread", "--no-tell-kernel", str(staged)], script)
        tree = Path(work, "tree")
        for name, text in TREE.items():
            target = tree / name
            if name.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
        (tree / "root").chmod(0o700)
        filesystem = Path(work, "root.ext4")
        with filesystem.open("xb") as handle:
            handle.truncate(PARTITION_SIZE)
        _run(["mke2fs", "-q", "-F", "-t", "ext4", "-L", "root", "-E", "root_owner=0:0",
              "-d", str(tree), str(filesystem)])
        with staged.open("r+b") as disk, filesystem.open("rb") as source:
            disk.seek(PARTITION_START)
            shutil.copyfileobj(source, disk, 1 << 20)
        staged.replace(path)
    return path


def _run(argv: list[str], stdin: str | None = None) -> None:
    program = find_tool(argv[0]) or argv[0]
    try:
        done = subprocess.run([program, *argv[1:]], input=stdin, text=True,
                              capture_output=True, timeout=TOOL_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DemoImageError(f"{argv[0]} failed building the demo image: {error}") from None
    if done.returncode != 0:
        said = " ".join(done.stderr.split())[:300] or f"exit status {done.returncode}"
        raise DemoImageError(f"{argv[0]} failed building the demo image: {said}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


_BLOCK = re.compile(r"(?ms)^\[\[images\]\]\n(?:(?!\[\[).*\n?)*")


def add_to_catalog(catalog: Path, image: DemoImage) -> str | None:
    """Put ``image``'s entry in ``catalog`` (made if missing), keeping every other
    entry as written; a note when an operator's own ``demo`` entry was left alone."""
    text = catalog.read_text() if catalog.exists() else ""
    try:
        entries = tomllib.loads(text).get("images", [])
    except tomllib.TOMLDecodeError as error:
        return f"{catalog} is not valid TOML ({error}): the demo image is not listed"
    ours = [e for e in entries if isinstance(e, dict) and e.get("name") == image.name]
    if ours and not str(ours[0].get("file", "")).startswith(FILE_PREFIX):
        return (f"{catalog} has an image named {image.name!r} of its own: left as it is "
                f"(the simulator's is {image.path.name})")
    if ours and ours[0].get("file") == image.path.name and ours[0].get("sha256") == \
            image.sha256:
        return None
    kept = [block for block in _BLOCK.findall(text)
            if not re.search(rf'(?m)^name\s*=\s*"{re.escape(image.name)}"\s*$', block)]
    head = _BLOCK.sub("", text).strip()
    parts = ([head] if head else []) + [b.strip() for b in kept] + [
        image.catalog_entry().strip()]
    staged = catalog.with_name(f".{catalog.name}.tmp")
    staged.write_text("\n\n".join(parts) + "\n")
    staged.replace(catalog)
    return None
