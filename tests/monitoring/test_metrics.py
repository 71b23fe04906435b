"""SyncMetrics / WorkerStats / MetricsServer against fresh registries and a real HTTP server."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.helpers.monitoring import parse_exposition, rank_status, sample
from tests.helpers.net import http_get
from vllm_deltasync.errors import ChainError, ConfigError
from vllm_deltasync.server import metrics
from vllm_deltasync.server.endpoint import MetricsServer
from vllm_deltasync.server.engine.coordinator import parse_statuses
from vllm_deltasync.server.messages import MessageError
from vllm_deltasync.stores.base import StoreStats


def status(rank: int, applied: int | None, newest: int | None, stats: metrics.WorkerStats,
           store: StoreStats | None = None, **extra: Any) -> Any:
    return rank_status(rank, applied_step=applied, staged_step=applied, newest_step=newest,
                       counters=stats.snapshot(store), **extra)


def test_every_name_follows_the_conventions(registry: CollectorRegistry) -> None:
    metrics.SyncMetrics(registry=registry, bucket_url="file:///b", format_version=1)
    names = [f.name for f in registry.collect()]
    assert names and all(n.startswith("deltasync_") for n in names)
    for family in registry.collect():
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        assert "since" not in family.name and "ms" not in family.name.split("_")
        for s in family.samples:
            assert not {"step", "file", "path"} & set(s.labels), s


def test_gauges_follow_status_per_rank(registry: CollectorRegistry) -> None:
    m = metrics.SyncMetrics(registry=registry)
    a, b = metrics.WorkerStats(), metrics.WorkerStats()
    m.update([status(0, 7, 9, a, applied_published_at=100.0, newest_published_at=130.5,
                     staged_bytes=4096, last_discovery_at=140.0),
              status(1, None, 9, b)], now=150.0)
    assert sample(registry, "deltasync_applied_step", model="policy", rank="0") == 7
    assert sample(registry, "deltasync_steps_behind", model="policy", rank="0") == 2
    assert sample(registry, "deltasync_applied_step", model="policy", rank="1") == -1
    assert sample(registry, "deltasync_steps_behind", model="policy", rank="1") == 10
    assert sample(registry, "deltasync_newest_publish_timestamp_seconds", model="policy", rank="0") == 130.5
    assert sample(registry, "deltasync_applied_publish_timestamp_seconds", model="policy", rank="0") == 100.0
    assert sample(registry, "deltasync_staged_bytes", model="policy", rank="0") == 4096
    assert sample(registry, "deltasync_last_discovery_timestamp_seconds", model="policy", rank="0") == 140.0
    assert sample(registry, "deltasync_applied_publish_timestamp_seconds", model="policy", rank="1") is None
    assert sample(registry, "deltasync_status_timestamp_seconds") == 150.0


def test_cumulative_counters_become_exact_increments(registry: CollectorRegistry) -> None:
    m = metrics.SyncMetrics(registry=registry)
    stats, store = metrics.WorkerStats(), StoreStats()
    stats.add_download("anchor", 1000, 0.2)
    store.count("list", "ok")
    m.update([status(0, None, 0, stats, store)])
    m.update([status(0, None, 0, stats, store)])  # the same snapshot twice counts once
    stats.add_download("delta", 30, 0.01)
    stats.add_download("delta", 12, 0.02)
    stats.add_apply("delta", 0.003, 17)
    store.count("read", "rate_limited", 2)
    m.update([status(0, 1, 1, stats, store)])
    assert sample(registry, "deltasync_downloaded_bytes_total", model="policy", rank="0", kind="anchor") == 1000
    assert sample(registry, "deltasync_downloaded_bytes_total", model="policy", rank="0", kind="delta") == 42
    assert sample(registry, "deltasync_changed_elements_total", model="policy", rank="0") == 17
    assert sample(registry, "deltasync_applied_steps_total", model="policy", rank="0", kind="delta") == 1
    assert sample(registry, "deltasync_download_duration_seconds_count", model="policy", rank="0") == 3
    assert sample(registry, "deltasync_download_duration_seconds_sum", model="policy", rank="0") == pytest.approx(0.23)
    assert sample(registry, "deltasync_apply_duration_seconds_count", model="policy", rank="0") == 1
    labels = {"model": "policy", "rank": "0", "operation": "read"}
    assert sample(registry, "deltasync_store_requests_total", outcome="rate_limited", **labels) == 2
    assert sample(registry, "deltasync_store_requests_total", outcome="ok", **labels) == 0
    assert sample(registry, "deltasync_store_requests_total", model="policy", rank="0", operation="list",
                  outcome="ok") == 1


def test_a_restarted_worker_is_counted_from_zero(registry: CollectorRegistry) -> None:
    m = metrics.SyncMetrics(registry=registry)
    old = metrics.WorkerStats()
    old.add_download("delta", 500, 0.1)
    m.update([status(0, 1, 1, old)])
    new = metrics.WorkerStats()  # new epoch, smaller totals, event numbers start again
    new.add_download("delta", 100, 0.1)
    m.update([status(0, 1, 1, new)])
    assert sample(registry, "deltasync_downloaded_bytes_total", model="policy", rank="0", kind="delta") == 600
    assert sample(registry, "deltasync_download_duration_seconds_count", model="policy", rank="0") == 2


def test_failures_and_last_error(registry: CollectorRegistry) -> None:
    m = metrics.SyncMetrics(registry=registry)
    stats = metrics.WorkerStats()
    stats.add_failure("verify", ChainError("step 3: base 2 missing"))
    err = "ChainError: step 3: base 2 missing"
    m.update([status(0, 1, 3, stats, last_error=err)], now=10.0)
    m.update([status(0, 1, 3, stats, last_error=err)], now=20.0)  # same error: time kept
    assert sample(registry, "deltasync_failures_total", model="policy", rank="0", stage="verify",
                  reason="ChainError") == 1
    assert sample(registry, "deltasync_failing", model="policy", rank="0") == 1
    assert sample(registry, "deltasync_last_failure_timestamp_seconds", model="policy", rank="0",
                  reason="ChainError") == 10.0
    m.update([status(0, 3, 3, stats)], now=30.0)
    assert sample(registry, "deltasync_failing", model="policy", rank="0") == 0


def test_switch_and_bucket_info_without_credentials(registry: CollectorRegistry) -> None:
    m = metrics.SyncMetrics(registry=registry, format_version=1,
                            bucket_url="s3://AKIA:secret@bucket.example:9000/run?token=x")
    m.observe_switch(4, 0.004, now=55.0)
    assert sample(registry, "deltasync_switches_total") == 1
    assert sample(registry, "deltasync_pause_duration_seconds_count") == 1
    assert sample(registry, "deltasync_last_switch_timestamp_seconds") == 55.0
    [info] = [s for f in registry.collect() if f.name == "deltasync_bucket_info" for s in f.samples]
    assert info.labels == {"url": "s3://bucket.example:9000/run", "format_version": "1"}
    assert "secret" not in repr(list(registry.collect()))


def test_bad_input_is_a_clear_error(registry: CollectorRegistry) -> None:
    m = metrics.SyncMetrics(registry=registry)
    with pytest.raises(MessageError, match="deltasync_status: expected a dict, got NoneType"):
        parse_statuses([None])
    with pytest.raises(MessageError, match="missing keys \\['model'"):
        parse_statuses([{"rank": 0}])
    with pytest.raises(ConfigError, match="failure stage 'upload'"):
        metrics.WorkerStats().add_failure("upload", "boom")
    with pytest.raises(ConfigError, match="step kind 'full'"):
        metrics.WorkerStats().add_download("full", 1, 1.0)
    with pytest.raises(ConfigError, match="out of range"):
        MetricsServer(m, port=70000)


def test_two_instances_never_collide() -> None:
    first, second = metrics.SyncMetrics(), metrics.SyncMetrics()
    assert first.registry is not second.registry


def test_server_serves_metrics_and_readiness(registry: CollectorRegistry) -> None:
    m = metrics.SyncMetrics(registry=registry)
    assert m.start_server(0) is None  # 0 = off
    server = MetricsServer(m, port=0, addr="127.0.0.1")
    try:
        base = f"http://127.0.0.1:{server.port}"
        code, body = http_get(f"{base}/synced")
        assert code == 503 and json.loads(body)["ranks"] == []  # nothing gathered yet
        stats = metrics.WorkerStats()
        m.update([status(0, 5, 7, stats), status(1, 5, 7, stats)])
        code, body = http_get(f"{base}/synced?max_steps_behind=2")
        assert code == 200 and json.loads(body)["synced"] is True
        code, body = http_get(f"{base}/synced?max_steps_behind=1")
        assert code == 503 and json.loads(body)["ranks"][1]["steps_behind"] == 2
        assert http_get(f"{base}/synced?max_steps_behind=x")[0] == 400
        code, body = http_get(f"{base}/metrics")
        values = parse_exposition(body.decode())
        assert values[("deltasync_steps_behind", (("model", "policy"), ("rank", "1")))] == 2
        with pytest.raises(ConfigError, match="choose another metrics_port"):
            MetricsServer(m, port=server.port, addr="127.0.0.1")
    finally:
        server.close()


def test_the_drafter_has_its_own_series(registry: CollectorRegistry) -> None:
    """A rank's status carries its drafter's (``drafter_url``): the same series, ``model``
    label ``drafter``; a drafter refused at start is failing; /synced shows it, never 503s."""
    m = metrics.SyncMetrics(registry=registry)
    p, d = metrics.WorkerStats(), metrics.WorkerStats()
    d.add_download("delta", 300, 0.05)
    d.add_failure("verify", "IntegrityError: x")
    m.update([status(0, 4, 4, p, drafter=status(0, 2, 4, d, last_error="IntegrityError: x")),
              status(1, 4, 4, p, drafter={"refused": "no draft"})])
    assert sample(registry, "deltasync_applied_step", model="policy", rank="0") == 4
    assert sample(registry, "deltasync_applied_step", model="drafter", rank="0") == 2
    assert sample(registry, "deltasync_steps_behind", model="drafter", rank="0") == 2
    assert sample(registry, "deltasync_failing", model="policy", rank="0") == 0
    assert sample(registry, "deltasync_failing", model="drafter", rank="0") == 1
    assert sample(registry, "deltasync_failing", model="drafter", rank="1") == 1  # refused
    assert sample(registry, "deltasync_downloaded_bytes_total", model="drafter", rank="0",
                  kind="delta") == 300
    assert sample(registry, "deltasync_downloaded_bytes_total", model="policy", rank="0",
                  kind="delta") == 0  # the policy downloaded nothing
    assert sample(registry, "deltasync_failures_total", model="drafter", rank="0",
                  stage="verify", reason="IntegrityError") == 1
    ok, body = m.synced()
    assert ok and body["drafter_synced"] is False
    assert [r["rank"] for r in body["drafter"]] == [0, 1]
    assert body["drafter"][1]["refused"] == "no draft"
