"""The verified reboot ladder: power actions climbed until one is *seen* to work.

Why verified: a BMC answers 204 to a reset that lands seconds later, or never; an API
answers 202 to a reboot a hung machine ignores. "Asked, then waited a minute" told
Recovery nothing, and a machine that never rebooted went back to AgentStart only to
fail there. So every rung ends only when an observation confirms it, or when
``rung_timeout`` passes, and then the next, harder rung is tried:

1. graceful restart;
2. force restart;
   each verified by the power state leaving On and coming back, or by the SSH
   banner going away (or being away already before the reset: a hung machine) and
   coming back. The banner is looked at *before* the reset too, because a BMC may
   cycle power faster than it is polled (sushy-emulator's fake driver can go Off
   and On again within a millisecond; some real BMCs never report Off during a
   warm reset): a hung machine answering after the reset is evidence enough;
3. power off, verified Off; power on, verified On.

A rung the BMC does not offer (IPMI has no graceful restart; an API reboot has no
power off) is skipped and says so. Each rung's outcome, what was observed and how
long it took, is handed to ``note`` (Recovery puts it in BMDB history at once, so
an operator watching ``shepherd show`` sees the ladder being climbed).

The rung before these (restart only the agent, when SSH still answers) needs the
initializer, so it lives in ``recoverer``. An unreachable BMC or refused credentials
raise (``PowerError``) instead of climbing further: the next rung would hit the same
wall, and the cause must name the BMC, not read "ladder exhausted".
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from shepherd.power import (
    ActionUnsupported,
    BmcAuthFailed,
    PowerAction,
    PowerControl,
    PowerError,
    PowerState,
)


@dataclass(frozen=True)
class LadderSettings:
    """``rung_timeout``: how long one rung may take to be verified (rung 3 has this
    for the Off and again for the On). ``boot_wait``: after a rung verified by power
    alone, how long to wait for SSH to answer again before handing the machine back
    to AgentStart (which would otherwise meet a machine still booting)."""

    rung_timeout: float = 300.0
    boot_wait: float = 300.0
    poll_interval: float = 2.0
    banner_timeout: float = 5.0


@dataclass(frozen=True)
class RungOutcome:
    rung: int
    name: str
    verified: bool
    detail: str
    seconds: float

    def text(self) -> str:
        verdict = "verified" if self.verified else "not verified"
        return f"rung {self.rung} ({self.name}): {verdict} after {self.seconds:.1f}s: {self.detail}"


@dataclass(frozen=True)
class Endpoint:
    """Where the machine's SSH server listens (None: unknown, power is the only witness)."""

    address: str | None
    port: int


Note = Callable[[RungOutcome], None]


