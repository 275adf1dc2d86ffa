"""Settings: every knob from ``SHEPHERD_*`` environment variables, with embedded defaults.

One frozen object built once per process (``Settings.from_env()``); command-line
flags override by building a new one with ``dataclasses.replace``. Secrets (the
provider API token) come only from the environment or files, never from flags,
and never appear in ``repr``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import bmdb


class SettingsError(ValueError):
    """A SHEPHERD_* variable has a value that cannot be used; the message names it."""


def _get(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(f"SHEPHERD_{name}", default)


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = _get(env, name, str(default))
    try:
        value = float(raw)
    except ValueError as error:
        raise SettingsError(f"SHEPHERD_{name}={raw!r} is not a number") from error
    if value < 0:
        raise SettingsError(f"SHEPHERD_{name}={raw!r} must not be negative")
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = _get(env, name, str(default))
    try:
        return int(raw)
    except ValueError as error:
        raise SettingsError(f"SHEPHERD_{name}={raw!r} is not a whole number") from error


def _backoff(env: Mapping[str, str], name: str, default: bmdb.Backoff) -> bmdb.Backoff:
    """``SHEPHERD_<NAME>_BACKOFF=initial,maximum,exponent`` (seconds, seconds, factor)."""
    raw = env.get(f"SHEPHERD_{name}_BACKOFF")
    if raw is None:
        return default
    try:
        initial, maximum, exponent = (float(part) for part in raw.split(","))
    except ValueError as error:
        raise SettingsError(
            f"SHEPHERD_{name}_BACKOFF={raw!r}: expected initial,maximum,exponent"
        ) from error
    return bmdb.Backoff(initial=initial, maximum=maximum, exponent=exponent)


@dataclass(frozen=True)
class Settings:
    # Where things are.
    bmdb_url: str = "sqlite:///var/bmdb.sqlite"
    broker_url: str = "sqla+sqlite:///var/broker.sqlite"
    result_backend: str = "db+sqlite:///var/results.sqlite"
    state_dir: Path = Path("var")
    # The provider: "simulator" (default), "equinix" or "static".
    provider: str = "simulator"
    provider_url: str = ""
    provider_project: str = ""
    provider_token: str = field(default="", repr=False)
    static_inventory: str = ""
    device_prefix: str = "shepherd-"
    ssh_key_label: str = "shepherd"
    ssh_key_path: Path = Path("var/ssh/shepherd_ed25519")
    bmaas_endpoint: str = "http://127.0.0.1:8080"
    # Intervals (seconds) of what beat schedules.
    reconcile_interval: float = 60.0
    update_interval: float = 60.0
    source_interval: float = 5.0
    sweep_interval: float = 5.0
    # Sourcing and handoff.
    batch_size: int = 20
    in_flight_cap: int = 100
    dispatch_ttl: float = 120.0
    # Sessions and thresholds.
    session_interval: float = 5.0
    first_heartbeat_timeout: float = 30 * 60.0
    heartbeat_timeout: float = 10 * 60.0
    # SSH.
    ssh_connect_timeout: float = 10.0
    ssh_exec_timeout: float = 60.0
    # Backoffs.
    agent_start_backoff: bmdb.Backoff = bmdb.backoff.AGENT_START_BACKOFF
    recovery_backoff: bmdb.Backoff = bmdb.backoff.RECOVERY_BACKOFF

    @property
    def thresholds(self) -> bmdb.Thresholds:
        return bmdb.Thresholds(
            first_heartbeat=self.first_heartbeat_timeout, heartbeat=self.heartbeat_timeout
        )

    def with_overrides(self, **changes: object) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        d = cls()
        return cls(
            bmdb_url=_get(env, "BMDB_URL", d.bmdb_url),
            broker_url=_get(env, "BROKER_URL", d.broker_url),
            result_backend=_get(env, "RESULT_BACKEND", d.result_backend),
            state_dir=Path(_get(env, "STATE_DIR", str(d.state_dir))),
            provider=_get(env, "PROVIDER", d.provider),
            provider_url=_get(env, "PROVIDER_URL", d.provider_url),
            provider_project=_get(env, "PROVIDER_PROJECT", d.provider_project),
            provider_token=_read_secret(env, "PROVIDER_TOKEN"),
            static_inventory=_get(env, "STATIC_INVENTORY", d.static_inventory),
            device_prefix=_get(env, "DEVICE_PREFIX", d.device_prefix),
            ssh_key_label=_get(env, "SSH_KEY_LABEL", d.ssh_key_label),
            ssh_key_path=Path(_get(env, "SSH_KEY_PATH", str(d.ssh_key_path))),
            bmaas_endpoint=_get(env, "BMAAS_ENDPOINT", d.bmaas_endpoint),
            reconcile_interval=_float(env, "RECONCILE_INTERVAL", d.reconcile_interval),
            update_interval=_float(env, "UPDATE_INTERVAL", d.update_interval),
            source_interval=_float(env, "SOURCE_INTERVAL", d.source_interval),
            sweep_interval=_float(env, "SWEEP_INTERVAL", d.sweep_interval),
            batch_size=_int(env, "BATCH_SIZE", d.batch_size),
            in_flight_cap=_int(env, "IN_FLIGHT_CAP", d.in_flight_cap),
            dispatch_ttl=_float(env, "DISPATCH_TTL", d.dispatch_ttl),
            session_interval=_float(env, "SESSION_INTERVAL", d.session_interval),
            first_heartbeat_timeout=_float(
                env, "FIRST_HEARTBEAT_TIMEOUT", d.first_heartbeat_timeout
            ),
            heartbeat_timeout=_float(env, "HEARTBEAT_TIMEOUT", d.heartbeat_timeout),
            ssh_connect_timeout=_float(env, "SSH_CONNECT_TIMEOUT", d.ssh_connect_timeout),
            ssh_exec_timeout=_float(env, "SSH_EXEC_TIMEOUT", d.ssh_exec_timeout),
            agent_start_backoff=_backoff(env, "AGENT_START", d.agent_start_backoff),
            recovery_backoff=_backoff(env, "RECOVERY", d.recovery_backoff),
        )


def _read_secret(env: Mapping[str, str], name: str) -> str:
    """``SHEPHERD_<NAME>`` or the contents of the file named by ``SHEPHERD_<NAME>_FILE``."""
    path = env.get(f"SHEPHERD_{name}_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as error:
            raise SettingsError(f"SHEPHERD_{name}_FILE={path!r}: {error.strerror}") from error
    return env.get(f"SHEPHERD_{name}", "")
