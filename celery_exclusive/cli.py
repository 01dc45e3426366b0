"""Operator commands: list, show, release and sweep leases, forget completion records, doctor.

Two front ends share one set of sub-commands and differ only in where the store comes from:

* ``celery-exclusive [--url URL] [--prefix P] COMMAND``: ``--url``, else ``CELERY_EXCLUSIVE_URL``.
* ``celery -A proj exclusive [--url URL] [--prefix P] COMMAND``: ``--url``, else the app's
  ``exclusive_url`` setting, else ``CELERY_EXCLUSIVE_URL``.

The prefix follows the workers' precedence: ``--prefix``, the app's ``exclusive_prefix``
(Celery front end only), ``CELERY_EXCLUSIVE_PREFIX``, then ``task-lock:``.

Exit codes: 0 success; 1 nothing released (mismatch or declined), nothing to forget, or a
doctor check failed; 2 configuration or input error; 3 lock store error. Errors are one
line on stderr, never a traceback, and never show a credential. See ``docs/cli.md``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import click

from celery_exclusive.diagnostics import doctor
from celery_exclusive.errors import (
    ConfigurationError,
    ExclusiveError,
    InvalidArgumentError,
)
from celery_exclusive.providers import KNOWN_SCHEMES
from celery_exclusive.providers.base import MAX_TASK_ID_LENGTH, SWEEP_LIMIT, CompletionInfo, LockInfo
from celery_exclusive.semaphore import slot_of
from celery_exclusive.service import DEFAULT_PREFIX, LockService
from celery_exclusive.urls import ENV_VAR, mask_url, resolve_url, url_secrets
from celery_exclusive.validation import QUEUED_SUFFIX, RERUN_SUFFIX, check_task_id

EXIT_OK = 0
EXIT_NOT_RELEASED = 1
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_BACKEND = 3

#: Environment fallback for the key prefix, as the workers read it.
PREFIX_ENV_VAR = "CELERY_EXCLUSIVE_PREFIX"

_META_KEY = "celery_exclusive.target"
F = TypeVar("F", bound=Callable[..., Any])


# -- where the store comes from -------------------------------------------------------------


@dataclass
class Target:
    """The store one invocation talks to; the service is built on first use and closed at exit."""

    explicit_url: str | None
    conf: Mapping[str, Any] | None
    prefix: str
    celery: bool
    url: str | None = None
    _service: LockService | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        shown = self.url or self.explicit_url
        url = None if shown is None else mask_url(shown)
        return f"Target(url={url!r}, prefix={self.prefix!r}, celery={self.celery!r})"

    def resolve(self) -> str:
        """The lock store URL by precedence, or ConfigurationError naming where to set it."""
        if self.url is None:
            try:
                self.url = resolve_url(self.explicit_url, self.conf)
            except ConfigurationError:
                places = "pass --url, set app.conf.exclusive_url," if self.celery else "pass --url"
                raise ConfigurationError(
                    f"no lock store configured: {places} or set the {ENV_VAR} environment "
                    f"variable (schemes: {', '.join(KNOWN_SCHEMES)})"
                ) from None
        return self.url

    def service(self) -> LockService:
        """A LockService on the resolved URL with this invocation's prefix."""
        if self._service is None:
            self._service = LockService(self.resolve(), prefix=self.prefix)
        return self._service

    def close(self) -> None:
        """Close the service if one was built (the CLI never holds leases)."""
        if self._service is not None:
            service, self._service = self._service, None
            with contextlib.suppress(Exception):  # the answer is out; a failed disconnect changes nothing
                service.close(release=False)

    def scrub(self, text: str) -> str:
        """``text`` with every URL masked and this URL's secrets replaced by ``***``."""
        return mask_url(text, url_secrets(self.url or self.explicit_url or ""))


def _target(ctx: click.Context) -> Target:
    target = ctx.meta.get(_META_KEY)
    if not isinstance(target, Target):
        raise ConfigurationError("celery-exclusive sub-commands must run under a celery-exclusive group")
    return target


def _option(*decls: str, **attrs: Any) -> Callable[[F], F]:
    """A click option never read from the environment by click itself.

    ``celery`` runs with ``auto_envvar_prefix="CELERY"``, which would silently bind
    CELERY_EXCLUSIVE_URL to ``exclusive --url`` and so rank the environment above
    app.conf.exclusive_url; the documented precedence is applied by resolve_url instead.
    """
    return click.option(*decls, allow_from_autoenv=False, **attrs)


def _url_option(fallback: str) -> Callable[[F], F]:
    return _option("--url", default=None, metavar="URL", help=f"Lock store URL (else {fallback}).")


