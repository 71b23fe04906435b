"""hf:// against the local Hub bucket server: token hygiene, rate limits, faults, resume, paging.

Uploads go through the injected test uploader (see conftest.py): the Xet upload protocol
cannot run offline, so ``HfStore``'s ``uploader=`` seam is the one part not exercised here.
Deletes run through ``huggingface_hub.batch_bucket_files`` against the local server.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import aiohttp
import pytest

from vllm_deltasync.errors import (
    AuthError,
    ConfigError,
    NotFoundError,
    RateLimitedError,
    TransientStoreError,
)
from vllm_deltasync.stores import open_store
from vllm_deltasync.stores._retry import RetryPolicy
from vllm_deltasync.stores.hf import HfStore, parse_hf_url, resolve_token

FAST = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


def test_url_forms() -> None:
    assert parse_hf_url("hf://buckets/ns/name/a/b/") == ("ns/name", "a/b")
    assert parse_hf_url("hf://buckets/ns/name") == ("ns/name", "")
    with pytest.raises(ConfigError, match="hf://buckets/<namespace>/<name>"):
        open_store("hf://ns/name")


def test_token_chain_order() -> None:
    assert resolve_token("explicit", {"HF_TOKEN": "env"}) == "explicit"
    assert resolve_token(None, {"HF_TOKEN": "env"}) == "env"
    assert resolve_token(False, {"HF_TOKEN": "env"}) is None


def test_token_never_reaches_the_cdn(hub: Any, hf_store: HfStore, run: Any) -> None:
    data = os.urandom(300_000)  # several parts: many CDN requests
    run(hf_store.write("data/w.bin", data))
    assert run(hf_store.read("data/w.bin")) == data
    cdn = hub.requests("cdn")
    assert len(cdn) >= 4 and not any(r["auth"] for r in cdn)
    assert hub.cdn_auth_seen == 0
    assert all(r["auth"] for r in hub.requests("resolve"))


def test_cdn_really_rejects_authorization(hub: Any, hf_store: HfStore, run: Any) -> None:
    """The check above could fail: the CDN origin refuses a request that carries the token."""
    run(hf_store.write("data/w.bin", b"payload"))

    async def naive_get() -> int:
        headers = {"Authorization": f"Bearer {hub.token}"}
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                hf_store._resolve_url("data/w.bin"), headers=headers, allow_redirects=False
            ) as r,
        ):
            location = r.headers["Location"]
        async with aiohttp.ClientSession() as session, session.get(location, headers=headers) as r:
            return r.status

    assert run(naive_get()) == 400
    assert hub.cdn_auth_seen == 1


def test_aiohttp_itself_drops_the_token_on_the_cross_origin_redirect(
    hub: Any, hf_store: HfStore, run: Any
) -> None:
    """The dependency floor (aiohttp >= 3.13.4) matters to users who fetch with plain aiohttp."""
    run(hf_store.write("data/w.bin", b"payload"))

    async def follow() -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {hub.token}"}
        async with (
            aiohttp.ClientSession() as session,
            session.get(hf_store._resolve_url("data/w.bin"), headers=headers) as r,
        ):
            return r.status, await r.read()

    assert run(follow()) == (200, b"payload")
    assert hub.cdn_auth_seen == 0


def test_token_not_in_repr_errors_or_logs(
    hub: Any, make_hf_store: Any, run: Any, caplog: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    store = make_hf_store(retry_policy=FAST)
    hub.faults.fail_next = 2
    run(store.write("a", b"x"))
    errors = []
    for call in (store.read("missing"), make_hf_store(token="wrong-token").list()):
        try:
            run(call)
        except Exception as exc:
            errors.append(exc)
    assert [type(e) for e in errors] == [NotFoundError, AuthError]
    texts = [repr(store), str(store), store.url, *map(str, errors), caplog.text]
    assert not any(hub.token in text for text in texts)
    assert "HF_TOKEN" in str(errors[1])


def test_error_codes_map_to_classes(hub: Any, make_hf_store: Any, run: Any) -> None:
    store = make_hf_store(retry_policy=FAST)
    hub.buckets.pop(store.bucket_id)
    with pytest.raises(NotFoundError, match="bucket 'tester/"):
        run(store.list())
    with pytest.raises(NotFoundError, match="bucket 'tester/"):
        run(store.read("x"))
    with pytest.raises(NotFoundError, match="bucket 'tester/"):
        run(store.stat("x"))
    anon = make_hf_store(token=False)
    with pytest.raises(AuthError, match="401"):
        run(anon.stat("x"))


def test_5xx_is_retried_with_backoff(hub: Any, make_hf_store: Any, run: Any) -> None:
    store = make_hf_store(retry_policy=FAST)
    run(store.write("m/1", b"1"))
    hub.faults.fail_next = 3
    assert [o.path for o in run(store.list())] == ["m/1"]
    assert store.stats.requests[("list", "error")] == 3
    hub.faults.fail_next = 10
    with pytest.raises(TransientStoreError):
        run(store.list())
    assert hub.faults.fail_next == 10 - FAST.attempts


def test_429_is_honoured(hub: Any, make_hf_store: Any, run: Any) -> None:
    """After a 429 advertising a reset, no API request reaches the server before that reset."""
    store = make_hf_store(retry_policy=RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05))
    run(store.write("m/1", b"1"))
    hub.quotas["api"] = hub.quotas["api"].__class__(limit=3, window_s=1.5)

    async def many() -> list[int]:
        return [len(await store.list()) for _ in range(5)]

    assert run(many()) == [1] * 5
    api = hub.requests("api")
    limited = [r for r in api if r["status"] == 429]
    assert limited, "the quota should have been hit"
    for hit in limited:
        later = [r["t"] for r in api if r["t"] > hit["t"]]
        assert later and min(later) >= hit["reset_at"] - 0.01
    assert store.stats.requests[("list", "rate_limited")] == len(limited)


def test_429_with_reset_beyond_patience_raises(hub: Any, make_hf_store: Any, run: Any) -> None:
    store = make_hf_store(retry_policy=RetryPolicy(attempts=3, max_rate_limit_wait_s=5.0))
    hub.quotas["api"] = hub.quotas["api"].__class__(limit=0, window_s=120.0)
    with pytest.raises(RateLimitedError) as caught:
        run(store.list())
    assert 100 < caught.value.retry_after_s <= 120
    assert len(hub.requests("api")) == 1  # no retry before the advertised reset


def test_dropped_connection_resumes_without_redownloading(
    hub: Any, make_hf_store: Any, run: Any
) -> None:
    store = make_hf_store(part_size=4 << 20)  # one stream for the whole file
    data = os.urandom(1_000_000)
    run(store.write("data/f.bin", data))
    hub.log.clear()
    hub.faults.truncate_next, hub.faults.truncate_after = 2, 300_000
    assert run(store.read("data/f.bin")) == data
    cdn = hub.requests("cdn")
    assert [r["range"] for r in cdn] == [
        "bytes=0-4194303",
        "bytes=300000-4194303",
        "bytes=600000-4194303",
    ]
    assert hub.cdn_bytes_served == len(data)  # nothing was fetched twice
    assert store.resumed_bytes == 300_000 + 600_000
    assert len(hub.requests("resolve")) == 1


def test_parallel_ranges_use_one_resolve(hub: Any, make_hf_store: Any, run: Any) -> None:
    store = make_hf_store(part_size=1 << 16, max_parallel_parts=4)
    data = os.urandom(10 * (1 << 16) + 5)
    run(store.write("data/p.bin", data))
    hub.log.clear()
    assert run(store.read("data/p.bin")) == data
    assert len(hub.requests("resolve")) == 1
    assert len(hub.requests("cdn")) == 11
    assert hub.cdn_bytes_served == len(data)


def test_slow_body_times_out_and_resumes(hub: Any, make_hf_store: Any, run: Any) -> None:
    """A stalled body times out; each retry asks only for the bytes still missing."""
    policy = RetryPolicy(attempts=8, base_delay_s=0.01, max_delay_s=0.05)
    store = make_hf_store(part_size=4 << 20, request_timeout_s=0.3, retry_policy=policy)
    data = os.urandom(200_000)
    run(store.write("data/s.bin", data))
    hub.log.clear()
    hub.faults.cdn_bytes_per_s = 100_000  # one 64 KiB chunk, then a 0.65 s stall: timeout
    assert run(store.read("data/s.bin")) == data
    starts = [int(r["range"].split("=")[1].split("-")[0]) for r in hub.requests("cdn")]
    assert len(starts) >= 3 and starts == sorted(set(starts)) and starts[0] == 0
    assert all(start % (64 << 10) == 0 for start in starts)  # exactly what had arrived
    assert store.stats.requests[("read", "resumed")] == len(starts) - 1
    hub.faults.cdn_bytes_per_s = None
    hub.faults.truncate_next, hub.faults.truncate_after = 100, 0  # no progress at all
    with pytest.raises(TransientStoreError, match="connection failed"):
        run(make_hf_store(bucket_id=store.bucket_id, retry_policy=FAST).read("data/s.bin"))
    assert hub.faults.truncate_next == 100 - FAST.attempts


def test_stat_uses_the_resolve_quota(hub: Any, hf_store: HfStore, run: Any) -> None:
    run(hf_store.write("manifests/000000000003.json", b"{}"))
    hub.log.clear()
    info = run(hf_store.stat("manifests/000000000003.json"))
    assert info is not None and info.size == 2 and info.etag
    assert run(hf_store.stat("manifests/000000000004.json")) is None
    assert [r["kind"] for r in hub.log] == ["resolve", "resolve"]


def test_paths_info_and_delete_via_batch_api(hub: Any, hf_store: HfStore, run: Any) -> None:
    run(hf_store.write_many([("d/1", b"1"), ("d/2", b"22")]))
    assert [(o.path, o.size) for o in run(hf_store.paths_info(["d/1", "d/2", "d/3"]))] == [
        ("d/1", 1),
        ("d/2", 2),
    ]
    run(hf_store.delete(["d/1", "d/3"]))
    assert "run/d/1" not in hub.buckets[hf_store.bucket_id]
    batch = [r for r in hub.requests("api") if r["path"].endswith("/batch")]
    assert len(batch) == 1 and batch[0]["auth"]


def test_ranged_reads_of_one_object_share_a_resolve(hub: Any, make_hf_store: Any,
                                                    run: Any) -> None:
    """A v2 reader range-reads the chunks it needs from one file: one resolve per file (the
    signed CDN URL is reused for LOCATED_TTL_S), one CDN request per range."""
    store = make_hf_store()
    data = os.urandom(50_000)
    run(store.write("data/r.safetensors", data))
    hub.log.clear()
    assert run(store.read("data/r.safetensors", 0, 100)) == data[:100]
    assert run(store.read("data/r.safetensors", 20_000, 20_500)) == data[20_000:20_500]
    assert run(store.read("data/r.safetensors", 49_000)) == data[49_000:]
    assert len(hub.requests("resolve")) == 1
    assert len(hub.requests("cdn")) == 3
