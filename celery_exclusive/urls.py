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
# A URL starts at a scheme that does not go on a word, a path or a userinfo ("u://x@h" has
# no second URL in "postgresql://u://x@h/db", whose password is "//x").
_SCHEME_START = re.compile(r"(?<![\w+.\-/@])[A-Za-z][A-Za-z0-9+.-]*://")
#: The name of a query (or libpq ``key=value``) parameter whose value is a secret.
_HIDDEN_NAME = r"[\w.-]*?(?:pass|pwd|token|secret|credential|api_?key)[\w.-]*"
#: Such a parameter in a word.
_SECRET_PARAM = re.compile(rf"(?i)(^|[?&;])({_HIDDEN_NAME})=([^&#]*)")
#: A URL's secret query parameter (what follows a ``?`` or ``&``), its value up to the next
#: ``&`` or ``#`` or the line's end, whitespace included.
_SPACED_PARAM = re.compile(rf"(?i)([?&])({_HIDDEN_NAME})=([^&#\n]*)")
#: A libpq ``key='quoted value'`` secret (``\'`` and ``\\`` escape in it).
_QUOTED_PARAM = re.compile(rf"(?i)(^|\s)({_HIDDEN_NAME})=('(?:[^'\\\n]|\\.)*')")
#: An ``@`` that may end a URL's userinfo: not one between quotes (``'root'@'localhost'``).
_URL_AT = re.compile(r"""(?<!['"])@|@(?!['"])""")
#: Userinfo masked already: ``user:***@``.
_MASKED_USERINFO = re.compile(rf"[^\s:@/]*:{re.escape(MASK)}@")
#: What ends a URL's userinfo, host or path for one driver or another.
_URL_DELIMITERS = re.compile(r"[@/?#]")
#: SQLAlchemy's URL userinfo (``make_url``'s pattern): a user without ``:`` or ``/``, and
#: a password up to the first ``@``.
_SQLALCHEMY_USERINFO = re.compile(r"[^:/]*(?::[^@]*)?@")
#: ``user:password@`` at the start of a token without ``scheme://``, or after a broken
#: scheme ending in "/" (``//user:pw@host``, ``redis//:pw@host``).
_BARE_USERINFO = re.compile(r"^((?:[^:@]*/)?[^:@/]*):(.+)@")
#: The ``user:`` of such a text whose password has whitespace in it (``u:pa ss@h``).
_BARE_START = re.compile(r"""^(['"]?(?:[^\s:@]*/)?[^\s:@/]*):""")


