"""Owner tokens: 128 random bits each, never repeated across threads, refills or a fork."""

from __future__ import annotations

import os
import re
import threading
import warnings

from celery_exclusive._process import TOKENS_PER_DRAW, new_token, this

_SHAPE = re.compile(r"^(?P<prefix>.+:\d+:)\d+:(?P<random>[0-9a-f]{32})$")


def _random_part(token: str) -> str:
    found = _SHAPE.match(token)
    assert found is not None, token
    assert found["prefix"] == this.token_prefix
    return found["random"]


def test_a_token_carries_128_random_bits_never_repeated_over_several_refills() -> None:
    parts = [_random_part(new_token()) for _ in range(TOKENS_PER_DRAW * 5 + 3)]
    assert len(set(parts)) == len(parts)


def test_threads_drawing_at_once_never_get_the_same_random_part() -> None:
    drawn: list[list[str]] = [[] for _ in range(8)]
    start = threading.Barrier(8)

    def draw(into: list[str]) -> None:
        start.wait()
        into.extend(_random_part(new_token()) for _ in range(TOKENS_PER_DRAW * 3))

    threads = [threading.Thread(target=draw, args=(into,)) for into in drawn]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [part for into in drawn for part in into]
    assert len(set(every)) == len(every) == 8 * TOKENS_PER_DRAW * 3


def test_a_forked_child_never_draws_what_its_parent_draws_next() -> None:
    new_token()  # the pool is part-used at the fork: the child must not go on from it
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process (3.12+)
        pid = os.fork()
    if pid == 0:
        try:
            os.write(write, "\n".join(new_token() for _ in range(TOKENS_PER_DRAW)).encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    child = b"".join(chunks).decode().split("\n")
    assert len(child) == TOKENS_PER_DRAW
    assert str(pid) in child[0].split(":")  # the child's own pid in its prefix
    parent = {_random_part(new_token()) for _ in range(TOKENS_PER_DRAW)}
    assert not parent & {token.rsplit(":", 1)[1] for token in child}
