"""A local Hugging Face Storage Buckets server (aiohttp) for the store tests and the benchmark.

Started by the ``hub_server`` fixture of ``tests/conftest.py`` (and loaded by path by
``benchmarks/``); it is not a test module. It speaks the bucket protocol of REFERENCE.md §4 on
two loopback origins:

* API origin (127.0.0.1): ``GET /api/buckets/{id}`` (info), ``GET .../tree/{prefix}`` paged by
  ``Link: <...>; rel="next"``, ``POST .../paths-info``, ``POST .../batch`` (ndjson, as sent by
  ``huggingface_hub.batch_bucket_files``), ``GET .../events`` (server-sent events), and
  ``HEAD``/``GET /buckets/{id}/resolve/{path}`` answering 302 to a signed URL on
* the CDN origin (127.0.0.2), which serves ``Range`` requests and rejects any request that
  carries an ``Authorization`` header (counted in ``cdn_auth_seen``).

Every API/resolve answer carries ``RateLimit: "<quota>";r=<left>;t=<reset s>``; past the quota a
429 with that header and ``Retry-After``. Errors carry ``X-Error-Code``. Switches in
:class:`Faults` inject 5xx, slow (per-connection bandwidth limit) and truncated bodies, and
dropped connections. ``PUT /_test/upload/{id}/{path}`` is the test stand-in for the Xet upload
(the one part of the protocol that cannot run offline).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from aiohttp import web

from .loopserver import LoopServer

SECRET = b"cdn-signing-key"


@dataclass
class Faults:
    """Switches tests flip while the server runs."""

    fail_next: int = 0
    """The next N API/resolve requests answer ``fail_status``."""
    fail_status: int = 503
    truncate_next: int = 0
    """The next N CDN bodies are cut after ``truncate_after`` bytes (connection dropped)."""
    truncate_after: int = 0
    cdn_bytes_per_s: float | None = None
    """Per-connection bandwidth limit of the CDN (mimics object-store/CDN per-stream speed)."""
    api_delay_s: float = 0.0
    events_enabled: bool = True
    events_max_s: float = 30.0
    """An events connection ends with a ``reconnect`` event after this long."""
    events_garbage: bool = False
    """Each events connection sends one malformed ``changes`` event after ``ready``."""
    events_silent: bool = False
    """Events connections send ``ready``, then nothing at all (a feed gone silent)."""


@dataclass
class Quota:
    limit: int
    window_s: float
    used: int = 0
    start: float = field(default_factory=time.monotonic)

    def take(self) -> tuple[bool, int, float]:
        """(allowed, remaining, seconds to reset)."""
        now = time.monotonic()
        if now - self.start >= self.window_s:
            self.start, self.used = now, 0
        reset = self.window_s - (now - self.start)
        if self.used >= self.limit:
            return False, 0, reset
        self.used += 1
        return True, self.limit - self.used, reset


class HubServer(LoopServer):
    """Runs the two origins on a daemon thread; ``with HubServer() as hub: ...``."""

    def __init__(self, token: str | None = "hf_test_secret_token", page_size: int = 50) -> None:
        super().__init__()
        self.token = token
        self.page_size = page_size
        self.faults = Faults()
        self.buckets: dict[str, dict[str, bytes]] = {}
        self.blobs: dict[str, bytes] = {}
        self.log: list[dict[str, Any]] = []
        self.cdn_auth_seen = 0
        self.cdn_bytes_served = 0
        self.quotas = {"api": Quota(1000, 300.0), "resolve": Quota(5000, 300.0)}
        self.events: list[dict[str, Any]] = []
        self._changed: asyncio.Event | None = None
        self.endpoint = ""
        self.cdn = ""

    # -- lifecycle (LoopServer) --------------------------------------------------------------

    thread_name = "hubserver"

    async def _start(self) -> None:
        self._changed = asyncio.Event()
        api, cdn = web.Application(client_max_size=1 << 30), web.Application()
        b = "/api/buckets/{ns}/{name}"
        api.router.add_get(b, self._info)
        api.router.add_get(b + "/tree", self._tree)
        api.router.add_get(b + "/tree/{prefix:.*}", self._tree)
        api.router.add_post(b + "/paths-info", self._paths_info)
        api.router.add_post(b + "/batch", self._batch)
        api.router.add_get(b + "/events", self._events)
        api.router.add_route("*", "/buckets/{ns}/{name}/resolve/{path:.*}", self._resolve)
        api.router.add_put("/_test/upload/{ns}/{name}/{path:.*}", self._test_upload)
        api.router.add_get("/_test/log", self._test_log)
        cdn.router.add_get("/cdn/{ns}/{name}/{path:.*}", self._cdn_get)
        self.endpoint = await self._serve(api, "127.0.0.1")
        self.cdn = await self._serve(cdn, "127.0.0.2")

    # -- test helpers (any thread) -----------------------------------------------------------

    def create_bucket(self, bucket_id: str) -> None:
        self.buckets.setdefault(bucket_id, {})

    def put(self, bucket_id: str, path: str, data: bytes) -> None:
        """Store an object as an upload would, emitting an event."""
        self._call(self._store(bucket_id, path, data))

    def set_quota(self, kind: str, limit: int, window_s: float) -> None:
        """Replace quota ``api`` or ``resolve`` with a fresh window."""
        self.quotas[kind] = Quota(limit, window_s)

    def requests(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [r for r in list(self.log) if kind is None or r["kind"] == kind]

    # -- internals ---------------------------------------------------------------------------

    async def _store(self, bucket_id: str, path: str, data: bytes) -> None:
        op = "update" if path in self.buckets[bucket_id] else "add"
        self.buckets[bucket_id][path] = data
        self.blobs[_xet(data)] = data
        await self._emit(
            bucket_id, {"path": path, "op": op, "size": len(data), "xetHash": _xet(data)}
        )

    async def _emit(self, bucket_id: str, change: dict[str, Any]) -> None:
        assert self._changed is not None
        self.events.append({"bucket": bucket_id, "change": change})
        self._changed.set()  # wake every feed, then arm a fresh event for the next change
        self._changed = asyncio.Event()

    def _record(self, request: web.Request, kind: str, status: int, **extra: Any) -> None:
        self.log.append(
            {
                "t": time.monotonic(),
                "kind": kind,
                "method": request.method,
                "path": request.path,
                "auth": "Authorization" in request.headers,
                "range": request.headers.get("Range"),
                "status": status,
                **extra,
            }
        )

    def _bucket(self, request: web.Request) -> tuple[str, dict[str, bytes]]:
        bucket_id = f"{request.match_info['ns']}/{request.match_info['name']}"
        if bucket_id not in self.buckets:
            raise self._error(404, "RepoNotFound", f"bucket {bucket_id} not found")
        return bucket_id, self.buckets[bucket_id]

    @staticmethod
    def _error(
        status: int, code: str, message: str, extra: dict[str, str] | None = None
    ) -> web.HTTPException:
        return _HubError(
            status, {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})}, message
        )

    async def _gate(self, request: web.Request, kind: str) -> dict[str, str]:
        """Auth, fault injection and quota for an API or resolve call; returns RateLimit headers."""
        if self.faults.api_delay_s:
            await asyncio.sleep(self.faults.api_delay_s)
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            self._record(request, kind, 401)
            raise self._error(401, "Unauthorized", "invalid or missing token")
        if self.faults.fail_next > 0:
            self.faults.fail_next -= 1
            self._record(request, kind, self.faults.fail_status)
            raise self._error(self.faults.fail_status, "InternalError", "injected failure")
        ok, left, reset = self.quotas[kind].take()
        quota = "api" if kind == "api" else "resolvers"
        headers = {"RateLimit": f'"{quota}";r={left};t={math.ceil(reset)}'}
        if not ok:
            self._record(request, kind, 429, reset_at=time.monotonic() + reset)
            raise self._error(
                429,
                "RateLimited",
                "too many requests",
                {"Retry-After": str(math.ceil(reset)), **headers},
            )
        self._record(request, kind, 200)
        return headers

    # -- API origin --------------------------------------------------------------------------

    async def _info(self, request: web.Request) -> web.Response:
        headers = await self._gate(request, "api")
        bucket_id, files = self._bucket(request)
        info = {
            "id": bucket_id,
            "private": True,
            "totalFiles": len(files),
            "size": sum(map(len, files.values())),
        }
        return web.json_response(info, headers=headers)

    async def _tree(self, request: web.Request) -> web.Response:
        headers = await self._gate(request, "api")
        bucket_id, files = self._bucket(request)
        prefix = unquote(request.match_info.get("prefix", "")).strip("/")
        under = sorted(p for p in files if not prefix or p.startswith(prefix + "/"))
        if prefix and not under:
            raise self._error(404, "EntryNotFound", f"{prefix} not found", headers)
        cursor = int(request.query.get("cursor", "0"))
        page = under[cursor : cursor + self.page_size]
        body = [_file_entry(p, files[p]) for p in page]
        if cursor + self.page_size < len(under):
            tail = f"/{quote(prefix, safe='')}" if prefix else ""
            nxt = f"{self.endpoint}/api/buckets/{bucket_id}/tree{tail}?recursive=true&cursor={cursor + self.page_size}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        return web.json_response(body, headers=headers)

    async def _paths_info(self, request: web.Request) -> web.Response:
        headers = await self._gate(request, "api")
        _, files = self._bucket(request)
        wanted = (await request.json())["paths"]
        return web.json_response(
            [_file_entry(p, files[p]) for p in wanted if p in files], headers=headers
        )

    async def _batch(self, request: web.Request) -> web.Response:
        headers = await self._gate(request, "api")
        bucket_id, files = self._bucket(request)
        failed = []
        for line in (await request.read()).splitlines():
            op = json.loads(line)
            if op["type"] == "deleteFile":
                if files.pop(op["path"], None) is not None:
                    await self._emit(bucket_id, {"path": op["path"], "op": "delete"})
            elif op["type"] == "addFile" and op.get("xetHash") in self.blobs:
                await self._store(bucket_id, op["path"], self.blobs[op["xetHash"]])
            else:
                failed.append({"path": op.get("path"), "error": "unknown xetHash or operation"})
        return web.json_response({"failed": failed}, status=422 if failed else 200, headers=headers)

    async def _test_upload(self, request: web.Request) -> web.Response:
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            raise self._error(401, "Unauthorized", "invalid or missing token")
        bucket_id, _ = self._bucket(request)
        await self._store(bucket_id, unquote(request.match_info["path"]), await request.read())
        return web.json_response({"ok": True})

    async def _test_log(self, request: web.Request) -> web.Response:
        """The request log since monotonic time ``since`` as ``[t, kind, status, path, bytes]``
        rows (for a benchmark running this server in another process; not counted)."""
        since = float(request.query.get("since", "0"))
        rows = [[r["t"], r["kind"], r["status"], r["path"], r.get("bytes", 0)]
                for r in list(self.log) if r["t"] >= since]
        return web.json_response(rows)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        headers = await self._gate(request, "resolve")
        bucket_id, files = self._bucket(request)
        path = unquote(request.match_info["path"])
        if path not in files:
            raise self._error(404, "EntryNotFound", f"{path} not found", headers)
        data = files[path]
        expires = str(int(time.time()) + 3600)
        sig = _sign(bucket_id, path, expires)
        location = f"{self.cdn}/cdn/{bucket_id}/{quote(path)}?expires={expires}&sig={sig}"
        headers.update(
            {"Location": location, "X-Xet-Hash": _xet(data), "X-Linked-Size": str(len(data))}
        )
        return web.Response(status=302, headers=headers)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        await self._gate(request, "api")
        bucket_id, _ = self._bucket(request)
        if not self.faults.events_enabled:
            raise self._error(501, "NotImplemented", "events feed unavailable")
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        cursor = int(request.query.get("cursor", len(self.events)))
        with contextlib.suppress(ConnectionError):
            await self._feed(resp, bucket_id, cursor)
        return resp

    async def _feed(self, resp: web.StreamResponse, bucket_id: str, cursor: int) -> None:
        await resp.write(f"id: {cursor}\nevent: ready\ndata: {{}}\n\n".encode())
        if self.faults.events_garbage:
            await resp.write(b"event: changes\ndata: {not json\xff\n\n")
        if self.faults.events_silent:
            await asyncio.sleep(self.faults.events_max_s)
            return
        deadline = time.monotonic() + self.faults.events_max_s
        while (left := deadline - time.monotonic()) > 0:
            assert self._changed is not None
            changed = self._changed
            if len(self.events) > cursor:
                mine = [e["change"] for e in self.events[cursor:] if e["bucket"] == bucket_id]
                cursor = len(self.events)
                if mine:
                    data = json.dumps(mine)
                    await resp.write(f"id: {cursor}\nevent: changes\ndata: {data}\n\n".encode())
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, 5.0))
        await resp.write(f"id: {cursor}\nevent: reconnect\ndata: {{}}\n\n".encode())

    # -- CDN origin --------------------------------------------------------------------------

    async def _cdn_get(self, request: web.Request) -> web.StreamResponse:
        bucket_id = f"{request.match_info['ns']}/{request.match_info['name']}"
        path = unquote(request.match_info["path"])
        if "Authorization" in request.headers:
            self.cdn_auth_seen += 1
            self._record(request, "cdn", 400)
            raise self._error(
                400, "AuthorizationNotAllowed", "the CDN rejects Authorization headers"
            )
        expires = request.query.get("expires", "")
        if (
            request.query.get("sig") != _sign(bucket_id, path, expires)
            or int(expires) < time.time()
        ):
            self._record(request, "cdn", 403)
            raise self._error(403, "SignatureDoesNotMatch", "bad or expired signature")
        data = self.buckets.get(bucket_id, {}).get(path)
        if data is None:
            raise self._error(404, "NoSuchKey", path)
        start, end = _parse_range(request.headers.get("Range"), len(data))
        if start >= len(data) and data:
            raise self._error(416, "InvalidRange", "range not satisfiable")
        body = data[start:end]
        status = 206 if request.headers.get("Range") else 200
        resp = web.StreamResponse(status=status)
        resp.content_length = len(body)
        if status == 206:
            resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        await resp.prepare(request)
        cut = None
        if self.faults.truncate_next > 0:
            self.faults.truncate_next -= 1
            cut = self.faults.truncate_after
        planned = body if cut is None else body[:cut]
        self._record(request, "cdn", status, bytes=len(planned), cut=cut is not None)
        await self._send(resp, planned)
        if cut is not None and request.transport is not None:
            while request.transport.get_write_buffer_size() > 0:  # what was sent arrives
                await asyncio.sleep(0.001)
            request.transport.abort()  # then the connection drops mid-body
        return resp

    async def _send(self, resp: web.StreamResponse, body: bytes) -> None:
        rate = self.faults.cdn_bytes_per_s
        step = 64 << 10
        started = time.monotonic()
        for offset in range(0, len(body), step):
            self.cdn_bytes_served += len(
                body[offset : offset + step]
            )  # before: no race with the reader
            await resp.write(body[offset : offset + step])
            if rate:
                ahead = (offset + step) / rate - (time.monotonic() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)


class _HubError(web.HTTPException):
    def __init__(self, status: int, headers: dict[str, str], message: str) -> None:
        self.status_code = status
        super().__init__(
            headers=headers, text=json.dumps({"error": message}), content_type="application/json"
        )


def _xet(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sign(bucket_id: str, path: str, expires: str) -> str:
    return hmac.new(SECRET, f"{bucket_id}/{path}/{expires}".encode(), "sha256").hexdigest()[:32]


def _file_entry(path: str, data: bytes) -> dict[str, Any]:
    return {
        "type": "file",
        "path": path,
        "size": len(data),
        "xetHash": _xet(data),
        "mtime": 0,
        "uploadedAt": 0,
    }


def _parse_range(value: str | None, size: int) -> tuple[int, int]:
    if not value:
        return 0, size
    first, _, last = value.removeprefix("bytes=").partition("-")
    start = int(first)
    end = min(size, int(last) + 1) if last else size
    return start, end


def main() -> None:
    """Serve in this process (used by benchmarks/ to keep the server off the client's GIL).

    Prints one JSON line ``{"endpoint", "cdn", "token"}``; stops when stdin closes.
    """
    import argparse
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", action="append", default=[])
    parser.add_argument("--cdn-bytes-per-s", type=float, default=None)
    parser.add_argument("--events-max-s", type=float, default=None,
                        help="an events connection ends after this long (default 30 s)")
    parser.add_argument("--no-quota", action="store_true", help="no 429s (a fleet benchmark)")
    args = parser.parse_args()
    with HubServer() as server:
        server.faults.cdn_bytes_per_s = args.cdn_bytes_per_s
        if args.events_max_s is not None:
            server.faults.events_max_s = args.events_max_s
        if args.no_quota:
            for kind in ("api", "resolve"):
                server.set_quota(kind, 1 << 60, 300.0)
        for bucket in args.bucket:
            server.create_bucket(bucket)
        print(
            json.dumps({"endpoint": server.endpoint, "cdn": server.cdn, "token": server.token}),
            flush=True,
        )
        sys.stdin.read()


if __name__ == "__main__":
    main()
