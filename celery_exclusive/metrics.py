"""Prometheus metrics for lock events (``pip install 'celery-exclusive[metrics]'``).

::

    from celery_exclusive import metrics
    metrics.install()            # default registry; install(registry=...) for another one

:func:`install` connects receivers to :mod:`celery_exclusive.signals`; it is idempotent,
and :func:`uninstall` disconnects them (the series stay registered, so counters never go
backwards if metrics are installed again on the same registry). Every metric name starts
with ``celery_exclusive_``; see ``docs/observability.md`` for the list.

No metric has the lock key as a label: keys are usually built from arguments (one per
pull request, per customer, ...), so a key label would create an unbounded number of time
series and exhaust the Prometheus server's memory. Labels are only small fixed sets
(outcomes) or the task name (bounded by the code base).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from celery_exclusive import signals
from celery_exclusive.errors import InvalidArgumentError, MissingDriverError

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise MissingDriverError("metrics", "prometheus_client") from exc

__all__ = ["Metrics", "install", "installed", "uninstall"]

NAMESPACE = "celery_exclusive"

HOLD_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600, 7200, 21600, 86400)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)

ACQUIRE_OUTCOMES = ("acquired", "contended")
RELEASE_OUTCOMES = ("released", "not_owned", "unknown")


@dataclass(frozen=True)
class Metrics:
    """The metric objects on one registry; values change only while installed."""

    registry: CollectorRegistry
    acquisitions: Counter
    task_skips: Counter
    hold_seconds: Histogram
    releases: Counter
    heartbeat_seconds: Histogram
    heartbeat_leases: Histogram
    heartbeat_failures: Counter
    leases_lost: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> Metrics:
        """Register every metric on ``registry`` (ValueError if the names are taken)."""
        kw: dict[str, Any] = {"namespace": NAMESPACE, "registry": registry}
        metrics = cls(
            registry=registry,
            acquisitions=Counter("acquisitions", "Lock acquisition attempts by outcome.", ["outcome"], **kw),
            task_skips=Counter(
                "task_skips", "Task runs skipped because their lock was held, by task name.", ["task"], **kw
            ),
            hold_seconds=Histogram(
                "hold_seconds",
                "Seconds a lease was held, from acquisition to release.",
                buckets=HOLD_BUCKETS,
                **kw,
            ),
            releases=Counter("releases", "Lease releases by outcome.", ["outcome"], **kw),
            heartbeat_seconds=Histogram(
                "heartbeat_duration_seconds",
                "Round-trip time of one heartbeat refresh call.",
                buckets=LATENCY_BUCKETS,
                **kw,
            ),
            heartbeat_leases=Histogram(
                "heartbeat_leases",
                "Leases confirmed by one heartbeat refresh call.",
                buckets=BATCH_BUCKETS,
                **kw,
            ),
            heartbeat_failures=Counter(
                "heartbeat_failures", "Heartbeat refresh calls that failed (leases in jeopardy).", **kw
            ),
            leases_lost=Counter("leases_lost", "Leases lost before they were released.", **kw),
        )
        # Pre-create the outcome series so they are scraped as 0 before the first event.
        for outcome in ACQUIRE_OUTCOMES:
            metrics.acquisitions.labels(outcome)
        for outcome in RELEASE_OUTCOMES:
            metrics.releases.labels(outcome)
        return metrics

    # Receivers: Celery signals call them with ``signal``, ``sender`` and the documented kwargs.

    def on_acquired(self, sender: object = None, **kwargs: Any) -> None:
        """``lock_acquired``: count an acquisition."""
        self.acquisitions.labels("acquired").inc()

    def on_contended(self, sender: object = None, **kwargs: Any) -> None:
        """``lock_contended``: count a refused acquisition."""
        self.acquisitions.labels("contended").inc()

    def on_skipped(self, sender: object = None, **kwargs: Any) -> None:
        """``task_skipped``: count a skipped run under its task's name."""
        task = kwargs.get("task", sender)
        self.task_skips.labels(str(getattr(task, "name", None) or "unknown")).inc()

    def on_released(self, sender: object = None, **kwargs: Any) -> None:
        """``lock_released``: count the outcome and observe how long the lease was held."""
        outcome = kwargs.get("outcome")
        self.releases.labels(str(getattr(outcome, "value", outcome))).inc()
        held_for = kwargs.get("held_for")
        if isinstance(held_for, (int, float)):
            self.hold_seconds.observe(max(0.0, float(held_for)))

    def on_refreshed(self, sender: object = None, **kwargs: Any) -> None:
        """``lock_refreshed``: observe the round trip and how many leases it confirmed."""
        duration = kwargs.get("duration")
        if isinstance(duration, (int, float)):
            self.heartbeat_seconds.observe(max(0.0, float(duration)))
        self.heartbeat_leases.observe(len(kwargs.get("leases") or ()))

    def on_refresh_failed(self, sender: object = None, **kwargs: Any) -> None:
        """``refresh_failed``: count a failed refresh call."""
        self.heartbeat_failures.inc()

    def on_lost(self, sender: object = None, **kwargs: Any) -> None:
        """``lock_lost``: count a lost lease."""
        self.leases_lost.inc()

    def receivers(self) -> list[tuple[Any, Any]]:
        """(signal, receiver) pairs this object connects."""
        return [
            (signals.lock_acquired, self.on_acquired),
            (signals.lock_contended, self.on_contended),
            (signals.task_skipped, self.on_skipped),
            (signals.lock_released, self.on_released),
            (signals.lock_refreshed, self.on_refreshed),
            (signals.refresh_failed, self.on_refresh_failed),
            (signals.lock_lost, self.on_lost),
        ]


