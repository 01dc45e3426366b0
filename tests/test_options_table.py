"""``settings.OPTIONS``: the one table the settings, the task attributes, ``exclusive_task``'s
keywords and the conf/env names come from, pinned to the names the docs promise."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.settings import OPTIONS, TASK_OPTIONS, ExclusiveSettings
from celery_exclusive.task import ExclusiveTask, exclusive_task

#: field: (app.conf name, environment variable, task attribute, exclusive_task keyword)
DOCUMENTED = {
    "url": ("exclusive_url", "CELERY_EXCLUSIVE_URL", None, None),
    "prefix": ("exclusive_prefix", "CELERY_EXCLUSIVE_PREFIX", None, None),
    "ttl": ("exclusive_default_ttl", "CELERY_EXCLUSIVE_DEFAULT_TTL", "lock_ttl", "ttl"),
    "max_lifetime": (
        "exclusive_max_lifetime",
        "CELERY_EXCLUSIVE_MAX_LIFETIME",
        "lock_max_lifetime",
        "max_lifetime",
    ),
    "refresh_interval": (
        "exclusive_refresh_interval",
        "CELERY_EXCLUSIVE_REFRESH_INTERVAL",
        "lock_refresh_interval",
        "refresh_interval",
    ),
    "sweep_interval": ("exclusive_sweep_interval", "CELERY_EXCLUSIVE_SWEEP_INTERVAL", None, None),
    "on_locked": ("exclusive_on_locked", "CELERY_EXCLUSIVE_ON_LOCKED", "lock_on_locked", "on_locked"),
    "on_lost": ("exclusive_on_lost", "CELERY_EXCLUSIVE_ON_LOST", "lock_on_lost", "on_lost"),
    "lock_max_retries": (
        "exclusive_lock_max_retries",
        "CELERY_EXCLUSIVE_LOCK_MAX_RETRIES",
        "lock_max_retries",
        "lock_max_retries",
    ),
    "lock_retry_backoff": (
        "exclusive_lock_retry_backoff",
        "CELERY_EXCLUSIVE_LOCK_RETRY_BACKOFF",
        "lock_retry_backoff",
        "lock_retry_backoff",
    ),
    "lock_retry_backoff_max": (
        "exclusive_lock_retry_backoff_max",
        "CELERY_EXCLUSIVE_LOCK_RETRY_BACKOFF_MAX",
        "lock_retry_backoff_max",
        "lock_retry_backoff_max",
    ),
    "done_retention": (
        "exclusive_done_retention",
        "CELERY_EXCLUSIVE_DONE_RETENTION",
        "lock_done_retention",
        "done_retention",
    ),
    "lock_wait": ("exclusive_lock_wait", "CELERY_EXCLUSIVE_LOCK_WAIT", "lock_wait", "lock_wait"),
    "lock_wait_fallback": (
        "exclusive_lock_wait_fallback",
        "CELERY_EXCLUSIVE_LOCK_WAIT_FALLBACK",
        "lock_wait_fallback",
        "lock_wait_fallback",
    ),
    "dedupe": ("exclusive_dedupe", "CELERY_EXCLUSIVE_DEDUPE", "lock_dedupe", "dedupe"),
    "on_duplicate": (
        "exclusive_on_duplicate",
        "CELERY_EXCLUSIVE_ON_DUPLICATE",
        "lock_on_duplicate",
        "on_duplicate",
    ),
    "dedupe_ttl": ("exclusive_dedupe_ttl", "CELERY_EXCLUSIVE_DEDUPE_TTL", "lock_dedupe_ttl", "dedupe_ttl"),
    "cooldown": ("exclusive_cooldown", "CELERY_EXCLUSIVE_COOLDOWN", "lock_cooldown", "cooldown"),
    "rerun_args": ("exclusive_rerun_args", "CELERY_EXCLUSIVE_RERUN_ARGS", "lock_rerun_args", "rerun_args"),
    "limit": ("exclusive_limit", "CELERY_EXCLUSIVE_LIMIT", "lock_limit", "limit"),
}


def test_the_table_has_one_row_per_settings_field_with_the_documented_names() -> None:
    """Every ExclusiveSettings field has exactly one row, and its names are the documented ones."""
    assert [o.field for o in OPTIONS] == [f.name for f in dataclasses.fields(ExclusiveSettings)]
    assert {o.field: (o.conf_name, o.env, o.attribute, o.keyword) for o in OPTIONS} == DOCUMENTED
    assert {field: names[2] for field, names in DOCUMENTED.items() if names[2]} == TASK_OPTIONS


def test_every_row_is_a_task_attribute_and_a_decorator_keyword() -> None:
    """A per-task row exists as an ExclusiveTask attribute and as an exclusive_task keyword."""
    keywords = inspect.signature(exclusive_task).parameters
    for option in OPTIONS:
        if option.attribute is None:
            continue
        assert getattr(ExclusiveTask, option.attribute) is None, option.attribute
        assert option.keyword in keywords, option.keyword


@pytest.mark.parametrize("bad", [0, 65, True, 1.5, "2"])
def test_a_bad_limit_is_refused_when_the_task_is_declared(bad: object) -> None:
    """``exclusive_task(limit=...)`` checks the limit at declaration, as every option."""
    from celery_exclusive.settings import check_task_options

    with pytest.raises(InvalidArgumentError, match="limit"):
        check_task_options(limit=bad)
    with pytest.raises(InvalidArgumentError, match="limit"):
        ExclusiveSettings(limit=bad)  # type: ignore[arg-type]


def test_the_limit_reads_from_the_environment() -> None:
    assert ExclusiveSettings.from_conf({}, {"CELERY_EXCLUSIVE_LIMIT": "3"}).limit == 3
