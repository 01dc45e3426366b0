"""The one masker, by property: no piece of a password survives, the rest of the text does.

URLs of every scheme the package accepts carry passwords drawn from a wide alphabet
(whitespace, quotes, ``@ : / # ? % ; &``, non-ASCII), written as users write them (raw, as
the drivers accept them), percent-encoded, or as a ``?password=`` parameter, inside the
messages drivers and the package print. :func:`mask_url` must leave no 4-character piece
of the password (as written or percent-decoded), and must keep the host, port and database.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from celery_exclusive.providers import KNOWN_SCHEMES
from celery_exclusive.urls import MASK, mask_url, url_secrets

#: Every registered scheme and the SQLAlchemy driver variants the registry resolves.
SCHEMES = [*KNOWN_SCHEMES, "postgresql+psycopg2", "mysql+mysqldb", "mariadb+mariadbconnector"]

#: Messages that show a URL: the drivers' (libpq, redis-py, PyMySQL), the package's, a traceback.
MESSAGES = [
    "{url}",
    "could not connect to {url}: Connection refused",
    "lock store '{url}': refused",
    'invalid URI query parameter in "{url}"',
    "error: redis {url}: Error 111 connecting to 127.0.0.1:1. Connection refused.",
    "<LockService {url} prefix='x:'>",
    "({url})",
    'SQL lock store {url} failed to lock: OperationalError: (1045, "Access denied for user '
    "'root'@'localhost' (using password: YES)\")",
    'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: {url}\nDuring handling',
    "first {url};redis://:{masked}@other:6379/1 then",
]

PASSWORDS = (
    st.lists(
        st.one_of(
            st.characters(min_codepoint=0x20, max_codepoint=0x7E),  # printable ASCII, space included
            st.sampled_from(" \t'\"@:/#?%;&=é中ü€😀"),
            st.sampled_from(["%20", "%40", "%3A", "%2F", "%25", "%27"]),  # percent-encoded forms
        ),
        min_size=1,
        max_size=24,
    )
    .map("".join)
    .map(lambda s: s.replace("***", "*x*"))  # "user:***@" is how a masked URL reads
)

SECRET_PARAM = st.sampled_from(["password", "ssl_password", "sslpassword", "token", "access_token"])


def _pieces(password: str) -> set[str]:
    """Every 4-character piece of the password as written and percent-decoded."""
    return {form[i : i + 4] for form in (password, unquote(password)) for i in range(len(form) - 3)}


def _check(message: str, url: str, shown: str, password: str, *, whole_line: bool = False) -> None:
    """No piece of ``password`` is in the masked text that is not in its masked form too,
    and the masked text is the message showing ``shown`` (the URL, masked by hand); with
    ``whole_line``, only up to the URL's end (what follows on its line may be masked too)."""
    text = message.format(url=url, masked="pw")
    masked = mask_url(text)
    expected = message.format(url=shown, masked=MASK)
    leaked = sorted(p for p in _pieces(password) if p in masked and p not in expected)
    assert not leaked, (text, masked)
    if whole_line:
        before, _, after = message.partition("{url}")
        later = after.partition("\n")[2]
        assert masked.startswith(before.format(masked=MASK) + shown), text
        assert masked.endswith(later.format(masked=MASK)), text
    else:
        assert masked == expected, text
    # The configured URL's secrets hide the password however a driver echoes it alone.
    secrets = url_secrets(url)
    echoed = mask_url(f"authentication failed for {password!r} ({unquote(password)})", secrets)
    assert not [p for p in _pieces(password) if p in echoed and p not in "authentication failed for"], echoed


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scheme=st.sampled_from(SCHEMES),
    user=st.sampled_from(["", "app", "postgres", "my user", "u.ser-1"]),
    password=PASSWORDS,
    encoded=st.booleans(),
    message=st.sampled_from(MESSAGES),
)
@example(scheme="postgresql", user="user", password="pa ss", encoded=False, message=MESSAGES[1])
@example(scheme="redis", user="", password="pa ss", encoded=False, message=MESSAGES[0])
@example(scheme="redis", user="", password="abcd@efgh ijkl", encoded=False, message=MESSAGES[7])
@example(scheme="mysql", user="root", password="a' b@c", encoded=False, message=MESSAGES[2])
def test_no_piece_of_a_userinfo_password_survives(
    scheme: str, user: str, password: str, encoded: bool, message: str
) -> None:
    """A password in the userinfo, raw or percent-encoded, is hidden; host, port and db stay."""
    written = quote(password, safe="") if encoded else password
    tail = "@db.example:5432/app?sslmode=require"
    _check(message, f"{scheme}://{user}:{written}{tail}", f"{scheme}://{user}:{MASK}{tail}", written)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scheme=st.sampled_from(SCHEMES),
    name=SECRET_PARAM,
    # Raw, a value ends at "&" or "#" (the drivers read the query so); encoded, anything goes.
    password=PASSWORDS.filter(lambda p: not p.startswith("*")),
    encoded=st.booleans(),
    message=st.sampled_from(MESSAGES),
)
@example(scheme="redis", name="password", password="pa ss", encoded=False, message=MESSAGES[1])
def test_no_piece_of_a_query_password_survives(
    scheme: str, name: str, password: str, encoded: bool, message: str
) -> None:
    """A secret query parameter's value, raw or encoded, is hidden; the rest of the URL stays."""
    if not encoded:
        password = password.replace("&", "").replace("#", "")
    written = quote(password, safe="") if encoded else password
    head = f"{scheme}://db.example:6379/0?a=1&{name}="
    # A value runs to "&", "#" or its line's end, as far as anyone can tell (a raw one may
    # have spaces): what follows it on the line may be masked with it.
    _check(message, f"{head}{written}", f"{head}{MASK}", written, whole_line=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    head=st.sampled_from(["", "//", "redis//", "postgresql/"]),
    user=st.sampled_from(["", "app", "u.ser-1"]),
    password=PASSWORDS,
    encoded=st.booleans(),
)
@example(head="", user="user", password="pa ss", encoded=False)
def test_no_piece_of_the_password_of_a_url_without_its_scheme_survives(
    head: str, user: str, password: str, encoded: bool
) -> None:
    """A URL missing its ``scheme://`` (as a malformed-URL error shows it: masked alone)."""
    # "app://x@h" is a URL of scheme "app" and user "x", whatever was meant: nothing to hide.
    assume(not (head == "" and user and password.startswith("//")))
    written = quote(password, safe="") if encoded else password
    tail = "@db.example:5432/app"
    _check("{url}", f"{head}{user}:{written}{tail}", f"{head}{user}:{MASK}{tail}", written)


