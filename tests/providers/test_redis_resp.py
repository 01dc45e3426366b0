"""The hot commands packed in Python (``_redis_resp``) are the bytes hiredis packs, or None."""

from __future__ import annotations

import pytest
from hiredis import pack_command

from celery_exclusive.providers import _redis_resp as resp
from celery_exclusive.providers._redis_scripts import ACQUIRE, FENCES, RELEASE, SHA

HOLDER = '{"host":"h","pid":1,"task_id":"t-1"}'


class Text(str):
    """A str subclass: packed by hiredis, never here."""


@pytest.mark.parametrize("key", ["k", "ce:" + "x" * 150, "a b\r\n$3"])
@pytest.mark.parametrize(("ttl_ms", "life_ms"), [(1, 1), (900_000, 3_600_000), (2**40, 10**12)])
@pytest.mark.parametrize("task_id", [None, "", "0123-abcd"])
def test_acquire_is_what_hiredis_packs(key: str, ttl_ms: int, life_ms: int, task_id: str | None) -> None:
    token = "0123456789abcdef" * 2
    once = () if task_id is None else (task_id,)
    expected = pack_command(("EVALSHA", SHA[ACQUIRE], 2, key, FENCES, token, ttl_ms, life_ms, HOLDER, *once))
    assert resp.acquire(key, FENCES, token, ttl_ms, life_ms, HOLDER, task_id) == expected


@pytest.mark.parametrize("key", ["k", "ce:" + "x" * 1000])
def test_release_is_what_hiredis_packs(key: str) -> None:
    token = "f" * 32
    assert resp.release(key, token) == pack_command(("EVALSHA", SHA[RELEASE], 1, key, token))
    for retain_ms in (1, 86_400_000):
        expected = pack_command(("EVALSHA", SHA[RELEASE], 1, key, token, "t-9", "0|success", retain_ms))
        assert resp.release_done(key, token, "t-9", resp.record("0|success", retain_ms)) == expected


def test_anything_but_ascii_text_is_left_to_hiredis() -> None:
    token = "f" * 32
    for key, holder, task_id in [
        ("clé", HOLDER, None),
        ("k", '{"host":"hôte"}', None),
        ("k", HOLDER, "tâche"),
        (Text("k"), HOLDER, None),
        ("k", Text(HOLDER), None),
        ("k", HOLDER, Text("t")),
        ("k", HOLDER, 7),
    ]:
        assert resp.acquire(key, FENCES, token, 1000, 1000, holder, task_id) is None  # type: ignore[arg-type]
    assert resp.acquire("k", FENCES, Text(token), 1000, 1000, HOLDER, None) is None
    assert resp.release("clé", token) is None
    assert resp.release("k", Text(token)) is None
    tail = resp.record("0|success", 1)
    assert resp.release_done("k", token, "tâche", tail) is None
    assert resp.release_done("k", token, b"t", tail) is None  # type: ignore[arg-type]
    assert resp.release_done("k", token, "t", resp.record("0|succès", 1)) is None


def test_the_durations_kept_are_bounded() -> None:
    for ms in range(10_000, 10_300):
        assert resp.acquire("k", FENCES, "t", ms, ms + 1, HOLDER, None) == pack_command(
            ("EVALSHA", SHA[ACQUIRE], 2, "k", FENCES, "t", ms, ms + 1, HOLDER)
        )
    assert len(resp._NUMBERS) <= resp._MAX_NUMBERS


@pytest.mark.parametrize("size", [1, 9, 10, resp.SHORT - 1, resp.SHORT, resp.SHORT + 1, 70_000])
def test_length_headers_are_hiredis_s_either_side_of_the_table(size: int) -> None:
    """Arguments ``size`` characters long, shorter and longer than the table of length
    headers, one at a time, and a cluster's own fences key: the bytes hiredis packs."""
    text, token = "x" * (size - 1), "f" * 32
    for key, tok, holder, task_id in [
        ("k" + text, token, HOLDER, None),
        ("k", "t" + text, HOLDER, "0123"),
        ("k", token, "{" + text, None),
        ("k", token, HOLDER, "i" + text),
    ]:
        for fences in (FENCES, "FENCES{abc}"):
            once = () if task_id is None else (task_id,)
            command = ("EVALSHA", SHA[ACQUIRE], 2, key, fences, tok, 900_000, 3_600_000, holder, *once)
            packed = resp.acquire(key, fences, tok, 900_000, 3_600_000, holder, task_id)
            assert packed == pack_command(command)
        assert resp.release(key, tok) == pack_command(("EVALSHA", SHA[RELEASE], 1, key, tok))
        done = (task_id or "t-9", "|" + text)
        assert resp.release_done(key, tok, done[0], resp.record(done[1], 86_400_000)) == pack_command(
            ("EVALSHA", SHA[RELEASE], 1, key, tok, *done, 86_400_000)
        )


def test_a_release_s_record_arguments_are_made_afresh_for_every_kind_of_record() -> None:
    """The provider keeps the record arguments it made last per outcome: each call answers
    what it would make from scratch, however the attempt, retention or outcome change
    between calls (a bool attempt is not the int it equals), and it keeps few."""
    from celery_exclusive.providers.base import Completion
    from celery_exclusive.providers.redis import _RECORDS, _record_args, whole_ms

    def fresh(c: Completion) -> tuple[str, int, str]:
        result, ms = f"{c.attempt}|{c.outcome}", whole_ms(c.retain)
        return result, ms, resp.record(result, ms)

    kinds = [(0, "success", 86400.0), (2, "success", 86400.0), (0, "success", 60.0), (0, "success", 86400)]
    kinds += [
        (1, "failure", 86400.0),
        (True, "success", 86400.0),
        (1, "success", 86400.0),
        (True, "success", 1.0),
    ]
    kinds += [(0, f"outcome-{i}", 1.5) for i in range(40)]
    for attempt, outcome, retain in kinds * 2:
        c = Completion("t-1", outcome, attempt, retain)
        assert _record_args(c) == fresh(c), (attempt, outcome, retain)
    assert len(_RECORDS) <= 16
