"""Throw-away PostgreSQL and Redis servers for the tests, started from the installed binaries.

Each server gets its own data directory and a free loopback port, and is stopped
when the test run ends. ``SHEPHERD_TEST_PG_URL`` / ``SHEPHERD_TEST_REDIS_URL``
point the tests at existing servers instead (tests that restart a server then
skip, since they cannot restart someone else's).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import glob
import ipaddress
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.waiting import wait_until

INSTALL_HINT = "apt-get install -y postgresql redis-server"


class MissingServer(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1", *, udp: bool = False) -> int:
    """A port nothing holds now (TCP, or UDP for ``udp``); whoever binds it next may
    still lose a race for it, so servers that can retry on another one do."""
    kind = socket.SOCK_DGRAM if udp else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout: float = 30.0) -> None:
    wait_until(lambda: listening(host, port), timeout, f"a listener on {host}:{port}",
               every=0.05)


def self_signed(directory: Path, name: str = "server") -> tuple[str, str]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as files ``name``.crt and
    ``name``.key in ``directory`` (created if need be)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shepherd-test")])
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(
            ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def _postgres_bindir() -> Path:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    found = shutil.which("pg_ctl")
    if found:
        candidates.insert(0, str(Path(os.path.realpath(found)).parent))
    for directory in candidates:
        if (Path(directory) / "initdb").exists() and (Path(directory) / "postgres").exists():
            return Path(directory)
    raise MissingServer(f"PostgreSQL server binaries not found; install them with: {INSTALL_HINT}")


class PostgresServer:
    """A private PostgreSQL cluster. As root, it runs as the ``postgres`` user (initdb insists)."""

    def __init__(self, fsync: bool = False) -> None:
        self.bindir = _postgres_bindir()
        self.fsync = fsync
        self.port = free_port()
        self.datadir = Path(tempfile.mkdtemp(prefix="shepherd-pg-"))
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.datadir, user.pw_uid, user.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as_user, *args], check=True, capture_output=True, timeout=120)

    def start(self) -> PostgresServer:
        if not (self.datadir / "PG_VERSION").exists():
            self._run(str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", "postgres",
                      "--auth=trust", "-E", "UTF8", "--no-sync")
        options = (
            f"-p {self.port} -k {self.datadir} -c listen_addresses=127.0.0.1 "
            f"-c max_connections=300 -c fsync={'on' if self.fsync else 'off'} "
            f"-c synchronous_commit={'on' if self.fsync else 'off'} -c full_page_writes=off"
        )
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-o", options,
                  "-l", str(self.datadir / "server.log"), "-w", "-t", "60", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop")

    def restart(self, down_for: float = 0.0) -> None:
        self.stop(mode="immediate")
        time.sleep(down_for)
        self.start()

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop(mode="immediate")
        shutil.rmtree(self.datadir, ignore_errors=True)


def redis_db_url(url: str, db: int) -> str:
    """``url`` (a Redis server's, with or without a database) naming database ``db``."""
    base = url.rsplit("/", 1)[0] if url.count("/") > 2 else url
    return f"{base}/{db}"


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise MissingServer(f"redis-server not found; install it with: {INSTALL_HINT}")
        self.binary = binary
        self.port = free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="shepherd-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port("127.0.0.1", self.port)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def restart(self, down_for: float = 0.0) -> None:
        """Kill and start again: like a crash, everything it held is lost."""
        self.stop()
        time.sleep(down_for)
        self.start()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
