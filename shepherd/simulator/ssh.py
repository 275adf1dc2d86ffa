"""Per-device SSH servers: paramiko, public-key auth, SFTP into a sandbox, real exec.

Each device listens on its own loopback address (127.net.x.y) and the configured
port. While a device is not up (provisioning, rebooting, ``ssh_refused``) its
listening socket is closed, so clients get a real ECONNREFUSED. Commands run as
``bash -c`` in the device's sandbox with ``SHEPHERD_SIM_DEVICE`` in their
environment: that marker is how processes that detached (double fork + setsid)
are still found and killed on reboot or an "agent killed" fault.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import posixpath
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from paramiko.common import (
    AUTH_FAILED,
    AUTH_SUCCESSFUL,
    OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED,
    OPEN_SUCCEEDED,
)
from paramiko.sftp import SFTP_OK, SFTP_OP_UNSUPPORTED
from typing_extensions import Buffer

from shepherd.os_processes import kill_marked

log = logging.getLogger(__name__)
MARKER = "SHEPHERD_SIM_DEVICE"
INSTANCE_MARKER = "SHEPHERD_SIM_INSTANCE"
#: The device's sandbox path: unique to one simulator's workdir, unlike a rack's
#: readable device id, so it finds exactly this world's leftover processes.
SANDBOX_MARKER = "SHEPHERD_SIM_SANDBOX"
#: Where a device's agent reads /proc and /sys (and finds its disk), when it has a fake
#: system root (``shepherd.simulator.disks``).
SYS_ROOT_ENV = "SHEPHERD_AGENT_SYS_ROOT"
POLL = 0.05
# paramiko logs every probe and hang-up as an error; for a simulator that is noise.
TRANSPORT_LOG = logging.getLogger(__name__ + ".transport")
TRANSPORT_LOG.setLevel(logging.CRITICAL)


def generate_host_key() -> paramiko.PKey:
    """A fresh ed25519 host key (fast, unlike RSA generation)."""
    return host_key_from_text(generate_host_key_text())


def generate_host_key_text() -> str:
    """A fresh ed25519 host key as OpenSSH private-key text: what a persisted world
    stores (paramiko can read an Ed25519 key but not write one back)."""
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode()


def host_key_from_text(text: str) -> paramiko.PKey:
    """The host key ``generate_host_key_text`` wrote (ValueError if it is not one)."""
    try:
        return paramiko.Ed25519Key(file_obj=io.StringIO(text))
    except paramiko.SSHException as error:
        raise ValueError(f"not an OpenSSH ed25519 private key: {error}") from None


# -- SFTP ------------------------------------------------------------------------


def _sftp_errno(error: OSError) -> int:
    """The SFTP status for ``error`` (a failure without an errno is an I/O error)."""
    return paramiko.SFTPServer.convert_errno(error.errno or errno.EIO)


class SandboxHandle(paramiko.SFTPHandle):
    """An open file in the sandbox. ``stall`` is called before every write: it returns
    at once unless the "SFTP stalls" fault holds the write (and so every later reply,
    as the SFTP server answers requests in order)."""

    # Set by whoever opens the handle (paramiko's convention, absent from its stubs).
    filename: str
    readfile: IO[bytes]
    writefile: IO[bytes]

    def __init__(self, flags: int = 0, stall: Callable[[], None] = lambda: None) -> None:
        super().__init__(flags)
        self.stall = stall

    def write(self, offset: int, data: Buffer) -> int:
        self.stall()
        return super().write(offset, data)

    def stat(self) -> Any:
        try:
            return paramiko.SFTPAttributes.from_stat(os.fstat(self.readfile.fileno()))
        except OSError as error:
            return _sftp_errno(error)

    def chattr(self, attr: paramiko.SFTPAttributes) -> int:
        try:
            paramiko.SFTPServer.set_file_attr(self.filename, attr)
        except OSError as error:
            return _sftp_errno(error)
        return SFTP_OK


class SandboxSFTP(paramiko.SFTPServerInterface):
    """SFTP where "/" is the device's sandbox directory; ".." cannot climb out."""

    def __init__(self, server: Any, *args: Any, root: str,
                 stalls: Callable[[], bool] = lambda: False,
                 stopped: threading.Event | None = None, **kwargs: Any) -> None:
        super().__init__(server, *args, **kwargs)
        self.root = root
        self.stalls = stalls
        self.stopped = stopped or threading.Event()

    def _stall(self) -> None:
        """Hold while the fault is set: the client sees an upload that stops answering
        mid-way (the file is open, its data sent, no reply ever comes)."""
        while self.stalls() and not self.stopped.is_set():
            self.stopped.wait(POLL)

    def _local(self, path: str) -> str:
        relative = posixpath.normpath("/" + path).lstrip("/")
        return os.path.join(self.root, relative)

    def canonicalize(self, path: str) -> str:
        return posixpath.normpath("/" + path)

    def list_folder(self, path: str) -> Any:
        local = self._local(path)
        try:
            out = []
            for name in os.listdir(local):
                attr = paramiko.SFTPAttributes.from_stat(os.lstat(os.path.join(local, name)))
                attr.filename = name
                out.append(attr)
            return out
        except OSError as error:
            return _sftp_errno(error)

    def stat(self, path: str) -> Any:
        try:
            return paramiko.SFTPAttributes.from_stat(os.stat(self._local(path)))
        except OSError as error:
            return _sftp_errno(error)

    def lstat(self, path: str) -> Any:
        try:
            return paramiko.SFTPAttributes.from_stat(os.lstat(self._local(path)))
        except OSError as error:
            return _sftp_errno(error)

    def open(self, path: str, flags: int, attr: paramiko.SFTPAttributes) -> Any:
        local = self._local(path)
        mode = attr.st_mode if attr is not None and attr.st_mode is not None else 0o644
        try:
            fd = os.open(local, flags | getattr(os, "O_BINARY", 0), mode & 0o7777)
        except OSError as error:
            return _sftp_errno(error)
        if flags & os.O_CREAT and attr is not None:
            # The mode was given to open; paramiko keeps which fields are set privately.
            attr._flags &= ~attr.FLAG_PERMISSIONS  # type: ignore[attr-defined]
            paramiko.SFTPServer.set_file_attr(local, attr)
        if flags & os.O_WRONLY:
            fmode = "ab" if flags & os.O_APPEND else "wb"
        elif flags & os.O_RDWR:
            fmode = "a+b" if flags & os.O_APPEND else "r+b"
        else:
            fmode = "rb"
        try:
            handle_file = os.fdopen(fd, fmode)
        except OSError as error:
            return _sftp_errno(error)
        handle = SandboxHandle(flags, self._stall)
        handle.filename = local
        handle.readfile = handle_file
        handle.writefile = handle_file
        return handle

    def _simple(self, action: Callable[[], object]) -> int:
        try:
            action()
        except OSError as error:
            return _sftp_errno(error)
        return SFTP_OK

    def remove(self, path: str) -> int:
        return self._simple(lambda: os.remove(self._local(path)))

    def rename(self, oldpath: str, newpath: str) -> int:
        return self._simple(lambda: os.rename(self._local(oldpath), self._local(newpath)))

    def posix_rename(self, oldpath: str, newpath: str) -> int:
        return self._simple(lambda: os.replace(self._local(oldpath), self._local(newpath)))

    def mkdir(self, path: str, attr: paramiko.SFTPAttributes) -> int:
        local = self._local(path)

        def make() -> None:
            os.mkdir(local)
            if attr is not None:
                paramiko.SFTPServer.set_file_attr(local, attr)

        return self._simple(make)

    def rmdir(self, path: str) -> int:
        return self._simple(lambda: os.rmdir(self._local(path)))

    def chattr(self, path: str, attr: paramiko.SFTPAttributes) -> int:
        return self._simple(lambda: paramiko.SFTPServer.set_file_attr(self._local(path), attr))

    def symlink(self, target_path: str, path: str) -> int:
        return SFTP_OP_UNSUPPORTED  # a link could point out of the sandbox


