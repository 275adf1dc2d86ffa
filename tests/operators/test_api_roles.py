"""Every route of the operators' API with every role and with no, a wrong, a revoked and
an expired token: each refusal is a 401 or 403 with a one-line reason, and nothing in
the BMDB changed; each allowed call gets past both (``api_routes.ROUTES`` is the role
table under test)."""

from __future__ import annotations

import pytest
import requests

from shepherd import api_routes
from shepherd.roles import Role
from tests.support.api_fixtures import NOT_LIVE, ApiPlane, digest, valid_values

#: Routes whose command reaches outside the BMDB (a BMC, the provider, the catalog):
#: an allowed call names no machine there, so it is answered 404 after the checks.
OUTSIDE = {"power_status", "power", "install", "host_key"}


def refusal(answer: object) -> str:
    body = answer.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    line: str = body["error"]
    assert line and "\n" not in line
    return line


def test_every_route_refuses_every_token_that_is_not_a_live_one(api_plane: ApiPlane
                                                                ) -> None:
    before = digest(api_plane.db)
    for route in api_routes.ROUTES:
        values = valid_values(route, api_plane.fleet.healthy)
        for kind in NOT_LIVE:
            answer = api_plane.call(route, api_plane.tokens[kind], values)
            assert answer.status_code == 401, (route.name, kind, answer.text)
            assert answer.headers["WWW-Authenticate"].startswith("Bearer")
            reason = refusal(answer)
            assert ("no token" if kind == "none" else "not accepted") in reason
    assert digest(api_plane.db) == before
    assert api_plane.workers.asked == []


def test_every_route_refuses_the_roles_below_its_own(api_plane: ApiPlane) -> None:
    before = digest(api_plane.db)
    refused = 0
    for route in api_routes.ROUTES:
        values = valid_values(route, api_plane.fleet.healthy)
        for role in Role:
            if role >= route.role:
                continue
            answer = api_plane.call(route, api_plane.tokens[role.word], values)
            assert answer.status_code == 403, (route.name, role, answer.text)
            assert f"needs the {route.role.word} role" in refusal(answer)
            refused += 1
    assert refused == sum(route.role - 1 for route in api_routes.ROUTES) > 0
    assert digest(api_plane.db) == before
    assert api_plane.workers.asked == []


@pytest.mark.parametrize("route", api_routes.ROUTES, ids=lambda r: r.name)
def test_every_role_at_or_above_a_routes_own_gets_through(api_plane: ApiPlane,
                                                          route: api_routes.Route) -> None:
    machine = "no-such-machine" if route.name in OUTSIDE else api_plane.fleet.healthy
    for role in Role:
        if role < route.role:
            continue
        answer = api_plane.call(route, api_plane.tokens[role.word],
                                valid_values(route, machine))
        assert answer.status_code not in (401, 403), (role, answer.text)
        if route.name in OUTSIDE:
            assert answer.status_code == 404
            assert "no machine named 'no-such-machine'" in refusal(answer)


def test_the_role_table_is_the_issues(api_plane: ApiPlane) -> None:
    """Viewers read; operators act on machines; admins manage tokens and let held
    machines back."""
    roles = {route.name: route.role for route in api_routes.ROUTES}
    assert {n for n, r in roles.items() if r is Role.VIEWER} == {
        "fleet", "machines", "show", "explain", "sessions"}
    assert {n for n, r in roles.items() if r is Role.ADMIN} == {
        "quarantine_clear", "bmc_mismatch_clear", "tokens", "token_revoke"}
    assert all(route.method == "GET" for route in api_routes.ROUTES
               if route.role is Role.VIEWER)


def test_who_did_it_is_the_tokens_name_whatever_the_client_says(api_plane: ApiPlane
                                                                ) -> None:
    route = api_routes.BY_NAME["maintenance"]
    machine = api_plane.fleet.healthy
    claimed = api_plane.call(route, api_plane.tokens["operator"],
                             {"machine": str(machine), "state": "on", "reason": "r",
                              "by": "somebody-else"})
    assert claimed.status_code == 400
    assert "unknown parameter 'by'" in refusal(claimed)
    done = api_plane.call(route, api_plane.tokens["operator"],
                          {"machine": str(machine), "state": "on", "reason": "disk swap"})
    assert done.status_code == 200, done.text
    assert done.headers["Shepherd-Exit"] == "0"
    show = api_plane.call(api_routes.BY_NAME["show"], api_plane.tokens["viewer"],
                          {"machine": str(machine)}).json()
    assert show["holds"][0]["actor"] == "operator"
    assert show["history"][0]["cause"] == "by operator: disk swap"


def test_a_revoked_token_is_refused_on_its_next_request(api_plane: ApiPlane) -> None:
    fleet = api_routes.BY_NAME["fleet"]
    viewer = api_plane.tokens["viewer"]
    assert api_plane.call(fleet, viewer, {}).status_code == 200
    revoke = api_plane.call(api_routes.BY_NAME["token_revoke"], api_plane.tokens["admin"],
                            {"name": "viewer"})
    assert revoke.status_code == 200 and revoke.json() == {"name": "viewer",
                                                           "revoked": True}
    assert api_plane.call(fleet, viewer, {}).status_code == 401


def test_no_token_appears_in_answers_history_metrics_or_the_log(api_plane: ApiPlane,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    admin = api_plane.tokens["admin"]
    assert admin is not None
    listed = api_plane.call(api_routes.BY_NAME["tokens"], admin, {})
    assert listed.status_code == 200
    assert {t["name"] for t in listed.json()["tokens"]} >= {"viewer", "operator", "admin"}
    machine = str(api_plane.fleet.healthy)
    api_plane.call(api_routes.BY_NAME["maintenance"], admin,
                   {"machine": machine, "state": "on", "reason": "r"})
    shown = api_plane.call(api_routes.BY_NAME["show"], admin, {"machine": machine},
                           accept="text/plain")
    rows = digest(api_plane.db)
    metrics = requests.get(api_plane.url + "/metrics", timeout=30)
    assert metrics.status_code == 200
    secrets = [t for t in api_plane.tokens.values() if t]
    for text in (listed.text, shown.text, repr(rows), caplog.text, metrics.text):
        assert not any(secret in text for secret in secrets)
    stored = "".join(rows["api_tokens"])
    assert all(secret[len("shepherd_"):] not in stored for secret in secrets)
