"""Mirrors: data objects read through HTTP caches before the origin.

A mirror is a base URL (``http://cache.local/run``) under which a data object's store path is
served: ``GET <mirror>/data/000000000012-<token>/00000.safetensors`` with ``Range``, the key
being the object's path relative to the followed bucket URL. A caching reverse proxy in front
of the bucket (``deploy/nginx/``), a CDN or a peer-to-peer distributor (Dragonfly) can be one
(docs/transports.md, "Mirrors"). :class:`MirroredStore` wraps the bucket's store:

* **data objects only**: a read of a path under ``data/`` is tried on each mirror in turn, then
  on the origin. Manifests, listings, probes and the events feed always go to the origin: a
  manifest is the root of trust, its sha256s are what every data byte is checked against.
* **nothing unverified is applied**: the reader checks every byte against the manifest's sha256s
  whoever served it. Bytes that fail are evicted (``Store.evict``, called by the reader): the
  mirror that served them is skipped for ``backoff_s`` and that path is read from the origin
  from then on.
* **a mirror that errors, times out, is slow** (below the origin's rate floor,
  ``min_bytes_per_s`` over ``rate_window_s``) is skipped for ``backoff_s`` with one log line;
  the origin serves meanwhile. A 404 (the mirror does not hold the object) goes on to the next
  one without a back-off. Each try is counted in the store's stats (``mirror_requests``, exported
  as ``deltasync_mirror_requests_total{mirror,outcome}``).
* **no credentials**: a mirror is read with its own session, without the origin's token or any
  cookie, and never follows a redirect (a redirect is an error). A mirror URL carrying
  credentials or a query string is refused, without being shown.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from vllm_deltasync._urls import check_http_url
from vllm_deltasync.errors import (
    ConfigError,
    DeltaSyncError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)
from vllm_deltasync.format.layout import parse_data_path
from vllm_deltasync.stores._parts import Chunks, RangedReader, parse_content_range, range_header
from vllm_deltasync.stores._retry import RetryPolicy
from vllm_deltasync.stores.base import ObjectInfo, Store

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "not_found", "error", "timeout", "slow", "corrupt")
"""Label ``outcome`` of ``deltasync_mirror_requests_total``."""
_ONCE = RetryPolicy(attempts=1)
_REMEMBERED = 4096


def check_mirror_urls(urls: str | Iterable[str], where: str = "mirror_urls") -> tuple[str, ...]:
    """Base URLs of mirrors from a comma-separated string or a list, by the one rule for
    http(s) base URLs (``_urls.check_http_url``: no credentials in any spelling, no query
    string or fragment, never echoed), the trailing ``/`` removed."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    return tuple(check_http_url(item.strip() if isinstance(item, str) else item,
                                f"{where}[{i}]").rstrip("/")
                 for i, item in enumerate(items)
                 if not (isinstance(item, str) and not item.strip()))


@dataclass(frozen=True, kw_only=True)
class MirrorOptions:
    """How mirrors are read. Unset (None) transfer bounds are the origin store's own
    (``HfOptions`` / ``S3Options``), else the defaults below."""

    request_timeout_s: float = 10.0
    """Longest wait to connect, or between two bytes, before a mirror counts as timed out."""
    backoff_s: float = 60.0
    """How long a mirror that failed (error, timeout, slow, corrupt bytes) is skipped."""
    min_bytes_per_s: int | None = None
    """A mirror slower than this over ``rate_window_s`` counts as slow; None: the origin's
    rate floor (64 KiB/s when the origin has none)."""
    rate_window_s: float | None = None
    """None: the origin's (30 s when it has none)."""
    max_request_s: float | None = None
    """Longest one request may take, however fast; None: the origin's (900 s)."""

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "backoff_s", "rate_window_s", "max_request_s"):
            value = getattr(self, name)
            optional = name not in ("request_timeout_s", "backoff_s")
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"MirrorOptions.{name}={value!r}: use a number of seconds > 0"
                                  + (", or None for the origin's" if optional else ""))
        rate = self.min_bytes_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int) or rate < 1):
            raise ConfigError(f"MirrorOptions.min_bytes_per_s={rate!r}: use bytes per second "
                              ">= 1, or None for the origin's")


