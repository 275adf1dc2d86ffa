"""Operator reads (list, show, explain, sessions) and writes (clear a backoff, claim for a
handoff) against a seeded BMDB, on PostgreSQL and SQLite."""

from __future__ import annotations

import functools
import json
import socket
import uuid
from typing import Any

import pytest
import requests

import bmdb
from shepherd import operations
from shepherd.agent import agent
from shepherd.operations.explain import why_not
from shepherd.workflows import guard
from tests.support.agent_fixtures import refused_installation
from tests.support.bmdb_helpers import backlog_ids
from tests.support.garbage_fixtures import DOCUMENTS, assert_plain, seed_garbage
from tests.support.operator_fixtures import Fleet, healthy_callback_server, seed_fleet


@pytest.fixture
def fleet(db: bmdb.BMDB, session: bmdb.Session) -> Fleet:
    return seed_fleet(db, session)


def ids(found: operations.MachineList) -> set[uuid.UUID]:
    return {m.id for m in found.machines}


def test_list_filters_combine(db: bmdb.BMDB, fleet: Fleet) -> None:
    def listed(**kw: Any) -> set[uuid.UUID]:
        return db.read(lambda tx: ids(operations.list_machines(tx, operations.MachineFilter(**kw))))

    assert listed() == set(fleet.all)
    assert listed(tags=("AgentStarted",), without=("AgentHeartbeat",)) == {
        fleet.silent, fleet.orphaned, fleet.fresh_agent}
    assert listed(work="any") == {fleet.busy, fleet.orphaned}
    assert listed(work=bmdb.Process.RECOVERY.value) == {fleet.orphaned}
    # The healthy machine's backoff has expired: it is no filter match.
    assert listed(backoff="any") == {fleet.backing_off}
    assert listed(provider="test", tags=("Provided",)) == set(fleet.all)
    assert listed(provider="other") == set()
    page = db.read(lambda tx: operations.list_machines(tx, operations.MachineFilter(limit=3)))
    assert (len(page.machines), page.matched, page.total) == (3, 9, 9)
    assert page.tag_counts == {"Provided": 9, "AgentStarted": 5, "AgentHeartbeat": 2,
                               "HardwareReport": 0, "OSInstallationRequest": 0,
                               "OSInstallationReport": 0}


@pytest.mark.parametrize("limits", [guard.GuardLimits(), guard.GuardLimits(max_share=1.0)],
                         ids=["guard-pauses", "guard-allows"])
def test_explain_agrees_with_what_a_claim_would_take(db: bmdb.BMDB, session: bmdb.Session,
                                                     fleet: Fleet,
                                                     limits: guard.GuardLimits) -> None:
    """``claimable`` must be exactly what a claim would take, for every machine: the
    claim's own eligibility, and for Recovery nothing while the guard (which the task
    asks before claiming) pauses it. Checked twice: against the eligibility and the
    guard's ``evaluate``, and by claiming each machine for real."""
    paused = guard.evaluate(db, db.thresholds, limits).paused
    assert (paused is not None) == (limits.max_share < 1)  # both cases are exercised
    for machine in (fleet.healthy, fleet.silent):  # heartbeating, and not: one claimable
        session.transact(functools.partial(
            bmdb.want_installation, machine_id=machine, image="debian-12", disk="serial=S1",
            origin="operator", by="test", reason="an installation's backlog too"))
    for process in operations.BACKLOG_PROCESSES:
        eligible = backlog_ids(session, process)
        assert eligible  # so that an empty answer cannot pass by accident
        if process is bmdb.Process.RECOVERY and paused:
            eligible = set()
        claimable = set()
        for machine_id in fleet.all:
            found = db.read(functools.partial(operations.explain, machine_id=machine_id,
                                              thresholds=db.thresholds, limits=limits))
            mine = next(p for p in found.processes if p.process == process.value)
            if mine.claimable:
                claimable.add(machine_id)
        assert claimable == eligible, process
        assert claimed_one_by_one(session, process, fleet.all, limits) == claimable, process


