"""``Store.read(max_bytes=)`` on every scheme: a range larger than the cap is refused with a
FormatError naming the path and the cap, without reading past it (issue 23 item 5.3)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from aiohttp import web

from tests.helpers.faults import Hostile
from vllm_deltasync.errors import ConfigError, FormatError
from vllm_deltasync.stores import RetryPolicy, Store, open_store
from vllm_deltasync.stores.hf import HfStore


def test_cap_on_every_store(store: Store, run: Any, large_size: int) -> None:
    body = bytes(range(256)) * (large_size // 256 + 1)
    body = body[:large_size]
    run(store.write("obj.bin", body))
    assert run(store.read("obj.bin", max_bytes=large_size)) == body
    assert run(store.read("obj.bin", 10, 20, max_bytes=10)) == body[10:20]
    assert run(store.read("obj.bin", large_size - 5, max_bytes=5)) == body[-5:]
    assert run(store.read("obj.bin", 0, large_size + 100, max_bytes=large_size)) == body
    before = store.stats.bytes_read
    for args in ((0, None), (1, None), (0, large_size)):
        with pytest.raises(FormatError) as err:
            run(store.read("obj.bin", *args, max_bytes=1000))
        msg = str(err.value)
        assert "obj.bin" in msg and "1000-byte cap" in msg and len(msg.splitlines()) == 1
    assert store.stats.bytes_read == before  # nothing counted as read
    with pytest.raises(ConfigError, match="max_bytes"):
        run(store.read("obj.bin", max_bytes=-1))


def test_hf_cap_stops_a_body_that_ignores_range(run: Any) -> None:
    """A server that answers 200 with an endless body to a ranged GET is cut at the cap."""
    sent = {"bytes": 0}

    async def resolve(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": "/cdn/m.json"})

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200)
        await resp.prepare(request)
        chunk = b"{" * (64 << 10)
        try:
            for _ in range(16 << 10):  # 1 GiB if nobody stops reading
                await resp.write(chunk)
                sent["bytes"] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    with Hostile() as hostile:
        hostile.on("HEAD", "/buckets/ns/name/resolve/p/manifests/000000000001.json", resolve)
        hostile.on("GET", "/cdn/m.json", endless)
        store = open_store("hf://buckets/ns/name/p", endpoint=hostile.url, token=False,
                           environ={}, retry_policy=RetryPolicy(attempts=1))
        assert isinstance(store, HfStore)
        started = time.monotonic()
        with pytest.raises(FormatError, match=r"manifests/000000000001.json: more than 1048576 "):
            run(store.read("manifests/000000000001.json", max_bytes=1 << 20), timeout_s=30)
        run(store.close())
        assert time.monotonic() - started < 10
        time.sleep(0.2)
    assert sent["bytes"] < 64 << 20  # stopped near the cap, far from 1 GiB
