"""Installation: a machine taken from its current system to the image wanted for it,
booted from its disk with an identity Shepherd chose, and its agent heartbeating there.

Its steps, each in the machine's history (``shepherd show``, the machine page) and the
current one in ``os_wanted.step`` (``bmdb.advance_installation``):

0. **rescue** (only when needed): no agent heartbeats, or the one that does runs from
   the disk to be written (its installation marker says so, or it refuses the request
   as "own_system"): the rescue system is booted by network or virtual media and taken
   over with the inventory's pin (``booting``).
1. **writing** (``Dispatched``): the wanted image, looked up in the catalog
   (``shepherd.images``), becomes a request under the machine's next generation, with a
   fetch token for an image Shepherd serves and, for a machine Shepherd can boot, the
   identity to write (host name, authorized key, the host key's public half, the
   marker). Every heartbeat answer carries it to the agent, signed. The agent streams
   the image, reads the disk back, then writes the identity into the installed root
   filesystem and reads that back (``shepherd.agent.installer``, ``.identity``).
2. **Verified** once the agent reports "ok" and the report holds up here too: the
   digest written and the digest read back both equal the catalog's, and the byte
   count its size. The request then leaves the answers (its token dies): the agent
   that answers next is the installed system's, and must never get it.
3. **boot_device**, **rebooting**, **taking_over**, **first_heartbeat**: the host key's
   public half becomes the machine's pin, then the machine is booted from its disk
   and taken over (``booting``); the first heartbeat must carry this generation's
   marker. Only then is the wish settled **installed**. A machine without a BMC
   settles **written** after step 2: nothing can boot it.

Anything else is Failed, with the step's cause and a backoff; the
``quarantine_after``-th failure in a row quarantines the machine (``bmdb.holds``).

Rules, in one place:

* The work (``ShepherdOSInstall``, in the agent's exclusion group) is held from the
  claim to the outcome, so no AgentStart, Recovery or power command runs meanwhile;
  the request is settled (it leaves the answers, its token dies) in the transaction
  before the work is released, whatever the outcome.
* Silence is judged by the BMDB's clock against the last progress (or the dispatch):
  ``stall_timeout`` without a word fails the installation as "the agent went
  silent", and ``deadline`` bounds it as a whole, so a dead agent never holds a
  machine for ever.
* An operator's ``shepherd install --cancel`` settles what was wanted; the workflow
  sees it at its next look and cancels (no backoff), and the agent, whose answers no
  longer carry the request, stops writing.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import bmdb
from shepherd.agent.protocol import IMAGES_PATH
from shepherd.answer_key import AnswerKey
from shepherd.images import Catalog, CatalogError, Image, UnknownImage
from shepherd.inventory.host_keys import key_line_fingerprint
from shepherd.power import BootDevice, PowerControl
from shepherd.providers import ssh_keys
from shepherd.providers.base import Provider, ProviderError, ProviderMachine
from shepherd.workflows.booting import BootSettings, Target, boot_into
from shepherd.workflows.common import (
    NOT_OURS,
    PERMANENT_BACKOFF,
    WorkflowFailure,
    WorkflowResult,
    fail,
)
from shepherd.workflows.initializer import HostKeyPin
from shepherd.workflows.recoverer import current_machine

log = logging.getLogger(__name__)
UNDEFINED = "; the disk's contents are now undefined"
#: What a failure's cause starts with, as a bounded label (metrics): the agent's cause
#: kinds (``shepherd.agent.installer``) and this workflow's own.
CAUSE_KINDS = frozenset({
    "no_disk", "ambiguous_disk", "not_a_disk", "mounted", "swap", "own_system", "too_small",
    "bad_request", "fetch", "stall", "short_stream", "digest", "decompress", "write",
    "read_back", "deadline", "canceled", "refused", "agent_silent"})


def cause_kind(cause: str | None) -> str:
    """The kind a failure's cause names first (``digest: ...``), else "other"."""
    head = (cause or "").split(":", 1)[0].strip().replace(" ", "_")
    return head if head in CAUSE_KINDS else "other"