class MirroredStore(Store):
    """``inner`` (the origin) with its data objects read through ``mirrors`` first (see the
    module docstring). Counts go into ``inner.stats``; everything but data reads is the
    origin's."""

    def __init__(self, inner: Store, mirrors: str | Iterable[str],
                 options: MirrorOptions | None = None, *,
                 session: aiohttp.ClientSession | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.stats = inner.stats
        self.scheme = inner.scheme
        self.mirrors = check_mirror_urls(mirrors)
        self.options = options if options is not None else MirrorOptions()
        if not isinstance(self.options, MirrorOptions):
            raise ConfigError(f"MirroredStore: options={type(options).__name__}; use MirrorOptions")
        origin = getattr(inner, "options", None)
        o = self.options
        self._rate = (o.min_bytes_per_s if o.min_bytes_per_s is not None
                      else getattr(origin, "min_bytes_per_s", 64 << 10))
        self._window: float = o.rate_window_s or getattr(origin, "rate_window_s", None) or 30.0
        self._max_request = o.max_request_s or getattr(origin, "max_request_s", 900.0)
        self._part_size = getattr(origin, "part_size", 16 << 20)
        self._parallel = getattr(origin, "max_parallel_parts", 8)
        self._session = session
        self._owns_session = session is None
        self._down: dict[str, float] = {}
        """mirror -> monotonic time it is tried again."""
        self._served: OrderedDict[str, str] = OrderedDict()
        """path -> the mirror that served its last bytes (who to blame when they fail)."""
        self._origin_only: OrderedDict[str, None] = OrderedDict()
        """Paths whose mirror bytes failed their sha256: read from the origin from now on."""
        for name in ("changes", "quota_left"):  # discovery asks the origin's
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def retry_policy(self) -> RetryPolicy | None:
        policy = getattr(self.inner, "retry_policy", None)
        return policy if isinstance(policy, RetryPolicy) else None

    # ---------------------------------------------------------------- data reads
    async def read(self, path: str, start: int = 0, end: int | None = None, *,
                   max_bytes: int | None = None) -> bytes:
        capped: dict[str, Any] = {} if max_bytes is None else {"max_bytes": max_bytes}
        if parse_data_path(path) is not None and path not in self._origin_only:
            for mirror in self._ready():
                data = await self._try(mirror, path, start, end, max_bytes)
                if data is not None:
                    return data
        return await self.inner.read(path, start, end, **capped)

    def _ready(self) -> list[str]:
        now = time.monotonic()
        return [m for m in self.mirrors if self._down.get(m, 0.0) <= now]

    async def _try(self, mirror: str, path: str, start: int, end: int | None,
                   max_bytes: int | None) -> bytes | None:
        """The bytes from ``mirror``, or None (counted, and the mirror backed off unless it
        only did not hold the object)."""
        cut: list[str] = []
        url = f"{mirror}/{quote(path)}"
        reader = RangedReader(
            fetch=lambda a, b, buf: self._get(url, a, b, buf), what=f"mirror {url}",
            policy=_ONCE, part_size=self._part_size, max_parallel_parts=self._parallel,
            min_bytes_per_s=self._rate, rate_window_s=self._window,
            max_request_s=self._max_request, on_cut=cut.append)
        try:
            data = await reader.read(start, end, max_bytes)
        except NotFoundError:
            self.stats.count_mirror(mirror, "not_found")
            return None
        except (DeltaSyncError, aiohttp.ClientError, TimeoutError) as exc:
            timed_out = isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError)
            outcome = cut[0] if cut else "timeout" if timed_out else "error"
            self._fail(mirror, outcome, exc)
            return None
        self.stats.count_mirror(mirror, "ok")
        self.stats.mirror_bytes_read += len(data)
        self._remember(self._served, path, mirror)
        return data

    async def _get(self, url: str, start: int, end: int | None, buf: Chunks) -> int | None:
        """One ranged GET from a mirror: no credentials, no cookies, no redirects."""
        headers = {"Range": range_header(start, end), "Accept-Encoding": "identity"}
        try:
            async with self._http().get(URL(url, encoded=True), headers=headers,
                                        allow_redirects=False) as resp:
                if resp.status == 416:
                    return 0
                if resp.status == 404:
                    raise NotFoundError(f"mirror {url}: HTTP 404")
                if resp.status not in (200, 206):
                    raise StoreError(f"mirror {url}: HTTP {resp.status}"
                                     + (" (redirects are not followed)" if resp.status < 400 else ""))
                if resp.status == 200 and start > 0:
                    raise StoreError(f"mirror {url}: the Range header was ignored")
                async for chunk in resp.content.iter_any():
                    buf.extend(chunk)
                return parse_content_range(resp.headers.get("Content-Range")) if resp.status == 206 else None
        except aiohttp.ClientError as exc:
            raise TransientStoreError(f"mirror {url}: {type(exc).__name__}") from exc

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.options.request_timeout_s,
                                            sock_read=self.options.request_timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout,
                                                  cookie_jar=aiohttp.DummyCookieJar())
            self._owns_session = True
        return self._session

    def _fail(self, mirror: str, outcome: str, why: BaseException | str) -> None:
        """Count the failure; back the mirror off, with one log line when it was up."""
        self.stats.count_mirror(mirror, outcome)
        now = time.monotonic()
        if self._down.get(mirror, 0.0) <= now:
            text = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
            logger.warning("mirror %s %s (%s); skipped for %.0fs, the origin serves", mirror,
                           outcome, " ".join(text.split())[:300], self.options.backoff_s)
        self._down[mirror] = now + self.options.backoff_s

    @staticmethod
    def _remember(table: OrderedDict[str, Any], key: str, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > _REMEMBERED:
            table.popitem(last=False)

    async def evict(self, path: str) -> bool:
        """Bytes of ``path`` failed their sha256: the mirror that served them is backed off
        (``corrupt``) and the path is read from the origin from now on; the origin store's
        own copies (a cache) are dropped too. True when a next read gets other bytes."""
        dropped = await self.inner.evict(path)
        mirror = self._served.pop(path, None)
        if mirror is None:
            return dropped
        self._fail(mirror, "corrupt", f"bytes of {path} failed their sha256 check")
        self._remember(self._origin_only, path, None)
        return True

    # ---------------------------------------------------------------- the origin's
    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self.inner.list(prefix)

    async def stat(self, path: str) -> ObjectInfo | None:
        return await self.inner.stat(path)

    async def write(self, path: str, data: bytes | memoryview, *, overwrite: bool = False) -> None:
        await self.inner.write(path, data, overwrite=overwrite)

    async def write_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        await self.inner.write_many(items)

    async def delete(self, paths: Sequence[str]) -> None:
        await self.inner.delete(paths)

    async def close(self) -> None:
        try:
            if self._owns_session and self._session is not None and not self._session.closed:
                await self._session.close()
        finally:
            self._session = None
            await self.inner.close()


__all__ = ["OUTCOMES", "MirrorOptions", "MirroredStore", "check_mirror_urls"]
