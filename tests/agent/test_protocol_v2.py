"""Agent protocol v2 on real parts: no replay across takeovers, signed answers, the interval.

* A heartbeat captured before a Recovery is refused after it, whether the agent made
  a fresh key (the real agent) or kept its old one (signed here): the takeover's
  nonce alone ends it (``bmdb.lock_agent_credentials`` states the invariant).
* A man in the middle (a real HTTP proxy between the real agent and the real server)
  that strips, tampers with or forges heartbeat answers gets nothing acted on: the
  agent logs why and counts the heartbeat failed; the same proxy passing answers
  through shows the agent acting on signed ones.
* The servers' answer key is one per BMDB, and takeovers tell agents the interval
  the settings give.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import client as http_client
from http import server as http_server
from pathlib import Path
from typing import Any

import pytest
import requests

import bmdb
from shepherd import runtime
from shepherd.agent.protocol import (
    HEADER_ANSWER_SIGNATURE,
    HEADER_MACHINE,
    HEADER_TIMESTAMP,
    HEARTBEAT_PATH,
    answer_payload,
)
from shepherd.answer_key import AnswerKey, verify_answer
from shepherd.config import Settings
from shepherd.providers.base import register_provided
from shepherd.providers.equinix import EquinixProvider
from shepherd.server import RunningServer
from shepherd.simulator import Simulator
from shepherd.workflows import initialize
from shepherd.workflows.recoverer import forget_agent
from tests.support.agent_fixtures import (
    AgentLauncher,
    AgentRun,
    add_machine,
    bmdb_rows,
    heartbeat_at,
    heartbeat_body,
    new_key,
    record_takeover,
    signed_headers,
    start_agent,
    tags_of,
    take_over,
)
from tests.support.waiting import wait_until

#: For tests that run real agents or devices: the signing they check does not depend
#: on the backend, and the 2-core test machines are shared.
POSTGRESQL_ONLY = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
INJECTED = {"os_installation_request": {"generation": 66, "request": {"kind": "evil-os"}}}


def post(http: requests.Session, server: RunningServer, body: bytes,
         headers: dict[str, str]) -> requests.Response:
    return http.post(server.url + HEARTBEAT_PATH, data=body, headers=headers, timeout=10)


def recovery(session: bmdb.Session, machine: uuid.UUID) -> None:
    """What a verified Recovery finishes with: AgentStarted and AgentHeartbeat dropped."""
    session.transact(lambda tx: forget_agent(tx, machine))


# -- no replay across takeovers ------------------------------------------------------


def test_a_heartbeat_signed_before_recoveries_is_refused_after_them_even_with_the_same_key(
    db: bmdb.BMDB, session: bmdb.Session, callback_server: RunningServer,
    http: requests.Session,
) -> None:
    """The issue's replay: Recovery deleted ``last_signed_at`` and the agent kept its key;
    a capture from one and from two cycles back must both stay dead. Only the nonce
    (new at every takeover, signed over) can refuse them: the key is the same."""
    key, public = new_key()
    machine = add_machine(session, public)
    captures = []
    for cycle in range(2):
        body = heartbeat_body(machine, hardware_report={"captured_in_cycle": cycle})
        headers = signed_headers(key, machine, body)
        assert post(http, callback_server, body, headers).status_code == 200
        captures.append((body, headers))
        recovery(session, machine)
        record_takeover(session, machine, public)  # same key, the new takeover's nonce
    before = bmdb_rows(db)

    answers = [post(http, callback_server, body, headers) for body, headers in captures]

    assert [(a.status_code, a.json()) for a in answers] == [(401, {"error": "unauthorized"})] * 2
    assert bmdb_rows(db) == before
    tags = tags_of(db, machine)
    assert "AgentHeartbeat" not in tags
    assert tags["HardwareReport"]["report"] == {"captured_in_cycle": 1}
    # The agent of the current takeover is heard (its nonce is the recorded one).
    body = heartbeat_body(machine)
    assert post(http, callback_server, body, signed_headers(key, machine, body)).status_code == 200


# -- a man in the middle --------------------------------------------------------------


@dataclass
class Captured:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0


@dataclass
class Proxy:
    """A real HTTP proxy on loopback between agents and the callback server: forwards
    each heartbeat, records it, and rewrites the answer as ``mode`` says."""

    upstream: str
    url: str = ""
    mode: str = "pass"
    captured: list[Captured] = field(default_factory=list)
    attacker: Any = field(default_factory=lambda: new_key()[0])

    def rewrite(self, request: Captured, status: int, answer: bytes,
                signature: str | None) -> tuple[int, bytes, str | None]:
        """(status, body, signature) as the agent will get them."""
        injected = json.dumps(INJECTED).encode()
        if self.mode == "unsigned":
            return 200, injected, None
        if self.mode == "tampered":  # the server's genuine signature, another body
            return 200, injected, signature
        if self.mode == "forged":  # well-formed, for this very request, wrong key
            payload = answer_payload(request.headers.get(HEADER_MACHINE, ""),
                                     request.headers.get(HEADER_TIMESTAMP, ""), 200, injected)
            return 200, injected, base64.b64encode(self.attacker.sign(payload)).decode()
        if self.mode == "unsigned-413":  # would make the agent drop its reports
            return 413, b'{"error": "request entity too large"}', None
        return status, answer, signature


def proxy_handler(proxy: Proxy) -> type[http_server.BaseHTTPRequestHandler]:
    target = urllib.parse.urlsplit(proxy.upstream)
    assert target.hostname is not None, proxy.upstream
    host = target.hostname

    class Handler(http_server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items()
                       if k.lower().startswith("x-shepherd") or k.lower() == "content-type"}
            request = Captured(self.path, headers, body)
            connection = http_client.HTTPConnection(host, target.port, timeout=10)
            try:
                connection.request("POST", self.path, body, headers)
                response = connection.getresponse()
                status, answer = response.status, response.read()
                signature = response.getheader(HEADER_ANSWER_SIGNATURE)
            finally:
                connection.close()
            request.status = status
            proxy.captured.append(request)
            status, answer, signature = proxy.rewrite(request, status, answer, signature)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            if signature:
                self.send_header(HEADER_ANSWER_SIGNATURE, signature)
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def proxy(callback_server: RunningServer) -> Iterator[Proxy]:
    middle = Proxy(callback_server.url)
    server = http_server.ThreadingHTTPServer(("127.0.0.1", 0), proxy_handler(middle))
    server.daemon_threads = True
    middle.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="mitm-proxy", daemon=True)
    thread.start()
    yield middle
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def accepted(proxy: Proxy) -> int:
    return sum(1 for captured in proxy.captured if captured.status == 200)


def refusals(run: AgentRun, why: str) -> int:
    return sum(1 for line in run.log().splitlines()
               if " WARNING heartbeat failed " in line and "refused" in line and why in line)


@POSTGRESQL_ONLY
@pytest.mark.parametrize(("mode", "why"), [
    ("unsigned", "not signed"),
    ("tampered", "does not verify"),
    ("forged", "does not verify"),
    ("unsigned-413", "not signed"),
])
def test_the_agent_acts_on_no_answer_it_cannot_verify(
    mode: str, why: str, db: bmdb.BMDB, session: bmdb.Session, proxy: Proxy,
    agents: AgentLauncher, answer_key: str,
) -> None:
    proxy.mode = mode
    machine, _, run = start_agent(agents, session, proxy.url, answer_key=answer_key)

    wait_until(lambda: refusals(run, why) >= 3 and accepted(proxy) >= 3, timeout=15,
               what=f"three accepted heartbeats whose {mode} answers were refused")

    log = run.log()
    assert "evil-os" not in log and "OS installation request" not in log, log
    assert "dropping" not in log, "an unsigned 413 must not make the agent drop its reports"
    assert "OSInstallationReport" not in tags_of(db, machine)
    # The agent's first heartbeats may reach the server before start_agent recorded its
    # key (401, as in production); from the first accepted on, every one is accepted.
    statuses = [captured.status for captured in proxy.captured]
    first = statuses.index(200)
    assert set(statuses[:first]) <= {401} and set(statuses[first:]) == {200}, \
        f"the server accepted the heartbeats: only the answers were refused ({statuses})"

    # The same proxy passing answers through: signed ones are acted on (a real request).
    session.transact(lambda tx: bmdb.set_os_installation_request(
        tx, machine, 7, {"kind": "debian"}))
    proxy.mode = "pass"
    report = wait_until(lambda: tags_of(db, machine).get("OSInstallationReport"), timeout=15,
                      what="the installation report through the transparent proxy")
    assert report["generation"] == 7
    assert "evil-os" not in run.log()
    assert "HardwareReport" in tags_of(db, machine)


def test_a_heartbeat_of_the_real_agent_replayed_after_a_recovery_is_refused(
    db: bmdb.BMDB, session: bmdb.Session, proxy: Proxy, callback_server: RunningServer,
    agents: AgentLauncher, answer_key: str, http: requests.Session,
) -> None:
    """A capture of the real agent's first heartbeat (with its hardware report), sent
    again after Recovery gave the machine a new agent: refused, nothing overwritten."""
    machine, first, _ = start_agent(agents, session, proxy.url, answer_key=answer_key)
    wait_until(lambda: heartbeat_at(db, machine), what="the first heartbeat")
    # The BMDB has the heartbeat before the proxy, which records a request only once
    # the server answered it: wait for the record too.
    # the agent's first heartbeat may have raced the record of its key (401): the
    # capture is the first the server accepted, the hardware report still in it.
    capture = wait_until(lambda: next((c for c in proxy.captured if c.status == 200), None),
                         what="the proxy's record of the first accepted heartbeat")
    assert capture.status == 200 and b"hardware_report" in capture.body
    recovery(session, machine)
    # The new agent's first heartbeat is a minute away: nothing but the replay comes.
    second, _ = take_over(agents, machine, proxy.url, answer_key=answer_key, interval=60)
    assert second.ok and second.key is not None and second.init_message is not None
    assert second.key != first.key
    record_takeover(session, machine, second.key, second.init_message.nonce)
    before = bmdb_rows(db)

    replay = post(http, callback_server, capture.body, capture.headers)

    assert (replay.status_code, replay.json()) == (401, {"error": "unauthorized"})
    assert bmdb_rows(db) == before
    assert "AgentHeartbeat" not in tags_of(db, machine)


# -- the answer key -----------------------------------------------------------------


def test_every_answer_on_the_heartbeat_path_is_signed_for_its_request(
    db: bmdb.BMDB, session: bmdb.Session, callback_server: RunningServer,
    http: requests.Session,
) -> None:
    """200, 400 and 401 alike, bound to the request's machine and timestamp: the
    signature of one answer does not verify for another request's headers."""
    key, public = new_key()
    machine = add_machine(session, public)
    server_key = base64.b64decode(AnswerKey.from_bmdb(db).public_b64)
    good = heartbeat_body(machine)
    cases = [(good, signed_headers(key, machine, good), 200),
             (b"[1]", signed_headers(key, machine, b"[1]"), 400),
             (good, signed_headers(new_key()[0], machine, good), 401),
             (good, {"Content-Type": "application/json"}, 401)]
    for body, headers, status in cases:
        answer = post(http, callback_server, body, headers)
        assert answer.status_code == status
        signature = answer.headers.get(HEADER_ANSWER_SIGNATURE, "")
        sent = (headers.get(HEADER_MACHINE, ""), headers.get(HEADER_TIMESTAMP, ""))
        assert verify_answer(server_key, signature, *sent, status, answer.content), status
        assert not verify_answer(server_key, signature, sent[0], f"{time.time():.6f}", status,
                                 answer.content)
        assert not verify_answer(server_key, signature, str(uuid.uuid4()), sent[1], status,
                                 answer.content)