@dataclass(frozen=True)
class InstallationSettings:
    callback_url: str
    image_dir: Path
    #: Seconds between looks at the BMDB while the agent works (each a read, no commit).
    poll_interval: float = 0.25
    #: Seconds without progress (or, before the first, since the dispatch) after which
    #: the agent counts as gone.
    stall_timeout: float = 300.0
    #: Seconds an installation may take up to its verified write (a rescue boot included);
    #: the boot of the installed system has its own steps' deadlines (``booting``).
    deadline: float = 1800.0
    #: What the agent is told: how often to resume a broken fetch, and how long a fetch
    #: may go without a byte before it is resumed.
    fetch_retries: int = 5
    fetch_stall: float = 30.0
    #: How machines are booted into the rescue and the installed system (None: the
    #: installation ends once the image is written and verified).
    boot: BootSettings | None = None
    #: Installations failed in a row before the machine is quarantined.
    quarantine_after: int = 3


class Withdrawn(Exception):
    """An operator withdrew the installation while it was in flight."""


#: The machine's power control, or None when nothing can set its boot device.
PowerFor = Callable[[ProviderMachine], PowerControl | None]
QUARANTINE_ACTOR = "shepherd installation"


def install(work: bmdb.Work, settings: InstallationSettings, provider: Provider | None = None,
            power_for: PowerFor | None = None) -> WorkflowResult:
    """Carry the machine's wanted installation to its outcome (the module's steps). With
    no ``provider``/``power_for`` (or a machine without a BMC), it ends once the image is
    written and verified: the wish settles as "written", since nothing can boot it."""
    run = Run(work, settings, provider, power_for)
    try:
        outcome = run.carry_out()
    except NOT_OURS:
        raise
    except Withdrawn as withdrawn:
        work.cancel(str(withdrawn), then=settler(work, run.generation))
        return WorkflowResult(work.machine_id, work.process.value, "canceled", str(withdrawn))
    except WorkflowFailure as failure:
        return fail(work, failure.cause, failure.backoff,
                    then=failed(work, run.generation, settings.quarantine_after))
    except ProviderError as error:  # listing the machine, before anything was done
        return fail(work, f"provider: {type(error).__name__}: {error}",
                    then=settler(work, run.generation))
    except Exception as error:  # a bug must not leave the machine held
        log.exception("installation on %s", work.machine_id)
        return fail(work, f"unexpected {type(error).__name__}: {error}",
                    then=failed(work, run.generation, settings.quarantine_after))
    generation, target = run.generation, run.target
    assert generation is not None and target is not None
    work.finish(lambda tx: bmdb.settle_installation(tx, work.machine_id, generation,
                                                    outcome, target))
    return WorkflowResult(work.machine_id, work.process.value, "finished")


