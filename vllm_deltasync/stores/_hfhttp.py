"""Helpers of the hf:// store: URL and token, errors into the project's tree, the events feed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from vllm_deltasync._urls import redact_text, redact_url
from vllm_deltasync.errors import (
    AlreadyExistsError,
    AuthError,
    ConfigError,
    NotFoundError,
    RateLimitedError,
    StoreError,
    TransientStoreError,
)
from vllm_deltasync.stores._retry import parse_retry_after

_NOT_FOUND_HINT = {
    "RepoNotFound": "the bucket does not exist or the token cannot see it; check the URL and HF_TOKEN",
    "EntryNotFound": "no such object in the bucket",
}


def hub_error(status: int, message: str, retry_after_s: float | None = None) -> StoreError:
    """The error class for an HTTP status (0 = unknown)."""
    if status in (401, 403):
        return AuthError(f"{message}; set HF_TOKEN (or `hf auth login`) to a token with access")
    if status == 404:
        return NotFoundError(message)
    if status in (409, 412):
        return AlreadyExistsError(message)
    if status == 429:
        return RateLimitedError(message, retry_after_s)
    if status == 501:  # not implemented: retrying will not help (e.g. no events feed)
        return StoreError(message)
    if status == 408 or status >= 500:
        return TransientStoreError(message)
    return StoreError(message)


def error_for_response(
    status: int, headers: Mapping[str, str], what: str, secret: str | None = None
) -> StoreError:
    """Translate an error answer; ``X-Error-Code`` refines the message. What the server says
    is cut to 200 characters, its URLs redacted and ``secret`` (the token) masked: a hostile
    server may echo what it was sent."""
    code = headers.get("X-Error-Code", "")[:64]
    detail = _NOT_FOUND_HINT.get(code, headers.get("X-Error-Message", ""))
    if secret:
        detail, code = detail.replace(secret, "<redacted>"), code.replace(secret, "<redacted>")
    detail = redact_text(" ".join(detail.split())[:200])
    message = (
        f"{what}: HTTP {status}" + (f" {code}" if code else "") + (f" ({detail})" if detail else "")
    )
    if status == 429:
        wait = parse_retry_after(headers)
        message += f"; rate limited, retry in {wait:.0f}s" if wait is not None else "; rate limited"
        return hub_error(status, message, wait)
    return hub_error(status, message)


def connection_error(exc: aiohttp.ClientError, what: str) -> StoreError:
    """A network-level failure: transient unless it is a bad URL."""
    if isinstance(exc, aiohttp.InvalidURL):
        return StoreError(f"{what}: invalid URL ({redact_text(str(exc))})")
    return TransientStoreError(
        f"{what}: connection failed ({type(exc).__name__}: {redact_text(str(exc))})"
    )


async def parse_sse(stream: aiohttp.StreamReader) -> AsyncIterator[tuple[str, str, str | None]]:
    """Server-sent events as ``(event, data, id)``; ``id`` is the last one seen (the cursor)."""
    kind, event_id = "message", None
    data: list[str] = []
    async for raw in stream:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data or kind != "message":
                yield kind, "\n".join(data), event_id
            kind, data = "message", []
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            kind = value
        elif field == "data":
            data.append(value)
        elif field == "id":
            event_id = value


@dataclass(frozen=True)
class ChangeEvent:
    """One event of the bucket feed: ``changes`` (paths added/updated/deleted), ``reset``
    (state unknown: list again), ``ready`` (connected)."""

    kind: str
    paths: tuple[str, ...] = ()
    cursor: str | None = None


def parse_hf_url(url: str) -> tuple[str, str]:
    """``hf://buckets/ns/name/a/b`` -> ``("ns/name", "a/b")``."""
    rest = url.split("://", 1)[1] if "://" in url else url
    parts = [p for p in rest.split("/") if p]
    if len(parts) < 3 or parts[0] != "buckets":
        raise ConfigError(
            f"bucket URL {redact_url(url)!r}: expected hf://buckets/<namespace>/<name>[/<prefix>]"
        )
    return f"{parts[1]}/{parts[2]}", "/".join(parts[3:])


def resolve_token(explicit: str | bool | None, environ: Mapping[str, str]) -> str | None:
    """``token=`` option, else ``HF_TOKEN``, else huggingface_hub's own chain; ``False``: none."""
    if explicit is False:
        return None
    if isinstance(explicit, str):
        return explicit
    if environ.get("HF_TOKEN"):
        return environ["HF_TOKEN"]
    try:
        from huggingface_hub import get_token
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return None
    return get_token()


def change_event(kind: str, data: str, cursor: str | None, prefix: str) -> ChangeEvent:
    """A feed event with paths made relative to ``prefix`` (others and deletions dropped).

    A ``changes`` event that is not the documented JSON becomes ``ChangeEvent("malformed")``:
    one bad event never stops the feed (discovery counts it and lists again)."""
    if kind != "changes":
        return ChangeEvent(kind, (), cursor)
    try:
        decoded = json.loads(data) if data else []
        items = decoded.get("changes", [decoded]) if isinstance(decoded, dict) else decoded
        root = f"{prefix}/" if prefix else ""
        paths = tuple(
            i["path"][len(root) :]
            for i in items
            if i.get("op") != "delete" and i["path"].startswith(root)
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return ChangeEvent("malformed", (), cursor)
    return ChangeEvent(kind, paths, cursor)


def json_list(body: bytes, what: str) -> list[dict[str, Any]]:
    """A JSON array of objects from the bucket API, or a :class:`StoreError` (an HTML page, a
    captive portal, garbage) that says so in one line."""
    try:
        items = json.loads(body)
    except (ValueError, RecursionError):
        raise StoreError(f"{what}: the answer is not the bucket API's JSON (an HTML page or a "
                         "proxy in the way?); check the endpoint") from None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise StoreError(f"{what}: the answer is JSON but not a list of entries; check the endpoint")
    return items


def checked_size(value: Any, path: str) -> int:
    """An object size from a header or a listing, checked (a bad one is a StoreError)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 53:
        return value
    if isinstance(value, str) and value.isdigit() and len(value) <= 16:
        return int(value)
    raise StoreError(f"{path[:200]}: the server gave a bad size {str(value)[:40]!r}")


__all__ = [
    "checked_size",
    "json_list",
    "ChangeEvent",
    "change_event",
    "parse_hf_url",
    "resolve_token",
    "connection_error",
    "error_for_response",
    "hub_error",
    "parse_sse",
]
