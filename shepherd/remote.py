"""Thin helpers over Fabric and paramiko for the initializer: connect, upload, run with stdin.

Why a wrapper: the initializer needs two separate time limits (reaching the
machine vs. working on it) and errors it can classify for the BMDB backoff cause,
neither of which Fabric gives directly. With a ``host_key`` pin, any other key is
refused before authentication (``HostKeyMismatch``); without one the key is
accepted and reported (``Remote.host_key``), so the initializer can pin it at the
first takeover (freshly provisioned bare metal has no key we could know beforehand).

Fabric opens the connection; the upload and the command run on its paramiko
transport directly, each under one deadline (``_Deadline``). Why not Fabric's
``run``/``sftp``: paramiko waits without a timeout for the answer to an exec or
subsystem request and for every SFTP reply, so a machine that stops answering
mid-upload held the worker until Celery's hard limit; and invoke's runner keeps
all output in memory (joining it again at every chunk). Here captured output is
capped at ``OUTPUT_CAP`` bytes per stream: the rest is read and dropped, and the
kept text ends with a note saying how much was dropped.
"""

from __future__ import annotations

import io
import logging
import posixpath
import select
import threading
import time
from pathlib import Path
from typing import NamedTuple

import fabric
import paramiko
from paramiko.ssh_exception import NoValidConnectionsError

from shepherd.inventory.host_keys import ALGORITHMS, key_line_fingerprint
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


class UploadTimeout(RemoteError):
    """The SFTP upload did not finish within its timeout (the machine stopped answering)."""


class UploadRefused(RemoteError):
    """The machine's SFTP server refused to write the file there (permissions, a
    read-only or full file system): another place on the same machine may do."""


class NoSftp(RemoteError):
    """The SSH server started no working SFTP subsystem. sshd starts an external
    sftp-server through the login shell, so a shell that runs no commands (nologin)
    shows up here first, as do a missing sftp-server and a shell that prints a banner."""


