"""Hugging Face Storage Buckets: ``hf://buckets/<namespace>/<name>/<prefix>``.

Reads speak the bucket HTTP API with aiohttp (the session is injectable):

* ``list``: ``GET /api/buckets/{id}/tree/{dir}?recursive=true``, following ``Link: rel="next"``.
* ``stat``: ``HEAD /buckets/{id}/resolve/{path}`` (counts against the larger *resolve* quota,
  not the API quota); size from ``X-Linked-Size`` / ``Content-Length``, identity ``X-Xet-Hash``.
* ``read``: ``GET /buckets/{id}/resolve/{path}``; the redirect is followed by hand so the token
  is only ever sent to the endpoint's own origin, never to the CDN host. Large objects are
  read as parallel ranges from the signed CDN URL (one resolve per read), a part cut by a
  dropped connection resumes from the last byte received.
* ``changes``: the bucket's server-sent events feed (used by :mod:`vllm_deltasync.server.worker.discovery`).

Options are one :class:`HfOptions` (``HfStore(bucket_id, prefix, options)``) or, the same
names, keyword arguments of ``open_store(url, **store_options)``.

Writes go through ``huggingface_hub.batch_bucket_files`` (stores/_hfwrite.py; ``uploader=``
replaces the Xet upload, which cannot run offline). Buckets are mutable, so ``write`` refuses to overwrite by checking first
(HEAD or one paths-info call for a batch); the check and the upload are not atomic, which the
format tolerates because every name it writes is new (random token per publish attempt).

Errors: status and ``X-Error-Code`` map to :mod:`vllm_deltasync.errors`; a 429 becomes
:class:`RateLimitedError` with the wait from ``RateLimit: "api";r=..;t=..`` / ``Retry-After``,
and no request of the same quota (``api`` or ``resolve``) leaves before that reset.
"""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import aiohttp
from yarl import URL

from vllm_deltasync._urls import redact_url
from vllm_deltasync.errors import (
    ConfigError,
    NotFoundError,
    RateLimitedError,
    StoreError,
    TransientStoreError,
)
from vllm_deltasync.stores import _options
from vllm_deltasync.stores._hfhttp import (
    ChangeEvent,
    change_event,
    checked_size,
    connection_error,
    error_for_response,
    hub_error,
    json_list,
    parse_hf_url,
    parse_sse,
    resolve_token,
)
from vllm_deltasync.stores._hfoptions import DEFAULT_ENDPOINT, HfOptions
from vllm_deltasync.stores._hfwrite import BatchWriter, Uploader
from vllm_deltasync.stores._parts import (
    Chunks,
    RangedReader,
    check_max_bytes,
    parse_content_range,
    range_header,
)
from vllm_deltasync.stores._redirects import RedirectGuard
from vllm_deltasync.stores._retry import (
    RateGate,
    RetryPolicy,
    parse_remaining,
    parse_retry_after,
    retry,
)
from vllm_deltasync.stores.base import ObjectInfo, Store, check_path

_REDIRECTS = (301, 302, 303, 307, 308)


_RUNTIME_KEYS = ("session", "uploader", "environ")
"""``store_options`` keys of ``hf://`` that are runtime objects, passed to HfStore as is."""


LOCATED_TTL_S = 30.0
"""Seconds a resolved CDN URL is reused for more reads of the same object (signed URLs stay
valid for minutes; a failed read drops it)."""


