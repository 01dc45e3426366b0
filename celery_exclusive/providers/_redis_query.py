"""A Redis URL's query parameters, checked and typed before redis-py reads them.

redis-py's URL parser (``redis.connection.parse_url``) converts the parameters it knows a
type for (numbers; truth values, where any text but ``0 f false n no off`` is true), keeps
the first of a repeated one, and passes every other one on as text to the connection
pool and connection, which may take it for an object (``cache_config=x``: an
AttributeError), read it as true (``decode_responses=false``), or fail only on the first
connection (``socket_timeout=-1``, ``client_name=a b``). :func:`checked_query` asks each
of those questions when the store is built, for every Redis URL form; its ValueError
names the parameter (the caller words it as a ConfigurationError, masked).
"""

from __future__ import annotations

import codecs
import math
import ssl
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, unquote_plus, urlsplit

#: Parameters that take a Python object, by what it is: a URL carries text only.
_CACHE = "redis-py's client-side caching cannot be turned on from a URL"
OBJECTS = {
    "cache": f"a cache; {_CACHE}",
    "cache_config": f"a CacheConfig; {_CACHE}",
    "cache_factory": f"a cache factory; {_CACHE}",
    "connection_class": "a connection class; the scheme chooses it: redis://, rediss://, unix://",
    "parser_class": "a reply parser class",
    "retry": "a Retry; the store makes no automatic retries, it retries where that is safe itself",
    "credential_provider": "a credential provider",
    "redis_connect_func": "a callback",
    "command_packer": "a command packer",
    "event_dispatcher": "an event dispatcher",
    "driver_info": "a DriverInfo",
    "maint_notifications_config": "a MaintNotificationsConfig",
    "maint_notifications_pool_handler": "a handler",
    "oss_cluster_maint_notifications_handler": "a handler",
    "metadata_resolver": "a MetadataResolver",
    "himport_registry": "an HImportRegistry",
    "socket_keepalive_options": "a dict of TCP options",
    "socket_type": "a socket type constant",
    "ssl_ocsp_context": "an OpenSSL context",
}

_FALSE = ("0", "f", "false", "n", "no", "off")  # redis-py's FALSE_STRINGS
_TRUE = ("1", "t", "true", "y", "yes", "on")
#: Truth values; redis-py reads any text but a false one as true, ``decode_responses``
#: (which it passes on as text) any text at all.
TRUTHS = (
    "decode_responses",
    "legacy_responses",
    "retry_on_timeout",
    "socket_keepalive",
    "ssl_check_hostname",
    "ssl_validate_ocsp",
    "ssl_validate_ocsp_stapled",
)
#: The truth values redis-py passes on as text: passed on typed here.
_RAW_TRUTHS = ("decode_responses",)
_TLS_VERSIONS = ", ".join(f"{v.value} ({v.name})" for v in ssl.TLSVersion)


def _seconds(text: str) -> object:
    value = float(text)
    return value if math.isfinite(value) and value > 0 else None


def _whole(low: int) -> Callable[[str], object]:
    def read(text: str) -> object:
        value = int(text)
        return value if value >= low else None

    return read


def _tls_version(text: str) -> object:
    return ssl.TLSVersion(int(text))


def _client_name(text: str) -> object:
    # Redis refuses a name with a space, a line break or any byte outside "!".."~".
    return text if all("!" <= c <= "~" for c in text) else None


def _encoding(text: str) -> object:
    return codecs.lookup(text)


def _error_handler(text: str) -> object:
    return codecs.lookup_error(text)


#: What each parameter must be, and how it is read (None or an error: it is not).
_VALUES: dict[str, tuple[str, Callable[[str], object]]] = {
    "db": ("must be a database number (0 or more)", _whole(0)),
    "socket_timeout": ("must be seconds above 0 (finite)", _seconds),
    "socket_connect_timeout": ("must be seconds above 0 (finite)", _seconds),
    "health_check_interval": ("must be whole seconds, 0 or more (0: no checks)", _whole(0)),
    "max_connections": ("must be a whole number, 1 or more (redis-py reads 0 as 100)", _whole(1)),
    "socket_read_size": ("must be a whole number of bytes, 1 or more", _whole(1)),
    "ssl_min_version": (f"must be one of Python's ssl.TLSVersion values: {_TLS_VERSIONS}", _tls_version),
    "client_name": ("must be printable ASCII without spaces (Redis refuses others)", _client_name),
    "encoding": ("must be a codec Python knows", _encoding),
    "encoding_errors": ("must be a codec error handler Python knows", _error_handler),
}


def checked_query(url: str) -> dict[str, Any]:
    """The typed values of ``url``'s query parameters that redis-py would pass on as
    text (``decode_responses``), after checking every one this module knows; ValueError
    naming the first that is bad, given twice, or one that takes an object."""
    pairs = parse_qsl(urlsplit(url).query)  # as redis-py reads it: blank values dropped
    for name, count in Counter(name for name, _ in pairs).items():
        if count > 1:
            raise ValueError(f"URL option {name!r} is given twice; give it once")
    typed: dict[str, Any] = {}
    for name, value in pairs:
        if name in OBJECTS:
            raise ValueError(
                f"URL option {name!r} takes a Python object, which a URL cannot carry ({OBJECTS[name]})"
            )
        if name in TRUTHS:
            if value.lower() not in (*_FALSE, *_TRUE):
                raise ValueError(
                    f"URL option {name!r} must be true or false ({'/'.join(_TRUE)}; "
                    f"{'/'.join(_FALSE)}), got {value!r}"
                )
            if name in _RAW_TRUTHS:
                typed[name] = value.lower() in _TRUE
        elif name in _VALUES:
            rule, read = _VALUES[name]
            try:
                good = read(value) is not None
            except (ValueError, LookupError, OverflowError):
                good = False
            if not good:
                raise ValueError(f"URL option {name!r} {rule}, got {value!r}")
    return typed


def without(url: str, names: Any) -> str:
    """``url`` without its query parameters named in ``names``; the rest as written."""
    head, sep, rest = url.partition("?")
    query, hash_, fragment = rest.partition("#")
    kept = [part for part in query.split("&") if unquote_plus(part.partition("=")[0]) not in names]
    kept = [part for part in kept if part]
    return f"{head}{sep if kept else ''}{'&'.join(kept)}{hash_}{fragment}"
