"""The one exception tree of vllm-deltasync.

::

    DeltaSyncError
    ├── ConfigError                 bad option, URL or environment variable
    ├── StoreError                  a bucket operation failed (the only retried family)
    │   ├── NotFoundError           the path (or bucket) does not exist
    │   ├── AlreadyExistsError      write refused: names in a bucket are immutable
    │   ├── AuthError               credentials missing or refused (401/403)
    │   └── TransientStoreError     worth retrying: 5xx, dropped connection, timeout
    │       └── RateLimitedError    429; ``retry_after_s`` says when to come back
    ├── FormatError                 a manifest or data file is not what the format says
    │   ├── UnsupportedFormatError  a format or codec version this release does not read
    │   ├── IntegrityError          size or sha256 of a data file does not match its manifest
    │   ├── FingerprintError        the bucket was written for another parameter set
    │   └── ChainError              a delta's base is missing, or not the step it applies on
    ├── PublishError                the trainer side was used wrongly (step order, names, shapes)
    └── ApplyError                  the engine cannot take a step (unplaceable name, dtype, shape)

Foreign errors (aiohttp, botocore, huggingface_hub, safetensors) are translated at the
boundary with ``raise ... from exc`` into the most specific class here. Messages name the
object and the fix.
"""

from __future__ import annotations


class DeltaSyncError(Exception):
    """Base class of every error raised on purpose by vllm-deltasync."""


class ConfigError(DeltaSyncError, ValueError):
    """An option, URL or environment variable is invalid."""


class StoreError(DeltaSyncError):
    """A bucket operation failed."""


class NotFoundError(StoreError, FileNotFoundError):
    """The path or bucket does not exist."""


class AlreadyExistsError(StoreError, FileExistsError):
    """A write would overwrite an existing path; bucket names are immutable."""


class AuthError(StoreError, PermissionError):
    """Credentials are missing or were refused."""


class TransientStoreError(StoreError):
    """A failure worth retrying (server error, dropped connection, timeout)."""


class RateLimitedError(TransientStoreError):
    """The server answered 429. ``retry_after_s`` is how long to wait before the next request."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FormatError(DeltaSyncError, ValueError):
    """A manifest or data file does not follow the bucket format."""


class UnsupportedFormatError(FormatError):
    """A manifest of a format version or codec version this reader does not read: the reader
    must be upgraded (never skipped as garbage: a server says it cannot follow)."""


class IntegrityError(FormatError):
    """A data file's size or sha256 differs from what its manifest records."""


class FingerprintError(FormatError):
    """The bucket's parameter set (names, shapes, dtypes) is not the one expected."""


class ChainError(FormatError):
    """A delta cannot be applied: its base step is missing or is not the applied step."""


class PublishError(DeltaSyncError, ValueError):
    """The publisher was called wrongly (non-increasing step, changed names/shapes/dtypes)."""


class ApplyError(DeltaSyncError):
    """The engine cannot apply a step (a name it cannot place, a wrong shape or dtype)."""


__all__ = [
    "AlreadyExistsError",
    "ApplyError",
    "AuthError",
    "ChainError",
    "ConfigError",
    "DeltaSyncError",
    "FingerprintError",
    "FormatError",
    "IntegrityError",
    "NotFoundError",
    "PublishError",
    "RateLimitedError",
    "UnsupportedFormatError",
    "StoreError",
    "TransientStoreError",
]
