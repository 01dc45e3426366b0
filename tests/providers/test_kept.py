"""KeptConnections across fork: a child never takes a connection its parent kept."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

from celery_exclusive.providers._kept import KeptConnections


def _in_child(check: Callable[[], bool]) -> bool:
    """``check()`` run in a forked child; its answer, read back through a pipe."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process (3.12+)
        pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = check()
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    return answer == b"1"


def test_a_forked_child_hands_the_parents_connections_to_on_fork_and_takes_none() -> None:
    inherited: list[str] = []
    kept: KeptConnections[str] = KeptConnections(on_fork=inherited.extend)
    kept.give("parent's", 1.0)

    def child() -> bool:
        first = kept.take()
        kept.give("child's", 2.0)
        return first is None and inherited == ["parent's"] and kept.take() == ("child's", 2.0)

    assert _in_child(child)
    assert kept.take() == ("parent's", 1.0)  # the parent's own, untouched by the child
    assert inherited == []


def test_a_grandchild_is_a_new_process_too() -> None:
    kept: KeptConnections[str] = KeptConnections()
    kept.give("parent's", 1.0)

    def child() -> bool:
        if kept.take() is not None:
            return False
        kept.give("child's", 2.0)
        return _in_child(lambda: kept.take() is None and len(kept) == 0)

    assert _in_child(child)
    assert len(kept) == 1