def _prefix_option(fallback: str) -> Callable[[F], F]:
    return _option(
        "--prefix",
        default=None,
        metavar="PREFIX",
        help=f"Key prefix of the locks (else {fallback}, else {DEFAULT_PREFIX!r}).",
    )


def _prefix(explicit: str | None, conf: Mapping[str, Any] | None) -> str:
    """The key prefix by the workers' precedence: option > app.conf > environment > default."""
    for candidate in (explicit, (conf or {}).get("exclusive_prefix"), os.environ.get(PREFIX_ENV_VAR)):
        if candidate is not None and candidate != "":
            return str(candidate)
    return DEFAULT_PREFIX


def _json_option() -> Callable[[F], F]:
    return _option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")


# -- error handling -------------------------------------------------------------------------


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, (ConfigurationError, InvalidArgumentError)):
        return EXIT_USAGE
    return EXIT_BACKEND


def _fail(ctx: click.Context, exc: BaseException) -> NoReturn:
    target = ctx.meta.get(_META_KEY)
    message = str(exc) or type(exc).__name__
    if not isinstance(exc, ExclusiveError):
        message = f"unexpected {type(exc).__name__}: {message}"
    message = target.scrub(message) if isinstance(target, Target) else mask_url(message)
    click.echo(f"error: {printable(' '.join(message.split()))}", err=True)
    ctx.exit(_exit_code(exc))


def _handled(f: Callable[..., int | None]) -> Callable[..., None]:
    """Run a sub-command: exit with its code; errors become one masked line and exit 2/3."""

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> None:
        ctx = click.get_current_context()
        try:
            code = f(*args, **kwargs)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except Exception as exc:  # every failure is one line, never a traceback
            _fail(ctx, exc)
        finally:
            target = ctx.meta.get(_META_KEY)
            if isinstance(target, Target):
                target.close()
        ctx.exit(code or EXIT_OK)

    return run


# -- formatting -----------------------------------------------------------------------------


def human_duration(value: float) -> str:
    """Seconds for people: ``0.4s``, ``42s``, ``3m07s``, ``2h05m``, ``1d03h``."""
    if value < 0:
        return "-" + human_duration(-value)
    if value < 10:
        return f"{value:.1f}s"
    whole = int(value)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def printable(text: object) -> str:
    """``text`` safe for a terminal: every non-printable character as a visible escape.

    Keys and holder fields come from task arguments; raw, an ESC sequence would recolour or
    clear the operator's terminal and a newline would forge a table row. Control, format
    (bidi overrides, zero-width) and separator characters are shown as Python escapes
    (``\\x1b``, ``\\n``, ``\\u202e``); everything printable, emoji included, is kept.
    """
    value = str(text)
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)


def describe_holder(info: LockInfo) -> str:
    """Who holds a lease, for messages: task name and id, host and pid where known; a holder
    that is no task (a ``LockService`` caller) is "a process on host:pid"."""
    holder = info.holder
    parts = []
    if holder.get("task_name"):
        parts.append(f"task {holder['task_name']}")
    if holder.get("task_id"):
        parts.append(f"[{holder['task_id']}]")
    where = ":".join(str(holder[k]) for k in ("host", "pid") if holder.get(k) not in (None, ""))
    if where:
        parts.append(f"on {where}" if parts else f"a process on {where}")
    return printable(" ".join(parts) or f"token {info.token}")


#: Key suffixes of the Celery layer's marker leases, and the state ``list`` shows for each.
MARKER_STATES = {QUEUED_SUFFIX: "queued", RERUN_SUFFIX: "rerun"}


def lease_state(key: str) -> str:
    """What a lease on ``key`` is: a queued (dedupe) or rerun marker, or a run holding it."""
    return next((state for suffix, state in MARKER_STATES.items() if key.endswith(suffix)), "held")


#: Holder field a task with ``cooldown`` stores at acquire (the seconds it stays held).
COOLDOWN_FIELD = "cooldown"


def full_state(service: LockService, info: LockInfo) -> str:
    """:func:`lease_state`, and ``cooling`` for a run's lease kept past its end by a cooldown.

    A store cannot change a lease's holder when the release shortens it to the cooldown's
    end, so the holder says only that a cooldown applies (``cooldown``, written at
    acquire); the run has ended when its completion record exists (the release writes it
    in the same step). One store call per such lease. Without records (``done_retention=False``,
    or a ``service.lock(..., hold_at_least=...)`` lease with no task id) a cooling
    lease shows as ``held``.
    """
    state = lease_state(info.key)
    task_id = info.holder.get("task_id")
    if state != "held" or not info.holder.get(COOLDOWN_FIELD) or not isinstance(task_id, str) or not task_id:
        return state
    try:
        record = service.completion(info.key, task_id)
    except InvalidArgumentError:  # an id no record can hold (too long, NUL): none was written
        return state
    return state if record is None else "cooling"


