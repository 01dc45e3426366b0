"""The completion record the Celery layer builds at every run's release
(``_records.checked_completion``): checked once when made, as ``check_completion`` checks
any record, and not checked again by the release carrying it (issue #16)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from celery_exclusive import LockService, ReleaseOutcome
from celery_exclusive._records import check_completion, checked_completion
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import MAX_ATTEMPT, MAX_RETAIN, Completion

FIELDS: list[tuple[Any, Any, Any, Any]] = [
    ("t", "success", 0, 60.0),
    ("a" * 200, "failure", MAX_ATTEMPT, MAX_RETAIN),
    ("é-id", "retried", 3, 60.0),  # not ASCII: the full way
    ("t", "success", 0, 60),  # an int retain: converted the full way
    ("t", "success", 0, timedelta(minutes=1)),
    ("", "success", 0, 60.0),
    ("a" * 201, "success", 0, 60.0),
    ("a\x00b", "success", 0, 60.0),
    ("\ud800", "success", 0, 60.0),  # a lone surrogate
    (7, "success", 0, 60.0),
    ("t", "maybe", 0, 60.0),
    ("t", "success", -1, 60.0),
    ("t", "success", MAX_ATTEMPT + 1, 60.0),
    ("t", "success", True, 60.0),
    ("t", "success", 0, 0.0),
    ("t", "success", 0, float("nan")),
    ("t", "success", 0, MAX_RETAIN * 2),
]


@pytest.mark.parametrize("fields", FIELDS, ids=[repr(f)[:40] for f in FIELDS])
def test_the_built_record_is_checked_as_any_record_is(fields: tuple[Any, Any, Any, Any]) -> None:
    """The same record, or the same InvalidArgumentError, as check_completion of Completion(...)."""
    try:
        expected: Completion | str = check_completion(Completion(*fields))
    except InvalidArgumentError as exc:
        expected = str(exc)
    try:
        got: Completion | str = checked_completion(*fields)
    except InvalidArgumentError as exc:
        got = str(exc)
    assert got == expected
    if isinstance(got, Completion):
        assert type(got) is Completion
        assert check_completion(got) is got


def test_a_release_still_checks_a_record_it_was_not_given_by_the_builder() -> None:
    """After a built record, a bad record of the caller's own is refused with the lease still
    held; the built one is recorded by its release."""
    service = LockService("memory://", prefix="checked-completion:")
    try:
        lease = service.lock("k")
        good = checked_completion("task-1", "success", 0, 60.0)
        with pytest.raises(InvalidArgumentError):
            lease.release(Completion("task-1", "success", -1, 60.0))
        assert lease.held
        assert lease.release(good) is ReleaseOutcome.RELEASED
        record = service.completion("k", "task-1")
        assert record is not None
        assert (record.outcome, record.attempt) == ("success", 0)
    finally:
        service.close()