#: Passwords with line breaks (the drivers take them raw) and no other whitespace.
BROKEN_PASSWORDS = (
    st.lists(
        st.one_of(
            st.characters(min_codepoint=0x21, max_codepoint=0x7E),  # printable ASCII, no space
            st.sampled_from(["\n", "\r\n", "\r", "@", ":", "/", "é", "😀"]),
        ),
        min_size=1,
        max_size=24,
    )
    .map("".join)
    .filter(lambda s: any(c in s for c in "\r\n"))
    # An "@" before the last line break: the line's own URL seems to end there (hidden only
    # with the store's secrets, url_secrets, as every error and repr of the store has them).
    .filter(lambda s: "@" not in s[: max(s.rfind("\n"), s.rfind("\r"))])
    .map(lambda s: s.replace("***", "*x*"))
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scheme=st.sampled_from(SCHEMES),
    user=st.sampled_from(["", "app", "postgres", "u.ser-1"]),
    password=BROKEN_PASSWORDS,
    message=st.sampled_from(MESSAGES),
)
@example(scheme="redis", user="", password="ab\ncd", message=MESSAGES[9])
@example(scheme="postgresql", user="u", password="a\nb@c", message=MESSAGES[1])
@example(scheme="redis", user="", password="a\r\n\nb:c/d", message=MESSAGES[9])
def test_no_piece_of_a_password_with_a_line_break_survives(
    scheme: str, user: str, password: str, message: str
) -> None:
    """A raw line break in a userinfo password: the URL's userinfo runs across it to its
    ``@``, in any message; the rest of the message is kept."""
    # "app://x@h" is a URL of scheme "app" and user "x", whatever was meant: nothing to hide.
    assume(not (user and password.startswith("//")))
    tail = "@db.example:5432/app?sslmode=require"
    _check(message, f"{scheme}://{user}:{password}{tail}", f"{scheme}://{user}:{MASK}{tail}", password)
