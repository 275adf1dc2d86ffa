"""Equinix Metal: an API client (``requests`` + ``tenacity``) and the provider on top of it.

Why the client looks the way it does (the Equinix Metal API as it was documented):

* Every call goes through one process-wide limiter per base URL (a minimum interval
  between calls and a cap on calls in flight), because the API's limits are per
  token, not per thread.
* 5xx, 429 (honouring Retry-After) and connection errors/timeouts are retried with
  exponential backoff; 401/403/404/422 never are. Errors are typed and their text
  is built from method, path and status only, and they are raised outside the
  ``except`` that caught a ``requests`` exception, so no ``__context__`` leads to a
  request object holding the token.
* Redirects are never followed: ``requests`` keeps ``X-Auth-Token`` on a redirect to
  another host, so a 3xx would hand the token to whoever it points at.
* The API's own error text is the one part of an error the API writes, and an API may
  echo the token in it. The token is removed from it before it is shortened, and
  every error leaving the client or the provider (with the errors it chains to) is
  scrubbed once more (``EquinixClient.scrubbed``), so task results, history causes
  and logs never hold it, whatever a future message quotes.
* Device creation is not idempotent server-side. We use the hardware reservation
  as the lock and a unique witness tag per creation intent: each attempt first
  looks at the reservation; a device there with our witness is ours (an earlier
  attempt whose reply was lost), one without it means we lost a race. The POST
  itself is never blindly re-sent.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import requests
import tenacity

import bmdb
from shepherd.providers.base import (
    CallObserver,
    Capacity,
    ConfigError,
    NotFound,
    PermanentError,
    ProviderError,
    ProviderMachine,
    RaceLost,
    TransientExhausted,
    no_observer,
    refuse_placeholder,
)
from shepherd.providers.ssh_keys import ensure_registered, same_key
from shepherd.redaction import redact_url, scrub

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_BASE_URL = "https://api.equinix.com/metal/v1"
MANAGED_TAG = "managed-by:shepherd"
WITNESS_PREFIX = "shepherd-witness:"
# What a device shows while a reboot is under way (the state enum has no "rebooting").
REBOOTING_STATES = frozenset({"powering_off", "powering_on"})

STATE_MAP: dict[str, bmdb.ProviderStatus] = {
    "queued": bmdb.ProviderStatus.PROVISIONING,
    "provisioning": bmdb.ProviderStatus.PROVISIONING,
    "reinstalling": bmdb.ProviderStatus.PROVISIONING,
    "post_provisioning": bmdb.ProviderStatus.PROVISIONING,
    "active": bmdb.ProviderStatus.RUNNING,
    "inactive": bmdb.ProviderStatus.STOPPED,
    "powering_off": bmdb.ProviderStatus.STOPPED,
    "powering_on": bmdb.ProviderStatus.STOPPED,
    "failed": bmdb.ProviderStatus.FAILED,
    "deleted": bmdb.ProviderStatus.MISSING,
    "deprovisioning": bmdb.ProviderStatus.MISSING,
}


def provider_status(state: str | None) -> bmdb.ProviderStatus:
    """Map a device ``state`` (an open enum) to the shepherd's status."""
    status = STATE_MAP.get(state or "")
    if status is None:
        log.warning("unknown Equinix device state %r, recording Unknown", state)
        return bmdb.ProviderStatus.UNKNOWN
    return status


