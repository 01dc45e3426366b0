"""Bad ``dedupe`` / ``on_duplicate`` / ``dedupe_ttl`` / ``rerun_args`` values are rejected when
the task is defined (or the app's settings are read), naming the option; no store is touched."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_exclusive import AlreadyQueued, ConfigurationError, InvalidArgumentError
from celery_exclusive.dedupe import DEFAULT_DEDUPE_TTL, marker_ttl
from celery_exclusive.settings import ExclusiveSettings
from celery_exclusive.task import ExclusiveTask, exclusive_task


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"dedupe": "until_queued"}, "dedupe must be"),
        ({"dedupe": 1}, "dedupe must be"),
        ({"dedupe": True, "on_duplicate": "ignore"}, "on_duplicate must be"),
        ({"dedupe": True, "on_duplicate": 3}, "on_duplicate must be"),
        ({"dedupe": True, "dedupe_ttl": 0}, "dedupe_ttl"),
        ({"dedupe": True, "dedupe_ttl": -5}, "dedupe_ttl"),
        ({"dedupe": True, "dedupe_ttl": 2 * 86400}, "dedupe_ttl"),
        ({"on_locked": "rerun", "rerun_args": "last"}, "rerun_args must be"),
        ({"cooldown": 0}, "lock_cooldown"),
        ({"cooldown": -1}, "lock_cooldown"),
        ({"cooldown": 120, "max_lifetime": 60}, "cooldown"),
        ({"cooldown": 2 * 86400}, "cooldown"),
    ],
)
def test_bad_options_are_rejected_at_definition(options: dict[str, Any], fragment: str) -> None:
    app = Celery("bad-dedupe", set_as_current=False)
    with pytest.raises(InvalidArgumentError, match=fragment):
        exclusive_task(app=app, key="k", shared=False, **options)(lambda: None)


def test_bad_class_attributes_are_rejected_at_definition() -> None:
    with pytest.raises(InvalidArgumentError, match="on_duplicate must be"):

        class _Bad(ExclusiveTask[[], None]):
            lock_dedupe = "until_done"
            lock_on_duplicate = "drop"

            def run(self) -> None: ...


@pytest.mark.parametrize(
    ("conf", "fragment"),
    [
        ({"exclusive_dedupe": "yes"}, "exclusive_dedupe"),
        ({"exclusive_on_duplicate": "x"}, "exclusive_on_duplicate"),
    ],
)
def test_bad_app_settings_name_the_setting(conf: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        ExclusiveSettings.from_conf(conf, environ={})


@pytest.mark.parametrize("raw", ["true", "on", "until_queued"])
def test_a_bad_dedupe_environment_variable_names_the_strings_it_takes(raw: str) -> None:
    """The environment's text cannot say True: the error names the strings it takes."""
    with pytest.raises(ConfigurationError) as caught:
        ExclusiveSettings.from_conf({}, environ={"CELERY_EXCLUSIVE_DEDUPE": raw})
    message = str(caught.value)
    assert message.startswith(f"CELERY_EXCLUSIVE_DEDUPE={raw!r}")
    assert "'until_start'" in message
    assert "'until_done'" in message
    assert "'off'" in message
    assert "True" not in message


def test_good_values_resolve() -> None:
    settings = ExclusiveSettings.from_conf(
        {"exclusive_dedupe": True, "exclusive_dedupe_ttl": 30},
        environ={"CELERY_EXCLUSIVE_RERUN_ARGS": "latest"},
    )
    assert (settings.dedupe, settings.on_duplicate, settings.dedupe_ttl, settings.rerun_args) == (
        "until_start",
        "return",
        30.0,
        "latest",
    )
    assert ExclusiveSettings.from_conf({}, environ={"CELERY_EXCLUSIVE_DEDUPE": "off"}).dedupe is False


def test_marker_ttl_covers_the_countdown_and_stops_at_expires() -> None:
    app = Celery("ttl-dedupe", set_as_current=False)

    def job() -> None: ...

    task = exclusive_task(app=app, key="k", dedupe=True)(job)
    assert marker_ttl(task, None, {}) == DEFAULT_DEDUPE_TTL
    assert marker_ttl(task, 4.0, {"countdown": 10}) == 14.0
    assert marker_ttl(task, 4.0, {"countdown": 10, "expires": 12}) == 12.0
    assert marker_ttl(task, None, {"expires": -1}) is None


