"""The agent callback server (``shepherd serve``): agents' signed heartbeats into the BMDB.

``asgi`` holds the Starlette apps (agents' and operators' listeners), ``app`` the
``ServerConfig`` and the Flask web view, ``limits`` and ``asgi_protocol`` what a client
may send, ``asgi_server`` the event loop serving them; ``serve.main(argv)`` runs it
all from one ``Settings``; ``serve.start_server(config, runtime=...)`` (or ``db=...``)
serves in-process (tests, embedded use).
"""

from shepherd.server.app import ServerConfig, create_web_app
from shepherd.server.limits import ServerLimits
from shepherd.server.serve import RunningServer, main, start_server

__all__ = ["RunningServer", "ServerConfig", "ServerLimits", "create_web_app", "main",
           "start_server"]
