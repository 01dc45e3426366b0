"""Health checks of a lock store, each store call under a deadline: ``doctor`` and its parts.

:func:`doctor` connects, times the round trip, lists the live leases and runs the
provider's own ``diagnose()``; it returns a :class:`Report`, which the CLI's ``doctor``
command only formats. Every store call it makes (the service's ``peek`` and ``locks``, the
provider's ``diagnose()``) runs under a deadline of :class:`~celery_exclusive._store.StoreCalls`
(the service's ``call_timeout``, 10 s by default): a store that accepts connections and
never answers (a hung server, a silent network) is a failed check after the deadline, not a
command that hangs for the driver's own timeouts. The service's own deadline is not enough
for that (measured on a silent server with ``call_timeout=1``, tests/test_cli.py): the
service's peek ends by its deadline on Redis (1.0 s) and MariaDB (1.1 s), but PostgreSQL's
first call sets up the schema within libpq's 2 s ``connect_timeout`` floor (2.0-2.2 s).
A ``diagnose()`` that takes the ``timeout`` keyword (the SQL stores' and Redis's) is given the
deadline and ends by it itself; one that does not (a third-party store's) runs in a thread
that doctor stops waiting for at the deadline.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from celery_exclusive._store import StoreCalls
from celery_exclusive.errors import BackendError
from celery_exclusive.providers.base import Diagnosis, accepts_timeout
from celery_exclusive.service import LockService
from celery_exclusive.urls import mask_url, scheme_family, url_secrets

#: Peeks timed by :func:`doctor`; the median is reported as the round trip.
DOCTOR_SAMPLES = 10
#: Median round trip above which :func:`doctor` warns (every acquire, refresh and release pays it).
SLOW_ROUND_TRIP = 0.1


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
    report.round_trip = _store_checks(service, _Bounded(timeout), report.checks)
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


class _Bounded:
    """Calls that take no ``timeout`` themselves, each run by :class:`StoreCalls` in a worker
    thread that the caller stops waiting for after ``timeout`` seconds (BackendError).

    The service's ``peek`` and ``locks`` are bounded by its ``call_timeout`` already, but not
    tightly enough for a doctor on PostgreSQL (libpq's 2 s connect floor, see the module
    docs), so they are wrapped here too; so is a ``diagnose()`` without a ``timeout``."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._calls = StoreCalls()

    def peek(self, service: LockService, key: str) -> float:
        """Seconds one peek took (timed inside the call, so the deadline's thread costs nothing)."""

        def peek() -> float:
            start = time.perf_counter()
            service.peek(key)
            return time.perf_counter() - start

        return self._calls.call("peek", peek, timeout=self.timeout)

    def locks(self, service: LockService) -> int:
        """How many live leases the service lists."""
        return len(self._calls.call("scan", service.locks, timeout=self.timeout))

    def diagnose(self, diagnose: Callable[..., Iterable[object]]) -> list[object]:
        """The provider's findings: a diagnose() taking ``timeout`` is given the deadline (it
        ends by then itself, no thread left waiting); another is listed in the call's thread
        (for a diagnose() that yields)."""
        if accepts_timeout(diagnose):
            return list(self._calls.call("diagnose", diagnose, timeout=self.timeout))
        return self._calls.call("diagnose", lambda: list(diagnose()), timeout=self.timeout)


def _store_checks(service: LockService, bounded: _Bounded, checks: list[Diagnosis]) -> float | None:
    """Append the connection, round-trip and provider checks; return the median round trip."""
    probe = f"doctor-probe:{uuid.uuid4().hex}"
    try:
        first = bounded.peek(service, probe)
    except BackendError as exc:
        checks.append(Diagnosis("connect", "fail", str(exc)))
        return None
    checks.append(Diagnosis("connect", "ok", f"first request answered in {_ms(first)}"))
    try:
        samples = [bounded.peek(service, probe) for _ in range(DOCTOR_SAMPLES)]
        live = bounded.locks(service)
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
    checks.extend(_findings(service, bounded))
    return median


def _ms(value: float) -> str:
    return f"{value * 1000:.3f} ms" if value < 0.001 else f"{value * 1000:.1f} ms"


def provider_findings(service: LockService, timeout: float | None = None) -> list[Diagnosis]:
    """The provider's own ``diagnose()`` findings (within ``timeout``, default the service's
    ``call_timeout``), each status normalised to ok/warn/fail."""
    return _findings(service, _Bounded(service.call_timeout if timeout is None else timeout))


def _findings(service: LockService, bounded: _Bounded) -> list[Diagnosis]:
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
        findings = bounded.diagnose(diagnose)
    except Exception as exc:  # a broken check is a finding, not a crash
        return [Diagnosis("diagnose", "fail", f"{type(exc).__name__}: {exc}")]
    return [_normalised(finding) for finding in findings]


def _normalised(finding: object) -> Diagnosis:
    if not isinstance(finding, Diagnosis):
        return Diagnosis("diagnose", "warn", f"unreadable finding {finding!r}")
    if finding.status not in ("ok", "warn", "fail"):
        return Diagnosis(finding.check, "warn", f"[status {finding.status!r}] {finding.detail}")
    return finding
