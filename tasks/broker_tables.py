"""The embedded SQLite broker's and result store's tables, made before any Celery
process starts: ``python -m tasks.broker_tables`` (``shepherd up`` runs it).

Why ahead of time: every Celery process (workers, beat, Flower, a client) makes them
on first use, and several doing so at once on a new SQLite file race. Why here and not
in ``shepherd up``: the tables are kombu's and Celery's, and ``shepherd`` does not know
Celery; ``up`` runs this as a program with the run's environment, as it runs the
workers. The tables are made by kombu and Celery themselves (a channel opened, a
result session started), from the app's own configuration, so they are the ones the
workers then use. Redis needs nothing; other URLs are left alone.
"""

from __future__ import annotations

import sqlite3
import sys

from celery import Celery

#: The URL prefixes of the embedded SQLite broker and result store (``celeryconfig``).
SQLITE_BROKER = "sqla+sqlite:///"
SQLITE_RESULTS = "db+sqlite:///"


def prepare(app: Celery) -> list[str]:
    """Make the SQLite broker's and result store's tables of ``app``'s configuration,
    each file in WAL mode (readers never wait for a writer); which were made."""
    made = []
    broker: str = app.conf.broker_url or ""
    if broker.startswith(SQLITE_BROKER):
        use_wal(broker.removeprefix(SQLITE_BROKER))
        with app.connection_for_write() as connection:
            channel = connection.default_channel
            for queue in app.amqp.queues.values():  # as a worker does when it starts;
                queue(channel).declare()            # kombu makes its tables at the first
        made.append("broker")
    results: str = app.conf.result_backend or ""
    if results.startswith(SQLITE_RESULTS):
        from celery.backends.database import DatabaseBackend

        use_wal(results.removeprefix(SQLITE_RESULTS))
        backend = app.backend
        if not isinstance(backend, DatabaseBackend):
            raise RuntimeError(f"{results.split(':', 1)[0]} is served by "
                               f"{type(backend).__name__}, not Celery's database backend")
        backend.ResultSession().close()  # Celery makes its tables with the session
        made.append("results")
    return made


def use_wal(path: str) -> None:
    """Put the SQLite file at ``path`` (made if absent) in WAL mode, which it keeps."""
    connection = sqlite3.connect(path.split("?", 1)[0])
    try:
        connection.execute("PRAGMA journal_mode=WAL")
    finally:
        connection.close()


def main() -> int:
    from tasks import app

    made = prepare(app)
    print(f"prepared: {', '.join(made) or 'nothing (no SQLite broker or result store)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
