"""Fault injection for the simulator, globally and per device.

Settings are sticky (until changed or cleared); ``fail_next`` / ``lose_next`` /
``fail_after_apply_next`` are one-shot budgets, which make retry counts deterministic
in tests.

Two kinds of injected error differ in what the server did: a plain injected status
(``api_error_rate``, ``fail_next``) is answered *instead of* the action, so nothing
happened; an error after apply (``api_error_after_apply_rate``,
``fail_after_apply_next``) is answered *after* the action was performed, as when a
gateway times out on a backend that did the work. Only the second can expose a
client that repeats a non-idempotent call (a device created twice).
"""

from __future__ import annotations

import dataclasses
import random
import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class FaultSettings:
    """What can go wrong; per-device values override the global ones field by field."""

    api_latency: float = 0.0          # seconds added to every API reply
    api_error_rate: float = 0.0       # share of API calls answered 500
    api_429_rate: float = 0.0         # share of API calls answered 429
    retry_after: float | None = 1.0   # Retry-After sent with injected 429s (None: no header)
    lost_response_rate: float = 0.0   # share of API calls applied but never answered
    api_error_after_apply_rate: float = 0.0  # share of API calls applied, then answered 500
    ssh_refused: bool = False         # the device's SSH port refuses connections
    ssh_hang: bool = False            # TCP accepted, SSH banner never sent
    ssh_latency: float = 0.0          # seconds each SSH connection waits before its banner
    ssh_exec_hang: bool = False       # SSH works, but commands never answer (a wedged host)
    sftp_stall: bool = False          # SFTP opens files, then never answers a write (stalled)
    api_echo_token: bool = False      # API error texts quote the token the request carried


FIELDS = {f.name for f in dataclasses.fields(FaultSettings)}


@dataclass
class Decision:
    """What to do with one API request."""

    latency: float = 0.0
    status: int | None = None         # an injected error status, or None
    retry_after: float | None = None
    lost: bool = False
    after_apply: bool = False         # ``status`` is answered after the action was applied


@dataclass
class _Budget:
    count: int
    status: int | None = None
    retry_after: float | None = None
    method: str | None = None
    device_id: str | None = None
    lose: bool = False
    after_apply: bool = False

    def matches(self, method: str, device_id: str | None) -> bool:
        if self.method and self.method != method:
            return False
        return not (self.device_id and self.device_id != device_id)


class Faults:
    """Thread-safe fault configuration consulted by the HTTP and SSH servers."""

    def __init__(self, seed: int | None = None) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.global_ = FaultSettings()
        self.per_device: dict[str, dict[str, Any]] = {}
        self._budgets: list[_Budget] = []

    def set(self, device_id: str | None = None, **settings: Any) -> None:
        """Change settings globally, or for one device when ``device_id`` is given."""
        unknown = set(settings) - FIELDS
        if unknown:
            raise ValueError(f"unknown fault settings: {sorted(unknown)}")
        with self._lock:
            if device_id is None:
                self.global_ = dataclasses.replace(self.global_, **settings)
            else:
                self.per_device.setdefault(device_id, {}).update(settings)

    def clear(self) -> None:
        with self._lock:
            self.global_ = FaultSettings()
            self.per_device.clear()
            self._budgets.clear()

    def fail_next(self, count: int, status: int = 500, *, retry_after: float | None = None,
                  method: str | None = None, device_id: str | None = None) -> None:
        """Answer the next ``count`` matching API calls with ``status``."""
        with self._lock:
            self._budgets.append(_Budget(count, status, retry_after, method, device_id))

    def lose_next(self, count: int, *, method: str | None = None,
                  device_id: str | None = None) -> None:
        """Apply the next ``count`` matching API calls but drop their replies."""
        with self._lock:
            self._budgets.append(_Budget(count, method=method, device_id=device_id, lose=True))

    def fail_after_apply_next(self, count: int, status: int = 500, *,
                              method: str | None = None,
                              device_id: str | None = None) -> None:
        """Apply the next ``count`` matching API calls, then answer them with ``status``."""
        with self._lock:
            self._budgets.append(_Budget(count, status, method=method, device_id=device_id,
                                         after_apply=True))

    def effective(self, device_id: str | None) -> FaultSettings:
        with self._lock:
            overrides = self.per_device.get(device_id or "", {})
            return dataclasses.replace(self.global_, **overrides)

    def decide(self, method: str, device_id: str | None) -> Decision:
        """Roll the dice for one API request."""
        settings = self.effective(device_id)
        decision = Decision(latency=settings.api_latency)
        with self._lock:
            for budget in self._budgets:
                if budget.count > 0 and budget.matches(method, device_id):
                    budget.count -= 1
                    decision.lost = budget.lose
                    decision.status = budget.status
                    decision.retry_after = budget.retry_after
                    decision.after_apply = budget.after_apply
                    self._budgets = [b for b in self._budgets if b.count > 0]
                    return decision
            roll = self._rng.random()
        error = settings.api_error_rate
        limited = error + settings.api_429_rate
        lost = limited + settings.lost_response_rate
        if roll < error:
            decision.status = 500
        elif roll < limited:
            decision.status, decision.retry_after = 429, settings.retry_after
        elif roll < lost:
            decision.lost = True
        elif roll < lost + settings.api_error_after_apply_rate:
            decision.status, decision.after_apply = 500, True
        return decision

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "global": dataclasses.asdict(self.global_),
                "per_device": {k: dict(v) for k, v in self.per_device.items()},
                "pending_budgets": [dataclasses.asdict(b) for b in self._budgets],
            }
