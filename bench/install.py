"""OS installation: the agent's image writer against ``curl | dd``, on real loop disks.

One ``shepherd serve`` (its own process, over a fresh BMDB) serves the images through
its real, token-bound route (``GET /agent/v1/images/{name}``); every fetch belongs to a
machine with an installation in flight, as in production. Each install writes onto a
loop device over a sparse file (``--dir``, default /var/tmp) and counts only once the
disk has been read back and its hash matched. Every figure is a ratio against a
baseline measured in the same run, beside the raw numbers:

1. raw, one machine: the writer (``shepherd/agent/installer.py`` in a python3 of its
   own, imported by path and given the request, as on a machine) against
   ``curl | tee >(sha256sum) | dd oflag=direct conv=fsync`` then ``head -c | sha256sum``
   onto a second loop disk: verified bytes per second, ours / the pipeline's;
2. zstd, one machine: the same with a compressible image's zstd copy (format zstd),
   against the pipeline with ``zstd -d`` in it;
3. ``--machines`` at once: their aggregate verified rate against as many concurrent
   ``curl -o /dev/null`` of the same file from the same server (what the server and
   loopback can deliver); meanwhile 50 other machines heartbeat once a second each,
   signed, and their latency is compared with the same load on an idle server;
4. the writer's peak resident memory (the child's own VmHWM at its end: ru_maxrss
   would count the parent's), against a python3 that only imported the writer.

Why the writer runs as a process of its own: the server and the load generators must
not share its interpreter (nor the server theirs), and its memory is then its own.

Why ``--dir``: on /var/tmp the flush at the end of each install writes the backing
file to the host's disk (and a fresh sparse file's first write allocates its blocks),
so a slow disk shows in every install and in no download; ``--dir /dev/shm`` takes the
disk away and leaves the software. The details (``--json``, or printed above the
table) give each step's wall time, its phases and its processes' CPU seconds
(``step_cpu_seconds``): on a small machine figure 3 is bound by CPU, since every
install hashes each byte twice and copies it through the loop device, where a download
only receives it.

The pipeline's ``sha256sum`` is coreutils' (no SHA extensions on some CPUs, where it
runs at a quarter of OpenSSL's speed, which the writer's hashlib uses): that is part
of what the baseline costs, not a flaw of the measure.

    .venv/bin/python -m bench.install [--size 1024] [--machines 8] [--pg-url URL]
        [--dir /var/tmp] [--json FILE]
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import http.client
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import bmdb
from bench.common import arguments, postgres
from bench.heartbeat_ingest import Agent, Server, cpu_seconds, seed, serve
from shepherd.agent.protocol import (
    HEADER_MACHINE,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    HEARTBEAT_PATH,
    signing_payload,
)
from shepherd.answer_key import AnswerKey
from shepherd.images import Catalog, Format, Image
from shepherd.workflows.installation import InstallationSettings, request_for
from tests.support.disk_images import loop_disk

REPO = Path(__file__).resolve().parent.parent
INSTALLER = REPO / "shepherd" / "agent" / "installer.py"
MIB = 2**20
TOOLS = ("losetup", "curl", "zstd", "dd", "bash", "tee", "head", "sha256sum")
#: The other machines heartbeating while the installs run, each once a second.
HEARTBEAT_MACHINES = 50
HEARTBEAT_THREADS = HEARTBEAT_MACHINES  # a slow answer must not delay the next machine
#: Seconds of heartbeats on the idle server: the latency baseline.
IDLE_SECONDS = 5.0
#: Seconds of heartbeats before that, not counted.
WARM_UP = 1.0
#: Longest any one step may take before the bench gives up (a hung child, say).
STEP_TIMEOUT = 600.0
#: Of the compressible image, the share of 1 MiB blocks left zero (free space), the
#: rest 4 bits of entropy per byte: zstd -1 makes about a third of it, like an OS image.
ZERO_EVERY = (1, 3)  # block index % 5 in this: zero

#: The agent's side: the writer, loaded by path (no shepherd package), given the
#: request on stdin; prints its result and its own peak resident set (VmHWM, KiB).
#: With "idle" it only reports the memory of having loaded the writer.
CHILD = r"""
import importlib.util, json, os, re, sys, threading
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # its siblings (identity), as in the bundle
spec = importlib.util.spec_from_file_location("installer", sys.argv[1])
installer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(installer)
result = {}
if sys.argv[2] != "idle":
    result = installer.install(json.load(sys.stdin), progress=lambda update: None,
                               cancelled=threading.Event())
