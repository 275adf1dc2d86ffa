"""BMCs no one here wrote, on loopback (fixtures registered by ``tests/conftest.py``).

* ``redfish_bmc``: one ``sushy-emulator`` (fake driver, Basic auth) with one system,
  ``node-1``, powered On. Its power changes land 1 to 11 s after the reset.
* ``ipmi_bmc``: one ``ipmi_sim`` (Debian's ``openipmi``) whose chassis power and boot
  device are files, written by its ``chassis_control`` script; ``ipmitool`` reads
  them too.

Each has a random password in a 0600 file, and builds the ``BmcSpec`` an
inventory would give (``.spec()``), with another password file to test refusals.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from shepherd.bmc import BmcSpec
from shepherd.os_processes import stop_process
from shepherd.simulator.redfish import RedfishEmulator
from tests.support.servers import free_port
from tests.support.waiting import wait_until

IPMI_HINT = "apt-get install -y openipmi ipmitool"
USERNAME = "admin"


def secret_file(path: Path, password: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(password + "\n")
    return path


def new_password(size: int = 12) -> str:
    """Recognisable in a leak check, and never a substring of anything else."""
    return f"pw-{secrets.token_hex(size)}"


def ipmi_password() -> str:
    """15 characters: IPMI 1.5 allows 16, IPMI 2.0 20 (ipmi_sim refuses longer ones)."""
    return new_password(6)


# -- Redfish ---------------------------------------------------------------------------


class RedfishBmc:
    """A running emulator plus the credentials files a spec points at."""

    def __init__(self, emulator: RedfishEmulator, password: str, directory: Path) -> None:
        self.emulator = emulator
        self.password = password
        self.password_file = secret_file(directory / "bmc-password", password)
        self.wrong_password_file = secret_file(directory / "bmc-wrong", new_password())

    @property
    def address(self) -> str:
        return self.emulator.base_url

    def spec(self, system: str | None = None, *, wrong_password: bool = False,
             **overrides: object) -> BmcSpec:
        """``system``: an emulated system's *name* (its path is filled in), or None
        to let the driver discover it."""
        fields: dict[str, object] = {
            "driver": "redfish", "address": self.address, "username": USERNAME,
            "password_file": str(self.wrong_password_file if wrong_password
                                 else self.password_file),
            "system": self.emulator.system_path(system) if system else None,
        }
        fields.update(overrides)
        return BmcSpec(**fields)  # type: ignore[arg-type]

    def power_state(self, name: str = "node-1") -> str:
        return self.emulator.power_state(name)

    def boot_target(self, name: str = "node-1") -> str:
        return self.emulator.boot_target(name)


@contextlib.contextmanager
def running_redfish(directory: Path, systems: Sequence[tuple[str, str]] = (("node-1", "On"),),
                    **options: object) -> Iterator[RedfishBmc]:
    """An emulator with ``systems`` as (name, power state); ``options`` go to
    ``RedfishEmulator`` (``notify_url``, ``frozen``, ``ignore_boot``...)."""
    password = new_password()
    entries = [(name, str(uuid.uuid4()), state) for name, state in systems]
    emulator = RedfishEmulator(entries, username=USERNAME, password=password,
                               workdir=directory / "emulator", **options)  # type: ignore[arg-type]
    with emulator:
        yield RedfishBmc(emulator, password, directory)


@pytest.fixture
def redfish_bmc(tmp_path: Path) -> Iterator[RedfishBmc]:
    with running_redfish(tmp_path / "redfish") as bmc:
        yield bmc


# -- IPMI ------------------------------------------------------------------------------

CHASSIS_SCRIPT = """#!/bin/sh
# ipmi_sim's chassis_control: "<mc> get <param>..." prints param:value lines;
# "<mc> set <param> <value>" changes it. Power and the boot device are files (ipmi_sim
# asks "get boot" whenever the boot flags are read: the file is the BMC's memory);
# resets are counted. A "get" first sleeps the seconds in the file "delay" (ipmi_sim
# waits for this script: a slow BMC). Each call appends one line when it ends,
# "<start> <end> <args>" (epoch seconds), so that overlapping calls are told apart.
dir=$(dirname "$0")
start=$(date +%s.%N)
args="$*"
trap 'echo "$start $(date +%s.%N) $args" >> "$dir/chassis.log"' EXIT
shift
op=$1; shift
if [ "$op" = get ]; then
  sleep "$(cat "$dir/delay")"
  for p in "$@"; do
    [ "$p" = power ] && echo "power:$(cat "$dir/power")"
    [ "$p" = boot ] && echo "boot:$(cat "$dir/boot")"
  done
  exit 0
