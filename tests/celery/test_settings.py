"""Settings of the Celery integration: precedence, validation, masking, the lazy service."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_exclusive.errors import ConfigurationError, InvalidArgumentError
from celery_exclusive.service import DEFAULT_TTL
from celery_exclusive.settings import ExclusiveSettings
from celery_exclusive.task import exclusive_task
from celery_exclusive.worker import app_settings, get_lock_service
from tests.conftest import in_forked_child


def test_defaults() -> None:
    """With nothing configured: skip, log, 10 lock retries, the core's ttl and prefix, no URL."""
    settings = ExclusiveSettings.from_conf({}, environ={})
    assert settings.url is None
    assert settings.on_locked == "skip"
    assert settings.on_lost == "log"
    assert settings.lock_max_retries == 10
    assert settings.lease_ttl == DEFAULT_TTL
    assert settings.prefix == "task-lock:"


def test_app_conf_beats_environment_beats_defaults() -> None:
    """app.conf wins over CELERY_EXCLUSIVE_* variables, which win over defaults."""
    environ = {
        "CELERY_EXCLUSIVE_URL": "redis://env/0",
        "CELERY_EXCLUSIVE_ON_LOCKED": "retry",
        "CELERY_EXCLUSIVE_DEFAULT_TTL": "42",
        "CELERY_EXCLUSIVE_LOCK_MAX_RETRIES": "3",
    }
    conf = {"exclusive_url": "postgresql://conf/db", "exclusive_on_locked": "raise"}
    settings = ExclusiveSettings.from_conf(conf, environ=environ)
    assert settings.url == "postgresql://conf/db"
    assert settings.on_locked == "raise"
    assert settings.ttl == 42.0
    assert settings.lock_max_retries == 3


def test_task_options_beat_app_settings() -> None:
    """A task's own options override the app's; None leaves the app's value."""
    base = ExclusiveSettings.from_conf(
        {"exclusive_on_locked": "raise", "exclusive_default_ttl": 60}, environ={}
    )
    task = base.with_overrides(on_locked="rerun", ttl=None, lock_max_retries=1)
    assert (task.on_locked, task.ttl, task.lock_max_retries) == ("rerun", 60.0, 1)


def test_repr_masks_the_password() -> None:
    """The settings repr never shows a password from the URL."""
    settings = ExclusiveSettings(url="postgresql://app:s3cret@db/app")
    assert "s3cret" not in repr(settings)
    assert "app:***@db" in repr(settings)


def test_settings_are_frozen() -> None:
    """The settings object cannot be changed after it is made."""
    settings = ExclusiveSettings()
    with pytest.raises(AttributeError):
        settings.on_locked = "raise"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"CELERY_EXCLUSIVE_DEFAULT_TTL": "soon"}, "CELERY_EXCLUSIVE_DEFAULT_TTL='soon' is not a number"),
        ({"CELERY_EXCLUSIVE_ON_LOCKED": "block"}, "CELERY_EXCLUSIVE_ON_LOCKED: on_locked must be one of"),
        ({"CELERY_EXCLUSIVE_PREFIX": "has space"}, "CELERY_EXCLUSIVE_PREFIX: key prefix"),
        # The value as written, not the timedelta it was read into (days=-1, seconds=86399).
        ({"CELERY_EXCLUSIVE_COOLDOWN": "-1"}, r"CELERY_EXCLUSIVE_COOLDOWN: .*number of seconds, got -1\.0$"),
        ({"CELERY_EXCLUSIVE_DEFAULT_TTL": "inf"}, r"CELERY_EXCLUSIVE_DEFAULT_TTL: .*finite.*, got inf$"),
        # A number, but not a whole one: "is not a number" was wrong.
        ({"CELERY_EXCLUSIVE_LIMIT": "2.5"}, "CELERY_EXCLUSIVE_LIMIT='2.5' is not a whole number"),
        ({"CELERY_EXCLUSIVE_LOCK_MAX_RETRIES": "1e3"}, "LOCK_MAX_RETRIES='1e3' is not a whole number"),
    ],
)
def test_bad_environment_values_name_the_variable(environ: dict[str, str], message: str) -> None:
    """An unusable environment value raises ConfigurationError naming the variable."""
    with pytest.raises(ConfigurationError, match=message):
        ExclusiveSettings.from_conf({}, environ=environ)


def test_default_ttl_is_capped_by_max_lifetime_but_an_explicit_one_is_checked() -> None:
    """The default ttl shrinks to a short max lifetime; an explicit longer ttl is an error."""
    assert ExclusiveSettings(max_lifetime=60).lease_ttl == 60
    with pytest.raises(InvalidArgumentError, match="must not exceed max_lifetime"):
        ExclusiveSettings(ttl=120, max_lifetime=60)
    assert ExclusiveSettings(ttl=timedelta(minutes=1)).ttl == 60.0


def test_missing_url_with_a_redis_broker_says_how_to_configure(monkeypatch: pytest.MonkeyPatch) -> None:
    """No URL anywhere: the error names exclusive_url and the env variable, and hints at the Redis broker."""
    monkeypatch.delenv("CELERY_EXCLUSIVE_URL", raising=False)
    app = Celery("ce_settings_nourl", broker="redis://localhost:6379/0", set_as_current=False)
    with pytest.raises(ConfigurationError) as caught:
        get_lock_service(app)
    message = str(caught.value)
    assert "app.conf.exclusive_url" in message
    assert "CELERY_EXCLUSIVE_URL" in message
    assert "Your broker is Redis" in message