with open("/proc/self/status") as status:
    result["vmhwm_kib"] = int(re.search(r"VmHWM:\s+(\d+)", status.read()).group(1))
print(json.dumps(result))
"""

#: The baseline: the same bytes through the standard tools, then read back and hashed.
PIPELINE = r"""set -euo pipefail
curl -sf -H "X-Shepherd-Machine: $MACHINE" -H "Authorization: Bearer $TOKEN" "$URL" \
  {decompress}| tee >(sha256sum >/dev/null) \
  | dd of="$DISK" bs=4M oflag=direct conv=fsync iflag=fullblock status=none
date +%s.%N
head -c "$SIZE" "$DISK" | sha256sum
"""


class BenchError(RuntimeError):
    """A step did not do what it must (an install not verified, a fetch refused)."""


def missing() -> str | None:
    """Why this machine cannot run the bench (one line), or None."""
    if os.geteuid() != 0:
        return "the installation bench needs root (loop devices)"
    if not Path("/dev/loop-control").exists():
        return "the installation bench needs loop devices (/dev/loop-control)"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"the installation bench needs {', '.join(absent)}"
    return None


# -- the images ----------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """A catalog image's file: ``sha256`` and ``size`` are of its raw bytes."""

    name: str
    file: Path
    sha256: str
    size: int
    format: Format

    def entry(self) -> str:
        return Image(self.name, self.sha256, self.size, self.format,
                     file=self.file.name).catalog_entry()


def keystream(size: int, chunk: int = 4 * MIB) -> Iterator[bytes]:
    """Random-looking bytes, fast (AES-CTR of zeros: urandom would take seconds per GiB)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    encryptor = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16))).encryptor()
    zeros = bytes(chunk)
    for offset in range(0, size, chunk):
        yield encryptor.update(zeros[:min(chunk, size - offset)])


#: Maps each byte to one of 16 letters: 4 bits of entropy per byte, text-like.
LETTERS = bytes(b"abcdefghijklmnop"[value & 15] for value in range(256))


def compressible(size: int) -> Iterator[bytes]:
    """An OS image's mix: free space (zero blocks) between low-entropy data."""
    for index, block in enumerate(keystream(size, MIB)):
        yield bytes(len(block)) if index % 5 in ZERO_EVERY else block.translate(LETTERS)


def write_file(path: Path, blocks: Iterator[bytes]) -> str:
    digest = hashlib.sha256()
    with path.open("xb") as file:
        for block in blocks:
            digest.update(block)
            file.write(block)
    return digest.hexdigest()


def make_images(directory: Path, size: int) -> tuple[Served, Served]:
    """The raw image (random bytes) and the zstd one, with their catalog."""
    directory.mkdir()
    raw = Served("bench-raw", directory / "raw.img", write_file(directory / "raw.img",
                                                               keystream(size)), size, "raw")
    plain = directory / "packed.img"
    digest = write_file(plain, compressible(size))
    packed = directory / "packed.img.zst"
    subprocess.run(["zstd", "-1", "-T0", "-q", str(plain), "-o", str(packed)], check=True,
                   timeout=STEP_TIMEOUT)
    plain.unlink()
    zstd = Served("bench-zstd", packed, digest, size, "zstd")
    (directory / "catalog.toml").write_text(raw.entry() + "\n" + zstd.entry())
    return raw, zstd


# -- the fleet: machines with an installation in flight ----------------------------------


@dataclass(frozen=True)
class Grant:
    """One machine's right to fetch one image now: the request its agent would get."""

    machine: uuid.UUID
    token: str
    request: dict[str, Any]