class _Transient(ProviderError):
    """One transient failure; retried, surfacing as ``TransientExhausted`` at the end.

    ``status`` is the HTTP status when the server answered, None when no answer came
    at all (connection error, timeout): callers of non-idempotent endpoints need the
    difference to judge whether the attempt may have landed unseen.
    """

    def __init__(self, message: str, status: int | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


# -- rate limiting ------------------------------------------------------------------


class RateLimiter:
    """A minimum interval between call starts and a cap on calls in flight.

    ``shared`` hands out one limiter per base URL for the whole process, so all
    threads (and all clients) talking to the same API share the budget. The first
    client to ask for a base URL sets its parameters.
    """

    _registry: dict[str, RateLimiter] = {}
    _registry_lock = threading.Lock()

    def __init__(self, min_interval: float, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.min_interval = max(0.0, min_interval)
        self.max_in_flight = max_in_flight
        self._semaphore = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._next_start = 0.0

    @classmethod
    def shared(cls, key: str, min_interval: float, max_in_flight: int) -> RateLimiter:
        with cls._registry_lock:
            limiter = cls._registry.get(key)
            if limiter is None:
                limiter = cls._registry[key] = cls(min_interval, max_in_flight)
            elif (limiter.min_interval, limiter.max_in_flight) != (min_interval, max_in_flight):
                log.warning("rate limiter for %s already set to %.3fs / %d in flight", key,
                            limiter.min_interval, limiter.max_in_flight)
            return limiter

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one in-flight slot, starting no sooner than ``min_interval`` after the last."""
        with self._semaphore:
            with self._lock:
                now = time.monotonic()
                start = max(now, self._next_start)
                self._next_start = start + self.min_interval
            if start > now:
                time.sleep(start - now)
            yield


# -- client ------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientConfig:
    """How to reach the API and how hard to try. ``token`` is never shown in a repr."""

    token: str = field(repr=False)
    project_id: str
    base_url: str = DEFAULT_BASE_URL
    min_interval: float = 0.2         # seconds between call starts, per process
    max_in_flight: int = 3            # concurrent calls, per process
    retries: int = 5                  # retries after the first attempt
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    retry_after_max: float = 120.0    # never sleep longer than this on a Retry-After
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    per_page: int = 100


class EquinixClient:
    """The Equinix Metal API subset Shepherd needs; thread-safe.

    ``observer`` wraps every HTTP exchange (see ``CallObserver``), e.g.
    ``shepherd.metrics.provider_call`` to count and time them; by default nothing is
    noted.
    """

    def __init__(self, config: ClientConfig, *, observer: CallObserver = no_observer) -> None:
        if not config.token:
            raise ConfigError("Equinix API token is empty")
        refuse_placeholder("Equinix project id", config.project_id)
        self.config = config
        self.observer = observer
        self.base_url = config.base_url.rstrip("/")
        self.limiter = RateLimiter.shared(self.base_url, config.min_interval,
                                          config.max_in_flight)
        self._local = threading.local()

    def __repr__(self) -> str:
        return (f"EquinixClient({redact_url(self.base_url)!r}, "
                f"project={self.config.project_id!r})")

    def scrub(self, text: str) -> str:
        """``text`` without the configured token (see ``shepherd.redaction.scrub``)."""
        return scrub(text, self.config.token)

    @contextlib.contextmanager
    def scrubbed(self) -> Iterator[None]:
        """Let no ``ProviderError`` out with the token in its text, nor in the text of
        the exceptions it chains to (a traceback shows those too)."""
        try:
            yield
        except ProviderError as error:
            _scrub_chain(error, self.scrub)
            raise

    @property
    def _session(self) -> requests.Session:
        # One session per thread: requests.Session is not documented thread-safe.
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.headers.update({"X-Auth-Token": self.config.token,
                                    "Accept": "application/json",
                                    "User-Agent": "shepherd/0.1"})
            # The environment's proxies and CA bundle for the API, read once: with
            # trust_env, requests reads the whole environment at every request.
            found = session.merge_environment_settings(self.base_url, {}, None, None, None)
            session.proxies.update(found["proxies"])
            session.verify = found["verify"]
            session.trust_env = False
            self._local.session = session
        return session

    # -- transport ----------------------------------------------------------

    def _once(self, method: str, path: str, params: dict[str, Any] | None = None,
              body: Any = None) -> dict[str, Any] | None:
        """One HTTP exchange: the reply's JSON object, or None for an empty reply.

        Raises typed errors, ``_Transient`` for retryable ones. Every reply of the API
        is an object: any other JSON is refused here, so that no caller reads a list
        or a number as one."""
        what = f"{method} {path}"
        response = self._send(what, method, path, params, body)
        status = response.status_code
        if status == 429 or status >= 500:
            raise _Transient(f"{what}: HTTP {status}", status, _retry_after(response))
        if 300 <= status < 400:
            raise PermanentError(f"{what}: HTTP {status}: redirect not followed (the API "
                                 "token is only sent to the configured base URL)", status)
        if status == 404:
            raise NotFound(f"{what}: not found")
        if status >= 400:
            raise PermanentError(f"{what}: HTTP {status}: "
                                 f"{_error_text(response, self.scrub)}", status)
        if not response.content:
            return None
        try:
            document = response.json()
        except ValueError:
            pass  # raised below, so the decode error is not the new error's __context__
        else:
            if isinstance(document, dict):
                return document
            raise PermanentError(f"{what}: HTTP {status} with JSON that is not an object "
                                 f"({type(document).__name__})", status)
        raise _Transient(f"{what}: HTTP {status} with a body that is not JSON", status)

    def _send(self, what: str, method: str, path: str, params: dict[str, Any] | None,
              body: Any) -> requests.Response:
        """Send one request, never following redirects.

        A ``requests`` exception carries the prepared request, token header included;
        the typed error is raised after the ``except`` so it is not even its
        ``__context__``.
        """
        failure: ProviderError
        try:
            with self.limiter.slot(), self.observer(method, path) as call:
                response = self._session.request(
                    method, self.base_url + path, params=params, json=body,
                    timeout=(self.config.connect_timeout, self.config.read_timeout),
                    allow_redirects=False,
                )
                call.status = response.status_code
                return response
        except (requests.ConnectionError, requests.Timeout) as error:
            failure = _Transient(f"{what}: {type(error).__name__}")  # no answer: status None
        except requests.RequestException as error:
            failure = ProviderError(f"{what}: {type(error).__name__}")
        raise failure

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``, retrying ``_Transient`` with backoff; ``TransientExhausted`` at the end."""
        exponential = tenacity.wait_exponential_jitter(
            multiplier=self.config.backoff_initial, max=self.config.backoff_max,
            jitter=self.config.backoff_initial / 2,
        )

        def wait(state: tenacity.RetryCallState) -> float:
            error = state.outcome.exception() if state.outcome else None
            if isinstance(error, _Transient) and error.retry_after is not None:
                return min(error.retry_after, self.config.retry_after_max)
            return exponential(state)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_Transient),
            stop=tenacity.stop_after_attempt(self.config.retries + 1),
            wait=wait,
            before_sleep=lambda s: log.info(
                "Equinix %s: %s; retry %d", what,
                self.scrub(str(s.outcome.exception() if s.outcome else None)),
                s.attempt_number),
            reraise=True,
        )
        with self.scrubbed():
            try:
                return retrying(call)
            except _Transient as error:
                last = str(error)
            raise TransientExhausted(f"{what}: gave up after {self.config.retries + 1} "
                                     f"attempts: {last}")

    def request(self, method: str, path: str, params: dict[str, Any] | None = None,
                body: Any = None) -> dict[str, Any] | None:
        """One call with retries (only for calls that are safe to repeat)."""
        return self._retrying(f"{method} {path}", lambda: self._once(method, path, params, body))

    def _paginated(self, path: str, key: str, params: dict[str, Any] | None = None) -> list[Any]:
        """Every item of a paginated list."""
        return list(self._items(path, key, params))

    def _items(self, path: str, key: str, params: dict[str, Any] | None = None
               ) -> Iterator[Any]:
        """The items of a paginated list as they come: pages 1..meta.last_page at a fixed
        per_page, each asked for only once the previous one is consumed."""
        page = 1
        while True:
            query = {**(params or {}), "page": page, "per_page": self.config.per_page}
            body = self.request("GET", path, query) or {}
            yield from body.get(key) or []
            meta = body.get("meta") or {}
            last_page = int(meta.get("last_page") or page)
            if page >= last_page or not meta.get("next"):
                return
            page += 1

    # -- endpoints ----------------------------------------------------------

    def list_devices(self) -> list[dict[str, Any]]:
        return list(self.devices())

    def devices(self) -> Iterator[dict[str, Any]]:
        """The project's devices a page at a time (``list_devices``, streamed)."""
        return self._items(f"/projects/{self.config.project_id}/devices", "devices")

    def get_device(self, device_id: str) -> dict[str, Any]:
        path = f"/devices/{_segment(device_id)}"
        return _object("GET", path, self.request("GET", path))

    def list_reservations(self) -> list[dict[str, Any]]:
        return self._paginated(f"/projects/{self.config.project_id}/hardware-reservations",
                               "hardware_reservations")

    def get_reservation(self, reservation_id: str, include_device: bool = True) -> dict[str, Any]:
        params = {"include": "device"} if include_device else None
        path = f"/hardware-reservations/{_segment(reservation_id)}"
        return _object("GET", path, self.request("GET", path, params))

    def list_ssh_keys(self) -> list[dict[str, Any]]:
        body = self.request("GET", f"/projects/{self.config.project_id}/ssh-keys") or {}
        return list(body.get("ssh_keys") or [])

    def create_ssh_key(self, label: str, key: str) -> dict[str, Any]:
        """Register a key, at most once.

        A 429 was refused before anything happened, so it is simply retried. A 5xx or
        a lost reply may have registered the key, so the retry first looks for a key
        with our label and blob and returns it instead of POSTing a duplicate.
        """
        path = f"/projects/{self.config.project_id}/ssh-keys"
        maybe_applied = False

        def attempt() -> dict[str, Any]:
            nonlocal maybe_applied
            if maybe_applied:
                existing = self._find_ssh_key(label, key)
                if existing is not None:
                    return existing
            try:
                return _object("POST", path,
                               self._once("POST", path, body={"label": label, "key": key}))
            except _Transient as error:
                maybe_applied = maybe_applied or error.status != 429
                raise

        return self._retrying(f"POST {path}", attempt)

    def _find_ssh_key(self, label: str, key: str) -> dict[str, Any] | None:
        for existing in self.list_ssh_keys():
            if existing.get("label") == label and same_key(str(existing.get("key") or ""), key):
                return existing
        return None

    def update_ssh_key(self, key_id: str, *, label: str | None = None,
                       key: str | None = None) -> dict[str, Any]:
        body = {k: v for k, v in (("label", label), ("key", key)) if v is not None}
        path = f"/ssh-keys/{_segment(key_id)}"
        return _object("PUT", path, self.request("PUT", path, body=body))

    def reboot_device(self, device_id: str) -> None:
        """Request a reboot (202); the action is not idempotent.

        A 422 ("wrong state") on a retry may mean an earlier attempt landed and the
        device is rebooting. That is only possible if an attempt got no HTTP answer at
        all (a 5xx or 429 is an answer: nothing was done), and it is only believed if
        the device is seen rebooting; otherwise the 422 stands.
        """
        path = f"/devices/{_segment(device_id)}/actions"
        unanswered = False

        def attempt() -> None:
            nonlocal unanswered
            try:
                self._once("POST", path, body={"type": "reboot"})
            except _Transient as error:
                unanswered = unanswered or error.status is None
                raise
            except PermanentError as error:
                if not (unanswered and error.status == 422 and self._rebooting(device_id)):
                    raise

        self._retrying(f"POST {path}", attempt)

    def _rebooting(self, device_id: str) -> bool:
        return self.get_device(device_id).get("state") in REBOOTING_STATES

    def create_device(self, reservation_id: str, body: dict[str, Any],
                      witness: str) -> dict[str, Any]:
        """Create a device on ``reservation_id`` at most once for ``witness``.

        Each attempt: look at the reservation (ours already? someone else's?), then
        POST once. Transient failures repeat the whole attempt, so a POST whose reply
        was lost is found on the reservation instead of being sent again.
        """
        body = {**body, "hardware_reservation_id": reservation_id,
                "tags": _with_tags(body.get("tags"), MANAGED_TAG, witness)}
        path = f"/projects/{self.config.project_id}/devices"

        def attempt() -> dict[str, Any]:
            existing = self._device_on(reservation_id, witness)
            if existing is not None:
                return existing
            try:
                return _object("POST", path, self._once("POST", path, body=body))
            except PermanentError as error:
                if error.status != 422:
                    raise
                # Maybe an earlier, unanswered POST of ours took it meanwhile.
                found = self._device_on(reservation_id, witness)
                if found is not None:
                    return found
                raise

        return self._retrying(f"POST {path}", attempt)

    def _device_on(self, reservation_id: str, witness: str) -> dict[str, Any] | None:
        """Our device on the reservation, None if it is free; ``RaceLost`` if taken."""
        reservation = self.get_reservation(reservation_id)
        device = reservation.get("device")
        if not device:
            if reservation.get("provisionable") is False:
                raise PermanentError(f"hardware reservation {reservation_id} is not "
                                     "provisionable", 422)
            return None
        if "tags" not in device:  # href only (the API's default): fetch the device itself
            device = self.get_device(str(device.get("id") or _id_from_href(device["href"])))
        if witness in (device.get("tags") or []):
            return device
        raise RaceLost(f"hardware reservation {reservation_id} was taken by device "
                       f"{device.get('id')} (not carrying our witness tag)", 422)


