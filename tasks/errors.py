"""Why a task ended as FAILURE, in words an operator reads in Flower.

Each takes one message (so Celery's JSON result backend can rebuild it for
``AsyncResult.get``) and none is ever retried by Celery: failures of machine work
are recorded in the BMDB as backoffs before these are raised.
"""

from __future__ import annotations


class ShepherdTaskError(Exception):
    """Base of the failures tasks raise on purpose (logged without a traceback)."""


class MachineWorkFailed(ShepherdTaskError):
    """The workflow failed; the BMDB already holds the ``Failed`` history and the backoff."""


class MachineNotClaimable(ShepherdTaskError):
    """Called by hand on a machine that is busy, in backoff or not in the backlog: untouched."""


class MachineWorkLost(ShepherdTaskError):
    """The claim stopped being ours mid-way (session expired, swept): the sweep settles it."""


class RecoveryPaused(ShepherdTaskError):
    """Recovery called by hand while the blast-radius guard pauses it: nothing rebooted."""


class ReconcileRefused(ShepherdTaskError):
    """The provider and the BMDB disagree; reconcile created nothing (``FleetMismatch``)."""