class Fleet:
    """Machines whose installations are put in flight as the workflow does (want, then
    dispatch of ``request_for``'s request), so the route authorizes their fetches."""

    def __init__(self, db: bmdb.BMDB, server: Server, image_dir: Path) -> None:
        self.db = db
        self.key = AnswerKey.from_bmdb(db)
        self.catalog = Catalog.load(image_dir)
        self.settings = InstallationSettings(callback_url=f"http://{server.host}:{server.port}",
                                             image_dir=image_dir)
        self.machines: list[uuid.UUID] = []

    def machine(self, index: int) -> uuid.UUID:
        while len(self.machines) <= index:
            self.machines.append(self.db.read(bmdb.create_machine))
        return self.machines[index]

    def grant(self, index: int, image: Served, disk: str) -> Grant:
        """Machine ``index``'s installation of ``image`` onto ``disk``, in flight."""
        machine = self.machine(index)
        request = request_for(machine, self.catalog.get(image.name), f"device={disk}",
                              self.settings)

        def body(tx: bmdb.Tx) -> int:
            bmdb.want_installation(tx, machine, image=image.name, disk=request["disk"],
                                   origin="operator", by="bench", reason="bench.install")
            return bmdb.dispatch_installation(tx, machine, request)

        token = self.key.fetch_token(str(machine), self.db.read(body), image.name)
        # What the server's heartbeat answer adds for a served image (``with_secrets``).
        return Grant(machine, token, {**request, "authorization": token})


# -- the runs ----------------------------------------------------------------------------


@dataclass
class Run:
    """One transfer: bytes verified (or downloaded), its wall time, what it reported."""

    bytes: int
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """MB/s (10^6 bytes), as the disk tools print it."""
        return self.bytes / self.seconds / 1e6


