"""URLs as they may be shown: the one place that decides whether a URL may carry a secret.

**The rule.** A URL may carry a credential, in any spelling, when an ``@`` follows its scheme
anywhere (the path of a ``file:///`` URL excepted: a local directory may have ``@`` in its
name). A parser alone does not see them all: by RFC 3986 an unencoded ``/`` ends the
authority, so ``s3://KEY:sec/ret@bucket/p`` parses as host ``KEY``, port ``sec`` and path
``/ret@bucket/p``, and a secret key with ``/`` in it (AWS secret keys are base64) would go
through. Such a URL is refused in one line that shows its scheme only
(:func:`credential_refusal`), and no part of it reaches a host name lookup.

* :func:`has_credentials`: the rule itself;
* :func:`check_bucket_url`: a bucket URL that carries credentials, a query string, or that is
  malformed (a known scheme without ``//``: ``s3:KEY:SECRET@b/p``; no bucket after ``://``)
  is refused without echoing it;
* :func:`check_http_url`: the same for an http(s) base URL (a mirror, an endpoint);
* :func:`redact_url`: one URL as it may be shown: everything up to its last ``@`` dropped,
  query and fragment removed (a label, a log line);
* :func:`redact_text`: any text (an exception message, a log line, a ``last_error``) with every
  URL in it redacted the same way, and ``key=value`` secrets of signed URLs masked;
* :func:`address_class` / :func:`redirect_allowed`: the redirect rule of the network stores
  (never from a public origin to a private, loopback or link-local address).
"""

from __future__ import annotations

import ipaddress
import re

from vllm_deltasync.errors import ConfigError

CREDENTIAL_SOURCES = (
    "put credentials in the environment (HF_TOKEN; AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / "
    "AWS_SESSION_TOKEN), the SDK's own chain (`hf auth login`; AWS profiles, instance roles) or "
    "store_options (the keys token, aws_access_key_id, ...), never in the URL"
)
"""Where credentials belong: named by every refusal of a URL that carries them."""

KNOWN_SCHEMES = ("file", "memory", "hf", "s3", "http", "https", "gs", "gcs", "az", "abfs", "r2")
"""Schemes a string is a URL of even without ``//`` (``s3:b/p`` is a malformed URL, never a
local directory named ``s3:b``); ``open_store`` adds the schemes registered with it."""

_NEEDS_AUTHORITY = frozenset(KNOWN_SCHEMES) - {"file", "memory"}
"""Schemes whose authority is the bucket (or host): ``s3:///...`` names none. ``file:///``
and other registered schemes (a local directory behind them) take an empty one."""

_SCHEME_PREFIX = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]{0,15}):")
_SECRET_PARAM = re.compile(
    r"(?i)\b(x-amz-[a-z-]*(?:token|signature|credential)|signature|sig|token|access_token|"
    r"password|passwd|secret|api_key|apikey|key-pair-id|policy)=([^\s&'\"]+)"
)


def _split(url: str) -> tuple[str, str, str] | None:
    """``(scheme, separator, rest)`` of ``scheme://rest`` (separator ``//``) or of a known
    scheme without ``//`` (``s3:K:S@b``: separator ``""``); None for anything else (a bare
    path, ``host:port``)."""
    if "://" in url:
        scheme, rest = url.split("://", 1)
        if _SCHEME_PREFIX.fullmatch(scheme + ":"):
            return scheme, "//", rest
    match = _SCHEME_PREFIX.match(url)
    if match is not None and match.group(1).lower() in KNOWN_SCHEMES:
        return match.group(1), "", url[match.end():]
    return None


def _local_path(scheme: str, sep: str, rest: str) -> bool:
    """``file:///...``: what follows ``//`` is an absolute local path, no authority."""
    return scheme.lower() == "file" and sep == "//" and rest.startswith("/")


def has_credentials(url: str) -> bool:
    """The rule: ``url`` may carry a credential when an ``@`` follows its scheme anywhere
    (authority, path, query), except in the path of a ``file:///`` URL. A string that is no
    URL (a bare path, ``host:port``) carries none unless it has an ``@`` and a ``:`` before
    it (``KEY:SECRET@host``)."""
    parts = _split(url)
    if parts is None:
        return "@" in url and ":" in url.split("@", 1)[0]
    return "@" in parts[2] and not _local_path(*parts)


def shown_scheme(url: str) -> str:
    """What a refusal of ``url`` may show of it: ``'s3://...'``, or ``'...'``."""
    parts = _split(url)
    return f"'{parts[0].lower()}://...'" if parts is not None else "'...'"


def credential_refusal(url: str, what: str, fix: str = CREDENTIAL_SOURCES) -> ConfigError:
    """The one-line refusal of ``url`` (``what``: the option or argument that held it), which
    carries credentials: shows the scheme only."""
    return ConfigError(
        f"{what} {shown_scheme(url)} may carry a credential (an '@' after the scheme; the URL "
        f"is not shown): refused; {fix}")


def strip_userinfo(url: str) -> str:
    """``url`` without what :func:`has_credentials` calls a credential position (from ``//``
    to the last ``@``); everything else, query included, kept as is (``same_bucket``)."""
    parts = _split(url)
    if parts is None or not has_credentials(url):
        return url
    scheme, sep, rest = parts
    return f"{scheme}:{sep}{rest.rsplit('@', 1)[1]}"


def redact_url(url: str) -> str:
    """``url`` as it may be shown: everything from the scheme's ``//`` (or ``:``) to its last
    ``@`` dropped (userinfo in any spelling), query and fragment removed. String rules only:
    nothing to parse, so nothing fails; a ``file:///`` path is kept whole."""
    url = str(url)
    parts = _split(url)
    if parts is None:
        return "<redacted>@" + url.rsplit("@", 1)[1] if "@" in url else url
    scheme, sep, rest = parts
    if "@" in rest and not _local_path(scheme, sep, rest):
        rest = rest.rsplit("@", 1)[1]
        if not sep:
            rest = "<redacted>@" + rest
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    return f"{scheme}:{sep}{rest}"


