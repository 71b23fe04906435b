"""S3 and S3-compatible buckets (AWS, R2, GCS interop, MinIO, the Hub's S3 gateway): ``s3://bucket/prefix``.

Built on aiobotocore. Options are one :class:`S3Options` (``S3Store(bucket, prefix, options)``)
or, the same names, keyword arguments of ``open_store(url, **store_options)``; they mirror
botocore's: ``endpoint_url``, ``region_name``, ``addressing_style`` (``"path"`` for the Hub
gateway and most self-hosted servers), ``aws_access_key_id`` / ``aws_secret_access_key`` /
``aws_session_token``, ``profile``. Anything not given comes from the standard AWS chain and
environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_PROFILE``, shared config, instance
roles), read by botocore itself. Checksums are computed and validated only when required (the
Hub gateway and several S3-compatible servers reject the newer default checksum headers);
listing is ListObjectsV2 only.

Writes are atomic by nature: one PUT (multipart above ``multipart_threshold``, completed in one
call). Overwrites are refused with a conditional PUT (``If-None-Match: *``) where the server
supports it; ``conditional_writes=False`` (or a server answering 501 to it) falls back to HEAD
then PUT, which leaves a race between two writers of the same name (the format never writes a
name twice: each publish attempt has a random token).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from vllm_deltasync._urls import redact_url
from vllm_deltasync.errors import (
    AlreadyExistsError,
    ConfigError,
    DeltaSyncError,
    NotFoundError,
    StoreError,
)
from vllm_deltasync.stores import _options
from vllm_deltasync.stores._parts import (
    Chunks,
    RangedReader,
    check_max_bytes,
    parse_content_range,
    range_header,
)
from vllm_deltasync.stores._retry import RetryPolicy, retry
from vllm_deltasync.stores._s3errors import s3_error
from vllm_deltasync.stores._s3options import S3Options, parse_s3_url
from vllm_deltasync.stores.base import ObjectInfo, Store, check_path

logger = logging.getLogger(__name__)


class S3Store(Store):
    """A prefix inside one S3 bucket."""

    scheme = "s3"

    def __init__(self, bucket: str, prefix: str = "", options: S3Options | None = None) -> None:
        super().__init__()
        if options is not None and not isinstance(options, S3Options):
            raise ConfigError(
                f"s3 store {bucket!r}: options={type(options).__name__}; use S3Options(...) "
                "(or open_store(url, **store_options) for keyword options)"
            )
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.options = options if options is not None else S3Options()
        self.conditional_writes = self.options.conditional_writes
        """False once the server answered 501 to a conditional PUT (then: HEAD then PUT)."""
        self._client: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._lock = asyncio.Lock()
        self._swept = False

    @classmethod
    def from_url(cls, url: str, **store_options: Any) -> S3Store:
        """``open_store("s3://...", **store_options)``: keys are :class:`S3Options` fields (or
        ``options=S3Options(...)``, which the other keys override)."""
        bucket, prefix = parse_s3_url(url)
        try:
            options = S3Options.from_store_options(store_options)
        except ConfigError as exc:
            raise _options.with_prefix(f"s3 store {redact_url(url)}", exc) from None
        return cls(bucket, prefix, options)

    @classmethod
    def hub_gateway(cls, namespace: str, bucket: str, prefix: str = "", **store_options: Any) -> S3Store:
        """The Hub's S3 gateway for bucket ``namespace/bucket`` (credentials: an HF token pair).

        ``store_options`` as for :meth:`from_url`; what they set overrides the gateway's
        ``endpoint_url``, ``region_name`` and ``addressing_style``.
        """
        gateway = {
            "endpoint_url": f"https://s3.hf.co/{namespace}",
            "region_name": "us-east-1",
            "addressing_style": "path",
        }
        try:
            explicit = S3Options.from_store_options(store_options)
            unset: dict[str, Any] = {
                k: v
                for k, v in gateway.items()
                if k not in store_options and getattr(explicit, k) is None
            }
            options = dataclasses.replace(explicit, **unset)
        except ConfigError as exc:
            raise _options.with_prefix(f"s3 gateway store {namespace}/{bucket}", exc) from None
        return cls(bucket, prefix, options)

    # the options most often read back, as before they were grouped in S3Options
    @property
    def endpoint_url(self) -> str | None:
        return self.options.endpoint_url

    @property
    def region_name(self) -> str | None:
        return self.options.region_name

    @property
    def addressing_style(self) -> str | None:
        return self.options.addressing_style

    @property
    def multipart_threshold(self) -> int:
        return self.options.multipart_threshold

    @property
    def part_size(self) -> int:
        return self.options.part_size

    @property
    def max_parallel_parts(self) -> int:
        return self.options.max_parallel_parts

    @property
    def retry_policy(self) -> RetryPolicy:
        return self.options.retry_policy

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, path: str) -> str:
        path = check_path(path)
        return f"{self.prefix}/{path}" if self.prefix else path

    def _rel(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key

    async def _s3(self) -> Any:
        async with self._lock:
            if self._client is None:
                from aiobotocore.config import AioConfig
                from aiobotocore.session import AioSession

                config = AioConfig(
                    s3={"addressing_style": self.options.addressing_style or "auto"},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    retries={"total_max_attempts": 1},
                    max_pool_connections=self.options.max_pool_connections,
                )
                session = AioSession(profile=self.options.profile)
                self._stack = contextlib.AsyncExitStack()
                self._client = await self._stack.enter_async_context(
                    session.create_client(
                        "s3",
                        endpoint_url=self.endpoint_url,
                        region_name=self.region_name,
                        config=config,
                        **self.options.credentials(),
                    )
                )
            return self._client

    async def _call(self, op: str, what: str, method: str, **kwargs: Any) -> Any:
        client = await self._s3()

        async def once() -> Any:
            try:
                return await getattr(client, method)(Bucket=self.bucket, **kwargs)
            except Exception as exc:
                raise s3_error(exc, what) from exc

        try:
            result = await retry(
                once,
                what=what,
                policy=self.retry_policy,
                on_retry=lambda e: self.stats.count(op, "error"),
            )
        except NotFoundError:
            self.stats.count(op, "not_found")
            raise
        except StoreError:
            self.stats.count(op, "error")
            raise
        self.stats.count(op, "ok")
        return result

    # -- reads -------------------------------------------------------------------------------

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        full = (f"{self.prefix}/" if self.prefix else "") + prefix.lstrip("/")
        found: builtins.list[ObjectInfo] = []
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = await self._call(
                "list", f"{self.url}: list", "list_objects_v2", Prefix=full, **extra
            )
            for item in page.get("Contents", []):
                found.append(
                    ObjectInfo(self._rel(item["Key"]), int(item["Size"]), item.get("ETag"))
                )
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return sorted(found, key=lambda o: o.path)

    async def stat(self, path: str) -> ObjectInfo | None:
        try:
            head = await self._call(
                "stat", f"{self.url}/{path}", "head_object", Key=self._key(path)
            )
        except NotFoundError:
            return None
        return ObjectInfo(path, int(head["ContentLength"]), head.get("ETag"))

    async def read(
        self, path: str, start: int = 0, end: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        what = f"{self.url}/{path}"
        check_max_bytes(max_bytes)
        reader = RangedReader(
            fetch=lambda a, b, buf: self._fetch(path, a, b, buf, what),
            what=what,
            policy=self.retry_policy,
            part_size=self.part_size,
            max_parallel_parts=self.max_parallel_parts,
            on_resume=lambda kept: self.stats.count("read", "resumed"),
            min_bytes_per_s=self.options.min_bytes_per_s,
            rate_window_s=self.options.rate_window_s,
            max_request_s=self.options.max_request_s,
        )
        data = await reader.read(start, end, max_bytes)
        self.stats.bytes_read += len(data)
        return data

    async def _fetch(
        self, path: str, start: int, end: int | None, buf: Chunks, what: str
    ) -> int | None:
        client = await self._s3()
        try:
            resp = await client.get_object(
                Bucket=self.bucket, Key=self._key(path), Range=range_header(start, end)
            )
        except Exception as exc:
            err = s3_error(exc, what)
            if getattr(exc, "response", {}).get("Error", {}).get("Code") == "InvalidRange":
                return 0
            self.stats.count("read", "not_found" if isinstance(err, NotFoundError) else "error")
            raise err from exc
        self.stats.count("read", "ok")
        try:
            async with resp["Body"] as body:
                async for chunk in body.iter_chunks(1 << 18):
                    buf.extend(chunk)  # over the read's max_bytes: FormatError, stream stopped
        except DeltaSyncError:
            raise
        except Exception as exc:
            raise s3_error(exc, f"{what}: body cut after {len(buf)} bytes") from exc
        return parse_content_range(resp.get("ContentRange"))

    # -- writes ------------------------------------------------------------------------------

    async def abort_stale_uploads(self, older_than_s: float | None = None) -> builtins.list[str]:
        """Abort the unfinished multipart uploads under this prefix that started more than
        ``older_than_s`` (default ``stale_upload_s``) ago: what a writer killed in the middle of
        a large object leaves behind. Returns their paths."""
        import datetime

        limit = self.options.stale_upload_s if older_than_s is None else older_than_s
        cutoff = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=limit)
        prefix = f"{self.prefix}/" if self.prefix else ""
        aborted: builtins.list[str] = []
        markers: dict[str, str] = {}
        while True:
            page = await self._call("list", f"{self.url}: list uploads", "list_multipart_uploads",
                                    Prefix=prefix, **markers)
            for upload in page.get("Uploads", []):
                started = upload.get("Initiated")
                if isinstance(started, datetime.datetime) and started <= cutoff:
                    key = upload["Key"]
                    with contextlib.suppress(NotFoundError):
                        await self._call("delete", f"{self.url}: abort upload",
                                         "abort_multipart_upload", Key=key,
                                         UploadId=upload["UploadId"])
                    aborted.append(self._rel(key))
            if not page.get("IsTruncated"):
                break
            markers = {"KeyMarker": page.get("NextKeyMarker", ""),
                       "UploadIdMarker": page.get("NextUploadIdMarker", "")}
        if aborted:
            logger.info("%s: aborted %d unfinished upload(s) left by a killed writer", self.url,
                        len(aborted))
        return aborted

    async def write(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> None:
        what = f"{self.url}/{path}"
        payload = bytes(data)
        if not self._swept:
            self._swept = True
            try:
                await self.abort_stale_uploads()
            except StoreError as exc:  # servers without the call (some gateways): not fatal
                logger.info("%s: stale multipart uploads not checked: %s", self.url, exc)
        if not overwrite and not self.conditional_writes and await self.stat(path) is not None:
            raise AlreadyExistsError(f"{what}: already exists; bucket names are immutable")
        if len(payload) >= self.multipart_threshold:
            if not overwrite and self.conditional_writes and await self.stat(path) is not None:
                raise AlreadyExistsError(f"{what}: already exists; bucket names are immutable")
            await self._multipart(path, payload, what)
        else:
            await self._put(
                path, payload, what, conditional=self.conditional_writes and not overwrite
            )
        self.stats.bytes_written += len(payload)

    async def _put(self, path: str, payload: bytes, what: str, *, conditional: bool) -> None:
        extra = {"IfNoneMatch": "*"} if conditional else {}
        try:
            await self._call(
                "write", what, "put_object", Key=self._key(path), Body=payload, **extra
            )
        except StoreError as exc:
            if conditional and "NotImplemented" in str(exc):
                self.conditional_writes = (
                    False  # the server cannot do conditional PUT: HEAD then PUT
                )
                await self.write(path, payload)
                return
            raise

    async def _multipart(self, path: str, payload: bytes, what: str) -> None:
        key = self._key(path)
        upload = await self._call("write", what, "create_multipart_upload", Key=key)
        upload_id = upload["UploadId"]
        limiter = asyncio.Semaphore(self.max_parallel_parts)

        async def part(number: int, offset: int) -> dict[str, Any]:
            async with limiter:
                body = payload[offset : offset + self.part_size]
                done = await self._call(
                    "write",
                    what,
                    "upload_part",
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=body,
                )
                return {"PartNumber": number, "ETag": done["ETag"]}

        try:
            offsets = range(0, len(payload), self.part_size)
            parts = await asyncio.gather(*(part(i + 1, o) for i, o in enumerate(offsets)))
            await self._call(
                "write",
                what,
                "complete_multipart_upload",
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await self._call(
                    "write", what, "abort_multipart_upload", Key=key, UploadId=upload_id
                )
            raise

    async def delete(self, paths: Sequence[str]) -> None:
        keys = [{"Key": self._key(p)} for p in paths]
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            await self._call(
                "delete",
                f"{self.url}: delete",
                "delete_objects",
                Delete={"Objects": batch, "Quiet": True},
            )

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
        self._client, self._stack = None, None


__all__ = ["RetryPolicy", "S3Options", "S3Store", "parse_s3_url"]
