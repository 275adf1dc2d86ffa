"""The ``shepherd`` command: one entry point for every role and for operators.

``main.py`` is the entry point, ``arguments.py`` the command line, ``context.py`` what
each command is handed (settings built once, the runtime, the worker layer);
``reads.py``, ``actions.py`` and ``migrate.py`` are the commands, ``render.py`` what
they print for people, ``workers.py`` the way to the Celery workers.
"""

from shepherd.cli.arguments import DELEGATED, parser
from shepherd.cli.main import main

__all__ = ["DELEGATED", "main", "parser"]
