"""A Redis client for the test Celery apps' worker processes, never shared across fork."""

from __future__ import annotations

import os
import threading

import redis

#: The socket timeout of the suite's own Redis clients (records, events, a test's admin),
#: in seconds: longer than the longest blocking call they make (a BLPOP of 60 s). redis-py
#: 8 made 5 s the default (none before), which ended such a wait early with TimeoutError.
SOCKET_TIMEOUT = 90.0


class ForkSafeRedis:
    """``get()`` returns this process's client of ``url``, made on first use after a fork."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: tuple[int, redis.Redis] | None = None
        self._mutex = threading.Lock()

    def get(self) -> redis.Redis:
        with self._mutex:
            if self._client is None or self._client[0] != os.getpid():
                self._client = (os.getpid(), redis.Redis.from_url(self.url, socket_timeout=SOCKET_TIMEOUT))
            return self._client[1]