fi
case "$1" in
  power) echo "$2" > "$dir/power" ;;
  reset) echo $(( $(cat "$dir/resets") + 1 )) > "$dir/resets" ;;
  boot) echo "$2" > "$dir/boot" ;;
  *) exit 1 ;;
esac
"""

LAN_CONF = """name "shepherd-test"
set_working_mc 0x20
  startlan 1
    addr 127.0.0.1 {port}
    priv_limit admin
    allowed_auths_callback none md2 md5 straight
    allowed_auths_user none md2 md5 straight
    allowed_auths_operator none md2 md5 straight
    allowed_auths_admin none md2 md5 straight
    guid {guid}
  endlan
{chassis}
  user 2 true "{username}" "{password}" admin 10 none md2 md5 straight
"""

#: The system GUID ipmi_sim answers Get System GUID with, as the 16 bytes it sends (hex,
#: first byte first): the lan.conf ``guid`` line, inside ``startlan`` (``man ipmi_lan``).
#: Without one ipmi_sim refuses RMCP+ sessions ("This BMC does not support IPMI v2").
IPMI_GUID = "a123456789abcdefa123456789abcdef"

#: Device support 0x9f includes "FRU inventory device": FRU device 0 is ``{fru}``, the
#: ``FRU_LINE`` or nothing (then ipmi_sim answers "Invalid data field" for it).
EMU = """mc_setbmc 0x20
mc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02 persist_sdr
{fru}sel_enable 0x20 1000 0x0a
mc_enable 0x20
"""
#: FRU device 0's data read from a file (``man ipmi_sim_cmd``), ``size`` bytes.
FRU_LINE = 'mc_add_fru_data 0x20 0 {size} file 0 "{path}"\n'


@dataclass(frozen=True)
class IpmiFru:
    """FRU device 0 of the simulated machine: a product area (the system, as SMBIOS
    type 1 and Linux's product_serial/product_name have it) and a board area (the
    mainboard, with its own serial), each value distinct so a test tells which one a
    reader took."""

    product_serial: str = "SYS-0042-A"
    product_name: str = "Shepherd Test Server"
    product_part: str = "STS-PN-7"
    manufacturer: str = "Shepherd Labs"
    board_serial: str = "BRD-7731-Z"
    board_name: str = "STS Mainboard"

    def image(self, size: int = 256) -> bytes:
        """The FRU as stored (Platform Management FRU Information Storage Definition
        1.0: common header, board area, product area), padded to ``size`` bytes."""
        board = fru_area([b"\x00\x00\x00", fru_field(self.manufacturer),
                          fru_field(self.board_name), fru_field(self.board_serial),
                          fru_field("BRD-PN-1"), fru_field("")])
        product = fru_area([fru_field(self.manufacturer), fru_field(self.product_name),
                            fru_field(self.product_part), fru_field("v1"),
                            fru_field(self.product_serial), fru_field("ASSET-1"),
                            fru_field("")])
        header = with_checksum(bytes([1, 0, 0, 1, 1 + len(board) // 8, 0, 0]))
        data = header + board + product
        assert len(data) <= size, "FRU larger than its device"
        return data.ljust(size, b"\x00")


def fru_field(text: str) -> bytes:
    """A type/length byte (8-bit ASCII, its length) and the text."""
    raw = text.encode("latin-1")
    return bytes([0xC0 | len(raw)]) + raw


def fru_area(fields: list[bytes]) -> bytes:
    """A FRU info area: version, length in 8 bytes, language English, ``fields`` (a
    board area's first is its manufacturing date), end marker, padding, checksum."""
    body = b"\x00" + b"".join(fields) + b"\xc1"
    length = -(-(len(body) + 3) // 8) * 8
    return with_checksum(bytes([1, length // 8]) + body.ljust(length - 3, b"\x00"))


def with_checksum(data: bytes) -> bytes:
    return data + bytes([-sum(data) & 0xFF])


class IpmiBmc:
    """One ``ipmi_sim`` on ``127.0.0.1:port`` (UDP), its chassis power in a file."""

    def __init__(self, directory: Path, power_on: bool = True,
                 chassis_control: bool = True, guid: str = IPMI_GUID,
                 fru: IpmiFru | None = IpmiFru()) -> None:
        """``chassis_control=False``: no script, so ipmi_sim reads power but refuses
        to change it ("Invalid data field in request"), a BMC that cannot do that.
        ``guid``: the system GUID's 16 bytes in hex, as sent (``IPMI_GUID``).
        ``fru``: FRU device 0, or None for a BMC without one."""
        binary = shutil.which("ipmi_sim")
        if binary is None or shutil.which("ipmitool") is None:
            pytest.fail(f"ipmi_sim or ipmitool not found; install them with: {IPMI_HINT}")
        self.binary = binary
        self.chassis_control = chassis_control
        self.guid = guid
        self.fru = fru
        self.directory = directory
        self.password = ipmi_password()
        directory.mkdir(parents=True, exist_ok=True)
        self.script = directory / "chassis.sh"
        self.script.write_text(CHASSIS_SCRIPT)
        self.script.chmod(0o755)
        (directory / "power").write_text("1\n" if power_on else "0\n")
        (directory / "resets").write_text("0\n")
        (directory / "boot").write_text("none\n")
        self.set_delay(0)
        (directory / "state").mkdir(exist_ok=True)
        if fru is not None:
            (directory / "fru.bin").write_bytes(fru.image())
        #: What a spec points at: the password Shepherd was given (``set_password``
        #: leaves it behind, as an inventory not yet told).
        self.password_file = secret_file(directory / "bmc-password", self.password)
        self.wrong_password_file = secret_file(directory / "bmc-wrong", ipmi_password())
        #: The BMC's password now, for ipmitool.
        self.current_password_file = secret_file(directory / "bmc-current", self.password)
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> IpmiBmc:
        """Starts ipmi_sim: on a free port the first time, on the same one after a
        ``stop()`` (a BMC that answers again, where its clients' specs point)."""
        fixed = self.port != 0
        for _ in range(3):  # a UDP port picked by bind-and-close can be taken meanwhile
            if not fixed:
                self.port = free_port(udp=True)
            self._write_config()
            log = (self.directory / "ipmi_sim.log").open("ab")
            self.process = subprocess.Popen(
                [self.binary, "-c", str(self.directory / "lan.conf"),
                 "-f", str(self.directory / "sim.emu"), "-s", str(self.directory / "state"),
                 "-n"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
            log.close()
            if self._answers_or_exits() and self.process.poll() is None:
                return self
            self.stop()
        raise RuntimeError(f"ipmi_sim did not start; see {self.directory / 'ipmi_sim.log'}")

    def _write_config(self) -> None:
        conf = self.directory / "lan.conf"
        # ipmi_sim reads the password from this file: it stays in the test's directory.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            chassis = (f'  chassis_control "{self.script} 0x20"' if self.chassis_control
                       else "")
            handle.write(LAN_CONF.format(port=self.port, chassis=chassis, guid=self.guid,
                                         username=USERNAME, password=self.password))
        fru = self.directory / "fru.bin"
        line = FRU_LINE.format(size=fru.stat().st_size, path=fru) if self.fru else ""
        (self.directory / "sim.emu").write_text(EMU.format(fru=line))

    def _answers_or_exits(self, timeout: float = 10.0) -> bool:
        """Whether ipmi_sim answered within ``timeout`` (or exited, e.g. on a port taken
        meanwhile: then the caller tries another)."""
        process = self.process
        assert process is not None
        with contextlib.suppress(AssertionError):
            return wait_until(lambda: process.poll() is not None or
                              self.ipmitool("chassis", "power", "status").returncode == 0,
                              timeout, "ipmi_sim answering")
        return False

    def stop(self) -> None:
        """Stops ipmi_sim (and waits for it). ``start`` binds the same port again; it is
        not held meanwhile, so another test's ``free_port`` could take it (rarely)."""
        process, self.process = self.process, None
        stop_process(process)

    def set_password(self, new: str | None = None) -> str:
        """Restarts ipmi_sim on the same port with ``new`` (a fresh one by default) as
        the user's password: a BMC whose password was changed. ``password_file`` keeps
        the old one; write the new one there (``secret_file``) once "told"."""
        self.stop()
        self.password = new or ipmi_password()
        secret_file(self.current_password_file, self.password)
        self.start()
        return self.password

    def set_delay(self, seconds: float) -> None:
        """Every chassis "get" (power, boot device) takes ``seconds`` more from now on."""
        (self.directory / "delay").write_text(f"{seconds:g}\n")

    def spec(self, *, wrong_password: bool = False, **overrides: object) -> BmcSpec:
        fields: dict[str, object] = {
            "driver": "ipmi", "address": "127.0.0.1", "port": self.port, "username": USERNAME,
            "password_file": str(self.wrong_password_file if wrong_password
                                 else self.password_file),
        }
        fields.update(overrides)
        return BmcSpec(**fields)  # type: ignore[arg-type]

    def ipmitool(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Debian's ipmitool against this BMC (cipher suite 3: no 10 s suite probing;
        the BMC's current password from its file, not argv)."""
        return subprocess.run(
            ["ipmitool", "-I", "lanplus", "-C", "3", "-H", "127.0.0.1", "-p", str(self.port),
             "-U", USERNAME, "-f", str(self.current_password_file), *args],
            capture_output=True, text=True, timeout=20)

    def powered(self) -> bool:
        """The chassis power as the simulated machine has it (on: True). A method, not a
        property: each call reads it anew, and the type checker must not assume that
        two reads around a power action agree."""
        return (self.directory / "power").read_text().strip() == "1"

    def boot_param(self) -> str:
        """The boot device as the simulated machine has it, in ipmi_sim's words: ``none``,
        ``default`` (the hard disk), ``pxe``, ``cdrom``, ``bios``. Read anew each call."""
        return (self.directory / "boot").read_text().strip()

    @property
    def resets(self) -> int:
        return int((self.directory / "resets").read_text().strip() or 0)

    def calls(self) -> list[tuple[float, float, str]]:
        """What ipmi_sim asked the chassis script, in the order the calls ended: (start,
        end, args) with epoch seconds and args like ``0x20 set power 1``."""
        path = self.directory / "chassis.log"
        lines = path.read_text().splitlines() if path.exists() else []
        calls = []
        for line in lines:
            start, end, args = line.split(" ", 2)
            calls.append((float(start), float(end), args))
        return calls

    @property
    def chassis_log(self) -> list[str]:
        """What ipmi_sim asked the chassis script, oldest first (``0x20 set power 1``)."""
        return [args for _, _, args in self.calls()]


@pytest.fixture
def ipmi_bmc(tmp_path: Path) -> Iterator[IpmiBmc]:
    bmc = IpmiBmc(tmp_path / "ipmi").start()
    try:
        yield bmc
    finally:
        bmc.stop()
