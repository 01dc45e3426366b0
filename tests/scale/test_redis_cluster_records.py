"""Completion records on a private three-primary Redis Cluster: the record contract suite
once more, plus records on keys of every primary (a record is a field of its lock's hash,
so it lives in the lock's slot and every script stays single-slot)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from celery_exclusive import LockService
from celery_exclusive.providers.base import Completion
from tests.conftest import Store
from tests.contract import test_completion_records as _records
from tests.scale.conftest import contract_store


@pytest.fixture
def store(redis_cluster: str) -> Iterator[Store]:
    """The contract suite's ``store``, here the private cluster."""
    yield from contract_store("redis-cluster", redis_cluster)


def test_records_on_keys_of_every_primary(redis_cluster: str) -> None:
    """Records on 60 keys spread over all primaries are written, listed and forgotten."""
    service = LockService(redis_cluster, prefix=f"r{uuid.uuid4().hex[:8]}:")
    try:
        keys = [f"k{i}" for i in range(60)]
        cluster = service.provider._client  # type: ignore[attr-defined]
        owners = {
            cluster.nodes_manager.get_node_from_slot(cluster.keyslot(service.prefix + k)).name for k in keys
        }
        assert len(owners) == 3
        for key in keys:
            service.lock(key, task_id=f"id-{key}").release(Completion(f"id-{key}", "success", 0, 60.0))
        assert [(r.key, r.task_id) for r in service.completions()] == sorted((k, f"id-{k}") for k in keys)
        assert all(service.forget(k, f"id-{k}") for k in keys)
        assert service.completions() == []
    finally:
        service.close()


globals().update({name: getattr(_records, name) for name in dir(_records) if name.startswith("test_")})
