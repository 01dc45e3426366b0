"""The provider registry: which provider each lock store URL scheme selects.

:data:`PROVIDERS` is the one table of schemes; every other scheme list
(:data:`KNOWN_SCHEMES`, the scheme families, ``celery_exclusive.urls``' names) is derived
from it. Providers are named as ``"module:attribute"`` and imported only when a URL needs
one, so importing any provider module (which imports this package) loads no driver.
"""

from __future__ import annotations

import importlib
from typing import Any

from celery_exclusive.errors import ConfigurationError
from celery_exclusive.providers.base import LockProvider
from celery_exclusive.urls import mask_url

__all__ = [
    "DRIVER_SCHEMES",
    "KNOWN_SCHEMES",
    "PROVIDERS",
    "LockProvider",
    "provider_class",
    "provider_from_url",
    "scheme_family",
]

_MEMORY = "celery_exclusive.providers.memory:MemoryLockProvider"
_POSTGRES = "celery_exclusive.providers.postgres:PostgresLockProvider"
_SQL = "celery_exclusive.providers.sql:SqlLockProvider"
_REDIS = "celery_exclusive.providers.redis:RedisLockProvider"
_DJANGO = "celery_exclusive.contrib.django.store:provider_from_django_url"

#: URL scheme -> ``"module:attribute"`` of its provider: a class built by its ``from_url``
#: (or by calling it with the URL), or a function of the URL.
PROVIDERS: dict[str, str] = {
    "memory": _MEMORY,
    "postgresql": _POSTGRES,
    "postgres": _POSTGRES,
    "postgresql+psycopg": _POSTGRES,
    "sqlite": _SQL,
    "mysql": _SQL,
    "mysql+pymysql": _SQL,
    "mariadb": _SQL,
    "mariadb+pymysql": _SQL,
    "redis": _REDIS,
    "rediss": _REDIS,
    "unix": _REDIS,
    "redis+cluster": _REDIS,
    "rediss+cluster": _REDIS,
    "redis+sentinel": _REDIS,
    "rediss+sentinel": _REDIS,
    "sentinel": _REDIS,
    "django": _DJANGO,
}

#: Every scheme of :data:`PROVIDERS`, sorted (for messages that list them).
KNOWN_SCHEMES = tuple(sorted(PROVIDERS))
#: Schemes whose ``<scheme>+<driver>`` variants name an SQLAlchemy driver (``postgresql+psycopg2``).
DRIVER_SCHEMES = frozenset(
    s for s, target in PROVIDERS.items() if "+" not in s and target in (_POSTGRES, _SQL)
)
#: Provider family by the provider's module; any other module is an SQL store.
_FAMILIES = {"celery_exclusive.providers.memory": "memory", "celery_exclusive.providers.redis": "redis"}


def _scheme(url: object) -> str:
    """The registry's scheme for ``url`` (a driver variant resolved), or ConfigurationError."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(
            f"malformed lock store URL {mask_url(str(url))!r}: expected scheme://..., "
            f"one of {', '.join(KNOWN_SCHEMES)}"
        )
    scheme = url.split("://", 1)[0].lower()
    if scheme in PROVIDERS:
        return scheme
    base = scheme.split("+", 1)[0]
    if base in DRIVER_SCHEMES:
        return base
    raise ConfigurationError(
        f"unknown lock store scheme {scheme!r} in {mask_url(url)!r}; "
        f"known schemes: {', '.join(KNOWN_SCHEMES)}"
    )


def scheme_family(url: str) -> str:
    """``sql``, ``redis`` or ``memory`` for a URL, or ConfigurationError naming known schemes."""
    module = PROVIDERS[_scheme(url)].partition(":")[0]
    return _FAMILIES.get(module, "sql")


def provider_class(scheme: str) -> Any:
    """The provider (class or factory) registered for ``scheme``, imported now."""
    module, _, name = PROVIDERS[scheme].partition(":")
    return getattr(importlib.import_module(module), name)


def provider_from_url(url: str) -> LockProvider:
    """Build the provider the URL's scheme selects; drivers are imported only here."""
    scheme = _scheme(url)
    target = provider_class(scheme)
    build = getattr(target, "from_url", target)
    return build(url)  # type: ignore[no-any-return]
