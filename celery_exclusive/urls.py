"""Lock store URLs: which provider a URL selects, where the URL comes from, and masking.

Precedence: an explicit URL > Celery's ``exclusive_url`` setting > the
``CELERY_EXCLUSIVE_URL`` environment variable. Credentials never leave this module
unmasked: use :func:`mask_url` for anything shown to a person.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from celery_exclusive.errors import ConfigurationError

if TYPE_CHECKING:
    from celery_exclusive.providers import LockProvider

# The schemes themselves live in the provider registry (celery_exclusive.providers.PROVIDERS);
# the names below that need them import it on use, so importing this module loads no provider.

ENV_VAR = "CELERY_EXCLUSIVE_URL"
SETTING = "exclusive_url"

MASK = "***"
# Text is masked token by token; a token ends at whitespace or a quote (URLs are shown in
# repr quotes), never at ",", ";" or brackets, which occur inside URLs (hosts, passwords).
# A quote with an "@" after it in the same word is kept in the token: "'" is a valid
# password character (an RFC 3986 sub-delimiter), and an opening quote then stays in front.
_TOKENS = re.compile(r"""((?:[^\s'"]|['"](?=\S*@))+)""")
_SCHEME_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: Query (or libpq ``key=value``) parameters whose value is a secret.
_SECRET_PARAM = re.compile(
    r"(?i)(^|[?&;])([\w.-]*?(?:pass|pwd|token|secret|credential|api_?key)[\w.-]*)=([^&#]*)"
)
#: ``user:password@`` at the start of a token without ``scheme://``, or after a broken
#: scheme ending in "/" (``//user:pw@host``, ``redis//:pw@host``).
_BARE_USERINFO = re.compile(r"^((?:[^:@]*/)?[^:@/]*):(.+)@")


def mask_url(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every credential of every URL in it replaced by ``***``.

    The one masker of the package: whatever shows a URL or a driver's message goes
    through it. Hidden: the password of a URL's userinfo (``user:***@``: the user name
    stays, and a user-only URL is left as it is: it has no secret), the value of every
    query or libpq ``key=value`` parameter whose name contains ``pass``, ``pwd``,
    ``token``, ``secret``, ``credential`` or ``apikey`` (``password``, ``ssl_password``,
    ``sslpassword``, ``token``...), in each URL of a ``;``-separated list, in a URL
    without ``scheme://`` (``user:pw@host``, ``//user:pw@host``, ``redis//:pw@host``), a
    password with quotes in it (``'`` is a valid URL character), and every exact occurrence of ``secrets``
    (the configured URL's, see :func:`url_secrets`, for drivers that echo them outside
    a URL). Everything else, including the rest of the message, is kept.
    """
    known = sorted({s for s in secrets if s}, key=len, reverse=True)
    for secret in known:
        text = text.replace(secret, MASK)
    return _TOKENS.sub(lambda m: _mask_token(m.group(0), None), text)


def url_secrets(url: str) -> list[str]:
    """The secrets :func:`mask_url` hides in ``url``, raw and percent-decoded, longest first."""
    found: list[str] = []
    for token in _TOKENS.findall(url):
        _mask_token(token, found)
    values = {form for raw in found if raw and raw != MASK for form in (raw, unquote(raw))}
    return sorted(values, key=len, reverse=True)


def _mask_token(token: str, found: list[str] | None) -> str:
    starts = [m.start() for m in _SCHEME_START.finditer(token)]
    if not starts:
        return _mask_params(_mask_bare(token, found), found)
    parts = [_mask_params(token[: starts[0]], found)]
    for start, end in zip(starts, [*starts[1:], len(token)], strict=True):
        parts.append(_mask_one(token[start:end], found))
    return "".join(parts)


def _mask_one(url: str, found: list[str] | None) -> str:
    """One ``scheme://...`` URL (a trailing ``;`` separator is kept as it is)."""
    body = url.rstrip(";")
    tail = url[len(body) :]
    scheme, _, rest = body.partition("://")
    # The userinfo runs to the last "@" (SQLAlchemy and urlsplit read "@", "/" and ":" in a
    # password differently; masking up to the last one hides it for both).
    at = rest.rfind("@")
    if at >= 0:
        user, colon, password = rest[:at].partition(":")
        if colon:
            if found is not None:
                found.append(password)
            rest = f"{user}:{MASK}{rest[at:]}"
    return f"{scheme}://{_mask_params(rest, found)}{tail}"


def _mask_bare(token: str, found: list[str] | None) -> str:
    """``user:password@host...`` without a scheme (a URL missing its ``scheme://``)."""
    match = _BARE_USERINFO.match(token)
    if match is None:
        return token
    if found is not None:
        found.append(match.group(2))
    return f"{match.group(1)}:{MASK}@{token[match.end() :]}"


def _mask_params(text: str, found: list[str] | None) -> str:
    def hide(match: re.Match[str]) -> str:
        value = match.group(3)
        # Already masked, then punctuation of the message ("?password=***: refused"): keep it.
        tail = (
            value[len(MASK) :] if value.startswith(MASK) and not value[len(MASK) :].strip(":,.;)]}>") else ""
        )
        if found is not None:
            found.append(value[: len(value) - len(tail)])
        return f"{match.group(1)}{match.group(2)}={MASK}{tail}"

    return _SECRET_PARAM.sub(hide, text)


def hide_from_celery_reports() -> None:
    """Make Celery censor the ``exclusive_url`` setting as it censors its own secrets.

    ``celery report``, ``app.conf.humanize(censored=True)`` and ``app.conf.table(censored=True)``
    replace a setting's value by ``********`` when its name matches Celery's
    ``celery.app.utils.HIDDEN_SETTINGS`` pattern (``PASS``, ``SECRET``, ``DATABASE``...),
    which ``exclusive_url`` does not; the pattern is extended once, when this package is
    imported (a ``celery`` command imports it through its ``celery.commands`` entry point).
    """
    from celery.app import utils

    # celery-types does not declare HIDDEN_SETTINGS.
    hidden: re.Pattern[str] = utils.HIDDEN_SETTINGS  # type: ignore[attr-defined, unused-ignore]
    if not hidden.search(SETTING):
        utils.HIDDEN_SETTINGS = re.compile(  # type: ignore[attr-defined, unused-ignore]
            f"{hidden.pattern}|{SETTING}", hidden.flags | re.IGNORECASE
        )


def resolve_url(explicit: str | None = None, conf: Mapping[str, Any] | None = None) -> str:
    """Pick the lock store URL by precedence, or raise naming every place to set it."""
    for candidate in (explicit, (conf or {}).get(SETTING), os.environ.get(ENV_VAR)):
        if candidate is None or candidate == "":
            continue
        if not isinstance(candidate, str):
            raise ConfigurationError(f"the lock store URL must be a str, got {type(candidate).__name__}")
        return candidate
    broker = str((conf or {}).get("broker_url") or "")
    hint = ""
    if broker.startswith(("redis://", "rediss://")):
        hint = (
            " Your broker is Redis; to keep locks there too, set "
            f"app.conf.{SETTING} to a redis:// URL (it is never picked silently)."
        )
    from celery_exclusive.providers import KNOWN_SCHEMES

    raise ConfigurationError(
        f"no lock store configured: pass a URL, set app.conf.{SETTING}, or set the "
        f"{ENV_VAR} environment variable (schemes: {', '.join(KNOWN_SCHEMES)}).{hint}"
    )


def scheme_family(url: str) -> str:
    """``sql``, ``redis`` or ``memory`` for a URL, or ConfigurationError naming known schemes.

    The registry's :func:`celery_exclusive.providers.scheme_family`, under its older name.
    """
    from celery_exclusive.providers import scheme_family

    return scheme_family(url)


_SENTINEL_ALIAS = {"sentinel": "redis+sentinel"}
_URL_LIST = re.compile(r";(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def sentinel_url(url: str) -> str:
    """Kombu's Sentinel form as the package's own: ``sentinel://`` means ``redis+sentinel://``
    and ``sentinel://h1:26379/svc;sentinel://h2:26379`` means
    ``redis+sentinel://h1:26379,h2:26379/svc``. The parts' schemes must be equal, and their
    userinfo, path (``/<service>[/<db>]``) and query may be given once or repeated, never
    different. Any other URL is returned as it is.
    """
    parts = _URL_LIST.split(url)
    if len(parts) == 1 and not url.lower().startswith("sentinel://"):
        return url
    schemes = {_SENTINEL_ALIAS.get(s, s) for s in (p.partition("://")[0].lower() for p in parts)}
    if len(schemes) != 1 or not schemes <= {"redis+sentinel", "rediss+sentinel"}:
        raise ConfigurationError(
            f"a ;-separated lock store URL lists Sentinel URLs of one scheme (sentinel:// or "
            f"redis+sentinel://), got {mask_url(url)!r}"
        )
    hosts, seen = [], {"userinfo": "", "path": "", "query": ""}
    for part in parts:
        rest = part.partition("://")[2]
        rest, _, query = rest.partition("?")
        authority, _, path = rest.partition("/")
        userinfo, _, hostlist = authority.rpartition("@")
        hosts.append(hostlist)
        for name, value in (("userinfo", userinfo), ("path", path), ("query", query)):
            if value and seen[name] and value != seen[name]:
                raise ConfigurationError(
                    f"the parts of lock store URL {mask_url(url)!r} give different {name}s; "
                    "give it once (in the first part) or the same in every part"
                )
            seen[name] = seen[name] or value
    userinfo = f"{seen['userinfo']}@" if seen["userinfo"] else ""
    query = f"?{seen['query']}" if seen["query"] else ""
    return f"{schemes.pop()}://{userinfo}{','.join(hosts)}/{seen['path']}{query}"


def split_options(url: str, allowed: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """Remove celery-exclusive's own query options from ``url``; reject unknown ``ce_`` ones.

    Options are spelled ``ce_<name>`` (``?ce_table=locks``) so they never clash with a
    driver's own query parameters, which are passed through untouched.
    """
    try:
        query = urlsplit(url).query
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ConfigurationError(f"malformed lock store URL {mask_url(url)!r}: {exc}") from None
    kept: list[str] = []
    options: dict[str, str] = {}
    for segment in query.split("&"):
        parsed = parse_qsl(segment, keep_blank_values=True)
        if not parsed or not parsed[0][0].startswith("ce_"):
            if segment:
                kept.append(segment)  # a driver's parameter, passed on exactly as written
            continue
        name, value = parsed[0]
        option = name[3:]
        if option not in allowed:
            raise ConfigurationError(
                f"unknown option {name!r} in lock store URL {mask_url(url)!r}; "
                f"known: {', '.join('ce_' + a for a in allowed) or 'none'}"
            )
        options[option] = value
    base = url.split("?", 1)[0].split("#", 1)[0]
    return (f"{base}?{'&'.join(kept)}" if kept else base), options


def provider_from_url(url: str) -> LockProvider:
    """Build the provider the URL's scheme selects; drivers are imported only here.

    The registry's :func:`celery_exclusive.providers.provider_from_url`, under its older name.
    """
    from celery_exclusive.providers import provider_from_url

    return provider_from_url(url)


def __getattr__(name: str) -> tuple[str, ...]:
    """``KNOWN_SCHEMES``: the registry's, under its older name (read on use)."""
    if name == "KNOWN_SCHEMES":
        from celery_exclusive.providers import KNOWN_SCHEMES

        return KNOWN_SCHEMES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


hide_from_celery_reports()
