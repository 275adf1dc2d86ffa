"""The agent callback server (``shepherd serve``): agents' signed heartbeats into the BMDB.

``asgi`` holds the agents' and operators' Starlette apps, ``web`` the operator's web
view, ``options`` what the server is started with (``ServeOptions``, from
``Settings``), ``limits`` and ``asgi_protocol`` what a client may send, ``asgi_server``
the event loop serving them. ``serve.main(argv)`` runs it all from one ``Settings``;
``serve.serve(settings, db=...)`` or ``serve.start_server(runtime, options)`` serve
in-process (tests, embedded use).
"""

from shepherd.server.limits import ServerLimits
from shepherd.server.options import ServeOptions
from shepherd.server.serve import RunningServer, main, serve, start_server

__all__ = ["RunningServer", "ServeOptions", "ServerLimits", "main", "serve", "start_server"]
