"""URLs as they may be shown: the one place that strips secrets before a URL is printed.

* :func:`redact_url`: one URL without user, password, query or fragment (a label, a log line);
* :func:`redact_text`: any text (an exception message, a log line, a ``last_error``) with every
  URL in it redacted the same way, and ``key=value`` secrets of signed URLs masked;
* :func:`strip_userinfo`: a URL without its ``user:password@`` part (and nothing else changed),
  what a client may connect to without putting the secret into a host name lookup;
* :func:`check_bucket_url`: a bucket URL carrying credentials (``s3://KEY:SECRET@bucket``) or a
  query string is refused in one line that names where credentials go instead, without
  echoing them; so is a known scheme without ``//`` (``s3:KEY:SECRET@b/p``, ``hf:buckets/...``)
  or with no authority (``s3:///...``): malformed, never taken for a local path;
* :func:`address_class` / :func:`redirect_allowed`: the redirect rule of the network stores
  (never from a public origin to a private, loopback or link-local address).
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit, urlunsplit

from vllm_deltasync.errors import ConfigError

CREDENTIAL_SOURCES = (
    "put credentials in the environment (HF_TOKEN; AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
    "AWS_SESSION_TOKEN), the SDK's own chain (`hf auth login`; AWS profiles, instance roles) or "
    "store_options (the keys token, aws_access_key_id, ...), never in the URL"
)
"""Where credentials belong: named by every refusal of a URL that carries them."""

_URL_IN_TEXT = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]{0,15})://([^\s'\"<>()\[\]{},]*)")
_SECRET_PARAM = re.compile(
    r"(?i)\b(x-amz-[a-z-]*(?:token|signature|credential)|signature|sig|token|access_token|"
    r"password|passwd|secret|api_key|apikey|key-pair-id|policy)=([^\s&'\"]+)"
)


def strip_userinfo(url: str) -> str:
    """``url`` without the ``user:password@`` of its authority; everything else kept as is.

    String-level (no parsing that can fail): the authority runs from ``://`` to the first
    ``/``, ``?`` or ``#``, and only its part after the last ``@`` is kept."""
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    return f"{scheme}://{authority.rsplit('@', 1)[-1]}{tail}"


def redact_url(url: str) -> str:
    """``url`` without user, password, query or fragment (safe for a label or a log line).

    A URL whose authority does not parse (``http://host:port;``, a bad IPv6 literal) is cut
    by string rules instead, so it is still shown, its secrets removed."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:
        return _redact_by_string(url)
    if "@" in parts.netloc and not host:
        host = "<redacted>"
    path = parts.path
    if not parts.netloc:  # "s3:KEY:SECRET@b", "s3:/KEY:SECRET@b", "s3:///KEY:SECRET@b" forms
        body = path.lstrip("/")
        if "@" in body.split("/", 1)[0]:
            path = path[: len(path) - len(body)] + "<redacted>@" + body.split("@", 1)[1]
    return urlunsplit((parts.scheme, host, path, "", ""))


def _redact_by_string(url: str) -> str:
    head = re.split(r"[?#]", url, maxsplit=1)[0]
    if "://" not in head:
        return "<unparsable url>"
    scheme, rest = strip_userinfo(head).split("://", 1)
    return f"{scheme}://{rest}"


_TRAILING = ".,;:!?"
"""Punctuation that ends a sentence after a URL (``... at http://host:8080; check ...``):
left out of the URL before it is parsed, put back after it."""


def _redact_match(match: re.Match[str]) -> str:
    scheme, rest = match.group(1), match.group(2)
    bare = rest.rstrip(_TRAILING)
    trail = rest[len(bare):]
    if not bare:  # "s3://<bucket>" in a hint: a scheme alone, nothing to redact
        return match.group(0)
    if "?" in bare and not bare.split("?", 1)[1]:  # "...?" ended a sentence
        bare, trail = bare[:-1], "?" + trail
    shown = redact_url(f"{scheme}://{bare}")
    return shown + ("?<redacted>" if "?" in bare or "#" in bare else "") + trail


def redact_text(text: str) -> str:
    """``text`` with every ``scheme://...`` URL in it redacted (userinfo and query removed, a
    ``?<redacted>`` marker left), the userinfo of a known scheme without ``//``
    (``s3:KEY:SECRET@b``) masked, and secret-looking ``name=value`` pairs masked."""
    text = _URL_IN_TEXT.sub(_redact_match, text)
    text = _SCHEMELESS_USERINFO.sub(lambda m: f"{m.group(1)}:{m.group(2)}<redacted>@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m.group(1)}=<redacted>", text)


KNOWN_SCHEMES = ("file", "memory", "hf", "s3", "http", "https", "gs", "gcs", "az", "abfs", "r2")
"""Schemes a string is a URL of even without ``//`` (``s3:b/p`` is a malformed URL, never a
local directory named ``s3:b``); ``open_store`` adds the schemes registered with it."""

_NEEDS_AUTHORITY = frozenset(KNOWN_SCHEMES) - {"file", "memory"}
"""Schemes whose authority is the bucket (or host): ``s3:///...`` names none. ``file:///``
and other registered schemes (a local directory behind them) take an empty one."""

_SCHEME_PREFIX = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]{0,15}):")
_SCHEMELESS_USERINFO = re.compile(
    r"(?i)\b(" + "|".join(KNOWN_SCHEMES) + r"):(/?)[^\s'\"<>()\[\]{},@/]+@")
"""``s3:KEY:SECRET@b``, ``s3:/KEY:SECRET@b``: a known scheme without ``//`` and a userinfo."""


