"""The lock service's completion records (see :meth:`LockService.completion
<celery_exclusive.service.LockService.completion>`): checks, the prefix, stores without records.

Part of the lock core.
"""

from __future__ import annotations

from celery_exclusive._core import Store
from celery_exclusive._process import check_filter, unprefix
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import (
    COMPLETION_OUTCOMES,
    MAX_ATTEMPT,
    MAX_RETAIN,
    MAX_TASK_ID_LENGTH,
    Completion,
    CompletionInfo,
    CompletionStore,
)
from celery_exclusive.validation import check_key, check_task_id, seconds


class Records:
    """The service's completion records (see :meth:`LockService.completion`): key checks,
    the prefix, and None/[]/False from a store that keeps none."""

    def __init__(self, service: Store) -> None:
        self._service = service
        self._store = service.provider if isinstance(service.provider, CompletionStore) else None

    def for_release(self, completion: Completion | None) -> Completion | None:
        """``completion`` checked, or None when there is none or the store keeps no records."""
        if completion is None:
            return None
        completion = check_completion(completion)
        return completion if self._store is not None else None

    def _store_key(self, key: str, task_id: str) -> str:
        service = self._service
        check_key(key, prefix=service.prefix, max_length=service.provider.max_key_length)
        check_task_id(task_id, MAX_TASK_ID_LENGTH)
        return service.prefix + key

    def completion(self, key: str, task_id: str) -> CompletionInfo | None:
        store_key = self._store_key(key, task_id)
        if self._store is None:
            return None
        found = self._service._call("read a record", self._store.completion, store_key, task_id)
        return None if found is None else self.unprefixed(found)

    def completions(self, prefix: str) -> list[CompletionInfo]:
        check_filter(prefix, text=False)
        if self._store is None:
            return []
        found = self._service._call("list records", self._store.completions, self._service.prefix + prefix)
        return [self.unprefixed(record) for record in found]

    def forget(self, key: str, task_id: str) -> bool:
        store_key = self._store_key(key, task_id)
        if self._store is None:
            return False
        return bool(self._service._call("forget a record", self._store.forget, store_key, task_id))

    def unprefixed(self, record: CompletionInfo) -> CompletionInfo:
        return CompletionInfo(
            unprefix(record.key, self._service.prefix),
            record.task_id,
            record.outcome,
            record.attempt,
            record.age,
            record.expires_in,
        )


#: Completion's slot setters, by field: what its frozen ``__init__`` calls through
#: ``object.__setattr__``, without that call (see :func:`checked_completion`).
_SETTERS = tuple(Completion.__dict__[name].__set__ for name in ("task_id", "outcome", "attempt", "retain"))
_new = object.__new__
#: The last record :func:`checked_completion` made and checked (immutable, so it stays
#: checked): the release that carries it skips :func:`check_completion`'s checks. One
#: reference, replaced by the next record; another thread's record in between only means
#: the full check runs.
_last_checked: Completion | None = None


def checked_completion(task_id: str, outcome: str, attempt: int, retain: float) -> Completion:
    """``Completion(task_id, outcome, attempt, retain)``, checked whole as
    :func:`check_completion` checks it (InvalidArgumentError for the same values), for a
    record the library builds at a run's release (the Celery layer, whose usual run makes
    its record the same way inline, its values checked by its plan): the usual values
    (an ASCII task id, an int attempt, float seconds) are tested once here, the record is
    made without the frozen dataclass's ``__init__`` and the release does not check it again."""
    global _last_checked  # noqa: PLW0603 - one reference, see _last_checked
    if (
        type(task_id) is str
        and 0 < len(task_id) <= MAX_TASK_ID_LENGTH
        and task_id.isascii()
        and "\x00" not in task_id
        and outcome in COMPLETION_OUTCOMES
        and type(attempt) is int
        and 0 <= attempt <= MAX_ATTEMPT
        and type(retain) is float
        and 0.0 < retain <= MAX_RETAIN
    ):
        completion = _new(Completion)
        set_task_id, set_outcome, set_attempt, set_retain = _SETTERS
        set_task_id(completion, task_id)
        set_outcome(completion, outcome)
        set_attempt(completion, attempt)
        set_retain(completion, retain)
    else:  # anything else the full way: the same record, or the same error
        completion = check_completion(Completion(task_id, outcome, attempt, retain))
    _last_checked = completion
    return completion


def check_completion(completion: object) -> Completion:
    """``completion`` checked whole, before the release changes any state (a store refusing
    a field mid-release would leave the key held with no heartbeat until its ttl): its
    ``retain`` as float seconds (a timedelta converted), within :data:`MAX_RETAIN`, and its
    ``attempt`` within :data:`MAX_ATTEMPT`. The record :func:`checked_completion` made
    last is not checked again."""
    if completion is _last_checked and completion is not None:
        return completion
    if not isinstance(completion, Completion):
        raise InvalidArgumentError(f"completion must be a Completion, got {type(completion).__name__}")
    check_task_id(completion.task_id, MAX_TASK_ID_LENGTH)
    if completion.outcome not in COMPLETION_OUTCOMES:
        raise InvalidArgumentError(f"completion outcome must be one of {COMPLETION_OUTCOMES}")
    attempt = completion.attempt
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 0 <= attempt <= MAX_ATTEMPT:
        raise InvalidArgumentError(
            f"completion attempt must be an int from 0 to {MAX_ATTEMPT}, got {attempt!r}"
        )
    retain = completion.retain
    if type(retain) is float and 0.0 < retain <= MAX_RETAIN:  # the usual float: no call
        return completion
    retain = seconds("completion retain", retain)
    if retain > MAX_RETAIN:
        raise InvalidArgumentError(f"completion retain is {retain:g} s; at most {MAX_RETAIN:g} s (10 years)")
    return Completion(completion.task_id, completion.outcome, attempt, retain)
