"""A simulated Equinix Metal project on loopback, for tests and the demo.

``Simulator`` runs a real HTTP server speaking the API subset Shepherd uses, and
one real SSH server per device (``127.net.x.y``). See ``server.py``; ``racks.py``
puts its machines behind an emulated Redfish BMC and lists them in a static inventory.
"""

from shepherd.simulator.faults import Faults, FaultSettings
from shepherd.simulator.server import Simulator, SimulatorConfig

__all__ = ["FaultSettings", "Faults", "Simulator", "SimulatorConfig"]