class HfStore(Store):
    """A prefix inside one Hugging Face Storage Bucket."""

    scheme = "hf"

    def __init__(
        self,
        bucket_id: str,
        prefix: str = "",
        options: HfOptions | None = None,
        *,
        session: aiohttp.ClientSession | None = None,
        uploader: Uploader | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """``session``: an aiohttp session to share (else one of its own, closed by
        :meth:`close`); ``uploader``: replaces the Xet upload (tests); ``environ``: where
        ``HF_ENDPOINT`` / ``HF_TOKEN`` are read (default ``os.environ``)."""
        super().__init__()
        if options is not None and not isinstance(options, HfOptions):
            raise ConfigError(
                f"hf store {bucket_id!r}: options={type(options).__name__}; use HfOptions(...) "
                "(or open_store(url, **store_options) for keyword options)"
            )
        self.options = options if options is not None else HfOptions()
        env = os.environ if environ is None else environ
        self.bucket_id = bucket_id
        self.prefix = prefix.strip("/")
        _options.check_endpoint("environment", "HF_ENDPOINT", env.get("HF_ENDPOINT"))
        self.endpoint = (self.options.endpoint or env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        secret = resolve_token(self.options.token, env)
        self.__token = lambda: secret  # a closure: never shown by repr() or vars()
        self._session = session
        self._owns_session = session is None
        self._writer = BatchWriter(self.url, self.endpoint, bucket_id, lambda: secret, uploader,
                                   self.stats)
        self._timeout = aiohttp.ClientTimeout(
            total=self.options.max_request_s, sock_connect=30, sock_read=self.options.request_timeout_s
        )
        self.redirects = RedirectGuard(self.endpoint, self.options.allow_redirects_to,
                                       lambda: self.stats.count("redirect", "refused"))
        """The redirect rule and the hosts it pinned (stores/_redirects.py)."""
        self.gates = {"api": RateGate("api"), "resolve": RateGate("resolve")}
        self._located: dict[str, tuple[str, float]] = {}
        """path -> (CDN URL, monotonic time it is trusted until)."""
        self._quota: dict[str, tuple[int, float]] = {}
        self.resumed_bytes = 0

    @classmethod
    def from_url(cls, url: str, **store_options: Any) -> HfStore:
        """``open_store("hf://...", **store_options)``: keys are :class:`HfOptions` fields (or
        ``options=HfOptions(...)``, which the other keys override) and the runtime objects
        ``session``, ``uploader``, ``environ``."""
        bucket_id, prefix = parse_hf_url(url)
        runtime = {k: store_options.pop(k) for k in _RUNTIME_KEYS if k in store_options}
        try:
            _options.check_keys("hf", store_options, (*HfOptions.keys(), "options", *_RUNTIME_KEYS))
            options = HfOptions.from_store_options(store_options)
        except ConfigError as exc:
            raise _options.with_prefix(f"hf store {redact_url(url)}", exc) from None
        return cls(bucket_id, prefix, options, **runtime)

    # the options most often read back, as before they were grouped in HfOptions
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
    def _uploader(self) -> Uploader | None:
        """The upload seam this store was given (tests hand it to a second store)."""
        return self._writer.uploader

    @property
    def url(self) -> str:
        tail = f"/{self.prefix}" if self.prefix else ""
        return f"hf://buckets/{self.bucket_id}{tail}"

    # -- plumbing ----------------------------------------------------------------------------

    def _full(self, path: str) -> str:
        path = check_path(path)
        return f"{self.prefix}/{path}" if self.prefix else path

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _auth(self, url: str) -> dict[str, str]:
        """The token goes to the endpoint's own origin only."""
        same = urlsplit(url)[:2] == urlsplit(self.endpoint)[:2]
        token = self.__token()
        return {"Authorization": f"Bearer {token}"} if same and token else {}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
            self._owns_session = True
        return self._session

    def _count_retry(self, op: str) -> Callable[[TransientStoreError], None]:
        def count(exc: TransientStoreError) -> None:
            self.stats.count(op, "rate_limited" if isinstance(exc, RateLimitedError) else "error")

        return count

    async def _once(
        self, kind: str, method: str, url: str, what: str, ok404: bool, kw: dict[str, Any]
    ) -> tuple[int, Mapping[str, str], bytes, dict[str, Any]]:
        """One request: (status, headers, body, links); a 404 is returned when ``ok404``."""
        try:
            async with self._http().request(
                method, URL(url, encoded=True), headers=self._auth(url), allow_redirects=False,
                timeout=self._timeout, **kw
            ) as resp:
                self._note_quota(kind, resp.headers)
                body = await resp.read()
                if resp.status == 404 and ok404:
                    return 404, resp.headers, body, {}
                if resp.status >= 400:
                    raise error_for_response(resp.status, resp.headers, what, self.__token())
                return resp.status, resp.headers, body, dict(resp.links)
        except aiohttp.ClientError as exc:
            raise connection_error(exc, what) from exc
        except TimeoutError as exc:
            raise TransientStoreError(
                f"{what}: timed out (request_timeout_s / max_request_s)") from exc

    async def _call(
        self,
        op: str,
        kind: str,
        method: str,
        url: str,
        *,
        what: str,
        ok404: bool = False,
        **kw: Any,
    ) -> tuple[int, Mapping[str, str], bytes, dict[str, Any]]:
        """``_once`` with retries, the quota's rate gate and request counters."""

        def once() -> Awaitable[tuple[int, Mapping[str, str], bytes, dict[str, Any]]]:
            return self._once(kind, method, url, what, ok404, kw)

        try:
            result = await retry(
                once,
                what=what,
                policy=self.retry_policy,
                gate=self.gates[kind],
                on_retry=self._count_retry(op),
            )
        except NotFoundError:
            self.stats.count(op, "not_found")
            raise
        except StoreError:
            self.stats.count(op, "error")
            raise
        self.stats.count(op, "not_found" if result[0] == 404 else "ok")
        return result

    def _note_quota(self, kind: str, headers: Mapping[str, str]) -> None:
        remaining, reset_s = parse_remaining(headers), parse_retry_after(headers)
        if remaining is not None and reset_s is not None:
            self._quota[kind] = (remaining, time.monotonic() + reset_s)

    def quota_left(self, kind: str) -> tuple[int, float] | None:
        """(requests left, seconds to the window's reset) of quota ``api`` or ``resolve``, from
        the last ``RateLimit`` header seen; None when the server sent none."""
        if kind not in self._quota:
            return None
        remaining, reset_at = self._quota[kind]
        return remaining, max(0.0, reset_at - time.monotonic())

    def _api(self, tail: str) -> str:
        return f"{self.endpoint}/api/buckets/{self.bucket_id}{tail}"

    def _resolve_url(self, path: str) -> str:
        return f"{self.endpoint}/buckets/{self.bucket_id}/resolve/{quote(self._full(path))}"

    # -- reads -------------------------------------------------------------------------------

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        full = (f"{self.prefix}/" if self.prefix else "") + prefix.lstrip("/")
        directory = full.rsplit("/", 1)[0] if "/" in full else ""
        tail = "/tree" + (f"/{quote(directory, safe='')}" if directory else "")
        url: str | None = self._api(tail) + "?recursive=true"
        found: builtins.list[ObjectInfo] = []
        while url:
            status, headers, body, links = await self._call(
                "list", "api", "GET", url, what=f"{self.url}: list", ok404=True
            )
            if status == 404:
                self._raise_if_no_bucket(headers)
                return []
            for item in json_list(body, f"{self.url}: list"):
                path = item.get("path", "")
                if item.get("type") == "file" and isinstance(path, str) and path.startswith(full):
                    found.append(
                        ObjectInfo(self._rel(path), checked_size(item.get("size"), path), item.get("xetHash"))
                    )
            nxt = links.get("next")
            url = urljoin(url, str(nxt["url"])) if nxt else None
        return sorted(found, key=lambda o: o.path)

    def _raise_if_no_bucket(self, headers: Mapping[str, str]) -> None:
        if headers.get("X-Error-Code") == "RepoNotFound":
            raise NotFoundError(
                f"{self.url}: bucket {self.bucket_id!r} not found at {self.endpoint}; "
                "check the URL, HF_ENDPOINT and that HF_TOKEN can see it"
            )

    async def paths_info(self, paths: Sequence[str]) -> builtins.list[ObjectInfo]:
        """The existing objects among ``paths`` in one API call (missing ones are left out)."""
        if not paths:
            return []
        payload = {"paths": [self._full(p) for p in paths]}
        _, _, body, _ = await self._call(
            "paths_info",
            "api",
            "POST",
            self._api("/paths-info"),
            what=f"{self.url}: paths-info",
            json=payload,
        )
        return [
            ObjectInfo(self._rel(str(i.get("path", ""))), checked_size(i.get("size"), str(i.get("path"))), i.get("xetHash"))
            for i in json_list(body, f"{self.url}: paths-info")
            if i.get("type", "file") == "file"
        ]

    async def stat(self, path: str) -> ObjectInfo | None:
        status, headers, _, _ = await self._call(
            "stat",
            "resolve",
            "HEAD",
            self._resolve_url(path),
            what=f"{self.url}/{path}",
            ok404=True,
        )
        if status == 404:
            self._raise_if_no_bucket(headers)
            return None
        size = headers.get("X-Linked-Size") or headers.get("Content-Length") or "0"
        return ObjectInfo(path, checked_size(size, path), headers.get("X-Xet-Hash"))

    async def read(
        self, path: str, start: int = 0, end: int | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        what = f"{self.url}/{path}"
        try:
            return await self._read(path, start, end, what, max_bytes)
        except Exception:
            self._located.pop(path, None)  # a failed read resolves again next time
            raise

    async def _read(
        self, path: str, start: int, end: int | None, what: str, max_bytes: int | None
    ) -> bytes:
        check_max_bytes(max_bytes)
        cdn = await self._locate(path, what)
        reader = RangedReader(
            fetch=lambda a, b, buf: self._fetch(cdn, a, b, buf, what),
            what=what,
            policy=self.retry_policy,
            part_size=self.part_size,
            max_parallel_parts=self.max_parallel_parts,
            on_retry=self._count_retry("read"),
            on_resume=self._count_resume,
            min_bytes_per_s=self.options.min_bytes_per_s,
            rate_window_s=self.options.rate_window_s,
            max_request_s=self.options.max_request_s,
        )
        data = await reader.read(start, end, max_bytes)
        self.stats.bytes_read += len(data)
        return data

    def _count_resume(self, kept: int) -> None:
        self.resumed_bytes += kept
        self.stats.count("read", "resumed")

    async def _locate(self, path: str, what: str) -> str:
        """The CDN URL the resolve call redirects to (or the resolve URL if served directly).

        Kept for :data:`LOCATED_TTL_S` (objects are immutable): the ranged reads of one file
        within a step cost one resolve, not one per range."""
        now = time.monotonic()
        known = self._located.get(path)
        if known is not None and known[1] > now:
            return known[0]
        target = await self._resolve(path, what)
        if len(self._located) >= 4096:
            self._located.clear()
        self._located[path] = (target, now + LOCATED_TTL_S)
        return target

    async def _resolve(self, path: str, what: str) -> str:
        url = self._resolve_url(path)
        status, headers, _, _ = await self._call(
            "resolve", "resolve", "HEAD", url, what=what, ok404=True
        )
        if status == 404:
            self._raise_if_no_bucket(headers)
            raise NotFoundError(f"{what}: no such object in the bucket (EntryNotFound)")
        if status in _REDIRECTS and headers.get("Location"):
            target = urljoin(url, headers["Location"])
            await self.redirects.check(url, target, what)
            return target
        return url


    async def _fetch(
        self, url: str, start: int, end: int | None, buf: Chunks, what: str
    ) -> int | None:
        for _ in range(self.options.max_redirects):
            target = await self._fetch_once(url, start, end, buf, what)
            if not isinstance(target, str):
                return target
            await self.redirects.check(url, target, what)
            url = target
        self.stats.count("redirect", "refused")
        raise StoreError(f"{what}: more than {self.options.max_redirects} redirects "
                         "(HfOptions.max_redirects); a redirect loop?")

    async def _fetch_once(
        self, url: str, start: int, end: int | None, buf: Chunks, what: str
    ) -> int | str | None:
        """One GET of a range: the total size (or None), or the URL a redirect points to."""
        headers = {**self._auth(url), "Range": range_header(start, end)}
        direct, extra = await self.redirects.pinned(url, what)
        if "host_header" in extra:
            headers["Host"] = extra.pop("host_header")
        try:
            async with self._http().get(
                direct, headers=headers, allow_redirects=False, timeout=self._timeout, **extra,
            ) as resp:
                if resp.status == 416:
                    return 0
                if resp.status in _REDIRECTS and resp.headers.get("Location"):
                    return urljoin(url, resp.headers["Location"])
                if resp.status >= 400:
                    raise error_for_response(resp.status, resp.headers, what, self.__token())
                if resp.status == 200 and start > 0:
                    raise StoreError(
                        f"{what}: the server ignored the Range header; cannot read parts"
                    )
                async for chunk in resp.content.iter_any():
                    buf.extend(chunk)
                total = parse_content_range(resp.headers.get("Content-Range"))
                return total if resp.status == 206 else None
        except aiohttp.ClientError as exc:
            raise connection_error(exc, what) from exc
        except TimeoutError as exc:
            raise TransientStoreError(
                f"{what}: read timed out after {len(buf)} bytes (a socket silent for "
                "request_timeout_s, or the request past max_request_s)") from exc

    # -- events feed -------------------------------------------------------------------------

    async def changes(self, cursor: str | None = None) -> AsyncIterator[ChangeEvent]:
        """Events of the bucket feed under this prefix until the server ends the stream.

        Raises a :class:`StoreError` subclass when the feed is unavailable (401/403/404/501).
        """
        url = self._api("/events") + (f"?cursor={quote(cursor)}" if cursor else "")
        await self.gates["api"].wait()
        headers = {**self._auth(url), "Accept": "text/event-stream"}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        try:
            async with self._http().get(
                URL(url, encoded=True), headers=headers, timeout=timeout, allow_redirects=False
            ) as resp:
                self.stats.count("events", "ok" if resp.status < 300 else "error")
                if 300 <= resp.status < 400:
                    raise StoreError(f"{self.url}: events feed answered a redirect "
                                     f"(HTTP {resp.status}); the feed is not followed there")
                if resp.status >= 400:
                    error = error_for_response(
                        resp.status, resp.headers, f"{self.url}: events feed", self.__token()
                    )
                    if isinstance(error, RateLimitedError) and error.retry_after_s:
                        self.gates["api"].block_for(error.retry_after_s)
                    raise error
                async for kind, data, event_id in parse_sse(resp.content):
                    yield change_event(kind, data, event_id, self.prefix)
        except aiohttp.ClientError as exc:
            raise connection_error(exc, f"{self.url}: events feed") from exc

    # -- writes ------------------------------------------------------------------------------

    async def write(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> None:
        if not overwrite and await self.stat(path) is not None:
            raise hub_error(409, f"{self.url}/{path}: already exists; bucket names are immutable")
        await self._upload([(self._full(path), bytes(data))])

    async def write_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        if not items:
            return
        existing = await self.paths_info([p for p, _ in items])
        if existing:
            names = ", ".join(o.path for o in existing[:3])
            raise hub_error(409, f"{self.url}: {names} already exist; bucket names are immutable")
        await self._upload([(self._full(p), bytes(d)) for p, d in items])

    async def _upload(self, items: builtins.list[tuple[str, bytes]]) -> None:
        await self._writer.upload(items)

    async def delete(self, paths: Sequence[str]) -> None:
        await self._writer.delete([self._full(p) for p in paths])

    async def close(self) -> None:
        if self._owns_session and self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None



__all__ = ["ChangeEvent", "HfOptions", "HfStore", "RetryPolicy", "Uploader", "parse_hf_url", "resolve_token"]
