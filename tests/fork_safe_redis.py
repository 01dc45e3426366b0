"""A Redis client for the test Celery apps' worker processes, never shared across fork."""

from __future__ import annotations

import os
import threading

import redis


class ForkSafeRedis:
    """``get()`` returns this process's client of ``url``, made on first use after a fork."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: tuple[int, redis.Redis] | None = None
        self._mutex = threading.Lock()

    def get(self) -> redis.Redis:
        with self._mutex:
            if self._client is None or self._client[0] != os.getpid():
                self._client = (os.getpid(), redis.Redis.from_url(self.url))
            return self._client[1]
