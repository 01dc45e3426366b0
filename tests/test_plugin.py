"""celery_exclusive.testing and its pytest plugin: the example project in its own pytest
(pytester), the plugin's inertness, and each helper's behaviour."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_exclusive import InvalidArgumentError, LeaseState, exclusive_task
from celery_exclusive.testing import (
    ExclusiveStore,
    FakeClock,
    assert_coalesced,
    assert_not_skipped,
    assert_skipped,
    skip_marker,
)
from celery_exclusive.worker import get_lock_service

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = Path(__file__).with_name("plugin_example")
EXAMPLE_FILES = ["shop_tasks.py", "conftest.py", "test_eager.py", "test_worker.py"]


def copy_example(pytester: pytest.Pytester) -> None:
    for name in EXAMPLE_FILES:
        (pytester.path / name).write_text((EXAMPLE / name).read_text())


def test_the_documented_example_passes_eager_and_on_the_embedded_worker(pytester: pytest.Pytester) -> None:
    """The user's tests of docs/testing.md pass, in a pytest of their own."""
    copy_example(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error", timeout=120)
    result.assert_outcomes(passed=8)


def test_the_docs_show_the_example_exactly() -> None:
    """Every file of the example appears verbatim in the testing guide, so neither drifts."""
    guides = sorted(ROOT.glob("docs/**/testing.md"))
    assert guides, "docs/testing.md is missing"
    text = guides[0].read_text()
    for name in EXAMPLE_FILES:
        body = (EXAMPLE / name).read_text()
        assert body in text, f"{name} differs from its copy in {guides[0].relative_to(ROOT)}"


def test_the_plugin_is_inert_unless_its_fixtures_are_used(pytester: pytest.Pytester) -> None:
    """Loaded by its entry point, the plugin adds fixtures only: no hook, no option, no store;
    ``-p no:celery_exclusive`` removes them."""
    pytester.makepyfile(
        test_plain="""
        from celery import Celery

        from celery_exclusive import worker


        def test_plain(request):
            plugin = request.config.pluginmanager.get_plugin("celery_exclusive")
            assert plugin is not None
            assert request.config.pluginmanager.get_hookcallers(plugin) == []
            app = Celery("plain", set_as_current=False)
            assert worker._current().services.get(app) is None
        """,
        test_fixture="""
        def test_uses_it(exclusive_store):
            assert exclusive_store.locks() == []
        """,
    )
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)
    disabled = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:celery_exclusive", "test_fixture.py"
    )
    disabled.assert_outcomes(errors=1)
    disabled.stdout.fnmatch_lines(["*fixture 'exclusive_store' not found*"])


# -- the helpers, in this process ----------------------------------------------------------------

app = Celery("ce_testing_helpers", set_as_current=False)
app.conf.update(task_always_eager=True, exclusive_url="memory://", exclusive_prefix="helpers:")


@exclusive_task(app=app, key="job:{n}", bind=True)
def job(self: Any, n: int) -> int:
    return int(self.lock.fence)


@exclusive_task(app=app, key="merge:{n}", on_locked="rerun")
def merge(n: int) -> int:
    return n


@pytest.fixture
def store() -> Any:
    with ExclusiveStore() as store:
        store.install(app)
        yield store


def test_install_routes_the_apps_service_to_the_store_and_close_restores_it() -> None:
    """While installed, get_lock_service(app) is the store's; close() puts the old one back."""
    before = get_lock_service(app)
    with ExclusiveStore() as store:
        service = store.install(app)
        assert get_lock_service(app) is service
        assert service.provider is store.provider
        assert store.prefix == "helpers:"
    assert get_lock_service(app) is before


def test_a_task_run_before_install_uses_the_store_once_installed_and_its_own_after_close() -> None:
    """A task that already ran on the app's own service (a test without the store, earlier in
    the session) uses the store once it is installed, and the app's service again once it is
    closed (on main it kept the service it had looked up first, so a hold made through the
    store did not skip it and the store saw none of its leases)."""
    assert assert_not_skipped(job.delay(11)) >= 1  # looked up the app's own memory:// service
    with ExclusiveStore() as store:
        store.install(app)
        store.hold("job:11")
        assert_skipped(job.delay(11), key="job:11")
    own = get_lock_service(app)
    with own.lock("job:11"):  # held on the app's own service: the task sees it again
        assert_skipped(job.delay(11), key="job:11")


def test_hold_makes_tasks_skip_and_release_frees_the_key(store: ExclusiveStore) -> None:
    """A held key skips the task, naming the holder; released, the task runs."""
    hold = store.hold("job:1", holder={"host": "w2"})
    marker = assert_skipped(job.delay(1), key="job:1")
    assert marker["holder"] == {"host": "w2", "fence": hold.fence}
    assert hold.release() is True
    assert assert_not_skipped(job.delay(1)) > hold.fence
    with pytest.raises(InvalidArgumentError, match="already held"), store.hold("job:2"):
        store.hold("job:2")