class _AtDebug(logging.Filter):
    """Every record passes, demoted to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


#: Where our SSH clients' paramiko transports log. paramiko logs a peer that never
#: sends its banner (a hung machine: rung 0's everyday case) at ERROR, with its
#: traceback one record per line, from its own thread; ``Remote`` raises the same
#: failure as one classified line that the workflow records at the level it deserves.
#: So paramiko's account is kept for whoever turns DEBUG on, and no louder.
TRANSPORT_LOG = logging.getLogger(__name__ + ".transport")
TRANSPORT_LOG.addFilter(_AtDebug())

#: Bytes of stdout, and of stderr, kept from one command; the rest is read and dropped.
OUTPUT_CAP = 1 << 20
_CHUNK = 32768
_POLL = 0.5  # seconds between looks at a channel that signalled nothing (a safety net)


class HostKeyMismatch(RemoteError):
    """The machine presented another host key than the one pinned for it."""

    def __init__(self, where: str, seen: str, expected: str) -> None:
        super().__init__(f"{where}: host key mismatch: the machine presented {seen} "
                         f"({key_line_fingerprint(seen)}), expected {expected} "
                         f"({key_line_fingerprint(expected)})")
        self.seen = seen
        self.expected = expected


def _other_key_algorithms(pin: str) -> list[str]:
    """Every host-key algorithm but those of the pin's type: a server with several host
    keys shows the one the client prefers, and it must be the pinned one's type."""
    wanted = ALGORITHMS.get(pin.split()[0], ()) if pin.split() else ()
    # A class attribute paramiko documents nowhere, so its stubs leave it out.
    preferred: tuple[str, ...] = paramiko.Transport._preferred_keys  # type: ignore[attr-defined]
    return [name for name in preferred if name not in wanted]


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
                 exec_timeout: float = 60.0, host_key: str | None = None,
                 output_cap: int = OUTPUT_CAP) -> None:
        self.address = address
        self.port = port
        self.user = user
        self.connect_timeout = connect_timeout
        #: The limit of one command, and of one upload (``timeout`` overrides it per call).
        self.exec_timeout = exec_timeout
        self.output_cap = output_cap
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
        self.connection.client.set_log_channel(TRANSPORT_LOG.name)

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
        where = self.where
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
                                  f"({_said(error)})")
        if isinstance(error, paramiko.SSHException | OSError | EOFError):
            return RemoteError(f"{where}: SSH failed: {_said(error)}")
        return RemoteError(f"{where}: unexpected {type(error).__name__}: {error}")

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port}"

    def _transport(self) -> paramiko.Transport:
        transport: paramiko.Transport | None = self.connection.client.get_transport()
        if transport is None or not transport.is_active():
            raise RemoteError(f"{self.where}: the SSH session is gone")
        return transport

    def upload(self, content: bytes, remote: str, mode: int = 0o755,
               timeout: float | None = None) -> None:
        """Put ``content`` at ``remote`` (parents created) with ``mode``, atomically, within
        ``timeout`` (default: the exec timeout) or ``UploadTimeout``.

        Written to a temporary name and renamed, so a running copy of the old file
        is never overwritten in place (ETXTBSY) and nobody sees a half-written one:
        an upload cut off by its deadline leaves at most the temporary file.
        """
        self.connect()
        limit = self.exec_timeout if timeout is None else timeout
        temp = f"{remote}.upload-tmp"
        transport = self._transport()
        with _Deadline(transport, limit) as deadline:
            try:
                sftp = self._sftp(transport)
                with sftp:
                    _makedirs(sftp, posixpath.dirname(remote))
                    sftp.putfo(io.BytesIO(content), temp)
                    sftp.chmod(temp, mode)
                    sftp.posix_rename(temp, remote)
            except (OSError, paramiko.SSHException, EOFError) as error:
                if deadline.fired.is_set():
                    raise UploadTimeout(f"{self.where}: upload to {remote} did not finish "
                                        f"within {limit}s (SFTP stopped answering)") from error
                # paramiko raises OSError (IOError) for an SFTP status the server sent;
                # a broken connection is an OSError too, but not a refusal.
                refused = isinstance(error, OSError) and not isinstance(
                    error, (ConnectionError, TimeoutError))
                raise (UploadRefused if refused else RemoteError)(
                    f"{self.where}: upload to {remote} failed: {_said(error)}") from error

    def _sftp(self, transport: paramiko.Transport) -> paramiko.SFTPClient:
        try:
            sftp = paramiko.SFTPClient.from_transport(transport)
        except paramiko.SFTPError as error:  # the subsystem's first bytes were not SFTP
            raise NoSftp(
                f"{self.where}: the SSH server's SFTP subsystem did not start ({error}): "
                f"sshd runs it through the login shell of {self.user!r}, which must run "
                "commands (not nologin) and print nothing of its own") from error
        if sftp is None:
            raise paramiko.SSHException("no SFTP channel")
        return sftp

    def run(self, command: str, stdin: bytes | str | None = None,
            timeout: float | None = None) -> RunResult:
        """Run ``command``, feeding ``stdin`` then EOF; never raises on a non-zero exit.

        ``ExecTimeout`` unless it exits within ``timeout`` (default: the exec timeout);
        the SSH connection is then closed, which ends the command on a well-behaved
        sshd (as a hang-up does). Each output stream is kept up to ``output_cap`` bytes.
        """
        self.connect()
        limit = self.exec_timeout if timeout is None else timeout
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        transport = self._transport()
        with _Deadline(transport, limit) as deadline:
            try:
                done = _execute(transport, command, data, self.output_cap, self.connect_timeout)
            except (OSError, paramiko.SSHException, EOFError) as error:
                if deadline.fired.is_set():
                    raise ExecTimeout(f"{self.where}: {command!r} did not finish within "
                                      f"{limit}s") from error
                raise RemoteError(f"{self.where}: running {command!r} failed: "
                                  f"{_said(error)}") from error
        if done.exit_code < 0 and deadline.fired.is_set():  # closed before any exit status
            raise ExecTimeout(f"{self.where}: {command!r} did not finish within {limit}s")
        if done.stdin_error is not None and done.exit_code < 0:
            # The channel closed with neither the input written nor an exit status:
            # the connection broke, and there is no answer to judge.
            failure = done.stdin_error
            raise RemoteError(f"{self.where}: streams to {command!r} failed: "
                              f"{type(failure).__name__}: {failure}")
        # A command that exits without reading all its input (nologin, a shell that
        # cannot find the program) ends its channel while the input may still be on
        # its way; whether writing it failed is a race. Its status and output are the
        # same either way, so they are what run returns; the caller judges them (the
        # takeover protocol binds an answer to its request through the nonce).
        return RunResult(done.exit_code, done.stdout, done.stderr)

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