def test_the_answer_key_is_one_per_bmdb_whoever_asks_first(db: bmdb.BMDB) -> None:
    """Server processes and workers race to create it; all end up with one key."""
    keys: list[str] = []
    gate = threading.Barrier(6)

    def fetch() -> None:
        gate.wait()
        keys.append(AnswerKey.from_bmdb(db).public_b64)

    threads = [threading.Thread(target=fetch) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(keys) == 6 and len(set(keys)) == 1
    assert AnswerKey.from_bmdb(db).public_b64 == keys[0]
    signature = AnswerKey.from_bmdb(db).sign("m", "1.5", 200, b"{}")
    assert verify_answer(base64.b64decode(keys[0]), signature, "m", "1.5", 200, b"{}")
    assert not verify_answer(base64.b64decode(keys[0]), signature, "m", "1.5", 200, b"{} ")


# -- the heartbeat interval -----------------------------------------------------------


def test_the_default_interval_is_a_tenth_of_the_heartbeat_timeout() -> None:
    assert Settings().agent_interval == 60.0
    assert Settings(heartbeat_timeout=30).agent_interval == 3.0
    assert Settings(heartbeat_timeout=30, agent_heartbeat_interval=7).agent_interval == 7.0
    env = {"SHEPHERD_HEARTBEAT_TIMEOUT": "120", "SHEPHERD_AGENT_HEARTBEAT_INTERVAL": "9"}
    assert Settings.from_env(env).agent_interval == 9.0
    assert Settings.from_env({"SHEPHERD_HEARTBEAT_TIMEOUT": "120"}).agent_interval == 12.0


def distinct_heartbeats(db: bmdb.BMDB, machine: uuid.UUID, seen: set[Any]) -> int:
    if (stamp := heartbeat_at(db, machine)) is not None:
        seen.add(stamp)
    return len(seen)


@POSTGRESQL_ONLY
@pytest.mark.parametrize("env", [
    {"SHEPHERD_HEARTBEAT_TIMEOUT": "3"},  # derived: 0.3 s
    {"SHEPHERD_HEARTBEAT_TIMEOUT": "600", "SHEPHERD_AGENT_HEARTBEAT_INTERVAL": "0.3"},
], ids=["derived", "explicit"])
def test_the_agent_heartbeats_at_the_interval_settings_give_it(
    env: dict[str, str], db: bmdb.BMDB, session: bmdb.Session, provider: EquinixProvider,
    simulator: Simulator, ssh_key: Path, callback_server: RunningServer,
) -> None:
    """A worker's settings (as ``runtime`` builds them) reach the agent in its
    TakeoverInit; nothing on the command line says otherwise. At the old fixed 5 s,
    or the default 60 s, three heartbeats would not come within the wait."""
    settings = Settings.from_env({**env, "SHEPHERD_CALLBACK_URL": callback_server.url,
                                  "SHEPHERD_SSH_KEY_PATH": str(ssh_key)})
    init_settings = runtime.initializer_settings(settings)
    assert init_settings.agent_args == () and init_settings.heartbeat_interval == 0.3
    capacity = provider.list_capacity()[0]
    created = provider.create_machine(capacity)
    simulator.wait_for_state(created.provider_id, "active", timeout=5)
    simulator.wait_for_ssh(created.provider_id, timeout=5)
    machine_id = session.transact(lambda tx: register_provided(
        tx, provider.name, provider.get_machine(created.provider_id)))
    (work,) = session.claim_backlog(bmdb.Process.AGENT_START, 1)

    result = initialize(work, provider, init_settings)

    assert result.ok, result.cause
    seen: set[Any] = set()
    wait_until(lambda: distinct_heartbeats(db, machine_id, seen) >= 3, timeout=6,
             what="three heartbeats at 0.3 s")
    log = simulator.sandbox(created.provider_id) / "shepherd-agent" / "agent.log"
    assert "every 0.30s" in log.read_text()
    recorded = tags_of(db, machine_id)["AgentStarted"]
    assert len(recorded["public_key"]) == 32 and len(recorded["nonce"]) == 44
