"""Celery settings, read from SHEPHERD_* environment variables.

Embedded default: a SQLite-backed broker under ./var, so one host needs no Redis;
production points SHEPHERD_BROKER_URL at Redis.
"""

from __future__ import annotations

import os

broker_url = os.environ.get("SHEPHERD_BROKER_URL", "sqla+sqlite:///var/broker.sqlite")
result_backend = os.environ.get("SHEPHERD_RESULT_BACKEND", "db+sqlite:///var/results.sqlite")

task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
timezone = "UTC"
enable_utc = True

# Flower shows every task with its name and arguments (which never carry secrets).
worker_send_task_events = True
task_send_sent_event = True
