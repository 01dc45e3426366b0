"""The Django app: its label is ``celery_exclusive``."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryExclusiveConfig(AppConfig):  # type: ignore[misc]  # Django ships no type hints
    """Installs the lock table migration and the ``exclusive`` management command."""

    name = "celery_exclusive.contrib.django"
    label = "celery_exclusive"
    verbose_name = "celery-exclusive"
