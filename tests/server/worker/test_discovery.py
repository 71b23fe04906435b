"""StepWatcher: new steps are seen through the events feed, by probing, and by listing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from vllm_deltasync.format.layout import manifest_path, parse_manifest_path
from vllm_deltasync.server.worker.discovery import QuotaPacer, StepWatcher
from vllm_deltasync.stores import open_store


def test_manifest_names() -> None:
    assert manifest_path(42) == "manifests/000000000042.json"
    assert parse_manifest_path("manifests/000000000042.json") == 42
    assert parse_manifest_path("data/000000000042-abc/00000.safetensors") is None


async def _publish_later(store: Any, step: int, delay_s: float) -> float:
    await asyncio.sleep(delay_s)
    await store.write(manifest_path(step), b"{}")
    return time.monotonic()


async def _until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_events_feed_sees_a_new_step(hub: Any, hf_store: Any, run: Any) -> None:
    async def scenario() -> tuple[int | None, int | None, float, StepWatcher]:
        await hf_store.write(manifest_path(1), b"{}")
        watcher = StepWatcher(hf_store, probe_interval_s=60.0, listing_interval_s=600.0)
        first = await watcher.wait_for_new(None, timeout_s=5.0)
        await _until(lambda: watcher.stats.mode == "events")
        publish = asyncio.create_task(_publish_later(hf_store, 2, 0.2))
        second = await watcher.wait_for_new(1, timeout_s=10.0)
        lag = time.monotonic() - await publish
        await watcher.close()
        return first, second, lag, watcher

    first, second, lag, watcher = run(scenario())
    assert (first, second) == (1, 2)
    assert lag < 2.0  # the probe interval is 60 s: only the feed can explain this
    assert watcher.stats.events_received >= 1 and watcher.stats.events_connects == 1
    assert watcher.stats.probes == 0 and watcher.stats.listings == 1


def test_polling_sees_a_new_step_when_the_feed_is_unavailable(
    hub: Any, hf_store: Any, run: Any
) -> None:
    hub.faults.events_enabled = False

    async def scenario() -> tuple[int | None, int | None, StepWatcher]:
        await hf_store.write(manifest_path(7), b"{}")
        watcher = StepWatcher(hf_store, probe_interval_s=0.1, listing_interval_s=600.0)
        first = await watcher.wait_for_new(None, timeout_s=5.0)
        publish = asyncio.create_task(_publish_later(hf_store, 8, 0.3))
        second = await watcher.wait_for_new(7, timeout_s=5.0)
        await publish
        await watcher.close()
        return first, second, watcher

    first, second, watcher = run(scenario())
    assert (first, second) == (7, 8)
    assert watcher.stats.mode == "polling" and watcher.stats.events_unavailable == 1
    assert watcher.stats.probe_hits == 1 and watcher.stats.listings == 1
    probes = [r for r in hub.requests("resolve") if r["path"].endswith(manifest_path(8))]
    # every probe but the last (of step 9, a miss) asked for step 8; + the write's own check
    assert len(probes) == watcher.stats.probes
    assert [r for r in hub.requests("resolve") if r["path"].endswith(manifest_path(9))]


def test_probing_follows_the_publish_stride_and_catches_up(tmp_path: Any, run: Any) -> None:
    store = open_store(f"memory://stride-{tmp_path.name}")

    async def scenario() -> tuple[list[int | None], StepWatcher]:
        for step in (10, 20):
            await store.write(manifest_path(step), b"{}")
        watcher = StepWatcher(store, probe_interval_s=0.05, listing_interval_s=600.0)
        seen = [await watcher.wait_for_new(None, 2.0)]
        publish = asyncio.create_task(_publish_later(store, 30, 0.2))
        seen.append(await watcher.wait_for_new(20, 5.0))
        await publish
        for step in (40, 50):
            await store.write(manifest_path(step), b"{}")
        seen.append(await watcher.wait_for_new(30, 5.0))
        seen.append(await watcher.wait_for_new(50, 0.3))
        return seen, watcher

    seen, watcher = run(scenario())
    assert seen == [20, 30, 50, None]
    assert watcher.stride == 10 and watcher.stats.listings == 1
    assert watcher.stats.probe_hits == 3


def test_empty_bucket_times_out(tmp_path: Any, run: Any) -> None:
    store = open_store(f"file://{tmp_path}/empty")
    watcher = StepWatcher(store, probe_interval_s=0.05, empty_listing_interval_s=0.1)
    started = time.monotonic()
    assert run(watcher.wait_for_new(None, 0.5)) is None
    assert 0.45 < time.monotonic() - started < 2.0
    assert watcher.stats.listings >= 3


def test_probing_slows_down_to_fit_a_shared_quota(hub: Any, hf_store: Any, run: Any) -> None:
    """A probe every 10 ms would spend a 40-per-3 s quota in 0.4 s; paced, it never hits 429."""
    run(hf_store.write(manifest_path(1), b"{}"))

    def probe_for_two_seconds(pace: bool) -> tuple[StepWatcher, list[int]]:
        hub.set_quota("resolve", limit=40, window_s=3.0)
        hub.log.clear()
        watcher = StepWatcher(hf_store, probe_interval_s=0.01, use_events=False, pace_to_quota=pace)
        assert run(watcher.wait_for_new(1, 2.0)) is None
        return watcher, [r["status"] for r in hub.requests("resolve")]

    paced, statuses = probe_for_two_seconds(True)
    assert 429 not in statuses and 5 <= len(statuses) <= 40
    assert paced.stats.pace_factor > 5
    unpaced, statuses = probe_for_two_seconds(False)
    assert 429 in statuses and unpaced.stats.pace_factor == 1.0


def _fleet_requests(
    limit: int, window_s: float, interval_s: float, replicas: int, pace: bool
) -> int:
    """Requests a fleet probing on one shared quota sends in one window (event simulation)."""
    pacers = [QuotaPacer() for _ in range(replicas)]
    next_at = [i * interval_s / replicas for i in range(replicas)]
    used = 0
    while (now := min(next_at)) < window_s:
        i = next_at.index(now)
        used += 1
        factor = pacers[i].update(max(0, limit - used), window_s - now, now) if pace else 1.0
        next_at[i] = now + min(interval_s * factor, max(interval_s, window_s - now))
    return used


@pytest.mark.parametrize("interval_s", [0.5, 1.0, 2.0])
def test_pacer_keeps_32_replicas_inside_the_free_tier(interval_s: float) -> None:
    unpaced = _fleet_requests(5000, 300.0, interval_s, 32, pace=False)
    paced = _fleet_requests(5000, 300.0, interval_s, 32, pace=True)
    assert paced <= 5000  # no 429 for anyone (unpaced at 1 s: 9600)
    assert paced < unpaced


def test_a_listing_slower_than_the_poll_interval_still_ends(
    hub: Any, hf_store: Any, run: Any
) -> None:
    """Each ``wait_for_new`` call lasts one poll interval. A listing that takes longer (a slow
    link, a long prefix) used to be cancelled at every deadline and started over, so discovery
    never saw a step; now the next calls await the same listing until it ends."""
    hub.faults.events_enabled = False

    async def scenario() -> tuple[list[int | None], StepWatcher]:
        await hf_store.write(manifest_path(7), b"{}")
        hub.faults.api_delay_s = 0.6
        watcher = StepWatcher(hf_store, probe_interval_s=0.1, listing_interval_s=600.0)
        seen: list[int | None] = []
        while len(seen) < 15 and (not seen or seen[-1] is None):
            seen.append(await watcher.wait_for_new(None, timeout_s=0.2))
        await watcher.close()
        return seen, watcher

    seen, watcher = run(scenario())
    assert seen[-1] == 7 and seen[0] is None, seen  # calls ended before the listing did
    assert watcher.stats.listings == 1  # one listing, awaited across calls, never restarted
