"""``shepherd inventory check --probe``: ask every BMC for its power state and the
system it manages, and every SSH endpoint for its host key, in parallel, each bounded
in time. Where the machine's own DMI identity is known (``known``: from the BMDB, for
machines already taken over), the BMC's system is compared with it
(``shepherd.power.identity``): a swapped pair of inventory lines shows here, before
any reset goes through the wrong BMC.

Nothing is changed and nothing logs in: the BMC is only read (one power-state
request), and the SSH probe stops after the key exchange, so it needs no key of
ours and leaves no login in the machine's logs. The BMC read does not take the
fleet-wide BMC lock (that needs the BMDB, which a check of a file does not): one
read among the workers' calls is what a BMC's web page does too.

Why daemon threads and an overall deadline rather than a thread pool: each probe
has its own timeouts, but a library that ignores one must not keep the command
(or the interpreter's exit, which joins pool threads) waiting.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from shepherd.bmc import BmcSpec
from shepherd.inventory.file import ssh_endpoint
from shepherd.inventory.host_keys import HostKey, ProbeError, fetch_host_key, parse_host_key
from shepherd.power import PowerError, SystemIdentity, connect
from shepherd.power.identity import Verdict, compare
from shepherd.providers.base import ProviderMachine

#: Probes run at once, at most (each is mostly waiting on the network).
PARALLEL = 32


@dataclass(frozen=True)
class BmcProbe:
    """What the BMC said: its power state, or why it said nothing."""

    description: str
    power: str | None = None
    error: str | None = None
    #: The system the BMC says it manages (None: not read, the probe failed).
    system: SystemIdentity | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class SshProbe:
    """The host key the SSH endpoint showed, and how it compares with the pin."""

    endpoint: str
    fingerprint: str | None = None
    key_type: str | None = None
    #: The pin's fingerprint; None when the inventory pins no key.
    pinned: str | None = None
    #: True/False against the pin; None when there is no pin or no key was read.
    matches: bool | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.matches is not False


@dataclass(frozen=True)
class MachineProbe:
    machine_id: str
    ssh: SshProbe
    #: None: the machine has no BMC in the inventory.
    bmc: BmcProbe | None
    #: The BMC's system against the machine's DMI: "match", "mismatch" or "unknown"
    #: (``identity.Verdict``), with why; None when not compared (no BMC read, or the
    #: machine's DMI not known).
    identity: str | None = None
    identity_reason: str | None = None

    @property
    def ok(self) -> bool:
        return (self.ssh.ok and (self.bmc is None or self.bmc.ok)
                and self.identity != Verdict.MISMATCH)


def probe_machines(machines: Sequence[ProviderMachine], *, timeout: float = 10.0,
                   parallel: int = PARALLEL,
                   known: Mapping[str, SystemIdentity] | None = None) -> list[MachineProbe]:
    """One ``MachineProbe`` per machine, in the same order; ``known``: the machines' own
    DMI identities by inventory id, where known, to compare the BMCs' with.

    Each network step is bounded by ``timeout`` (an SSH probe has three: connect,
    banner, key exchange; a Redfish one up to a few requests); ``parallel`` probes
    run at once, and whatever is still running after four steps' worth per wave is
    reported as unanswered."""
    jobs: list[Callable[[], object]] = []
    for machine in machines:
        jobs.append(functools.partial(probe_ssh, machine, timeout=timeout))
        if machine.bmc is not None:
            jobs.append(functools.partial(probe_bmc, machine.bmc, timeout=timeout))
    waves = -(-len(jobs) // max(1, parallel))
    results = _run(jobs, parallel=parallel, deadline=waves * 4 * timeout + 5)
    found: list[MachineProbe] = []
    position = 0
    for machine in machines:
        ssh = results[position]
        position += 1
        if not isinstance(ssh, SshProbe):
            ssh = SshProbe(ssh_endpoint(machine), error=_no_result(ssh))
        bmc: BmcProbe | None = None
        if machine.bmc is not None:
            result = results[position]
            position += 1
            bmc = result if isinstance(result, BmcProbe) else BmcProbe(
                machine.bmc.description, error=_scrubbed(_no_result(result), machine.bmc))
        found.append(_compared(MachineProbe(machine.provider_id, ssh, bmc),
                               (known or {}).get(machine.provider_id)))
    return found


def _compared(probe: MachineProbe, machine: SystemIdentity | None) -> MachineProbe:
    if machine is None or probe.bmc is None or probe.bmc.system is None:
        return probe
    checked = compare(probe.bmc.system, machine)
    return dataclasses.replace(probe, identity=checked.verdict.value,
                               identity_reason=checked.reason)


def _no_result(result: object) -> str:
    if isinstance(result, Exception):
        return f"probe failed: {type(result).__name__}: {result}"
    return "no answer before the probes' deadline"


def probe_ssh(machine: ProviderMachine, *, timeout: float) -> SshProbe:
    """The endpoint's host key (of the pin's type, when pinned) against the pin."""
    endpoint = ssh_endpoint(machine)
    pin = parse_host_key(machine.host_key) if machine.host_key else None
    pinned = pin.fingerprint if pin else None
    try:
        key = fetch_host_key(str(machine.address), machine.ssh_port, timeout=timeout,
                             key_type=pin.key_type if pin else None)
    except ProbeError as error:
        return SshProbe(endpoint, pinned=pinned, error=str(error))
    return SshProbe(endpoint, fingerprint=key.fingerprint, key_type=key.key_type,
                    pinned=pinned, matches=_matches(key, pin))


def probe_bmc(spec: BmcSpec, *, timeout: float) -> BmcProbe:
    """The power state and the system's identity, each asked once (a probe reports, it
    does not insist)."""
    try:
        control = connect(spec, timeout=timeout, attempts=1)
        power = control.power_state()
        system = control.identity()
    except PowerError as error:
        text = str(error)
        if spec.description not in text:
            text = f"{spec.description}: {text}"
        return BmcProbe(spec.description, error=_scrubbed(text, spec))
    except Exception as error:  # a driver's bug is one probe's failure
        return BmcProbe(spec.description, error=_scrubbed(
            f"{spec.description}: {type(error).__name__}: {error}", spec))
    return BmcProbe(spec.description, power=str(power), system=system)


def _matches(key: HostKey, pin: HostKey | None) -> bool | None:
    return None if pin is None else key.blob == pin.blob


def _scrubbed(text: str, spec: BmcSpec) -> str:
    """``text`` with the BMC's password masked, should a library have echoed it.

    The drivers never put it in a message; this is the second lock on that door,
    for errors no one here wrote."""
    try:
        password = spec.read_password()
    except PowerError:
        return text
    return text.replace(password, "***") if len(password) >= 3 else text


def _run(jobs: Sequence[Callable[[], object]], *, parallel: int,
         deadline: float) -> list[object]:
    """Run ``jobs`` on at most ``parallel`` daemon threads; a job not done by the
    deadline leaves ``None`` in its place."""
    results: list[object] = [None] * len(jobs)
    pending: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(jobs)):
        pending.put(index)
    done = threading.Semaphore(0)

    def work() -> None:
        while True:
            try:
                index = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = jobs[index]()
            except Exception as error:  # reported as that probe's failure
                results[index] = error
            done.release()

    for number in range(min(parallel, len(jobs))):
        threading.Thread(target=work, daemon=True, name=f"inventory-probe-{number}").start()
    end = time.monotonic() + deadline
    for _ in jobs:
        if not done.acquire(timeout=max(0.0, end - time.monotonic())):
            break
    return list(results)
