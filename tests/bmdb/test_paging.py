"""Cursor paging of machines (``bmdb.list_machines``): every match once, in
creation order, across pages; the edges (empty, last page, a cursor whose machine is
gone, a page over the cap, a cursor no page gave out); counts, exact or estimated."""

from __future__ import annotations

import functools
import uuid

import pytest
import sqlalchemy as sa

import bmdb
from bmdb import MachineFilter, inspection
from bmdb._types import natural_key, natural_key_text
from shepherd import operations
from tests.support.bmdb_helpers import (
    rack_order,
    seed_health_fleet,
    seed_provided,
    seed_rack_names,
    start_agent,
)


def all_pages(db: bmdb.BMDB, **filters) -> tuple[list[uuid.UUID], int]:
    """Every machine the filter matches, page by page; and how many pages it took."""
    seen: list[uuid.UUID] = []
    after, pages = None, 0
    while True:
        found = db.read(functools.partial(inspection.list_machines,
                                          f=MachineFilter(after=after, **filters),
                                          thresholds=db.thresholds))
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


#: Each health figure (``bmdb.HealthCounts``' field) and the filter that lists its machines.
HEALTH_FILTERS = {
    "heartbeating": ("heartbeating", {"health": "heartbeating"}),
    "silent": ("silent", {"health": "silent"}),
    "in-recovery": ("in_recovery", {"work": bmdb.Process.RECOVERY.value}),
    "installing": ("installing", {"health": "installing"}),
    "held": ("held", {"held": inspection.ANY}),
    "backing-off": ("backing_off", {"backoff": inspection.ANY}),
}


def test_each_health_figure_is_what_its_filter_lists(db, session) -> None:
    """For a fleet with one machine of each health: every figure equals its filter's
    ``matched`` and the machines its pages list, which are the expected ones; the
    silent figure is the guard's."""
    fleet = seed_health_fleet(session)
    health = db.read(lambda tx: bmdb.health_counts(tx, db.thresholds))
    for key, (field, filters) in HEALTH_FILTERS.items():
        seen, pages = all_pages(db, limit=1, **filters)
        counted = db.read(lambda tx, f=filters: inspection.list_machines(
            tx, MachineFilter(**f), db.thresholds))
        assert set(seen) == fleet.expected[key] and len(seen) == len(set(seen)), key
        assert getattr(health, field) == counted.matched == len(seen), key
        assert not counted.matched_estimated and pages == len(seen), key
    assert health.silent == db.read(lambda tx: bmdb.silent_machines(tx, db.thresholds))
    by_name, _ = all_pages(db, limit=1, health="silent", sort="name")
    assert set(by_name) == fleet.expected["silent"]
    maintenance, _ = all_pages(db, held="maintenance")
    assert maintenance == [fleet.machines["held"]]
    assert all_pages(db, held="quarantine") == ([], 1)


def test_heartbeating_and_silent_need_the_thresholds(db, session) -> None:
    seed_provided(session, 1)
    for health in ("heartbeating", "silent"):
        with pytest.raises(ValueError, match="needs the BMDB's thresholds"):
            db.read(lambda tx, h=health: inspection.list_machines(tx, MachineFilter(health=h)))
    found = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(health="installing")))
    assert found.matched == 0


@pytest.mark.parametrize("text", [
    "rack1-u2", "rack10-u1", "a#5", "u007", "7", "", "0" * 25, "1" * 25,
    "00" + "1" * 19, "x" + "1" * 45 + "y0", "ünï9cøde10", "12345678901234567890123",
    "a\nb2", "%s%(x)s\\1", None])
def test_the_database_computes_the_natural_key_as_python_does(db, text: str | None) -> None:
    """What SQL computes (PostgreSQL's regular expressions, SQLite's registered
    function) is what ``natural_key_text`` computes, for the awkward cases too."""
    computed = db.read(lambda tx: tx.execute(
        sa.select(natural_key(sa.literal(text, sa.String)))).scalar_one())
    assert computed == natural_key_text(text)


def test_natural_keys_put_racks_in_rack_order() -> None:
    names = ["rack10-u1", "rack2-u1", "rack1-u10", "rack1-u2", "rack1-u02", "rack", "rack-"]
    assert sorted(names, key=lambda n: (natural_key_text(n), n)) == [
        "rack", "rack-", "rack1-u02", "rack1-u2", "rack1-u10", "rack2-u1", "rack10-u1"]
    assert natural_key_text("u007") == natural_key_text("u7")
    assert natural_key_text("9" * 21) == natural_key_text("9" * 20)  # past 20 digits: the last 20


def test_by_name_pages_cover_every_machine_once_ties_and_unnamed_included(db, session):
    """Provider ids out of order, a tie by value (``u02``, ``u2``), a tie between two
    providers, machines without a provider id, the tag filter: every page size pages
    through the same order, each machine once; a cursor of one order is refused by the
    other."""
    named = seed_rack_names(session, unnamed=3)
    expected = rack_order(named)
    for limit in (1, 2, 4, 9, 10):
        seen, pages = all_pages(db, limit=limit, sort="name")
        assert seen == expected and pages == -(-len(expected) // limit), limit
    provided, _ = all_pages(db, limit=2, sort="name", tags=("Provided",))
    assert provided == [m for m in expected if named[m] is not None]
    first = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(limit=2, sort="name")))
    assert first.next_cursor is not None
    with pytest.raises(operations.BadArgument, match="not a page cursor"):
        operations.machine_filter(after=first.next_cursor)
    created = db.read(lambda tx: inspection.list_machines(tx, MachineFilter(limit=2)))
    assert created.next_cursor is not None
    with pytest.raises(operations.BadArgument, match="not a page cursor"):
        operations.machine_filter(after=created.next_cursor, sort="name")


@pytest.mark.parametrize(("arguments", "error"), [
    ({"health": "happy"}, "unknown health 'happy'"), ({"held": "jail"}, "unknown hold 'jail'"),
    ({"sort": "size"}, "unknown order 'size'")])
def test_unknown_health_holds_and_orders_are_refused(arguments, error: str) -> None:
    with pytest.raises(operations.BadArgument, match=error):
        operations.machine_filter(**arguments)
    assert operations.machine_filter(health=" Silent ", held="ANY", sort="Name") == MachineFilter(
        health="silent", held="any", sort="name")


def test_heartbeating_with_a_provider_is_counted_up_to_the_bound(db, session, monkeypatch):
    """Heartbeating alone is counted by the counters; with a provider filter, a walk up
    to ``EXACT_UP_TO`` (then, on PostgreSQL, the planner's estimate), as a provider
    filter alone is."""
    fleet = seed_health_fleet(session)
    heartbeating = MachineFilter(health="heartbeating", provider="test")
    found = db.read(lambda tx: inspection.list_machines(tx, heartbeating, db.thresholds))
    assert (found.matched, found.matched_estimated) == (2, False)
    assert {m.id for m in found.machines} == fleet.expected["heartbeating"]
    monkeypatch.setattr(inspection, "EXACT_UP_TO", 1)
    found = db.read(lambda tx: inspection.list_machines(tx, heartbeating, db.thresholds))
    if db.engine.dialect.name == "postgresql":
        assert found.matched_estimated and found.matched >= 2
    else:  # SQLite fleets are one host's: always counted
        assert (found.matched, found.matched_estimated) == (2, False)
