"""Fault matrix, hostile HTTP (items 4 and 7, and the listing/size rows of item 8): a real
aiohttp server on loopback misbehaves on purpose (redirect loops, redirects to private and
link-local addresses, trickling and endless bodies, HTML listings, bad sizes); the local Hub
server's feed sends garbage or goes silent. Nothing is followed that the rule forbids, every
failure is bounded in time and requests, and the CLI says it in one line.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web

from tests.helpers.faults import Hostile, cli, one_line_error
from vllm_deltasync._urls import redirect_allowed
from vllm_deltasync.errors import StoreError, TransientStoreError
from vllm_deltasync.server.worker.discovery import StepWatcher
from vllm_deltasync.stores import RetryPolicy, open_store
from vllm_deltasync.stores.hf import HfStore

FAST = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)
RESOLVE = "/buckets/ns/name/resolve/p/data/x.bin"


def _store(hostile: Hostile, **options: Any) -> HfStore:
    store = open_store("hf://buckets/ns/name/p", endpoint=hostile.url, token="hf_x", environ={},
                       retry_policy=FAST, **options)
    assert isinstance(store, HfStore)
    return store


def _redirect(location: str) -> Any:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": location})
    return handler


def test_redirect_loop_is_capped(hostile: Hostile, run: Any) -> None:
    hostile.on("HEAD", RESOLVE, _redirect("/cdn/x"))
    hostile.on("GET", "/cdn/x", _redirect("/cdn/x"))  # points to itself
    store = _store(hostile)
    with pytest.raises(StoreError, match="more than 10 redirects"):
        run(store.read("data/x.bin"))
    run(store.close())
    assert len(hostile.log) <= 12  # one resolve + at most 10 hops + slack, not 969
    assert store.stats.requests.get(("redirect", "refused")) == 1


@pytest.mark.parametrize("target", ["169.254.169.254", "10.0.0.1"])
def test_redirect_to_private_or_link_local_address_is_refused(hostile: Hostile, run: Any,
                                                              target: str) -> None:
    hostile.on("HEAD", RESOLVE, _redirect(f"http://{target}/latest/meta-data/"))
    store = _store(hostile)
    started = time.monotonic()
    with pytest.raises(StoreError, match="refused"):
        run(store.read("data/x.bin"))
    run(store.close())
    assert time.monotonic() - started < 5  # refused before any connection, never retried
    assert [m for m, _ in hostile.log] == ["HEAD"]


def test_redirect_rule_table() -> None:
    assert redirect_allowed("loopback", "loopback")          # local test servers
    assert redirect_allowed("private", "private")            # on-premises S3, MinIO
    assert redirect_allowed("private", "public")
    assert not redirect_allowed("public", "private")
    assert not redirect_allowed("public", "link-local")      # cloud metadata service
    assert not redirect_allowed("public", "loopback")
    assert not redirect_allowed("loopback", "link-local")
    assert redirect_allowed("public", "private", ("private",))  # the option allows more


def _trickle(pause_s: float, total: int, step: int = 1) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=206, headers={
            "Content-Range": f"bytes 0-{total - 1}/{total}", "Content-Length": str(total)})
        await resp.prepare(request)
        try:
            for _ in range(0, total, step):
                await resp.write(b"x" * step)
                await asyncio.sleep(pause_s)
        except (ConnectionError, asyncio.CancelledError):
            pass
        return resp
    return handler


def test_trickling_body_is_cut_by_the_minimum_rate(hostile: Hostile, run: Any) -> None:
    hostile.on("HEAD", RESOLVE, _redirect("/cdn/x"))
    hostile.on("GET", "/cdn/x", _trickle(0.5, 4096))  # one byte every 0.5 s
    store = _store(hostile, min_bytes_per_s=1024, rate_window_s=0.5, request_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(TransientStoreError, match="min_bytes_per_s"):
        run(store.read("data/x.bin"))
    run(store.close())
    assert time.monotonic() - started < 15  # bounded (loose: the machine is shared)
    assert store.stats.requests.get(("read", "error"), 0) + store.stats.requests.get(("read", "resumed"), 0) >= 1


def test_endless_fast_body_is_cut_by_the_request_cap(hostile: Hostile, run: Any) -> None:
    hostile.on("HEAD", RESOLVE, _redirect("/cdn/x"))
    hostile.on("GET", "/cdn/x", _trickle(0.01, 1 << 30, step=1 << 14))  # 1.6 MB/s for 10 min
    store = _store(hostile, max_request_s=0.5, min_bytes_per_s=None, part_size=1 << 31)
    started = time.monotonic()
    with pytest.raises(TransientStoreError, match="max_request_s"):
        run(store.read("data/x.bin"))
    run(store.close())
    assert time.monotonic() - started < 15  # bounded (loose: the machine is shared)


def test_events_feed_redirect_is_not_followed(hostile: Hostile, run: Any) -> None:
    hostile.on("GET", "/api/buckets/ns/name/events", _redirect("http://169.254.169.254/"))
    store = _store(hostile)

    async def consume() -> None:
        async for _ in store.changes():
            pass

    with pytest.raises(StoreError, match="redirect"):
        run(consume())
    run(store.close())
    assert len(hostile.log) == 1


def _html(request: web.Request) -> Any:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="<html><body>Welcome to the hotel wifi</body></html>",
                            content_type="text/html")
    return handler


def test_html_listing_is_one_cli_line(hostile: Hostile, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    hostile.on("GET", "/api/buckets/ns/name/tree/p/manifests", _html(None))  # type: ignore[arg-type]
    monkeypatch.setenv("HF_ENDPOINT", hostile.url)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    rc, _, err = cli(capsys, "inspect", "hf://buckets/ns/name/p")
    one_line_error(rc, err)
    assert "not the bucket API's JSON" in err


def test_bad_size_in_listing_and_header_is_refused(hostile: Hostile, run: Any,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    async def tree(request: web.Request) -> web.Response:
        return web.json_response([{"type": "file", "path": "p/manifests/000000000001.json",
                                   "size": "-12e99"}])

    async def head(request: web.Request) -> web.Response:
        return web.Response(headers={"X-Linked-Size": "lots"})

    hostile.on("GET", "/api/buckets/ns/name/tree/p/manifests", tree)
    hostile.on("HEAD", "/buckets/ns/name/resolve/p/manifests/000000000001.json", head)
    store = _store(hostile)
    with pytest.raises(StoreError, match="bad size"):
        run(store.list("manifests/"))
    with pytest.raises(StoreError, match="bad size"):
        run(store.stat("manifests/000000000001.json"))
    run(store.close())
    monkeypatch.setenv("HF_ENDPOINT", hostile.url)
    rc, _, err = cli(capsys, "verify", "hf://buckets/ns/name/p")
    one_line_error(rc, err)


def test_status_of_something_that_is_not_our_metrics(hostile: Hostile,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    hostile.on("GET", "/metrics", _html(None))  # type: ignore[arg-type]

    async def garbage(request: web.Request) -> web.Response:
        return web.Response(body=b"\x00\xff{{{ not prometheus\nfoo{bar=\"\n")

    hostile.on("GET", "/other", garbage)
    rc, out, err = cli(capsys, "status", hostile.url, hostile.url + "/other")
    assert rc == 1 and "Traceback" not in out + err
    assert len(out.strip().splitlines()) == 2 and all("unreachable" in line for line in out.splitlines())


# ---------------------------------------------------------------- item 7: the events feed
def _publish_manifest(hub: Any, bucket_id: str, step: int) -> None:
    hub.put(bucket_id, f"run/manifests/{step:012d}.json", b"{}")


def test_malformed_event_does_not_stop_the_feed(hub: Any, make_hf_store: Any, run: Any) -> None:
    hub.faults.events_garbage = True
    store = make_hf_store()
    bucket_id = store.bucket_id
    _publish_manifest(hub, bucket_id, 0)
    watcher = StepWatcher(store, probe_interval_s=30, listing_interval_s=60,
                          events_min_connect_interval_s=0.05)

    async def go() -> int | None:
        first = await watcher.wait_for_new(None, timeout_s=5)
        assert first == 0
        await asyncio.sleep(0.3)  # the feed got its garbage event by now
        hub.put(bucket_id, "run/manifests/000000000001.json", b"{}")
        try:
            return await watcher.wait_for_new(0, timeout_s=5)
        finally:
            await watcher.close()

    assert run(go()) == 1
    assert watcher.stats.events_malformed >= 1
    assert store.stats.requests[("events", "malformed")] >= 1  # exported: op, outcome labels
    assert watcher.stats.events_received >= 1  # step 1 came through the same feed


def test_silent_feed_is_noticed_and_discovery_falls_back(hub: Any, make_hf_store: Any, run: Any) -> None:
    hub.faults.events_silent = True
    hub.faults.events_max_s = 30
    store = make_hf_store()
    bucket_id = store.bucket_id
    _publish_manifest(hub, bucket_id, 0)
    watcher = StepWatcher(store, probe_interval_s=0.1, listing_interval_s=60,
                          events_min_connect_interval_s=0.05, events_check_s=0.3,
                          events_idle_s=60, events_retry_s=60)

    async def go() -> tuple[int | None, float]:
        assert await watcher.wait_for_new(None, timeout_s=5) == 0
        await asyncio.sleep(0.2)
        _publish_manifest(hub, bucket_id, 1)
        started = time.monotonic()
        try:
            return await watcher.wait_for_new(0, timeout_s=10), time.monotonic() - started
        finally:
            await watcher.close()

    found, waited = run(go())
    assert found == 1 and waited < 3  # not the 60 s listing interval
    assert watcher.stats.events_silent >= 1
    assert store.stats.requests[("events", "silent")] >= 1


def test_feed_silent_past_the_idle_limit_reconnects(hub: Any, make_hf_store: Any, run: Any) -> None:
    hub.faults.events_silent = True
    store = make_hf_store()
    watcher = StepWatcher(store, probe_interval_s=0.1, listing_interval_s=60,
                          events_min_connect_interval_s=0.05, events_idle_s=0.3)

    async def go() -> None:
        await watcher.wait_for_new(None, timeout_s=1.5)
        await watcher.close()

    run(go())
    assert watcher.stats.events_silent >= 1 and watcher.stats.events_connects >= 2


def test_trickling_s3_body_is_cut_by_the_minimum_rate(hostile: Hostile, run: Any) -> None:
    """The same bound on s3:// (moto cannot trickle: the loopback server plays S3)."""
    hostile.on("GET", "/bkt/p/data/x.bin", _trickle(0.5, 4096))
    store = open_store("s3://bkt/p", endpoint_url=hostile.url, region_name="us-east-1",
                       addressing_style="path", aws_access_key_id="k", aws_secret_access_key="s",
                       retry_policy=FAST, min_bytes_per_s=1024, rate_window_s=0.5)
    started = time.monotonic()
    with pytest.raises(TransientStoreError, match="min_bytes_per_s"):
        run(store.read("data/x.bin", 0, 4096))
    run(store.close())
    assert time.monotonic() - started < 15