class Children:
    """The processes a step started: killed on the way out, whatever happened."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, command: Sequence[str], stdin: bytes | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env=env, start_new_session=True,
                                   preexec_fn=as_a_machine)
        self.processes.append(process)
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(stdin or b"")
        process.stdin.close()
        process.stdin = None  # so that communicate() does not flush it again
        return process

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def as_a_machine() -> None:
    """What every simulated machine's process (writer, pipeline, curl) runs at: the
    lowest CPU priority. Why: on real racks each machine has CPUs of its own, and the
    server's are not theirs; on this one host, a machine's hashing must not take the
    server's share, or the heartbeats measured would wait for the machines' work. Both
    sides of every ratio run so, so none gains by it. With the kernel's autogroups each
    session is weighed as a whole, whatever its processes' nice: the session this child
    leads gets the lowest weight too."""
    os.nice(19)
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text("19")


def finish(process: subprocess.Popen[bytes], what: str) -> str:
    """The process's output, once it ended well; ``BenchError`` otherwise."""
    stdout, stderr = process.communicate(timeout=STEP_TIMEOUT)
    if process.returncode != 0:
        raise BenchError(f"{what} exited {process.returncode}: "
                         f"{stderr.decode(errors='replace').strip()[-400:]}")
    return stdout.decode()


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (each step reaps its own, in turn,
    so a step's difference is its processes' CPU: the writers' with their zstd)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def writer_command(idle: bool = False) -> list[str]:
    return [sys.executable, "-I", "-c", CHILD, str(INSTALLER), "idle" if idle else "install"]


def writer_result(process: subprocess.Popen[bytes], image: Served) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(finish(process, "the writer"))
    if result.get("status") != "ok" or result.get("read_back_sha256") != image.sha256:
        raise BenchError(f"the writer did not verify {image.name}: {result.get('status')} "
                         f"{result.get('cause')}")
    return result


def writers(grants: Sequence[Grant], image: Served) -> list[Run]:
    """The writers of ``grants`` at once; each Run timed from the first start."""
    cpu = children_cpu()
    with Children() as children:
        started = time.perf_counter()
        processes = [children.start(writer_command(), json.dumps(grant.request).encode())
                     for grant in grants]
        runs = []
        for process in processes:
            result = writer_result(process, image)
            runs.append(Run(image.size, time.perf_counter() - started, result))
    for run in runs:
        run.detail["step_cpu_seconds"] = round(children_cpu() - cpu, 2)
    return runs


def pipeline(grant: Grant, image: Served, url: str, disk: str) -> Run:
    """``PIPELINE`` for one machine onto ``disk``: the baseline of figures 1 and 2."""
    script = PIPELINE.format(decompress="| zstd -dcq " if image.format == "zstd" else "")
    env = {**os.environ, "MACHINE": str(grant.machine), "TOKEN": grant.token, "URL": url,
           "DISK": disk, "SIZE": str(image.size)}
    cpu = children_cpu()
    with Children() as children:
        started, wall = time.perf_counter(), time.time()
        output = finish(children.start(["bash", "-c", script], env=env), "the pipeline")
        seconds = time.perf_counter() - started
    written, digest = output.splitlines()[:2]
    if digest.split()[:1] != [image.sha256]:
        raise BenchError(f"the pipeline read back {digest!r}, not {image.sha256}")
    write = float(written) - wall
    return Run(image.size, seconds, {"durations": {"write_and_flush": round(write, 3),
                                                   "read_back": round(seconds - write, 3)},
                                     "step_cpu_seconds": round(children_cpu() - cpu, 2)})


def downloads(grants: Sequence[Grant], image: Served, url: str) -> Run:
    """``curl -o /dev/null`` for each grant at once: what the server delivers."""
    cpu = children_cpu()
    with Children() as children:
        started = time.perf_counter()
        processes = [children.start(
            ["curl", "-sf", "-o", "/dev/null", "-w", "%{size_download}",
             "-H", f"{HEADER_MACHINE}: {grant.machine}", "-H",
             f"Authorization: Bearer {grant.token}", url]) for grant in grants]
        sizes = [int(finish(process, "curl")) for process in processes]
        seconds = time.perf_counter() - started
    if any(size != image.file.stat().st_size for size in sizes):
        raise BenchError(f"curl downloaded {sizes}, not {image.file.stat().st_size} each")
    return Run(sum(sizes), seconds, {"step_cpu_seconds": round(children_cpu() - cpu, 2)})


def aggregate(runs: Sequence[Run]) -> Run:
    """All of ``runs`` as one transfer: their bytes over the last one's end."""
    return Run(sum(run.bytes for run in runs), max(run.seconds for run in runs),
               {"vmhwm_kib": max(run.detail["vmhwm_kib"] for run in runs),
                "step_cpu_seconds": runs[0].detail["step_cpu_seconds"]})


def idle_writer() -> int:
    """VmHWM (KiB) of a python3 that loaded the writer and did nothing."""
    with Children() as children:
        return int(json.loads(finish(children.start(writer_command(idle=True)),
                                     "the idle writer"))["vmhwm_kib"])


# -- heartbeats ----------------------------------------------------------------------


@dataclass(frozen=True)
class Beat:
    sent: float  # time.monotonic() when it was sent
    seconds: float
    status: int  # 0: no answer


class Heartbeats:
    """Each agent's signed heartbeat once a second (spread over the second), sent from
    a thread pool on a new connection each, as agents send them; every answer timed."""

    def __init__(self, agents: Sequence[Agent], server: Server) -> None:
        self.agents = agents
        self.server = server
        self.beats: list[Beat] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.schedule, name="heartbeats", daemon=True)

    def __enter__(self) -> Heartbeats:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()

    def schedule(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(HEARTBEAT_THREADS) as pool:
            start, count = time.monotonic(), 0
            while not self.stopping.wait(max(0.0, start + count / len(self.agents)
                                             - time.monotonic())):
                pool.submit(self.send, self.agents[count % len(self.agents)])
                count += 1

    def send(self, agent: Agent) -> None:
        stamp = f"{time.time():.6f}"
        body = json.dumps({"machine_id": str(agent.machine)}).encode()
        signature = agent.key.sign(signing_payload(agent.machine, agent.public, agent.nonce,
                                                   "POST", HEARTBEAT_PATH, stamp, body))
        headers = {HEADER_MACHINE: str(agent.machine), HEADER_TIMESTAMP: stamp,
                   HEADER_SIGNATURE: base64.b64encode(signature).decode(),
                   "Content-Type": "application/json", "Connection": "close"}
        sent = time.monotonic()
        status = 0
        connection = http.client.HTTPConnection(self.server.host, self.server.port, timeout=30)
        try:
            connection.request("POST", HEARTBEAT_PATH, body, headers)
            answer = connection.getresponse()
            answer.read()
            status = answer.status
        except (OSError, http.client.HTTPException):
            pass
        finally:
            connection.close()
        self.beats.append(Beat(sent, time.monotonic() - sent, status))

    def between(self, start: float, end: float) -> Latency:
        return Latency.of([beat for beat in list(self.beats) if start <= beat.sent < end])


@dataclass(frozen=True)
class Latency:
    count: int
    errors: int
    p50_ms: float
    p99_ms: float

    @classmethod
    def of(cls, beats: Sequence[Beat]) -> Latency:
        if not beats:
            raise BenchError("no heartbeat was sent in the window")
        ordered = sorted(beat.seconds * 1000 for beat in beats)
        return cls(len(beats), sum(beat.status != 200 for beat in beats),
                   statistics.median(ordered),
                   ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))])


