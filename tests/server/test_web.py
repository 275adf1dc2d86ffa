"""The operator's web view, loaded in a real headless Chromium from the distribution.

The server runs in-process on loopback with a seeded BMDB; Chromium renders each page
and dumps the DOM, which the tests read with the standard library's HTML parser.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import requests
import sqlalchemy as sa

import bmdb
from shepherd.config import Settings
from shepherd.runtime import Runtime
from shepherd.server import RunningServer, ServeOptions, serve, start_server
from shepherd.server.options import COMPONENT
from shepherd.server.web import HEALTH_TTL
from shepherd.workflows.guard import GuardLimits
from tests.support.bmdb_helpers import (
    claim_for,
    rack_order,
    seed_health_fleet,
    seed_rack_names,
)
from tests.support.chromium import BROWSER_FLAGS, Devtools
from tests.support.operator_fixtures import Fleet, seed_fleet
from tests.support.servers import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
                  "source", "track", "wbr"})






def loopback(url: str, **settings: Any) -> Settings:
    """A server's settings: this BMDB, any free port on loopback, and ``settings``."""
    return Settings(bmdb_url=url, serve_listen="127.0.0.1:0", **settings)


def serve_guarded(db: bmdb.BMDB, url: str, guard: GuardLimits) -> RunningServer:
    """A server whose web view and metrics use ``guard``, whatever the settings say."""
    settings = loopback(url)
    options = dataclasses.replace(ServeOptions.from_settings(settings), guard=guard)
    return start_server(Runtime(settings, COMPONENT, db=db), options)


