"""What the BMC drivers share: how they are built and their bounded retries.

Why ours and not the client libraries': sushy retries up to 10 times 3 s apart and
pyghmi per its own rules; a Recovery rung has a deadline and a BMC lock held
meanwhile, so a call must end within a bound the settings say
(``SHEPHERD_BMC_ATTEMPTS``, ``SHEPHERD_BMC_TIMEOUT``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar, TypeVar

import tenacity

from shepherd.bmc import BmcSpec, Driver
from shepherd.power.base import BmcSurvey, BmcUnreachable

log = logging.getLogger(__name__)
T = TypeVar("T")


class Transient(Exception):
    """No answer, or a 5xx: worth another attempt."""


def with_retries(description: str, what: str, attempts: int, backoff: float,
                 once: Callable[[], T]) -> T:
    """``once()``, tried up to ``attempts`` times while it raises ``Transient``,
    ``backoff`` seconds apart at first (doubling, at most ten times that);
    ``BmcUnreachable`` naming the BMC when every attempt failed."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(Transient),
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_exponential(multiplier=backoff, max=10 * backoff),
        before_sleep=lambda s: log.info("%s: %s: %s; retry %d", description, what,
                                        s.outcome.exception() if s.outcome else "",
                                        s.attempt_number),
        reraise=True,
    )
    try:
        return retrying(once)
    except Transient as error:
        raise BmcUnreachable(f"{description}: {what}: no answer after {attempts} "
                             f"attempts: {error}") from None


class BmcDriver:
    """Base of the drivers of an inventory's ``bmc`` table (``DRIVER`` names which).

    ``timeout`` bounds each attempt; ``attempts`` how many times a call is tried when
    the BMC does not answer (``Transient``), ``backoff`` seconds apart at first.
    """

    DRIVER: ClassVar[Driver]
    reads_state = True

    def __init__(self, spec: BmcSpec, *, timeout: float = 10.0, attempts: int = 3,
                 backoff: float = 0.5) -> None:
        if spec.driver != self.DRIVER:
            raise ValueError(f"{spec.description}: not a {self.DRIVER} BMC")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.spec = spec
        self.description = spec.description
        self.timeout = timeout
        self.attempts = attempts
        self.backoff = backoff

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description})"

    def survey(self) -> BmcSurvey:
        """Power, health and identity in one read (``BmcSurvey``); the drivers' own."""
        raise NotImplementedError

    def retried(self, what: str, once: Callable[[], T]) -> T:
        """``once()`` under this driver's retries (``with_retries``)."""
        return with_retries(self.description, what, self.attempts, self.backoff, once)
