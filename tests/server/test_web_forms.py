"""The web view acts: a login with a token, forms for maintenance, clearing a backoff
and a power cycle (after a confirmation page), each for the roles the API's table
allows, each refused without its session's anti-forgery value. Driven in headless
Chromium as a person would, and by hand where a forger would."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests

import bmdb
from shepherd.config import Settings
from shepherd.server import RunningServer, serve
from shepherd.server.web_session import COOKIE
from tests.support.api_fixtures import digest, make_tokens
from tests.support.chromium import Devtools
from tests.support.operator_fixtures import Fleet, seed_fleet


@dataclass
class Site:
    server: RunningServer
    db: bmdb.BMDB
    fleet: Fleet
    tokens: dict[str, str | None]

    @property
    def url(self) -> str:
        return self.server.url


def site_of(pg_url: str, **settings: Any) -> Iterator[Site]:
    db = bmdb.connect(pg_url, thresholds=bmdb.Thresholds(first_heartbeat=60, heartbeat=30))
    config = Settings(bmdb_url=pg_url, serve_listen="127.0.0.1:0",
                      provider_url="http://127.0.0.1:9", **settings)
    with db.start_session("test", interval=30) as session:
        fleet = seed_fleet(db, session)
        found = make_tokens(db, session)
        with serve(config, db=db) as server:
            assert server.runtime.session.alive  # its row now, not at the first form
            yield Site(server, db, fleet, found)
    db.close()


@pytest.fixture
def site(pg_url: str) -> Iterator[Site]:
    yield from site_of(pg_url, serve_login_failures=1000)


def log_in(browser: Devtools, site: Site, role: str) -> None:
    browser.load(f"{site.url}/login")
    browser.submit("#login", token=site.tokens[role])


def holds(site: Site, machine: object) -> list[tuple[str, str, str]]:
    return [(h.kind, h.actor, h.reason) for h in site.db.read(
        lambda tx: bmdb.holds_of(tx, machine))]  # type: ignore[arg-type]


def test_an_operator_logs_in_and_puts_a_machine_into_maintenance_and_out(
        site: Site, devtools: Devtools) -> None:
    log_in(devtools, site, "operator")
    assert devtools.evaluate("location.pathname") == "/machines"
    assert "operator (operator)" in devtools.evaluate("document.querySelector("
                                                      "'#login-state').textContent")
    cookies = devtools.cookies()
    (cookie,) = [c for c in cookies if c["name"] == COOKIE]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and not cookie["secure"]
    assert site.tokens["operator"] not in cookie["value"]
    machine = site.fleet.healthy
    devtools.load(f"{site.url}/machines/{machine}")
    assert devtools.exists("#maintenance-on") and devtools.exists("#power-cycle")
    devtools.submit("#maintenance-on", reason="disk swap")
    assert devtools.evaluate("location.pathname") == f"/machines/{machine}"
    assert holds(site, machine) == [("maintenance", "operator", "disk swap")]
    assert devtools.exists("#maintenance-off")
    devtools.submit("#maintenance-off")
    assert holds(site, machine) == []
    assert devtools.violations() == []


def test_an_operator_clears_a_backoff_from_its_row(site: Site, devtools: Devtools) -> None:
    machine = site.fleet.backing_off
    def active() -> list[str]:
        return [b.process for b in site.db.read(
            lambda tx: bmdb.machine_backoffs(tx, machine)) if b.active]

    assert active() == ["ShepherdAgentStart"]
    log_in(devtools, site, "operator")
    devtools.load(f"{site.url}/machines/{machine}")
    devtools.submit("#clear-backoff-ShepherdAgentStart")
    assert active() == []


def test_a_power_cycle_asks_first_and_then_goes_to_the_power_path(
        site: Site, devtools: Devtools) -> None:
    machine = site.fleet.healthy
    log_in(devtools, site, "operator")
    devtools.load(f"{site.url}/machines/{machine}")
    before = digest(site.db)
    devtools.submit("#power-cycle")
    assert devtools.exists("#confirm-power-cycle")  # the confirmation, nothing done
    assert digest(site.db) == before
    devtools.submit("#confirm")
    # The seeded machine has no BMC, and its provider (Equinix's API, with no token
    # here) cannot be asked: refused in one line, as `shepherd power cycle` says it.
    text = devtools.evaluate("document.querySelector('#error').textContent")
    assert text.startswith("provider: ") and text.endswith("(nothing was done)")
    assert devtools.evaluate("document.title").startswith("502")
    assert digest(site.db) == before


def test_a_viewer_sees_no_forms_and_its_forged_post_changes_nothing(
        site: Site, devtools: Devtools) -> None:
    machine = site.fleet.healthy
    log_in(devtools, site, "viewer")
    devtools.load(f"{site.url}/machines/{machine}")
    assert not devtools.exists("#actions") and not devtools.exists("form[action$=clear-backoff]")
    cookie = {c["name"]: c["value"] for c in devtools.cookies()}
    csrf = devtools.evaluate("document.querySelector('#logout').elements['csrf'].value")
    before = digest(site.db)
    answer = requests.post(f"{site.url}/machines/{machine}/maintenance", cookies=cookie,
                           data={"csrf": csrf, "state": "on", "reason": "x"}, timeout=30,
                           allow_redirects=False)
    assert answer.status_code == 403 and "needs the operator role" in answer.text
    assert digest(site.db) == before


def test_a_post_without_the_sessions_csrf_value_changes_nothing(site: Site,
                                                                devtools: Devtools) -> None:
    machine = site.fleet.healthy
    log_in(devtools, site, "admin")
    cookie = {c["name"]: c["value"] for c in devtools.cookies()}
    before = digest(site.db)
    for fields in ({"state": "on", "reason": "x"},
                   {"state": "on", "reason": "x", "csrf": "forged"}):
        answer = requests.post(f"{site.url}/machines/{machine}/maintenance", cookies=cookie,
                               data=fields, timeout=30, allow_redirects=False)
        assert answer.status_code == 403
        assert "did not come from this site&#39;s page" in answer.text
    # A page of another site posting the same form: the browser does not send the
    # session (SameSite=Strict), so the post is nobody's.
    devtools.load("data:text/html,<form method=post action='" + site.url
                  + f"/machines/{machine}/maintenance'><input name=state value=on>"
                  "<input name=reason value=forged></form>")
    devtools.submit("form")
    assert devtools.evaluate("document.title").startswith("401")
    assert digest(site.db) == before


def test_a_revoked_token_is_logged_out_and_logout_ends_the_session(
        site: Site, devtools: Devtools) -> None:
    log_in(devtools, site, "operator")
    devtools.load(f"{site.url}/machines/{site.fleet.healthy}")
    assert devtools.exists("#maintenance-on")
    with site.db.start_session("t", interval=30) as session:
        session.transact(lambda tx: bmdb.revoke_token(tx, "operator"))
    devtools.load(f"{site.url}/machines/{site.fleet.healthy}")
    assert not devtools.exists("#maintenance-on") and devtools.exists("#login-link")
    log_in(devtools, site, "admin")
    devtools.submit("#logout")
    assert devtools.evaluate("location.pathname") == "/login"
    assert [c for c in devtools.cookies()
            if c["name"] == COOKIE] == []


def test_failed_logins_are_throttled_per_address(pg_url: str) -> None:
    for site in site_of(pg_url, serve_login_failures=2):
        answers = [requests.post(f"{site.url}/login", data={"token": "wrong"}, timeout=30)
                   for _ in range(2)]
        assert [a.status_code for a in answers] == [401, 401]
        throttled = requests.post(f"{site.url}/login", data={"token": site.tokens["admin"]},
                                  timeout=30, allow_redirects=False)
        assert throttled.status_code == 429 and "too many refused tokens" in throttled.text
        assert COOKIE not in throttled.cookies


def test_pages_can_require_a_login(pg_url: str) -> None:
    for site in site_of(pg_url, serve_login_required=True, serve_login_failures=1000):
        page = f"{site.url}/machines"
        assert requests.get(page, timeout=30).status_code == 401
        login = requests.post(f"{site.url}/login", data={"token": site.tokens["viewer"]},
                              timeout=30, allow_redirects=False)
        assert login.status_code == 303
        answer = requests.get(page, cookies=login.cookies, timeout=30)
        assert answer.status_code == 200 and str(site.fleet.healthy) in answer.text
