"""HTTP helpers of the Hugging Face bucket API: errors into the project's tree, the SSE parser."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp

from ..errors import (
    AlreadyExistsError,
    AuthError,
    NotFoundError,
    RateLimitedError,
    StoreError,
    TransientStoreError,
)
from ._retry import parse_retry_after

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


def error_for_response(status: int, headers: Mapping[str, str], what: str) -> StoreError:
    """Translate an error answer; ``X-Error-Code`` refines the message."""
    code = headers.get("X-Error-Code", "")
    detail = _NOT_FOUND_HINT.get(code, headers.get("X-Error-Message", ""))
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
        return StoreError(f"{what}: invalid URL ({exc})")
    return TransientStoreError(f"{what}: connection failed ({type(exc).__name__}: {exc})")


async def parse_sse(stream: aiohttp.StreamReader) -> AsyncIterator[tuple[str, str, str | None]]:
    """Server-sent events as ``(event, data, id)``; ``id`` is the last one seen (the cursor)."""
    kind, event_id = "message", None
    data: list[str] = []
    async for raw in stream:
        line = raw.decode("utf-8").rstrip("\r\n")
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


__all__ = ["connection_error", "error_for_response", "hub_error", "parse_sse"]
