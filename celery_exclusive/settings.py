"""The Celery integration's settings: one frozen object, resolved by precedence.

Precedence, highest first: per-task options > ``app.conf`` > environment
(``CELERY_EXCLUSIVE_*``) > defaults.

Each field: its ``app.conf`` name, its environment variable, its per-task option.

* ``url``: ``exclusive_url``, ``CELERY_EXCLUSIVE_URL`` (not per task)
* ``prefix``: ``exclusive_prefix``, ``CELERY_EXCLUSIVE_PREFIX`` (not per task)
* ``ttl``: ``exclusive_default_ttl``, ``CELERY_EXCLUSIVE_DEFAULT_TTL``, ``lock_ttl``
* ``max_lifetime``: ``exclusive_max_lifetime``, ``CELERY_EXCLUSIVE_MAX_LIFETIME``, ``lock_max_lifetime``
* ``refresh_interval``: ``exclusive_refresh_interval``, ``CELERY_EXCLUSIVE_REFRESH_INTERVAL``,
  ``lock_refresh_interval``
* ``sweep_interval``: ``exclusive_sweep_interval``, ``CELERY_EXCLUSIVE_SWEEP_INTERVAL`` (not per
  task): seconds between the heartbeat's sweeps of dead rows (60 s; 0 or False, ``0``/``off``
  in the environment, turns it off; see ``LockService.sweep``)
* ``on_locked``: ``exclusive_on_locked``, ``CELERY_EXCLUSIVE_ON_LOCKED``, ``lock_on_locked``
* ``on_lost``: ``exclusive_on_lost``, ``CELERY_EXCLUSIVE_ON_LOST``, ``lock_on_lost``
* ``lock_max_retries``, ``lock_retry_backoff``, ``lock_retry_backoff_max``: ``exclusive_<name>``,
  ``CELERY_EXCLUSIVE_<NAME>``, ``<name>``
* ``lock_wait``, ``lock_wait_fallback``: ``exclusive_<name>``, ``CELERY_EXCLUSIVE_<NAME>``,
  ``<name>``: under ``on_locked="wait"``, the seconds a run waits for the key (blocking its
  worker slot) and the policy it falls back to after that (``skip``, ``retry`` or ``raise``)
* ``done_retention``: ``exclusive_done_retention``, ``CELERY_EXCLUSIVE_DONE_RETENTION``,
  ``lock_done_retention``: how long a finished task id's completion record is kept (None:
  Celery's ``result_expires``, or 24 h without one); ``False`` (``false``/``off`` in the
  environment) keeps none
* ``dedupe``, ``on_duplicate``, ``dedupe_ttl``: ``exclusive_<name>``, ``CELERY_EXCLUSIVE_<NAME>``,
  ``lock_<name>``: deduplication at enqueue (see :mod:`celery_exclusive.dedupe`); ``dedupe``
  is False (off, the default; ``false``/``off`` in the environment), ``"until_start"`` (or
  True) or ``"until_done"``; ``on_duplicate`` is ``"return"`` (default), ``"raise"`` or a
  callable ``(task, key, existing AsyncResult) -> result``; ``dedupe_ttl`` (None: 1 h, plus
  the eta/countdown, capped by ``expires``) bounds how long a marker may outlive a lost message
* ``cooldown``: ``exclusive_cooldown``, ``CELERY_EXCLUSIVE_COOLDOWN``, ``lock_cooldown``: the key
  stays held at least that long after a run started, even when the run ended sooner (None:
  no cooldown; at most ``max_lifetime``)
* ``rerun_args``: ``exclusive_rerun_args``, ``CELERY_EXCLUSIVE_RERUN_ARGS``, ``lock_rerun_args``:
  which coalesced request's arguments an ``on_locked="rerun"`` follow-up runs with,
  ``"first"`` (default) or ``"latest"``
* ``limit``: ``exclusive_limit``, ``CELERY_EXCLUSIVE_LIMIT``, ``lock_limit``: at most that many
  runs hold the key at once (1, the default: an exclusive lock; up to 64: a leased semaphore,
  see :mod:`celery_exclusive.semaphore`)

Durations are seconds (int/float) or ``timedelta``; in the environment, seconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from celery_exclusive._leasing import DEFAULT_SWEEP_INTERVAL
from celery_exclusive._options import _sweep_interval as sweep_interval
from celery_exclusive.errors import ConfigurationError, InvalidArgumentError
from celery_exclusive.providers.base import MAX_RETAIN
from celery_exclusive.semaphore import check_limit
from celery_exclusive.service import DEFAULT_MAX_LIFETIME, DEFAULT_PREFIX, DEFAULT_TTL
from celery_exclusive.urls import ENV_VAR as URL_ENV_VAR
from celery_exclusive.urls import mask_url
from celery_exclusive.validation import check_durations, check_prefix, lease_durations, refused_call, seconds
from celery_exclusive.waiting import MAX_WAIT

#: What a task does when its key is held; a callable ``(task, key, holder) -> result`` also works.
ON_LOCKED_POLICIES = ("skip", "retry", "raise", "rerun", "wait")
#: What an ``on_locked="wait"`` task does when its ``lock_wait`` ran out.
WAIT_FALLBACKS = ("skip", "retry", "raise")
#: What a task does when its lease is lost while it runs.
ON_LOST_POLICIES = ("log", "raise", "terminate")
#: How long a deduplicated send's queued marker lives (``dedupe``; False turns it off).
DEDUPE_MODES = ("until_start", "until_done")
#: What a deduplicated send answers when the key is queued already; a callable also works.
ON_DUPLICATE_POLICIES = ("return", "raise")
#: Whose arguments an ``on_locked="rerun"`` follow-up runs with.
RERUN_ARGS = ("first", "latest")

DEFAULT_ON_LOCKED = "skip"
DEFAULT_ON_LOST = "log"
DEFAULT_LOCK_MAX_RETRIES = 10
DEFAULT_LOCK_RETRY_BACKOFF = 1.0
DEFAULT_LOCK_RETRY_BACKOFF_MAX = 60.0
DEFAULT_LOCK_WAIT = 30.0
DEFAULT_LOCK_WAIT_FALLBACK = "skip"

ENV_PREFIX = "CELERY_EXCLUSIVE_"
CONF_PREFIX = "exclusive_"


@dataclasses.dataclass(frozen=True)
class Option:
    """One lock setting: its :class:`ExclusiveSettings` field, its ``app.conf`` name
    (``exclusive_<conf>``) and environment variable (``CELERY_EXCLUSIVE_<CONF>``), and,
    if a task may override it, the task attribute (``lock_<field>``, or the field when it
    already starts with ``lock_``) and the ``exclusive_task`` keyword (the field). ``kind``
    picks its check (see ``check_task_options``) and how the environment's text is parsed:
    a ``"choice"`` is one of ``choices`` or, where ``callable_form`` describes one, a callable."""

    field: str
    conf: str
    kind: str  # "duration", "choice", "retries", "retention", "dedupe", "limit", "sweep" or "text"
    per_task: bool = True
    choices: tuple[str, ...] = ()
    callable_form: str | None = None

    @property
    def conf_name(self) -> str:
        return CONF_PREFIX + self.conf

    @property
    def env(self) -> str:
        return URL_ENV_VAR if self.field == "url" else ENV_PREFIX + self.conf.upper()

    @property
    def attribute(self) -> str | None:
        if not self.per_task:
            return None
        return self.field if self.field.startswith("lock_") else "lock_" + self.field

    @property
    def keyword(self) -> str | None:
        return self.field if self.per_task else None


#: Every setting, in one table: TASK_OPTIONS, the duration list, the conf and env names,
#: ``exclusive_task``'s keywords and ``check_task_options`` are derived from it.
OPTIONS = (
    Option("url", "url", "text", per_task=False),
    Option("prefix", "prefix", "text", per_task=False),
    Option("ttl", "default_ttl", "duration"),
    Option("max_lifetime", "max_lifetime", "duration"),
    Option("refresh_interval", "refresh_interval", "duration"),
    Option("sweep_interval", "sweep_interval", "sweep", per_task=False),
    Option(
        "on_locked",
        "on_locked",
        "choice",
        choices=ON_LOCKED_POLICIES,
        callable_form="(task, key, holder) -> result",
    ),
    Option("on_lost", "on_lost", "choice", choices=ON_LOST_POLICIES),
    Option("lock_max_retries", "lock_max_retries", "retries"),
    Option("lock_retry_backoff", "lock_retry_backoff", "duration"),
    Option("lock_retry_backoff_max", "lock_retry_backoff_max", "duration"),
    Option("done_retention", "done_retention", "retention"),
    Option("lock_wait", "lock_wait", "duration"),
    Option("lock_wait_fallback", "lock_wait_fallback", "choice", choices=WAIT_FALLBACKS),
    Option("dedupe", "dedupe", "dedupe"),
    Option(
        "on_duplicate",
        "on_duplicate",
        "choice",
        choices=ON_DUPLICATE_POLICIES,
        callable_form="(task, key, existing AsyncResult) -> result",
    ),
    Option("dedupe_ttl", "dedupe_ttl", "duration"),
    Option("cooldown", "cooldown", "duration"),
    Option("rerun_args", "rerun_args", "choice", choices=RERUN_ARGS),
    Option("limit", "limit", "limit"),
)
_BY_FIELD = {option.field: option for option in OPTIONS}

#: Fields a task may override, and the task attribute that overrides each.
TASK_OPTIONS = {o.field: o.attribute for o in OPTIONS if o.attribute is not None}
#: ``exclusive_task``'s short keywords, and the task attribute each sets.
TASK_KEYWORDS = {o.keyword: o.attribute for o in OPTIONS if o.keyword is not None and o.attribute is not None}
_DURATIONS = tuple(option.field for option in OPTIONS if option.kind == "duration")


def _conf_name(field: str) -> str:
    return _BY_FIELD[field].conf_name


def _env_name(field: str) -> str:
    return _BY_FIELD[field].env


@dataclasses.dataclass(frozen=True)
class ExclusiveSettings:
    """Resolved settings for one app, or one task (the app's with the task's overrides).

    ``ttl`` None means the default ttl, capped by ``max_lifetime`` (see :attr:`lease_ttl`).
    ``url`` None means not configured: :func:`~celery_exclusive.get_lock_service` then
    raises a ConfigurationError naming every place to set it. The repr masks passwords.
    """

    url: str | None = None
    prefix: str = DEFAULT_PREFIX
    ttl: float | None = None
    max_lifetime: float = DEFAULT_MAX_LIFETIME
    refresh_interval: float | None = None
    sweep_interval: float | None = DEFAULT_SWEEP_INTERVAL  # None: off
    on_locked: str | Callable[..., Any] = DEFAULT_ON_LOCKED
    on_lost: str = DEFAULT_ON_LOST
    lock_max_retries: int = DEFAULT_LOCK_MAX_RETRIES
    lock_retry_backoff: float = DEFAULT_LOCK_RETRY_BACKOFF
    lock_retry_backoff_max: float = DEFAULT_LOCK_RETRY_BACKOFF_MAX
    done_retention: float | bool | None = None
    lock_wait: float = DEFAULT_LOCK_WAIT
    lock_wait_fallback: str = DEFAULT_LOCK_WAIT_FALLBACK
    dedupe: str | bool = False
    on_duplicate: str | Callable[..., Any] = "return"
    dedupe_ttl: float | None = None
    cooldown: float | None = None
    rerun_args: str = "first"
    limit: int = 1

    def __post_init__(self) -> None:
        if self.url is not None and not isinstance(self.url, str):
            raise InvalidArgumentError(f"url must be a str, got {type(self.url).__name__}")
        check_prefix(self.prefix)
        object.__setattr__(self, "sweep_interval", sweep_interval(self.sweep_interval))
        for name, value in check_durations({name: getattr(self, name) for name in _DURATIONS}).items():
            object.__setattr__(self, name, value)
        check_on_locked(self.on_locked)
        check_on_lost(self.on_lost)
        check_wait_fallback(self.lock_wait_fallback)
        check_wait_seconds(self.lock_wait)
        if self.done_retention is not None:
            object.__setattr__(self, "done_retention", check_done_retention(self.done_retention))
        check_max_retries("lock_max_retries", self.lock_max_retries)
        object.__setattr__(self, "dedupe", check_dedupe(self.dedupe))
        check_on_duplicate(self.on_duplicate)
        check_rerun_args(self.rerun_args)
        check_limit(self.limit)
        # Rejects ttl > max_lifetime and refresh_interval >= ttl now, not at the first lock.
        lease_durations(
            self.lease_ttl, self.refresh_interval, self.max_lifetime, ttl_explicit=self.ttl is not None
        )

    def __repr__(self) -> str:
        fields = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "url" and value is not None:
                value = mask_url(value)
            fields.append(f"{field.name}={value!r}")
        return f"ExclusiveSettings({', '.join(fields)})"

    @property
    def lease_ttl(self) -> float:
        """The ttl each lease gets: ``ttl``, or the default capped by ``max_lifetime``."""
        return self.ttl if self.ttl is not None else min(DEFAULT_TTL, self.max_lifetime)

    def with_overrides(self, **options: Any) -> ExclusiveSettings:
        """A copy with the given fields replaced; None values are ignored (not overridden)."""
        unknown = set(options) - set(TASK_OPTIONS)
        if unknown:
            raise InvalidArgumentError(f"unknown per-task lock option(s): {', '.join(sorted(unknown))}")
        changes = {name: value for name, value in options.items() if value is not None}
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def from_conf(
        cls, conf: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> ExclusiveSettings:
        """Settings from a Celery ``app.conf`` (or any mapping), then the environment, then defaults."""
        conf = conf if conf is not None else {}
        environ = environ if environ is not None else os.environ
        _check_names(conf, environ)
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            name = field.name
            configured = conf.get(_conf_name(name))
            if configured is not None and configured != "":
                values[name] = configured
                source = f"app.conf.{_conf_name(name)}"
            else:
                env_name = _env_name(name)
                raw = environ.get(env_name)
                if raw is None or raw == "":
                    continue
                values[name] = _parse_env(name, env_name, raw)
                source = env_name
            try:
                cls(**{name: values[name]})  # blame the setting that is wrong, by name
            except InvalidArgumentError as exc:
                raise ConfigurationError(f"{source}: {exc}") from None
        try:
            return cls(**values)
        except InvalidArgumentError as exc:
            raise ConfigurationError(f"celery-exclusive settings: {exc}") from None


#: ``app.conf`` names read elsewhere than :data:`OPTIONS`: the worker's start-up check, and
#: the Django lock table (``CELERY_EXCLUSIVE_TABLE``, which ``config_from_object(...,
#: namespace="CELERY")`` brings in as ``exclusive_table``).
_OTHER_CONF = ("startup_check", "table")


def _check_names(conf: Mapping[str, Any], environ: Mapping[str, str]) -> None:
    """ConfigurationError for an ``exclusive_*`` setting or a ``CELERY_EXCLUSIVE_*``
    variable that is none of ours (a misspelt one would be ignored), naming the closest
    (found among the settings' names and their per-task names: ``ttl`` is ``default_ttl``)."""
    meant = {name: name for name in _OTHER_CONF}
    for option in OPTIONS:
        meant.update({option.field: option.conf, option.conf: option.conf})
    for prefix, names in ((CONF_PREFIX, conf), (ENV_PREFIX, environ)):
        for name in names:
            if not isinstance(name, str) or not name.startswith(prefix):
                continue
            given = name[len(prefix) :]
            own = given.lower() if prefix == ENV_PREFIX else given
            if own in meant.values() and (prefix == CONF_PREFIX or given == own.upper()):
                continue
            close = difflib.get_close_matches(own, sorted(meant), n=1, cutoff=0.6)
            where = "setting app.conf." if prefix == CONF_PREFIX else "environment variable "
            spell = (lambda conf_name: CONF_PREFIX + conf_name) if prefix == CONF_PREFIX else _env_of
            hint = f"did you mean {spell(meant[close[0]])}?" if close else "see docs/celery.md, Configuration"
            raise ConfigurationError(f"unknown {where}{name}; {hint}")


def _env_of(conf_name: str) -> str:
    return URL_ENV_VAR if conf_name == "url" else ENV_PREFIX + conf_name.upper()


def check_choice(field: str, value: object) -> None:
    """Reject a value of the choice option ``field`` (its :data:`OPTIONS` row) that is not
    one of its ``choices``, nor a callable where the row allows one."""
    option = _BY_FIELD[field]
    if option.callable_form is not None and callable(value):
        refused = refused_call(value, None, None, None)
        if refused is not None:
            form = option.callable_form.partition(" ->")[0]
            raise InvalidArgumentError(f"{field} callable must take {form} by position; {refused}")
        return
    if value not in option.choices:
        also = "" if option.callable_form is None else f" or a callable {option.callable_form}"
        raise InvalidArgumentError(
            f"{field} must be one of {', '.join(map(repr, option.choices))}{also}, got {value!r}"
        )


def check_on_locked(value: object) -> None:
    """Reject anything but a known policy name or a callable."""
    check_choice("on_locked", value)


def check_wait_fallback(value: object) -> None:
    """Reject anything but a policy ``on_locked="wait"`` can fall back to."""
    check_choice("lock_wait_fallback", value)


def check_wait_seconds(value: float) -> None:
    """A ``lock_wait`` within :data:`celery_exclusive.waiting.MAX_WAIT` (24 h)."""
    if value > MAX_WAIT:
        raise InvalidArgumentError(f"lock_wait is {value:g} s; at most {MAX_WAIT:g} s (24 h)")


def check_done_retention(value: object) -> float | bool:
    """A completion-record retention: positive seconds (or a timedelta), or False for none."""
    if value is False:
        return False
    if value is True:
        raise InvalidArgumentError(
            "done_retention must be a positive duration, or False to keep no completion records, got True"
        )
    try:
        result = seconds("done_retention", value)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{exc}; or False to keep no completion records") from None
    if result > MAX_RETAIN:  # else every release of the task would refuse its record
        raise InvalidArgumentError(f"done_retention is {result:g} s; at most {MAX_RETAIN:g} s (10 years)")
    return result


def check_on_lost(value: object) -> None:
    """Reject anything but a known on-lost policy name."""
    check_choice("on_lost", value)


def check_dedupe(value: object) -> str | bool:
    """A ``dedupe`` setting: False (off), True (``"until_start"``) or one of DEDUPE_MODES."""
    if value is True:
        return DEDUPE_MODES[0]
    if value is False or value in DEDUPE_MODES:
        return value if isinstance(value, str) else False
    raise InvalidArgumentError(
        f"dedupe must be False, True or one of {', '.join(map(repr, DEDUPE_MODES))}, got {value!r}"
    )


def check_on_duplicate(value: object) -> None:
    """Reject anything but a known on-duplicate answer or a callable."""
    check_choice("on_duplicate", value)


def check_rerun_args(value: object) -> None:
    """Reject anything but a known ``rerun_args`` choice."""
    check_choice("rerun_args", value)


def check_task_options(**options: Any) -> None:
    """Validate per-task lock options on their own (when a task is declared); None means unset.

    Each option is checked by its row's kind (:data:`OPTIONS`), durations all together by
    :func:`~celery_exclusive.validation.check_durations` (named by their task attributes)."""
    for name, value in options.items():
        if value is None:
            continue
        if name not in TASK_OPTIONS:
            raise InvalidArgumentError(f"unknown per-task lock option {name!r}")
        kind = _BY_FIELD[name].kind
        if kind == "choice":
            check_choice(name, value)
        elif kind != "duration":
            _CHECKS[kind](TASK_OPTIONS[name], value)
    durations = check_durations({name: options.get(name) for name in _DURATIONS}, labels=TASK_OPTIONS)
    if "lock_wait" in durations:
        check_wait_seconds(durations["lock_wait"])
    if options.get("on_locked") is not None:
        check_policy_options(options["on_locked"], options)


#: Per-task options that one ``on_locked`` policy alone reads, and that policy: given to a
#: task whose policy is another, they would be ignored without a word.
POLICY_OPTIONS = {"lock_wait": "wait", "lock_wait_fallback": "wait", "rerun_args": "rerun"}


def check_policy_options(on_locked: object, options: Mapping[str, Any], whose: str = "") -> None:
    """InvalidArgumentError if ``options`` (per-task, None: unset) sets one of
    :data:`POLICY_OPTIONS` that ``on_locked`` (the task's own, or the app's where the task
    sets none) does not read; a callable policy may read any. ``whose``: what to call the
    policy in the message (its source)."""
    if callable(on_locked):
        return
    for name, policy in POLICY_OPTIONS.items():
        if options.get(name) is not None and on_locked != policy:
            attribute = TASK_OPTIONS[name]
            raise InvalidArgumentError(
                f"{attribute} applies only under on_locked={policy!r}, and this task's on_locked is "
                f"{on_locked!r}{whose}: set on_locked={policy!r} with it, or leave {attribute} out"
            )


def check_max_retries(name: str, value: object) -> None:
    """A lock retry budget: an int >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}")


#: Each option kind's check of a per-task value, given the task attribute's name (durations:
#: ``check_durations``, which also checks them against each other; choices: ``check_choice``).
_CHECKS: dict[str, Callable[[str, Any], object]] = {
    "retries": check_max_retries,
    "retention": lambda _name, value: check_done_retention(value),
    "dedupe": lambda _name, value: check_dedupe(value),
    "limit": lambda _name, value: check_limit(value),
}


def keyword_attributes(given: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """``exclusive_task``'s short keywords found in ``given`` (``key``, and those of
    :data:`TASK_KEYWORDS`: ``ttl``...) as the task attributes they set (``lock_key``,
    ``lock_ttl``...), None left out; InvalidArgumentError if ``options`` names one too."""
    found: dict[str, Any] = {}
    for keyword, attribute in {"key": "lock_key", **TASK_KEYWORDS}.items():
        value = given.get(keyword)
        if value is None:
            continue
        if options.get(attribute) is not None:
            raise InvalidArgumentError(f"{attribute} given twice (once by its short name)")
        found[attribute] = value
    return found


def check_lock_attributes(names: Iterable[str], known: Iterable[str]) -> None:
    """Reject ``lock_*`` names that are not lock options: a typo must not be silently ignored."""
    unknown = sorted(n for n in names if n.startswith("lock_") and n not in set(known))
    if unknown:
        raise InvalidArgumentError(
            f"unknown lock option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )


def _parse_env(name: str, env_name: str, raw: str) -> Any:
    raw = raw.strip()
    if name in ("done_retention", "dedupe", "sweep_interval") and raw.lower() in ("false", "off", "no"):
        return False
    if name == "dedupe" and raw not in DEDUPE_MODES:  # its check's message says True, which text is not
        modes = " or ".join(map(repr, DEDUPE_MODES))
        raise ConfigurationError(
            f"{env_name}={raw!r}: must be {modes}, or 'false', 'off' or 'no' to turn deduplication off"
        )
    if name in ("lock_max_retries", "limit"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigurationError(f"{env_name}={raw!r} is not a whole number") from None
    if name in ("done_retention", "sweep_interval", *_DURATIONS):
        try:
            return float(raw)  # seconds; the setting's check refuses -1, inf, nan showing them
        except ValueError:
            raise ConfigurationError(f"{env_name}={raw!r} is not a number") from None
    return raw
