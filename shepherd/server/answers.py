"""The server's side of signed heartbeat answers (the key: ``shepherd.answer_key``).

``AnswerSigner`` fetches the fleet's answer key on first use and signs every answer
on the heartbeat path with it, errors included.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import bmdb
from shepherd.agent.protocol import HEADER_ANSWER_SIGNATURE
from shepherd.answer_key import AnswerKey

log = logging.getLogger(__name__)


class AnswerSigner:
    """Signs a server's heartbeat answers, fetching the key on first use.

    ``run`` runs one BMDB transaction (``runtime.transact``, ``db.read``). Why not
    at start: a server must start, and answer ``/healthz``, while the BMDB is down.
    A failed fetch is tried again by the next answer; a 503 (the BMDB did not
    answer) does not try, so that it is not delayed by a second wait for the BMDB,
    and goes unsigned, which the agent counts as a failed heartbeat, as it would
    the 503.
    """

    def __init__(self, run: Callable[[Callable[[bmdb.Tx], AnswerKey]], AnswerKey]) -> None:
        self._run = run
        self._lock = threading.Lock()
        self._key: AnswerKey | None = None

    def key(self) -> AnswerKey:
        if self._key is None:
            with self._lock:
                if self._key is None:
                    self._key = self._run(AnswerKey.from_tx)
        return self._key

    def headers(self, machine: str | None, timestamp: str | None, status: int,
                body: bytes) -> dict[str, str]:
        """``{HEADER_ANSWER_SIGNATURE: ...}`` for this answer, or ``{}`` when the key
        cannot be had (logged). ``machine`` and ``timestamp`` are the request's headers
        as sent (None when absent)."""
        if self._key is None and status == 503:
            return {}
        try:
            key = self.key()
        except Exception as error:  # unsigned, and the agent refuses it: say why here
            log.warning("heartbeat answer left unsigned: no answer key (%s)",
                        str(error)[:200])
            return {}
        return {HEADER_ANSWER_SIGNATURE: key.sign(machine or "", timestamp or "", status, body)}


__all__ = ["AnswerSigner"]
