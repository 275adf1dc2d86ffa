"""AgentStart: SSH into a Provided machine, upload and start the agent, record its key.

Every takeover (here and in Recovery's rung 0) gives the agent a nonce of its own
and the servers' answer key, and must get back a fresh key with a proof of it
(``shepherd.agent.protocol``): AgentStarted records the key with the nonce, which
is what makes everything signed for an earlier takeover worthless
(``bmdb.lock_agent_credentials``).

Plain Python, no Celery: a task adopts or claims the work and calls ``initialize``.
The one rule every path keeps: the work is finished or failed before returning, so a
machine is never left held by a live session. Only ``WorkGone`` / ``SessionExpired``
(the claim is no longer ours, nothing to release) and ``CommitOutcomeUnknown``
(the sweep settles it) propagate.
"""

from __future__ import annotations

import logging
import posixpath
import shlex
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import bmdb
from shepherd.agent import BUNDLE_NAME, agent_bundle
from shepherd.agent.protocol import (
    ProtocolError,
    TakeoverInit,
    new_nonce,
    parse_takeover_response,
)
from shepherd.answer_key import AnswerKey
from shepherd.inventory.host_keys import key_line_fingerprint
from shepherd.providers.base import (
    NotFound,
    Provider,
    ProviderMachine,
)
from shepherd.remote import HostKeyMismatch, Remote, RemoteError, UploadRefused
from shepherd.workflows.common import (
    PERMANENT_BACKOFF,
    WorkflowFailure,
    WorkflowResult,
    provider_id_from,
    run_work,
)

log = logging.getLogger(__name__)

#: Where the agent goes when the login's home directory refuses it (read-only, say).
#: /run is a root-only tmpfs on every current Linux: nobody else can have prepared a
#: directory there for us to write into, as they could in /tmp.
FALLBACK_DIRECTORY = "/run/shepherd-agent"


@dataclass(frozen=True)
class InitializerSettings:
    """How to reach machines and what to tell their agents.

    ``agent_target`` is relative on purpose: it lands in the login's home directory
    (the sandbox on simulated devices), else in ``FALLBACK_DIRECTORY``, and is run as
    ``/bin/sh ./<target>`` (``agent_command``). ``agent_args`` are appended (e.g. a short
    ``--interval`` for tests and the demo, which wins over ``heartbeat_interval``).
    ``heartbeat_interval`` is what the TakeoverInit tells the agent (the setting
    ``agent_heartbeat_interval``: a tenth of the heartbeat timeout by default).
    """

    ssh_key_path: Path
    callback_url: str
    ca_certificate: str | None = None
    connect_timeout: float = 10.0
    exec_timeout: float = 60.0
    ssh_user: str = "root"
    #: Not "shepherd-agent": on simulated devices that is the agent's default state
    #: directory ($SHEPHERD_SIM_SANDBOX/shepherd-agent), and the two would collide.
    agent_target: str = BUNDLE_NAME
    agent_args: tuple[str, ...] = ()
    heartbeat_interval: float = 60.0
    permanent_backoff: bmdb.Backoff = PERMANENT_BACKOFF


def initialize(work: bmdb.Work, provider: Provider, settings: InitializerSettings,
               known: Known | None = None) -> WorkflowResult:
    """Start the agent on ``work``'s machine; finish with AgentStarted or fail with a cause.

    ``known``: what ``read_known_in`` read in the transaction that adopted the claim
    (``machine_work``); without it, it is read here."""

    def body() -> Callable[[bmdb.Tx], None]:
        nonlocal known
        known = known or read_known(work)
        # Its transaction has committed: the answer key it holds is the fleet's.
        _remember_answer_key(work.session.db, known.answer_key)
        machine = reachable_machine(work, provider, settings.permanent_backoff,
                                    known.view.provided)
        pin = pin_for(machine, known.view.host_key)
        work.ensure_held()
        try:
            taken = take_over(machine, work.machine_id, settings, pin,
                              answer_key=known.answer_key, current_key=known.view.agent_key)
        except WorkflowFailure as failure:
            raise hold_on_mismatch(failure, failure.__cause__, work) from failure

        def record(tx: bmdb.Tx) -> None:
            record_agent(tx, work.machine_id, taken)
            if pin is None:
                bmdb.pin_host_key(tx, work.machine_id, taken.host_key,
                                   key_line_fingerprint(taken.host_key))

        return record

    return run_work(work, body)