def test_service_is_created_once_per_app_and_configured_from_it() -> None:
    """get_lock_service returns one service per app, with the app's prefix and ttl."""
    app = Celery("ce_settings_svc", set_as_current=False)
    app.conf.update(exclusive_url="memory://", exclusive_prefix="svc:", exclusive_default_ttl=30)
    other = Celery("ce_settings_svc2", set_as_current=False)
    other.conf.exclusive_url = "memory://"
    service = get_lock_service(app)
    assert get_lock_service(app) is service
    assert get_lock_service(other) is not service
    assert service.prefix == "svc:"
    assert service.ttl == 30.0
    assert app_settings(app).prefix == "svc:"


def test_task_settings_combine_app_and_task_options() -> None:
    """A task's lock_settings are the app's settings with its own options applied."""
    app = Celery("ce_settings_task", set_as_current=False)
    app.conf.update(exclusive_url="memory://", exclusive_on_locked="raise", exclusive_lock_max_retries=4)

    @exclusive_task(app=app, ttl=5, name="ce_settings_task.t")
    def settings_probe() -> None: ...

    settings = settings_probe.lock_settings
    assert (settings.on_locked, settings.ttl, settings.lock_max_retries) == ("raise", 5.0, 4)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_fork_child_gets_its_own_service() -> None:
    """After fork the child never reuses the parent's service (or its connections)."""
    app = Celery("ce_settings_fork", set_as_current=False)
    app.conf.exclusive_url = "memory://"
    parent_service = get_lock_service(app)
    assert in_forked_child(
        lambda: get_lock_service(app) is not parent_service and get_lock_service(app) is get_lock_service(app)
    )
    assert get_lock_service(app) is parent_service


def test_conf_callable_policy_is_kept() -> None:
    """A callable exclusive_on_locked from app.conf is accepted as the default policy."""

    def policy(task: Any, key: str, holder: Any) -> str:
        return key

    assert ExclusiveSettings.from_conf({"exclusive_on_locked": policy}, environ={}).on_locked is policy


def test_django_style_namespace_settings_are_read() -> None:
    """CELERY_EXCLUSIVE_* names in a CELERY-namespaced config object reach the settings."""

    class DjangoSettings:
        CELERY_EXCLUSIVE_URL = "memory://"
        CELERY_EXCLUSIVE_DEFAULT_TTL = 33

    app = Celery("ce_settings_django", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    settings = app_settings(app)
    assert (settings.url, settings.ttl) == ("memory://", 33.0)


@pytest.mark.parametrize(
    ("conf", "environ", "expected"),
    [
        ({}, {}, 60.0),
        ({"exclusive_sweep_interval": 600}, {"CELERY_EXCLUSIVE_SWEEP_INTERVAL": "5"}, 600.0),
        ({"exclusive_sweep_interval": timedelta(minutes=2)}, {}, 120.0),
        ({}, {"CELERY_EXCLUSIVE_SWEEP_INTERVAL": "30"}, 30.0),
        ({}, {"CELERY_EXCLUSIVE_SWEEP_INTERVAL": "off"}, None),
        ({}, {"CELERY_EXCLUSIVE_SWEEP_INTERVAL": "0"}, None),
        ({"exclusive_sweep_interval": 0}, {}, None),
        ({"exclusive_sweep_interval": False}, {}, None),
        # README: "0 or off" turns it off, in the app's settings as in the environment.
        ({"exclusive_sweep_interval": "off"}, {}, None),
        ({"exclusive_sweep_interval": "Off"}, {"CELERY_EXCLUSIVE_SWEEP_INTERVAL": "30"}, None),
        ({"exclusive_sweep_interval": "0"}, {}, None),
    ],
)
def test_sweep_interval_from_conf_or_environment(
    conf: dict[str, Any], environ: dict[str, str], expected: float | None
) -> None:
    """exclusive_sweep_interval / CELERY_EXCLUSIVE_SWEEP_INTERVAL: seconds, or 0/False/off for none."""
    assert ExclusiveSettings.from_conf(conf, environ).sweep_interval == expected


def test_sweep_interval_is_rejected_when_bad_and_reaches_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad sweep interval names its setting; a good one is the worker's service's."""
    with pytest.raises(ConfigurationError, match="exclusive_sweep_interval"):
        ExclusiveSettings.from_conf({"exclusive_sweep_interval": -5}, {})
    with pytest.raises(ConfigurationError, match="exclusive_sweep_interval"):
        ExclusiveSettings.from_conf({"exclusive_sweep_interval": "soon"}, {})
    with pytest.raises(ConfigurationError, match="CELERY_EXCLUSIVE_SWEEP_INTERVAL"):
        ExclusiveSettings.from_conf({}, {"CELERY_EXCLUSIVE_SWEEP_INTERVAL": "soon"})
    monkeypatch.delenv("CELERY_EXCLUSIVE_SWEEP_INTERVAL", raising=False)
    app = Celery("sweep", set_as_current=False)
    app.conf.exclusive_url = "memory://"
    app.conf.exclusive_sweep_interval = 300
    service = get_lock_service(app)
    try:
        assert service.sweep_interval == 300.0
    finally:
        service.close()
