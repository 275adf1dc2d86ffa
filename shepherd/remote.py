"""Thin helpers over Fabric for the initializer: connect, upload, run with stdin.

Why a wrapper: the initializer needs two separate time limits (reaching the
machine vs. running the command) and errors it can classify for the BMDB
backoff cause, neither of which Fabric gives directly. With a ``host_key`` pin,
any other key is refused before authentication (``HostKeyMismatch``); without one
the key is accepted and reported (``Remote.host_key``), so the initializer can pin
it at the first takeover (freshly provisioned bare metal has no key we could know
beforehand).
"""

from __future__ import annotations

import io
import posixpath
import time
from pathlib import Path
from typing import NamedTuple

import fabric
import invoke
import paramiko
from paramiko.ssh_exception import NoValidConnectionsError

from shepherd.inventory.host_keys import ALGORITHMS, HostKeyError, parse_host_key
from shepherd.providers.ssh_keys import same_key


class RemoteError(Exception):
    """Anything that went wrong talking to a machine over SSH."""


class ConnectTimeout(RemoteError):
    """No SSH session within the connect timeout (TCP, banner or authentication)."""


class ConnectionRefused(RemoteError):
    """The machine actively refused the TCP connection (SSH not up)."""


class AuthenticationFailed(RemoteError):
    """The machine does not accept our key."""


class ExecTimeout(RemoteError):
    """The command did not finish within the exec timeout."""


class HostKeyMismatch(RemoteError):
    """The machine presented another host key than the one pinned for it."""

    def __init__(self, where: str, seen: str, expected: str) -> None:
        super().__init__(f"{where}: host key mismatch: the machine presented {seen} "
                         f"({fingerprint(seen)}), expected {expected} ({fingerprint(expected)})")
        self.seen = seen
        self.expected = expected


def fingerprint(key_line: str) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint of a public-key line (``type base64 [comment]``)."""
    try:
        return parse_host_key(key_line).fingerprint
    except HostKeyError:
        return "SHA256:?"


def _other_key_algorithms(pin: str) -> list[str]:
    """Every host-key algorithm but those of the pin's type: a server with several host
    keys shows the one the client prefers, and it must be the pinned one's type."""
    wanted = ALGORITHMS.get(pin.split()[0], ()) if pin.split() else ()
    return [name for name in paramiko.Transport._preferred_keys if name not in wanted]


class _PinPolicy(paramiko.MissingHostKeyPolicy):
    """Record the server's key; refuse it (before authentication) unless it is the pin."""

    def __init__(self, where: str, expected: str | None) -> None:
        self.where = where
        self.expected = expected
        self.seen: str | None = None

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str,
                         key: paramiko.PKey) -> None:
        self.seen = f"{key.get_name()} {key.get_base64()}"
        if self.expected is not None and not same_key(self.seen, self.expected):
            raise HostKeyMismatch(self.where, self.seen, self.expected)


class RunResult(NamedTuple):
    exit_code: int
    stdout: str
    stderr: str