def hold_on_mismatch(failure: WorkflowFailure, cause: BaseException | None,
                     work: bmdb.Work) -> WorkflowFailure:
    """``failure`` itself, or, when its ``cause`` is a host-key mismatch, the same failure
    that also holds the machine (``bmdb.HOST_KEY_HOLD``) with the key it met.

    Why hold: the machine answers SSH, so it runs, and no retry or reset changes the
    key it presents (a reinstall behind Shepherd's back, or another machine at this
    address). Only an operator can say which: ``shepherd host-key accept`` pins exactly
    the key kept here (never one seen later) and lets the machine go, in one step.
    """
    if not isinstance(cause, HostKeyMismatch):
        return failure
    seen, expected = key_line_fingerprint(cause.seen), key_line_fingerprint(cause.expected)
    reason = (f"SSH presented host key {seen}, not the pinned {expected}: reinstalled, or "
              "another machine at this address?")

    def hold(tx: bmdb.Tx) -> None:
        if failure.then is not None:
            failure.then(tx)
        bmdb.put_hold(tx, work.machine_id, bmdb.HOST_KEY_HOLD, reason, work.process.value,
                      host_key=cause.seen)

    return WorkflowFailure(f"{failure.cause}; held until an operator accepts the key or "
                           "fixes the pin", failure.backoff, then=hold)


@dataclass(frozen=True)
class HostKeyPin:
    """The host key a machine must present, and where the pin comes from (for causes)."""

    key: str
    source: str


def host_key_pin(work: bmdb.Work, machine: ProviderMachine) -> HostKeyPin | None:
    """The pin a takeover of ``machine`` must see (``pin_for``), read now."""
    recorded = work.session.transact(
        lambda tx: bmdb.recorded_host_key(tx, work.machine_id))
    return pin_for(machine, recorded)


def pin_for(machine: ProviderMachine, recorded: bmdb.RecordedPin | None
            ) -> HostKeyPin | None:
    """The pin a takeover must see, in this order: the key an installation of Shepherd's
    chose (the system on the disk is the one it wrote) or an operator accepted (a
    later word than the file's), the inventory's (an operator's word for the system
    the machine had), the key recorded at the first takeover."""
    if recorded is not None and recorded.source == bmdb.OPERATOR_PIN:
        return HostKeyPin(recorded.host_key, "accepted by an operator")
    if recorded is not None and recorded.chosen:
        return HostKeyPin(recorded.host_key, f"chosen by installation generation "
                                             f"{recorded.generation} and written into the "
                                             "system it installed")
    if machine.host_key:
        return HostKeyPin(machine.host_key, "pinned in the inventory")
    if recorded is None:
        return None
    return HostKeyPin(recorded.host_key, "recorded at the first takeover")


class Known(NamedTuple):
    """What an AgentStart needs from the BMDB, read together before it acts
    (``read_known``): the machine's own rows, and the fleet's answer key (public
    half, base64) for the agent's TakeoverInit."""

    view: bmdb.TakeoverView
    answer_key: str


def read_known(work: bmdb.Work) -> Known:
    """Everything AgentStart reads from the BMDB (``read_known_in``), in a transaction of
    its own: for a claim made here, by hand; a dispatched claim's is read in the
    transaction that adopts it (``machine_work``), one commit fewer per machine.

    Outside the session (``BMDB.read``): a session's transaction locks the session
    row, so even a read writes and its COMMIT waits for the WAL to reach the disk.
    Nothing read here needs the lease; the takeover checks it (``ensure_held``) right
    before acting, and the finish checks it again in its own transaction.
    """
    db = work.session.db
    return db.read(lambda tx: read_known_in(tx, db, work.machine_id))


