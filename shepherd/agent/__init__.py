"""The Shepherd agent: ``agent.py`` is the single file uploaded to machines.

``AGENT_PATH`` is where it lies in the installed package, for the initializer to
upload; ``protocol`` holds the takeover messages as the shepherd side validates them.
"""

from pathlib import Path

AGENT_PATH = Path(__file__).with_name("agent.py")


def agent_source() -> bytes:
    """The agent file's bytes, as uploaded (mode 0755) to a machine."""
    return AGENT_PATH.read_bytes()


__all__ = ["AGENT_PATH", "agent_source"]