class Remote:
    """One SSH connection to (address, port) as ``user`` with a private key file,
    to a machine that must present ``host_key`` when one is given."""

    def __init__(self, address: str, port: int, key_filename: Path | str, *,
                 user: str = "root", connect_timeout: float = 10.0,
                 exec_timeout: float = 60.0, host_key: str | None = None) -> None:
        self.address = address
        self.port = port
        self.connect_timeout = connect_timeout
        self.exec_timeout = exec_timeout
        config = fabric.Config(ssh_config=paramiko.SSHConfig(),
                               overrides={"load_ssh_configs": False})
        self.connection = fabric.Connection(
            host=address, port=port, user=user, config=config,
            connect_kwargs={
                "key_filename": [str(key_filename)],
                "look_for_keys": False,
                "allow_agent": False,
                # Fabric's connect_timeout is an int; paramiko takes floats here.
                "timeout": connect_timeout,
                "banner_timeout": connect_timeout,
                "auth_timeout": connect_timeout,
                "channel_timeout": connect_timeout,
                **({"disabled_algorithms": {"keys": _other_key_algorithms(host_key)}}
                   if host_key else {}),
            },
        )
        self._policy = _PinPolicy(f"{address}:{port}", host_key)
        self.connection.client.set_missing_host_key_policy(self._policy)

    @property
    def host_key(self) -> str | None:
        """The key the machine presented (``type base64``), once connected."""
        return self._policy.seen

    def __repr__(self) -> str:
        return f"Remote({self.address}:{self.port})"

    def __enter__(self) -> Remote:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        """Open the SSH session now, so connect failures are told from exec failures."""
        if self.connection.is_connected:
            return
        started = time.monotonic()
        try:
            self.connection.open()
        except HostKeyMismatch:
            self.connection.client.close()
            raise
        except Exception as error:
            self.connection.client.close()  # stop a half-open transport's thread
            raise self._classify(error, time.monotonic() - started) from error

    def _classify(self, error: Exception, elapsed: float) -> RemoteError:
        where = f"{self.address}:{self.port}"
        if isinstance(error, NoValidConnectionsError | ConnectionRefusedError):
            return ConnectionRefused(f"{where}: connection refused")
        if isinstance(error, paramiko.AuthenticationException):
            return AuthenticationFailed(f"{where}: our key was not accepted")
        # paramiko reports a silent peer in several ways ("Error reading SSH protocol
        # banner", "No existing session" after its negotiation wait ran out, a socket
        # timeout); what they share is that the connect timeout has passed. A peer that
        # reset the connection early is not a timeout.
        text = str(error).lower()
        if (isinstance(error, TimeoutError) or elapsed >= self.connect_timeout * 0.9
                or "timed out" in text):
            return ConnectTimeout(f"{where}: no SSH session within {self.connect_timeout}s "
                                  f"({error or type(error).__name__})")
        if isinstance(error, paramiko.SSHException | OSError | EOFError):
            return RemoteError(f"{where}: SSH failed: {error or type(error).__name__}")
        return RemoteError(f"{where}: unexpected {type(error).__name__}: {error}")

    def upload(self, local: Path | str, remote: str, mode: int = 0o755) -> None:
        """Put ``local`` at ``remote`` (parents created) with ``mode``, atomically.

        Written to a temporary name and renamed, so a running copy of the old file
        is never overwritten in place (ETXTBSY) and nobody sees a half-written one.
        """
        self.connect()
        temp = f"{remote}.upload-tmp"
        try:
            sftp = self.connection.sftp()
            _makedirs(sftp, posixpath.dirname(remote))
            sftp.put(str(local), temp)
            sftp.chmod(temp, mode)
            sftp.posix_rename(temp, remote)
        except (OSError, paramiko.SSHException, EOFError) as error:
            raise RemoteError(f"{self.address}:{self.port}: upload to {remote} failed: "
                              f"{error}") from error

    def run(self, command: str, stdin: bytes | str | None = None,
            timeout: float | None = None) -> RunResult:
        """Run ``command``, feeding ``stdin`` then EOF; never raises on a non-zero exit."""
        self.connect()
        limit = self.exec_timeout if timeout is None else timeout
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        try:
            result = self.connection.run(
                command, in_stream=io.BytesIO(data), hide=True, warn=True, pty=False,
                timeout=limit,
            )
        except invoke.CommandTimedOut as error:
            raise ExecTimeout(f"{self.address}:{self.port}: {command!r} did not finish "
                              f"within {limit}s") from error
        except invoke.ThreadException as error:
            # The command exited (or the channel closed) while its stdin was still
            # being written: whatever it answered is lost.
            found = "; ".join(f"{type(w.value).__name__}: {w.value}" for w in error.exceptions)
            raise RemoteError(f"{self.address}:{self.port}: streams to {command!r} failed: "
                              f"{found or 'unknown stream error'}") from error
        except (OSError, paramiko.SSHException, EOFError) as error:
            raise RemoteError(f"{self.address}:{self.port}: running {command!r} failed: "
                              f"{error}") from error
        return RunResult(result.exited, result.stdout, result.stderr)

    def close(self) -> None:
        self.connection.close()


def _makedirs(sftp: paramiko.SFTPClient, directory: str) -> None:
    if directory in ("", "/", "."):
        return
    try:
        sftp.stat(directory)
        return
    except OSError:
        pass
    _makedirs(sftp, posixpath.dirname(directory))
    try:
        sftp.mkdir(directory)
    except OSError:
        sftp.stat(directory)  # created meanwhile is fine; anything else raises
