"""The API's OpenAPI document is served and true: every route is documented, every
documented operation is served, and each answers with a documented status and a body
of the documented shape."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
import requests
from starlette.routing import Route

from shepherd import api_routes
from shepherd.cli.api_server import Api, openapi
from shepherd.config import Settings
from shepherd.runtime import Runtime
from shepherd.server.pool import ApiPools, Pool
from tests.support.api_fixtures import ApiPlane, Workers, valid_values

#: Routes whose command reaches outside the BMDB: asked for a machine that is not
#: there, so the answer is the documented 404 without a BMC or provider call.
OUTSIDE = {"power_status", "power", "install", "host_key"}


def served_operations() -> set[tuple[str, str]]:
    """(method, path) of every route the API's app serves, the document's own included."""
    pool = Pool(1, "test")
    api = Api(Runtime(Settings(), "test"), ApiPools(pool, pool), Workers())  # none opened
    found = set()
    for route in api.routes():
        assert isinstance(route, Route)
        for method in route.methods or ():
            if method != "HEAD":
                found.add((method.lower(), route.path))
    return found


def documented_operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method, path) for path, item in document["paths"].items() for method in item}


def test_the_document_is_served_without_a_token_and_is_the_generated_one(
        api_plane: ApiPlane) -> None:
    answer = requests.get(api_plane.url + "/api/v1/openapi.json", timeout=30)
    assert answer.status_code == 200
    assert answer.json() == openapi()


def test_every_route_is_documented_and_every_documented_route_served() -> None:
    document = openapi()
    served = served_operations() - {("get", "/api/v1/openapi.json")}
    assert served == documented_operations(document)
    assert len(served) == len(api_routes.ROUTES)


def test_every_schema_in_the_document_is_a_json_schema() -> None:
    document = openapi()
    check = jsonschema.Draft202012Validator.check_schema
    for item in document["paths"].values():
        for operation in item.values():
            for parameter in operation["parameters"]:
                check(parameter["schema"])
            if "requestBody" in operation:
                check(operation["requestBody"]["content"]["application/json"]["schema"])
            for answer in operation["responses"].values():
                check(answer["content"]["application/json"]["schema"])


def documented_schema(document: dict[str, Any], route: api_routes.Route,
                      status: int) -> dict[str, Any]:
    responses = document["paths"][route.url_path][route.method.lower()]["responses"]
    assert str(status) in responses, f"{route.name} answered an undocumented {status}"
    schema: dict[str, Any] = responses[str(status)]["content"]["application/json"]["schema"]
    if "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


@pytest.mark.parametrize("route", api_routes.ROUTES, ids=lambda r: r.name)
def test_every_route_answers_the_documented_shape(api_plane: ApiPlane,
                                                  route: api_routes.Route) -> None:
    document = openapi()
    machine = "no-such-machine" if route.name in OUTSIDE else api_plane.fleet.backing_off
    answer = api_plane.call(route, api_plane.tokens["admin"], valid_values(route, machine))
    jsonschema.validate(answer.json(), documented_schema(document, route, answer.status_code))
    if route.name in OUTSIDE:
        assert answer.status_code == 404
    elif route.name != "start":  # a fake worker layer nobody adopts from: a 409
        assert answer.status_code == 200, answer.text
    text = api_plane.call(route, api_plane.tokens["admin"], valid_values(route, machine),
                          accept="text/plain")  # again: a revoked token is now a 409
    documented_schema(document, route, text.status_code)
    if text.status_code == 200:
        assert text.headers["content-type"].startswith("text/plain")
        assert text.text.strip()


def test_start_answers_a_documented_refusal_when_no_worker_adopts(api_plane: ApiPlane
                                                                  ) -> None:
    route = api_routes.BY_NAME["start"]
    answer = api_plane.call(route, api_plane.tokens["operator"],
                            {"machine": str(api_plane.fleet.new), "process": "agent-start",
                             "wait": 0.3})
    assert answer.status_code == 409
    jsonschema.validate(answer.json(), documented_schema(openapi(), route, 409))
    assert "claim cancelled" in answer.json()["error"]
    assert api_plane.workers.asked == [f"dispatch {api_plane.fleet.new}"]


def test_a_wait_beyond_the_documented_maximum_is_refused(api_plane: ApiPlane) -> None:
    route = api_routes.BY_NAME["start"]
    answer = api_plane.call(route, api_plane.tokens["operator"],
                            {"machine": str(api_plane.fleet.new), "process": "agent-start",
                             "wait": api_routes.WAIT_MOST + 1})
    assert answer.status_code == 400
    assert "more than 600" in answer.json()["error"]
    assert api_plane.workers.asked == []