_TRAILING = ".,;:!?"
"""Punctuation that ends a sentence after a URL (``... at http://host:8080; check ...``):
left out of the URL before it is parsed, put back after it."""

_USERINFO_IN_TEXT = re.compile(
    r"\b([a-zA-Z][a-zA-Z0-9+.-]{0,15})://([^\s'\"<>]*)@"
    r"|\b(" + "|".join(KNOWN_SCHEMES) + r"):(?!//)([^\s'\"<>]*)@", re.I)
"""A URL's scheme and everything up to the last ``@`` of the same word (``s3://K:S/x@``,
``s3:K:S@``, ``s3:/K:S@``): the credential positions of :func:`has_credentials`."""

_URL_IN_TEXT = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]{0,15})://([^\s'\"<>()\[\]{},]*)")


def _drop_userinfo(match: re.Match[str]) -> str:
    if match.group(1) is not None:
        scheme, rest = match.group(1), match.group(2)
        if scheme.lower() == "file" and rest.startswith("/"):
            return match.group(0)  # a local path with '@' in it
        return f"{scheme}://"
    return f"{match.group(3)}:<redacted>@"


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
    """``text`` with every URL in it redacted: what :func:`has_credentials` calls a credential
    position dropped (up to the last ``@`` of the word), query strings replaced by a
    ``?<redacted>`` marker, and secret-looking ``name=value`` pairs masked."""
    text = _USERINFO_IN_TEXT.sub(_drop_userinfo, text)
    text = _URL_IN_TEXT.sub(_redact_match, text)
    return _SECRET_PARAM.sub(lambda m: f"{m.group(1)}=<redacted>", text)


def check_bucket_url(url: str, schemes: tuple[str, ...] | frozenset[str] = KNOWN_SCHEMES,
                     forms: dict[str, str] | None = None, what: str = "bucket URL") -> None:
    """Refuse a bucket URL that may carry credentials (:func:`has_credentials`), one with a
    query string or fragment, and a malformed one: a known scheme (``schemes``) followed by
    ``:`` but not ``://`` (``s3:KEY:SECRET@b/p``, ``s3:/b``, ``hf:buckets/...``), or a network
    scheme (``s3``, ``hf``, ...) with nothing between ``://`` and the next ``/``.

    A refusal shows the scheme only (what follows may be a pasted secret), names the
    supported credential sources when the URL carries an ``@``, and ``forms[scheme]`` (the
    URL form to use) when given. ``what`` names the option or argument in the message. A bare
    path (no scheme) is a local directory and passes.
    """
    if not isinstance(url, str):
        raise ConfigError(f"{what} must be a string, got {type(url).__name__}")
    match = _SCHEME_PREFIX.match(url)
    if match is not None and "://" not in url[: match.end() + 2]:
        scheme = match.group(1).lower()
        if scheme in schemes:
            raise ConfigError(_malformed(url, scheme, "has no '//' after the scheme", forms, what))
    if "://" not in url:
        return
    scheme, rest = url.split("://", 1)
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if not authority and scheme.lower() in _NEEDS_AUTHORITY:
        raise ConfigError(_malformed(url, scheme.lower(), "names no bucket after '://'", forms,
                                     what))
    if has_credentials(url):
        raise credential_refusal(url, what)
    if "?" in rest or "#" in rest:
        raise ConfigError(
            f"{what} {redact_url(url)}?<redacted>: a query string or fragment is refused "
            "(it is no part of a bucket address); " + CREDENTIAL_SOURCES
        )


def check_http_url(url: object, what: str) -> str:
    """``url`` as an http(s) base URL with a host (a mirror, an endpoint), else ConfigError
    naming ``what``: credentials (:func:`has_credentials`), a query string or fragment, another
    scheme, no host or a bad port are refused without echoing what may be a secret."""
    if not isinstance(url, str):
        raise ConfigError(f"{what} must be a string (an http(s) URL), got {type(url).__name__}")
    if has_credentials(url):
        raise credential_refusal(url, what, "the URL takes none")
    parts = _split(url)
    if parts is None or parts[1] != "//" or parts[0].lower() not in ("http", "https"):
        raise ConfigError(f"{what} {shown_scheme(url)} is not an http(s):// URL; use "
                          "https://host[:port][/path]")
    authority = re.split(r"[/?#]", parts[2], maxsplit=1)[0]
    host, port = authority, ""
    if ":" in authority and not authority.endswith("]"):  # host:port, [v6]:port
        host, _, port = authority.rpartition(":")
        port = port or "x"
    if not host or (":" in host and not host.startswith("[")) or (port and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536)):
        raise ConfigError(f"{what} {redact_url(url)!r} names no host or a bad port; use "
                          "https://host[:port][/path]")
    if "?" in parts[2] or "#" in parts[2]:
        raise ConfigError(f"{what} {redact_url(url)}?<redacted>: a query string or fragment is "
                          "refused (a base URL takes none)")
    return url


def _malformed(url: str, scheme: str, why: str, forms: dict[str, str] | None,
               what: str = "bucket URL") -> str:
    form = (forms or {}).get(scheme)
    message = f"{what} '{scheme}:...' is malformed: it {why}"
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
    "check_http_url",
    "credential_refusal",
    "has_credentials",
    "redact_text",
    "redact_url",
    "redirect_allowed",
    "shown_scheme",
    "strip_userinfo",
]