# -- SSH server ------------------------------------------------------------------


class DeviceInterface(paramiko.ServerInterface):
    """Auth and channel policy for one device's SSH server."""

    def __init__(self, endpoint: DeviceSSH) -> None:
        self.endpoint = endpoint

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        # Read at auth time: a key registered a moment ago must work now.
        if username == "root" and key.get_base64() in self.endpoint.authorized_keys():
            return AUTH_SUCCESSFUL
        return AUTH_FAILED

    def check_channel_request(self, kind: str, chanid: int) -> int:
        if kind == "session":
            return OPEN_SUCCEEDED
        return OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        text = command.decode("utf-8", "replace")
        threading.Thread(target=self.endpoint.run_command, args=(channel, text),
                         name=f"sim-exec-{self.endpoint.device_id[:8]}", daemon=True).start()
        return True


class DeviceSSH:
    """The SSH endpoint of one simulated device: a listener thread and its sessions."""

    def __init__(self, *, device_id: str, address: str, port: int, sandbox: Path,
                 host_key: paramiko.PKey, instance: str,
                 is_up: Callable[[], bool], hangs: Callable[[], bool],
                 authorized_keys: Callable[[], set[str]],
                 latency: Callable[[], float] = lambda: 0.0,
                 exec_hangs: Callable[[], bool] = lambda: False,
                 sftp_stalls: Callable[[], bool] = lambda: False) -> None:
        self.device_id = device_id
        self.address = address
        self.port = port
        self.sandbox = sandbox
        self.host_key = host_key
        self.instance = instance
        self.is_up = is_up
        self.hangs = hangs
        self.authorized_keys = authorized_keys
        self.latency = latency
        self.exec_hangs = exec_hangs
        self.sftp_stalls = sftp_stalls
        #: The device's fake system root once it has a disk (``disks.attach``): its
        #: commands' agent reads it instead of "/".
        self.sys_root: Path | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._transports: set[paramiko.Transport] = set()
        self._hung: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._passes = 0  # listening-loop passes done; ``settle`` waits on it
        self._passed = threading.Condition()
        self.bind_error: str | None = None
        self._thread = threading.Thread(target=self._serve, name=f"sim-ssh-{device_id[:8]}",
                                        daemon=True)

    def start(self) -> DeviceSSH:
        self.sandbox.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    # -- listening ----------------------------------------------------------

    def _serve(self) -> None:
        listener: socket.socket | None = None
        try:
            while not self._stop.is_set():
                up = self.is_up()
                if up and listener is None:
                    listener = self._bind()
                elif not up and listener is not None:
                    listener.close()
                    listener = None
                if listener is None:
                    self._stop.wait(POLL)
                elif select.select([listener], [], [], POLL)[0]:
                    self._accept(listener)
                self._count_pass()
        finally:
            if listener is not None:
                listener.close()
            self._count_pass()

    def _count_pass(self) -> None:
        with self._passed:
            self._passes += 1
            self._passed.notify_all()

    def settle(self, timeout: float = 2.0) -> None:
        """Return once the listener reflects ``is_up()`` as it is now.

        The loop polls ``is_up`` every ``POLL``; without this a reboot would leave
        the old listener accepting for up to one pass, and a client connecting
        right after the reboot call returned would not get the ECONNREFUSED a
        rebooting machine gives. Two full passes after the call guarantee that
        one of them read the new state.
        """
        deadline = time.monotonic() + timeout
        with self._passed:
            target = self._passes + 2
            while self._passes < target and self._thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._passed.wait(remaining)

    def _bind(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.address, self.port))
        except OSError as error:
            sock.close()
            self.bind_error = f"{self.address}:{self.port}: {error}"
            log.warning("simulated device %s cannot listen on %s", self.device_id,
                        self.bind_error)
            self._stop.wait(0.5)
            return None
        self.bind_error = None
        sock.listen(16)
        return sock

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        if self.hangs():
            with self._lock:
                self._hung.append(conn)  # TCP is up, the banner never comes
            return
        thread = threading.Thread(target=self._session, args=(conn,), daemon=True,
                                  name=f"sim-ssh-conn-{self.device_id[:8]}")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _session(self, conn: socket.socket) -> None:
        delay = self.latency()
        if delay > 0 and self._stop.wait(delay):  # a slow or far-away machine
            conn.close()
            return
        transport = paramiko.Transport(conn)
        transport.set_log_channel(TRANSPORT_LOG.name)
        with self._lock:
            self._transports.add(transport)
        try:
            transport.add_server_key(self.host_key)
            transport.set_subsystem_handler("sftp", paramiko.SFTPServer, SandboxSFTP,
                                            root=str(self.sandbox), stalls=self.sftp_stalls,
                                            stopped=self._stop)
            transport.start_server(server=DeviceInterface(self))
            # Channels act through DeviceInterface callbacks, but paramiko only holds
            # them weakly: keep the accepted ones referenced or they close at once.
            channels: list[paramiko.Channel] = []
            while transport.is_active() and not self._stop.is_set():
                channel = transport.accept(0.2)
                channels = [c for c in channels if not c.closed]
                if channel is not None:
                    channels.append(channel)
        except (paramiko.SSHException, OSError, EOFError) as error:
            log.debug("simulated device %s: SSH session ended: %s", self.device_id, error)
        finally:
            transport.close()
            with self._lock:
                self._transports.discard(transport)

    # -- exec ---------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        """The command environment; the simulator's Python comes first on PATH."""
        path = os.pathsep.join([os.path.dirname(sys.executable),
                                os.environ.get("PATH", "/usr/bin:/bin")])
        env = {"PATH": path, "HOME": str(self.sandbox), "LANG": "C.UTF-8",
               "USER": "root", MARKER: self.device_id,
               SANDBOX_MARKER: str(self.sandbox), INSTANCE_MARKER: self.instance}
        if self.sys_root is not None:
            env[SYS_ROOT_ENV] = str(self.sys_root)
        return env

    def run_command(self, channel: paramiko.Channel, command: str) -> None:
        """Run ``command`` like sshd would: streams in and out, exit status, then close."""
        if self.exec_hangs():  # a wedged host: nothing runs, nothing answers, until hang-up
            while not (channel.closed or self._stop.is_set()):
                time.sleep(POLL)
            return
        try:
            proc = subprocess.Popen(
                ["bash", "-c", command], cwd=self.sandbox, env=self.environment(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as error:
            with contextlib.suppress(Exception):
                channel.sendall_stderr(f"exec failed: {error}\n".encode())
                channel.send_exit_status(127)
                channel.close()
            return
        threading.Thread(target=_pump_stdin, args=(channel, proc), daemon=True).start()
        pumps = [
            threading.Thread(target=_pump_out, args=(proc.stdout, channel.sendall), daemon=True),
            threading.Thread(target=_pump_out, args=(proc.stderr, channel.sendall_stderr),
                             daemon=True),
        ]
        for pump in pumps:
            pump.start()
        self._await(proc, channel, pumps)
        with contextlib.suppress(Exception):
            channel.send_exit_status(proc.returncode if proc.returncode >= 0
                                     else 128 - proc.returncode)
            channel.close()

    def _await(self, proc: subprocess.Popen[bytes], channel: paramiko.Channel,
               pumps: list[threading.Thread]) -> None:
        # The client hanging up (e.g. its exec timeout) ends the command's process group,
        # as a SIGHUP would; detached processes (their own session) survive, as on a host.
        while proc.poll() is None or any(p.is_alive() for p in pumps):
            if proc.poll() is None and (channel.closed or self._stop.is_set()):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if proc.poll() is not None and (channel.closed or self._stop.is_set()):
                break
            time.sleep(POLL)
        proc.wait()

    # -- lifecycle ----------------------------------------------------------

    def kill_processes(self) -> int:
        return kill_marked(MARKER, self.device_id)

    def drop_sessions(self) -> None:
        """Close every SSH session and hung socket (what a reboot does to them)."""
        with self._lock:
            transports, hung = list(self._transports), list(self._hung)
            self._hung.clear()
        for transport in transports:
            transport.close()
        for sock in hung:
            with contextlib.suppress(OSError):
                sock.close()

    def stop(self) -> None:
        self._stop.set()
        self.drop_sessions()
        self.kill_processes()
        self._thread.join(timeout=5)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)


def _pump_stdin(channel: paramiko.Channel, proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    try:
        while True:
            data = channel.recv(32768)
            if not data:
                break
            proc.stdin.write(data)
            proc.stdin.flush()
    except (OSError, EOFError, ValueError):
        pass
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()


def _pump_out(stream: Any, send: Callable[[bytes], None]) -> None:
    fd = stream.fileno()
    broken = False
    while True:
        try:
            data = os.read(fd, 32768)
        except OSError as error:
            if error.errno == errno.EINTR:
                continue
            break
        if not data:
            break
        if not broken:
            try:
                send(data)
            except (OSError, EOFError, paramiko.SSHException):
                broken = True  # keep draining so the process never blocks on a full pipe
    stream.close()
