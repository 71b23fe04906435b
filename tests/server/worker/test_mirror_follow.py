"""A rank following through a mirror, and a fleet not downloading a step all at once (issue 37
items 1 and 3).

The real poller (``Follower``: the rank's ``Poller`` and ``SyncState``) follows a bucket on the
local Hub server with ``mirror_urls`` set, as ``VLLM_DELTASYNC_MIRRORS`` sets it in a server:
through a real nginx cache (deploy/nginx/), or through a mirror that serves corrupt bytes. The
evidence is the live weights (equal to the trainer's, bit for bit), the Hub server's log (what
reached the origin) and the rank's status counters as the engine core exports them
(``deltasync_mirror_requests_total``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from tests.helpers.follow import Follower, Weights, publish_steps, seeded_weights
from tests.helpers.transports import hub_origin
from vllm_deltasync import DeltaPublisher
from vllm_deltasync.config import SyncConfig
from vllm_deltasync.format.layout import parse_data_path
from vllm_deltasync.server import metrics
from vllm_deltasync.server.messages import RankStatus
from vllm_deltasync.server.worker import bucket as bucket_module
from vllm_deltasync.server.worker import poller as poller_module


@pytest.fixture
def bucket(hub: Any, make_hf_store: Callable[..., Any]) -> tuple[Any, dict[str, Any]]:
    store = make_hf_store()
    return store, {"endpoint": hub.endpoint, "token": hub.token, "environ": {},
                   "uploader": store._uploader, "part_size": 1 << 16}


def _publish_steps(store: Any, options: dict[str, Any], steps: range,
                   truth: dict[int, Weights], state: list[Any]) -> None:
    """Steps of one run; ``state`` keeps (weights, generator) between calls."""
    if not state:
        state += [seeded_weights(5), torch.Generator().manual_seed(6)]
    with DeltaPublisher(store.url, anchor_every=10, store_options=options) as pub:
        publish_steps(pub, state[0], state[1], steps, truth)


def _zeros(truth: dict[int, Weights]) -> Weights:
    return {k: torch.zeros_like(v) for k, v in truth[0].items()}


def _cdn_data(hub: Any) -> list[dict[str, Any]]:
    return [r for r in hub.requests("cdn")
            if parse_data_path(r["path"].split("/run/", 1)[-1]) is not None]


def _exported(follower: Follower) -> dict[tuple[str, str], float]:
    """``deltasync_mirror_requests_total`` by (mirror, outcome), as the engine core exports the
    rank's status."""
    m = metrics.SyncMetrics(registry=CollectorRegistry())
    m.update([RankStatus({"policy": dataclasses.replace(follower.poller.status(), model="policy")},
                         "policy")])
    return {(s.labels["mirror"], s.labels["outcome"]): s.value
            for family in m.registry.collect() for s in family.samples
            if s.name == "deltasync_mirror_requests_total"}


def test_ranks_follow_through_a_cache_and_the_second_downloads_nothing_from_the_hub(
        hub: Any, bucket: tuple[Any, dict[str, Any]], make_mirror: Callable[..., Any],
        follower_factory: Callable[..., Follower]) -> None:
    store, options = bucket
    truth: dict[int, Weights] = {}
    _publish_steps(store, options, range(4), truth, [])
    mirror = make_mirror(*hub_origin(hub, store))
    hub.log.clear()
    first = follower_factory(store.url, _zeros(truth), store_options=options,
                             mirror_urls=(mirror.url,), fetch_jitter_s=0)
    first.follow_until(lambda: first.at(3, truth[3]))
    fetched = sorted(r["path"] for r in _cdn_data(hub))
    assert fetched and len(fetched) == len(set(fetched))

    second = follower_factory(store.url, _zeros(truth), store_options=options,
                              mirror_urls=(mirror.url,), fetch_jitter_s=0)
    second.follow_until(lambda: second.at(3, truth[3]))
    assert sorted(r["path"] for r in _cdn_data(hub)) == fetched  # no second download
    exported = _exported(second)
    assert exported[(mirror.url, "ok")] >= 1
    assert not [k for k, v in exported.items() if k[1] != "ok" and v]


def test_a_rank_behind_a_corrupt_mirror_applies_only_verified_bytes(
        hub: Any, bucket: tuple[Any, dict[str, Any]], make_bad_mirror: Callable[..., Any],
        follower_factory: Callable[..., Follower]) -> None:
    store, options = bucket
    truth: dict[int, Weights] = {}
    _publish_steps(store, options, range(4), truth, [])
    bad = make_bad_mirror(lambda key: hub.buckets[store.bucket_id].get(f"{store.prefix}/{key}"))
    f = follower_factory(store.url, _zeros(truth), store_options=options,
                         mirror_urls=(bad.url,), fetch_jitter_s=0)
    f.follow_until(lambda: f.at(3, truth[3]))  # bit for bit: nothing corrupt was applied
    assert _exported(f)[(bad.url, "corrupt")] >= 1
    assert f.poller.status().last_error is None
    assert not [r for r in bad.requests if r["auth"] or r["key"].startswith("manifests/")]


# ---------------------------------------------------------------- no thundering herd
def test_the_jitter_rule() -> None:
    def rule(url: str, **kw: Any) -> float:
        cfg = SyncConfig(url=url, **kw)
        return bucket_module.fetch_jitter_s(cfg, url.split("://")[0])

    assert rule("hf://buckets/a/b", poll_interval_s=2.0) == 2.0  # one poll interval
    assert rule("s3://b/p", poll_interval_s=30.0) == 5.0  # at most 5 s
    assert rule("file:///b", poll_interval_s=2.0) == 0.0  # no remote origin to spare
    assert rule("file:///b", fetch_jitter_s=0.7) == 0.7
    assert rule("hf://buckets/a/b", fetch_jitter_s=0) == 0.0


@pytest.mark.parametrize("jitter_s", [0.0, 1.5])
def test_a_discovered_step_is_downloaded_after_a_bounded_random_wait(
        hub: Any, bucket: tuple[Any, dict[str, Any]], follower_factory: Callable[..., Follower],
        monkeypatch: pytest.MonkeyPatch, jitter_s: float) -> None:
    """The wait is drawn in [0, fetch_jitter_s): pinned here to its largest value, the step's
    data is asked for that long after its manifest was read, and never later."""
    store, options = bucket
    truth: dict[int, Weights] = {}
    state: list[Any] = []
    _publish_steps(store, options, range(2), truth, state)
    f = follower_factory(store.url, _zeros(truth), store_options=options,
                         fetch_jitter_s=jitter_s, poll_interval_s=0.1)
    f.follow_until(lambda: f.at(1, truth[1]))
    monkeypatch.setattr(poller_module.random, "uniform", lambda a, b: b)
    hub.log.clear()
    _publish_steps(store, options, range(2, 3), truth, state)
    f.follow_until(lambda: f.at(2, truth[2]))
    seen = min(r["t"] for r in hub.requests("resolve")
               if r["path"].endswith("manifests/000000000002.json") and r["method"] == "HEAD")
    fetched = min(r["t"] for r in _cdn_data(hub))
    waited = fetched - seen
    assert jitter_s <= waited < jitter_s + 1.0, waited
