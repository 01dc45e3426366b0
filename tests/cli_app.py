"""A minimal Celery app for the CLI tests: ``celery -A tests.cli_app:app exclusive ...``.

Its lock store and prefix come from ``CE_TEST_CLI_URL`` and ``CE_TEST_CLI_PREFIX`` so a
test can point a real ``celery`` subprocess at its own isolated store.
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("cli_app", broker="memory://", set_as_current=False)
app.conf.exclusive_url = os.environ.get("CE_TEST_CLI_URL")
app.conf.exclusive_prefix = os.environ.get("CE_TEST_CLI_PREFIX")
