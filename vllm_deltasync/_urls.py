"""URLs as they may be shown: the one place that strips secrets before a URL is printed."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact_url(url: str) -> str:
    """``url`` without user, password, query or fragment (safe for a label or a log line)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:
        return "<unparsable url>"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


__all__ = ["redact_url"]
