"""Lock store URLs: which provider a URL selects, where the URL comes from, and masking.

Precedence: an explicit URL > Celery's ``exclusive_url`` setting > the
``CELERY_EXCLUSIVE_URL`` environment variable. Credentials never leave this module
unmasked: use :func:`mask_url` for anything shown to a person.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, quote_plus, unquote, urlsplit

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
#: The name of an option whose value is a secret (``password``, ``ssl_password``...).
SECRET_NAME = re.compile(f"(?i){_HIDDEN_NAME}")
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
#: What ends a URL's userinfo, host, port or path for one driver or another, or a line.
_PASSWORD_PARTS = re.compile(r"[@:/?#\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+")
#: SQLAlchemy's URL userinfo (``make_url``'s pattern): a user without ``:`` or ``/``, and
#: a password up to the first ``@``.
_SQLALCHEMY_USERINFO = re.compile(r"[^:/]*(?::[^@]*)?@")
#: A URL's ``scheme://user:`` whose password runs across a line break before any ``@`` or
#: other whitespace (the drivers take a raw line break in a password).
_BROKEN_USERINFO = re.compile(
    r"(?<![\w+.\-/@])[A-Za-z][A-Za-z0-9+.-]*://[^\s:@/]*:(?=[^\s@]*[\r\n\v\f\x1c-\x1e\x85\u2028\u2029])"
)
#: What :data:`_BROKEN_USERINFO`'s password is: words joined by line breaks only, up to
#: the end of the first word with an ``@``.
_BROKEN_RUN = re.compile(r"[^\s@]*(?:[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]+[^\s@]*)+@\S*")
#: A secret shorter than this is hidden only where it stands alone (:func:`mask_url`).
SHORT_SECRET = 4
#: Where a short secret stands alone: no letter, digit, ``_``, ``.``, ``%`` or ``-`` next
#: to it, nor a ``:`` after a word before it or a ``:`` after it (a host, port, number or
#: word it is part of: ``127.0.0.1:1``); a ``:`` after a quote or ``//`` is a userinfo's.
_ALONE = (r"(?<![\w.%-])(?<![\w.]:)", r"(?![\w.:%-])")
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
    kept as it is. A password with a line break in it (the drivers take one) is hidden too:
    a URL whose line ends in its userinfo (``user:pass`` with no ``@`` or whitespace
    after it) runs on across line breaks to the first word with an ``@``, so a URL with
    no password whose line ends after a port (``redis://h:6379/0``) and whose next line
    starts with a word with an ``@`` is masked up to that ``@``. A text that is one URL
    (a scheme at its start and no other) whose userinfo has whitespace in it has that
    userinfo run to its last ``@``, across line breaks and spaces both. A password with an
    ``@`` before its last line break is hidden in a longer text only with ``secrets``
    (there, the URL seems to end at that ``@``).

    A known secret of fewer than :data:`SHORT_SECRET` (4) characters is replaced only where
    it stands alone, with no letter, digit or ``_ . % -`` directly before or after it, nor
    a ``:`` after it or after a word before it (``'ab'``, ``'ab@host'``, ``=ab&``,
    ``':ab'``; not ``ab:1``, ``h:ab``): replaced blindly, a password ``1`` would turn
    ``127.0.0.1:1`` into ``***27.0.0.***:***``, and inside a longer word it shows no more than
    that word does, and one of whitespace only not at all (it cannot be told from the
    text's own). Longer secrets are replaced wherever they occur.
    """
    text = _replace_known(text, [*secrets, *_one_url_password(text)])
    text = _mask_spaced(text, None)
    return _TOKENS.sub(lambda m: _mask_token(m.group(0), None), text)


def _one_url_password(text: str) -> list[str]:
    """The password of ``text`` if it is one URL (a scheme at its start, no other) whose
    userinfo has whitespace in it: that userinfo then runs to the URL's last ``@``, across
    line breaks and spaces both (no rule on a longer text can tell where such a one ends)."""
    starts = list(itertools.islice(_SCHEME_START.finditer(text), 2))
    if len(starts) != 1 or starts[0].start() != 0:
        return []
    rest = text[starts[0].end() :]
    if _MASKED_USERINFO.match(rest):
        return []
    _, colon, password = rest[: max(_userinfo_end(rest), 0)].partition(":")
    return [password] if colon and any(c.isspace() for c in password) else []