def claimed_one_by_one(session: bmdb.Session, process: bmdb.Process,
                       machines: list[uuid.UUID], limits: guard.GuardLimits) -> set[uuid.UUID]:
    """The machines a guarded claim takes, each released at once (no backoff, and a
    cancelled claim does not count in the hourly budget)."""
    taken = set()
    for machine_id in machines:
        try:
            work = operations.claim_for_handoff(session, process, machine_id, 30, limits)
        except (bmdb.NotClaimable, operations.RecoveryPaused):
            continue
        taken.add(machine_id)
        work.cancel("test")
    return taken


def test_paused_recovery_is_not_claimable_and_says_why(db: bmdb.BMDB, fleet: Fleet) -> None:
    found = db.read(lambda tx: operations.explain(tx, fleet.silent, db.thresholds))
    recovery = next(p for p in found.processes if p.process == "ShepherdRecovery")
    assert recovery.in_backlog and recovery.work is None and recovery.backoff is None
    assert not recovery.claimable and recovery.state == "PAUSED by the guard"
    assert recovery.summary.startswith("in the backlog, but Recovery is PAUSED by the guard: "
                                       "3 of 5 started agents are silent")
    assert recovery.verdict == f"not claimable: {recovery.summary}"


def test_explain_asks_the_callback_server_like_the_guard(db: bmdb.BMDB, session: bmdb.Session,
                                                         fleet: Fleet) -> None:
    with socket.socket() as sock:  # bound, not listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/healthz"
        limits = guard.GuardLimits(max_share=1.0, healthz_url=url, healthz_timeout=2)
        found = operations.explain_machine(db, fleet.silent, limits)
        recovery = next(p for p in found.processes if p.process == "ShepherdRecovery")
        assert not recovery.claimable and recovery.guard["callback_healthy"] is False
        assert recovery.paused == guard.evaluate(db, db.thresholds, limits).paused
        assert (recovery.paused or "").startswith(
            f"recovery paused: callback server {url} unreachable")
        with pytest.raises(operations.RecoveryPaused, match="callback server"):
            operations.claim_for_handoff(session, bmdb.Process.RECOVERY, fleet.silent, 30, limits)
    with healthy_callback_server() as endpoint:
        limits = guard.GuardLimits(max_share=1.0, healthz_url=f"{endpoint}/healthz")
        found = operations.explain_machine(db, fleet.silent, limits)
        recovery = next(p for p in found.processes if p.process == "ShepherdRecovery")
        assert recovery.claimable and recovery.paused is None
        assert recovery.guard["callback_healthy"] is True


def test_explain_reasons(db: bmdb.BMDB, fleet: Fleet) -> None:
    def explained(machine_id: uuid.UUID) -> dict[str, operations.ProcessExplanation]:
        found = db.read(lambda tx: operations.explain(tx, machine_id, db.thresholds))
        return {p.process: p for p in found.processes}

    quiet = explained(fleet.quiet)["ShepherdRecovery"]
    assert quiet.in_backlog and quiet.backlog.startswith("heartbeat stale")
    healthy = explained(fleet.healthy)
    assert healthy["ShepherdRecovery"].backlog.startswith("heartbeat fresh")
    assert healthy["ShepherdRecovery"].backoff is not None
    assert not healthy["ShepherdRecovery"].backoff.active
    orphaned = explained(fleet.orphaned)["ShepherdRecovery"]
    assert orphaned.work is not None and not orphaned.work.session_alive
    assert orphaned.work.session_id == fleet.dead_session
    assert "silent" in (orphaned.paused or "") and orphaned.guard["started"] == 5
    busy = explained(fleet.busy)["ShepherdAgentStart"]
    assert busy.work is not None and busy.work.session_alive and busy.state == "held by work"
    assert explained(fleet.new)["ShepherdAgentStart"].summary == "claimable now"
    assert "no Provided" not in explained(fleet.stopped)["ShepherdAgentStart"].backlog