class _Deadline:
    """Close the SSH transport once ``seconds`` have passed, unless left before.

    Why closing the whole transport: it is the one action that wakes every paramiko
    call blocked on this connection (an exec or subsystem request never answered,
    an SFTP reply, a full send window); each then returns or raises at once, and
    ``fired`` tells the caller it was the deadline. The connection is not reused
    afterwards (``Remote.connect`` would open a new one).
    """

    def __init__(self, transport: paramiko.Transport, seconds: float) -> None:
        self.fired = threading.Event()
        self._transport = transport
        self._timer = threading.Timer(max(seconds, 0.0), self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired.set()
        self._transport.close()

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


class _Capture:
    """At most ``cap`` bytes of one output stream; what is beyond is counted, not kept."""

    def __init__(self, name: str, cap: int) -> None:
        self.name = name
        self.cap = cap
        self.kept = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = max(self.cap - len(self.kept), 0)
        self.kept += data[:room]
        self.dropped += max(len(data) - room, 0)

    def text(self) -> str:
        text = self.kept.decode("utf-8", "replace")
        if self.dropped:
            text += (f"\n[shepherd: {self.dropped} more bytes of {self.name} dropped; "
                     f"captured output is capped at {self.cap} bytes]\n")
        return text


class _Executed(NamedTuple):
    exit_code: int  # -1: the channel closed without an exit status (as paramiko says)
    stdout: str
    stderr: str
    stdin_error: BaseException | None


def _execute(transport: paramiko.Transport, command: str, data: bytes, cap: int,
             open_timeout: float) -> _Executed:
    """Run ``command`` on a new session channel: ``data`` to its stdin (from a thread,
    so a command that writes before it reads cannot deadlock us), its output read
    until EOF, then its exit status. Unbounded by itself: the caller's ``_Deadline``
    bounds it."""
    channel = transport.open_session(timeout=open_timeout)
    try:
        wake = channel.fileno()  # readable when either output buffer has data or closes
        channel.exec_command(command)
        failures: list[BaseException] = []
        feeder = threading.Thread(target=_feed, args=(channel, data, failures), daemon=True,
                                  name="remote-stdin")
        feeder.start()
        out, err = _Capture("stdout", cap), _Capture("stderr", cap)
        while True:
            while channel.recv_ready():
                out.add(channel.recv(_CHUNK))
            while channel.recv_stderr_ready():
                err.add(channel.recv_stderr(_CHUNK))
            if channel.eof_received or channel.closed:
                if not (channel.recv_ready() or channel.recv_stderr_ready()):
                    break
                continue
            select.select([wake], [], [], _POLL)
        channel.recv_exit_status()  # returns at the status, or when the channel closes
        feeder.join()
        return _Executed(channel.exit_status, out.text(), err.text(),
                         failures[0] if failures else None)
    finally:
        channel.close()


def _feed(channel: paramiko.Channel, data: bytes, failures: list[BaseException]) -> None:
    try:
        if data:
            channel.sendall(data)
        channel.shutdown_write()
    except (OSError, EOFError, paramiko.SSHException) as error:
        failures.append(error)


def _said(error: BaseException) -> str:
    """What ``error`` says, or its type when it says nothing (paramiko raises some
    errors without a message; an exception object itself is always true)."""
    return str(error) or type(error).__name__
