"""What a lock service is built from: its constructor's arguments checked (each bad one an
InvalidArgumentError before any store is touched), and the sweep interval read from the
environment when not given.

Part of the lock core (it serves :mod:`celery_exclusive.service`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from celery_exclusive._leasing import DEFAULT_SWEEP_INTERVAL
from celery_exclusive.errors import InvalidArgumentError
from celery_exclusive.providers.base import LockProvider
from celery_exclusive.urls import provider_from_url, resolve_url
from celery_exclusive.validation import check_prefix, lease_durations, seconds

#: Environment variable read when ``sweep_interval`` is not given: seconds, or 0/off.
SWEEP_ENV_VAR = "CELERY_EXCLUSIVE_SWEEP_INTERVAL"
#: The default of ``sweep_interval``: read :data:`SWEEP_ENV_VAR`.
FROM_ENV: Any = object()
#: Longest ``call_timeout`` accepted, in seconds (a day, as for ``wait``): a driver's poll
#: takes its timeout in int milliseconds (psycopg's overflows past about 24.8 days).
MAX_CALL_TIMEOUT = 24 * 60 * 60.0


@dataclass(frozen=True, slots=True)
class Options:
    """A service's settings, checked: durations in seconds, ``sweep_interval`` None for off."""

    prefix: str
    sweep_interval: float | None
    call_timeout: float
    #: (ttl, refresh_interval, max_lifetime), completed by ``validation.lease_durations``.
    durations: tuple[float, float, float]
    #: Whether ``refresh_interval`` was given (kept for leases with their own ttl, see _acquiring).
    refresh_explicit: bool
    batch_size: int


def checked(
    prefix: object,
    durations: tuple[object, object, object],
    call_timeout: object,
    sweep_interval: object,
    batch_size: object,
    **callables: object,
) -> Options:
    """The service's settings from its arguments (``durations``: ttl, refresh_interval or
    None, max_lifetime), or InvalidArgumentError naming the first bad one; each of
    ``callables`` (by argument name) must be callable."""
    ttl, refresh_interval, max_lifetime = durations
    options = Options(
        check_prefix(prefix),
        _sweep_interval(sweep_interval),
        _call_timeout(call_timeout),
        lease_durations(
            seconds("ttl", ttl),
            None if refresh_interval is None else seconds("refresh_interval", refresh_interval),
            seconds("max_lifetime", max_lifetime),
            ttl_explicit=True,
        ),
        refresh_interval is not None,
        _check_batch_size(batch_size),
    )
    for name, value in callables.items():
        if not callable(value):
            raise InvalidArgumentError(f"{name} must be callable, got {type(value).__name__}")
    return options


def store_from(store: LockProvider | str | None) -> tuple[str | None, LockProvider]:
    """The URL (None for a provider given as such) and the provider of ``store``."""
    if store is None or isinstance(store, str):
        url = resolve_url(store)
        return url, provider_from_url(url)
    if isinstance(store, LockProvider):
        return None, store
    raise InvalidArgumentError(f"store must be a URL or a LockProvider, got {type(store).__name__}")


def _call_timeout(value: object) -> float:
    timeout = seconds("call_timeout", value)
    if timeout > MAX_CALL_TIMEOUT:
        raise InvalidArgumentError(
            f"call_timeout must be at most {MAX_CALL_TIMEOUT:g} s (24 h), got {timeout:g}"
        )
    return timeout


def _check_batch_size(size: object) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise InvalidArgumentError(f"heartbeat_batch_size must be a positive int, got {size!r}")
    return size


#: The texts that turn the sweep off.
_OFF = ("0", "off", "false", "no")


def _sweep_interval(value: object) -> float | None:
    """The heartbeat's sweep interval in seconds, None for off (0, False, or the text
    ``"0"``/``"off"``/``"false"``/``"no"``, as configured or in the environment); from the
    environment (``CELERY_EXCLUSIVE_SWEEP_INTERVAL``) when not given."""
    if isinstance(value, str) and value.strip().lower() in _OFF:
        return None
    if value is FROM_ENV:
        raw = os.environ.get(SWEEP_ENV_VAR, "").strip().lower()
        if not raw:
            return DEFAULT_SWEEP_INTERVAL
        if raw in _OFF:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise InvalidArgumentError(f"{SWEEP_ENV_VAR} must be seconds or 0/off, got {raw!r}") from None
    if value is None or value is False or value == 0:
        return None
    return seconds("sweep_interval", value)
