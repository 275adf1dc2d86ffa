"""Celery glue over the shepherd workflows: ``celery -A tasks worker``.

Tasks stay thin: each adopts or claims BMDB work and calls a workflow in ``shepherd``.
"""

from __future__ import annotations

from celery import Celery

app = Celery("shepherd")
app.config_from_object("celeryconfig")
