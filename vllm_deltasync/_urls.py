"""URLs as they may be shown: the one place that strips secrets before a URL is printed.

* :func:`redact_url`: one URL without user, password, query or fragment (a label, a log line);
* :func:`redact_text`: any text (an exception message, a log line, a ``last_error``) with every
  URL in it redacted the same way, and ``key=value`` secrets of signed URLs masked;
* :func:`check_bucket_url`: a bucket URL carrying credentials (``s3://KEY:SECRET@bucket``) or a
  query string is refused in one line that names where credentials go instead, without
  echoing them;
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


def redact_url(url: str) -> str:
    """``url`` without user, password, query or fragment (safe for a label or a log line)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:
        return "<unparsable url>"
    if "@" in parts.netloc and not host:
        host = "<redacted>"
    path = parts.path
    if not parts.netloc and "@" in path.split("/", 1)[0]:  # "s3:KEY:SECRET@b" forms
        path = "<redacted>@" + path.split("@", 1)[1]
    return urlunsplit((parts.scheme, host, path, "", ""))


def _redact_match(match: re.Match[str]) -> str:
    scheme, rest = match.group(1), match.group(2)
    shown = redact_url(f"{scheme}://{rest}")
    return shown + ("?<redacted>" if "?" in rest or "#" in rest else "")


def redact_text(text: str) -> str:
    """``text`` with every ``scheme://...`` URL in it redacted (userinfo and query removed, a
    ``?<redacted>`` marker left) and secret-looking ``name=value`` pairs masked."""
    text = _URL_IN_TEXT.sub(_redact_match, text)
    return _SECRET_PARAM.sub(lambda m: f"{m.group(1)}=<redacted>", text)


def check_bucket_url(url: str) -> None:
    """Refuse a bucket URL with userinfo (``user:password@``) or a query string / fragment.

    The message shows the URL redacted and names the supported credential sources.
    """
    if not isinstance(url, str):
        raise ConfigError(f"bucket URL must be a string, got {type(url).__name__}")
    if "://" not in url:
        return
    scheme, rest = url.split("://", 1)
    authority = rest.split("/", 1)[0]
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
    "address_class",
    "check_bucket_url",
    "redact_text",
    "redact_url",
    "redirect_allowed",
]