def test_a_held_machine_is_in_no_backlog_and_explain_says_why(
        db: bmdb.BMDB, session: bmdb.Session, fleet: Fleet) -> None:
    """Maintenance and quarantine: in neither backlog (the claims agree), the hold is the
    reason given for both processes, with who, why and the command that lifts it."""
    put = operations.put_maintenance(session, fleet.new, "  swap the NIC ", "alice")
    assert put.changed and put.hold is not None
    assert (put.hold.reason, put.hold.actor) == ("swap the NIC", "alice")
    session.transact(lambda tx: bmdb.put_hold(tx, fleet.quiet, bmdb.QUARANTINE,
                                               "ladder exhausted 3 times", "shepherd recovery"))
    limits = guard.GuardLimits(max_share=1.0)
    for machine_id, words in ((fleet.new, "in maintenance since"),
                              (fleet.quiet, "quarantined since")):
        found = db.read(functools.partial(operations.explain, machine_id=machine_id,
                                          thresholds=db.thresholds, limits=limits))
        assert [h.machine_id for h in found.holds] == [machine_id]
        for p in found.processes:
            assert not p.in_backlog and not p.claimable, p
            assert p.backlog.startswith(words) and "held machines are in no backlog" in p.backlog
    assert "(`shepherd maintenance off " in db.read(
        lambda tx: operations.explain(tx, fleet.new, db.thresholds)).processes[0].backlog
    with pytest.raises(bmdb.NotInBacklog, match="in maintenance since .* because swap the NIC "
                                                r"\(by alice\)"):
        operations.claim_for_handoff(session, bmdb.Process.AGENT_START, fleet.new, 30)
    with pytest.raises(bmdb.NotInBacklog, match="quarantined since"):
        operations.claim_for_handoff(session, bmdb.Process.RECOVERY, fleet.quiet, 30, limits)
    listed = db.read(lambda tx: operations.list_machines(tx))
    assert {m.id: m.holds for m in listed.machines if m.holds} == {
        fleet.new: ["maintenance"], fleet.quiet: ["quarantine"]}
    detail = db.read(lambda tx: operations.show_machine(tx, fleet.quiet))
    assert [(h.kind, h.actor) for h in detail.holds] == [("quarantine", "shepherd recovery")]

    lifted = operations.lift_maintenance(session, fleet.new, "alice", "done")
    assert lifted.changed and lifted.remaining == []
    assert not operations.lift_maintenance(session, fleet.new, "alice").changed
    cleared = operations.clear_quarantine(session, fleet.quiet, "bob")
    assert cleared.changed and cleared.hold is not None
    assert cleared.hold.reason == "ladder exhausted 3 times"
    for process in (bmdb.Process.AGENT_START, bmdb.Process.RECOVERY):
        claimable = claimed_one_by_one(session, process, [fleet.new, fleet.quiet], limits)
        assert claimable == {fleet.new if process is bmdb.Process.AGENT_START else fleet.quiet}


def test_hold_arguments_are_checked_before_anything_changes(
        db: bmdb.BMDB, session: bmdb.Session, fleet: Fleet) -> None:
    with pytest.raises(operations.BadArgument, match="--reason is required"):
        operations.put_maintenance(session, fleet.new, " \t", "alice")
    with pytest.raises(operations.BadArgument, match="--by is required"):
        operations.lift_maintenance(session, fleet.new, "")
    with pytest.raises(operations.UnknownMachine):
        operations.put_maintenance(session, uuid.uuid4(), "x", "alice")
    assert db.read(lambda tx: bmdb.held_counts(tx)) == {"maintenance": 0, "quarantine": 0,
                                                        "host-key": 0, "bmc-mismatch": 0}


def test_a_bmc_mismatch_is_cleared_with_a_reason_and_says_when_there_was_none(
        db: bmdb.BMDB, session: bmdb.Session, fleet: Fleet) -> None:
    session.transact(lambda tx: bmdb.put_hold(tx, fleet.healthy, bmdb.BMC_MISMATCH_HOLD,
                                              "the BMC manages uuid A", "ShepherdRecovery"))
    with pytest.raises(operations.BadArgument, match="--reason is required"):
        operations.clear_bmc_mismatch(session, fleet.healthy, "alice", " ")
    assert db.read(lambda tx: bmdb.held_counts(tx))["bmc-mismatch"] == 1
    change = operations.clear_bmc_mismatch(session, fleet.healthy, "alice", "lines swapped")
    assert change.changed and change.hold is not None
    assert operations.hold_text(change.hold).startswith("held on a BMC mismatch since ")
    assert operations.lift_command(change.hold) == (
        f"shepherd bmc-mismatch clear {fleet.healthy} --reason TEXT")
    again = operations.clear_bmc_mismatch(session, fleet.healthy, "alice", "twice")
    assert not again.changed
    assert db.read(lambda tx: bmdb.held_counts(tx))["bmc-mismatch"] == 0


