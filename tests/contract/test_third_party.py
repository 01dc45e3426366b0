"""The exported contract as a third party uses it: a store of their own, one subclass, one
fixture, in a pytest of its own (pytester); and the suite catches a store that is wrong."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["pytester"]
LONG = os.environ.get("CE_LONG", "").strip().lower() not in ("", "0", "false", "no")

THIRD_PARTY = '''
import pytest

from celery_exclusive import LockService
from celery_exclusive.providers.sql import SqlLockProvider
from celery_exclusive.testing.contract import OUTAGE_SECRET, LockContract, open_store

URL = "sqlite:///{db}"


class TheirProvider:
    """Somebody's own store: here it delegates to SQLite, through the protocol only."""

    max_key_length = 255

    def __init__(self, url=URL, *, broken=False):
        self._inner = SqlLockProvider.from_url(url)
        self._broken = broken

    def acquire(self, key, token, ttl, max_lifetime, holder, *, task_id=None):
        return self._inner.acquire(key, token, ttl, max_lifetime, holder, task_id=task_id)

    def refresh(self, requests):
        return self._inner.refresh(requests)

    def release(self, key, token, completion=None):
        if self._broken:  # a bug: releases whoever holds the key
            if completion is not None:  # and a bug: its record replaces a later attempt's
                self._inner.forget(key, completion.task_id)
            info = self._inner.peek(key)
            return info is not None and self._inner.release(key, info.token, completion)
        return self._inner.release(key, token, completion)

    def peek(self, key):
        return self._inner.peek(key)

    def scan(self, prefix):
        return self._inner.scan(prefix)

    def completion(self, key, task_id):
        return self._inner.completion(key, task_id)

    def completions(self, prefix):
        return self._inner.completions(prefix)

    def forget(self, key, task_id):
        return self._inner.forget(key, task_id)

    def close(self):
        self._inner.close()

    def diagnose(self):
        return self._inner.diagnose()


def provider():
    return TheirProvider()


def broken_provider():
    return TheirProvider(broken=True)


def unreachable():
    return LockService(TheirProvider(f"sqlite:////no-such-dir/{{OUTAGE_SECRET}}/locks.sqlite3"))


class TestTheirStore(LockContract):
    @pytest.fixture
    def store(self):
        with open_store("theirs", provider_factory=provider, outage=unreachable) as store:
            yield store


class TestTheirBrokenStore(LockContract):
    @pytest.fixture
    def store(self):
        with open_store("broken", provider_factory=broken_provider, fencing=False) as store:
            yield store
'''


def write_suite(pytester: pytest.Pytester) -> None:
    db = pytester.path / "locks.sqlite3"
    pytester.makepyfile(test_their_store=THIRD_PARTY.replace("{db}", str(db)))


#: The short mode's selection: the cross-process path (spawned processes build their store
#: through the provider factory), the outage and guard capabilities, token-bound calls, the
#: completion records' order.
SHORT = (
    "process_contention or outage or guard or wrong_token or idempotent or double_release or earlier_attempt"
)


def test_a_third_party_store_runs_the_contract_with_one_subclass(pytester: pytest.Pytester) -> None:
    """Their store passes the contract (in short mode the tests above; all with CE_LONG=1),
    skipping only the capability it lacks (guard); their broken store fails it where its
    release ignores the token or its record replaces a later attempt's, and
    ``fencing=False`` skips the fence test."""
    write_suite(pytester)
    broken = "TestTheirBrokenStore and (wrong_token or double_release or fences_increase or earlier_attempt)"
    good = "TestTheirStore" if LONG else f"TestTheirStore and ({SHORT})"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rfs", "-k", f"({good}) or ({broken})")
    result.assert_outcomes(passed=24 if LONG else 7, failed=3, skipped=4 if LONG else 2)
    result.stdout.fnmatch_lines_random(
        [
            "*store 'theirs' cannot share a transaction*",
            "*store 'broken' gives no fencing numbers*",
            "FAILED*TestTheirBrokenStore::test_wrong_token_refresh_and_release_change_nothing*",
            "FAILED*TestTheirBrokenStore::test_double_release_is_harmless*",
            "FAILED*TestTheirBrokenStore::test_a_record_never_goes_back_to_an_earlier_attempt*",
        ]
    )
