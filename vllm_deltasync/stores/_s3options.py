"""``S3Options``: how an ``s3://`` store reaches its bucket (one frozen object, every field also a
``store_options`` key), and ``parse_s3_url``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_deltasync._urls import redact_url
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.stores import _options
from vllm_deltasync.stores._retry import RetryPolicy

_ADDRESSING_STYLES = (None, "auto", "path", "virtual")
_CREDENTIALS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``."""
    rest = url.split("://", 1)[1] if "://" in url else url
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ConfigError(f"bucket URL {redact_url(url)!r}: expected s3://<bucket>[/<prefix>]")
    return bucket, prefix.strip("/")


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """How an :class:`S3Store` reaches its bucket. Every field is also a ``store_options`` key.

    Unset connection fields (None) come from the AWS chain. Credentials are kept out of
    ``repr``. ``retry_policy`` also accepts None (the defaults) or a mapping of
    :class:`RetryPolicy` fields, and is always a :class:`RetryPolicy` afterwards.
    """

    endpoint_url: str | None = None
    """R2, MinIO, GCS interop, the Hub gateway; None: AWS chain (``AWS_ENDPOINT_URL``...)."""
    region_name: str | None = None
    addressing_style: str | None = None
    """``path`` (Hub gateway, MinIO, most self-hosted servers), ``virtual`` or ``auto`` (None)."""
    aws_access_key_id: str | None = field(default=None, repr=False)
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_session_token: str | None = field(default=None, repr=False)
    profile: str | None = None
    """A profile of the shared AWS config files."""
    conditional_writes: bool = True
    """Refuse overwrites with ``If-None-Match: *``; False: HEAD then PUT."""
    multipart_threshold: int = 64 << 20
    """Objects of at least this many bytes are written as one multipart upload."""
    part_size: int = 16 << 20
    """Bytes per multipart part and per parallel ranged read (S3 needs >= 5 MiB)."""
    max_parallel_parts: int = 8
    max_pool_connections: int = 32
    stale_upload_s: float = 3600.0
    """Multipart uploads under the prefix started longer ago than this are a killed writer's:
    the store's first write aborts them (their parts cost storage until then)."""
    min_bytes_per_s: int | None = 64 << 10
    """A ranged read slower than this over ``rate_window_s`` is cut and the rest retried."""
    rate_window_s: float = 30.0
    max_request_s: float | None = 900.0
    """Cap on one ranged read of a part, however fast."""
    retry_policy: RetryPolicy = field(default_factory=RetryPolicy)
    """botocore's own retries are off; this policy applies."""

    def __post_init__(self) -> None:
        owner = "S3Options"
        for name in ("endpoint_url", "region_name", "profile"):
            _options.check_optional_str(owner, name, getattr(self, name))
        _options.check_endpoint(owner, "endpoint_url", self.endpoint_url)
        for name in _CREDENTIALS:
            _options.check_optional_str(owner, name, getattr(self, name), secret=True)
        if self.addressing_style not in _ADDRESSING_STYLES:
            raise ConfigError(
                f"{owner}.addressing_style={self.addressing_style!r}: use 'path' (Hub gateway, "
                "MinIO, most self-hosted servers), 'virtual' or 'auto'"
            )
        _options.check_bool(owner, "conditional_writes", self.conditional_writes)
        if (isinstance(self.stale_upload_s, bool) or not isinstance(self.stale_upload_s, int | float)
                or not self.stale_upload_s >= 0):
            raise ConfigError(f"{owner}.stale_upload_s={self.stale_upload_s!r}: use seconds >= 0 "
                              "(how old an unfinished multipart upload must be to be aborted)")
        _options.check_int(owner, "part_size", self.part_size, 5 << 20, " bytes (S3 parts are at least 5 MiB)")
        _options.check_int(owner, "multipart_threshold", self.multipart_threshold, 5 << 20, " bytes")
        if self.multipart_threshold < self.part_size:
            raise ConfigError(
                f"{owner}.multipart_threshold={self.multipart_threshold} is below "
                f"part_size={self.part_size}: raise multipart_threshold to at least part_size"
            )
        _options.check_int(owner, "max_parallel_parts", self.max_parallel_parts, 1)
        _options.check_int(owner, "max_pool_connections", self.max_pool_connections, 1)
        _options.check_rate(owner, self.min_bytes_per_s, self.rate_window_s, self.max_request_s)
        object.__setattr__(self, "retry_policy", _options.retry_policy(owner, self.retry_policy))

    def credentials(self) -> dict[str, str]:
        """The explicit credentials that are set, as botocore's ``create_client`` keywords."""
        return {k: v for k in _CREDENTIALS if (v := getattr(self, k))}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every option name (the ``store_options`` keys of ``s3://``, ``options`` aside)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_store_options(
        cls, store_options: Mapping[str, Any], base: S3Options | None = None
    ) -> S3Options:
        """Options from ``store_options`` keys over ``options=`` if given, else over ``base``
        (the defaults when None).

        Unknown keys raise a :class:`ConfigError` that lists the accepted ones.
        """
        _options.check_keys("s3", store_options, (*cls.keys(), "options"))
        given = dict(store_options)
        found = given.pop("options", None)
        if found is not None and not isinstance(found, S3Options):
            raise ConfigError(
                f"options={type(found).__name__}: use an S3Options, or pass its fields as keys"
            )
        start = found if found is not None else base
        return cls(**given) if start is None else dataclasses.replace(start, **given)


__all__ = ["S3Options", "parse_s3_url"]