def test_a_machine_its_provider_no_longer_lists_is_shown_as_gone(
        db: bmdb.BMDB, fleet: Fleet) -> None:
    db.read(lambda tx: bmdb.set_provider_status(tx, [fleet.new],
                                                     bmdb.ProviderStatus.MISSING))
    found = db.read(lambda tx: operations.explain(tx, fleet.new, db.thresholds))
    agent_start = found.processes[0]
    assert not agent_start.in_backlog
    assert agent_start.backlog.startswith("gone (no longer listed by test) since ")
    assert operations.status_text("Missing", "static") == "gone (no longer listed by static)"
    assert operations.status_text("Running", "static") == "Running"


def test_show_lists_every_backoff_and_history_newest_first(db: bmdb.BMDB, fleet: Fleet) -> None:
    detail = db.read(lambda tx: operations.show_machine(tx, fleet.backing_off))
    assert [(b.process, b.active) for b in detail.backoffs] == [("ShepherdAgentStart", True)]
    assert [h["event"] for h in detail.history] == ["Failed", "Started"]
    assert detail.history[0]["cause"] == "ssh: connection refused"
    with pytest.raises(operations.UnknownMachine):
        db.read(lambda tx: operations.show_machine(tx, uuid.uuid4()))


# -- stored documents: whatever a row holds, show, explain and the page work -----------


def test_whatever_a_document_holds_show_and_explain_work(db: bmdb.BMDB,
                                                         session: bmdb.Session) -> None:
    """Garbage written past every check (tests/support/garbage_fixtures.py): ``show_machine``
    gives plain, bounded documents that JSON and terminals take, and ``explain`` (which
    needs no document) works too."""
    for name, machine_id in seed_garbage(db, session).items():
        detail = db.read(functools.partial(operations.show_machine, machine_id=machine_id))
        for tag, (_, column) in DOCUMENTS.items():
            assert_plain(detail.tags[tag][column], f"{name}: {tag}")
        json.dumps(operations.jsonable(detail), allow_nan=False)
        found = db.read(functools.partial(operations.explain, machine_id=machine_id,
                                          thresholds=db.thresholds))
        assert set(DOCUMENTS) <= set(found.tags), name
        assert why_not(db, bmdb.Process.RECOVERY, machine_id).reason, name


def test_what_garbage_is_shown_as(db: bmdb.BMDB, session: bmdb.Session) -> None:
    machines = seed_garbage(db, session)

    def report(name: str) -> Any:  # each case is of its own shape
        return db.read(lambda tx: operations.show_machine(tx, machines[name])
                       ).tags["HardwareReport"]["report"]

    assert report("900 deep, objects").startswith(
        "(not readable as JSON: recursion limit exceeded")
    deep = report("100 deep")
    for _ in range(14):
        deep = deep["a"]
    assert deep == {"a": "… (nested deeper than 16 levels)"}
    assert report("a float beyond doubles") == {"x": "Infinity"}
    assert report("an integer beyond int64") == {"x": str(2**70)}
    assert report("a 5 MiB string")["s"].endswith(f"… ({(5 << 20) - 16384} more characters)")
    assert report("100,000 items")[-1] == f"… ({100_000 - 4096} more items)"
    assert report("a number") == 42 and report("null") is None
    if db.url.startswith("sqlite"):
        assert report("NaN and Infinity") == {"x": "NaN", "y": "-Infinity", "z": ["Infinity"]}
        assert report("not JSON").startswith("(not readable as JSON:")
        assert report("a BLOB, not UTF-8").startswith("(not readable as JSON:")


