"""The agent callback server (``shepherd serve``): agents' signed heartbeats into the BMDB.

``app.create_app(ServerConfig, runtime)`` builds the WSGI app; ``serve.main(argv)`` runs
it from one ``Settings``; ``serve.start_server(config, runtime=...)`` (or ``db=...``)
serves in-process (tests, embedded use).
"""

from shepherd.server.app import ServerConfig, create_app
from shepherd.server.serve import RunningServer, main, start_server

__all__ = ["RunningServer", "ServerConfig", "create_app", "main", "start_server"]
