"""The operators' listener: TLS with a certificate of its own, and refused tokens
throttled per client address."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

import bmdb
from shepherd import api_routes, cli
from shepherd.config import Settings
from shepherd.server import serve
from tests.support.api_fixtures import Workers, api_factory, digest, make_tokens
from tests.support.servers import self_signed


def test_the_operators_listener_serves_the_api_over_tls_with_its_own_certificate(
        pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    agents_cert, agents_key = self_signed(tmp_path, "agents")
    cert, key = self_signed(tmp_path, "operators")  # its own CA
    settings = Settings(bmdb_url=pg_url, serve_listen="127.0.0.1:0",
                        serve_operator_listen="127.0.0.1:0", serve_tls_cert=agents_cert,
                        serve_tls_key=agents_key, serve_operator_tls_cert=cert,
                        serve_operator_tls_key=key)
    db = bmdb.connect(pg_url)
    with db.start_session("test", interval=30) as session:
        found = make_tokens(db, session)
        with serve(settings, db=db, operator_api=api_factory(Workers())) as server:
            url = server.operator_url
            assert url is not None and url.startswith("https://")
            monkeypatch.setenv("SHEPHERD_API_URL", url)
            monkeypatch.setenv("SHEPHERD_API_TOKEN", str(found["viewer"]))
            monkeypatch.setenv("SHEPHERD_BMDB_URL", "postgresql://nobody@127.0.0.1:1/x")
            refused = cli.main(["fleet"])  # the system does not trust our CA
            assert refused == 1
            assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
            monkeypatch.setenv("SHEPHERD_API_CA_FILE", cert)
            assert cli.main(["--json", "fleet"]) == 0
            assert json.loads(capsys.readouterr().out)["machines"] == 0
            with pytest.raises(requests.exceptions.SSLError):  # not the agents' one
                requests.get(url + "/api/v1/fleet", verify=agents_cert, timeout=10)
            assert requests.get(server.url + "/healthz", verify=agents_cert,
                                timeout=10).status_code == 200
    db.close()


def test_an_address_sending_refused_tokens_is_throttled_and_nothing_changes(
        pg_url: str) -> None:
    settings = Settings(bmdb_url=pg_url, serve_listen="127.0.0.1:0", serve_login_failures=3)
    db = bmdb.connect(pg_url)
    with db.start_session("test", interval=30) as session:
        found = make_tokens(db, session)
        with serve(settings, db=db, operator_api=api_factory(Workers())) as server:
            fleet = server.url + api_routes.BY_NAME["fleet"].url_path
            assert server.runtime.session.alive
            before = digest(db)

            def ask(token: str | None) -> requests.Response:
                return requests.get(fleet, headers={"Authorization": f"Bearer {token}"},
                                    timeout=10)

            assert [ask(found["wrong"]).status_code for _ in range(3)] == [401] * 3
            throttled = ask(found["admin"])  # a good token too, from this address
            assert throttled.status_code == 429
            assert 0 < int(throttled.headers["Retry-After"]) <= 60
            assert "too many refused tokens from 127.0.0.1" in throttled.json()["error"]
            assert digest(db) == before
    db.close()
