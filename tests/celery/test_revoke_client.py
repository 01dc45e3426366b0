"""A process that only sends and revokes (a web process, a script) on a real broker.

``AsyncResult.revoke()`` / ``app.control.revoke()`` of an app with exclusive tasks also
frees the revoked ids' queued markers (``dedupe.release_revoked``). A client with no lock
store configured has none to free (it could not have taken one), so its revoke says
nothing; one whose store fails says so in one line, without a traceback: the revoke went
out, and the worker that meets the message frees the marker. So does that worker's own
release of a revoked message's marker when its store fails (it retries in the background).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery import signals as celery_signals
from celery.app.task import Context

from celery_exclusive.dedupe import HEADER
from celery_exclusive.task import exclusive_task
from celery_exclusive.urls import ENV_VAR
from celery_exclusive.worker import close_lock_services
from tests.celery.conftest import BROKER_URL
from tests.conftest import DEAD_URLS, OUTAGE_SECRET, require_server


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Celery, Any]]:
    """An app on the suite's Redis broker with an exclusive deduplicating task and a plain
    exclusive one, no lock store in its settings or environment; one message sent."""
    require_server(BROKER_URL)
    monkeypatch.delenv(ENV_VAR, raising=False)
    tag = uuid.uuid4().hex[:8]
    app = Celery(f"revoke-client-{tag}", broker=BROKER_URL, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        broker_transport_options={"global_keyprefix": os.environ["CE_CELERY_KEYPREFIX"]},
        task_default_queue=f"revoke-client-{tag}",  # nobody consumes it
    )

    def job(n: int) -> int:
        return n

    exclusive_task(app=app, key="job:{n}", dedupe=True, name=f"revoke-client.deduped.{tag}")(job)
    plain = exclusive_task(app=app, key="job:{n}", name=f"revoke-client.plain.{tag}")(job)
    try:
        yield app, plain.delay(1)
    finally:
        close_lock_services()


def _revoke_all_ways(app: Celery, sent: Any) -> None:
    sent.revoke(terminate=True)
    app.control.revoke([sent.id, uuid.uuid4().hex], terminate=True)
    app.AsyncResult(uuid.uuid4().hex).revoke()


def test_a_client_without_a_lock_store_revokes_without_a_word(
    client: tuple[Celery, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """No store configured: revokes (terminate=True, several ids, before and after the app
    is finalized) log nothing at WARNING or above."""
    app, sent = client
    with caplog.at_level(logging.DEBUG, logger="celery_exclusive"):
        _revoke_all_ways(app, sent)
        app.finalize()
        _revoke_all_ways(app, sent)
    loud = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert loud == [], [record.getMessage() for record in loud]


def test_a_client_whose_lock_store_fails_says_so_in_one_line(
    client: tuple[Celery, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A store configured but unreachable: one WARNING per revoke naming the ids, the store's
    error (its password masked) and who frees the markers instead; no traceback."""
    app, sent = client
    app.conf.exclusive_url = DEAD_URLS["redis"]
    with caplog.at_level(logging.WARNING, logger="celery_exclusive"):
        sent.revoke(terminate=True)
    (record,) = [record for record in caplog.records if record.name.startswith("celery_exclusive")]
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert not record.exc_info
    assert "\n" not in message
    assert sent.id in message
    assert "127.0.0.1:1" in message
    assert "the worker" in message
    assert OUTAGE_SECRET not in message


def test_a_worker_whose_lock_store_fails_says_so_in_one_line_for_a_revoked_messages_marker(
    client: tuple[Celery, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's side: ``task_revoked`` for a message carrying a queued marker (sent as
    Celery's worker sends it when it discards a revoked message), the store unreachable:
    one WARNING naming the key, the store's error and the retry in the background; no
    traceback."""
    app, _ = client
    app.conf.exclusive_url = DEAD_URLS["redis"]
    task = app.tasks[f"revoke-client.deduped.{app.main.rsplit('-', 1)[1]}"]
    marker = {"key": "job:1", "token": uuid.uuid4().hex, "mode": "until_start"}
    request = Context(id=uuid.uuid4().hex, headers={HEADER: marker})
    with caplog.at_level(logging.WARNING, logger="celery_exclusive"):
        celery_signals.task_revoked.send(
            sender=task, request=request, terminated=False, signum=None, expired=False
        )
    (record,) = [record for record in caplog.records if record.name.startswith("celery_exclusive")]
    message = record.getMessage()
    assert not record.exc_info
    assert "\n" not in message
    assert "'job:1'" in message
    assert "127.0.0.1:1" in message
    assert "retrying in the background" in message
    assert OUTAGE_SECRET not in message