def test_an_honest_report_is_shown_as_sent(db: bmdb.BMDB, session: bmdb.Session) -> None:
    report = agent.hardware_report()
    result = refused_installation({"kind": "debian-12"})

    def store(tx: bmdb.Tx) -> uuid.UUID:
        machine_id = bmdb.create_machine(tx)
        bmdb.set_hardware_report(tx, machine_id, report)
        bmdb.set_os_installation_report(tx, machine_id, 3, result)
        return machine_id

    machine_id = session.transact(store)
    tags = db.read(lambda tx: operations.show_machine(tx, machine_id)).tags
    assert tags["HardwareReport"]["report"] == report
    assert (tags["OSInstallationReport"]["generation"],
            tags["OSInstallationReport"]["result"]) == (3, result)


def machine_pages(db: bmdb.BMDB, session: bmdb.Session, db_url: str) -> dict[str, str]:
    """Garbage name -> the machine page of a machine holding it, from a real server (whose
    threads have a deeper stack than the CLI: 900 levels failed there even to decode)."""
    from shepherd.config import Settings
    from shepherd.server import serve

    machines = seed_garbage(db, session)
    pages = {}
    with (serve(Settings(bmdb_url=db_url, serve_listen="127.0.0.1:0"), db=db) as server,
          requests.Session() as http):
        http.trust_env = False
        assert server.operator_url
        for name, machine_id in machines.items():
            page = http.get(f"{server.operator_url}/machines/{machine_id}", timeout=30)
            assert page.status_code == 200, name
            pages[name] = page.text
    return pages


def test_the_machine_page_renders_whatever_a_document_holds(
        db: bmdb.BMDB, session: bmdb.Session, db_url: str) -> None:
    pages = machine_pages(db, session, db_url)
    for name, page in pages.items():
        assert len(page) < 200_000, name
        assert "<script>alert" not in page, name
    # Objects are shown as JSON: their control characters escaped.
    assert '"\\u001b[2J\\u001b]0;pwned' in pages["terminal escapes"]


def test_the_machine_page_shows_control_characters_rather_than_sending_them(
        db: bmdb.BMDB, session: bmdb.Session, db_url: str) -> None:
    """Plain values (a document that is a bare string, say) go through
    ``operations.printable``, which web.py registers as the ``printable`` filter."""
    pages = machine_pages(db, session, db_url)
    for name, page in pages.items():
        assert "\x1b" not in page and "\x07" not in page, name
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in pages["a string of escapes"]


def test_sessions(db: bmdb.BMDB, session: bmdb.Session, fleet: Fleet) -> None:
    _, found = db.read(lambda tx: operations.list_sessions(tx))
    by_id = {s.id: s for s in found}
    assert by_id[session.id].alive and by_id[session.id].work == 1
    assert not by_id[fleet.dead_session].alive and by_id[fleet.dead_session].work == 1
    _, alive = db.read(lambda tx: operations.list_sessions(tx, include_dead=False))
    assert fleet.dead_session not in {s.id for s in alive}


def test_clear_backoff_makes_the_machine_claimable(session: bmdb.Session, fleet: Fleet) -> None:
    process = bmdb.Process.AGENT_START
    assert fleet.backing_off not in backlog_ids(session, process)
    cleared = operations.clear_backoff(session, fleet.backing_off, process)
    assert cleared is not None and cleared.cause == "ssh: connection refused"
    assert fleet.backing_off in backlog_ids(session, process)
    assert operations.clear_backoff(session, fleet.backing_off, process) is None
    with pytest.raises(operations.UnknownMachine):
        operations.clear_backoff(session, uuid.uuid4(), process)


def test_claim_for_handoff_can_be_adopted(db: bmdb.BMDB, session: bmdb.Session,
                                          fleet: Fleet) -> None:
    work = operations.claim_for_handoff(session, bmdb.Process.AGENT_START, fleet.new, 30)
    with db.start_session("worker", interval=30) as worker:
        adopted = worker.adopt(work.id, machine_id=fleet.new, process=bmdb.Process.AGENT_START)
        assert operations.wait_adopted(session, work, timeout=1)
        adopted.cancel("test")
    with pytest.raises(bmdb.MachineInBackoff):
        operations.claim_for_handoff(session, bmdb.Process.AGENT_START, fleet.backing_off, 30)
    with pytest.raises(bmdb.NotInBacklog):
        operations.claim_for_handoff(session, bmdb.Process.AGENT_START, fleet.stopped, 30)
    with pytest.raises(operations.RecoveryPaused):
        operations.claim_for_handoff(session, bmdb.Process.RECOVERY, fleet.silent, 30)
    with pytest.raises(operations.UnknownMachine):
        operations.claim_for_handoff(session, bmdb.Process.AGENT_START, uuid.uuid4(), 30)


