"""``shepherd up``: the whole control plane in one foreground command.

What it starts, each as a subprocess (``supervisor.py``):

* the simulator with ``--machines`` reservations (unless ``SHEPHERD_PROVIDER`` names a
  real provider),
* the agent callback server with the web view and ``/metrics`` (``shepherd serve``; both
  on the agents' listener on the simulator, where it is loopback, else on a loopback
  operators' listener of their own: ``environment.serve_addresses``),
* two Celery workers, one per queue, so control work never waits behind SSH work,
* Celery beat (its schedule file under the state directory),
* Flower when it is installed (127.0.0.1, basic auth).

Every child gets the same ``SHEPHERD_*`` environment (``environment.py`` decides it
before anything starts), plus ``SHEPHERD_UP_RUN=<id>``, the marker the final sweep
finds leftovers by.

Embedded defaults live under the state directory (``./var``, ``state.py``): the SQLite
BMDB, a SQLite broker (kombu's SQLAlchemy transport) and a SQLite result backend. Each
queue has exactly one consuming process (the worker's main process), which is what
makes the polling SQLite broker safe: no two consumers race on one queue. Its limit:
a virtual transport has no cross-process fanout, so Flower connects but sees no
workers and no task events there. ``--broker redis-server`` runs a private Redis
under the state directory instead (what production runs; Flower then works fully).
``SHEPHERD_BMDB_URL`` / ``SHEPHERD_BROKER_URL`` pointing at PostgreSQL / Redis win.

A run resumes its state directory (``state.py``): the same BMDB, and the simulator
keeps its machines (``--persist``); ``--fresh`` sets everything aside first. Ports
are checked before anything starts (``ports.py``), children that die are restarted
(``children.py``), and what a second terminal needs is written to
``shepherd.env`` (``shepherd.state_env``).

``--racks`` runs the simulator's machines as one's own racks instead: the static
provider over an inventory the simulator writes, each machine behind an emulated
Redfish BMC (``racks.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from shepherd.simulator.ssh import SANDBOX_MARKER as SIM_SANDBOX
from shepherd.up.children import ChildFailed
from shepherd.up.environment import RUN_MARKER, Plan, UpError, UpOptions, plan
from shepherd.up.supervisor import Up

__all__ = ["RUN_MARKER", "SIM_SANDBOX", "ChildFailed", "Plan", "Up", "UpError", "UpOptions",
           "main", "plan"]


def main(options: UpOptions, env: Mapping[str, str]) -> int:
    return Up(options, env).run()