def check_bucket_url(url: str, schemes: tuple[str, ...] | frozenset[str] = KNOWN_SCHEMES,
                     forms: dict[str, str] | None = None) -> None:
    """Refuse a bucket URL with userinfo (``user:password@``) or a query string / fragment,
    and a malformed one: a known scheme (``schemes``) followed by ``:`` but not ``://``
    (``s3:KEY:SECRET@b/p``, ``s3:/b``, ``hf:buckets/...``), or a network scheme (``s3``,
    ``hf``, ...) with nothing between ``://`` and the next ``/`` (``s3:///KEY:SECRET@b/p``).

    The message shows the URL redacted (a malformed one only by its scheme: what follows may
    be a pasted secret), names the supported credential sources when the URL carries an
    ``@``, and ``forms[scheme]`` (the URL form to use) when given.
    """
    if not isinstance(url, str):
        raise ConfigError(f"bucket URL must be a string, got {type(url).__name__}")
    match = _SCHEME_PREFIX.match(url)
    if match is not None and "://" not in url[: match.end() + 2]:
        scheme = match.group(1).lower()
        if scheme in schemes:
            raise ConfigError(_malformed(url, scheme, "has no '//' after the scheme", forms))
    if "://" not in url:
        return
    scheme, rest = url.split("://", 1)
    authority = rest.split("/", 1)[0]
    if not authority and scheme.lower() in _NEEDS_AUTHORITY:
        raise ConfigError(_malformed(url, scheme.lower(), "names no bucket after '://'", forms))
    if "@" in authority:
        raise ConfigError(
            f"bucket URL {redact_url(url)!r}: credentials in the URL are refused; "
            + CREDENTIAL_SOURCES
        )
    if "?" in rest or "#" in rest:
        raise ConfigError(
            f"bucket URL {redact_url(url)}?<redacted>: a query string or fragment is refused "
            "(it is no part of a bucket address); " + CREDENTIAL_SOURCES
        )


def _malformed(url: str, scheme: str, why: str, forms: dict[str, str] | None) -> str:
    form = (forms or {}).get(scheme)
    message = f"bucket URL '{scheme}:...' is malformed: it {why}"
    if form:
        message += f"; use {form}"
    if "@" in url:
        message += "; " + CREDENTIAL_SOURCES
    return message + " (the URL is not shown: it may hold a secret)"


# -- the redirect rule ---------------------------------------------------------------------------

ADDRESS_CLASSES = ("public", "private", "loopback", "link-local")


def address_class(host: str) -> str | None:
    """``public``, ``private``, ``loopback`` or ``link-local`` for an IP address literal;
    ``loopback`` for ``localhost``; None for any other host name (resolve it first)."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return "loopback"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_private or ip.is_reserved or ip.is_unspecified or ip.is_multicast:
        return "private"
    return "public"


def redirect_allowed(origin_class: str, target_class: str, allow: frozenset[str] | tuple[str, ...] = ()) -> bool:
    """The redirect rule: a public target is always allowed, a target of the origin's own class
    too (local test servers, on-premises object stores); any other class only when ``allow``
    names it (``HfOptions.allow_redirects_to``)."""
    return target_class == "public" or target_class == origin_class or target_class in allow


__all__ = [
    "ADDRESS_CLASSES",
    "CREDENTIAL_SOURCES",
    "KNOWN_SCHEMES",
    "address_class",
    "check_bucket_url",
    "redact_text",
    "redact_url",
    "redirect_allowed",
    "strip_userinfo",
]
