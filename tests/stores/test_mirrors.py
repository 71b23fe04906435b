"""Mirrors (issue 37 items 1-2): data objects read through HTTP caches before the origin.

A real cache tier: nginx configured from ``deploy/nginx/``'s template in front of the local Hub
server (its resolve call answers 302 to a second origin, the CDN: the mirror follows it to the
final bytes) and in front of moto's S3 server. Replicas are real ``BucketReader`` s: the origin
must never see a second download of an object the mirror holds, and the bytes must rebuild the
trainer's weights. Mirrors that fail on purpose (corrupt bytes, nothing listening, a hang, a
trickle; ``tests/helpers/mirrorserver.py``) are each survived: the origin serves, nothing wrong is
returned, the outcome is counted and the mirror is skipped afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.helpers.transports import S3_CREDENTIALS, hub_origin
from vllm_deltasync.errors import ConfigError
from vllm_deltasync.format.layout import parse_data_path
from vllm_deltasync.format.reader import BucketReader
from vllm_deltasync.stores import open_store
from vllm_deltasync.stores.mirrors import MirrorOptions, check_mirror_urls
from vllm_deltasync.trainer.publisher import DeltaPublisher

SHAPES = {"layers.0.weight": (96, 64), "layers.1.weight": (96, 64), "head.weight": (32, 96)}
STEPS = 4


def _publish(url: str, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Steps 0..3 (an anchor, then deltas), several data files each; the newest weights."""
    gen = torch.Generator().manual_seed(7)
    weights = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}
    with DeltaPublisher(url, anchor_every=10, max_file_bytes=1 << 14,
                        store_options=options) as pub:
        for step in range(STEPS):
            for tensor in weights.values():
                flat = tensor.view(-1)
                flat[torch.randint(0, flat.numel(), (flat.numel() // 40,), generator=gen)] += 0.25
            pub.publish(step, weights)
        pub.flush()
    return {n: t.clone() for n, t in weights.items()}


def _same(state: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(state[n].view(-1).view(torch.int16), t.view(-1).view(torch.int16))
               for n, t in truth.items())


@pytest.fixture
def hf_bucket(hub: Any, make_hf_store: Callable[..., Any]) -> tuple[Any, dict[str, Any]]:
    """An hf:// store on the local Hub server and the store_options that reach it."""
    store = make_hf_store()
    options = {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
               "uploader": store._uploader, "part_size": 1 << 16}
    return store, options


def _replica(url: str, options: dict[str, Any], mirrors: list[str],
             mirror_options: MirrorOptions | None = None) -> BucketReader:
    return BucketReader(open_store(url, **options), mirror_urls=mirrors,
                        mirror_options=mirror_options)


async def _read(*readers: BucketReader) -> list[dict[str, torch.Tensor]]:
    try:
        return list(await asyncio.gather(*(r.read_full(STEPS - 1) for r in readers)))
    finally:
        for r in readers:
            await r.close()


def _data_requests(hub: Any, kind: str) -> dict[str, int]:
    """Data object key -> requests of ``kind`` (``resolve`` / ``cdn``) the Hub server saw."""
    counts: dict[str, int] = {}
    for r in hub.requests(kind):
        key = r["path"].split("/run/", 1)[-1]
        if parse_data_path(key) is not None:
            counts[key] = counts.get(key, 0) + 1
    return counts


def _outcomes(reader_store: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for (_, outcome), n in reader_store.stats.mirror_requests.items():
        out[outcome] = out.get(outcome, 0) + n
    return out


# ---------------------------------------------------------------- a real cache tier
def test_the_second_replica_downloads_from_the_cache_not_the_hub(
        hub: Any, hf_bucket: tuple[Any, dict[str, Any]], make_mirror: Callable[..., Any],
        run: Any) -> None:
    store, options = hf_bucket
    truth = _publish(store.url, options)
    mirror = make_mirror(*hub_origin(hub, store))
    hub.log.clear()

    first = _replica(store.url, options, [mirror.url])
    assert _same(run(_read(first))[0], truth)
    fetched = _data_requests(hub, "cdn")
    assert fetched and all(n == 1 for n in fetched.values()), fetched
    assert _data_requests(hub, "resolve") == fetched  # the mirror resolved each object once
    assert hub.cdn_auth_seen == 0  # the mirror's credential never went past the redirect

    # the second and third replicas, at once: every data byte from the cache
    second, third = (_replica(store.url, options, [mirror.url]) for _ in range(2))
    states = run(_read(second, third))
    assert all(_same(s, truth) for s in states)
    assert _data_requests(hub, "cdn") == fetched  # no second download of any object
    assert _data_requests(hub, "resolve") == fetched
    assert sorted(mirror.origin_fetches()) == sorted(fetched)
    assert _outcomes(second.store) == {"ok": _outcomes(second.store)["ok"]}
    # manifests never went through the mirror: every replica read them from the Hub
    assert not [k for k, _, _ in mirror.answers() if k.startswith("manifests/")]
    assert len([r for r in hub.requests("resolve") if "/manifests/" in r["path"]]) >= 3 * STEPS


def test_a_cache_in_front_of_s3_serves_the_second_replica(
        make_s3_store: Callable[..., Any], make_mirror: Callable[..., Any], run: Any) -> None:
    store = make_s3_store()
    options = {"endpoint_url": store.endpoint_url, "region_name": "us-east-1",
               "addressing_style": "path", **S3_CREDENTIALS}
    truth = _publish(store.url, options)
    # the mirror reads without signing: a bucket policy lets anyone read data/ (docs/transports.md)
    run(_let_anyone_read_data(store))
    mirror = make_mirror(f"{store.endpoint_url}/{store.bucket}/{store.prefix}/")
    first = _replica(store.url, options, [mirror.url])
    assert _same(run(_read(first))[0], truth)
    fetched = mirror.origin_fetches()
    assert fetched and len(fetched) == len(set(fetched))
    second = _replica(store.url, options, [mirror.url])
    assert _same(run(_read(second))[0], truth)
    assert mirror.origin_fetches() == fetched  # the origin saw no second download
    assert {s for _, _, s in mirror.answers()[-len(fetched):]} == {"HIT"}


async def _let_anyone_read_data(store: Any) -> None:
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
        "Resource": f"arn:aws:s3:::{store.bucket}/{store.prefix}/data/*"}]}
    client = await store._s3()
    await client.put_bucket_policy(Bucket=store.bucket, Policy=json.dumps(policy))


# ---------------------------------------------------------------- mirrors that fail
def _hub_source(hub: Any, store: Any) -> Callable[[str], bytes | None]:
    return lambda key: hub.buckets[store.bucket_id].get(f"{store.prefix}/{key}")


def test_a_mirror_serving_corrupt_bytes_is_caught_backed_off_and_the_hub_serves(
        hub: Any, hf_bucket: tuple[Any, dict[str, Any]], make_bad_mirror: Callable[..., Any],
        run: Any, caplog: pytest.LogCaptureFixture) -> None:
    store, options = hf_bucket
    truth = _publish(store.url, options)
    bad = make_bad_mirror(_hub_source(hub, store), "corrupt")
    reader = _replica(store.url, options, [bad.url])

    async def twice() -> tuple[dict[str, torch.Tensor], int, dict[str, torch.Tensor]]:
        try:
            first = await reader.read_full(STEPS - 1)
            asked = len(bad.requests)
            return first, asked, await reader.read_full(STEPS - 1)  # every object once more
        finally:
            await reader.close()

    first, asked, second = run(twice())
    assert _same(first, truth) and _same(second, truth)  # nothing corrupt came through
    outcomes = _outcomes(reader.store)
    assert outcomes.get("corrupt", 0) >= 1, outcomes
    lines = [r.getMessage() for r in caplog.records if "skipped for" in r.getMessage()]
    assert len(lines) == 1 and bad.url in lines[0] and "corrupt" in lines[0]
    assert len(bad.requests) == asked  # skipped during its back-off
    assert not [r for r in bad.requests if r["auth"] or r["cookie"]]  # no credentials
    assert not [r for r in bad.requests if r["key"].startswith("manifests/")]


@pytest.mark.parametrize("mode", ["dead", "hang", "trickle"])
def test_a_dead_hanging_or_slow_mirror_is_survived(
        hub: Any, hf_bucket: tuple[Any, dict[str, Any]], make_bad_mirror: Callable[..., Any],
        run: Any, mode: str, request: pytest.FixtureRequest) -> None:
    store, options = hf_bucket
    truth = _publish(store.url, options)
    if mode == "dead":
        url = request.getfixturevalue("dead_mirror")
    else:
        url = make_bad_mirror(_hub_source(hub, store), mode, trickle_bytes_per_s=200).url
    bounds = MirrorOptions(request_timeout_s=0.5, min_bytes_per_s=4096, rate_window_s=0.5)
    reader = _replica(store.url, options, [url], bounds)
    began = time.monotonic()
    assert _same(run(_read(reader))[0], truth)
    assert time.monotonic() - began < 15
    outcomes = _outcomes(reader.store)
    expected = {"dead": "error", "hang": "timeout", "trickle": "slow"}[mode]
    assert outcomes.get(expected, 0) >= 1 and not outcomes.get("ok"), outcomes


# ---------------------------------------------------------------- what a mirror URL may be
@pytest.mark.parametrize("url", [
    "http://user:s3cr3t-value@cache.local:8080/run",
    "https://cache.local/run?token=s3cr3t-value",
    "ftp://cache.local/run",
    "cache.local/run",
])
def test_a_mirror_url_with_credentials_or_not_http_is_refused_unshown(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_mirror_urls(f"http://ok.local:8080, {url}")
    assert "s3cr3t-value" not in str(info.value)
    from vllm_deltasync.config import SyncConfig

    with pytest.raises(ConfigError) as info:
        SyncConfig(url="file:///b", mirror_urls=(url,))
    assert "s3cr3t-value" not in str(info.value) and "mirror_urls" in str(info.value)


def test_mirror_urls_from_a_variable() -> None:
    from vllm_deltasync.config import SyncConfig

    cfg = SyncConfig.from_sources({}, {"VLLM_DELTASYNC_URL": "file:///b",
                                       "VLLM_DELTASYNC_MIRRORS": "http://a:80/x/, https://b/y"})
    assert cfg.mirror_urls == ("http://a:80/x", "https://b/y")