_mutex = threading.Lock()
_by_registry: dict[int, Metrics] = {}
_installed: Metrics | None = None


def _uid(signal: Any) -> str:
    return f"celery_exclusive.metrics:{signal.name}"


def install(registry: CollectorRegistry | None = None) -> Metrics:
    """Count lock events on ``registry`` (default: prometheus_client's global REGISTRY).

    Idempotent: installing again on the same registry returns the same :class:`Metrics`
    and counts each event once. While installed on one registry, installing on another
    raises InvalidArgumentError; call :func:`uninstall` first.
    """
    global _installed  # noqa: PLW0603 - one set of receivers per process, by design
    registry = REGISTRY if registry is None else registry
    if not callable(getattr(registry, "register", None)) or not callable(getattr(registry, "collect", None)):
        raise InvalidArgumentError(
            f"registry must be a prometheus_client CollectorRegistry, got {type(registry).__name__}"
        )
    with _mutex:
        if _installed is not None:
            if _installed.registry is registry:
                return _installed
            raise InvalidArgumentError(
                "celery-exclusive metrics are already installed on another registry; call uninstall() first"
            )
        metrics = _by_registry.get(id(registry))
        if metrics is None or metrics.registry is not registry:
            metrics = Metrics.create(registry)
            _by_registry[id(registry)] = metrics
        for signal, receiver in metrics.receivers():
            # A fixed dispatch_uid makes a repeated connect a no-op; weak=False keeps the
            # bound methods alive without the caller holding the Metrics object.
            signal.connect(receiver, weak=False, dispatch_uid=_uid(signal))
        _installed = metrics
        return metrics


def uninstall() -> None:
    """Disconnect the receivers; the metrics stay registered with their values. Idempotent."""
    global _installed  # noqa: PLW0603
    with _mutex:
        if _installed is None:
            return
        for signal, receiver in _installed.receivers():
            signal.disconnect(receiver, dispatch_uid=_uid(signal))
        _installed = None


def installed() -> Metrics | None:
    """The installed :class:`Metrics`, or None."""
    return _installed