def _replace_known(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` replaced by ``***``, longest first (a short one only
    where it stands alone: :func:`mask_url`)."""
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        if len(secret) >= SHORT_SECRET:
            text = text.replace(secret, MASK)
        elif secret in text and secret.strip():
            text = re.sub(f"{_ALONE[0]}{re.escape(secret)}{_ALONE[1]}", MASK, text)
    return text


def mask_error(exc: BaseException, secrets: Iterable[str]) -> None:
    """Mask ``exc`` and every exception chained to it (``__cause__``, ``__context__``, and
    one held in an attribute, as SQLAlchemy's ``orig``), in place, so that no traceback of
    the store's error shows a credential.

    Each text an exception shows (its ``args``, string attributes, ``strerror`` and
    ``filename``, notes) goes through :func:`mask_url` with ``secrets`` (see
    :func:`known_secrets`): the driver's words, the exception's type and the chain stay.
    An exception whose ``str`` or ``repr`` still shows a secret after that (one that
    builds its message from elsewhere) is given a subclass of its own type, same name
    and module, that shows the masked text instead.
    """
    known = list(secrets)
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        current = todo.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        _mask_in_place(current, known)
        todo += [current.__cause__, current.__context__]
        todo += [v for v in getattr(current, "__dict__", {}).values() if isinstance(v, BaseException)]


def _masked_value(value: object, secrets: list[str]) -> object:
    if isinstance(value, str):
        return mask_url(value, secrets)
    if isinstance(value, tuple | list):
        return type(value)(_masked_value(v, secrets) for v in value)
    return value


def _mask_in_place(exc: BaseException, secrets: list[str]) -> None:
    """One exception of :func:`mask_error`'s chain."""
    before = str(exc), repr(exc)
    with contextlib.suppress(TypeError, ValueError, AttributeError):
        exc.args = tuple(_masked_value(a, secrets) for a in exc.args)
    names = [n for n, v in getattr(exc, "__dict__", {}).items() if isinstance(v, str | tuple | list)]
    for name in [*names, "strerror", "filename", "filename2", "msg", "reason"]:
        value = getattr(exc, name, None)
        if isinstance(value, str | tuple | list) and name != "__notes__":
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                setattr(exc, name, _masked_value(value, secrets))
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        notes[:] = [_masked_value(note, secrets) for note in notes]
    shown = str(exc), repr(exc)
    if all(_replace_known(text, secrets) == text for text in shown):
        return
    masked = tuple(mask_url(text, secrets) for text in before)
    # A built-in type (TypeError) shows its args, masked already; one without a __dict__
    # (AttributeError) could not keep the texts.
    with contextlib.suppress(TypeError, AttributeError):
        exc.__dict__["_ce_masked"] = masked
        exc.__class__ = _masked_class(type(exc))


#: The classes :func:`_masked_class` made, by the class they stand for.
_MASKED_CLASSES: dict[type[BaseException], type[BaseException]] = {}


def _masked_class(cls: type[BaseException]) -> type[BaseException]:
    """``cls`` under its own name and module, showing :func:`_mask_in_place`'s texts."""
    if cls in _MASKED_CLASSES.values():
        return cls
    made = _MASKED_CLASSES.get(cls)
    if made is None:
        made = _MASKED_CLASSES.setdefault(cls, _make_masked_class(cls))
    return made


def _make_masked_class(cls: type[BaseException]) -> type[BaseException]:

    def text(self: BaseException) -> str:
        return str(self.__dict__["_ce_masked"][0])

    def shown(self: BaseException) -> str:
        return str(self.__dict__["_ce_masked"][1])

    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (cls,), {"__str__": text, "__repr__": shown, **names})


def url_secrets(url: str) -> list[str]:
    """The secrets :func:`mask_url` hides in ``url``, longest first: each as written,
    percent-decoded, percent-encoded, and as Python's ``repr`` escapes them."""
    found: list[str] = []
    for token in _TOKENS.findall(_mask_spaced(url, found)):
        _mask_token(token, found)
    found += _one_url_password(url)
    # A driver that reads a raw "@", ":", "/", "?" or "#" in a password as the URL's next
    # part echoes that part as a host, port or path ("failed to resolve host 'rest@h'", "Port
    # could not be cast to integer value as 'start'"), and a message cut at a line break
    # shows a line of it: each such part, and each rest after an "@" (SQLAlchemy's host),
    # is a secret too (one of 1-3 characters hidden only where it stands alone: mask_url).
    parts = [p for raw in found for p in _PASSWORD_PARTS.split(raw)]
    parts += [raw.split("@", n)[-1] for raw in found for n in range(1, raw.count("@") + 1)]
    found += parts
    return known_secrets(raw for raw in found if raw != MASK)


def known_secrets(secrets: Iterable[str]) -> list[str]:
    """``secrets`` (a URL's, see :func:`url_secrets`, or passwords a store was given
    outside one), longest first, each also percent-decoded, percent-encoded (as a URL or a
    form writes it) and as Python's ``repr`` escapes it (a driver's message often quotes a
    value with repr: a tab, a quote or a backslash then reads escaped)."""
    decoded = {form for raw in secrets if raw for form in (raw, unquote(raw))}
    encoded = {form for raw in decoded for form in (quote(raw, safe=""), quote_plus(raw), quote(raw))}
    values = decoded | encoded | {repr(form)[1:-1] for form in decoded}
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
    text = _mask_broken(text, found)
    if "\n" not in text and not _SCHEME_START.search(text):
        text = _mask_spaced_bare(text, found)
    return "".join(_mask_spaced_line(line, found) for line in text.splitlines(keepends=True))


def _mask_broken(text: str, found: list[str] | None) -> str:
    """``text`` with the password of each URL whose userinfo runs across a line break
    masked: from its ``user:`` over words separated by line breaks only, to the last ``@``
    (not one in a secret query parameter) of the first word with an ``@``."""
    if not _BROKEN_USERINFO.search(text):
        return text
    parts: list[str] = []
    done = 0
    for match in _BROKEN_USERINFO.finditer(text):
        if match.start() < done:
            continue
        run = _BROKEN_RUN.match(text, match.end())
        if run is None:
            continue
        word = run.group(0)
        later = _SCHEME_START.search(word, 1)  # the next URL of a list ("...;redis://...")
        at = _userinfo_end(word[: later.start()] if later else word)
        if at < 0:
            continue
        if found is not None:
            found.append(word[:at])
        parts += [text[done : match.end()], MASK]
        done = match.end() + at
    return "".join(parts) + text[done:]


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


def store_configured(explicit: str | None = None, conf: Mapping[str, Any] | None = None) -> bool:
    """Whether a lock store URL is set in any place :func:`resolve_url` looks (it may still
    be wrong: resolve_url and the store say so)."""
    return any(candidate not in (None, "") for candidate in _candidates(explicit, conf))


def _candidates(explicit: str | None, conf: Mapping[str, Any] | None) -> tuple[Any, ...]:
    return (explicit, (conf or {}).get(SETTING), os.environ.get(ENV_VAR))


def resolve_url(explicit: str | None = None, conf: Mapping[str, Any] | None = None) -> str:
    """Pick the lock store URL by precedence, or raise naming every place to set it."""
    for candidate in _candidates(explicit, conf):
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
        secrets = url_secrets(url)
        mask_error(exc, secrets)  # still the error's __context__
        raise ConfigurationError(
            f"malformed lock store URL {mask_url(url)!r}: {mask_url(str(exc), secrets)}"
        ) from None
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
        if option in options:
            raise ConfigurationError(f"option {name!r} is given twice in lock store URL {mask_url(url)!r}")
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