def lock_json(info: LockInfo, state: str | None = None) -> dict[str, Any]:
    """The stable JSON form of a lease (see docs/cli.md)."""
    return {
        "key": info.key,
        "token": info.token,
        "fence": info.fence,
        "age": round(info.age, 3),
        "expires_in": round(info.expires_in, 3),
        "hard_expires_in": round(info.hard_expires_in, 3),
        "holder": info.holder,
        "state": lease_state(info.key) if state is None else state,
    }


def _dump(value: object) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, default=str))


def _cell(value: object) -> str:
    return "-" if value is None or value == "" else printable(value)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [headers, *rows]
    ]
    return "\n".join(lines)


# -- sub-commands ---------------------------------------------------------------------------


@click.command(name="list")
@click.argument("filter_prefix", metavar="[PREFIX]", required=False, default="")
@_option("--done", is_flag=True, help="List completion records (finished task ids) instead of leases.")
@_json_option()
@_handled
def list_command(filter_prefix: str, done: bool, as_json: bool) -> int:
    """List live leases, optionally only keys starting with PREFIX.

    PREFIX is matched against the key without the lock prefix (--prefix). With --done,
    list the completion records instead: which task ids finished a run on which key, so
    that a redelivered copy of their message does not run again.
    """
    target = _target(click.get_current_context())
    if done:
        return _list_done(target, filter_prefix, as_json)
    service = target.service()
    locks = service.locks(filter_prefix)
    states = [full_state(service, info) for info in locks]
    if as_json:
        found = [lock_json(info, state) for info, state in zip(locks, states, strict=True)]
        _dump({"prefix": target.prefix, "filter": filter_prefix, "locks": found})
        return EXIT_OK
    if not locks:
        click.echo(f"no live leases under {target.prefix + filter_prefix!r}")
        return EXIT_OK
    headers = ["KEY", "STATE", "HOST", "PID", "TASK ID", "TASK NAME", "AGE", "EXPIRES IN", "FENCE"]
    rows = [
        [
            printable(info.key) + _slot_note(info.key),
            state,
            _cell(info.holder.get("host")),
            _cell(info.holder.get("pid")),
            _cell(info.holder.get("task_id")),
            _cell(info.holder.get("task_name")),
            human_duration(info.age),
            human_duration(info.expires_in),
            str(info.fence),
        ]
        for info, state in zip(locks, states, strict=True)
    ]
    click.echo(_table(rows, headers))
    return EXIT_OK


def _slot_note(key: str) -> str:
    """`` (slot i of K)`` for a semaphore's slot key ``{K}#i``, else nothing."""
    of, slot = slot_of(key)
    return f" (slot {slot} of {printable(of)})" if slot > 1 else ""


@click.command(name="show")
@click.argument("key")
@_json_option()
@_handled
def show_command(key: str, as_json: bool) -> int:
    """Show the live lease on KEY.

    A free key is not an error: it prints "is free" (JSON: null) and exits 0.
    """
    target = _target(click.get_current_context())
    service = target.service()
    info = service.peek(key)
    if as_json:
        _dump(None if info is None else lock_json(info, full_state(service, info)))
        return EXIT_OK
    if info is None:
        click.echo(f"{key!r} is free")
        return EXIT_OK
    fields = [
        ("key", printable(info.key)),
        ("holder", describe_holder(info)),
        ("task name", _cell(info.holder.get("task_name"))),
        ("task id", _cell(info.holder.get("task_id"))),
        ("host", _cell(info.holder.get("host"))),
        ("pid", _cell(info.holder.get("pid"))),
        ("fence", str(info.fence)),
        ("age", human_duration(info.age)),
        ("expires in", human_duration(info.expires_in)),
        ("hard deadline in", human_duration(info.hard_expires_in)),
        ("token", printable(info.token)),
    ]
    extra = sorted(k for k in info.holder if k not in ("task_name", "task_id", "host", "pid"))
    fields += [(f"holder.{printable(k)}", _cell(info.holder[k])) for k in extra]
    width = max(len(name) for name, _ in fields)
    for name, value in fields:
        click.echo(f"{name.ljust(width)}  {value}")
    return EXIT_OK


