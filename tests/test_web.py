"""The operator's web view, loaded in a real headless Chromium from the distribution.

The server runs in-process on loopback with a seeded BMDB; Chromium renders each page
and dumps the DOM, which the tests read with the standard library's HTML parser.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
import requests

import bmdb
from shepherd import runtime
from shepherd.config import Settings
from shepherd.server import RunningServer, ServerConfig, start_server
from shepherd.workflows.guard import GuardLimits
from tests.operator_fixtures import Fleet, seed_fleet
from tests.servers import free_port

pytestmark = pytest.mark.timeout(120)
VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
                  "source", "track", "wbr"})
BROWSER_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1366,900")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Chromium is missing: install it with `apt-get install -y chromium` "
                    "(./dev test does as root)")
    return path


@pytest.fixture
def web(sqlite_url: str) -> Iterator[tuple[RunningServer, bmdb.BMDB, Fleet]]:
    db = bmdb.connect(sqlite_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    with db.start_session("test", interval=2) as session:
        fleet = seed_fleet(db, session)
        with start_server(ServerConfig(bmdb_url=sqlite_url), db=db) as server:
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
        if tag == "tr":
            self._row, self._cells = (attributes, []), []
        if tag == "td" and self._row is not None:
            self._cells.append(attributes.get("class", ""))
        if tag in VOID:
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
    session = db.start_session("more", interval=2)
    try:
        work = session.claim_machine(bmdb.Process.AGENT_START, fleet.new)
        work.finish(lambda tx: bmdb.tags.set_agent_started(tx, fleet.new, b"\x03" * 32))
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


def limits_from_env() -> GuardLimits:
    """The guard limits ``shepherd serve`` builds from its settings (``Settings`` is the
    only reader of the environment; ``start_server`` is given what it builds)."""
    return runtime.guard_limits(Settings.from_env(), interactive=True)


def test_the_machine_page_asks_the_callback_server_like_the_guard(
        sqlite_url: str, browse, monkeypatch) -> None:
    """The whole guard, as a worker asks it: with the share allowed, an unreachable
    callback server alone pauses Recovery on the page; a healthy one does not."""
    db = bmdb.connect(sqlite_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    monkeypatch.setenv("SHEPHERD_RECOVERY_MAX_SHARE", "1.0")
    with db.start_session("test", interval=2) as session:
        fleet = seed_fleet(db, session)
        monkeypatch.setenv("SHEPHERD_BMAAS_ENDPOINT", f"http://127.0.0.1:{free_port()}")
        with start_server(ServerConfig(bmdb_url=sqlite_url), db=db,
                          limits=limits_from_env()) as server:
            page = browse(f"{server.url}/machines/{fleet.silent}")
        explain = {a["data-explain"]: t for a, t in page.rows_with("data-explain")}
        assert "PAUSED" in explain["ShepherdRecovery"]
        assert "callback server" in explain["ShepherdRecovery"]
        port = free_port()
        monkeypatch.setenv("SHEPHERD_BMAAS_ENDPOINT", f"http://127.0.0.1:{port}")
        with start_server(ServerConfig(bmdb_url=sqlite_url), db=db, port=port,
                          limits=limits_from_env()) as server:
            page = browse(f"{server.url}/machines/{fleet.silent}")  # its own /healthz: 200
        assert "claimable" in page.classes_of("data-explain", "ShepherdRecovery")
    db.close()


def test_holds_gone_machines_and_refusals_are_shown(web, browse) -> None:
    """Maintenance and quarantine on the list and the machine page (with who, why and
    the command that lifts them), a machine the provider stopped listing as gone, and a
    reconcile refusal with its advice above the list."""
    server, db, fleet = web

    def changes(tx: bmdb.Tx) -> None:
        bmdb.holds.put(tx, fleet.new, bmdb.holds.MAINTENANCE, "replacing a DIMM", "alice")
        bmdb.holds.put(tx, fleet.silent, bmdb.holds.QUARANTINE,
                       "the reboot ladder was exhausted 3 times in a row", "shepherd recovery")
        bmdb.tags.set_provider_status(tx, [fleet.stopped], bmdb.ProviderStatus.MISSING)
        bmdb.refusals.record(tx, "equinix", "FLEET MISMATCH: 2 at the provider but not in "
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


def test_unknown_and_malformed_machines_get_a_404_page(web, browse) -> None:
    server, _, _ = web
    missing = "00000000-0000-4000-8000-000000000000"
    page = browse(f"{server.url}/machines/{missing}")
    assert page.by_id["error"] == f"no machine {missing} in the BMDB"
    assert requests.get(f"{server.url}/machines/{missing}", timeout=10).status_code == 404
    page = browse(f"{server.url}/machines/not-a-uuid")
    assert "is not a machine id" in page.by_id["error"]
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
    config = ServerConfig(bmdb_url=sqlite_url)
    with start_server(config, operator_listen=("127.0.0.1", free_port())) as server:
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
    with start_server(ServerConfig(bmdb_url=sqlite_url), host="0.0.0.0") as server:
        local = f"http://127.0.0.1:{server.port}"
        assert server.operator_url is None and server.metrics_url is None
        for path in ("/machines", "/metrics", "/sessions", "/"):
            assert requests.get(f"{local}{path}", timeout=10).status_code == 404, path
        assert requests.get(f"{local}/healthz", timeout=10).status_code == 200
        assert requests.post(f"{local}/agent/v1/heartbeat", timeout=10).status_code == 401


def test_with_the_view_off_the_operator_listener_still_serves_metrics(sqlite_url: str
                                                                       ) -> None:
    config = ServerConfig(bmdb_url=sqlite_url, operator_views=False)
    with start_server(config, operator_listen=("127.0.0.1", free_port())) as server:
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

    config = ServerConfig(bmdb_url=sqlite_url)
    assert views_on_agent_listener(config, host, operator_listen) is expected


def test_operator_views_can_be_turned_off(sqlite_url: str) -> None:
    config = ServerConfig(bmdb_url=sqlite_url, operator_views=False)
    with start_server(config) as server:
        assert requests.get(f"{server.url}/machines", timeout=10).status_code == 404
        assert requests.get(f"{server.url}/metrics", timeout=10).status_code == 200
