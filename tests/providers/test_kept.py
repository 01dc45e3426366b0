"""KeptConnections across fork: a child never takes a connection its parent kept."""

from __future__ import annotations

from celery_exclusive.providers._kept import KeptConnections
from tests.conftest import in_forked_child


def test_a_forked_child_hands_the_parents_connections_to_on_fork_and_takes_none() -> None:
    inherited: list[str] = []
    kept: KeptConnections[str] = KeptConnections(on_fork=inherited.extend)
    kept.give("parent's", 1.0)

    def child() -> bool:
        first = kept.take()
        kept.give("child's", 2.0)
        return first is None and inherited == ["parent's"] and kept.take() == ("child's", 2.0)

    assert in_forked_child(child)
    assert kept.take() == ("parent's", 1.0)  # the parent's own, untouched by the child
    assert inherited == []


def test_a_grandchild_is_a_new_process_too() -> None:
    kept: KeptConnections[str] = KeptConnections()
    kept.give("parent's", 1.0)

    def child() -> bool:
        if kept.take() is not None:
            return False
        kept.give("child's", 2.0)
        return in_forked_child(lambda: kept.take() is None and len(kept) == 0)

    assert in_forked_child(child)
    assert len(kept) == 1
