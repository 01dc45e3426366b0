"""Health checks of a lock store, each store call under a deadline: ``doctor`` and its parts.

:func:`doctor` connects, times the round trip, lists the live leases and runs the
provider's own ``diagnose()``; it returns a :class:`Report`, which the CLI's ``doctor``
command only formats. Every store call it makes runs under :func:`within`: a store that
accepts connections and never answers (a hung server, a silent network) is a failed check
after the deadline (the service's ``call_timeout``, 10 s by default), not a command that
hangs for the driver's own timeouts. The worker's warm-up at process start uses
:func:`within` as well (see :mod:`celery_exclusive.worker`).
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from celery_exclusive.errors import BackendError
from celery_exclusive.providers.base import Diagnosis
from celery_exclusive.service import LockService
from celery_exclusive.urls import mask_url, scheme_family, url_secrets

T = TypeVar("T")

#: Peeks timed by :func:`doctor`; the median is reported as the round trip.
DOCTOR_SAMPLES = 10
#: Median round trip above which :func:`doctor` warns (every acquire, refresh and release pays it).
SLOW_ROUND_TRIP = 0.1


def within(timeout: float, what: str, call: Callable[[], T]) -> T:
    """``call()``, waited for at most ``timeout`` seconds: its result or its exception.

    The call runs in a daemon thread; past the deadline this raises :class:`BackendError`
    and leaves the call to end on its own (its outcome is then dropped): the caller stops
    waiting for a store that does not answer, whatever the driver's own timeouts are.
    """
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the waiting thread
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name=f"celery-exclusive-{what}", daemon=True).start()
    if not done.wait(timeout):
        raise BackendError(f"lock store did not answer the {what} within {timeout:g} s")
    answered, value = outcome[0]
    if answered:
        return value  # type: ignore[no-any-return]
    raise value


@dataclass
class Report:
    """What :func:`doctor` found: its checks (details already scrubbed of the URL's secrets)
    and the median round trip in seconds (None when the store did not answer)."""

    url: str | None
    prefix: str
    checks: list[Diagnosis] = field(default_factory=list)
    round_trip: float | None = None

    @property
    def failed(self) -> int:
        return sum(d.status == "fail" for d in self.checks)

    @property
    def warned(self) -> int:
        return sum(d.status == "warn" for d in self.checks)

    @property
    def ok(self) -> bool:
        return self.failed == 0


def doctor(service: LockService, *, url: str | None = None, call_timeout: float | None = None) -> Report:
    """Check ``service``'s store: the URL (when given), connect, round trip, listing, and
    the provider's own findings. Each store call waits at most ``call_timeout`` seconds
    (default: the service's); a store that fails or does not answer is a failed check."""
    timeout = service.call_timeout if call_timeout is None else call_timeout
    report = Report(None if url is None else mask_url(url), service.prefix)
    if url is not None:
        report.checks.extend(_url_checks(url, service.prefix))
    report.round_trip = _store_checks(service, timeout, report.checks)
    secrets = url_secrets(url or "")
    report.checks = [Diagnosis(d.check, d.status, mask_url(d.detail, secrets)) for d in report.checks]
    return report


def _url_checks(url: str, prefix: str) -> list[Diagnosis]:
    family = scheme_family(url)
    checks = [Diagnosis("url", "ok", f"{mask_url(url)} ({family} store), key prefix {prefix!r}")]
    if family == "memory":
        checks.append(
            Diagnosis(
                "scope",
                "warn",
                "memory:// lives inside one process: this command sees only its own empty store, "
                "never a worker's leases, and gives no exclusion across processes",
            )
        )
    return checks


def _timed_peek(service: LockService, key: str, timeout: float) -> float:
    """Seconds one peek took (timed inside the call, so the deadline's thread costs nothing)."""

    def peek() -> float:
        start = time.perf_counter()
        service.peek(key)
        return time.perf_counter() - start

    return within(timeout, "peek", peek)


def _store_checks(service: LockService, timeout: float, checks: list[Diagnosis]) -> float | None:
    """Append the connection, round-trip and provider checks; return the median round trip."""
    probe = f"doctor-probe:{uuid.uuid4().hex}"
    try:
        first = _timed_peek(service, probe, timeout)
    except BackendError as exc:
        checks.append(Diagnosis("connect", "fail", str(exc)))
        return None
    checks.append(Diagnosis("connect", "ok", f"first request answered in {_ms(first)}"))
    try:
        samples = [_timed_peek(service, probe, timeout) for _ in range(DOCTOR_SAMPLES)]
        live = len(within(timeout, "scan", service.locks))
    except BackendError as exc:
        checks.append(Diagnosis("round trip", "fail", str(exc)))
        return None
    median = statistics.median(samples)
    detail = (
        f"median {_ms(median)} over {len(samples)} peeks (min {_ms(min(samples))}, max {_ms(max(samples))})"
    )
    if median > SLOW_ROUND_TRIP:
        checks.append(
            Diagnosis("round trip", "warn", f"{detail}: slow; every acquire, refresh and release pays it")
        )
    else:
        checks.append(Diagnosis("round trip", "ok", detail))
    checks.append(Diagnosis("listing", "ok", f"{live} live lease(s) under {service.prefix!r}"))
    checks.extend(provider_findings(service, timeout))
    return median


def _ms(value: float) -> str:
    return f"{value * 1000:.3f} ms" if value < 0.001 else f"{value * 1000:.1f} ms"


def provider_findings(service: LockService, timeout: float | None = None) -> list[Diagnosis]:
    """The provider's own ``diagnose()`` findings (within ``timeout``, default the service's
    ``call_timeout``), each status normalised to ok/warn/fail."""
    provider = service.provider
    diagnose = getattr(provider, "diagnose", None)
    if not callable(diagnose):
        return [
            Diagnosis(
                "diagnose",
                "warn",
                f"{type(provider).__name__} has no diagnose(); store-specific checks were skipped",
            )
        ]
    try:
        findings = within(
            service.call_timeout if timeout is None else timeout, "diagnose", lambda: list(diagnose())
        )
    except Exception as exc:  # a broken check is a finding, not a crash
        return [Diagnosis("diagnose", "fail", f"{type(exc).__name__}: {exc}")]
    return [_normalised(finding) for finding in findings]


def _normalised(finding: object) -> Diagnosis:
    if not isinstance(finding, Diagnosis):
        return Diagnosis("diagnose", "warn", f"unreadable finding {finding!r}")
    if finding.status not in ("ok", "warn", "fail"):
        return Diagnosis(finding.check, "warn", f"[status {finding.status!r}] {finding.detail}")
    return finding