def test_marker_ttl_covers_an_eta_takes_the_tasks_expires_and_stops_at_the_ceiling() -> None:
    """An eta (aware, naive as UTC as Celery reads it, or ISO text) counts like a countdown; the
    task's own ``expires`` bounds the marker; no marker outlives the 24 h ceiling."""
    from datetime import datetime, timedelta, timezone

    from celery_exclusive.validation import MAX_LIFETIME_CAP

    app = Celery("ttl-eta", set_as_current=False)

    def job() -> None: ...

    task = exclusive_task(app=app, key="k", dedupe=True, shared=False, name="ttl-eta.job")(job)
    eta = datetime.now(timezone.utc) + timedelta(seconds=100)
    for given in (eta, eta.replace(tzinfo=None), eta.isoformat()):
        ttl = marker_ttl(task, 4.0, {"eta": given})
        assert ttl is not None
        assert 103.0 < ttl <= 104.0, given
    assert marker_ttl(task, None, {"countdown": 2 * 86400}) == MAX_LIFETIME_CAP == 86400
    assert marker_ttl(task, None, {"countdown": 23.5 * 3600}) == MAX_LIFETIME_CAP
    expiring = exclusive_task(
        app=app, key="k", dedupe=True, expires=30, shared=False, name="ttl-eta.expiring"
    )(job)
    assert marker_ttl(expiring, None, {}) == 30.0
    assert marker_ttl(expiring, None, {"expires": 10}) == 10.0  # the send's own wins


def test_already_queued_survives_a_result_backend_round_trip() -> None:
    error = AlreadyQueued("k", "id-1")
    again = type(error)(*error.args)
    assert (again.key, again.task_id, str(again)) == ("k", "id-1", str(error))


def test_the_cli_names_the_marker_states_by_the_celery_layers_suffixes() -> None:
    """``celery exclusive list`` shows queued and rerun markers as such (it cannot import them)."""
    from celery_exclusive.cli import MARKER_STATES, lease_state
    from celery_exclusive.dedupe import QUEUED_SUFFIX
    from celery_exclusive.policies import RERUN_SUFFIX

    assert set(MARKER_STATES) == {QUEUED_SUFFIX, RERUN_SUFFIX}
    assert [lease_state(k + s) for k in ("a",) for s in ("", QUEUED_SUFFIX, RERUN_SUFFIX)] == [
        "held",
        "queued",
        "rerun",
    ]


def test_apply_async_keeps_celerys_positional_parameters() -> None:
    """``apply_async(args, kwargs, task_id)`` still means what it means to Celery (eager here:
    no broker, no marker)."""
    app = Celery("positional-dedupe", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.exclusive_url = "memory://"

    def add(x: int, y: int) -> int:
        return x + y

    task = exclusive_task(app=app, key="add:{x}", dedupe=True)(add)
    result = task.apply_async((1, 2), None, "my-id")
    assert (result.id, result.get()) == ("my-id", 3)


def test_an_app_with_an_exclusive_task_revokes_through_revoking_control_and_still_pickles() -> None:
    """Declaring an exclusive task swaps the app's control class (by name, before it is built)."""
    import pickle

    from celery_exclusive.dedupe import RevokingControl

    app = Celery("revoking-control", set_as_current=False)
    exclusive_task(app=app, key="k", shared=False)(lambda: None)
    assert isinstance(app.control, RevokingControl)
    again = pickle.loads(pickle.dumps(app))  # noqa: S301  # our own bytes, just made
    assert again.control_cls == "celery_exclusive.dedupe:RevokingControl"


def test_release_revoked_frees_exactly_the_revoked_ids_markers() -> None:
    """The revoke path finds markers by the task id in their holder and releases only those;
    a key that is not a marker, or another id's marker, stays."""
    from celery_exclusive.dedupe import QUEUED_SUFFIX, release_revoked
    from celery_exclusive.worker import close_lock_services, get_lock_service

    app = Celery("release-revoked", set_as_current=False)
    app.conf.exclusive_url = "memory://"

    def job(n: int) -> int:
        return n

    exclusive_task(app=app, key="job:{n}", dedupe=True, name="release-revoked.job")(job)
    service = get_lock_service(app)
    try:
        assert service.mark("job:1" + QUEUED_SUFFIX, ttl=60, holder={"task_id": "a"})
        assert service.mark("job:2" + QUEUED_SUFFIX, ttl=60, holder={"task_id": "b"})
        assert service.mark("job:3", ttl=60, holder={"task_id": "a"})
        assert release_revoked(app, "a") == 1
        assert release_revoked(app, ["a", "c"]) == 0
        assert [info.key for info in service.locks()] == ["job:2" + QUEUED_SUFFIX, "job:3"]
    finally:
        close_lock_services()
