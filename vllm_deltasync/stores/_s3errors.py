"""botocore / aiohttp failures of the S3 client translated into the project's error tree."""

from __future__ import annotations

import asyncio

from vllm_deltasync.errors import (
    AlreadyExistsError,
    AuthError,
    NotFoundError,
    RateLimitedError,
    StoreError,
    TransientStoreError,
)

_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_AUTH = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "403",
    "401",
}
_EXISTS = {"PreconditionFailed", "ConditionalRequestConflict", "412"}
_THROTTLE = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestLimitExceeded",
    "429",
}


def s3_error(exc: BaseException, what: str) -> StoreError:
    """The most specific class for a client exception (a ``StoreError`` is passed through)."""
    if isinstance(exc, StoreError):
        return exc
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return _client_error(response, what)
    name = type(exc).__name__
    if name in {"NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError"}:
        return AuthError(
            f"{what}: no AWS credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or pass store options"
        )
    if isinstance(exc, (asyncio.TimeoutError, ConnectionError, OSError)) or _is_network(exc):
        return TransientStoreError(f"{what}: connection failed ({name}: {exc})")
    return StoreError(f"{what}: {name}: {exc}")


def _client_error(response: dict, what: str) -> StoreError:
    error = response.get("Error", {})
    code = str(error.get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    message = f"{what}: {code or 'HTTP ' + str(status)} ({error.get('Message', '')})"
    if code in _NOT_FOUND or status == 404:
        return NotFoundError(message)
    if code in _AUTH or status in (401, 403):
        return AuthError(message + "; check the AWS credentials chain or store options")
    if code in _EXISTS or status == 412:
        return AlreadyExistsError(message + "; bucket names are immutable")
    if code in _THROTTLE or status == 429:
        after = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("retry-after")
        return RateLimitedError(message, float(after) if after and after.isdigit() else None)
    if status >= 500 or code in {"InternalError", "ServiceUnavailable", "RequestTimeout"}:
        if code == "NotImplemented":
            return StoreError(message)
        return TransientStoreError(message)
    return StoreError(message)


def _is_network(exc: BaseException) -> bool:
    """botocore's connection errors and aiohttp's payload errors, matched by name (no import)."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(
        names
        & {
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "ResponseStreamingError",
            "IncompleteReadError",
            "ClientPayloadError",
            "ServerDisconnectedError",
            "ClientConnectionError",
            "HTTPClientError",
        }
    )


__all__ = ["s3_error"]