class Run:
    """One installation's state while it runs: the generation in flight and the
    machine as its provider lists it (with its power control, when it can be booted)."""

    def __init__(self, work: bmdb.Work, settings: InstallationSettings,
                 provider: Provider | None, power_for: PowerFor | None) -> None:
        self.work, self.settings = work, settings
        self.provider, self.power_for = provider, power_for
        #: The deadline (``settings.deadline``) bounds all up to the verified write,
        #: a rescue boot included; the installed system's boot has its steps' own.
        self.started = time.monotonic()
        self.generation: int | None = None
        self.target: tuple[str, str] | None = None
        self.machine: ProviderMachine | None = None
        self.power: PowerControl | None = None

    def carry_out(self) -> Literal["installed", "written"]:
        image, wanted = prepare(self.work, self.settings)
        self.target = (image.name, wanted.disk)
        boot = self.bootable()
        if boot is not None and not self.agent_can_write(wanted.disk):
            self.boot_rescue(boot)
        result = self.write(image, wanted.disk, boot)
        if boot is not None and result.get("cause_kind") == "own_system":
            log.info("%s: the disk holds the running system; booting the rescue system",
                     self.work.machine_id)
            self.close_request()
            self.boot_rescue(boot)
            result = self.write(image, wanted.disk, boot)
        self.work.note(bmdb.Event.VERIFIED, verify(result, image))
        if boot is None:
            return "written"
        self.close_request()
        self.boot_installed(boot, image, wanted.disk)
        return "installed"

    def bootable(self) -> BootSettings | None:
        """The boot settings when this machine can be booted (a power control that sets
        boot devices, the provider's view of it), else None."""
        boot = self.settings.boot
        if boot is None or self.provider is None or self.power_for is None:
            return None
        self.machine = current_machine(self.work, self.provider, PERMANENT_BACKOFF)
        self.power = self.power_for(self.machine)
        return boot if self.power is not None and self.machine.bmc is not None else None

    def agent_can_write(self, disk: str) -> bool:
        """Whether an agent heartbeats, from a system that does not live on ``disk``: not
        one an installation of ours wrote there (its marker says so). Another system on
        that disk is refused by the agent itself ("own_system"), and then the rescue
        system is booted all the same (``carry_out``)."""
        limit = self.work.session.db.thresholds.heartbeat

        def read(tx: bmdb.Tx) -> bool:
            heard = bmdb.machine_tag(tx, "AgentHeartbeat", self.work.machine_id)
            if not heard or (tx.now - heard["last_heartbeat_at"]).total_seconds() > limit:
                return False
            report = bmdb.machine_tag(tx, "HardwareReport", self.work.machine_id) or {}
            running = (report.get("report") or {}).get("installation")
            return not (isinstance(running, dict) and running.get("disk") == disk
                        and running.get("machine_id") == str(self.work.machine_id))

        return bool(self.work.session.db.read(read))

    def write(self, image: Image, disk: str, boot: BootSettings | None) -> dict[str, Any]:
        waited = time.monotonic() - self.started
        if waited > self.settings.deadline:
            raise WorkflowFailure(f"deadline: {waited:.0f} s went by before the image could "
                                  f"be sent (limit {self.settings.deadline:g} s); nothing "
                                  "was written")
        self.generation = dispatch(self.work, image, disk, self.settings, self.identity(boot))
        return watch(self.work, self.generation, self.settings, self.started)

    def identity(self, boot: BootSettings | None) -> Identity | None:
        if boot is None or self.machine is None:
            return None
        public = ssh_keys.public_key_openssh(
            ssh_keys.load_or_create(boot.takeover.ssh_key_path))
        return Identity(hostname_of(self.machine.provider_id), (public,))

    def close_request(self) -> None:
        generation = self.generation
        assert generation is not None
        self.work.session.transact(lambda tx: bmdb.close_installation_request(
            tx, self.work.machine_id, generation))

    def step(self, name: str) -> None:
        """A step of the installed system's boot, under the generation that wrote it."""
        self.record_step(name, f"generation {self.generation}: {name}")

    def rescue_step(self, name: str) -> None:
        """A step of the rescue boot: recorded as "rescue", the boot's own step in
        history (it may come before any generation was dispatched)."""
        self.record_step("rescue", f"rescue: {name}")

    def record_step(self, step: str, said: str) -> None:
        def body(tx: bmdb.Tx) -> None:
            wanted = bmdb.installation_of(tx, self.work.machine_id).wanted
            assert wanted is not None
            bmdb.advance_installation(tx, self.work.machine_id, wanted.generation, step)

        self.work.session.transact(body)
        self.work.note(bmdb.Event.STEP, said)

    def boot_rescue(self, boot: BootSettings) -> None:
        """Boot the rescue system and take it over (its pin is the inventory's)."""
        machine, power = self.machine, self.power
        assert machine is not None and power is not None
        if not machine.host_key:
            raise WorkflowFailure("rescue: the inventory pins no host key (host_key) for "
                                  "the system the machine boots by network; Shepherd takes "
                                  "over no system it cannot authenticate")
        rescue = HostKeyPin(machine.host_key, "rescue system (the inventory's pin)")
        target = Target("the rescue system", boot.rescue_device, False, rescue)
        boot_into(self.work, machine, power, target, boot, self.rescue_step)

    def boot_installed(self, boot: BootSettings, image: Image, disk: str) -> None:
        """Pin the installed system's key, then boot its disk and take it over."""
        machine, power, generation = self.machine, self.power, self.generation
        assert machine is not None and power is not None and generation is not None
        chosen = self.work.session.transact(lambda tx: pin_chosen_key(
            tx, self.work.machine_id, generation))
        rescue = (HostKeyPin(machine.host_key, "rescue system (the inventory's pin)")
                  if machine.host_key else None)
        target = Target(f"the installed system (generation {generation})", BootDevice.DISK,
                        True, HostKeyPin(chosen, f"chosen by installation generation "
                                                 f"{generation}"), rescue,
                        marker=marker(self.work.machine_id, generation, image, disk))
        boot_into(self.work, machine, power, target, boot, self.step)


def pin_chosen_key(tx: bmdb.Tx, machine_id: uuid.UUID, generation: int) -> str:
    """Pin the host key installation ``generation`` chose (``AnswerKey.host_key``)."""
    public = AnswerKey.from_tx(tx).host_key(str(machine_id), generation).public
    bmdb.pin_installed_host_key(tx, machine_id, public, key_line_fingerprint(public),
                                generation)
    return public


