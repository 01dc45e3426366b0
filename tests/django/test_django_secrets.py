"""Django's own views of the settings hide the lock store URL, as Celery's do."""

from __future__ import annotations

import pytest

pytest.importorskip("django")

PW = "Zq8SECRETpw"


def test_the_debug_page_settings_hide_the_lock_store_url(project: dict[str, str]) -> None:
    """The settings Django's technical 500 page lists show ``CELERY_EXCLUSIVE_URL`` hidden,
    as they hide ``SECRET_KEY`` and ``DATABASES`` passwords (the app is installed)."""
    from django.test import override_settings
    from django.views.debug import SafeExceptionReporterFilter

    url = f"postgresql://app:{PW}@db.example:5432/app"
    with override_settings(CELERY_EXCLUSIVE_URL=url):
        shown = SafeExceptionReporterFilter().get_safe_settings()
    assert "CELERY_EXCLUSIVE_URL" in shown
    assert PW not in repr(shown)
