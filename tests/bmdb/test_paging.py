"""Cursor paging of machines (``bmdb.list_machines``): every match once, in
creation order, across pages; the edges (empty, last page, a cursor whose machine is
gone, a page over the cap, a cursor no page gave out); counts, exact or estimated."""

from __future__ import annotations

import functools
import uuid

import pytest

import bmdb
from bmdb import MachineFilter, inspection
from shepherd import operations
from tests.support.bmdb_helpers import seed_provided, start_agent


def all_pages(db: bmdb.BMDB, **filters) -> tuple[list[uuid.UUID], int]:
    """Every machine the filter matches, page by page; and how many pages it took."""
    seen: list[uuid.UUID] = []
    after, pages = None, 0
    while True:
        found = db.read(functools.partial(inspection.list_machines,
                                          f=MachineFilter(after=after, **filters)))
        pages += 1
        seen += [m.id for m in found.machines]
        if found.next_cursor is None:
            return seen, pages
        after = found.next_cursor
        assert pages < 100


def creation_order(db: bmdb.BMDB, ids) -> list[uuid.UUID]:
    created = {i: db.read(functools.partial(inspection.machine_created_at, machine_id=i))
               for i in ids}
    return sorted(ids, key=lambda i: (created[i], i))


def test_pages_cover_every_match_once_in_creation_order(db, session) -> None:
    # Two batches: machines of one transaction share created_at, so ids break ties.
    first, second = seed_provided(session, 7), seed_provided(session, 6)
    started = first[::2] + second[1::2]
    for machine in started:
        start_agent(session, machine)
    seen, pages = all_pages(db, limit=3)
    assert seen == creation_order(db, first + second) and pages == 5
    seen, _ = all_pages(db, limit=2, tags=("AgentStarted",))
    assert seen == creation_order(db, started)
    seen, _ = all_pages(db, limit=4, without=("AgentStarted",))
    assert seen == creation_order(db, set(first + second) - set(started))


def test_counts_tags_and_holds_come_with_the_page(db, session) -> None:
    a, b, c = seed_provided(session, 3)
    start_agent(session, a)
    session.transact(lambda tx: bmdb.put_hold(tx, b, "maintenance", "rack", "test"))
    found = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(limit=2)))
    assert found.total == 3 and found.matched == 3 and not found.matched_estimated
    assert found.tag_counts["Provided"] == 3 and found.tag_counts["AgentStarted"] == 1
    by_id = {m.id: m for m in found.machines}
    later = db.read(lambda tx: inspection.list_machines(
        tx, MachineFilter(after=found.next_cursor)))
    by_id.update({m.id: m for m in later.machines})
    assert by_id[a].tags == ["Provided", "AgentStarted"] and by_id[a].holds == []
    assert by_id[b].holds == ["maintenance"] and by_id[c].tags == ["Provided"]


def test_an_empty_fleet_and_a_filter_nobody_matches_give_an_empty_last_page(db, session):
    found = db.read(lambda tx: inspection.list_machines(tx, MachineFilter()))
    assert (found.machines, found.matched, found.next_cursor, found.total) == ([], 0, None, 0)
    seed_provided(session, 2)
    found = db.read(lambda tx: inspection.list_machines(
        tx, MachineFilter(tags=("AgentHeartbeat",))))
    assert (found.machines, found.matched, found.next_cursor) == ([], 0, None)


def test_the_last_page_has_no_next_cursor_even_when_full(db, session) -> None:
    seed_provided(session, 4)
    first = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(limit=2)))
    last = db.read(lambda tx: inspection.list_machines(
        tx, MachineFilter(limit=2, after=first.next_cursor)))
    assert first.next_cursor is not None
    assert len(last.machines) == 2 and last.next_cursor is None


def test_a_cursor_whose_machine_was_deleted_still_leads_on(db, session) -> None:
    ids = creation_order(db, seed_provided(session, 5))
    first = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(limit=2)))
    assert [m.id for m in first.machines] == ids[:2]
    session.transact(lambda tx: bmdb.delete_machine(tx, ids[1]))
    rest = db.read(lambda tx: inspection.list_machines(
        tx, MachineFilter(limit=10, after=first.next_cursor)))
    assert [m.id for m in rest.machines] == ids[2:]


@pytest.mark.parametrize("limit", [0, -1, inspection.MAX_PAGE + 1, 100_000])
def test_a_page_over_the_cap_is_refused(limit: int) -> None:
    with pytest.raises(operations.BadArgument, match=f"from 1 to {inspection.MAX_PAGE}"):
        operations.parse_limit(str(limit))
    with pytest.raises(ValueError, match="a page holds"):
        MachineFilter(limit=limit)


@pytest.mark.parametrize("cursor", ["garbage", "!!", "bm90IGEgY3Vyc29y",
                                    "MjAyNi0xMi0wMVQxMDowMDowMHx4"])
def test_a_cursor_no_page_gave_out_is_refused(cursor: str) -> None:
    with pytest.raises(operations.BadArgument, match="not a page cursor"):
        operations.machine_filter(after=cursor)


def test_work_and_backoff_filters_page_and_count_exactly(db, session) -> None:
    ids = seed_provided(session, 6)
    for machine in ids[:3]:
        session.claim_machine(bmdb.Process.AGENT_START, machine).fail("ssh: refused")
    seen, pages = all_pages(db, limit=2, backoff=inspection.ANY)
    assert seen == creation_order(db, ids[:3]) and pages == 2
    found = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(backoff="any")))
    assert found.matched == 3 and not found.matched_estimated


def test_a_provider_count_is_exact_up_to_a_bound_then_estimated(db, session, monkeypatch):
    seed_provided(session, 5)
    found = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(provider="test")))
    assert (found.matched, found.matched_estimated) == (5, False)
    found = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(provider="other")))
    assert (found.matched, found.matched_estimated) == (0, False)
    monkeypatch.setattr(inspection, "EXACT_UP_TO", 2)
    found = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(provider="test")))
    if db.engine.dialect.name == "postgresql":
        assert found.matched_estimated and found.matched >= 3
    else:  # SQLite fleets are one host's: always counted
        assert (found.matched, found.matched_estimated) == (5, False)


def test_a_page_at_a_glance_reads_what_glances_reads(db, session) -> None:
    """The list page's glances come with the page (one statement) and say what
    ``glances`` says of the same machines: heartbeat, hostname, power, or nothing."""
    bare, started, full = seed_provided(session, 3)
    start_agent(session, started)
    start_agent(session, full)

    def seed(tx: bmdb.Tx) -> None:
        bmdb.record_heartbeat(tx, full, tx.now)
        bmdb.set_hardware_report(tx, full, {"hostname": "rack1-u07"})
        bmdb.record_power_observed(tx, full, "On", "redfish http://bmc")

    db.read(seed)
    found, looks = db.read(lambda tx: inspection.list_machines_at_a_glance(
        tx, MachineFilter(limit=2)))
    alone = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(limit=2)))
    assert found.machines == alone.machines and found.next_cursor == alone.next_cursor
    assert list(looks) == [m.id for m in found.machines]
    assert list(looks) == creation_order(db, [bare, started, full])[:2]
    _, looks = db.read(lambda tx: inspection.list_machines_at_a_glance(tx, MachineFilter()))
    assert looks == db.read(lambda tx: bmdb.glances(tx, [bare, started, full]))
    assert looks[bare] == bmdb.Glance() and looks[started].agent_started_at is not None
    assert looks[full].hostname == "rack1-u07" and looks[full].power.state == "On"
    assert looks[full].last_heartbeat_at is not None