def marker(machine_id: uuid.UUID, generation: int, image: Image, disk: str) -> dict[str, Any]:
    """What the installed system's ``/etc/shepherd/installation.json`` says: which
    installation wrote it (its agent reports it in every first heartbeat)."""
    return {"machine_id": str(machine_id), "generation": generation, "image": image.name,
            "sha256": image.sha256, "disk": disk}


def hostname_of(provider_id: str) -> str:
    """The inventory's id as a host name: letters, digits and hyphens, at most 63."""
    name = re.sub(r"[^A-Za-z0-9-]+", "-", provider_id).strip("-")[:63].strip("-")
    return name or "shepherd-machine"


def failed(work: bmdb.Work, generation: int | None, limit: int
           ) -> Callable[[bmdb.Tx], None]:
    """A failure's extra changes: the request leaves the answers and the step is cleared
    (``settler``); the ``limit``-th failure in a row quarantines the machine."""
    settle = settler(work, generation)

    def body(tx: bmdb.Tx) -> None:
        settle(tx)
        if bmdb.quarantine_if_due(tx, work.machine_id, limit, QUARANTINE_ACTOR,
                                  bmdb.INSTALLATIONS_FAILED):
            log.error("QUARANTINED %s: %d installations failed in a row", work.machine_id,
                      limit)

    return body


def prepare(work: bmdb.Work, settings: InstallationSettings) -> tuple[Image, bmdb.Wanted]:
    """The catalog's image for what is wanted, and the wish."""
    state = work.session.transact(lambda tx: bmdb.installation_of(tx, work.machine_id))
    wanted = state.wanted
    if wanted is None or not wanted.pending:
        raise Withdrawn("nothing to install: no pending installation is wanted")
    try:
        image = Catalog.load(settings.image_dir).get(wanted.image)
    except (CatalogError, UnknownImage) as error:
        raise WorkflowFailure(f"refused: {error}; nothing was written") from None
    return image, wanted


class Identity(NamedTuple):
    """What the agent writes into the installed system besides its host key."""

    hostname: str
    authorized_keys: tuple[str, ...]


def request_for(machine_id: uuid.UUID, image: Image, disk: str,
                settings: InstallationSettings) -> dict[str, Any]:
    """The request as the agent reads it (``shepherd.agent.installer``)."""
    served = image.served
    url = (settings.callback_url.rstrip("/") + IMAGES_PATH + image.name) if served else image.url
    return {
        "kind": "image",
        # ``served``: the server adds the fetch token to its answers (never stored), so
        # a URL elsewhere never sees a token of ours.
        "image": {"name": image.name, "url": url, "sha256": image.sha256, "size": image.size,
                  "format": image.format, "served": served},
        "disk": disk,
        "machine_id": str(machine_id),
        "limits": {"retries": settings.fetch_retries, "stall_seconds": settings.fetch_stall,
                   "deadline_seconds": settings.deadline},
    }


def with_identity(request: dict[str, Any], identity: Identity, image: Image, generation: int,
                  answer_key: AnswerKey) -> dict[str, Any]:
    """``request`` asking the agent to write the installed system's identity too: the host
    key's public half only (the server adds the private half to its answers, see
    ``shepherd.server.heartbeat.with_secrets``), so nothing secret is ever stored."""
    machine_id = uuid.UUID(request["machine_id"])
    public = answer_key.host_key(str(machine_id), generation).public
    return {**request, "identity": {
        "hostname": identity.hostname, "authorized_keys": list(identity.authorized_keys),
        "host_key": {"public": public},
        "marker": marker(machine_id, generation, image, request["disk"])}}


def dispatch(work: bmdb.Work, image: Image, disk: str, settings: InstallationSettings,
             identity: Identity | None = None) -> int:
    """The request in flight under the machine's next generation (``bmdb.dispatch``)."""
    request = request_for(work.machine_id, image, disk, settings)

    def body(tx: bmdb.Tx) -> int:
        # The claim excludes every other dispatch for this machine, so the next generation
        # is this one's: the identity it names is checked against the dispatched number.
        wanted = bmdb.installation_of(tx, work.machine_id).wanted
        assert wanted is not None
        asked = request if identity is None else with_identity(
            request, identity, image, wanted.generation + 1, AnswerKey.from_tx(tx))
        generation = bmdb.dispatch_installation(tx, work.machine_id, asked)
        if generation != wanted.generation + 1:
            raise RuntimeError(f"generation {generation} dispatched where "
                               f"{wanted.generation + 1} was expected")
        bmdb.record_history(tx, work.machine_id, work.process.value, bmdb.Event.DISPATCHED,
                            f"generation {generation}: image {image.name} "
                            f"({image.size} bytes, sha256 {image.sha256[:16]}…) to disk "
                            f"{disk}" + (f", as host {identity.hostname} with a host key "
                                         "of Shepherd's" if identity else ""),
                            work_id=work.id)
        return generation

    return int(work.session.transact(body))


