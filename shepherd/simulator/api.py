"""The simulator's HTTP server: the Equinix Metal API subset Shepherd uses, plus admin.

Standard library ``ThreadingHTTPServer``: no extra dependency, real sockets, and
full control over the connection, which the "lost response" fault needs (the
action is applied, then the socket is closed without a reply).

Every request is recorded (``Simulator.requests``) as an ``ApiRequest``: the
``(method, path, status)`` tuple it always was, plus when it arrived, whether its
action was applied and which hardware reservation it named, so tests can count what
reached the API in a time window and how many creates each reservation received.

``PUT /bmc-notify`` is not the provider's API: it receives sushy-emulator's external
notifications (an emulated Redfish BMC's system after each change) and powers the
device of that name on or off, so a BMC's power action reaches the machine behind it,
and records its boot override (what a device with a disk boots at power on).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from shepherd.simulator.state import API_PREFIX, ApiError

if TYPE_CHECKING:
    from shepherd.simulator.server import Simulator

log = logging.getLogger(__name__)
Reply = tuple[int, Any]
Route = tuple[str, re.Pattern[str], Callable[..., Reply]]
#: Where sushy-emulator's ``EXTERNAL_NOTIFICATION_URL`` points (outside the API prefix).
NOTIFY_PATH = "/bmc-notify"


class ApiRequest(tuple[str, str, int | str]):
    """One request as served: ``(method, path, status)`` (status: the code answered, or
    ``"lost"``), so it compares and unpacks as a plain 3-tuple, with attributes:

    ``at``: ``time.monotonic()`` when the request arrived (before any injected latency);
    ``applied``: whether its action ran (the handler answered below 400), whatever was
    answered: True for a lost reply or an error injected after apply, False for an
    error injected instead of the action;
    ``reservation_id``: the ``hardware_reservation_id`` its JSON body named, if any
    (device creates).
    """

    at: float
    applied: bool
    reservation_id: str | None

    def __new__(cls, method: str, path: str, status: int | str, *, at: float,
                applied: bool, reservation_id: str | None = None) -> ApiRequest:
        request = super().__new__(cls, (method, path, status))
        request.at, request.applied, request.reservation_id = at, applied, reservation_id
        return request

    @property
    def method(self) -> str:
        return self[0]

    @property
    def path(self) -> str:
        return self[1]

    @property
    def status(self) -> int | str:
        return self[2]


class ApiServer(ThreadingHTTPServer):
    """Tracks its connections so ``stop`` can end keep-alive handlers at once."""

    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], sim: Simulator) -> None:
        self.sim = sim
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def stop(self) -> None:
        self.shutdown()
        with self._conn_lock:
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    """One request: auth, faults, route, JSON reply."""

    server: ApiServer
    protocol_version = "HTTP/1.1"
    timeout = 30
    # Headers and body go out in separate writes; without TCP_NODELAY each reply
    # waits ~40 ms on Nagle and the client's delayed ACK.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("api %s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        sim = self.server.sim
        self._arrived = time.monotonic()
        self._reservation_id: str | None = None
        url = urlsplit(self.path)
        path = url.path.removeprefix(API_PREFIX).rstrip("/") or "/"
        self._device_id = _device_in(path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            body = self._read_body()
        except ApiError as error:
            self._reply(error.status, {"errors": [str(error)]})
            return
        if isinstance(body, dict) and body.get("hardware_reservation_id") is not None:
            self._reservation_id = str(body["hardware_reservation_id"])
        if path == NOTIFY_PATH:
            self._notify(method, path, query, body)
            return
        if self.headers.get("X-Auth-Token") != sim.config.token:
            self._record(method, path, 401)
            self._reply(401, {"error": "Invalid authentication token"})
            return
        if path.startswith("/_admin/"):
            self._dispatch(method, path, query, body, ADMIN_ROUTES)
            return
        decision = sim.faults.decide(method, _device_in(path))
        if decision.latency:
            time.sleep(decision.latency)
        if decision.status is not None and not decision.after_apply:
            self._record(method, path, decision.status)
            headers = {}
            if decision.status == 429 and decision.retry_after is not None:
                headers["Retry-After"] = _format_seconds(decision.retry_after)
            self._reply(decision.status, {"errors": ["injected fault"]}, headers)
            return
        self._dispatch(method, path, query, body, API_ROUTES, lost=decision.lost,
                       error_after=decision.status if decision.after_apply else None)

    def _notify(self, method: str, path: str, query: dict[str, str], body: Any) -> None:
        """A BMC's notification. sushy-emulator sends no credentials, so instead of the
        token only loopback peers are heard: an API listening on 0.0.0.0 (a container)
        must not let the network power devices off."""
        if not ipaddress.ip_address(self.client_address[0]).is_loopback:
            self._record(method, path, 403)
            self._reply(403, {"errors": ["BMC notifications are accepted on loopback only"]})
            return
        self._dispatch(method, path, query, body, NOTIFY_ROUTES)

    def _dispatch(self, method: str, path: str, query: dict[str, str], body: Any,
                  routes: list[Route], lost: bool = False,
                  error_after: int | None = None) -> None:
        """Run the handler; then reply, drop the reply (``lost``), or answer the
        ``error_after`` status in its place (the action was applied all the same)."""
        sim = self.server.sim
        try:
            status, payload = _route(routes, method, path)(sim, query, body)
        except ApiError as error:
            status, payload = error.status, {"errors": [str(error)]}
        except Exception as error:  # a simulator bug must still answer something
            log.exception("simulator API handler failed")
            status, payload = 500, {"errors": [f"simulator error: {error}"]}
        applied = status < 400
        if lost:
            self._record(method, path, "lost", applied=applied)
            self.close_connection = True
            return
        if error_after is not None:
            self._record(method, path, error_after, applied=applied)
            self._reply(error_after, {"errors": ["injected fault (after the action)"]})
            return
        self._record(method, path, status, applied=applied)
        self._reply(status, payload)

    def _read_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as error:
            raise ApiError(422, "request body is not JSON") from error

    def _record(self, method: str, path: str, status: int | str,
                applied: bool = False) -> None:
        request = ApiRequest(method, path, status, at=self._arrived, applied=applied,
                             reservation_id=self._reservation_id)
        with self.server.sim.state.lock:
            self.server.sim.state.requests.append(request)

    def _reply(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        if status >= 400 and self.server.sim.faults.effective(
                getattr(self, "_device_id", None)).api_echo_token:
            payload = _quoting_token(payload, self.headers.get("X-Auth-Token") or "")
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if data:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _quoting_token(payload: Any, token: str) -> Any:
    """``payload``'s error texts with the request's token quoted in each: what the
    ``api_echo_token`` fault answers, as APIs that echo credentials in errors do."""
    if not isinstance(payload, dict):
        return payload
    note = f" (request made with token {token})"
    quoted = dict(payload)
    if isinstance(quoted.get("errors"), list):
        quoted["errors"] = [f"{error}{note}" for error in quoted["errors"]]
    if quoted.get("error"):
        quoted["error"] = f"{quoted['error']}{note}"
    return quoted


def _format_seconds(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else f"{seconds:g}"


def _device_in(path: str) -> str | None:
    parts = path.strip("/").split("/")
    return parts[1] if len(parts) >= 2 and parts[0] == "devices" else None


def _route(routes: list[Route], method: str, path: str) -> Callable[..., Reply]:
    allowed = False
    for route_method, pattern, handler in routes:
        match = pattern.fullmatch(path)
        if match:
            allowed = True
            if route_method == method:
                return lambda sim, q, b: handler(sim, q, b, **match.groupdict())
    raise ApiError(405 if allowed else 404, "Not found" if not allowed else "Method not allowed")


def _include(query: dict[str, str]) -> set[str]:
    return {part for part in query.get("include", "").split(",") if part}


def _paginate(items: list[Any], query: dict[str, str], path: str,
              key: str, render: Callable[[Any], Any]) -> Reply:
    """One page of ``items`` with the real ``meta`` object (no ``next`` on the last page)."""
    try:
        page = int(query.get("page", 1))
        per_page = int(query.get("per_page", 10))
    except ValueError as error:
        raise ApiError(422, "page and per_page must be integers") from error
    if not 1 <= page <= 100000 or not 1 <= per_page <= 1000:
        raise ApiError(422, "page must be in 1..100000 and per_page in 1..1000")
    last_page = max(1, math.ceil(len(items) / per_page))

    def href(number: int) -> dict[str, str]:
        return {"href": f"{API_PREFIX}{path}?page={number}&per_page={per_page}"}

    meta: dict[str, Any] = {"first": href(1), "last": href(last_page), "self": href(page),
                            "total": len(items), "current_page": page, "last_page": last_page}
    if page > 1:
        meta["previous"] = href(min(page - 1, last_page))
    if page < last_page:
        meta["next"] = href(page + 1)
    chunk = items[(page - 1) * per_page: page * per_page]
    return 200, {key: [render(item) for item in chunk], "meta": meta}


def _check_project(sim: Simulator, project: str) -> None:
    if project != sim.state.project_id:
        raise ApiError(404, "Not found")


# -- API handlers ---------------------------------------------------------------


def list_devices(sim: Simulator, query: dict[str, str], body: Any, project: str) -> Reply:
    _check_project(sim, project)
    include = _include(query)
    with sim.state.lock:
        return _paginate(sim.state.project_devices(), query, f"/projects/{project}/devices",
                         "devices", lambda d: sim.state.device_json(d, include))


def create_device(sim: Simulator, query: dict[str, str], body: Any, project: str) -> Reply:
    _check_project(sim, project)
    if not isinstance(body, dict):
        raise ApiError(422, "a JSON object body is required")
    device = sim.create_device(body)
    with sim.state.lock:
        return 201, sim.state.device_json(device)


def get_device(sim: Simulator, query: dict[str, str], body: Any, device: str) -> Reply:
    with sim.state.lock:
        return 200, sim.state.device_json(sim.state.get_device(device), _include(query))


def device_action(sim: Simulator, query: dict[str, str], body: Any, device: str) -> Reply:
    action = (body or {}).get("type") if isinstance(body, dict) else None
    if action not in ("power_on", "power_off", "reboot", "rescue", "reinstall"):
        sim.state.get_device(device)
        raise ApiError(422, f"unsupported action type {action!r}")
    if action != "reboot":
        raise ApiError(422, f"the simulator only implements reboot, not {action}")
    sim.reboot_device(device)
    return 202, None


def list_reservations(sim: Simulator, query: dict[str, str], body: Any, project: str) -> Reply:
    _check_project(sim, project)
    include = _include(query)
    with sim.state.lock:
        return _paginate(sim.state.project_reservations(), query,
                         f"/projects/{project}/hardware-reservations", "hardware_reservations",
                         lambda r: sim.state.reservation_json(r, include))


def get_reservation(sim: Simulator, query: dict[str, str], body: Any, reservation: str) -> Reply:
    with sim.state.lock:
        found = sim.state.get_reservation(reservation)
        return 200, sim.state.reservation_json(found, _include(query))


def list_ssh_keys(sim: Simulator, query: dict[str, str], body: Any, project: str) -> Reply:
    _check_project(sim, project)
    with sim.state.lock:
        keys = sorted(sim.state.ssh_keys.values(), key=lambda k: (k.created_at, k.id))
        return 200, {"ssh_keys": [sim.state.ssh_key_json(k) for k in keys]}


def create_ssh_key(sim: Simulator, query: dict[str, str], body: Any, project: str) -> Reply:
    _check_project(sim, project)
    if not isinstance(body, dict):
        raise ApiError(422, "a JSON object body is required")
    return 201, sim.state.ssh_key_json(sim.state.create_ssh_key(body))


def get_ssh_key(sim: Simulator, query: dict[str, str], body: Any, key: str) -> Reply:
    return 200, sim.state.ssh_key_json(sim.state.get_ssh_key(key))


def update_ssh_key(sim: Simulator, query: dict[str, str], body: Any, key: str) -> Reply:
    if not isinstance(body, dict):
        raise ApiError(422, "a JSON object body is required")
    return 200, sim.state.ssh_key_json(sim.state.update_ssh_key(key, body))


# -- admin handlers -------------------------------------------------------------


def admin_state(sim: Simulator, query: dict[str, str], body: Any) -> Reply:
    return 200, sim.snapshot()


def admin_faults(sim: Simulator, query: dict[str, str], body: Any) -> Reply:
    """Body: {"clear", "device_id", "fail_next": {...}, "lose_next": {...},
    "fail_after_apply_next": {...}, **settings}."""
    body = dict(body or {})
    if body.pop("clear", False):
        sim.faults.clear()
    device_id = body.pop("device_id", None)
    if "fail_next" in body:
        sim.faults.fail_next(device_id=device_id, **body.pop("fail_next"))
    if "lose_next" in body:
        sim.faults.lose_next(device_id=device_id, **body.pop("lose_next"))
    if "fail_after_apply_next" in body:
        sim.faults.fail_after_apply_next(device_id=device_id, **body.pop("fail_after_apply_next"))
    try:
        sim.faults.set(device_id, **body)
    except (TypeError, ValueError) as error:
        raise ApiError(422, str(error)) from error
    return 200, sim.faults.snapshot()


def admin_foreign_device(sim: Simulator, query: dict[str, str], body: Any) -> Reply:
    body = dict(body or {})
    device = sim.create_foreign_device(str(body.get("reservation_id")), body.get("hostname"))
    with sim.state.lock:
        return 201, sim.state.device_json(device)


def admin_kill_agent(sim: Simulator, query: dict[str, str], body: Any, device: str) -> Reply:
    sim.state.get_device(device)
    return 200, {"killed": sim.kill_agent(device)}


def admin_hang(sim: Simulator, query: dict[str, str], body: Any, device: str) -> Reply:
    """The "hung machine" fault, for a simulator run as a separate process (the demo)."""
    sim.state.get_device(device)
    return 200, {"killed": sim.hang(device)}


def admin_power(sim: Simulator, query: dict[str, str], body: Any, device: str) -> Reply:
    """Body ``{"on": bool}``: power behind the BMC's back (a pulled cable)."""
    on = (body or {}).get("on") if isinstance(body, dict) else None
    if not isinstance(on, bool):
        raise ApiError(422, 'a body {"on": true|false} is required')
    sim.state.get_device(device)
    return 200, {"changed": sim.set_power(device, on)}