def test_a_hold_expires_with_the_clock_but_an_own_lease_is_kept_by_its_heartbeat(
    store: ExclusiveStore,
) -> None:
    """advance() lets a hold's ttl run out while this process's heartbeat keeps its lease."""
    store.hold("job:1", ttl=60)
    own = store.service.lock("mine", ttl=30)
    store.advance(59)
    assert store.peek("job:1") is not None
    store.advance(2)
    assert store.peek("job:1") is None
    store.advance(600)
    assert own.state is LeaseState.HELD
    assert store.peek("mine") is not None
    own.release()


def test_advance_moves_the_clock_by_exactly_the_time_given(
    store: ExclusiveStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many heartbeat steps it takes (capped), the clock ends exactly ``by`` later."""
    from celery_exclusive import testing

    lease = store.service.lock("busy", ttl=3, refresh_interval=1)
    start = store.clock()
    store.advance(10.5)
    assert store.clock() == pytest.approx(start + 10.5)
    monkeypatch.setattr(testing, "MAX_ADVANCE_STEPS", 3)
    store.advance(100)
    assert store.clock() == pytest.approx(start + 110.5)
    assert lease.state is LeaseState.LOST  # the last jump was longer than its ttl


def test_without_heartbeat_passes_a_lease_dies_at_its_ttl(store: ExclusiveStore) -> None:
    """Moving only the clock (a frozen process) makes the lease LOST at its local deadline."""
    lease = store.service.lock("frozen", ttl=30)
    store.clock.advance(31)
    assert lease.state is LeaseState.LOST
    assert store.peek("frozen") is None


def test_lose_marks_the_lease_lost_fires_callbacks_and_frees_the_key(store: ExclusiveStore) -> None:
    """lose() acts as the heartbeat finding the lease gone: LOST, lost set, on_lost called."""
    lease = store.service.lock("k")
    called: list[str] = []
    lease.on_lost(lambda _lease, reason: called.append(reason))
    assert store.lose("k") is lease
    assert lease.state is LeaseState.LOST
    assert lease.lost.is_set()
    assert len(called) == 1
    assert "test" in called[0]
    assert store.peek("k") is None
    with pytest.raises(InvalidArgumentError, match="no lease"):
        store.lose("k")


def test_expire_frees_the_key_and_the_holder_learns_at_its_next_heartbeat(store: ExclusiveStore) -> None:
    """expire() frees the key in the store; the holder is LOST after the next heartbeat pass."""
    lease = store.service.lock("k")
    assert store.expire("k") is True
    assert store.peek("k") is None
    assert lease.state is LeaseState.HELD
    store.heartbeat()
    assert lease.state is LeaseState.LOST
    assert store.expire("k") is False


def test_a_rerun_request_coalesces_behind_a_rerun_policy_holder(store: ExclusiveStore) -> None:
    """hold(holder={"hands_on_reruns": True}) plays a rerun-policy run: requests coalesce."""
    store.hold("merge:1", holder={"hands_on_reruns": True})
    assert_coalesced(merge.delay(1), key="merge:1")


def test_assertions_say_what_they_got() -> None:
    """The marker assertions fail with the value they saw; they accept plain values too."""
    skipped = skip_marker("k", None)
    assert assert_skipped(skipped, key="k") == skipped
    with pytest.raises(AssertionError, match="'coalesced' marker"):
        assert_coalesced(skipped)
    with pytest.raises(AssertionError, match="for key 'other'"):
        assert_skipped(skipped, key="other")
    with pytest.raises(AssertionError, match="got the marker"):
        assert_not_skipped(skipped)
    assert assert_not_skipped(5) == 5


def test_fake_clock_moves_only_forward_and_is_thread_safe() -> None:
    clock = FakeClock(10.0)
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(InvalidArgumentError):
            clock.advance(bad)  # type: ignore[arg-type]
    threads = [threading.Thread(target=lambda: [clock.advance(0.5) for _ in range(100)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert clock() == 210.0


def test_bad_input_is_rejected_before_the_store_is_touched(store: ExclusiveStore) -> None:
    for call in (
        lambda: store.hold(""),
        lambda: store.hold("k", holder=["not", "a", "mapping"]),  # type: ignore[arg-type]
        lambda: store.hold("k", ttl=-1),
        lambda: store.expire("\x00"),
        lambda: store.advance(-5),
        lambda: store.install(object()),
        lambda: store.lose(object()),  # type: ignore[arg-type]
        lambda: ExclusiveStore(clock=lambda: 1.0),  # type: ignore[arg-type]
        lambda: ExclusiveStore(prefix="bad\x00"),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    assert store.locks() == []