def watch(work: bmdb.Work, generation: int, settings: InstallationSettings,
          started: float | None = None) -> dict[str, Any]:
    """The agent's result for ``generation``, once it has reported; ``deadline`` counts
    from ``started`` (``time.monotonic``; the claim's, when a rescue boot came first)."""
    started = time.monotonic() if started is None else started
    while True:
        work.ensure_held()
        # A read outside the session: it writes nothing, so polling often costs no commit.
        state, now = work.session.db.read(
            lambda tx: (bmdb.installation_of(tx, work.machine_id), tx.now))
        if state.wanted is None or state.wanted.outcome == "canceled":
            raise Withdrawn("canceled: an operator withdrew the installation")
        if state.in_flight is not None and state.in_flight.target != state.wanted.target:
            raise Withdrawn(f"canceled: superseded by a new wish (image {state.wanted.image} "
                            f"on disk {state.wanted.disk}), dispatched next")
        if state.in_flight is None or state.in_flight.generation != generation:
            raise WorkflowFailure(f"generation {generation} is no longer in flight")
        if state.result is not None:
            return state.result
        check_alive(state.in_flight, now, settings)
        if time.monotonic() - started > settings.deadline:
            raise WorkflowFailure(f"deadline: not done within {settings.deadline:g} s "
                                  f"({describe(state.in_flight.progress)})" + UNDEFINED)
        time.sleep(settings.poll_interval)


def check_alive(flight: bmdb.InFlight, now: Any, settings: InstallationSettings) -> None:
    last = flight.progress_at or flight.dispatched_at
    if last is None:
        return
    silent = (now - last).total_seconds()
    if silent > settings.stall_timeout:
        said = describe(flight.progress) if flight.progress else "it never started"
        # The agent may have begun writing before a heartbeat could say so.
        raise WorkflowFailure(f"agent_silent: no progress for {silent:.0f} s ({said})"
                              + UNDEFINED)


def describe(progress: dict[str, Any] | None) -> str:
    """The last progress, as a cause quotes it: "writing 512 of 1024 MiB"."""
    if not progress:
        return "no progress reported"
    done, total = progress.get("bytes_done"), progress.get("bytes_total")
    if isinstance(done, int) and isinstance(total, int) and total:
        return f"last: {progress.get('phase', '?')} {done >> 20} of {total >> 20} MiB"
    return f"last: {progress.get('phase', '?')}"


def verify(result: dict[str, Any], image: Image) -> str:
    """The history line of a good installation; ``WorkflowFailure`` with the agent's cause
    for any other, or for an "ok" whose figures do not hold up against the catalog."""
    status = result.get("status")
    if status != "ok":
        cause = str(result.get("cause") or f"the agent reported {status!r} without a cause")
        raise WorkflowFailure(f"{result.get('cause_kind') or status}: {cause}")
    written, read_back = result.get("written_sha256"), result.get("read_back_sha256")
    if written != image.sha256 or read_back != image.sha256 or result.get("bytes") != image.size:
        raise WorkflowFailure(
            f"read_back: the agent said ok, but wrote sha256 {written}, read back "
            f"{read_back} and {result.get('bytes')} bytes, where the catalog says "
            f"{image.sha256} and {image.size} bytes" + UNDEFINED)
    durations = result.get("durations") or {}
    seconds = sum(value for value in durations.values() if isinstance(value, (int, float)))
    rate = image.size / seconds / 1e6 if seconds else 0.0
    return (f"wrote {image.size} bytes of {image.name} to {result.get('disk')} and read "
            f"them back: sha256 {image.sha256} both ways, in {seconds:.1f} s "
            f"({rate:.0f} MB/s verified)")


def settler(work: bmdb.Work, generation: int | None) -> Callable[[bmdb.Tx], None]:
    """The ending transaction's extra change (a failure's or a cancel's), in the
    transaction that releases the work: the request leaves the answers, and no step is
    left set (a rescue boot may have set one before any dispatch)."""
    def settle(tx: bmdb.Tx) -> None:
        if generation is None:
            bmdb.end_installation_steps(tx, work.machine_id)
        else:
            bmdb.settle_installation(tx, work.machine_id, generation, None)

    return settle