# -- the figures ---------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str
    ours: float
    baseline: float
    baseline_name: str
    aim: str

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline

    def line(self) -> str:
        return (f"{self.name:<38} {self.ours:>9.1f} {self.baseline:>9.1f} {self.ratio:>6.2f}"
                f"  {self.unit:<5} {self.aim:<16} baseline: {self.baseline_name}")


HEADER = (f"{'figure':<38} {'ours':>9} {'baseline':>9} {'ratio':>6}  {'unit':<5} "
          f"{'aim':<16}")


@dataclass
class Rig:
    """What every step uses: the fleet, the server, the disks, the images."""

    fleet: Fleet
    server: Server
    disks: list[str]
    raw: Served
    zstd: Served
    agents: list[Agent]

    def url(self, image: Served) -> str:
        return f"http://{self.server.host}:{self.server.port}/agent/v1/images/{image.name}"


def one_machine(rig: Rig, image: Served) -> tuple[Run, Run]:
    """Figures 1 and 2: the writer on disk 0 (machine 0), then the pipeline on disk 1."""
    ours = writers([rig.fleet.grant(0, image, rig.disks[0])], image)[0]
    theirs = pipeline(rig.fleet.grant(1, image, rig.disks[1]), image, rig.url(image),
                      rig.disks[1])
    return ours, theirs


def with_server_cpu(server: Server, step: Callable[[], Run]) -> Run:
    """``step``'s Run, with the server's CPU seconds meanwhile (its heartbeats too)."""
    before = cpu_seconds(server.pid)
    run = step()
    run.detail["server_cpu_seconds"] = round(cpu_seconds(server.pid) - before, 2)
    return run


def many_machines(rig: Rig, machines: int) -> tuple[Run, Run, Latency, Latency, Latency]:
    """Figure 3: downloads, then installs, under heartbeats; their latency when idle,
    during the downloads and during the installs."""
    grants = [rig.fleet.grant(index, rig.raw, rig.disks[index]) for index in range(machines)]
    with Heartbeats(rig.agents, rig.server) as beats:
        time.sleep(WARM_UP)  # the server's first heartbeats open its BMDB connections
        began = time.monotonic()
        time.sleep(IDLE_SECONDS)
        idle_end = time.monotonic()
        download = with_server_cpu(rig.server,
                                   lambda: downloads(grants, rig.raw, rig.url(rig.raw)))
        download_end = time.monotonic()
        installs = with_server_cpu(rig.server, lambda: aggregate(writers(grants, rig.raw)))
        installs_end = time.monotonic()
    return (download, installs, beats.between(began, idle_end),
            beats.between(idle_end, download_end), beats.between(download_end, installs_end))