def read_known_in(tx: bmdb.Tx, db: bmdb.BMDB, machine_id: uuid.UUID) -> Known:
    """What AgentStart reads from the BMDB, in one statement once the answer key is
    known: every round trip here is paid per machine.

    Why reading it all before the provider call is safe: while this claim is held,
    nothing else writes these rows. AgentStarted and the recorded host key change
    only through a takeover or Recovery, which share this claim's exclusion group;
    only ``shepherd host-key forget`` may drop the pin meanwhile, as it could between
    separate reads before, and a pin read too early is stricter, never looser (the
    takeover fails with a mismatch). The inventory's pin comes with the provider's
    answer, fresh.
    """
    return Known(bmdb.takeover_view(tx, machine_id), _answer_key(tx, db))


#: The fleet's answer key (public half) per BMDB, once a transaction that read it has
#: committed. A server key never changes once written (``bmdb.server_keys``: one value
#: per name, ever), so a process reads it once instead of at every takeover, where it
#: cost a key generation and two statements. Remembered only after the commit: a key
#: this process created in a transaction that rolled back was never the fleet's.
_ANSWER_KEYS: weakref.WeakKeyDictionary[bmdb.BMDB, str] = weakref.WeakKeyDictionary()


def _answer_key(tx: bmdb.Tx, db: bmdb.BMDB) -> str:
    """The remembered answer key, else the BMDB's (created in ``tx`` if it has none)."""
    remembered = _ANSWER_KEYS.get(db)
    if remembered is not None:
        return remembered
    return AnswerKey.from_tx(tx).public_b64


def _remember_answer_key(db: bmdb.BMDB, key: str) -> None:
    _ANSWER_KEYS.setdefault(db, key)


class Takeover(NamedTuple):
    """A takeover's outcome: the agent's fresh key, the nonce it was given (recorded
    together in AgentStarted) and the host key the machine presented."""

    agent_key: bytes
    host_key: str
    nonce: str


def record_agent(tx: bmdb.Tx, machine_id: uuid.UUID, taken: Takeover) -> None:
    """AgentStarted for the agent of ``taken``: its key with the nonce it signs with."""
    bmdb.set_agent_started(tx, machine_id, taken.agent_key, taken.nonce)


def take_over_work(work: bmdb.Work, machine: ProviderMachine, settings: InitializerSettings,
                   pin: HostKeyPin | None = None) -> Takeover:
    """``take_over`` with what it needs from the BMDB, read in one transaction: the
    servers' answer key (created if the fleet has none yet) and the machine's current
    agent key, which the new agent must not answer with (Recovery's rung 0)."""
    db = work.session.db

    def read(tx: bmdb.Tx) -> tuple[str, bytes | None]:
        current = bmdb.agent_credentials(tx, work.machine_id)
        return _answer_key(tx, db), current.public_key if current else None

    answer_key, current_key = work.session.transact(read)
    _remember_answer_key(db, answer_key)
    return take_over(machine, work.machine_id, settings, pin, answer_key=answer_key,
                     current_key=current_key)


def reachable_machine(work: bmdb.Work, provider: Provider, permanent: bmdb.Backoff,
                      provided: dict[str, Any] | None) -> ProviderMachine:
    """The provider's current view of the machine (its ``provided`` tag says which
    device), which must have an address."""
    provider_id = provider_id_from(provided, provider, permanent)
    try:
        machine = provider.get_machine(provider_id)
    except NotFound as error:
        raise WorkflowFailure(f"provider {provider.name}: device {provider_id} not found: "
                              f"{error}", permanent) from error
    if not machine.address:
        raise WorkflowFailure(f"provider {provider.name}: device {provider_id} has no address")
    if machine.status is not bmdb.ProviderStatus.RUNNING:
        raise WorkflowFailure(f"provider {provider.name}: device {provider_id} is "
                              f"{machine.status.value}, not Running")
    return machine