def _segment(value: str) -> str:
    if not value or "/" in value or "?" in value:
        raise NotFound(f"invalid id {value!r}")
    return value


def _witness(device: dict[str, Any]) -> str | None:
    """The request id of the creation that made ``device`` (its witness tag), if ours."""
    tags = [str(t) for t in device.get("tags") or []]
    return next((t.removeprefix(WITNESS_PREFIX) for t in tags
                 if t.startswith(WITNESS_PREFIX)), None)


def _id_from_href(href: str) -> str:
    """The id at the end of an ``href`` such as ``/metal/v1/devices/<id>``."""
    return href.rstrip("/").rsplit("/", 1)[-1]


def _with_tags(tags: Any, *extra: str) -> list[str]:
    out = [str(t) for t in tags or []]
    return out + [t for t in extra if t not in out]


def _retry_after(response: requests.Response) -> float | None:
    """Seconds from Retry-After (delta or HTTP date), else X-RateLimit-Reset, else None."""
    value = response.headers.get("Retry-After")
    if value:
        try:
            return max(0.0, float(value))
        except ValueError:
            with contextlib.suppress(TypeError, ValueError):
                return max(0.0, email.utils.parsedate_to_datetime(value).timestamp()
                           - time.time())
    reset = response.headers.get("X-RateLimit-Reset")
    if reset:
        with contextlib.suppress(ValueError):
            return max(0.0, float(reset) - time.time())
    return None