def ssh_banner(endpoint: Endpoint, timeout: float) -> bool:
    """True if an SSH server answers with its banner at ``endpoint`` within ``timeout``.

    Nothing is authenticated and no key is exchanged: the banner is the cheapest
    sign of an operating system that booted.
    """
    if endpoint.address is None:
        return False
    try:
        with socket.create_connection((endpoint.address, endpoint.port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            return conn.recv(4).startswith(b"SSH-")
    except OSError:
        return False


class Watch:
    """Polls the machine's power state and SSH banner after an action, until a
    condition holds or the deadline passes. ``clock`` and ``sleep`` are injectable so
    the ladder's timing is testable without waiting minutes."""

    def __init__(self, power: PowerControl, endpoint: Endpoint, settings: LadderSettings,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.power = power
        self.endpoint = endpoint
        self.settings = settings
        self.clock = clock
        self.sleep = sleep
        self.unreadable = 0

    def state(self) -> PowerState:
        """The power state; UNKNOWN when the BMC cannot be read right now (a BMC may
        itself restart during a reset). Refused credentials are not such a moment."""
        if not self.power.reads_state:
            return PowerState.UNKNOWN
        try:
            return self.power.power_state()
        except BmcAuthFailed:
            raise
        except PowerError:
            self.unreadable += 1
            return PowerState.UNKNOWN

    def banner(self) -> bool:
        """Whether the machine's SSH server answers with its banner right now."""
        return ssh_banner(self.endpoint, self.settings.banner_timeout)

    def restarted(self, started: float, banner_before: bool = True) -> tuple[bool, str]:
        """Wait for evidence of a restart: power left On and came back, or the SSH
        banner was away (after the reset, or already before it: ``banner_before``
        False) and came back."""
        power_left = False
        banner_away = not banner_before
        seen: list[str] = []
        while True:
            state = self.state()
            if state is not PowerState.UNKNOWN and (not seen or seen[-1] != state.value):
                seen.append(state.value)
            if state in (PowerState.OFF, PowerState.TRANSITIONING):
                power_left = True
            banner = self.banner()
            banner_away = banner_away or not banner
            elapsed = self.clock() - started
            if power_left and state is PowerState.ON:
                return True, f"power {' -> '.join(seen)}{self._unreadable()}"
            if banner_away and banner:
                went = "went away" if banner_before else "was away before the reset"
                return True, f"SSH banner {went} and came back (power {self._seen(seen)})"
            if elapsed >= self.settings.rung_timeout:
                banner_said = ("SSH banner never came back" if banner_away
                               else "SSH banner never went away")
                return False, f"power {self._seen(seen)}; {banner_said}{self._unreadable()}"
            self.sleep(self.settings.poll_interval)

    def reaches(self, wanted: PowerState, started: float) -> tuple[bool, str]:
        """Wait until the BMC reports ``wanted``."""
        seen: list[str] = []
        while True:
            state = self.state()
            if state is not PowerState.UNKNOWN and (not seen or seen[-1] != state.value):
                seen.append(state.value)
            if state is wanted:
                return True, f"power {' -> '.join(seen)}"
            if self.clock() - started >= self.settings.rung_timeout:
                return False, f"power {self._seen(seen)}, never {wanted.value}{self._unreadable()}"
            self.sleep(self.settings.poll_interval)

    def banner_back(self) -> bool:
        """Wait up to ``boot_wait`` for the SSH banner."""
        started = self.clock()
        while not self.banner():
            if self.clock() - started >= self.settings.boot_wait:
                return False
            self.sleep(self.settings.poll_interval)
        return True

    @staticmethod
    def _seen(seen: list[str]) -> str:
        return " -> ".join(seen) if seen else "unread"

    def _unreadable(self) -> str:
        return f" ({self.unreadable} reads of the BMC failed)" if self.unreadable else ""


#: (rung, name, action) of the restarts; rung 3 is ``_off_then_on``.
RESTARTS = ((1, "graceful restart", PowerAction.GRACEFUL_RESTART),
            (2, "force restart", PowerAction.FORCE_RESTART))


def climb(power: PowerControl, watch: Watch, note: Note) -> RungOutcome | None:
    """Climb rungs 1-3 until one is verified; return it, or None when all failed.

    Raises ``PowerError`` when the BMC cannot be reached or refuses us.
    """
    for rung, name, action in RESTARTS:
        outcome = _restart(power, watch, rung, name, action)
        note(outcome)
        if outcome.verified:
            return outcome
    outcome = _off_then_on(power, watch)
    note(outcome)
    return outcome if outcome.verified else None


def cold_boot(power: PowerControl, watch: Watch) -> RungOutcome:
    """Power off and on (rung 3), each observed: what makes firmware read a new boot
    device. Where the BMC cannot power off or read its state, a force restart (rung 2)."""
    if power.reads_state and all(power.supports(action) for action in OFF_THEN_ON):
        return _off_then_on(power, watch)
    return _restart(power, watch, 2, "force restart", PowerAction.FORCE_RESTART)


def _skipped(rung: int, name: str, power: PowerControl, why: str = "") -> RungOutcome:
    return RungOutcome(rung, name, False, f"not offered by {power.description}{why}", 0.0)


def _restart(power: PowerControl, watch: Watch, rung: int, name: str,
             action: PowerAction) -> RungOutcome:
    if not power.supports(action):
        return _skipped(rung, name, power)
    banner_before = watch.banner()
    started = watch.clock()
    try:
        power.act(action)
    except ActionUnsupported as error:
        return _skipped(rung, name, power, f" ({error})")
    verified, detail = watch.restarted(started, banner_before)
    return RungOutcome(rung, name, verified, detail, watch.clock() - started)


OFF_THEN_ON = (PowerAction.POWER_OFF, PowerAction.POWER_ON)


def _off_then_on(power: PowerControl, watch: Watch) -> RungOutcome:
    rung, name = 3, "power off, then on"
    if not (power.reads_state and all(power.supports(action) for action in OFF_THEN_ON)):
        return _skipped(rung, name, power)
    started = watch.clock()
    try:
        power.act(PowerAction.POWER_OFF)
        off, off_detail = watch.reaches(PowerState.OFF, started)
        if not off:
            return RungOutcome(rung, name, False, off_detail, watch.clock() - started)
        on_started = watch.clock()
        power.act(PowerAction.POWER_ON)
        on, on_detail = watch.reaches(PowerState.ON, on_started)
    except ActionUnsupported as error:
        return _skipped(rung, name, power, f" ({error})")
    detail = f"off: {off_detail}; on: {on_detail}"
    return RungOutcome(rung, name, on, detail, watch.clock() - started)