@pytest.mark.parametrize(("text", "expected"), [
    ("agent-start", bmdb.Process.AGENT_START), ("ShepherdRecovery", bmdb.Process.RECOVERY),
    ("RECOVERY", bmdb.Process.RECOVERY), ("os_install", bmdb.Process.OS_INSTALL),
])
def test_parse_process(text: str, expected: bmdb.Process) -> None:
    assert operations.parse_process(text) is expected


@pytest.mark.parametrize("text", ["", "reboot", "shepherd"])
def test_parse_process_refuses(text: str) -> None:
    with pytest.raises(operations.BadArgument, match="unknown process"):
        operations.parse_process(text)


#: Machines named as operators name them (``operations.resolve_machine``): two of an
#: inventory, one each of two providers that both call theirs "dup", one whose
#: inventory id spells another's UUID prefix, one never Provided.
RACK = uuid.UUID("1234abcd-0000-4000-8000-000000000001")
TWIN = uuid.UUID("1234abce-0000-4000-8000-000000000002")
CLOUD = uuid.UUID("55550000-0000-4000-8000-000000000003")
SPELLED = uuid.UUID("abcdef00-0000-4000-8000-000000000004")
BARE = uuid.UUID("99990000-0000-4000-8000-000000000005")


@pytest.fixture
def named(db: bmdb.BMDB, session: bmdb.Session) -> bmdb.BMDB:
    provided = {RACK: ("inventory", "rack1-u01"), TWIN: ("inventory", "dup"),
                CLOUD: ("equinix", "dup"), SPELLED: ("inventory", "5555")}

    def seed(tx: bmdb.Tx) -> None:
        for machine in (RACK, TWIN, CLOUD, SPELLED, BARE):
            bmdb.create_machine(tx, machine)
        for machine, (provider, provider_id) in provided.items():
            bmdb.upsert_provided(tx, machine, provider=provider, provider_id=provider_id,
                                 provider_status=bmdb.ProviderStatus.RUNNING)
    session.transact(seed)
    return db


@pytest.mark.parametrize("text, expected", [
    (str(RACK), RACK), (RACK.hex.upper(), RACK), ("rack1-u01", RACK), (" rack1-u01 ", RACK),
    ("9999", BARE), ("99990000-00", BARE), ("1234abcd", RACK),
    ("5555", SPELLED),  # a provider's id wins over the UUID prefix it spells
    ("5555000", CLOUD),
])
def test_machines_are_found_by_the_names_operators_use(named: bmdb.BMDB, text: str,
                                                      expected: uuid.UUID) -> None:
    assert named.read(lambda tx: operations.resolve_machine(tx, text)) == expected


@pytest.mark.parametrize("text, says", [
    ("1234ab", f"'1234ab' names several machines: {RACK} (inventory rack1-u01), "
               f"{TWIN} (inventory dup); give the UUID"),
    ("dup", f"'dup' names several machines: {CLOUD} (equinix dup), {TWIN} (inventory dup)"),
    ("999", "no machine named '999' (by UUID, provider or inventory id, or a UUID prefix "
            "of at least 4 hex digits)"),
    ("rack9-u99", "no machine named 'rack9-u99'"),
    ("0f8e5c3a-7b1d", "no machine named '0f8e5c3a-7b1d'"),
    ("0" * 33, f"no machine named '{'0' * 33}'"),  # longer than any UUID: no prefix
    ("  ", "no machine named: give a machine id"),
])
def test_a_name_that_names_no_machine_or_several_says_so(named: bmdb.BMDB, text: str,
                                                        says: str) -> None:
    with pytest.raises(operations.BadArgument) as refused:
        named.read(lambda tx: operations.resolve_machine(tx, text))
    assert str(refused.value).startswith(says), str(refused.value)
