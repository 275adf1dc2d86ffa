"""Operator reads (list, show, explain, sessions) and writes (clear a backoff, claim for a
handoff) against a seeded BMDB, on PostgreSQL and SQLite."""

from __future__ import annotations

import uuid

import pytest

import bmdb
from shepherd import operator
from tests.bmdb_helpers import backlog_ids
from tests.operator_fixtures import Fleet, seed_fleet


@pytest.fixture
def fleet(db: bmdb.BMDB, session: bmdb.Session) -> Fleet:
    return seed_fleet(db, session)


def ids(found: operator.MachineList) -> set[uuid.UUID]:
    return {m.id for m in found.machines}


def test_list_filters_combine(db: bmdb.BMDB, fleet: Fleet) -> None:
    def listed(**kw: object) -> set[uuid.UUID]:
        return db.read(lambda tx: ids(operator.list_machines(tx, operator.MachineFilter(**kw))))

    assert listed() == set(fleet.all)
    assert listed(tags=("AgentStarted",), without=("AgentHeartbeat",)) == {
        fleet.silent, fleet.orphaned, fleet.fresh_agent}
    assert listed(work="any") == {fleet.busy, fleet.orphaned}
    assert listed(work=bmdb.Process.RECOVERY.value) == {fleet.orphaned}
    # The healthy machine's backoff has expired: it is no filter match.
    assert listed(backoff="any") == {fleet.backing_off}
    assert listed(provider="test", tags=("Provided",)) == set(fleet.all)
    assert listed(provider="other") == set()
    page = db.read(lambda tx: operator.list_machines(tx, operator.MachineFilter(limit=3)))
    assert (len(page.machines), page.matched, page.total) == (3, 9, 9)
    assert page.tag_counts == {"Provided": 9, "AgentStarted": 5, "AgentHeartbeat": 2,
                               "HardwareReport": 0, "OSInstallationRequest": 0,
                               "OSInstallationReport": 0}


def test_explain_agrees_with_what_a_claim_would_take(db: bmdb.BMDB, session: bmdb.Session,
                                                     fleet: Fleet) -> None:
    """``claimable`` must be exactly the claim's own eligibility, for every machine."""
    for process in operator.BACKLOG_PROCESSES:
        eligible = backlog_ids(session, process)
        claimable = set()
        for machine_id in fleet.all:
            found = db.read(lambda tx, m=machine_id: operator.explain(tx, m, db.thresholds))
            mine = next(p for p in found.processes if p.process == process.value)
            if mine.claimable:
                claimable.add(machine_id)
        assert claimable == eligible, process


def test_explain_reasons(db: bmdb.BMDB, fleet: Fleet) -> None:
    def explained(machine_id: uuid.UUID) -> dict[str, operator.ProcessExplanation]:
        found = db.read(lambda tx: operator.explain(tx, machine_id, db.thresholds))
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


def test_show_lists_every_backoff_and_history_newest_first(db: bmdb.BMDB, fleet: Fleet) -> None:
    detail = db.read(lambda tx: operator.show_machine(tx, fleet.backing_off))
    assert [(b.process, b.active) for b in detail.backoffs] == [("ShepherdAgentStart", True)]
    assert [h["event"] for h in detail.history] == ["Failed", "Started"]
    assert detail.history[0]["cause"] == "ssh: connection refused"
    with pytest.raises(operator.UnknownMachine):
        db.read(lambda tx: operator.show_machine(tx, uuid.uuid4()))


def test_sessions(db: bmdb.BMDB, session: bmdb.Session, fleet: Fleet) -> None:
    _, found = db.read(lambda tx: operator.list_sessions(tx))
    by_id = {s.id: s for s in found}
    assert by_id[session.id].alive and by_id[session.id].work == 1
    assert not by_id[fleet.dead_session].alive and by_id[fleet.dead_session].work == 1
    _, alive = db.read(lambda tx: operator.list_sessions(tx, include_dead=False))
    assert fleet.dead_session not in {s.id for s in alive}


def test_clear_backoff_makes_the_machine_claimable(session: bmdb.Session, fleet: Fleet) -> None:
    process = bmdb.Process.AGENT_START
    assert fleet.backing_off not in backlog_ids(session, process)
    cleared = operator.clear_backoff(session, fleet.backing_off, process)
    assert cleared is not None and cleared.cause == "ssh: connection refused"
    assert fleet.backing_off in backlog_ids(session, process)
    assert operator.clear_backoff(session, fleet.backing_off, process) is None
    with pytest.raises(operator.UnknownMachine):
        operator.clear_backoff(session, uuid.uuid4(), process)


def test_claim_for_handoff_can_be_adopted(db: bmdb.BMDB, session: bmdb.Session,
                                          fleet: Fleet) -> None:
    work = operator.claim_for_handoff(session, bmdb.Process.AGENT_START, fleet.new, 30)
    with db.start_session("worker", interval=2) as worker:
        adopted = worker.adopt(work.id, machine_id=fleet.new, process=bmdb.Process.AGENT_START)
        assert operator.wait_adopted(session, work, timeout=1)
        adopted.cancel("test")
    with pytest.raises(bmdb.MachineInBackoff):
        operator.claim_for_handoff(session, bmdb.Process.AGENT_START, fleet.backing_off, 30)
    with pytest.raises(bmdb.NotInBacklog):
        operator.claim_for_handoff(session, bmdb.Process.AGENT_START, fleet.stopped, 30)
    with pytest.raises(operator.RecoveryPaused):
        operator.claim_for_handoff(session, bmdb.Process.RECOVERY, fleet.silent, 30)
    with pytest.raises(operator.UnknownMachine):
        operator.claim_for_handoff(session, bmdb.Process.AGENT_START, uuid.uuid4(), 30)


@pytest.mark.parametrize(("text", "expected"), [
    ("agent-start", bmdb.Process.AGENT_START), ("ShepherdRecovery", bmdb.Process.RECOVERY),
    ("RECOVERY", bmdb.Process.RECOVERY), ("os_install", bmdb.Process.OS_INSTALL),
])
def test_parse_process(text: str, expected: bmdb.Process) -> None:
    assert operator.parse_process(text) is expected


@pytest.mark.parametrize("text", ["", "reboot", "shepherd"])
def test_parse_process_refuses(text: str) -> None:
    with pytest.raises(operator.BadArgument, match="unknown process"):
        operator.parse_process(text)


@pytest.mark.parametrize("text", ["", "xyz", "1234", "0f8e5c3a-7b1d-4c2e-9a6f"])
def test_parse_machine_id_refuses(text: str) -> None:
    with pytest.raises(operator.BadArgument, match="is not a machine id"):
        operator.parse_machine_id(text)