@click.command(name="release")
@click.argument("key")
@_option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_option(
    "--token",
    default=None,
    metavar="TOKEN",
    help="Release only if this token holds the key (as shown by `show`).",
)
@_handled
def release_command(key: str, yes: bool, token: str | None) -> int:
    """Release the current lease on KEY.

    Only the lease seen at the start is released: a newer holder is never touched.
    The holder is not told: its heartbeat finds the lease gone and reports it LOST.
    """
    target = _target(click.get_current_context())
    if token is not None and not token:
        raise InvalidArgumentError("--token must not be empty")
    service = target.service()
    info = service.peek(key)
    if info is None:
        click.echo(f"{key!r}: key is free; nothing released")
        return EXIT_OK
    who = f"{describe_holder(info)} (fence {info.fence})"
    if token is not None and info.token != token:
        click.echo(f"{key!r}: held by {who} with another token; nothing released")
        return EXIT_NOT_RELEASED
    if not yes and not _confirm(f"Release the lease of {who} on {key!r}?"):
        click.echo("nothing released")
        return EXIT_NOT_RELEASED
    if service.force_release(key, info.token):
        click.echo(f"{key!r}: released lease of {who}")
        return EXIT_OK
    click.echo(f"{key!r}: lease changed hands; nothing released")
    return EXIT_NOT_RELEASED


def _confirm(question: str) -> bool:
    """Ask on the terminal; no answer (stdin closed, Ctrl-C) is an input error naming --yes."""
    try:
        return click.confirm(question, default=False)
    except click.Abort:
        click.echo()  # end the unanswered prompt's line
        raise InvalidArgumentError(
            "no answer to the confirmation prompt (no terminal?); nothing released; "
            "pass --yes to release without asking"
        ) from None


def completion_json(record: CompletionInfo) -> dict[str, Any]:
    """The stable JSON form of a completion record (see docs/cli.md)."""
    return {
        "key": record.key,
        "task_id": record.task_id,
        "outcome": record.outcome,
        "attempt": record.attempt,
        "age": round(record.age, 3),
        "expires_in": round(record.expires_in, 3),
    }


def _list_done(target: Target, filter_prefix: str, as_json: bool) -> int:
    records = target.service().completions(filter_prefix)
    if as_json:
        _dump(
            {"prefix": target.prefix, "filter": filter_prefix, "done": [completion_json(r) for r in records]}
        )
        return EXIT_OK
    if not records:
        click.echo(f"no completion records under {target.prefix + filter_prefix!r}")
        return EXIT_OK
    headers = ["KEY", "TASK ID", "OUTCOME", "ATTEMPT", "AGE", "EXPIRES IN"]
    rows = [
        [
            printable(r.key),
            printable(r.task_id),
            r.outcome,
            str(r.attempt),
            human_duration(r.age),
            human_duration(r.expires_in),
        ]
        for r in records
    ]
    click.echo(_table(rows, headers))
    return EXIT_OK


@click.command(name="forget")
@click.argument("task_id")
@_option("--key", "key", default=None, metavar="KEY", help="Only the record on this lock key.")
@_handled
def forget_command(task_id: str, key: str | None) -> int:
    """Forget that TASK_ID finished: a later copy of its message runs the body again.

    Without --key, every record of TASK_ID (on any key under the prefix) is removed.
    Exits 1 when there was no such record.
    """
    target = _target(click.get_current_context())
    check_task_id(task_id, MAX_TASK_ID_LENGTH)  # an input error before the store is asked
    service = target.service()
    keys = [key] if key is not None else [r.key for r in service.completions() if r.task_id == task_id]
    forgotten = [k for k in keys if service.forget(k, task_id)]
    if not forgotten:
        click.echo(f"no completion record of task {printable(repr(task_id))}; nothing forgotten")
        return EXIT_NOT_RELEASED
    for k in forgotten:
        click.echo(f"{printable(repr(k))}: forgot task {printable(repr(task_id))}")
    return EXIT_OK