def _error_text(response: requests.Response, clean: Callable[[str], str]) -> str:
    """The API's own error text (``errors`` or ``error``), ``clean``-ed (the token
    removed) and then shortened: a cut first could leave a piece of the token too
    short to be recognised."""
    try:
        body = response.json()
    except ValueError:
        return clean(response.reason or "")[:200]
    if isinstance(body, dict):
        errors = body.get("errors") or ([body["error"]] if body.get("error") else [])
        return clean("; ".join(str(e) for e in errors))[:500]
    return ""


def _scrub_chain(error: BaseException, clean: Callable[[str], str]) -> None:
    """Replace the text of ``error`` and of every exception it chains to by ``clean``'s."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if current.args:
            text = str(current)
            cleaned = clean(text)
            if cleaned != text:
                current.args = (cleaned,)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


# -- provider ----------------------------------------------------------------------


@dataclass(frozen=True)
class ProviderConfig:
    """What the provider adds on top of the client: which devices are ours, how to make them."""

    device_prefix: str
    ssh_key_label: str
    operating_system: str = "ubuntu_22_04"
    ssh_port: int = 22
    name: str = "equinix"


Params = ParamSpec("Params")
Result = TypeVar("Result")
ProviderMethod = Callable[Concatenate["EquinixProvider", Params], Result]


def _scrubbing(method: ProviderMethod[Params, Result]) -> ProviderMethod[Params, Result]:
    """Run a provider method inside its client's ``scrubbed()``: no error it raises,
    whatever built it (``ensure_registered`` quotes API ids), carries the token."""

    @functools.wraps(method)
    def wrapper(self: EquinixProvider, /, *args: Params.args,
                **kwargs: Params.kwargs) -> Result:
        with self.client.scrubbed():
            return method(self, *args, **kwargs)

    return wrapper


class EquinixProvider:
    """``Provider`` for Equinix Metal (and the simulator, which speaks the same API)."""

    def __init__(self, client: EquinixClient, config: ProviderConfig) -> None:
        refuse_placeholder("device prefix", config.device_prefix)
        refuse_placeholder("SSH key label", config.ssh_key_label)
        if not 0 < config.ssh_port < 65536:
            raise ConfigError(f"SSH port {config.ssh_port} is out of range")
        self.client = client
        self.config = config
        self.ssh_key_ids: list[str] = []

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def authoritative(self) -> bool:
        return False  # a project's devices without our record may be someone else's

    @_scrubbing
    def ensure_ssh_key(self, public_key: str, *, replace: bool = False) -> str:
        """Register our public key under the configured label; new devices get only it.
        ``replace``: rotate a different key registered under that label (see
        ``ensure_registered``)."""
        key_id = ensure_registered(self.client, self.config.ssh_key_label, public_key,
                                   replace=replace)
        self.ssh_key_ids = [key_id]
        return key_id

    def machine(self, device: dict[str, Any]) -> ProviderMachine:
        """A ``ProviderMachine`` from a ``Device`` body."""
        state = device.get("state")
        return ProviderMachine(
            provider_id=str(device["id"]),
            address=public_ipv4(device),
            ssh_port=self.config.ssh_port,
            location=_location(device),
            reservation_id=_reservation_id(device),
            status=provider_status(state),
            failed=state == "failed",
            witness=_witness(device),
        )

    def list_machines(self) -> Iterator[ProviderMachine]:
        """Streamed a page at a time (a large project never sits in memory whole), so
        an error comes while iterating; scrubbed there, as ``_scrubbing`` would."""
        prefix = self.config.device_prefix
        with self.client.scrubbed():
            for device in self.client.devices():
                if str(device.get("hostname") or "").startswith(prefix):
                    yield self.machine(device)

    @_scrubbing
    def get_machine(self, provider_id: str) -> ProviderMachine:
        return self.machine(self.client.get_device(provider_id))

    @_scrubbing
    def list_capacity(self) -> list[Capacity]:
        """Reservations we could provision now: provisionable, empty, not in service."""
        out = []
        for reservation in self.client.list_reservations():
            if (reservation.get("device") or not reservation.get("provisionable")
                    or reservation.get("need_of_service")):
                continue
            facility = reservation.get("facility") or {}
            out.append(Capacity(
                reservation_id=str(reservation["id"]),
                location=facility.get("code"),
                plan=(reservation.get("plan") or {}).get("slug"),
                details={"metro": (facility.get("metro") or {}).get("code")},
            ))
        return out

    @_scrubbing
    def create_machine(self, capacity: Capacity) -> ProviderMachine:
        """Create the device, at most once per ``capacity.request_id`` (its witness tag).

        Only API calls: the caller registers the machine in its own transaction.
        """
        metro = capacity.details.get("metro")
        plan = capacity.plan
        if not metro or not plan:
            reservation = self.client.get_reservation(capacity.reservation_id,
                                                      include_device=False)
            facility = reservation.get("facility") or {}
            metro = metro or (facility.get("metro") or {}).get("code") or "any"
            plan = plan or (reservation.get("plan") or {}).get("slug")
        body: dict[str, Any] = {
            "metro": metro,
            "plan": plan,
            "operating_system": self.config.operating_system,
            "hostname": f"{self.config.device_prefix}{capacity.reservation_id[:8]}",
        }
        if self.ssh_key_ids:
            body["project_ssh_keys"] = list(self.ssh_key_ids)
        device = self.client.create_device(capacity.reservation_id, body,
                                           WITNESS_PREFIX + capacity.request_id)
        return self.machine(device)

    @_scrubbing
    def reboot(self, provider_id: str) -> None:
        self.client.reboot_device(provider_id)


def public_ipv4(device: dict[str, Any]) -> str | None:
    """The device's public IPv4 address, if it has one yet.

    A ``management`` address (one the OS was set up with at provisioning) comes
    first: other public IPv4s, such as elastic IPs, may be routed elsewhere. Without
    one, the first public IPv4 is better than nothing.
    """
    public = [entry for entry in device.get("ip_addresses") or []
              if entry.get("public") and entry.get("address_family") == 4
              and entry.get("address")]
    chosen = next((e for e in public if e.get("management")), public[0] if public else None)
    return str(chosen["address"]) if chosen else None


def _location(device: dict[str, Any]) -> str | None:
    facility = device.get("facility") or {}
    metro = device.get("metro") or facility.get("metro") or {}
    return facility.get("code") or metro.get("code")


def _reservation_id(device: dict[str, Any]) -> str | None:
    reservation = device.get("hardware_reservation") or {}
    if reservation.get("id"):
        return str(reservation["id"])
    href = reservation.get("href")
    return _id_from_href(href) if href else None


def _object(method: str, path: str, document: dict[str, Any] | None) -> dict[str, Any]:
    """The object a call must answer with; an empty reply is refused."""
    if document is None:
        raise PermanentError(f"{method} {path}: an empty reply where an object was expected")
    return document
