"""The Shepherd agent: what the initializer uploads to a machine and runs there.

``agent.py`` is the agent; ``agent_bundle()`` is the single file actually uploaded
(``bundle.py``: a shell prologue and a zip of the agent with a pure-Python Ed25519,
so a machine needs python3 alone). ``AGENT_PATH`` is where ``agent.py`` lies, for
tests that run it alone; ``protocol`` is the wire format, every message between the
shepherd and its agent, imported by both sides (the agent's copy is in its bundle).
"""

from pathlib import Path

from shepherd.agent.bundle import BUNDLE_NAME, agent_bundle

AGENT_PATH = Path(__file__).with_name("agent.py")

__all__ = ["AGENT_PATH", "BUNDLE_NAME", "agent_bundle"]