@click.command(name="sweep")
@_option(
    "--prefix",
    "filter_prefix",
    default="",
    metavar="PREFIX",
    help="Only keys starting with PREFIX (matched without the lock prefix).",
)
@_option(
    "--limit",
    default=SWEEP_LIMIT,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most dead leases (and most expired records) to delete in one batch.",
)
@_option("--all", "every", is_flag=True, help="Repeat batches until none is full.")
@_json_option()
@_handled
def sweep_command(filter_prefix: str, limit: int, every: bool, as_json: bool) -> int:
    """Delete dead leases and expired completion records, printing how many.

    A dead lease (its holder crashed and its key was never taken again) stays a row in an
    SQL store until swept; workers' heartbeats sweep a batch every minute. Only rows dead
    on the store's clock are deleted: live leases are never touched, and fences keep
    growing. Redis needs no sweep (its keys expire by themselves): 0 rows there.
    """
    target = _target(click.get_current_context())
    service = target.service()
    removed = batch = service.sweep(filter_prefix, limit=limit)
    while every and batch >= limit:
        batch = service.sweep(filter_prefix, limit=limit)
        removed += batch
    where = target.prefix + filter_prefix
    if as_json:
        _dump(
            {
                "prefix": target.prefix,
                "filter": filter_prefix,
                "removed": removed,
                "store_sweeps": service.sweeps,
            }
        )
    elif not service.sweeps:
        click.echo(f"removed 0 rows under {printable(repr(where))}: this store's keys expire by themselves")
    else:
        click.echo(f"removed {removed} dead row(s) under {printable(repr(where))}")
    return EXIT_OK


@click.command(name="doctor")
@_json_option()
@_handled
def doctor_command(as_json: bool) -> int:
    """Check the lock store's health.

    Connects, times the round trip, and runs the store's own checks, each store call
    within the store's call timeout (10 s). Exits 1 if any check failed (an unreachable
    or silent store is a failed check), 0 otherwise.
    """
    target = _target(click.get_current_context())
    url = target.resolve()
    report = doctor(target.service(), url=url)
    checks = report.checks
    if as_json:
        _dump(
            {
                "url": report.url,
                "prefix": report.prefix,
                "ok": report.ok,
                "round_trip": None if report.round_trip is None else round(report.round_trip, 6),
                "checks": [{"check": d.check, "status": d.status, "detail": d.detail} for d in checks],
            }
        )
    else:
        width = max(len(d.check) for d in checks)
        for d in checks:
            click.echo(f"{d.status:<4}  {d.check.ljust(width)}  {printable(d.detail)}")
        failed, warned = report.failed, report.warned
        click.echo(f"{failed} failed, {warned} warning(s), {len(checks) - failed - warned} ok")
    return EXIT_OK if report.ok else EXIT_CHECK_FAILED


COMMANDS = (list_command, show_command, release_command, forget_command, sweep_command, doctor_command)


# -- front ends -----------------------------------------------------------------------------


class _Group(click.Group):
    """A command group whose usage errors (bad option, missing argument, unknown command)
    are one ``error: ...`` line and exit 2, like every other error of the CLI, under both
    front ends (under ``celery`` the group's own options are parsed by Celery's group)."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            _usage_error(exc)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            _usage_error(exc)


def _usage_error(exc: click.UsageError) -> NoReturn:
    if type(exc).__name__ == "NoArgsIsHelpError":  # click >= 8.2: a bare group shows its help
        raise exc
    where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
    # Click echoes the arguments it refused ("unexpected extra argument (<a URL>)").
    message = " ".join(mask_url(exc.format_message()).split()).rstrip(".")
    click.echo(f"error: {printable(message)}{where}", err=True)
    raise click.exceptions.Exit(EXIT_USAGE)


@click.group(name="celery-exclusive", cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@_url_option(f"${ENV_VAR}")
@_prefix_option(f"${PREFIX_ENV_VAR}")
@click.version_option(package_name="celery-exclusive", prog_name="celery-exclusive")
@click.pass_context
def cli(ctx: click.Context, url: str | None, prefix: str | None) -> None:
    """Inspect and manage celery-exclusive leases (lock store from --url or $CELERY_EXCLUSIVE_URL)."""
    ctx.meta[_META_KEY] = Target(explicit_url=url, conf=None, prefix=_prefix(prefix, None), celery=False)


@click.group(name="exclusive", cls=_Group)
@_url_option(f"app.conf.exclusive_url, then ${ENV_VAR}")
@_prefix_option(f"app.conf.exclusive_prefix, then ${PREFIX_ENV_VAR}")
@click.pass_context
def exclusive(ctx: click.Context, url: str | None, prefix: str | None) -> None:
    """Inspect and manage celery-exclusive leases (lock store from the app's exclusive_url)."""
    # Celery's own context object carries the app; it stays ctx.obj for Celery's sake.
    app = getattr(ctx.obj, "app", None)
    conf: Mapping[str, Any] | None = getattr(app, "conf", None)
    ctx.meta[_META_KEY] = Target(explicit_url=url, conf=conf, prefix=_prefix(prefix, conf), celery=True)


for _command in COMMANDS:
    cli.add_command(_command)
    exclusive.add_command(_command)


def main() -> None:
    """Entry point of the ``celery-exclusive`` console script."""
    cli.main(prog_name="celery-exclusive")


if __name__ == "__main__":  # pragma: no cover
    main()
