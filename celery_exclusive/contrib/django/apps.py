"""The Django app: its label is ``celery_exclusive``."""

from __future__ import annotations

import re

from django.apps import AppConfig

#: The lock store URL setting under any Celery namespace (``CELERY_EXCLUSIVE_URL``).
URL_SETTING = "EXCLUSIVE_URL"


class CeleryExclusiveConfig(AppConfig):  # type: ignore[misc]  # Django ships no type hints
    """Installs the lock table migration and the ``exclusive`` management command."""

    name = "celery_exclusive.contrib.django"
    label = "celery_exclusive"
    verbose_name = "celery-exclusive"

    def ready(self) -> None:
        """Hide the lock store URL where Django shows the settings, as it hides its own secrets."""
        hide_from_django_reports()


def hide_from_django_reports() -> None:
    """Make Django's debug pages hide ``CELERY_EXCLUSIVE_URL`` as they hide ``SECRET_KEY``.

    The technical 500 page (``DEBUG = True``) and the error reports it mails list every
    setting, replacing the value of those whose name matches
    ``SafeExceptionReporterFilter.hidden_settings`` (``API``, ``TOKEN``, ``KEY``, ``SECRET``,
    ``PASS``...), which ``CELERY_EXCLUSIVE_URL`` does not; the pattern is extended once,
    when the app is ready (a project's own filter, ``DEFAULT_EXCEPTION_REPORTER_FILTER``,
    that subclasses it inherits the change).
    """
    from django.views.debug import SafeExceptionReporterFilter

    hidden: re.Pattern[str] = SafeExceptionReporterFilter.hidden_settings
    if not hidden.search(URL_SETTING):
        SafeExceptionReporterFilter.hidden_settings = re.compile(
            f"{hidden.pattern}|{URL_SETTING}", hidden.flags | re.IGNORECASE
        )