def measure(rig: Rig, machines: int) -> tuple[list[Figure], dict[str, Any]]:
    raw_ours, raw_pipe = one_machine(rig, rig.raw)
    zstd_ours, zstd_pipe = one_machine(rig, rig.zstd)
    download, installs, idle, downloading, installing = many_machines(rig, machines)
    floor = idle_writer()
    peak = max(run.detail["vmhwm_kib"] for run in (raw_ours, zstd_ours, installs))
    size = f"{rig.raw.size // MIB} MiB"
    figures = [
        Figure(f"1 machine, raw {size}: verified", "MB/s", raw_ours.rate, raw_pipe.rate,
               "curl | tee >(sha256sum) | dd, head | sha256sum", "ratio >= 0.8"),
        Figure(f"1 machine, zstd {size}: verified", "MB/s", zstd_ours.rate, zstd_pipe.rate,
               "curl | zstd -d | tee | dd, head | sha256sum", "ratio >= 0.8"),
        Figure(f"{machines} machines, raw: verified, total", "MB/s", installs.rate,
               download.rate, f"{machines} x curl -o /dev/null, total", "ratio >= 0.8"),
        Figure(f"heartbeats p50 during {machines} installs", "ms", installing.p50_ms,
               idle.p50_ms, f"{HEARTBEAT_MACHINES} machines/s, idle server", ""),
        Figure(f"heartbeats p99 during {machines} installs", "ms", installing.p99_ms,
               idle.p99_ms, f"{HEARTBEAT_MACHINES} machines/s, idle server", "ours < 500 ms"),
        Figure("writer peak resident (VmHWM)", "MiB", peak / 1024, floor / 1024,
               "python3 that loaded the writer", "ours <= 64 MiB"),
    ]
    details = {
        "size_bytes": rig.raw.size, "machines": machines,
        "zstd_compressed_bytes": rig.zstd.file.stat().st_size,
        "runs": {name: asdict(run) | {"rate_mb_s": run.rate} for name, run in (
            ("raw_writer", raw_ours), ("raw_pipeline", raw_pipe), ("zstd_writer", zstd_ours),
            ("zstd_pipeline", zstd_pipe), ("downloads", download), ("installs", installs))},
        "heartbeats": {"idle": asdict(idle), "during_downloads": asdict(downloading),
                       "during_installs": asdict(installing)},
    }
    return figures, details


# -- the whole run ---------------------------------------------------------------------


def terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C, so loop devices and files are cleaned up."""
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def rig(args: Any, say: Callable[[str], None]) -> Iterator[Rig]:
    """Everything the measures need; on the way out, even on errors, the server stopped,
    the loop devices detached, the files removed and the database dropped."""
    size = args.size * MIB
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(postgres(args.pg_url))
        workdir = Path(tempfile.mkdtemp(prefix="shepherd-bench-install-", dir=args.dir))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        say(f"images: {args.size} MiB raw and zstd in {workdir}")
        raw, zstd = make_images(workdir / "images", size)
        disks = [stack.enter_context(loop_disk(workdir / f"disk{index}", size))
                 for index in range(max(2, args.machines))]
        agents = seed(url, HEARTBEAT_MACHINES)
        db = bmdb.connect(url)
        stack.callback(db.close)
        server = stack.enter_context(serve(url, workdir, "serve", {
            "SHEPHERD_IMAGE_DIR": str(raw.file.parent)}))
        yield Rig(Fleet(db, server, raw.file.parent), server, disks, raw, zstd, agents)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="image size, MiB")
    parser.add_argument("--machines", type=int, default=8, help="installs at once (figure 3)")
    parser.add_argument("--dir", default="/var/tmp",
                        help="where the images and the loop disks' files go")
    args = parser.parse_args()
    if args.size < 1 or args.machines < 1:
        parser.error("--size and --machines must be positive")
    reason = missing()
    if reason:
        print(f"skipped: {reason}")
        if args.json:
            args.json.write_text(json.dumps({"skipped": reason}))
        return
    signal.signal(signal.SIGTERM, terminated)

    def say(line: str) -> None:
        print(line, flush=True)

    started = time.monotonic()
    with rig(args, say) as bench:
        say(f"measuring: 1 machine raw, 1 machine zstd, {args.machines} machines raw")
        figures, details = measure(bench, args.machines)
    details["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        args.json.write_text(json.dumps({"figures": [asdict(f) | {"ratio": f.ratio}
                                                     for f in figures],
                                         "details": details}, indent=1))
    print(json.dumps(details, indent=1))
    print(HEADER)
    for figure in figures:
        print(figure.line())


if __name__ == "__main__":
    main()
