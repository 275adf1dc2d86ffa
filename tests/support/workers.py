"""Which pytest-xdist worker runs this process, so that workers sharing a server
(``SHEPHERD_TEST_PG_URL`` / ``SHEPHERD_TEST_REDIS_URL``) never use each other's names.

Without xdist (``-n 0``, ``-p no:xdist``) the process is the only worker, index 0 of 1.
"""

from __future__ import annotations

import os

import pytest

#: "gw0", "gw1"... in an xdist worker; "main" in a run without workers.
NAME = os.environ.get("PYTEST_XDIST_WORKER", "main")
COUNT = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
INDEX = int(NAME[2:]) if NAME.startswith("gw") else 0
#: Redis numbers its databases 0..15 by default.
REDIS_DATABASES = 16


def redis_database() -> int:
    """This worker's own database on a shared Redis: what ``redis_url`` names."""
    return INDEX


def redis_test_databases() -> list[int]:
    """The databases this worker hands out one per test: above every worker's own one,
    each database to one worker only."""
    return [db for db in range(COUNT, REDIS_DATABASES) if db % COUNT == INDEX]


# -- what two workers must not do at once --------------------------------------------
# ``./dev test`` runs with ``--dist loadgroup``: the tests of one group run on one
# worker, one after the other. Everything else is per test (free ports, temporary
# directories, its own databases, markers with unique values).

#: Simulated machines named by their rack position (``rack1-u01``...): the simulator
#: finds a device's processes by that name machine-wide (to kill them at power-off,
#: and tests count them), so another worker's ``rack1-u01`` would be taken for its own.
RACK_DEVICES = pytest.mark.xdist_group("rack_devices")
#: The host's network interfaces: the compose stack's containers add and remove
#: some (podman's bridge and veth pairs), and an agent's hardware report read on
#: this host (the agent's tests, the stock machines, which share its network) is
#: compared with them. So these never run beside each other; the compose stack has
#: fixed published ports (8080, 8081, 5555) too, and the stock machines are chroots.
HOST_NETWORK = pytest.mark.xdist_group("host_network")
#: The benches at their tiny sizes (``tests/project/test_bench_*.py``): several drive the
#: machine's cores flat out on purpose (a load generator against a server, no-op tasks as
#: fast as Celery runs them), so two at once would starve each other and every
#: time-bounded test beside them.
BENCHES = pytest.mark.xdist_group("benches")
#: The checkout's ``build/`` directory: building the wheel (``tests/project/
#: test_packaging.py``, a module fixture) writes there, and two workers building at
#: once delete each other's files mid-copy ("No such file or directory").
CHECKOUT_BUILD = pytest.mark.xdist_group("checkout_build")
#: The agent under a process limit, as the first user id no process runs as: two at
#: once would pick the same user and count each other's processes.
UNUSED_UID = pytest.mark.xdist_group("unused_uid")
