"""Property-based: requests generated from the API's own OpenAPI document, well formed
or not, with an admin's token, find no 500, and a refused one (``REFUSED``) changes nothing
in the BMDB.

The strategies read the document, not ``api_routes``: what is tested is what the API
says it takes. Each parameter gets a value of its documented schema most of the time,
and otherwise something else (another type, an endless number, a long or hostile
string, a parameter nobody documented), so both the happy and the refused paths run.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shepherd.cli.api_server import openapi
from tests.support.api_fixtures import ApiPlane, digest

DOCUMENT = openapi()
OPERATIONS = [(method, path, operation) for path, item in DOCUMENT["paths"].items()
              for method, operation in item.items()]
#: Answers that refuse the input itself (a 409 is a command that ran and could not
#: finish now: what it did meanwhile is the command's, as in direct mode).
REFUSED = {400, 401, 403, 404, 405}
#: Whatever a client could send instead of what is documented.
GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.just("-h"), st.just("--bmdb-url=sqlite:///x"),
    st.text(min_size=2001, max_size=2100), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def of_schema(schema: dict[str, Any], machines: list[str]) -> st.SearchStrategy[Any]:
    """A value the schema describes (the machines the BMDB has, for names)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return st.integers(min_value=schema.get("minimum", 1),
                           max_value=int(schema.get("maximum", 2000)))
    if kind == "number":
        return st.floats(min_value=0.01, max_value=min(schema.get("maximum", 5.0), 0.5))
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(st.sampled_from(["Provided", "AgentStarted", "Nope"]), max_size=3)
    return st.one_of(st.sampled_from(machines), st.text(max_size=40))


@st.composite
def requests_of(draw: st.DrawFn, machines: list[str]) -> tuple[str, str, dict[str, Any],
                                                                dict[str, Any]]:
    """(method, path, query, body) of one documented operation."""
    method, path, operation = draw(st.sampled_from(OPERATIONS))
    query: dict[str, Any] = {}
    for parameter in operation["parameters"]:
        value = draw(st.one_of(of_schema(parameter["schema"], machines), GARBAGE)
                     if draw(st.integers(0, 4)) else GARBAGE)
        if parameter["in"] == "path":
            text = str(value) or "x"
            path = path.replace("{" + parameter["name"] + "}",
                                quote(text, safe=""))
        elif value is not None:
            query[parameter["name"]] = value
    body: dict[str, Any] = {}
    schema = operation.get("requestBody", {}).get("content", {}).get(
        "application/json", {}).get("schema", {"properties": {}})
    for name, member in schema["properties"].items():
        if draw(st.booleans()) or name in schema.get("required", ()):
            body[name] = draw(st.one_of(of_schema(member, machines), GARBAGE)
                              if draw(st.integers(0, 4)) else GARBAGE)
    body.update(draw(st.dictionaries(st.sampled_from(["by", "json", "bmdb_url", "zzz"]),
                                     GARBAGE, max_size=1)))
    return method, path, query, body


def send(plane: ApiPlane, method: str, path: str, query: dict[str, Any],
         body: dict[str, Any]) -> requests.Response:
    headers = {"Authorization": f"Bearer {plane.tokens['admin']}"}
    params = {k: v if isinstance(v, list) else str(v) for k, v in query.items()}
    if method == "get":
        return requests.get(plane.url + path, params=params, headers=headers, timeout=60)
    return requests.post(plane.url + path, params=params, headers=headers, timeout=60,
                         data=_json(body))


def _json(body: dict[str, Any]) -> bytes:
    import json

    return json.dumps(body, allow_nan=True).encode()


def test_no_request_finds_a_500_and_a_refused_one_changes_nothing(api_plane: ApiPlane
                                                                  ) -> None:
    fleet = api_plane.fleet
    machines = [str(m) for m in fleet.all] + [str(fleet.healthy)[:8], "no-such-machine"]
    seen: dict[int, int] = {}

    @settings(max_examples=250, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(requests_of(machines))
    def check(request: tuple[str, str, dict[str, Any], dict[str, Any]]) -> None:
        before = digest(api_plane.db)
        answer = send(api_plane, *request)
        seen[answer.status_code] = seen.get(answer.status_code, 0) + 1
        assert answer.status_code < 500 or answer.status_code in (502,), answer.text
        if answer.status_code in REFUSED:
            assert digest(api_plane.db) == before, (request, answer.text)

    check()
    print(seen)
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen
