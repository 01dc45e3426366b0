"""The origin design's lock, ported as-is to SQLAlchemy: the peer the PostgreSQL provider replaces.

From shared/reference/distributed-task-lock.md: acquire = (1) DELETE this key's expired or
stale row, (2) INSERT the row (a primary-key collision means "locked"), (3) on a collision,
SELECT the row to tell "held" from a real error; release = DELETE by key and token. Each
step is its own statement and transaction, as the origin's repository calls are; times
come from the client's clock, as the origin's did. Written the way the SQLAlchemy docs
show: Core statements on a default engine (``engine.begin()`` per step).
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

STALE = timedelta(hours=24)


def origin_table(metadata: sa.MetaData, name: str) -> sa.Table:
    """The origin's ``cache_entries`` shape: key, value (the token), expiresAt, createdAt."""
    return sa.Table(
        name,
        metadata,
        sa.Column("key", sa.String(512), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


class OriginLock:
    """``try_acquire`` / ``release`` exactly as the origin's service does them."""

    def __init__(self, engine: sa.Engine, table: sa.Table) -> None:
        self.engine = engine
        self.table = table

    def try_acquire(self, key: str, ttl: float, max_lifetime: float = STALE.total_seconds()) -> str | None:
        """The token if acquired, None if the key is held."""
        t = self.table
        token = f"{os.getpid()}-{int(time.time() * 1000)}-{secrets.token_hex(4)}"
        now = datetime.now(timezone.utc)
        with self.engine.begin() as conn:  # 1. sweep this key's expired or stale row
            conn.execute(
                sa.delete(t).where(t.c.key == key, sa.or_(t.c.expires_at < now, t.c.created_at < now - STALE))
            )
        try:
            with self.engine.begin() as conn:  # 2. INSERT: a primary-key collision means "locked"
                conn.execute(
                    sa.insert(t).values(
                        key=key,
                        value=token,
                        expires_at=now + timedelta(seconds=min(ttl, max_lifetime)),
                        created_at=now,
                    )
                )
        except sa_exc.IntegrityError:
            with self.engine.connect() as conn:  # 3. tell "held" from a real error
                if conn.execute(sa.select(t.c.key).where(t.c.key == key)).first() is not None:
                    return None
            raise
        return token

    def close(self) -> None:
        """Close the engine's pooled connections."""
        self.engine.dispose()

    def release(self, key: str, token: str) -> None:
        """Token-scoped DELETE."""
        t = self.table
        with self.engine.begin() as conn:
            conn.execute(sa.delete(t).where(t.c.key == key, t.c.value == token))
