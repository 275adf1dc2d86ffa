"""The BMC identity check as the workflows run it, before their first change through
a BMC: Recovery before its ladder, an installation before it sets the boot device.

One place for what both do with ``shepherd.power.mismatch``'s outcome: a mismatch
(the machine is held by then) or an unreadable BMC fails the work with a cause that
says where it stopped; any other outcome, "not compared" included, goes into the
machine's history, so an operator sees what the check found before each reset.
"""

from __future__ import annotations

import bmdb
from shepherd.power import PowerControl, PowerError
from shepherd.power.mismatch import BMC_IDENTITY, refuse_if_mismatched
from shepherd.workflows.common import WorkflowFailure


def check_the_bmc(work: bmdb.Work, power: PowerControl, where: str) -> None:
    """Refuse (``WorkflowFailure`` starting with ``where``) unless the BMC manages this
    machine or nothing says otherwise; note the outcome in history."""
    try:
        checked = refuse_if_mismatched(work.session, work.machine_id, power,
                                       work.process.value)
    except PowerError as error:
        raise WorkflowFailure(f"{where}: {type(error).__name__}: {error}") from error
    work.note(BMC_IDENTITY, checked.reason)
