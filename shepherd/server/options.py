"""What ``shepherd serve`` serves with, read once from ``Settings``.

Why a record of its own rather than ``Settings`` itself: the listeners want parsed
addresses, a checked certificate pair and the limits grouped per listener, and they
should get them checked once, before any socket is bound. The values come from
``Settings`` only (its defaults included), so the environment, the command line
(``serve.apply_flags``) and the tests all go through the same path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shepherd.config import Settings, parse_listen
from shepherd.runtime import guard_limits
from shepherd.server.limits import ServerLimits
from shepherd.workflows.guard import GuardLimits

#: The BMDB session holder name of the callback server.
COMPONENT = "callback-server"


@dataclass(frozen=True)
class TlsFiles:
    """The PEM certificate and key the listeners serve TLS with."""

    cert: str
    key: str


@dataclass(frozen=True)
class ServeOptions:
    """The callback server's listeners and what they enforce; see ``from_settings``."""

    #: The agents' listener (port 0: any free one).
    listen: tuple[str, int]
    #: The operators' own listener (web view, /metrics, /healthz), if any.
    operator_listen: tuple[str, int] | None
    tls: TlsFiles | None
    #: The operators' listener's certificate (None: ``tls``, the agents' one).
    operator_tls: TlsFiles | None
    #: Refused tokens per client address and minute before it is refused outright.
    login_failures: int
    #: The web view's pages need a login even on a loopback listener.
    login_required: bool
    #: Heartbeat batches written at once (threads, each with a BMDB connection).
    threads: int
    #: Seconds the first heartbeat of a batch waits for others (``group_commit``).
    batch_window: float
    #: Largest heartbeat body in bytes.
    max_body: int
    #: Seconds a heartbeat's timestamp may differ from the server's clock.
    clock_window: float
    #: Serve the operator's pages (fleet inventory: keep them off untrusted networks).
    operator_views: bool
    #: Seconds one /metrics computation is reused for (0: every scrape computes).
    metrics_cache: float
    #: What each listener enforces on its clients.
    limits: ServerLimits
    #: The guard's limits, as a person waits for them: the web view and /metrics say
    #: Recovery is paused exactly when a worker would pause it.
    guard: GuardLimits
    #: The image catalog's directory (``catalog.toml`` and the files it serves).
    image_dir: Path
    #: Seconds without an accepted heartbeat after which the next accepted ones
    #: record a resumption (``resumption``): half a heartbeat timeout, so a pause
    #: long enough to make agents look silent is never missed.
    resumption_gap: float

    @classmethod
    def from_settings(cls, settings: Settings) -> ServeOptions:
        """``ValueError`` naming what is wrong (a listener, half a certificate pair)."""
        tls = _tls_files(settings.serve_tls_cert, settings.serve_tls_key)
        operator_tls = _tls_files(settings.serve_operator_tls_cert,
                                  settings.serve_operator_tls_key, "the operators' listener")
        operator = settings.serve_operator_listen
        return cls(
            listen=parse_listen(settings.serve_listen),
            operator_listen=parse_listen(operator) if operator else None,
            tls=tls, operator_tls=operator_tls, login_failures=settings.serve_login_failures,
            login_required=settings.serve_login_required,
            threads=settings.serve_threads,
            batch_window=settings.serve_batch_window, max_body=settings.serve_max_body,
            clock_window=settings.serve_clock_window,
            operator_views=settings.serve_operator_views,
            metrics_cache=settings.metrics_cache, limits=ServerLimits.from_settings(settings),
            guard=guard_limits(settings, interactive=True),
            image_dir=settings.image_dir, resumption_gap=settings.heartbeat_timeout / 2)


def _tls_files(cert: str, key: str, what: str = "TLS") -> TlsFiles | None:
    if bool(cert) != bool(key):
        raise ValueError(f"{what} needs both a certificate and a key file")
    return TlsFiles(cert, key) if cert else None