def mask_url(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every credential of every URL in it replaced by ``***``.

    The one masker of the package: whatever shows a URL or a driver's message goes
    through it. Hidden: the password of a URL's userinfo (``user:***@``: the user name
    stays, and a user-only URL is left as it is: it has no secret), the value of every
    query or libpq ``key=value`` parameter whose name contains ``pass``, ``pwd``,
    ``token``, ``secret``, ``credential`` or ``apikey`` (``password``, ``ssl_password``,
    ``sslpassword``, ``token``...), in each URL of a ``;``-separated list, in a URL
    without ``scheme://`` (``user:pw@host``, ``//user:pw@host``, ``redis//:pw@host``), a
    password with quotes in it (``'`` is a valid URL character) or unencoded whitespace
    (invalid URL syntax the drivers accept: ``redis://:pa ss@h/0``), and every exact
    occurrence of ``secrets`` (the configured URL's, see :func:`url_secrets`, for drivers
    that echo them outside a URL). Everything else, including the rest of the message, is
    kept, with two exceptions where a password's end cannot be told from the message's
    text: a URL's userinfo runs to the last ``@`` of its line (not one between quotes, as
    in ``'root'@'localhost'``) when there is whitespace before it, and a secret query
    parameter's value followed on its line by whitespace or a quote runs to the next ``&``
    or ``#`` or the line's end; a URL masked already (``user:***@``, ``password=***``) is
    kept as it is. Not hidden: a password with a line break in it.
    """
    known = sorted({s for s in secrets if s}, key=len, reverse=True)
    for secret in known:
        text = text.replace(secret, MASK)
    text = _mask_spaced(text, None)
    return _TOKENS.sub(lambda m: _mask_token(m.group(0), None), text)


def url_secrets(url: str) -> list[str]:
    """The secrets :func:`mask_url` hides in ``url``, longest first: each as written,
    percent-decoded, and as Python's ``repr`` escapes them."""
    found: list[str] = []
    for token in _TOKENS.findall(_mask_spaced(url, found)):
        _mask_token(token, found)
    # A driver that reads a raw "@", "/", "?" or "#" in a password as the URL's next part
    # echoes that part as a host, port or path ("failed to resolve host 'rest@h'", "Port
    # could not be cast to integer value as 'start'"): each such part of 4 characters or
    # more, and each rest after an "@" (SQLAlchemy's host), is a secret too.
    parts = [p for raw in found for p in _URL_DELIMITERS.split(raw)]
    parts += [raw.split("@", n)[-1] for raw in found for n in range(1, raw.count("@") + 1)]
    found += [part for part in parts if len(part) >= 4]
    # As written, percent-decoded, and each as Python's repr shows it (a driver's message
    # often quotes a value with repr: a tab, a quote or a backslash then reads escaped).
    decoded = {form for raw in found if raw and raw != MASK for form in (raw, unquote(raw))}
    values = decoded | {repr(form)[1:-1] for form in decoded}
    return sorted(values, key=len, reverse=True)


def _mask_spaced(text: str, found: list[str] | None) -> str:
    """``text`` with the secrets that run across whitespace masked: the rest is masked word
    by word (:func:`_mask_token`), and a word ends at whitespace.

    Drivers accept an unencoded space in a password (``redis://:pa ss@h/0``,
    ``postgresql://u:pa ss@h/db``), so a URL's userinfo with a ``:`` runs to the last ``@``
    of its line before the next ``scheme://`` (an ``@`` between quotes, as in MySQL's
    ``'root'@'localhost'``, is a message's, not a URL's); a secret query parameter's value
    runs to the next ``&`` or ``#`` (or the line's end); a libpq ``key='quoted value'`` runs
    to its closing quote. A URL already masked (``user:***@``, ``password=***``) is left as
    it is; one on a line without a later ``@`` has no userinfo to hide. A text that is one
    URL missing its ``scheme://`` (``user:pa ss@host``, ``//u:pa ss@h``), one line with no
    scheme in it, is masked so too.
    """
    if "\n" not in text and not _SCHEME_START.search(text):
        text = _mask_spaced_bare(text, found)
    return "".join(_mask_spaced_line(line, found) for line in text.splitlines(keepends=True))


def _mask_spaced_bare(text: str, found: list[str] | None) -> str:
    match = _BARE_START.match(text)
    at = _userinfo_end(text)
    if match is None or at < match.end() or not any(c.isspace() for c in text[match.end() : at]):
        return text
    if found is not None:
        found.append(text[match.end() : at])
    return f"{match.group(1)}:{MASK}{text[at:]}"


def _mask_spaced_line(line: str, found: list[str] | None) -> str:
    line = _QUOTED_PARAM.sub(lambda m: _hide_param(m, found), line)
    starts: list[int] = []
    for match in _SCHEME_START.finditer(line):
        # A scheme is the next URL after ";" or "," (a list), or after the previous URL's
        # "@"; before that "@", it may be in the previous one's password ("u:a b://c@h").
        at = match.start()
        if not starts or line[at - 1] in ";," or _URL_AT.search(line, starts[-1], at):
            starts.append(at)
    if not starts:
        return line
    parts = [line[: starts[0]]]
    for start, end in zip(starts, [*starts[1:], len(line)], strict=True):
        url, separator = _separated(line[start:end], last=end == len(line))
        parts.append(_mask_spaced_url(url, found) + separator)
    return "".join(parts)


def _mask_spaced_url(url: str, found: list[str] | None) -> str:
    """One ``scheme://...`` and the rest of its line up to the next one."""
    head, _, rest = url.partition("://")
    if not _MASKED_USERINFO.match(rest):
        userinfo = rest[: max(_userinfo_end(rest), 0)]
        user, colon, password = userinfo.partition(":")
        if colon and any(c.isspace() for c in userinfo):
            if found is not None:
                found.append(password)
            rest = f"{user}:{MASK}{rest[len(userinfo) :]}"
    return f"{head}://{_SPACED_PARAM.sub(lambda m: _hide_param(m, found), rest)}"


def _userinfo_end(rest: str) -> int:
    """Where the userinfo of a URL (``rest``: what follows ``://``) ends: its last ``@``
    that is neither between quotes nor in a secret query parameter's value
    (``?password=p@ss``: an ``@`` there is the password's), or -1."""
    secret = _SPACED_PARAM.search(rest)
    ats = [m.start() for m in _URL_AT.finditer(rest, 0, secret.start() if secret else len(rest))]
    return ats[-1] if ats else -1


def _separated(url: str, *, last: bool) -> tuple[str, str]:
    """A URL of a list and the ``;`` or ``,`` that separates it from the next one."""
    if not last and url[-1:] in (";", ","):
        return url[:-1], url[-1]
    return url, ""


def _hide_param(match: re.Match[str], found: list[str] | None) -> str:
    """``name=***`` for a secret parameter whose value has whitespace or a quote in it (one
    word is masked with its word)."""
    value = match.group(3)
    if value.startswith(MASK) or not any(c.isspace() or c in "'\"" for c in value):
        return match.group(0)  # masked already, or one word: masked with the word
    if found is not None:
        found.append(value[1:-1] if match.re is _QUOTED_PARAM else value)
    return f"{match.group(1)}{match.group(2)}={MASK}"


def _mask_token(token: str, found: list[str] | None) -> str:
    starts = [m.start() for m in _SCHEME_START.finditer(token)]
    if not starts:
        return _mask_params(_mask_bare(token, found), found)
    parts = [_mask_params(token[: starts[0]], found)]
    for start, end in zip(starts, [*starts[1:], len(token)], strict=True):
        url, separator = _separated(token[start:end], last=end == len(token))
        parts.append(_mask_one(url, found) + separator)
    return "".join(parts)


def _mask_one(url: str, found: list[str] | None) -> str:
    """One ``scheme://...`` URL."""
    scheme, _, rest = url.partition("://")
    # The userinfo runs to the last "@" (SQLAlchemy and urlsplit read "@", "/" and ":" in a
    # password differently; masking up to the last one hides it for both).
    at = _userinfo_end(rest)
    if at >= 0:
        user, colon, password = rest[:at].partition(":")
        if colon:
            if found is not None:
                found.append(password)
            rest = f"{user}:{MASK}{rest[at:]}"
    return f"{scheme}://{_mask_params(rest, found)}"


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


def split_options(
    url: str, allowed: tuple[str, ...], *, sqlalchemy: bool = False
) -> tuple[str, dict[str, str]]:
    """Remove celery-exclusive's own query options from ``url``; reject unknown ``ce_`` ones.

    Options are spelled ``ce_<name>`` (``?ce_table=locks``) so they never clash with a
    driver's own query parameters, which are passed through untouched. With ``sqlalchemy``
    the userinfo is read as SQLAlchemy reads it (the password runs to the first ``@``, so
    a ``?`` or ``#`` in it starts no query or fragment) and kept as it is.
    """
    scheme, sep, rest = url.partition("://")
    userinfo = _SQLALCHEMY_USERINFO.match(rest) if sqlalchemy and sep else None
    head = f"{scheme}{sep}{userinfo.group(0)}" if userinfo else ""
    tail = rest[userinfo.end() :] if userinfo else url
    try:
        query = urlsplit(f"{scheme}{sep}{tail}" if userinfo else tail).query
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
    base = head + tail.split("?", 1)[0].split("#", 1)[0]
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
