"""The operators' roles: what an API token may do (``shepherd.api_routes`` says
which role each route needs; ``shepherd.operations.tokens`` keeps the tokens).

A word of its own, below everything, because both the CLI in API mode (which must
start without the BMDB's libraries) and the server read it.
"""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
    """Each role may do what the ones below it may."""

    #: Reads the BMDB: machines, show, explain, fleet, sessions, history.
    VIEWER = 1
    #: Also acts on machines: maintenance, power (a BMC read too), start, sweep,
    #: reconcile, clear-backoff, host keys, installations.
    OPERATOR = 2
    #: Also manages tokens and lets held machines back (quarantine, BMC mismatch).
    ADMIN = 3

    @property
    def word(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Role:
        """``viewer``, ``operator`` or ``admin``; ``ValueError`` names the choices."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"{text!r} is not a role (viewer, operator or admin)") from None