@pytest.fixture
def web(sqlite_url: str) -> Iterator[tuple[RunningServer, bmdb.BMDB, Fleet]]:
    db = bmdb.connect(sqlite_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    with db.start_session("test", interval=30) as session:
        fleet = seed_fleet(db, session)
        with serve(loopback(sqlite_url), db=db) as server:
            yield server, db, fleet
    db.close()


@pytest.fixture
def browse(chromium: str, tmp_path: Path):
    def load(url: str) -> Page:
        result = subprocess.run(
            [chromium, *BROWSER_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
             "--dump-dom", url],
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return Page.parse(result.stdout)

    return load


class Page(HTMLParser):
    """Rows (``tr``) with their attributes and text, the classes of each row's cells,
    and the text of elements with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[dict[str, str], str]] = []
        #: Per row (in ``rows``' order), the ``class`` of each of its ``td`` cells.
        self.cell_classes: list[list[str]] = []
        self._cells: list[str] = []
        self.by_id: dict[str, str] = {}
        #: The attributes of each element with an id (links' ``href``).
        self.attributes_by_id: dict[str, dict[str, str]] = {}
        self.title = ""
        self._row: tuple[dict[str, str], list[str]] | None = None
        self._ids: list[list] = []  # [tag, id, text parts, depth of that tag]
        self._in_title = False
        self.text_parts: list[str] = []
        #: Every element's tag name seen (a ``script`` here would be an injected one).
        self.start_tags: set[str] = set()
        #: Every attribute name seen (an ``onmouseover`` here would be an injected one).
        self.attribute_names: set[str] = set()
        #: The attributes of every link, and the hidden inputs (name -> value).
        self.anchors: list[dict[str, str]] = []
        self.hidden_inputs: dict[str, str] = {}

    @classmethod
    def parse(cls, html: str) -> Page:
        page = cls()
        page.feed(html)
        return page

    @property
    def text(self) -> str:
        return " ".join(self.text_parts)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        self.start_tags.add(tag)
        self.attribute_names.update(attributes)
        if tag == "a":
            self.anchors.append(attributes)
        if tag == "input" and attributes.get("type") == "hidden":
            self.hidden_inputs[attributes.get("name", "")] = attributes.get("value", "")
        if tag == "tr":
            self._row, self._cells = (attributes, []), []
        if tag == "td" and self._row is not None:
            self._cells.append(attributes.get("class", ""))
        if tag in VOID:
            if "id" in attributes:
                self.attributes_by_id[attributes["id"]] = attributes
            return
        for open_ in self._ids:
            if open_[0] == tag:
                open_[3] += 1
        if "id" in attributes:
            self.attributes_by_id[attributes["id"]] = attributes
            self._ids.append([tag, attributes["id"], [], 1])
        self._in_title = tag == "title"

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._row is not None:
            self.rows.append((self._row[0], " ".join(" ".join(self._row[1]).split())))
            self.cell_classes.append(self._cells)
            self._row = None
        for open_ in list(self._ids):
            if open_[0] == tag:
                open_[3] -= 1
                if open_[3] == 0:
                    self._ids.remove(open_)
                    self.by_id[open_[1]] = " ".join(" ".join(open_[2]).split())
        self._in_title = False

    def handle_data(self, data: str) -> None:
        self.text_parts.append(data)
        if self._in_title:
            self.title += data
        if self._row is not None:
            self._row[1].append(data)
        for open_ in self._ids:
            open_[2].append(data)

    def rows_with(self, attribute: str) -> list[tuple[dict[str, str], str]]:
        return [(a, t) for a, t in self.rows if attribute in a]

    def classes_of(self, attribute: str, value: str) -> list[str]:
        """The cell classes of the row whose ``attribute`` is ``value``."""
        (found,) = [c for (a, _), c in zip(self.rows, self.cell_classes, strict=True)
                    if a.get(attribute) == value]
        return found


def test_machines_page_shows_tags_counts_and_filters(web, browse) -> None:
    server, _, fleet = web
    page = browse(f"{server.url}/")  # redirects to /machines
    assert page.title.startswith("Machines")
    rows = {a["data-machine"]: t for a, t in page.rows_with("data-machine")}
    assert set(rows) == {str(m) for m in fleet.all}
    assert "AgentStart" in rows[str(fleet.busy)]
    assert "Stopped" in rows[str(fleet.stopped)]
    counts = page.by_id["tag-counts"]
    for expected in ("machines 9", "Provided 9", "AgentStarted 5", "AgentHeartbeat 2",
                     "HardwareReport 0"):
        assert expected in counts

    filtered = browse(f"{server.url}/machines?tag=AgentStarted&without=AgentHeartbeat")
    assert {a["data-machine"] for a, _ in filtered.rows_with("data-machine")} == {
        str(fleet.silent), str(fleet.orphaned), str(fleet.fresh_agent)}
    assert filtered.by_id["matched"].startswith("3 matching")
    backing_off = browse(f"{server.url}/machines?backoff=any")
    assert [a["data-machine"] for a, _ in backing_off.rows_with("data-machine")] == [
        str(fleet.backing_off)]
    held = browse(f"{server.url}/machines?work=recovery")
    assert [a["data-machine"] for a, _ in held.rows_with("data-machine")] == [
        str(fleet.orphaned)]


def test_machines_pages_follow_the_next_link_and_refuse_bad_pages(web, browse) -> None:
    server, _, fleet = web
    seen: list[str] = []
    url: str | None = f"{server.url}/machines?tag=Provided&limit=4"
    pages = 0
    while url:
        page = browse(url)
        seen += [a["data-machine"] for a, _ in page.rows_with("data-machine")]
        following = page.attributes_by_id.get("next-page")
        url = f"{server.url}{following['href']}" if following else None
        pages += 1
        assert pages <= 3
    assert sorted(seen) == sorted(str(m) for m in fleet.all) and len(seen) == len(set(seen))
    assert pages == 3 and "9 matching, showing 1 on this page" in page.by_id["matched"]
    assert "first-page" in page.attributes_by_id
    for query, error in (("limit=100000", "limit must be from 1 to 1000"),
                         ("limit=ten", "limit must be a whole number"),
                         ("after=bm9wZQ", "is not a page cursor")):
        answer = requests.get(f"{server.url}/machines?{query}", timeout=10)
        assert answer.status_code == 400 and error in answer.text


def test_machine_page_shows_work_backoffs_and_history(web, browse) -> None:
    server, db, fleet = web
    healthy = browse(f"{server.url}/machines/{fleet.healthy}")
    assert healthy.by_id["machine-id"] == str(fleet.healthy)
    assert {a["data-tag"] for a, _ in healthy.rows_with("data-tag")} == {
        "Provided", "AgentStarted", "AgentHeartbeat"}
    (backoff,) = healthy.rows_with("data-backoff")
    assert backoff[0]["class"] == "expired" and "expired" in backoff[1]
    assert "reboot: API 500" in backoff[1]
    assert [a["data-event"] for a, _ in healthy.rows_with("data-event")] == ["Failed", "Started"]

    orphaned = browse(f"{server.url}/machines/{fleet.orphaned}")
    (work,) = orphaned.rows_with("data-work")
    assert str(fleet.dead_session) in work[1] and "dead" in work[1]
    explain = {a["data-explain"]: t for a, t in orphaned.rows_with("data-explain")}
    assert "held by work" in explain["ShepherdRecovery"]
    assert "PAUSED" in explain["ShepherdRecovery"]

    busy = browse(f"{server.url}/machines/{fleet.backing_off}")
    ((attributes, active),) = busy.rows_with("data-backoff")
    assert attributes["class"] == "active"
    assert "active, ends in" in active and "ssh: connection refused" in active

    # The history of a machine with more events is newest first.
    session = db.start_session("more", interval=30)
    try:
        work = session.claim_machine(bmdb.Process.AGENT_START, fleet.new)
        work.finish(lambda tx: bmdb.set_agent_started(tx, fleet.new, b"\x03" * 32))
    finally:
        session.close()
    new = browse(f"{server.url}/machines/{fleet.new}")
    assert [a["data-event"] for a, _ in new.rows_with("data-event")] == ["Finished", "Started"]


def test_a_paused_recovery_is_not_shown_as_claimable(web, browse) -> None:
    """The guard pauses Recovery (3 of 5 started agents silent): a silent machine in the
    backlog is not claimable now, and its state is not green."""
    server, _, fleet = web
    silent = browse(f"{server.url}/machines/{fleet.silent}")
    explain = {a["data-explain"]: t for a, t in silent.rows_with("data-explain")}
    assert "PAUSED by the guard" in explain["ShepherdRecovery"]
    assert "claimable" not in explain["ShepherdRecovery"]
    assert "claimable" not in silent.classes_of("data-explain", "ShepherdRecovery")
    assert "blocked" in silent.classes_of("data-explain", "ShepherdRecovery")
    new = browse(f"{server.url}/machines/{fleet.new}")  # what green is for
    assert "claimable" in new.classes_of("data-explain", "ShepherdAgentStart")
    assert new.by_id["state"] == "not held: in the backlog of ShepherdAgentStart"


def test_a_healthy_machine_says_it_is_in_no_backlog_and_nothing_is_orange(web, browse
                                                                         ) -> None:
    """The verdict agrees with the table below it: no backlog, and a process with
    nothing to do is shown plainly, not as blocked."""
    server, _, fleet = web
    healthy = browse(f"{server.url}/machines/{fleet.healthy}")
    assert healthy.by_id["state"] == "not held: in no workflow's backlog, nothing to do"
    processes = [attributes["data-explain"] for attributes, _ in
                 healthy.rows_with("data-explain")]
    assert processes and all("not in backlog" in text for _, text in
                             healthy.rows_with("data-explain"))
    for process in processes:
        assert "idle" in healthy.classes_of("data-explain", process)
        assert "blocked" not in healthy.classes_of("data-explain", process)


def settings_from_env(url: str, port: int = 0) -> Settings:
    """The settings ``shepherd serve`` reads (``Settings`` is the only reader of the
    environment), on this test's BMDB and a loopback port."""
    return dataclasses.replace(Settings.from_env(), bmdb_url=url,
                               serve_listen=f"127.0.0.1:{port}")


def test_the_machine_page_asks_the_callback_server_like_the_guard(
        sqlite_url: str, browse, monkeypatch) -> None:
    """The whole guard, as a worker asks it: with the share allowed, an unreachable
    callback server alone pauses Recovery on the page; a healthy one does not."""
    db = bmdb.connect(sqlite_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    monkeypatch.setenv("SHEPHERD_RECOVERY_MAX_SHARE", "1.0")
    with db.start_session("test", interval=30) as session:
        fleet = seed_fleet(db, session)
        monkeypatch.setenv("SHEPHERD_CALLBACK_URL", f"http://127.0.0.1:{free_port()}")
        with serve(settings_from_env(sqlite_url), db=db) as server:
            page = browse(f"{server.url}/machines/{fleet.silent}")
        explain = {a["data-explain"]: t for a, t in page.rows_with("data-explain")}
        assert "PAUSED" in explain["ShepherdRecovery"]
        assert "callback server" in explain["ShepherdRecovery"]
        port = free_port()
        monkeypatch.setenv("SHEPHERD_CALLBACK_URL", f"http://127.0.0.1:{port}")
        with serve(settings_from_env(sqlite_url, port), db=db) as server:
            page = browse(f"{server.url}/machines/{fleet.silent}")  # its own /healthz: 200
        assert "claimable" in page.classes_of("data-explain", "ShepherdRecovery")
    db.close()


def test_holds_gone_machines_and_refusals_are_shown(web, browse) -> None:
    """Maintenance and quarantine on the list and the machine page (with who, why and
    the command that lifts them), a machine the provider stopped listing as gone, and a
    reconcile refusal with its advice above the list."""
    server, db, fleet = web

    def changes(tx: bmdb.Tx) -> None:
        bmdb.put_hold(tx, fleet.new, bmdb.MAINTENANCE, "replacing a DIMM", "alice")
        bmdb.put_hold(tx, fleet.silent, bmdb.QUARANTINE,
                       "the reboot ladder was exhausted 3 times in a row", "shepherd recovery")
        bmdb.set_provider_status(tx, [fleet.stopped], bmdb.ProviderStatus.MISSING)
        bmdb.record_refusal(tx, "equinix", "FLEET MISMATCH: 2 at the provider but not in "
                                            "the BMDB; set SHEPHERD_ASSIMILATE=true")

    db.read(changes)
    page = browse(f"{server.url}/machines")
    rows = {a["data-machine"]: t for a, t in page.rows_with("data-machine")}
    assert rows[str(fleet.new)].endswith("maintenance")
    assert rows[str(fleet.silent)].endswith("quarantine")
    assert rows[str(fleet.healthy)].endswith("—")
    assert "gone (no longer listed by test)" in rows[str(fleet.stopped)]
    assert "gone" in page.classes_of("data-machine", str(fleet.stopped))[3]
    counts = page.by_id["tag-counts"]
    assert "maintenance 1" in counts and "quarantine 1" in counts
    refusal = page.by_id["refusal-equinix"]
    assert refusal.startswith("RECONCILE REFUSING : reconcile of equinix REFUSING since")
    assert refusal.endswith("set SHEPHERD_ASSIMILATE=true")

    held = browse(f"{server.url}/machines/{fleet.new}")
    hold = held.by_id["hold-maintenance"]
    assert hold.startswith("HELD : in maintenance since")
    assert "because replacing a DIMM (by alice)" in hold
    assert f"shepherd maintenance off {fleet.new} lets it back" in hold
    explain = {a["data-explain"]: t for a, t in held.rows_with("data-explain")}
    assert "not in backlog: in maintenance since" in explain["ShepherdAgentStart"]
    assert "held machines are in no backlog" in explain["ShepherdAgentStart"]
    assert held.by_id["host-key"].startswith("none recorded")
    quarantined = browse(f"{server.url}/machines/{fleet.silent}").by_id["hold-quarantine"]
    assert "quarantined since" in quarantined and "(by shepherd recovery)" in quarantined
    assert f"shepherd quarantine clear {fleet.silent}" in quarantined
    gone = browse(f"{server.url}/machines/{fleet.stopped}")
    assert gone.by_id["gone"] == "gone (no longer listed by test): left alone, never deleted"


def test_a_machine_page_is_found_by_a_uuid_prefix(web) -> None:
    server, _, fleet = web
    answer = requests.get(f"{server.url}/machines/{fleet.healthy.hex[:10]}", timeout=10)
    assert answer.status_code == 200 and str(fleet.healthy) in answer.text


def test_unknown_and_malformed_machines_get_a_404_page(web, browse) -> None:
    server, _, _ = web
    missing = "00000000-0000-4000-8000-000000000000"
    page = browse(f"{server.url}/machines/{missing}")
    assert page.by_id["error"] == f"no machine {missing} in the BMDB"
    assert requests.get(f"{server.url}/machines/{missing}", timeout=10).status_code == 404
    page = browse(f"{server.url}/machines/not-a-uuid")
    assert page.by_id["error"].startswith("no machine named 'not-a-uuid'")
    answer = requests.get(f"{server.url}/machines?work=dance", timeout=10)
    assert answer.status_code == 400 and "unknown process" in answer.text


def test_sessions_page(web, browse) -> None:
    server, _, fleet = web
    page = browse(f"{server.url}/sessions")
    sessions = {a["data-session"]: (a["data-alive"], t) for a, t in page.rows_with("data-session")}
    assert sessions[str(fleet.dead_session)][0] == "no"
    assert "doomed-worker" in sessions[str(fleet.dead_session)][1]
    assert any(alive == "yes" and "test" in text for alive, text in sessions.values())


def test_the_web_view_can_have_a_listener_of_its_own(sqlite_url: str) -> None:
    """Agents reach one socket, operators another: the fleet inventory is only on theirs."""
    settings = loopback(sqlite_url, serve_operator_listen=f"127.0.0.1:{free_port()}")
    with serve(settings) as server:
        assert server.operator_url and server.operator_url != server.url
        assert requests.get(f"{server.url}/machines", timeout=10).status_code == 404
        assert requests.get(f"{server.operator_url}/machines", timeout=10).status_code == 200
        heartbeat = "/agent/v1/heartbeat"
        assert requests.post(f"{server.operator_url}{heartbeat}", timeout=10).status_code == 404
        assert requests.post(f"{server.url}{heartbeat}", timeout=10).status_code == 401
        for url in (server.url, server.operator_url):
            assert requests.get(f"{url}/healthz", timeout=10).status_code == 200
        # The fleet's metrics are operators' data too.
        assert requests.get(f"{server.url}/metrics", timeout=10).status_code == 404
        assert requests.get(f"{server.operator_url}/metrics", timeout=10).status_code == 200
        assert server.metrics_url == f"{server.operator_url}/metrics"


def test_agents_listener_off_loopback_keeps_only_heartbeats_and_healthz(sqlite_url: str
                                                                        ) -> None:
    """Bound where machines reach it, with no operator listener: no view, no metrics
    (and a warning says where they should go); heartbeats and /healthz stay."""
    with serve(Settings(bmdb_url=sqlite_url, serve_listen="0.0.0.0:0")) as server:
        local = f"http://127.0.0.1:{server.port}"
        assert server.operator_url is None and server.metrics_url is None
        for path in ("/machines", "/metrics", "/sessions", "/"):
            assert requests.get(f"{local}{path}", timeout=10).status_code == 404, path
        assert requests.get(f"{local}/healthz", timeout=10).status_code == 200
        assert requests.post(f"{local}/agent/v1/heartbeat", timeout=10).status_code == 401


def test_with_the_view_off_the_operator_listener_still_serves_metrics(sqlite_url: str
                                                                       ) -> None:
    settings = loopback(sqlite_url, serve_operator_views=False,
                        serve_operator_listen=f"127.0.0.1:{free_port()}")
    with serve(settings) as server:
        assert server.operator_url is None and server.metrics_url is not None
        operators = server.metrics_url.removesuffix("/metrics")
        assert requests.get(f"{operators}/machines", timeout=10).status_code == 404
        assert requests.get(server.metrics_url, timeout=10).status_code == 200
        assert requests.get(f"{server.url}/metrics", timeout=10).status_code == 404


@pytest.mark.parametrize(("host", "operator_listen", "expected"), [
    ("127.0.0.1", None, True), ("::1", None, True), ("localhost", None, True),
    ("0.0.0.0", None, False), ("10.1.2.3", None, False), ("::", None, False),
    ("127.0.0.1", ("127.0.0.1", 8471), False),
])
def test_the_agents_listener_serves_the_view_only_on_loopback(
        sqlite_url: str, host: str, operator_listen, expected: bool) -> None:
    from shepherd.server.serve import views_on_agent_listener

    options = dataclasses.replace(ServeOptions.from_settings(loopback(sqlite_url)),
                                  listen=(host, 8470), operator_listen=operator_listen)
    assert views_on_agent_listener(options) is expected


def test_operator_views_can_be_turned_off(sqlite_url: str) -> None:
    with serve(loopback(sqlite_url, serve_operator_views=False)) as server:
        assert requests.get(f"{server.url}/machines", timeout=10).status_code == 404
        assert requests.get(f"{server.url}/metrics", timeout=10).status_code == 200


@pytest.mark.timeout(120)
def test_pages_stuck_in_the_bmdb_never_hold_up_the_event_loop(pg_url: str) -> None:
    """Eight page loads (twice the view's threads) stuck behind a lock on the machines
    table: /healthz and the stylesheet, served by the same event loop, still answer at
    once, and the pages answer once the lock goes."""
    db = bmdb.connect(pg_url)
    with db.start_session("test", interval=30) as session:
        seed_fleet(db, session)
    locker = sa.create_engine(pg_url)
    with serve(loopback(pg_url), db=db) as server, locker.connect() as conn, \
            ThreadPoolExecutor(8) as pool:
        conn.begin()
        conn.exec_driver_sql("LOCK TABLE machines IN ACCESS EXCLUSIVE MODE")
        pages = [pool.submit(requests.get, f"{server.url}/machines", timeout=60)
                 for _ in range(8)]
        # pg_locks, not the statement's text: pg_stat_activity cuts a long query short.
        waiting = sa.text("SELECT count(*) FROM pg_locks "
                          "WHERE NOT granted AND relation = 'machines'::regclass")
        with locker.connect().execution_options(isolation_level="AUTOCOMMIT") as watcher:
            wait_until(lambda: watcher.execute(waiting).scalar(),
                       timeout=30, what="a page to wait for the lock")
        for path in ("/healthz", "/web-static/shepherd.css"):
            assert requests.get(f"{server.url}{path}", timeout=5).status_code == 200, path
        conn.rollback()
        assert [page.result(timeout=60).status_code for page in pages] == [200] * 8
    locker.dispose()
    db.close()


# -- operator comfort: columns, hardware tables, provider, refresh, banner, CSP ----------

CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")
def test_the_devtools_harness_sees_a_violation_and_a_style(devtools: Devtools) -> None:
    """The check below can fail: a page whose policy refuses its inline style reports
    the violation, and the style does not apply."""
    devtools.load("data:text/html,<meta http-equiv='Content-Security-Policy' "
                  "content=\"style-src 'self'\"><header style='color: red'>x</header>")
    assert any("style-src" in v for v in devtools.violations())
    assert devtools.style("header", "color") == "rgb(0, 0, 0)"
    devtools.load("data:text/html,<header style='color: red'>x</header>")
    assert devtools.violations() == [] and devtools.style("header", "color") == "rgb(255, 0, 0)"


def test_every_answer_carries_the_security_headers(web) -> None:
    server, _, fleet = web
    for path, status in (("/machines", 200), (f"/machines/{fleet.healthy}", 200),
                         ("/sessions", 200), ("/machines?limit=ten", 400),
                         ("/machines/not-a-uuid", 404), ("/no-such-page", 404),
                         ("/machines?refresh=2", 400), ("/web-static/shepherd.css", 200)):
        answer = requests.get(f"{server.url}{path}", timeout=10)
        assert answer.status_code == status, path
        assert answer.headers["Content-Security-Policy"] == CSP, path
        assert answer.headers["X-Content-Type-Options"] == "nosniff", path
        assert answer.headers["Referrer-Policy"] == "same-origin", path
    css = requests.get(f"{server.url}/web-static/shepherd.css", timeout=10)
    assert css.headers["Content-Type"].startswith("text/css")  # nosniff refuses others


def test_pages_render_under_the_policy_with_their_styles(web, devtools: Devtools) -> None:
    """Under the CSP, in Chromium: no violation on any page (error pages included),
    the stylesheet is applied (the header's colours, a late heartbeat's red), and
    no page has an inline style or script the policy would refuse."""
    server, db, fleet = web
    db.read(lambda tx: bmdb.put_hold(tx, fleet.new, bmdb.MAINTENANCE, "DIMM", "alice"))
    for path in ("/machines", "/machines?refresh=30", f"/machines/{fleet.quiet}",
                 f"/machines/{fleet.new}", "/sessions", "/machines?limit=ten",
                 "/machines/not-a-uuid"):
        devtools.load(f"{server.url}{path}")
        assert devtools.violations() == [], path
        assert devtools.style("header", "background-color") == "rgb(29, 35, 48)", path
        assert devtools.style("body", "font-size") == "14px", path
        assert devtools.evaluate("document.querySelectorAll('[style], style, script')"
                                 ".length") == 0, path
    devtools.load(f"{server.url}/machines")
    late = f"tr[data-machine='{fleet.quiet}'] td.heartbeat"
    assert devtools.style(late, "color") == "rgb(179, 38, 30)"
    assert devtools.style("#problems .banner", "background-color") == "rgb(253, 236, 234)"
    held = f"tr[data-machine='{fleet.new}'] td.held .badge"
    assert devtools.style(held, "color") == "rgb(161, 75, 0)"


def _cells(page: Page, machine: object) -> dict[str, str]:
    """The list's cells of one machine, by class (first class word)."""
    return {c.split()[0]: c for c in page.classes_of("data-machine", str(machine)) if c}


def test_the_list_shows_hostname_heartbeat_age_and_power(web, browse) -> None:
    """Heartbeat age, late past the BMDB's thresholds (30 s, first 60 s); the hostname
    from the stored report; the power last recorded, else "—" (the "test" provider's
    status says nothing of power)."""
    server, db, fleet = web

    def seed(tx: bmdb.Tx) -> None:
        bmdb.set_hardware_report(tx, fleet.healthy, {"hostname": "rack1-u07",
                                                          "cpu": {"cores": 8}})
        bmdb.set_hardware_report(tx, fleet.quiet, {"hostname": ["not", "a", "name"]})
        bmdb.record_power_observed(tx, fleet.healthy, "On", "redfish http://bmc")
        bmdb.record_power_observed(tx, fleet.silent, "Off", "redfish http://bmc")

    db.read(seed)
    page = browse(f"{server.url}/machines")
    rows = {a["data-machine"]: t for a, t in page.rows_with("data-machine")}
    assert "rack1-u07" in rows[str(fleet.healthy)]
    assert "On · " in rows[str(fleet.healthy)] and "s ago" in rows[str(fleet.healthy)]
    assert "Off · " in rows[str(fleet.silent)]
    assert "none since start 2h" in rows[str(fleet.silent)]
    assert "10m" in rows[str(fleet.quiet)] and "not" not in rows[str(fleet.quiet)]
    healthy, quiet = _cells(page, fleet.healthy), _cells(page, fleet.quiet)
    silent, fresh = _cells(page, fleet.silent), _cells(page, fleet.fresh_agent)
    assert "late" not in healthy["heartbeat"] and "late" in quiet["heartbeat"]
    assert "late" in silent["heartbeat"] and "late" not in fresh["heartbeat"]
    assert "observed" in healthy["power"] and "late" not in healthy["power"]
    assert "observed" in silent["power"] and "late" in silent["power"]
    assert _cells(page, fleet.new)["power"] == "power none"
    assert _cells(page, fleet.new)["heartbeat"] == "heartbeat"

    detail = browse(f"{server.url}/machines/{fleet.healthy}")
    assert detail.by_id["hostname"] == "rack1-u07"
    assert detail.by_id["power"].startswith("On · ")
    assert "read from redfish http://bmc" in detail.by_id["power"]
    assert re.fullmatch(r"\d+s ago \(last heartbeat \S+; late after 30s\)",
                        detail.by_id["heartbeat"]), detail.by_id["heartbeat"]
    silent_page = browse(f"{server.url}/machines/{fleet.silent}")
    assert silent_page.by_id["heartbeat"].startswith("none since start 2h")
    assert "late" in silent_page.attributes_by_id["heartbeat"]["class"]


def test_what_the_sync_found_wrong_with_a_bmc_is_in_the_power_cell(web, browse) -> None:
    """A BMC the sync found unreachable, one whose system is Critical, and one that says
    Off while the agent heartbeats: each marked late in the list's power cell with a
    few words; the machine page tells the whole story. A healthy BMC adds nothing."""
    server, db, fleet = web
    down, critical, off = fleet.silent, fleet.quiet, fleet.fresh_agent

    def seed(tx: bmdb.Tx) -> None:
        machines = (fleet.healthy, down, critical, off)
        bmdb.enroll_bmcs(tx, {machine: 0 for machine in machines})
        for machine in machines:
            bmdb.record_power_observed(tx, machine, "Off" if machine == off else "On",
                                       "redfish http://bmc")
        ok = bmdb.BmcReading("answering", 0.05, "redfish http://bmc", health="OK",
                             health_detail="Status.Health OK")
        bmdb.record_bmc_reading(tx, fleet.healthy, ok)
        bmdb.record_bmc_reading(tx, down, ok)
        bmdb.record_bmc_reading(tx, down, bmdb.BmcReading(
            "unreachable", 0.0, "redfish http://bmc", problem="BmcUnreachable: no answer"))
        bmdb.record_bmc_reading(tx, critical, bmdb.BmcReading(
            "answering", 0.05, "redfish http://bmc", health="Critical",
            health_detail="Status.Health Critical, State Enabled"))
        bmdb.record_bmc_reading(tx, off, bmdb.BmcReading(
            "answering", 0.05, "redfish http://bmc", health="OK", health_detail="OK",
            contradiction="the BMC says Off, but the agent heartbeated at <script>"))

    db.read(seed)
    page = browse(f"{server.url}/machines")
    rows = {a["data-machine"]: t for a, t in page.rows_with("data-machine")}
    assert "BMC" not in rows[str(fleet.healthy)]
    assert "late" not in _cells(page, fleet.healthy)["power"]
    for machine, words in ((down, "BMC unreachable"), (critical, "Critical"),
                           (off, "contradicts the agent")):
        assert words in rows[str(machine)], rows[str(machine)]
        assert "late" in _cells(page, machine)["power"]
    detail = browse(f"{server.url}/machines/{down}")
    assert "BMC unreachable since" in detail.by_id["power"]
    assert "BmcUnreachable: no answer" in detail.by_id["power"]
    assert "health OK (Status.Health OK), read" in detail.by_id["power"]
    flagged = browse(f"{server.url}/machines/{off}")
    assert "the agent heartbeated at <script>" in flagged.by_id["power"]


def test_simulated_and_api_machines_name_their_provider_and_its_power(web, browse) -> None:
    """The provider the BMDB records, the simulator marked as such; without a reading,
    an API provider's device state stands in, marked "(provider)"."""
    server, db, _ = web

    def seed(tx: bmdb.Tx) -> tuple:
        made = []
        for provider, status in (("simulator", "Running"), ("equinix", "Stopped")):
            machine = bmdb.create_machine(tx)
            bmdb.upsert_provided(tx, machine, provider=provider,
                                      provider_id=f"{provider}-1", provider_status=status,
                                      address="127.0.0.1")
            made.append(machine)
        return tuple(made)

    simulated, equinix = db.read(seed)
    page = browse(f"{server.url}/machines")
    rows = {a["data-machine"]: t for a, t in page.rows_with("data-machine")}
    assert rows[str(simulated)].split()[1:3] == ["simulator", "simulated"]
    assert "On (provider)" in rows[str(simulated)]
    assert rows[str(equinix)].split()[1] == "equinix" and "simulated" not in rows[str(equinix)]
    assert "Off (provider)" in rows[str(equinix)]
    assert _cells(page, equinix)["power"] == "power by-provider late"
    assert _cells(page, simulated)["power"] == "power by-provider"
    detail = browse(f"{server.url}/machines/{simulated}")
    assert detail.by_id["provider"] == "simulator simulated"
    assert detail.by_id["power"].startswith("On (provider)")


HOSTILE = "<script>document.title='owned'</script><img src=x onerror=alert(1)>"


def test_the_hardware_report_is_tables_and_hostile_text_stays_text(web, browse) -> None:
    server, db, fleet = web
    report = {
        "hostname": HOSTILE,
        "cpu": {"model": f"Xeon {HOSTILE}", "cores": 8, "threads": 16, "microcode": "0xb4"},
        "memory_bytes": 17179869184,
        "block_devices": [{"name": "nvme0n1", "size_bytes": 1024 ** 4},
                          {"name": "sda", "size_bytes": 512, "rotational": True}],
        "network_interfaces": [{"name": "eth0", "mac": "52:54:00:12:34:56"}],
        "warnings": ["cpu: no physical id/core id in /proc/cpuinfo"],
        "gpu": {"vendor": "nvidia", "count": 2},
        "tpm": "2.0",
        HOSTILE: "a key too",
    }
    db.read(lambda tx: bmdb.set_hardware_report(tx, fleet.healthy, report))
    page = browse(f"{server.url}/machines/{fleet.healthy}")
    assert page.title.startswith("Machine")  # the injected script never ran
    assert page.by_id["hardware-cpu-title"] == "CPU"
    cpu = page.by_id["hardware-cpu"]
    assert "Model Xeon <script>" in cpu and "Cores 8" in cpu and "Threads 16" in cpu
    assert "microcode 0xb4" in cpu  # an extra field, still shown
    disks = [t for a, t in page.rows_with("data-row") if a["data-row"] == "block_devices"]
    assert disks == ["nvme0n1 1024.0 GiB (1099511627776 bytes) —",
                     "sda 0.0 GiB (512 bytes) yes"]
    assert page.by_id["hardware-block_devices"].startswith("Name Size rotational")
    nics = page.by_id["hardware-network_interfaces"]
    assert nics == "Name MAC eth0 52:54:00:12:34:56"
    summary = page.by_id["hardware-summary"]
    assert "Memory 16.0 GiB (17179869184 bytes)" in summary and "tpm 2.0" in summary
    assert f"{HOSTILE} a key too" in summary and f"Hostname {HOSTILE}" in summary
    assert "vendor nvidia" in page.by_id["hardware-gpu"]
    assert page.by_id["hardware-warnings"] == "cpu: no physical id/core id in /proc/cpuinfo"
    assert page.by_id["hostname"] == HOSTILE
    assert "script" not in page.start_tags and "img" not in page.start_tags
    assert "HardwareReport" in {a["data-tag"] for a, _ in page.rows_with("data-tag")}
    # A provider's words reach the list too: its device id and address.
    hostile_provider = db.read(lambda tx: bmdb.create_machine(tx))
    db.read(lambda tx: bmdb.upsert_provided(
        tx, hostile_provider, provider="equinix", provider_id=f'x" onmouseover="{HOSTILE}',
        provider_status="Running", address=HOSTILE))
    list_page = browse(f"{server.url}/machines")
    assert "script" not in list_page.start_tags and "img" not in list_page.start_tags
    rows = {a["data-machine"]: t for a, t in list_page.rows_with("data-machine")}
    assert HOSTILE in rows[str(fleet.healthy)]
    assert rows[str(hostile_provider)].count(HOSTILE) >= 2, rows[str(hostile_provider)]
    assert f'x" onmouseover="{HOSTILE}' in rows[str(hostile_provider)]
    assert "onmouseover" not in list_page.attribute_names


def test_a_report_that_is_not_an_object_is_shown_not_failed(web, browse) -> None:
    server, db, fleet = web
    db.read(lambda tx: bmdb.set_hardware_report(tx, fleet.quiet, {}))
    page = browse(f"{server.url}/machines/{fleet.quiet}")
    assert "hardware" in page.by_id and page.by_id["hostname"] == "—"


def test_auto_refresh_is_bounded_and_kept_across_links(web, browse) -> None:
    server, _, fleet = web
    page = browse(f"{server.url}/machines?tag=Provided&limit=4&refresh=30")
    assert page.attributes_by_id["auto-refresh"]["content"] == "30"
    assert page.attributes_by_id["auto-refresh"]["http-equiv"] == "refresh"
    assert "refresh=30" in page.attributes_by_id["next-page"]["href"]
    links = [a.get("href", "") for a in page.anchors]
    machine_links = [h for h in links if h.startswith("/machines/")]
    assert machine_links and all(h.endswith("?refresh=30") for h in machine_links)
    assert page.attributes_by_id["refresh-off"]["href"] == "/machines?tag=Provided&limit=4"
    assert page.attributes_by_id["refresh-10"]["href"] == (
        "/machines?tag=Provided&limit=4&refresh=10")
    assert page.hidden_inputs == {"refresh": "30"}
    following = browse(server.url + page.attributes_by_id["next-page"]["href"])
    assert following.attributes_by_id["auto-refresh"]["content"] == "30"
    assert "refresh=30" in following.attributes_by_id["first-page"]["href"]
    detail = browse(f"{server.url}{machine_links[0]}")
    assert detail.attributes_by_id["auto-refresh"]["content"] == "30"
    plain = browse(f"{server.url}/machines")
    assert "auto-refresh" not in plain.attributes_by_id and plain.hidden_inputs == {}
    assert "class" in plain.attributes_by_id["refresh-off"]  # off is the current choice
    for bad in ("4", "3601", "ten", "-5", "1e3", "٣٠"):
        answer = requests.get(f"{server.url}/machines/{fleet.new}",
                              params={"refresh": bad}, timeout=10)
        assert answer.status_code == 400, bad
        assert "refresh must be a whole number of seconds from 5 to 3600" in answer.text
    for off in ("0", "off", ""):
        assert requests.get(f"{server.url}/sessions", params={"refresh": off},
                            timeout=10).status_code == 200


def test_the_page_really_reloads_itself(web, devtools: Devtools) -> None:
    """The meta refresh works under the CSP: the page loads again by itself."""
    server, _, _ = web
    devtools.load(f"{server.url}/sessions?refresh=5")
    devtools.evaluate("window.__first_load = true")
    devtools._wait(lambda m: m.get("method") == "Page.loadEventFired", timeout=20)
    assert devtools.evaluate("window.__first_load === undefined")
    assert devtools.evaluate("location.search") == "?refresh=5"


def test_the_banner_names_every_problem_on_every_page(web, browse) -> None:
    """The fixture's fleet has a dead session holding work and a guard pausing Recovery
    (3 of 5 silent); a refusal is added: each is on every page, error pages too."""
    server, db, fleet = web
    db.read(lambda tx: bmdb.record_refusal(tx, "simulator", "FLEET MISMATCH: 1 at the "
                                                             "provider but not in the BMDB"))
    for path in ("/machines", f"/machines/{fleet.new}", "/sessions", "/machines/nope"):
        page = browse(f"{server.url}{path}")
        assert page.by_id["refusal-simulator"].startswith("RECONCILE REFUSING :"), path
        dead = page.by_id["problem-dead-sessions"]
        assert dead.startswith("DEAD SESSIONS : 1 past their deadline, not swept yet, "
                               "holding 1 work items"), path
        paused = page.by_id["problem-recovery-paused"]
        assert paused.startswith("RECOVERY PAUSED : "), path
        assert "3 of 5 started agents are silent (60% > 10%)" in paused, path
    db.sweep()
    db.read(lambda tx: bmdb.clear_refusal(tx, "simulator"))
    page = browse(f"{server.url}/sessions")
    assert "problem-dead-sessions" not in page.by_id and "refusal-simulator" not in page.by_id
    assert "problem-recovery-paused" in page.by_id


def test_a_quiet_fleet_has_no_banner_and_an_unhealthy_callback_server_is_named(
        sqlite_url: str, browse) -> None:
    db = bmdb.connect(sqlite_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    with serve_guarded(db, sqlite_url, GuardLimits()) as server:
        page = browse(f"{server.url}/machines")
        assert "problems" not in page.by_id and page.title.startswith("Machines")
    nowhere = f"http://127.0.0.1:{free_port()}/healthz"
    limits = GuardLimits(healthz_url=nowhere, healthz_timeout=2.0)
    with serve_guarded(db, sqlite_url, limits) as server:
        page = browse(f"{server.url}/sessions")
    assert page.by_id["problem-callback"].startswith(
        f"CALLBACK SERVER UNHEALTHY : callback server {nowhere} unreachable")
    assert "callback server" in page.by_id["problem-recovery-paused"]
    db.close()


def test_holds_are_a_state_on_both_pages(web, browse) -> None:
    server, db, fleet = web

    def hold(tx: bmdb.Tx) -> None:
        bmdb.put_hold(tx, fleet.new, bmdb.MAINTENANCE, "replacing a <DIMM>", "alice")
        bmdb.put_hold(tx, fleet.silent, bmdb.QUARANTINE, "ladder exhausted", "shepherd")

    db.read(hold)
    page = browse(f"{server.url}/machines")
    held = {a["data-machine"]: a for a, _ in page.rows_with("data-machine")}
    assert held[str(fleet.new)]["data-held"] == "maintenance"
    assert held[str(fleet.new)]["class"] == "held-row"
    assert held[str(fleet.silent)]["data-held"] == "quarantine"
    assert "data-held" not in held[str(fleet.healthy)]
    state = browse(f"{server.url}/machines/{fleet.new}").by_id["state"]
    assert state == "MAINTENANCE replacing a <DIMM> (by alice)"
    assert browse(f"{server.url}/machines/{fleet.silent}").by_id["state"] == (
        "QUARANTINED ladder exhausted (by shepherd)")
    assert browse(f"{server.url}/machines/{fleet.healthy}").by_id["state"].startswith(
        "not held")


def test_the_stylesheet_ships_in_the_wheel() -> None:
    """The image installs the wheel, which holds only the data files that
    ``[options.package_data]`` names: a stylesheet left out would leave every page
    unstyled there (the CSP allows no inline style to fall back on)."""
    import configparser
    import fnmatch

    root = Path(__file__).resolve().parents[2]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    shipped = dict(config["options.package_data"]) if config.has_section(
        "options.package_data") else {}
    static = root / "shepherd" / "server" / "static"
    files = sorted(p.name for p in static.iterdir() if p.is_file())
    assert files, "no stylesheet"
    patterns = shipped.get("shepherd.server.static", "").replace(",", " ").split()
    missing = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert missing == [], ("add `shepherd.server.static = *.css` to setup.cfg's "
                           "[options.package_data]")


# -- the list leads with the fleet's health; sorted by name; fits 1400 pixels -------------

#: The health strip's links, in order (``web.HEALTH``).
HEALTH_KEYS = ["heartbeating", "silent", "in-recovery", "installing", "held", "backing-off"]


def fetch(url: str) -> Page:
    """A page as the server sends it (links and counts need no browser)."""
    answer = requests.get(url, timeout=30)
    assert answer.status_code == 200, answer.text[:500]
    return Page.parse(answer.text)


def listed(server: RunningServer, href: str) -> tuple[list[str], Page]:
    """The machines a list link shows, every page followed; and its first page."""
    first = page = fetch(server.url + href)
    seen = [a["data-machine"] for a, _ in page.rows_with("data-machine")]
    while "next-page" in page.attributes_by_id:
        page = fetch(server.url + page.attributes_by_id["next-page"]["href"])
        seen += [a["data-machine"] for a, _ in page.rows_with("data-machine")]
        assert len(seen) < 100
    return seen, first


def shown_count(page: Page, key: str) -> int:
    """The number a health figure shows ("silent 2" -> 2)."""
    return int(page.by_id[f"health-{key}"].split()[-1])


def test_the_list_leads_with_health_and_each_link_lists_what_it_counts(
        db: bmdb.BMDB, session: bmdb.Session, db_url: str) -> None:
    """One machine of each health (and one of none): each figure's link lists exactly
    the machines it counts, across pages (limit=1, kept by the links), and the page it
    leads to says so (its count, its link marked current)."""
    fleet = seed_health_fleet(session)
    with serve(loopback(db_url), db=db) as server:
        html = requests.get(f"{server.url}/machines?limit=1", timeout=30).text
        assert html.index('id="health"') < html.index('id="tag-counts"') < html.index(
            'id="machines"')
        page = Page.parse(html)
        links = {a["data-health"]: a["href"] for a in page.anchors if "data-health" in a}
        assert list(links) == HEALTH_KEYS
        for key, href in links.items():
            assert "limit=1" in href, href
            seen, landing = listed(server, href)
            expected = {str(m) for m in fleet.expected[key]}
            assert (shown_count(page, key), len(seen), set(seen)) == (
                len(expected), len(expected), expected), key
            assert landing.by_id["matched"].startswith(f"{len(expected)} matching"), key
            assert "current" in landing.attributes_by_id[f"health-{key}"]["class"], key
            assert shown_count(landing, key) == len(expected), key
        assert "current" not in page.attributes_by_id["health-silent"]["class"]


def test_the_health_counts_stay_true_as_the_fleet_changes(
        db: bmdb.BMDB, session: bmdb.Session, db_url: str) -> None:
    """A heartbeating machine gone quiet becomes silent, a silent one put in quarantine
    becomes held (and no longer silent): the figures and their links move together."""
    fleet = seed_health_fleet(session)
    heartbeating = fleet.machines["heartbeating"]
    h = bmdb._schema.agent_heartbeat
    session.transact(lambda tx: tx.execute(
        sa.update(h).where(h.c.machine_id == heartbeating)
        .values(last_heartbeat_at=tx.now - dt.timedelta(minutes=5))))
    session.transact(lambda tx: bmdb.put_hold(tx, fleet.machines["silent"], bmdb.QUARANTINE,
                                              "ladder exhausted", "test"))
    with serve(loopback(db_url), db=db) as server:
        page = fetch(f"{server.url}/machines")
        silent, _ = listed(server, page.attributes_by_id["health-silent"]["href"])
        held, _ = listed(server, page.attributes_by_id["health-held"]["href"])
        fresh, _ = listed(server, page.attributes_by_id["health-heartbeating"]["href"])
    assert set(silent) == {str(heartbeating), str(fleet.machines["recovering"])}
    assert set(held) == {str(fleet.machines["held"]), str(fleet.machines["silent"])}
    assert set(fresh) == {str(fleet.machines["withdrawn"])}
    assert [shown_count(page, k) for k in HEALTH_KEYS] == [1, 2, 1, 2, 2, 1]


def test_the_health_figures_are_read_once_per_ttl_and_then_follow_the_fleet(
        db: bmdb.BMDB, session: bmdb.Session, db_url: str) -> None:
    """Every list page within ``HEALTH_TTL`` shows one reading of the figures (they
    count the whole fleet), while its rows are read afresh; the next page after it
    shows the fleet as it is."""
    fleet = seed_health_fleet(session)
    with serve(loopback(db_url), db=db) as server:
        before = fetch(f"{server.url}/machines")
        read_at = time.monotonic()
        session.transact(lambda tx: bmdb.put_hold(
            tx, fleet.machines["heartbeating"], bmdb.MAINTENANCE, "rack work", "test"))
        within = fetch(f"{server.url}/machines?held=any")
        if time.monotonic() - read_at < HEALTH_TTL:  # else the host was too slow
            assert shown_count(within, "held") == shown_count(before, "held")
        assert within.by_id["matched"].startswith(f"{shown_count(before, 'held') + 1} ")
        time.sleep(max(0.0, HEALTH_TTL - (time.monotonic() - read_at)))
        after = fetch(f"{server.url}/machines")
    assert shown_count(after, "held") == shown_count(before, "held") + 1


#: Provider ids in rack order, as the list must show them (ties by machine id).
def seed_racks(session: bmdb.Session) -> list[str]:
    """``seed_rack_names`` with two machines without a provider id: their ids in the
    order the list must show them."""
    return [str(m) for m in rack_order(seed_rack_names(session, unnamed=2))]


def test_the_list_sorts_by_provider_id_in_rack_order_across_pages_and_filters(
        db: bmdb.BMDB, session: bmdb.Session, db_url: str) -> None:
    """The header's link orders the list by provider id, racks in rack order, ties by
    machine id and machines without a provider id last; every page size pages through
    it once; the order is kept by the next page, the health links and the filter form,
    and the other header's link goes back to creation order."""
    expected = seed_racks(session)
    with serve(loopback(db_url), db=db) as server:
        page = fetch(f"{server.url}/machines?limit=3")
        by_name = page.attributes_by_id["order-name"]["href"]
        assert by_name == "/machines?limit=3&sort=name"
        for limit in (1, 2, 3, 8):
            seen, _ = listed(server, by_name.replace("limit=3", f"limit={limit}"))
            assert seen == expected, limit
        first = fetch(server.url + by_name)
        assert first.hidden_inputs == {"sort": "name"}
        assert "class" in first.attributes_by_id["order-name"]  # marked as the order
        assert "class" not in first.attributes_by_id["order-created"]
        assert "sort=name" in first.attributes_by_id["health-silent"]["href"]
        following = first.attributes_by_id["next-page"]["href"]
        assert "sort=name" in following
        assert first.attributes_by_id["order-created"]["href"] == "/machines?limit=3"
        seen, _ = listed(server, "/machines?limit=3")
        assert seen != expected and sorted(seen) == sorted(expected)
        # A cursor names a position in its own order: the other refuses it.
        cursor = following.split("after=")[1]
        refused = requests.get(f"{server.url}/machines?after={cursor}", timeout=10)
        assert refused.status_code == 400 and "not a page cursor" in refused.text
        assert requests.get(f"{server.url}/machines?sort=size", timeout=10).status_code == 400
        refreshing = fetch(f"{server.url}/machines?limit=3&refresh=30")
        assert refreshing.attributes_by_id["order-name"]["href"] == (
            "/machines?limit=3&refresh=30&sort=name")
        assert refreshing.attributes_by_id["health-held"]["href"] == (
            "/machines?held=any&limit=3&refresh=30")


def test_the_list_fits_a_1400_pixel_screen_with_every_column(web, devtools: Devtools
                                                              ) -> None:
    """At 1400 pixels, a machine with the longest words a row can hold (host name,
    provider, provider id, an IPv6 address, every hold, work, a backoff, a BMC that
    does not answer) leaves the table's last column inside the window, and the page
    has nothing to scroll sideways. At 900 pixels the same check fails: it measures."""
    server, db, fleet = web
    wide = seed_widest_row(db, fleet)
    worker = db.start_session("wide", interval=10)
    claim_for(worker, bmdb.Process.POWER, wide)
    measure = ("(() => { const t = document.querySelector('#machines');"
               " const th = [...t.querySelectorAll('thead th')];"
               " return {right: t.getBoundingClientRect().right,"
               " last: th[th.length - 1].getBoundingClientRect().right,"
               " columns: th.length, window: innerWidth,"
               " scroll: document.documentElement.scrollWidth}; })()")

    def at(width: int) -> dict[str, int]:
        devtools.call("Emulation.setDeviceMetricsOverride", session=devtools.session,
                      width=width, height=900, deviceScaleFactor=1, mobile=False)
        devtools.load(f"{server.url}/machines")
        assert devtools.evaluate(f"!!document.querySelector(\"tr[data-machine='{wide}']\")")
        return devtools.evaluate(measure)

    fits = at(1400)
    assert fits["window"] == 1400 and fits["columns"] == 11 + len(bmdb.TAG_NAMES)
    assert fits["last"] <= 1400 and fits["right"] <= 1400, fits
    assert fits["scroll"] <= 1400, fits
    narrow = at(900)
    assert narrow["window"] == 900 and (narrow["scroll"] > 900 or narrow["last"] > 900), narrow
    worker.close()


def seed_widest_row(db: bmdb.BMDB, fleet: Fleet) -> uuid.UUID:
    """The healthy machine given the longest words each cell can hold; its id."""
    machine = fleet.healthy

    def seed(tx: bmdb.Tx) -> None:
        bmdb.upsert_provided(tx, machine, provider="p" * 64, provider_id="rack" + "9" * 124,
                             provider_status="Running",
                             address="2001:0db8:85a3:0000:0000:8a2e:0370:7334")
        bmdb.set_hardware_report(tx, machine, {"hostname": "host-" + "x" * 250})
        bmdb.enroll_bmcs(tx, {machine: 0})
        bmdb.record_power_observed(tx, machine, "On", "redfish http://bmc")
        bmdb.record_bmc_reading(tx, machine, bmdb.BmcReading(
            "unreachable", 0.0, "redfish http://bmc", problem="BmcUnreachable: no answer"))
        for kind in bmdb.HOLD_KINDS:
            bmdb.put_hold(tx, machine, kind, "test", "test")
        b = bmdb._schema.backoff  # its expired Recovery backoff, active again
        tx.execute(sa.update(b).where(b.c.machine_id == machine)
                   .values(until=tx.now + dt.timedelta(hours=1)))

    db.read(seed)
    return machine