def take_over(machine: ProviderMachine, machine_id: uuid.UUID,
              settings: InitializerSettings, pin: HostKeyPin | None = None, *,
              answer_key: str, current_key: bytes | None = None) -> Takeover:
    """Upload and run the agent over SSH with a new nonce; return its validated 32-byte
    public key (proven, and not ``current_key``), the nonce, and the host key the
    machine presented (which must be ``pin``'s when there is one: otherwise nothing
    is uploaded)."""
    assert machine.address is not None
    try:
        init = TakeoverInit(machine_id, settings.callback_url, settings.ca_certificate,
                            nonce=new_nonce(), answer_key=answer_key,
                            heartbeat_interval=settings.heartbeat_interval)
    except ProtocolError as error:
        raise WorkflowFailure(f"config: unusable takeover settings: {error}") from error
    remote = Remote(machine.address, machine.ssh_port, settings.ssh_key_path,
                    user=machine.ssh_user or settings.ssh_user,
                    connect_timeout=settings.connect_timeout,
                    exec_timeout=settings.exec_timeout,
                    host_key=None if pin is None else pin.key)
    try:
        remote.connect()
        command = agent_command(upload_agent(remote, settings.agent_target),
                                settings.agent_args)
        result = remote.run(command, stdin=init.encode())
    except HostKeyMismatch as error:
        assert pin is not None
        raise WorkflowFailure(f"ssh: {error} ({pin.source})",
                              settings.permanent_backoff) from error
    except RemoteError as error:
        raise WorkflowFailure(f"ssh: {type(error).__name__}: {error}") from error
    finally:
        remote.close()
    assert remote.host_key is not None
    # Whatever ran did not answer as the agent does. The login shell runs the command,
    # and one that runs nothing (nologin) or prints its own text is the usual cause.
    shell = (f"the login shell of {remote.user!r} runs {command!r} and must run it "
             "without printing anything of its own")
    if not result.stdout.strip():
        raise WorkflowFailure(f"agent: no answer (exit {result.exit_code}; stderr: "
                              f"{result.stderr.strip()[-300:]!r}); {shell}")
    try:
        response = parse_takeover_response(result.stdout, init, current_key)
    except ProtocolError as error:
        raise WorkflowFailure(f"agent: bad answer (exit {result.exit_code}): {error}; {shell}"
                              ) from error
    if response.error is not None:
        raise WorkflowFailure(f"agent: reported error: {response.error}")
    for warning in response.warnings:
        log.warning("agent on %s warns: %s", machine_id, warning)
    assert response.key is not None
    return Takeover(response.key, remote.host_key, init.nonce)


def upload_agent(remote: Remote, target: str) -> str:
    """Upload the agent bundle to ``target``; where the home directory refuses a
    relative one, to ``FALLBACK_DIRECTORY`` instead. Returns where it is."""
    bundle = agent_bundle()
    try:
        remote.upload(bundle, target, mode=0o755)
        return target
    except UploadRefused as refused:  # not a timeout, nor a broken SFTP: this place
        if posixpath.isabs(target):
            raise
        fallback = posixpath.join(FALLBACK_DIRECTORY, target)
        try:
            remote.upload(bundle, fallback, mode=0o755)
        except RemoteError as also_refused:
            raise RemoteError(f"the agent can be written neither in the home directory "
                              f"({refused}) nor in {FALLBACK_DIRECTORY} ({also_refused})"
                              ) from also_refused
        log.warning("%s: the home directory refused the agent (%s); it runs from %s",
                    remote.where, refused, fallback)
        return fallback


def agent_command(target: str, args: tuple[str, ...] = ()) -> str:
    """``/bin/sh ./shepherd-agent.pyz [args]``: through /bin/sh, the one interpreter every
    Unix has at that path, so that neither the file's exec bit (a noexec home), nor
    /usr/bin/env, nor the login shell's language matters: any shell that runs a
    simple command runs this one. ``./``: sh would look a bare name up on PATH."""
    path = target if "/" in target else f"./{target}"
    return shlex.join(["/bin/sh", path, *args])