def admin_rotate_host_key(sim: Simulator, query: dict[str, str], body: Any,
                          device: str) -> Reply:
    sim.state.get_device(device)
    return 200, {"host_key": sim.rotate_host_key(device)}


# -- BMC notifications ----------------------------------------------------------


def bmc_notify(sim: Simulator, query: dict[str, str], body: Any) -> Reply:
    """sushy-emulator's fake driver PUTs the whole system after every change: ``name``
    (the device id here), ``power_state`` ("On"/"Off": what the BMC reports now) and
    ``pending_power`` (a change due later, announced again when it lands) and
    ``boot_device`` (its boot override, once one was set: a change of it is notified
    too). A restart arrives as "Off" at once, then "On". The boot override is recorded
    before the power is applied: a device with a disk boots by it at power on."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise ApiError(422, "expected a Redfish system's JSON with a name")
    power = body.get("power_state")
    if power not in ("On", "Off"):
        raise ApiError(422, f"power_state {power!r} is neither On nor Off")
    boot = body.get("boot_device")
    if boot is not None and not isinstance(boot, str):
        raise ApiError(422, f"boot_device {boot!r} is not a string")
    device = body["name"]
    sim.state.get_device(device)
    if boot is not None and sim.set_boot_target(device, boot):
        log.info("BMC notification: device %s boot override %s", device, boot)
    changed = sim.set_power(device, power == "On")
    log.info("BMC notification: device %s power %s%s", device, power,
             "" if changed else " (unchanged)")
    return 200, {"device_id": device, "powered": power == "On", "changed": changed}


def _r(method: str, pattern: str, handler: Callable[..., Reply]) -> Route:
    return method, re.compile(pattern), handler


_ID = r"[^/]+"
API_ROUTES: list[Route] = [
    _r("GET", rf"/projects/(?P<project>{_ID})/devices", list_devices),
    _r("POST", rf"/projects/(?P<project>{_ID})/devices", create_device),
    _r("GET", rf"/devices/(?P<device>{_ID})", get_device),
    _r("POST", rf"/devices/(?P<device>{_ID})/actions", device_action),
    _r("GET", rf"/projects/(?P<project>{_ID})/hardware-reservations", list_reservations),
    _r("GET", rf"/hardware-reservations/(?P<reservation>{_ID})", get_reservation),
    _r("GET", rf"/projects/(?P<project>{_ID})/ssh-keys", list_ssh_keys),
    _r("POST", rf"/projects/(?P<project>{_ID})/ssh-keys", create_ssh_key),
    _r("GET", rf"/ssh-keys/(?P<key>{_ID})", get_ssh_key),
    _r("PUT", rf"/ssh-keys/(?P<key>{_ID})", update_ssh_key),
]
ADMIN_ROUTES: list[Route] = [
    _r("GET", r"/_admin/state", admin_state),
    _r("POST", r"/_admin/faults", admin_faults),
    _r("POST", r"/_admin/devices", admin_foreign_device),
    _r("POST", rf"/_admin/devices/(?P<device>{_ID})/kill-agent", admin_kill_agent),
    _r("POST", rf"/_admin/devices/(?P<device>{_ID})/hang", admin_hang),
    _r("POST", rf"/_admin/devices/(?P<device>{_ID})/power", admin_power),
    _r("POST", rf"/_admin/devices/(?P<device>{_ID})/rotate-host-key", admin_rotate_host_key),
]
NOTIFY_ROUTES: list[Route] = [_r("PUT", NOTIFY_PATH, bmc_notify)]
